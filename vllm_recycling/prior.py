"""The initial matrix computed from the model itself (``matrix_init: "model"``), and its cache.

Token Recycling learns its matrix from traffic, so a matrix that starts empty drafts nothing
useful until its rows fill. The prior fills every row before any traffic: for each vocabulary
token t, the model's own top-k next tokens (and their probabilities) after ``CONTEXT_IDS +
[t]``, the token as the first of an assistant turn. It holds no request's data, so every new
matrix may start from it, tenants' included. ``warm.compute_prior`` computes it once per
model through vLLM; it is cached under ``cache_root()/priors``, keyed by the model's identity,
its vocabulary, k and the context (``prior_key``). Files are written atomically; one that is
corrupt, or made for another model, vocabulary or k, is never loaded (``load_prior`` raises,
and the front end computes it again).

The computation goes through the vocabulary in id order, which for BPE and SentencePiece
vocabularies is the tokenizer's merge (or score) order and so follows how common a token was in
its training text: the rows most text uses come first (benchmarks/results/prior_order.md
measures it). It writes the file as it goes, at most every ``warm.PARTIAL_SAVE_S``, with the
number of leading rows done (``Prior.rows``); a partial file is never taken for a finished one,
and a later computation resumes from it. Beside a server, on a machine where the whole
vocabulary would take long, the computation stops on purpose once the rows that pay are done
(``warm.RowPlan``): the file says so (``Prior.stopped``), servers take it as final and start
no computation for the rest, and ``vllm-recycling warm`` computes the rest when asked.

A worker whose prior is not complete yet serves at once with the rows there are and watches the
file (``PriorWatch``); each time more rows are there, the matrix takes them in between two steps
(``AdjacencyMatrix.take_prior``): rows that traffic wrote keep theirs, the others and every
matrix created afterwards start from the prior.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vllm_recycling.cache import cache_root  # prior_path's; tools.models imports it from here too
from vllm_recycling.files import atomic_save_safetensors
from vllm_recycling.ranks import ranks_agree

PRIOR_FORMAT = "vllm-recycling-prior"
PRIOR_VERSION = "2"
# What each token follows when the prior is computed (docs/design.md, "The initial matrix"):
# the opening of an assistant reply in the model's chat template (``warm.context_ids``).
CONTEXT = "chat"
# A worker waiting for its prior looks for the file at most this often (a stat per look).
POLL_S = 1.0
# Tensor-parallel ranks take the prior in at the same step: they compare readiness every this
# many steps (an all-reduce of one number; none once it is in).
POLL_STEPS = 32
# A version of the prior file that failed to load is tried again at most this often.
RETRY_S = 30.0
# The weight files vLLM's default loader reads from a folder, by preference: the first suffix that
# finds any (model_executor/model_loader/default_loader.py:185-233). vLLM 0.32 has no GGUF loader.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class PriorError(ValueError):
    """A prior file that cannot be used: unreadable, corrupt, or for another model; ``partial``:
    a sound file whose computation is not finished (``load_complete_prior``), which a
    computation resumes rather than starts again."""

    def __init__(self, message: str, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


@dataclass(frozen=True)
class Prior:
    """A model's prior: table [V, k] int32 and probs [V, k] float16, of which the first ``rows``
    token ids are computed (the rest all 0: unwritten rows). stopped: the computation ended
    there on purpose (the rest cost more than they buy: ``warm.RowPlan``), so servers take it
    as final."""

    table: torch.Tensor
    probs: torch.Tensor
    rows: int
    stopped: bool = False

    @property
    def complete(self) -> bool:
        return self.rows == self.table.shape[0]

    @property
    def final(self) -> bool:
        """Nothing more will come to a server: every row, or a computation stopped on purpose."""
        return self.complete or self.stopped


def model_identity(model: str, revision: str | None = None) -> dict:
    """What identifies a model's weights: the name (a hub id, or a local directory resolved to
    its absolute path), the revision, and for a local directory its ``config.json`` and the
    names, sizes and modification times of its weight files (a model rebuilt in place gets a
    new prior)."""
    identity: dict = {"model": model, "revision": revision}
    path = Path(model).expanduser()
    if path.is_dir():
        identity["model"] = str(path.resolve())
        config = path / "config.json"
        if config.is_file():
            identity["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
        identity["weights"] = sorted(
            (f.name, f.stat().st_size, int(f.stat().st_mtime))
            for f in path.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES
        )
    return identity


def prior_key(model: str, revision: str | None, vocab_size: int, topk: int) -> str:
    blob = json.dumps(
        {"identity": model_identity(model, revision), "vocab_size": vocab_size, "topk": topk,
         "context": CONTEXT, "version": PRIOR_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def prior_path(model: str, revision: str | None, vocab_size: int, topk: int) -> Path:
    """Where the prior of this model, vocabulary and k is cached."""
    return cache_root() / "priors" / f"{prior_key(model, revision, vocab_size, topk)}.safetensors"


def save_prior(path: Path, table: torch.Tensor, probs: torch.Tensor, model: str, seconds: float,
               rows: int | None = None, stopped: bool = False) -> None:
    """Write the prior atomically (``files.atomic_save_safetensors``), readable by every user;
    rows: the leading token ids computed so far (None: all of them); stopped: the computation
    ended there on purpose (``Prior.stopped``)."""
    rows = table.shape[0] if rows is None else rows
    meta = {
        "format": PRIOR_FORMAT, "version": PRIOR_VERSION, "model": model, "context": CONTEXT,
        "vocab_size": str(table.shape[0]), "topk": str(table.shape[1]),
        "compute_seconds": f"{seconds:.1f}", "rows": str(rows),
    }
    if stopped and rows < table.shape[0]:
        meta["stopped"] = "1"
    tensors = {"table": table.to(torch.int32).contiguous().cpu(),
               "probs": probs.to(torch.float16).contiguous().cpu()}
    atomic_save_safetensors(path, tensors, meta, readable=True)


def read_prior(path: Path) -> Prior:
    """The prior in ``path`` as the file holds it, complete or partial (``Prior.rows``; files
    written before partial saves existed are complete), its vocabulary and k the file's own;
    ``PriorError`` naming what is wrong when the file is unreadable or corrupt."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            table, probs = f.get_tensor("table"), f.get_tensor("probs")
    except (OSError, SafetensorError, KeyError, ValueError) as e:
        raise PriorError(f"prior {path}: unreadable ({e})") from e
    if meta.get("format") != PRIOR_FORMAT or meta.get("version") != PRIOR_VERSION:
        raise PriorError(f"prior {path}: not a version {PRIOR_VERSION} {PRIOR_FORMAT} file")
    if table.dim() != 2 or tuple(probs.shape) != tuple(table.shape):
        raise PriorError(f"prior {path}: shapes {tuple(table.shape)}, {tuple(probs.shape)}")
    if table.dtype != torch.int32 or probs.dtype != torch.float16:
        raise PriorError(f"prior {path}: dtypes {table.dtype}, {probs.dtype}")
    vocab_size = table.shape[0]
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= vocab_size):
        raise PriorError(f"prior {path}: token ids outside the vocabulary")
    if not bool(torch.isfinite(probs).all()) or float(probs.min()) < 0 or float(probs.max()) > 1:
        raise PriorError(f"prior {path}: probabilities outside [0, 1]")
    try:
        rows = int(meta.get("rows", vocab_size))
    except ValueError:
        rows = -1
    if not 0 <= rows <= vocab_size:
        raise PriorError(f"prior {path}: {meta.get('rows')!r} rows computed, of {vocab_size}")
    return Prior(table, probs, rows, stopped=meta.get("stopped") == "1" and rows < vocab_size)


