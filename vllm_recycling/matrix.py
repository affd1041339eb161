"""The adjacency matrix: for every token, the k most likely next tokens seen after it recently.

Storage is one int32 table ``[rows, k]`` on any device. The scope says whose rows a request
reads and writes:

- ``shared``: one ``[V, k]`` matrix used by every request and never reset (the paper's hot
  start). Requests running together overwrite each other's rows.
- ``per_request``: each live request gets its own ``[V, k]`` matrix from a fixed pool (row
  ``slot * V + t``), reset when handed out and returned when the request ends. No interference,
  but every request starts cold and forgets what the others taught.
- ``overlay``: the shared matrix, plus for each live request a small direct-mapped cache of the
  rows it has verified itself: ``overlay_rows`` entries (a power of two), entry ``t % R`` holding
  token t's successors when its key says t. A request reads its own entry where the key matches
  and the shared row otherwise; verification writes both. Memory per request is
  ``overlay_rows * (k + 1) * 4`` bytes whatever the vocabulary (144 KiB at 4096 rows, k = 8).
  Table layout: ``[V + slots * R + 1, k]``: shared rows, then each slot's R entries, then one
  scratch row that absorbs the writes a later row of the same step overrides.
- ``salt``: tenant isolation, keyed by vLLM's per-request ``cache_salt`` (the key that already
  isolates prefix caching). As overlay, but a request with a salt reads and writes its salt's
  own ``[V, k]`` matrix instead of the shared one: requests with the same salt share what they
  learn, requests with different salts never read each other's entries, and requests without
  a salt use the shared matrix. ``salt_matrices`` matrices exist (layout ``[V * (1 + S) +
  slots * R + 1, k]``); a new salt takes an unused one or evicts the least recently used salt
  that no live request holds, and its matrix starts from the model's prior, or zeros without
  one (a salted tenant never reads what the shared matrix or a snapshot learned from others). While every salt matrix is held
  by live requests, a request of yet another salt drafts nothing (plain decoding, still
  exact), its rows are written to the scratch row, and it gets a matrix as soon as one is free.

Initial content: the model's prior (``prior``: its own top-k after each vocabulary token) where
one is given (``matrix_init: "model"``, the default, once it is computed: ``take_prior`` fills
rows then), else every entry token 0, as in the paper's reference code (``torch.zeros``). A draft
is only a guess, so any initial value is lossless; 0 is a valid id for every vocabulary and
costs nothing to write. Rows are overwritten the first time their token is verified. A
snapshot replaces the initial content of the shared matrix with a warm one saved earlier
(shared and overlay scopes: the shared part).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

# remove_stale_temporaries: what start-up calls on the snapshot's folder (slots.MatrixSlots)
from vllm_recycling.files import atomic_save_safetensors, remove_stale_temporaries  # noqa: F401
from vllm_recycling.kernels import native
from vllm_recycling.kernels.draft_tree import Overlay, draft_tree
from vllm_recycling.kernels.topk_update import topk_update
from vllm_recycling.transfer import to_device


class Scope(enum.StrEnum):
    """Whose rows a request reads and writes (the module's docstring); its value is the
    config's ``matrix_scope``."""

    SHARED = "shared"
    PER_REQUEST = "per_request"
    OVERLAY = "overlay"
    SALT = "salt"

    @property
    def has_overlay(self) -> bool:
        """Whether each live request keeps rows of its own in front of a shared matrix."""
        return self in (Scope.OVERLAY, Scope.SALT)


SCOPES = tuple(scope.value for scope in Scope)  # the config's spellings
DEFAULT_SALT_MATRICES = 16
# Where the engine core records a request's cache_salt for the workers (SamplingParams.extra_args).
CACHE_SALT_KEY = "vllm_recycling.cache_salt"
NO_MATRIX = -1  # salt scope: a request whose salt has no matrix yet (drafts nothing)
DEFAULT_OVERLAY_ROWS = 4096
SNAPSHOT_FORMAT = "vllm-recycling-adjacency"
# Version 2 holds the rows' confidences (``probs``) beside the table when the saving engine had
# them (budget "auto"); version 1 holds the table only and still loads.
SNAPSHOT_VERSION = "2"
SNAPSHOT_VERSIONS = ("1", "2")
SNAPSHOT_KEY = "adjacency"
SNAPSHOT_PROBS_KEY = "probs"


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
        scope: Scope | str = Scope.SHARED,
        max_requests: int = 1,
        device: torch.device | str = "cpu",
        initial: torch.Tensor | None = None,
        overlay_rows: int = DEFAULT_OVERLAY_ROWS,
        with_probs: bool = False,
        salt_matrices: int = DEFAULT_SALT_MATRICES,
        prior: tuple[torch.Tensor, torch.Tensor] | None = None,
        initial_probs: torch.Tensor | None = None,
    ) -> None:
        """initial: the shared matrix's content (a snapshot), initial_probs its rows'
        confidences when the snapshot holds them (``load_snapshot``); prior: (table [V, k]
        int32, probs [V, k] float16) every other new matrix starts from (``prior.py``), and the
        shared one too: wholly without ``initial``,
        else in the snapshot's rows that nothing wrote (a snapshot saved before the prior was
        there); without either, every entry is token 0."""
        if scope not in SCOPES:
            raise ValueError(f"matrix scope {scope!r}: expected one of {', '.join(SCOPES)}")
        scope = Scope(scope)
        if vocab_size < 1 or not 1 <= topk <= vocab_size:
            raise ValueError(f"need vocab_size >= 1 and 1 <= topk <= vocab_size, got {vocab_size}, {topk}")
        if scope != Scope.SHARED and max_requests < 1:
            raise ValueError(f"{scope} scope needs max_requests >= 1, got {max_requests}")
        if scope.has_overlay and (overlay_rows < 1 or overlay_rows & (overlay_rows - 1)):
            raise ValueError(f"overlay_rows must be a power of two, got {overlay_rows}")
        if scope == Scope.SALT and salt_matrices < 1:
            raise ValueError(f"salt scope needs salt_matrices >= 1, got {salt_matrices}")
        self.vocab_size = vocab_size
        self.topk = topk
        self.scope = scope
        slots = 1 if scope == Scope.SHARED else max_requests
        # What a new matrix starts from (a per-request one, a salt's): the prior, or zeros.
        self.fresh = torch.zeros((vocab_size, topk), dtype=torch.int32, device=device)
        self.fresh_probs = torch.zeros((vocab_size, topk), dtype=torch.float16, device=device)
        if prior is not None:  # its probabilities negated: the budget tells its rows apart
            table, probs = prior[0], prior[1]
            self.fresh.copy_(_checked(table, vocab_size, topk, "prior"))
            self.fresh_probs.copy_(-probs.to(torch.float16).abs())
        # The shared matrix's start: the snapshot, its unwritten rows the prior's; else fresh.
        initial_table = self.fresh.clone()
        start_probs = self.fresh_probs
        if initial is not None:
            initial_table.copy_(_checked(initial, vocab_size, topk, "initial matrix"))
            start_probs = snapshot_confidences(initial_table, initial_probs, self.fresh, self.fresh_probs)
            if prior is not None:
                unwritten = (initial_table == 0).all(-1, keepdim=True)
                initial_table = torch.where(unwritten, self.fresh, initial_table)
                start_probs = torch.where(unwritten, self.fresh_probs, start_probs)
        self.overlay_rows = overlay_rows if scope.has_overlay else 0
        self.salt_matrices = salt_matrices if scope == Scope.SALT else 0
        self.keys: torch.Tensor | None = None  # overlay, salt: [slots * R + 1] int32, -1 = empty
        if scope.has_overlay:
            salts = self.fresh.repeat(self.salt_matrices, 1)
            extra = torch.zeros((slots * overlay_rows + 1, topk), dtype=torch.int32, device=device)
            self.table = torch.cat([initial_table, salts, extra])
            self.keys = torch.full((slots * overlay_rows + 1,), -1, dtype=torch.int32, device=device)
            # update(): the last row of a step writing each entry, -1 between steps (only the
            # entries a step wrote are reset: no [slots * R] buffer filled per step)
            self._last_writer = torch.full(self.keys.shape, -1, dtype=torch.int64, device=device)
        else:
            self.table = initial_table.repeat(slots, 1)
        # The successors' probabilities under the logits that wrote them (the adaptive budget's
        # edge confidence): [rows, k] float16 beside ``table``; 0 for rows nothing wrote, the
        # prior's probabilities negated for rows it filled (calibrated apart, budget.Calibration).
        self.probs: torch.Tensor | None = None
        if with_probs:
            self.probs = torch.zeros(self.table.shape, dtype=torch.float16, device=device)
            matrices = 1 + self.salt_matrices if scope.has_overlay else slots
            self.probs[: vocab_size] = start_probs
            self.probs[vocab_size : matrices * vocab_size] = self.fresh_probs.repeat(matrices - 1, 1)
        self._free = list(range(slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        # salt scope: salt -> its matrix (1..S), least recently used first; live requests per
        # matrix; each request's salt and matrix (0: the shared one, NO_MATRIX: none free yet).
        self._salt_matrix: OrderedDict[str, int] = OrderedDict()
        self._salt_users = [0] * (self.salt_matrices + 1)
        self._request_salt: dict[str, str | None] = {}
        self._matrix_of: dict[str, int] = {}

    @property
    def device(self) -> torch.device:
        return self.table.device

    # -- slots -----------------------------------------------------------------------------------
    def allocate(self, request_id: str, salt: str | None = None) -> int:
        """Give a request its slot (per_request: a fresh one, reset to the prior or zeros;
        salt scope: also its salt's matrix, see ``matrix_of``)."""
        if self.scope == Scope.SHARED:
            return 0
        if request_id in self._slot_of:
            if self._matrix_of.get(request_id) == NO_MATRIX:
                self._take_salt_matrix(request_id, self._request_salt[request_id])  # retry
            return self._slot_of[request_id]
        if not self._free:
            raise MatrixPoolExhausted(
                f"all {len(self._slot_of)} per-request matrices are in use; raise max_requests"
            )
        slot = self._free.pop()
        self.clear_slot(slot)
        self._slot_of[request_id] = slot
        if self.scope == Scope.SALT:
            self._request_salt[request_id] = salt
            self._take_salt_matrix(request_id, salt)
        return slot

    def clear_slot(self, slot: int) -> None:
        """Slot ``slot`` as a new request finds it: overlay and salt scopes, its own rows empty
        (every key misses); per_request, its matrix reset to the prior or zeros. Device writes
        only (no host sync): Model Runner V2 calls it as a request takes a request-state slot."""
        if self.keys is not None:
            self.keys[slot * self.overlay_rows : (slot + 1) * self.overlay_rows] = -1
        elif self.scope != Scope.SHARED:
            self._reset(slot)

    def _take_salt_matrix(self, request_id: str, salt: str | None) -> None:
        """salt scope: the matrix of the request's salt: the shared one without a salt, the
        salt's own when it has one, else an unused one or the least recently used one no live
        request holds (reset to the prior or zeros: what the evicted salt taught is gone), else
        NO_MATRIX for now."""
        if salt is None:
            index = 0
        elif salt in self._salt_matrix:
            index = self._salt_matrix[salt]
            self._salt_matrix.move_to_end(salt)
        else:
            index = NO_MATRIX
            if len(self._salt_matrix) < self.salt_matrices:
                index = len(self._salt_matrix) + 1
            else:
                idle = next((s for s, i in self._salt_matrix.items() if not self._salt_users[i]), None)
                if idle is not None:
                    index = self._salt_matrix.pop(idle)
                    self._reset(index)
            if index != NO_MATRIX:
                self._salt_matrix[salt] = index
        if index != NO_MATRIX:
            self._salt_users[index] += 1
        self._matrix_of[request_id] = index

    def _reset(self, index: int) -> None:
        """Matrix ``index`` (a per-request slot, a salt's matrix) back to what a new one holds."""
        rows = slice(index * self.vocab_size, (index + 1) * self.vocab_size)
        self.table[rows] = self.fresh
        if self.probs is not None:
            self.probs[rows] = self.fresh_probs

    def take_prior(self, prior, start: int = 0) -> int:
        """Take rows [start, prior.rows) of the model's prior (a ``prior.Prior``: the leading
        rows computed so far) in while serving: every matrix created from now on starts from
        them, and each existing matrix's rows among them that nothing wrote yet take them (an
        unwritten row is all token 0, which a written one never is: its k successors are
        distinct). Rows that traffic or a snapshot wrote keep theirs. Matrix by matrix, a slice
        of rows at a time: no copy of a whole matrix. Returns how many rows it filled."""
        table = _checked(prior.table, self.vocab_size, self.topk, "prior")
        rows = slice(start, prior.rows)
        self.fresh[rows] = table[rows].to(self.fresh.device)
        self.fresh_probs[rows] = -prior.probs[rows].to(self.fresh_probs.device, torch.float16).abs()
        count = self.table.shape[0] // self.vocab_size if self.keys is None else 1 + self.salt_matrices
        filled = 0
        for index in range(count):
            part = slice(index * self.vocab_size + start, index * self.vocab_size + prior.rows)
            unwritten = (self.table[part] == 0).all(-1, keepdim=True)
            self.table[part] = torch.where(unwritten, self.fresh[rows], self.table[part])
            if self.probs is not None:
                self.probs[part] = torch.where(unwritten, self.fresh_probs[rows], self.probs[part])
            filled += int(unwritten.sum())
        return filled

    def matrix_of(self, request_id: str) -> int:
        """salt scope: the index of the matrix a request reads and writes (0: the shared one,
        1..salt_matrices: a salt's, NO_MATRIX: its salt has none yet, it drafts nothing);
        0 for the other scopes."""
        return self._matrix_of.get(request_id, 0)

    def free(self, request_id: str) -> None:
        """Return a finished request's slot to the pool (a no-op for shared scope or unknown ids)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        index = self._matrix_of.pop(request_id, NO_MATRIX)
        self._request_salt.pop(request_id, None)
        if index != NO_MATRIX:
            self._salt_users[index] -= 1

    def slots(self, request_ids: list[str]) -> torch.Tensor | None:
        """[B] int64 slot of each request (allocated), on the table's device; salt scope:
        [B, 2], the slot and ``matrix_of``; None for the shared scope. What ``draft`` and
        ``update`` take."""
        if self.scope == Scope.SHARED:
            return None
        if self.scope == Scope.SALT:
            pairs = [(self._slot_of[r], self._matrix_of[r]) for r in request_ids]
            return to_device(np.array(pairs, dtype=np.int64).reshape(-1, 2), torch.int64, self.device)
        slots = np.array([self._slot_of[r] for r in request_ids], dtype=np.int64)
        return to_device(slots, torch.int64, self.device)

    def lookup(self, slots: torch.Tensor | None):
        """What the draft kernels take for requests in ``slots`` [B] (None: shared):
        ``(row_base, overlay)``, each None when not used by the scope. row_base [B] int64;
        overlay a ``kernels.draft_tree.Overlay``: a request's entry for token t is
        ``key_base + (t & (R - 1))``, read at table row ``offset + entry`` when ``keys[entry] == t``.
        """
        if slots is None or self.scope == Scope.SHARED:
            return None, None
        if self.scope == Scope.PER_REQUEST:
            return slots * self.vocab_size, None
        offset = (1 + self.salt_matrices) * self.vocab_size
        if self.scope == Scope.SALT:
            return slots[:, 1] * self.vocab_size, Overlay(
                self.keys, slots[:, 0] * self.overlay_rows, offset, self.overlay_rows
            )
        return None, Overlay(self.keys, slots * self.overlay_rows, offset, self.overlay_rows)

    def draft(
        self, roots: torch.Tensor, tree, slots: torch.Tensor | None = None, with_probs: bool = False,
    ):
        """The draft trees of requests with roots [B] and ``slots`` [B]: tokens [B, N+1] int32,
        node i is ``table[row(parent), rank[i]]`` (``kernels.draft_tree``, one launch); with
        with_probs ``(tokens, conf)``, conf each node's confidence [B, N+1] float32."""
        row_base, overlay = self.lookup(slots)
        probs = self.probs if with_probs else None
        return draft_tree(self.table, roots, tree, row_base, overlay=overlay, probs=probs)

    # -- update ----------------------------------------------------------------------------------
    def update(
        self, tokens: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``adj[token[node]] = top-k(logits[node])`` for every node of every tree.

        tokens [B, M] int (the verified nodes, root included); logits [B*M, V] in the same
        order; slots [B] int64 (``slots()``) or None. Duplicate rows: the last in (request,
        breadth-first) order wins. Overlay scope: the shared row and the request's own entry
        are both written from one top-k. Returns the argmax of each logits row, [B*M] int64,
        for greedy acceptance.
        """
        tokens = tokens.long()
        row_base, overlay = self.lookup(slots)
        rows = tokens if row_base is None else tokens + row_base[:, None]
        if self.scope == Scope.SALT:  # requests without a matrix write to the scratch row
            rows = torch.where(row_base[:, None] < 0, self.table.shape[0] - 1, rows)
        if overlay is None:
            return topk_update(logits, rows.reshape(-1), self.table, probs=self.probs)
        keys, offset = overlay.keys, overlay.offset
        entry = overlay.entries(tokens).reshape(-1)
        if native.takes(logits, self.table, self.probs):
            # one C call: shared row and own entry of every node, and the entries' keys, written
            # in node order (the last writer wins without the scratch row)
            dest = torch.stack([rows.reshape(-1), offset + entry], dim=1)
            return native.update(
                logits, dest, self.table, probs=self.probs, keys=keys, key_index=entry,
                key_value=tokens.reshape(-1),
            )
        top = torch.empty((logits.shape[0], self.topk), dtype=torch.int32, device=self.device)
        top_probs = None
        if self.probs is not None:
            top_probs = torch.empty(top.shape, dtype=torch.float16, device=self.device)
        argmax = topk_update(
            logits, rows.reshape(-1), self.table, topk_out=top, probs=self.probs, probs_out=top_probs
        )
        # last writer per entry wins; the overridden writes go to the scratch row (no host sync)
        order = torch.arange(entry.shape[0], device=self.device)
        last = self._last_writer.scatter_reduce_(0, entry, order, "amax")
        wins = last[entry] == order
        last.index_fill_(0, entry, -1)  # not last[entry] = -1: a scalar index_put_ waits for the GPU
        entry = torch.where(wins, entry, keys.shape[0] - 1)
        self.table[offset + entry] = top
        if top_probs is not None:
            self.probs[offset + entry] = top_probs
        keys[entry] = tokens.reshape(-1).to(keys.dtype)
        keys[-1:].fill_(-1)  # the scratch entry never matches (keys[-1] = -1 would wait for the GPU)
        return argmax

    # -- snapshots -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the shared matrix atomically (temp file + rename) as a .safetensors snapshot,
        with its rows' confidences when it has them (salt scope: the salts' matrices are not
        saved)."""
        if self.scope == Scope.PER_REQUEST:
            raise SnapshotError("snapshots hold the shared matrix; scope is per_request")
        meta = {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "vocab_size": str(self.vocab_size),
            "topk": str(self.topk),
        }
        tensors = {SNAPSHOT_KEY: self.table[: self.vocab_size].cpu().contiguous()}
        if self.probs is not None:
            tensors[SNAPSHOT_PROBS_KEY] = self.probs[: self.vocab_size].cpu().contiguous()
        atomic_save_safetensors(path, tensors, meta)


def load_snapshot(path: str | Path, vocab_size: int, topk: int, with_probs: bool = False):
    """Read a snapshot's [V, k] int32 matrix, checking format, shape, vocabulary and values;
    with_probs: ``(table, probs)``, probs its rows' [V, k] float16 confidences, None when the
    snapshot holds none (version 1, or saved without the auto budget)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"matrix snapshot {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != SNAPSHOT_FORMAT or SNAPSHOT_KEY not in f.keys():
                raise SnapshotError(f"matrix snapshot {path}: not a vllm-recycling snapshot")
            if meta.get("version") not in SNAPSHOT_VERSIONS:
                raise SnapshotError(
                    f"matrix snapshot {path}: format version {meta.get('version')!r}, "
                    f"expected one of {', '.join(map(repr, SNAPSHOT_VERSIONS))}"
                )
            if meta.get("vocab_size") != str(vocab_size) or meta.get("topk") != str(topk):
                raise SnapshotError(
                    f"matrix snapshot {path}: made for vocab_size={meta.get('vocab_size')}, "
                    f"topk={meta.get('topk')}; this model needs vocab_size={vocab_size}, topk={topk}"
                )
            table = f.get_tensor(SNAPSHOT_KEY)
            probs = None
            if with_probs and meta["version"] != "1" and SNAPSHOT_PROBS_KEY in f.keys():
                probs = f.get_tensor(SNAPSHOT_PROBS_KEY)
    except SnapshotError:
        raise
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        raise SnapshotError(f"matrix snapshot {path}: unreadable ({e})") from e
    table = _checked(table, vocab_size, topk, f"matrix snapshot {path}")
    if not with_probs:
        return table
    if probs is not None and (
        probs.dtype != torch.float16 or probs.shape != table.shape
        or not bool((probs.abs() <= 1.0).all())  # NaN fails too
    ):
        raise SnapshotError(
            f"matrix snapshot {path}: confidences {probs.dtype} {tuple(probs.shape)}, expected "
            f"torch.float16 {tuple(table.shape)} within [-1, 1]"
        )
    return table, probs


def snapshot_confidences(table: torch.Tensor, probs: torch.Tensor | None, fresh: torch.Tensor,
                         fresh_probs: torch.Tensor) -> torch.Tensor:
    """The confidences [V, k] of a snapshot's rows: the saved ones; for a snapshot without them,
    the prior's (``fresh_probs``, negated) where a row is the prior's row, else 0 (a row
    verification wrote, whose confidences were not saved)."""
    if probs is not None:
        return probs.to(fresh_probs.device, torch.float16)
    same = (table == fresh).all(dim=1, keepdim=True)
    return torch.where(same, fresh_probs, torch.zeros_like(fresh_probs))


def _checked(table: torch.Tensor, vocab_size: int, topk: int, what: str) -> torch.Tensor:
    if table.dtype != torch.int32 or tuple(table.shape) != (vocab_size, topk):
        raise SnapshotError(
            f"{what}: {table.dtype} {tuple(table.shape)}, expected torch.int32 {(vocab_size, topk)}"
        )
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= vocab_size):
        raise SnapshotError(f"{what}: token ids outside 0..{vocab_size - 1}")
    return table
