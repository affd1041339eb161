"""The adjacency matrix: for every token, the k most likely next tokens seen after it recently.

Storage is one int32 table ``[slots * V, k]`` on any device; a request's row for token t is
``row_base + t``. Scope ``shared`` has one slot used by every request and never reset (the paper's
hot start); scope ``per_request`` gives each live request its own slot from a fixed pool, reset
when the slot is handed out and returned when the request ends.

Initial content: every entry is token 0. A draft is only a guess, so any initial value is
lossless; 0 is a valid id for every vocabulary, costs nothing to write, and matches the paper's
reference code (``torch.zeros``). Rows are overwritten the first time their token is verified, so
the zeros only cost the first steps of a cold matrix a few rejected draft nodes. A snapshot
replaces the zeros with a warm matrix saved earlier.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from vllm_recycling.kernels.topk_update import topk_update

SCOPES = ("shared", "per_request")
SNAPSHOT_FORMAT = "vllm-recycling-adjacency"
SNAPSHOT_VERSION = "1"
SNAPSHOT_KEY = "adjacency"


class SnapshotError(ValueError):
    """A snapshot that cannot be used: missing, unreadable, corrupt, or for another model."""


class MatrixPoolExhausted(RuntimeError):
    """No free per-request slot."""


class AdjacencyMatrix:
    """``table [slots * vocab_size, topk]`` int32 and the slot bookkeeping of its scope."""

    def __init__(
        self,
        vocab_size: int,
        topk: int = 8,
        scope: str = "shared",
        max_requests: int = 1,
        device: torch.device | str = "cpu",
        initial: torch.Tensor | None = None,
    ) -> None:
        if scope not in SCOPES:
            raise ValueError(f"matrix scope {scope!r}: expected one of {', '.join(SCOPES)}")
        if vocab_size < 1 or not 1 <= topk <= vocab_size:
            raise ValueError(f"need vocab_size >= 1 and 1 <= topk <= vocab_size, got {vocab_size}, {topk}")
        if scope == "per_request" and max_requests < 1:
            raise ValueError(f"per_request scope needs max_requests >= 1, got {max_requests}")
        self.vocab_size = vocab_size
        self.topk = topk
        self.scope = scope
        slots = 1 if scope == "shared" else max_requests
        # The content each slot starts from: zeros, or a snapshot's matrix.
        self.initial = torch.zeros((vocab_size, topk), dtype=torch.int32, device=device)
        if initial is not None:
            self.initial.copy_(_checked(initial, vocab_size, topk, "initial matrix"))
        self.table = self.initial.repeat(slots, 1)
        self._free = list(range(slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    @property
    def device(self) -> torch.device:
        return self.table.device

    # -- slots -----------------------------------------------------------------------------------
    def allocate(self, request_id: str) -> int:
        """Give a request its slot (per_request: a fresh one, reset to the initial matrix)."""
        if self.scope == "shared":
            return 0
        if request_id in self._slot_of:
            return self._slot_of[request_id]
        if not self._free:
            raise MatrixPoolExhausted(
                f"all {len(self._slot_of)} per-request matrices are in use; raise max_requests"
            )
        slot = self._free.pop()
        self.table[slot * self.vocab_size : (slot + 1) * self.vocab_size] = self.initial
        self._slot_of[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Return a finished request's slot to the pool (a no-op for shared scope or unknown ids)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def row_base(self, request_ids: list[str]) -> torch.Tensor | None:
        """[B] int64 first table row of each request's matrix; None for the shared scope."""
        if self.scope == "shared":
            return None
        bases = [self._slot_of[r] * self.vocab_size for r in request_ids]
        return torch.tensor(bases, dtype=torch.int64, device=self.device)

    def view(self, request_id: str | None = None) -> torch.Tensor:
        """The [V, k] matrix of a request (or the shared one)."""
        slot = 0 if self.scope == "shared" else self._slot_of[request_id]
        return self.table[slot * self.vocab_size : (slot + 1) * self.vocab_size]

    # -- update ----------------------------------------------------------------------------------
    def update(
        self, tokens: torch.Tensor, logits: torch.Tensor, row_base: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``adj[token[node]] = top-k(logits[node])`` for every node of every tree.

        tokens [B, M] int (the verified nodes, root included); logits [B*M, V] in the same
        order; row_base [B] or None. Duplicate tokens: the last in (request, breadth-first) order
        wins. Returns the argmax of each logits row, [B*M] int64, for greedy acceptance.
        """
        rows = tokens.long()
        if row_base is not None:
            rows = rows + row_base[:, None]
        return topk_update(logits, rows.reshape(-1), self.table)

    # -- snapshots -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the shared matrix atomically (temp file + rename) as a .safetensors snapshot."""
        if self.scope != "shared":
            raise SnapshotError("snapshots hold the shared matrix; scope is per_request")
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "vocab_size": str(self.vocab_size),
            "topk": str(self.topk),
        }
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file({SNAPSHOT_KEY: self.table.cpu().contiguous()}, tmp, metadata=meta)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def load_snapshot(path: str | Path, vocab_size: int, topk: int) -> torch.Tensor:
    """Read a snapshot's [V, k] int32 matrix, checking format, shape, vocabulary and values."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"matrix snapshot {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != SNAPSHOT_FORMAT or SNAPSHOT_KEY not in f.keys():
                raise SnapshotError(f"matrix snapshot {path}: not a vllm-recycling snapshot")
            if meta.get("version") != SNAPSHOT_VERSION:
                raise SnapshotError(
                    f"matrix snapshot {path}: format version {meta.get('version')!r}, "
                    f"expected {SNAPSHOT_VERSION!r}"
                )
            if meta.get("vocab_size") != str(vocab_size) or meta.get("topk") != str(topk):
                raise SnapshotError(
                    f"matrix snapshot {path}: made for vocab_size={meta.get('vocab_size')}, "
                    f"topk={meta.get('topk')}; this model needs vocab_size={vocab_size}, topk={topk}"
                )
            table = f.get_tensor(SNAPSHOT_KEY)
    except SnapshotError:
        raise
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        raise SnapshotError(f"matrix snapshot {path}: unreadable ({e})") from e
    return _checked(table, vocab_size, topk, f"matrix snapshot {path}")


def _checked(table: torch.Tensor, vocab_size: int, topk: int, what: str) -> torch.Tensor:
    if table.dtype != torch.int32 or tuple(table.shape) != (vocab_size, topk):
        raise SnapshotError(
            f"{what}: {table.dtype} {tuple(table.shape)}, expected torch.int32 {(vocab_size, topk)}"
        )
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= vocab_size):
        raise SnapshotError(f"{what}: token ids outside 0..{vocab_size - 1}")
    return table
