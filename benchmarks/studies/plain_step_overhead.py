"""What the plugin adds to a step where no draft pays (the budget sends none: a plain step),
per step on the host, at 1 to 64 requests: the proposer's work before the forward
(``begin_step``), before sampling (``verify``: the matrix learns from every logits row, the
top-k over the vocabulary), and after bookkeeping (``propose``: the budget's bookkeeping, the
context match over each request's history, the decision that nothing pays, the first level
drafted so the calibration keeps learning what would have been accepted).

The proposer is the default configuration (the shipped tree, the context branch, ``budget:
"auto"``) at the model's vocabulary, without an engine; its step cost is the linear layers'
measured cost at one thread (``linear_rows.py``'s results: what vLLM's CPU worker computes with
in a server on two cores), under which no draft pays at these batch sizes; each step checks that
the budget sent nothing. Logits are random in the model's dtype over the whole vocabulary, each
request's history 512 random tokens from a 4096-token pool (its context matches are then short
and rare, as in most text). Each step's phases are timed apart; the median over the steps is
kept, batch sizes in alternating order over rounds.

    python benchmarks/studies/plain_step_overhead.py --model qwen2.5-coder-0.5b --dtype bfloat16 [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: spec_bench
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from proposers import greedy_metadata, proposer_of  # noqa: E402  (the tests' proposer without an engine)
from spec_bench import RESULTS, run_header, write_results  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BATCHES = (1, 4, 16, 64)
HISTORY = 512
POOL = 4096
PHASES = ("begin_step", "verify", "propose")


def make_proposer(vocab_size: int, max_num_seqs: int, max_model_len: int):
    """The default configuration's proposer on the CPU, its matrix empty (filled by the steps)."""
    from vllm_recycling.config import RecyclingConfig

    return proposer_of(RecyclingConfig(matrix_init="empty"), vocab_size, max_num_seqs, max_model_len,
                       "plain-step-overhead")


def step_cost(linear_ms: dict[str, float]):
    """The budget's cost model from the linear layers' measured milliseconds per row count,
    extended linearly past the largest (what ``StepCost`` does beyond its profile)."""
    from vllm_recycling.cost_model import StepCost

    rows = sorted(int(m) for m in linear_ms)
    return StepCost(rows, [linear_ms[str(m)] / 1000 for m in rows])


def run_batch(proposer, batch: int, steps: int, vocab: int, dtype: torch.dtype,
              rng: np.random.Generator) -> dict[str, list[float]]:
    """``steps`` plain steps of ``batch`` requests (fresh request ids); seconds per phase."""
    req_ids = [f"b{batch}-r{i}-{rng.integers(1 << 30)}" for i in range(batch)]
    pool = rng.integers(0, vocab, size=POOL)
    history = np.zeros((batch, HISTORY + steps + 1), dtype=np.int32)
    history[:, :HISTORY] = rng.choice(pool, size=(batch, HISTORY))
    num_tokens = np.full(batch, HISTORY, dtype=np.int32)
    last = history[:, HISTORY - 1].copy()
    qsl = np.arange(batch + 1)
    slots = torch.arange(batch)
    metadata, greedy = SimpleNamespace(num_draft_tokens=[0] * batch), greedy_metadata()
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for _ in range(steps):
        logits = torch.randn(batch, vocab).to(dtype)
        tokens = torch.from_numpy(last.astype(np.int64))
        t0 = time.perf_counter()
        offsets = proposer.begin_step(req_ids, lambda r: None, [0] * batch, qsl, num_tokens - 1, slots)
        t1 = time.perf_counter()
        output = proposer.verify(req_ids, req_ids, tokens, logits, metadata, greedy, None, lambda: [])
        t2 = time.perf_counter()
        if offsets is not None or output is not None:
            raise SystemExit("a step without drafts planned a tree or sampled: not a plain step")
        sampled = rng.choice(pool, size=batch)  # what vLLM's sampler would have emitted
        history[np.arange(batch), num_tokens] = sampled
        num_tokens += 1
        t3 = time.perf_counter()
        drafts = proposer.propose([[int(t)] for t in sampled], num_tokens, history)
        t4 = time.perf_counter()
        if any(drafts):
            raise SystemExit(f"the budget sent drafts at {batch} requests: the cost model lets them pay")
        last = sampled
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t4 - t3)):
            times[phase].append(seconds)
    return times


