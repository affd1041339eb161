"""What is checked before a model's initial matrix is computed beside a server (``warm.py``,
``warm_launch.py``), as functions of what they read, so that each can be tested without an
engine.

- **Memory.** The background computation (on the CPU) loads a second copy of the model beside
  the server's, in a child process: about 1.5 times the checkpoint's size on disk, plus its
  own KV cache (``PRIOR_KV_CACHE_BYTES``, 1 GiB), plus vLLM's own overhead
  (``benchmarks/results/warm_qwen.md``: a peak of 4.6 GiB resident for Qwen2.5-Coder-0.5B,
  whose checkpoint is 1 GB). ``memory_problem`` refuses it when ``MemAvailable`` is below
  ``PRIOR_MEMORY_FACTOR`` x the checkpoint plus that KV cache. The check runs in the front end
  before the server's own engine has loaded its copy, so it only catches a host that could not
  hold the child at all; the child also makes itself the OOM killer's first choice
  (``prefer_oom_kill``), so that under memory pressure it goes before the server's worker.
- **Cores.** The child runs its engine in its own process with the server's environment, less
  the variables that pin OpenMP threads to cores (``child_env``): vLLM's worker binds the
  server's cores from ``VLLM_CPU_OMP_THREADS_BIND`` by setting ``OMP_PLACES`` and
  ``OMP_PROC_BIND``, ``GOMP_CPU_AFFINITY`` or ``KMP_AFFINITY`` (vllm/utils/ompmultiprocessing.py:
  71-120), and the same variables set by hand would put the child's threads on those cores.
  ``VLLM_CPU_OMP_THREADS_BIND`` is set to ``nobind``, as its default ``auto`` (vllm/envs.py:53)
  binds every rank to a NUMA node's cores, the server's; and the background child runs on one
  rank (``warm_launch.background_kwargs``).
- **The KV cache.** The child's engine takes ``PRIOR_KV_CACHE_BYTES`` of KV cache
  (``kv_cache_memory_bytes``), what ``memory_needed`` counts: the server's
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB), which on the CPU replaces ``kv_cache_memory_bytes``
  whenever it is set (vllm/platforms/cpu.py:323-327), is not passed on (``child_env``).
- **A failure recorded.** A computation that failed leaves ``<key>.failed`` beside the prior's
  place (the error, when it failed, and when to try again: ``FAILED_RETRY_S`` later), so that
  every start of the server does not spawn a child that fails again; a child that could not
  record it (killed by a signal: the out-of-memory killer) is recorded by the server
  (``warm_launch.watch``). ``vllm-recycling warm`` does not read it (an explicit request) and a
  computation that succeeds removes it.
- **The dtype.** On a CPU without bfloat16 instructions (neither AVX512-BF16 nor AMX: an
  AVX2-only machine), vLLM's bfloat16 kernels are emulated and a bfloat16 model's rows cost
  several times their float32 cost (benchmarks/results/prior_rows_cost_*.md: 5.8x for SmolLM2),
  while the rows agree with the model's own dtype's but for near-ties: the child computes a
  bfloat16 model's rows in float32 there (``prior_dtype``), and its memory counts the float32
  copy of the weights (``memory_needed``).
- **The context.** The child's engine takes ``min(PRIOR_MAX_MODEL_LEN, the model's derived
  length)`` positions; a model whose context (the chat template's opening and the token) does
  not fit in them is not computed (``prior_max_model_len``).

This module imports neither vLLM nor torch (``warm_command_of`` reads vLLM's defaults when called).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from vllm_recycling.prior import WEIGHT_SUFFIXES, PriorError

PRIOR_KV_CACHE_BYTES = 1 << 30  # the child engine's KV cache (warm.warm)
PRIOR_MAX_MODEL_LEN = 1024  # the child engine's positions at most: the context and the token
PRIOR_MEMORY_FACTOR = 1.5  # the child's resident memory per byte of checkpoint, KV cache aside
FAILED_RETRY_S = 24 * 3600.0  # a failed computation is not started again by a server for this long
OOM_SCORE_ADJ = "/proc/self/oom_score_adj"
MEMINFO = "/proc/meminfo"
CPUINFO = "/proc/cpuinfo"
BF16_INSTRUCTIONS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names
# What pins OpenMP threads to cores (vllm/utils/ompmultiprocessing.py:71-120 and 122-171).
BINDING_VARIABLES = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_PLACES",
                     "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
# The server's own engine settings read from the environment, which would override the child's:
# VLLM_CPU_KVCACHE_SPACE replaces kv_cache_memory_bytes on the CPU (vllm/platforms/cpu.py:323-327).
SERVER_ONLY_VARIABLES = ("VLLM_CPU_KVCACHE_SPACE",)
GIB = float(1 << 30)


# -- memory -------------------------------------------------------------------------------------

def mem_available(meminfo: str) -> int | None:
    """``MemAvailable`` in bytes from the text of /proc/meminfo; None without that line."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip() == "kB" else 1)
    return None


