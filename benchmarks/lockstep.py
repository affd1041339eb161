"""Clients in lockstep: why one answer limit for every request penalises speculation at high
concurrency, offline.

    python benchmarks/lockstep.py --questions question.jsonl   # Spec-Bench's whole question file

vLLM's offline engine (in one process) runs ``--requests`` prompts with ``max_num_seqs =
--batch``, for no speculation and the default recycling configuration, twice each: every
request limited to ``--max-tokens``, then each request's limit drawn from [max_tokens * (1 -
--spread), max_tokens] (seeded, the same list for both methods, as ``serve_bench.py
--output-spread`` does). Every step is timed (``execute_model`` plus ``sample_tokens``) and
sorted by whether it processed part of a prompt. With one limit, no speculation's requests of a
batch finish at the same step and the prompts that replace them are processed together in a few
full steps; speculation finishes requests apart, and their replacements' prompts take more,
smaller steps. Per case: tokens/s, steps, steps with a prompt and their seconds, decode-only
steps and theirs, and a least-squares fit of the prompt steps' seconds on their tokens.
Writes ``benchmarks/results/lockstep_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import output_limits  # noqa: E402
from spec_bench import run_header, speculative_config, write_results  # noqa: E402

METHODS = ("none", "recycling auto")


def run_case(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the executor in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids, spec_bench_questions

    model = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = spec_bench_questions(args.questions)
    random.Random(args.seed).shuffle(questions)
    prompts = [p for p in (chat_prompt_ids(tokenizer, q["turns"][0]) for q in questions)
               if len(p) <= 2048 - args.max_tokens]
    inputs = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(args.requests)]
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              max_num_seqs=args.batch, max_num_batched_tokens=2048,
              speculative_config=speculative_config(args.worker))
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    steps, current = [], {}
    execute, sample = executor.execute_model, executor.sample_tokens

    def timed_execute(scheduler_output, *a, **k):
        t0 = time.perf_counter()
        out = execute(scheduler_output, *a, **k)
        spec = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        tokens = scheduler_output.total_num_scheduled_tokens
        current.update(seconds=time.perf_counter() - t0, tokens=tokens,
                       prompt=bool(scheduler_output.scheduled_new_reqs) or tokens - spec > num_reqs)
        return out

    def timed_sample(*a, **k):
        t0 = time.perf_counter()
        out = sample(*a, **k)
        steps.append({**current, "seconds": current["seconds"] + time.perf_counter() - t0})
        return out

    executor.execute_model, executor.sample_tokens = timed_execute, timed_sample
    llm.generate(inputs[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    steps.clear()
    spread = argparse.Namespace(max_tokens=args.max_tokens, output_spread=args.spread if args.spread_on else 0.0,
                                seed=args.seed)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in output_limits(spread, args.requests)]
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt = [s for s in steps if s["prompt"]]
    fit = np.linalg.lstsq(np.stack([np.ones(len(prompt)), [s["tokens"] for s in prompt]], 1),
                          np.array([s["seconds"] for s in prompt]), rcond=None)[0]
    return {
        "method": args.worker, "limits": "spread" if args.spread_on else "one",
        "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
        "steps": len(steps), "prompt_steps": len(prompt),
        "prompt_step_s": round(sum(s["seconds"] for s in prompt), 2),
        "decode_step_s": round(sum(s["seconds"] for s in steps if not s["prompt"]), 2),
        "prompt_fit_ms": [round(1e3 * fit[0], 1), round(1e3 * fit[1], 3)],
        "mean_prompt_tokens": round(float(np.mean([len(x["prompt_token_ids"]) for x in inputs])), 1),
    }


def markdown(report: dict) -> str:
    lines = ["# Clients in lockstep, offline", "",
             f"{report['date']}; {report['machine']}; LD_PRELOAD {report['ld_preload']}; vLLM "
             f"{report['vllm']}; {report['model']}; {report['setup']}. Command: `{report['command']}`.", "",
             "| method | limits | tokens/s | steps | steps with a prompt | their s | fit ms + ms/token "
             "| decode-only s |", "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        a, b = r["prompt_fit_ms"]
        lines.append(f"| {r['method']} | {r['limits']} | {r['tokens_per_s']} | {r['steps']} | "
                     f"{r['prompt_steps']} | {r['prompt_step_s']} | {a} + {b} | {r['decode_step_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--questions", help="a Spec-Bench question.jsonl (default: the shipped sample)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--spread", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spread-on", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(run_case(args)))
        return
    if not 0.0 <= args.spread < 1.0:
        parser.error(f"--spread: expected 0 <= R < 1, got {args.spread}")
    rows = []
    for spread_on in (False, True):
        for method in METHODS:  # each case in a fresh process
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--worker", method, "--out", f.name,
                       "--model", args.model, "--batch", str(args.batch),
                       "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                       "--spread", str(args.spread), "--seed", str(args.seed)]
                cmd += ["--questions", args.questions] if args.questions else []
                cmd += ["--spread-on"] if spread_on else []
                subprocess.run(cmd, check=True)
                rows.append(json.loads(Path(f.name).read_text()))
            print(rows[-1], flush=True)
    low = max(1, round(args.max_tokens * (1 - args.spread)))
    report = {
        **run_header("lockstep.py", args.model),
        "setup": (f"offline LLM, max_num_seqs {args.batch}, max_num_batched_tokens 2048, "
                  f"{args.requests} prompts ({'the shipped sample' if not args.questions else Path(args.questions).name}, "
                  f"shuffled with seed {args.seed}, mean {rows[0]['mean_prompt_tokens']} tokens), greedy; "
                  f"limits: one = {args.max_tokens} for all, spread = {low}-{args.max_tokens} "
                  f"(seed {args.seed})"),
        "results": rows,
    }
    write_results(f"lockstep_{args.tag}", report, markdown)
    print("\n" + markdown(report))


if __name__ == "__main__":
    main()
