"""Files that other processes read while this one writes them: atomic safetensors writes, the
temporary files a killed write leaves behind, and an advisory lock.

A write goes to a temporary file beside its target (``.<name>.<random>.tmp``), is flushed to
disk and renamed over the target, so a reader sees the old file or the new one, never a part.
A process killed between the two leaves the temporary file; ``remove_stale_temporaries``
deletes those of a target where no writer can be active (under its lock, or at start-up).

This module imports neither vLLM nor torch (the safetensors writer is imported when used).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable

LOCK_POLL_S = 1.0  # a lock taken with ``waiting`` is tried again this often


def temp_prefix(path: Path) -> str:
    """The start of the names of ``path``'s temporary files."""
    return f".{path.name}."


def atomic_save_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str],
                            readable: bool = False) -> None:
    """Write ``tensors`` (name -> contiguous CPU tensor) and ``metadata`` to ``path`` as a
    .safetensors file atomically: a temporary file in the same folder, fsync, rename. readable:
    mode 0644 (a cache others read), else the temporary file's own 0600."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        if readable:
            os.chmod(tmp, 0o644)
        with open(tmp, "rb") as f:  # on disk before it replaces the previous file
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete the temporary files that writes of ``path`` (``atomic_save_safetensors``) left
    behind when their process was killed mid-write (``path`` itself is never partial: a write
    renames a complete file over it). Only where no writer of ``path`` is active; returns what
    it deleted."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f"{temp_prefix(path)}*.tmp"):
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed


class FileLock:
    """An advisory lock on ``path`` (``flock``, POSIX), held from ``__enter__`` to ``__exit__``;
    ``held`` says whether it really is (elsewhere nothing is locked: atomic writes keep the
    files sound). Without ``waiting`` it blocks until the lock is free; with it, it tries every
    ``LOCK_POLL_S`` seconds and calls ``waiting()`` between tries, which may raise to give up
    (a child whose parent is gone)."""

    def __init__(self, path: str | Path, waiting: Callable[[], None] | None = None) -> None:
        self.path, self.waiting = Path(path), waiting
        self.file = None
        self.held = False

    def __enter__(self) -> "FileLock":
        try:
            import fcntl
        except ImportError:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")
        try:
            if self.waiting is None:
                fcntl.flock(self.file, fcntl.LOCK_EX)
            else:
                while True:
                    try:
                        fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        self.waiting()
                        time.sleep(LOCK_POLL_S)
        except BaseException:
            self.file.close()
            self.file = None
            raise
        self.held = True
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()  # releases the lock
            self.file = None
        self.held = False