def markdown(report: dict) -> str:
    lines = [
        f"# What the plugin adds to a plain step (no draft pays): {report['model']}, {report['dtype']}",
        "",
        f"{report['date']}; {report['machine']}; vLLM {report['vllm']}; torch {report['torch']} "
        f"({report['threads']} threads). Command: `{report['command']}`.",
        "",
        f"The default configuration's proposer (vocabulary {report['vocab']}), no engine; random "
        f"logits in {report['dtype']}, {HISTORY}-token histories; median of {report['steps']} steps "
        "per batch size and round, the median over rounds. Linear layers alone (a plain step costs "
        f"more: attention, sampling, the engine): the same model's at the same threads, from "
        f"{report['linear_source']}.",
        "",
        "| requests | begin_step, ms | verify (matrix update), ms | propose (budget), ms | total, ms "
        "| linear layers alone, ms | total / linear layers |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, row in report["ms"].items():
        total = sum(row[p] for p in PHASES)
        linear = report["linear_ms"][b]
        lines.append(f"| {b} | {row['begin_step']:.3f} | {row['verify']:.3f} | {row['propose']:.3f} "
                     f"| {total:.3f} | {linear:.1f} | {100 * total / linear:.2f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from vllm_recycling.tools.models import prepare_model

    torch.set_num_threads(args.threads)
    threads = f"{args.threads}thread" + ("s" if args.threads > 1 else "")
    linear_name = f"linear_rows_{args.model}_{args.dtype}_{threads}"
    linear_path = RESULTS / f"{linear_name}.json"
    if not linear_path.exists():
        raise SystemExit(f"{linear_path} is missing: run benchmarks/studies/linear_rows.py --model {args.model} "
                         f"--dtype {args.dtype} --threads {args.threads} first")
    linear_ms = json.loads(linear_path.read_text())["ms"]
    config = json.loads((prepare_model(args.model) / "config.json").read_text())
    vocab = config["vocab_size"]
    dtype = DTYPES[args.dtype]
    proposer = make_proposer(vocab, max(BATCHES), HISTORY + args.steps * args.rounds + 1)
    proposer.budget.cost = step_cost(linear_ms)
    rng = np.random.default_rng(0)
    for b in BATCHES:  # warm-up: the matrix's rows written, the budget's tables started
        run_batch(proposer, b, 5, vocab, dtype, rng)
    medians: dict[int, dict[str, list[float]]] = {b: {p: [] for p in PHASES} for b in BATCHES}
    started = time.perf_counter()
    for r in range(args.rounds):
        for b in (BATCHES if r % 2 == 0 else BATCHES[::-1]):
            times = run_batch(proposer, b, args.steps, vocab, dtype, rng)
            for p in PHASES:
                medians[b][p].append(1000 * statistics.median(times[p]))
        print(f"round {r + 1} of {args.rounds} done ({time.perf_counter() - started:.0f} s)", flush=True)
    # the linear layers at b rows: measured, or extended by the last measured slope
    rows = sorted(int(m) for m in linear_ms)
    slope = (linear_ms[str(rows[-1])] - linear_ms[str(rows[-2])]) / (rows[-1] - rows[-2])
    linear_at = {b: linear_ms[str(b)] if str(b) in linear_ms else linear_ms[str(rows[-1])] + slope * (b - rows[-1])
                 for b in BATCHES}
    report = run_header("studies/plain_step_overhead.py", args.model) | {
        "dtype": args.dtype, "torch": torch.__version__, "threads": args.threads, "vocab": vocab,
        "steps": args.steps, "rounds": args.rounds,
        "linear_source": f"results/{linear_name}.md" + (
            f", past {rows[-1]} rows extended by its last slope ({slope:.2f} ms a row)"
            if any(b > rows[-1] for b in BATCHES) else ""),
        "linear_ms": {str(b): round(v, 2) for b, v in linear_at.items()},
        "ms": {str(b): {p: round(statistics.median(v), 4) for p, v in medians[b].items()} for b in BATCHES},
    }
    write_results(f"plain_step_overhead_{args.model}_{args.dtype}_{threads}", report, markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
