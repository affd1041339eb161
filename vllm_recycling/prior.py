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
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

PRIOR_FORMAT = "vllm-recycling-prior"
PRIOR_VERSION = "1"
# What each token follows when the prior is computed (docs/design.md, "The initial matrix").
CONTEXT = "assistant"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class PriorError(ValueError):
    """A prior file that cannot be used: unreadable, corrupt, or for another model."""


def cache_root() -> Path:
    """The cache root: ``$VLLM_RECYCLING_CACHE``, else ``$XDG_CACHE_HOME/vllm-recycling``,
    else ``~/.cache/vllm-recycling``."""
    explicit = os.environ.get("VLLM_RECYCLING_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "vllm-recycling"
    return Path.home() / ".cache" / "vllm-recycling"


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
            for f in path.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES
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


def save_prior(path: Path, table: torch.Tensor, probs: torch.Tensor, model: str, seconds: float) -> None:
    """Write the prior atomically (a temporary file in the same folder, fsync, rename)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": PRIOR_FORMAT, "version": PRIOR_VERSION, "model": model, "context": CONTEXT,
        "vocab_size": str(table.shape[0]), "topk": str(table.shape[1]),
        "compute_seconds": f"{seconds:.1f}",
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({"table": table.to(torch.int32).contiguous().cpu(),
                   "probs": probs.to(torch.float16).contiguous().cpu()}, tmp, metadata=meta)
        os.chmod(tmp, 0o644)  # a cache others read (mkstemp makes it private)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_prior(path: Path, vocab_size: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [V, k] int32, probs [V, k] float16) from ``path``; ``PriorError`` naming what is
    wrong when the file is unreadable, corrupt or made for another vocabulary or k."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            table, probs = f.get_tensor("table"), f.get_tensor("probs")
    except (OSError, SafetensorError, KeyError, ValueError) as e:
        raise PriorError(f"prior {path}: unreadable ({e})") from e
    if meta.get("format") != PRIOR_FORMAT or meta.get("version") != PRIOR_VERSION:
        raise PriorError(f"prior {path}: not a version {PRIOR_VERSION} {PRIOR_FORMAT} file")
    if tuple(table.shape) != (vocab_size, topk) or tuple(probs.shape) != (vocab_size, topk):
        raise PriorError(
            f"prior {path}: shape {tuple(table.shape)}, expected ({vocab_size}, {topk})"
        )
    if table.dtype != torch.int32 or probs.dtype != torch.float16:
        raise PriorError(f"prior {path}: dtypes {table.dtype}, {probs.dtype}")
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= vocab_size):
        raise PriorError(f"prior {path}: token ids outside the vocabulary")
    if not bool(torch.isfinite(probs).all()) or float(probs.min()) < 0 or float(probs.max()) > 1:
        raise PriorError(f"prior {path}: probabilities outside [0, 1]")
    return table, probs


def find_prior(model_config, topk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cached prior of a vLLM ``ModelConfig``'s model (what a worker starts its matrices
    from), None when there is none that loads: the front end computes it before the engine
    starts (``warm.ensure_prior``), so this happens only where the cache is not shared with it."""
    from vllm.logger import init_logger

    from vllm_recycling import LOGGER_NAME

    vocab_size = model_config.get_vocab_size()
    path = prior_path(str(model_config.model), model_config.revision, vocab_size, topk)
    try:
        return load_prior(path, vocab_size, topk)
    except PriorError as e:
        init_logger(LOGGER_NAME).warning(
            "recycling: matrix_init='model' but %s; the matrix starts empty", e
        )
        return None
