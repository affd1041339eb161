"""The initial matrix's computation (``warm.py``) as the server sees it: a child process
started, waited for or watched.

When an engine with ``matrix_init: "model"`` starts and the cache holds no usable prior, the
front end calls ``start_prior``: on the CPU it starts the computation in a child process
(``python -m vllm_recycling.warm``, at low priority) and returns at once, so the server serves
from the first second with empty rows and the workers take the prior in when its file appears
(``prior.PriorWatch``); on an accelerator, where the child's engine would compete for the
memory the server's engine takes and the computation is short, it computes it first
(``ensure_prior``, which ``vllm-recycling warm MODEL`` calls too). Either way a failed
computation is logged and the server goes on with rows learnt from traffic, and the failure is
recorded so that later starts do not try again for a day (``watch``); on the CPU the
computation is not started where the machine's available memory could not hold a second copy
of the model (``warm_checks``: the memory cost, the cores, the failure record).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from vllm_recycling import LOGGER_NAME
from vllm_recycling.prior import PriorError, load_complete_prior, prior_path
from vllm_recycling.warm_checks import (
    checkpoint_bytes,
    child_env,
    cpu_flags,
    local_time,
    memory_problem,
    prior_dtype,
    read_mem_available,
    record_failure,
    recorded_failure,
    warm_command_of,
)

# Engine arguments the prior's engine takes from the serving engine's (the model and how it is
# loaded); the rest are the prior's own: a short context, eager, no speculation.
_MODEL_ARGS = (
    "model", "tokenizer", "revision", "tokenizer_revision", "tokenizer_mode", "trust_remote_code",
    "dtype", "quantization", "tensor_parallel_size", "download_dir", "load_format", "hf_overrides",
    "seed",
)
NICE = 10  # the background computation yields the CPU to the server's steps


class NotForAChild(ValueError):
    """A model setting the prior's child engine cannot be given (it does not travel as JSON)."""


def engine_kwargs_of(engine_args) -> dict[str, Any]:
    """The model settings of vLLM ``EngineArgs`` that the prior's engine reuses, as JSON: a
    ``torch.dtype`` by its name (``torch.bfloat16`` -> ``"bfloat16"``, what vLLM's ``dtype``
    takes). ``NotForAChild`` names a setting that cannot travel (a callable ``hf_overrides``):
    the child would load another model than the server's."""
    out = {}
    for name in _MODEL_ARGS:
        value = getattr(engine_args, name, None)
        if value is None:
            continue
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise NotForAChild(f"{name}={value!r} cannot be passed to another process") from None
        out[name] = value
    return out


def ensure_prior(engine_args, model_config, topk: int, progress: str = "log") -> Path:
    """The prior of the engine's model (``model_config``: the target's vLLM ``ModelConfig``, as
    the workers will see it), computed in a child process first when the cache holds none that
    loads (missing, corrupt, or mismatched: computed again), waiting for it; a failure recorded
    by an earlier computation is not looked at (an explicit request). Concurrent engines of one
    model compute it once (a lock beside the file); the child stops when this process is gone.
    progress: "bar" (a progress bar on stderr) or "log" (a line at most every
    ``warm.PROGRESS_EVERY_S``). ``RecyclingConfigError`` when the computation fails."""
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)
    path = _path_of(model_config, topk)
    if _loads(path, model_config.get_vocab_size(), topk, logger):
        return path
    logger.info("recycling: computing the initial matrix of %s (cached at %s)", model_config.model, path)
    argv = _child_argv(engine_kwargs_of(engine_args), topk, path, progress, parent=os.getpid())
    result = subprocess.run(argv, env=child_env(dict(os.environ)))
    if result.returncode != 0:
        from vllm_recycling.config import RecyclingConfigError

        raise RecyclingConfigError(
            f"computing the initial matrix of {model_config.model} failed (exit {result.returncode}, "
            "see the log above)"
        )
    load_complete_prior(path, model_config.get_vocab_size(), topk)
    return path