def read_mem_available(meminfo: str | Path = MEMINFO) -> int | None:
    """``mem_available`` of this machine; None where there is no /proc/meminfo."""
    try:
        return mem_available(Path(meminfo).read_text())
    except (OSError, ValueError):
        return None


def weights_bytes(folder: Path) -> int | None:
    """The size of the weight files vLLM loads from the checkpoint folder: its .safetensors,
    else .bin, else .pt files; None when it holds none (not downloaded yet)."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return None
    for suffix in WEIGHT_SUFFIXES:
        sizes = [f.stat().st_size for f in entries if f.suffix == suffix and f.is_file()]  # links followed
        if sizes:
            return sum(sizes)
    return None


def checkpoint_bytes(model: str, revision: str | None = None, download_dir: str | None = None) -> int | None:
    """The size on disk of the checkpoint vLLM loads for ``model``: a file (GGUF), a local
    folder, or a hub id's snapshot in the local Hugging Face cache (``download_dir``: vLLM's
    ``--download-dir``); None when its weights are not on disk."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return weights_bytes(path)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", cache_dir=download_dir, revision=revision)
    except ValueError:  # not a hub id
        return None
    return weights_bytes(Path(found).parent) if isinstance(found, str) else None


def memory_needed(checkpoint: int, upcast: float = 1.0) -> int:
    """What the background computation is taken to need, in bytes, for a checkpoint of
    ``checkpoint`` bytes whose weights the child holds ``upcast`` times as large (2: bfloat16
    computed in float32, ``prior_dtype``) (the module's docstring)."""
    return int(PRIOR_MEMORY_FACTOR * upcast * checkpoint) + PRIOR_KV_CACHE_BYTES


def memory_problem(available: int | None, checkpoint: int | None, upcast: float = 1.0) -> str | None:
    """Why the background computation does not fit in ``available`` bytes (``MemAvailable``)
    for a checkpoint of ``checkpoint`` bytes (held ``upcast`` times as large), or None when it
    fits or either is unknown."""
    if available is None or checkpoint is None:
        return None
    need = memory_needed(checkpoint, upcast)
    if available >= need:
        return None
    held = f"{upcast:g} x " if upcast != 1 else ""
    return (f"computing it beside the server needs about {need / GIB:.1f} GiB of memory "
            f"({PRIOR_MEMORY_FACTOR:g} x {held}the checkpoint's {checkpoint / GIB:.1f} GiB and a "
            f"{PRIOR_KV_CACHE_BYTES / GIB:.1f} GiB KV cache) and {available / GIB:.1f} GiB is available")


# -- the dtype ----------------------------------------------------------------------------------

def cpu_flags(cpuinfo: str | Path = CPUINFO) -> set[str] | None:
    """The instruction-set flags of this machine's first CPU in /proc/cpuinfo; None where it
    cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return None


def prior_dtype(model_dtype: str, on_cpu: bool, flags: set[str] | None) -> str | None:
    """The dtype the prior's engine computes in when it is not the model's own (``model_dtype``,
    the one vLLM resolved: "bfloat16", "float16", "float32"): "float32" for a bfloat16 model on
    a CPU whose flags name no bfloat16 instructions (``BF16_INSTRUCTIONS``); None (the model's
    own) elsewhere, and where the flags are unknown."""
    if not on_cpu or model_dtype != "bfloat16" or flags is None:
        return None
    return None if any(f in flags for f in BF16_INSTRUCTIONS) else "float32"


# -- the child ----------------------------------------------------------------------------------

def child_env(environ: dict[str, str]) -> dict[str, str]:
    """The child's environment: ``environ`` without what pins threads to the server's cores
    (``BINDING_VARIABLES``; vLLM told not to bind any, its default being "auto") or sizes the
    server's KV cache (``SERVER_ONLY_VARIABLES``: the child's is ``PRIOR_KV_CACHE_BYTES``), its
    engine core in its own process (it starts in seconds) and vLLM's start-up lines quiet."""
    env = {k: v for k, v in environ.items() if k not in BINDING_VARIABLES and k not in SERVER_ONLY_VARIABLES}
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_LEVEL": "WARNING"}