def load_prior(path: Path, vocab_size: int, topk: int) -> Prior:
    """``read_prior``, and ``PriorError`` for a file made for another vocabulary or k."""
    prior = read_prior(path)
    if tuple(prior.table.shape) != (vocab_size, topk):
        raise PriorError(f"prior {path}: shape {tuple(prior.table.shape)}, expected ({vocab_size}, {topk})")
    return prior


def load_complete_prior(path: Path, vocab_size: int, topk: int, stopped_is_final: bool = False) -> Prior:
    """``load_prior``, and ``PriorError`` for a partial one; with stopped_is_final, one whose
    computation stopped on purpose (``Prior.stopped``) is taken as it is."""
    prior = load_prior(path, vocab_size, topk)
    if not (prior.final if stopped_is_final else prior.complete):
        raise PriorError(f"prior {path}: {prior.rows} of {vocab_size} rows computed so far", partial=True)
    return prior


class PriorWatch:
    """A worker's wait for the rest of its model's prior (``matrix_init: "model"``): ``poll``
    once per step returns the prior at a step where the matrix should take more of its rows in,
    else None; ``taken`` says how many leading rows the matrix holds (``took`` records it).

    path: the prior file; taken: the rows taken in at start-up; all_reduce_mean: averages a
    small host array over the tensor-parallel ranks (None in a single process). In a single
    process the file is looked at every ``POLL_S`` seconds; with several ranks every
    ``POLL_STEPS`` steps, and rows are taken in only when every rank has loaded the same ones
    (``ranks_agree``), so that the ranks' matrices (and so the budget's choices) stay the same.
    A version of the file (its modification time and size) that failed to load is tried again
    at most every ``RETRY_S`` seconds (a transient read error, or a file replaced while it was
    read); once the complete file is loaded the file is not looked at again."""

    def __init__(self, path: Path, vocab_size: int, topk: int, taken: int = 0,
                 all_reduce_mean: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.path, self.vocab_size, self.topk = path, vocab_size, topk
        self.all_reduce_mean = all_reduce_mean
        self.taken = taken
        self.loaded: Prior | None = None
        self._seen: tuple[int, int] | None = None  # (mtime, size) of the file last loaded
        self._failed: tuple[int, int] | None = None  # ... of the file last failed to load
        self._retry_at = 0.0  # when the failed one is tried again
        self._steps = 0
        self._next_look = 0.0
        self._final = False  # the rows taken are all there will be (``Prior.final``)

    @property
    def done(self) -> bool:
        return self.taken == self.vocab_size or self._final

    def took(self, prior: Prior) -> None:
        self.taken, self._final = prior.rows, prior.final

    def poll(self) -> Prior | None:
        if self.done:
            return None
        self._steps += 1
        if self.all_reduce_mean is None:
            now = time.monotonic()
            if now < self._next_look:
                return None
            self._next_look = now + POLL_S
            self._look()
            return self.loaded if self._news() else None
        if self._steps % POLL_STEPS:
            return None
        self._look()
        rows = self.loaded.rows if self.loaded is not None else self.taken
        final = self.loaded is not None and self.loaded.final
        if not ranks_agree(self.all_reduce_mean, 2 * rows + final) or not self._news():  # ranks differ, or nothing new
            return None
        return self.loaded

    def _news(self) -> bool:
        """The file loaded has rows not taken yet, or says that no more will come."""
        return self.loaded is not None and (self.loaded.rows > self.taken or self.loaded.final)

    def _look(self) -> None:
        if self.loaded is not None and self.loaded.final:
            return  # nothing more to come
        try:
            stat = self.path.stat()
        except OSError:
            return
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return
        now = time.monotonic()
        if seen == self._failed and now < self._retry_at:
            return
        try:
            self.loaded = load_prior(self.path, self.vocab_size, self.topk)
        except PriorError:
            self._failed, self._retry_at = seen, now + RETRY_S
            return
        self._seen = seen


def find_prior(model_config, topk: int, all_reduce_mean=None) -> tuple[Prior | None, PriorWatch | None]:
    """A worker's start for ``matrix_init: "model"``: the cached prior of a vLLM
    ``ModelConfig``'s model as far as it is computed (None without a file that loads), and a
    ``PriorWatch`` for the rest (None when it is final: complete, or stopped on purpose; the
    front end started its computation otherwise, ``warm_launch.start_prior``)."""
    vocab_size = model_config.get_vocab_size()
    path = prior_path(str(model_config.model), model_config.revision, vocab_size, topk)
    try:
        prior = load_prior(path, vocab_size, topk)
    except PriorError:
        prior = None
    # every rank starts from the rows all of them loaded
    if all_reduce_mean is not None and not ranks_agree(all_reduce_mean, prior.rows if prior is not None else -1):
        prior = None
    if prior is not None and prior.final:
        return prior, None
    return prior, PriorWatch(path, vocab_size, topk, 0 if prior is None else prior.rows, all_reduce_mean)