def start_prior(engine_args, model_config, topk: int, background: bool) -> subprocess.Popen | None:
    """What the front end calls when an engine with ``matrix_init: "model"`` starts: nothing
    when the cache holds a prior that loads, or when a computation failed less than
    ``warm_checks.FAILED_RETRY_S`` ago (logged); else, with background, the computation started
    in a child process at low priority (returned; its end is logged, a failure too, and the
    server goes on with empty rows) unless the memory it needs is not available (logged:
    ``warm_checks.memory_problem``); else ``ensure_prior``, whose failure is logged and the
    server goes on. Every line that says it is not computed gives the ``vllm-recycling warm``
    command that computes it ahead of time."""
    from vllm.logger import init_logger

    from vllm_recycling.config import RecyclingConfigError

    logger = init_logger(LOGGER_NAME)
    model = str(model_config.model)
    path = _path_of(model_config, topk)
    if _loads(path, model_config.get_vocab_size(), topk, logger, stopped_is_final=True):
        return None
    try:
        kwargs = engine_kwargs_of(engine_args)
    except NotForAChild as e:
        logger.warning("recycling: the initial matrix of %s is not computed (%s); matrix rows are learnt from "
                       "traffic only (`vllm-recycling warm` with the same settings as JSON computes it)", model, e)
        return None
    command = warm_command_of(kwargs, topk)
    failure = recorded_failure(path)
    if failure is not None:
        logger.warning(
            "recycling: the initial matrix of %s is not computed: computing it failed on %s (%s); a start "
            "tries again after %s, or now: %s", model, local_time(failure.get("failed_at")), failure.get("error"),
            local_time(failure.get("retry_after")), command,
        )
        return None
    if not background:
        try:
            ensure_prior(engine_args, model_config, topk)
        except (RecyclingConfigError, PriorError) as e:
            logger.warning("recycling: %s; serving goes on with matrix rows learnt from traffic only "
                           "(to compute it: %s)", e, command)
        return None
    upcast = 2.0 if prior_dtype(str(model_config.dtype).removeprefix("torch."), True, cpu_flags()) else 1.0
    problem = memory_problem(read_mem_available(), checkpoint_bytes(
        model, kwargs.get("revision"), kwargs.get("download_dir")), upcast)
    if problem is not None:
        logger.warning("recycling: the initial matrix of %s is not computed: %s; matrix rows are learnt from "
                       "traffic only. To compute it ahead of time, with the server stopped: %s",
                       model, problem, command)
        return None
    logger.info(
        "recycling: serving now with empty matrix rows; the initial matrix of %s is computed in "
        "the background, common tokens first, and taken in as its rows come (its progress and the "
        "time left follow in this log; cached at %s; `vllm-recycling warm` computes it ahead of "
        "time)", model, path,
    )
    argv = _child_argv(background_kwargs(kwargs), topk, path, "log", parent=os.getpid(), nice=NICE, rows="pay")
    return watch(subprocess.Popen(argv, env=child_env(dict(os.environ)), stdin=subprocess.DEVNULL), model, path)


def exit_reason(code: int) -> str:
    """How a child process ended, from its ``Popen.returncode`` (negative: the signal that killed it)."""
    if code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:  # its oom_score_adj of 1000 makes it the OOM killer's first choice
        return f"killed by {name}: likely the out-of-memory killer"
    return f"killed by {name}"


def watch(child: subprocess.Popen, model: str, path: Path) -> subprocess.Popen:
    """Log how the background computation ``child`` of the prior ``path`` ended, from a daemon
    thread. A child that failed without recording why (killed by a signal, the out-of-memory
    killer first of all, or an exit before it could) is recorded as failed here, so that the
    next starts do not launch it again before ``warm_checks.FAILED_RETRY_S``."""
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)

    def wait() -> None:
        code = child.wait()
        if code == 0:
            return
        how = exit_reason(code)
        failure = recorded_failure(path)
        if failure is None:
            try:
                record_failure(path, how)
                failure = recorded_failure(path)
            except OSError as e:
                logger.warning("recycling: the failure could not be recorded beside %s (%s)", path, e)
        logger.warning(
            "recycling: computing the initial matrix of %s failed (%s, see the log above); serving goes on "
            "with matrix rows learnt from traffic only%s", model, how,
            f"; a server start tries again after {local_time(failure.get('retry_after'))}" if failure else "",
        )

    threading.Thread(target=wait, name="recycling-prior", daemon=True).start()
    return child


def _path_of(model_config, topk: int) -> Path:
    return prior_path(str(model_config.model), model_config.revision, model_config.get_vocab_size(), topk)


def background_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The background child's engine settings (``engine_kwargs_of``): the server's on one rank
    (no ``tensor_parallel_size``). It computes the same prior; over several ranks its executor
    would bind the server ranks' cores and load the model in as many workers, which the memory
    check does not count. A synchronous computation (on a GPU) keeps them: the model may need them."""
    return {k: v for k, v in kwargs.items() if k != "tensor_parallel_size"}


def _child_argv(kwargs: dict[str, Any], topk: int, path: Path, progress: str, parent: int = 0,
                nice: int = 0, rows: str = "all") -> list[str]:
    return [sys.executable, "-m", "vllm_recycling.warm", "--engine-args",
            json.dumps(kwargs), "--topk", str(topk), "--out", str(path),
            "--progress", progress, "--parent", str(parent), "--nice", str(nice), "--rows", rows]


def _loads(path: Path, vocab_size: int, topk: int, logger, stopped_is_final: bool = False) -> bool:
    """Whether the complete prior is in ``path`` (with stopped_is_final, or one stopped on
    purpose: said in the log); a partial one is resumed, a bad one replaced."""
    try:
        prior = load_complete_prior(path, vocab_size, topk, stopped_is_final)
        if prior.stopped:
            logger.info("recycling: the initial matrix holds the first %d of %d rows (its computation stopped "
                        "there on purpose: the rest cost more than they buy on this machine); `vllm-recycling "
                        "warm` computes the rest (%s)", prior.rows, vocab_size, path)
        return True
    except PriorError as e:
        if path.exists():
            logger.warning("recycling: %s; computing %s", e, "the rest" if e.partial else "it again")
        return False