def prefer_oom_kill(path: str | Path = OOM_SCORE_ADJ) -> str | None:
    """Make this process the OOM killer's first choice (oom_score_adj 1000), best effort; why
    it could not, or None."""
    try:
        Path(path).write_text("1000\n")
    except OSError as e:
        return str(e)
    return None


def prior_max_model_len(derived: int, context: int, model: str) -> int:
    """The child engine's ``max_model_len``: ``min(PRIOR_MAX_MODEL_LEN, derived)``, ``derived``
    the length vLLM derives from the model's config (a larger one it refuses without
    VLLM_ALLOW_LONG_MAX_MODEL_LEN, config/model.py:2624-2665). ``PriorError`` when the
    ``context`` tokens and the token do not fit in it."""
    length = min(PRIOR_MAX_MODEL_LEN, derived)
    if context + 1 > length:
        raise PriorError(
            f"the initial matrix of {model} cannot be computed: its context (the chat template's "
            f"opening, {context} tokens, and the token) does not fit in the {length} positions "
            f"of its engine (the model's {derived}, at most {PRIOR_MAX_MODEL_LEN})"
        )
    return length


def warm_command(engine_kwargs: dict[str, Any], topk: int, defaults: dict[str, Any],
                 default_topk: int) -> str:
    """The ``vllm-recycling warm`` command that computes this prior ahead of time: the model,
    each engine setting that differs from ``defaults`` (vLLM's ``EngineArgs`` field defaults)
    as its ``vllm serve`` option, and k when it is not ``default_topk``."""
    words = ["vllm-recycling", "warm", str(engine_kwargs["model"])]
    for name, value in engine_kwargs.items():
        if name == "model" or value is None or value == defaults.get(name):
            continue
        if name == "tokenizer" and value == engine_kwargs["model"]:
            continue
        option = "--" + name.replace("_", "-")
        if value is True:
            words.append(option)
        elif value is False:
            words.append("--no-" + name.replace("_", "-"))
        else:
            words += [option, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    if topk != default_topk:
        words += ["--speculative-config", json.dumps({"method": "recycling", "topk": topk})]
    return shlex.join(words)


def warm_command_of(engine_kwargs: dict[str, Any], topk: int) -> str:
    """``warm_command`` with the defaults of the installed vLLM's ``EngineArgs``."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from vllm_recycling.config import DEFAULT_TOPK

    defaults = {}
    for field in dataclasses.fields(EngineArgs):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return warm_command(engine_kwargs, topk, defaults, DEFAULT_TOPK)


# -- a failure recorded -------------------------------------------------------------------------

def failed_path(path: Path) -> Path:
    """Where a failed computation of the prior ``path`` is recorded: ``<key>.failed``."""
    return path.with_suffix(".failed")


def record_failure(path: Path, error: str, now: float | None = None) -> None:
    """Record that computing the prior ``path`` failed with ``error``: no server starts it
    again before ``FAILED_RETRY_S`` has passed."""
    now = time.time() if now is None else now
    marker = failed_path(path)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"error": error, "failed_at": now, "retry_after": now + FAILED_RETRY_S}) + "\n")
    os.replace(tmp, marker)


def recorded_failure(path: Path, now: float | None = None) -> dict | None:
    """The failure recorded for the prior ``path`` (``error``, ``failed_at``, ``retry_after``,
    times in seconds since the epoch) while it holds; None without one, once its retry time
    has passed, or when the record is unreadable."""
    try:
        failure = json.loads(failed_path(path).read_text())
        retry_after = float(failure["retry_after"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return failure if (time.time() if now is None else now) < retry_after else None


def local_time(seconds) -> str:
    """A time recorded in seconds since the epoch, in local time ("?" when it is not one)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(seconds)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def clear_failure(path: Path) -> None:
    """Forget a failure recorded for the prior ``path`` (it was computed)."""
    try:
        failed_path(path).unlink()
    except FileNotFoundError:
        pass
