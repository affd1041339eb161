"""Spec-Bench through vLLM: tokens per step and output tokens/s per speculative method, all on
the same prompts, model and machine in one invocation.

    python benchmarks/spec_bench.py                       # the default set of methods
    python benchmarks/spec_bench.py --methods none,recycling --per-category 2 --max-tokens 128

Each method runs in its own process (one vLLM engine per process; an ``ngram`` engine also
poisons later engines in its process), the methods one after another so they never share the
CPU. Requests are sent one at a time (batch 1), greedy, in file order, so recycling's shared
matrix starts cold at the first prompt and stays warm across them (the paper's hot start).

Acceptance is counted two ways: tokens per step, ``tokens / (tokens - accepted)`` (every step
emits one token plus its accepted drafts, the prefill step included), which is what speeds
decoding up, and vLLM's own mean acceptance length ``1 + accepted / drafts``, which skips the
steps where a method drafted nothing. Writes ``benchmarks/results/spec_bench_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "recycling chain6": {"method": "recycling", "verify": "chain"},
    "recycling tree16": {"method": "recycling", "tree": "tree16"},
    "recycling tree32": {"method": "recycling", "tree": "tree32"},
    "recycling 2.2.2": {"method": "recycling"},
}
DEFAULT_METHODS = "none,ngram,recycling chain6,recycling tree16,recycling 2.2.2"


def run_method(args) -> dict:
    """One engine, every prompt one at a time; returns the method's figures."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from vllm_recycling.metrics import spec_decode_counters
    from vllm_recycling.models import prepare_model
    from vllm_recycling.prompts import chat_prompt_ids, spec_bench_questions

    model = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = spec_bench_questions(per_category=args.per_category)
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, q["turns"][0])} for q in questions]
    spec = METHODS[args.worker]
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              disable_log_stats=False, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    before = spec_decode_counters(llm)
    per_category: dict[str, dict[str, float]] = {}
    total_tokens, total_seconds = 0, 0.0
    for q, p in zip(tqdm(questions, desc=args.worker, unit="prompt"), prompts):
        c0 = spec_decode_counters(llm)
        start = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        c1 = spec_decode_counters(llm)
        tokens = len(out.outputs[0].token_ids)
        cat = per_category.setdefault(q["category"], {"tokens": 0, "accepted": 0, "drafts": 0,
                                                       "seconds": 0.0})
        cat["tokens"] += tokens
        cat["seconds"] += seconds
        cat["accepted"] += c1["accepted"] - c0["accepted"]
        cat["drafts"] += c1["drafts"] - c0["drafts"]
        total_tokens += tokens
        total_seconds += seconds
    after = spec_decode_counters(llm)
    accepted = after["accepted"] - before["accepted"]
    drafts = after["drafts"] - before["drafts"]
    return {
        "method": args.worker,
        "speculative_config": spec,
        "prompts": len(prompts),
        "tokens": total_tokens,
        "seconds": round(total_seconds, 2),
        "tokens_per_s": round(total_tokens / total_seconds, 2),
        "accepted": accepted,
        "drafts": drafts,
        "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
        "tokens_per_step": round(total_tokens / (total_tokens - accepted), 3),
        "vllm_mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "per_category": {
            k: {"tokens_per_step": round(v["tokens"] / (v["tokens"] - v["accepted"]), 3),
                "tokens_per_s": round(v["tokens"] / v["seconds"], 2)}
            for k, v in per_category.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma-separated, from: {', '.join(METHODS)}")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(run_method(args)))
        return
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    rows = []
    for method in methods:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--worker", method, "--out", f.name,
                   "--model", args.model, "--per-category", str(args.per_category),
                   "--max-tokens", str(args.max_tokens)]
            subprocess.run(cmd, check=True)
            rows.append(json.loads(Path(f.name).read_text()))
        print(_table(rows[-1:]), flush=True)
    import vllm

    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "vllm": vllm.__version__,
        "model": args.model,
        "dtype": "float32",
        "prompts": f"Spec-Bench turns[0], {args.per_category} per category, chat template",
        "max_tokens": args.max_tokens,
        "batch": 1,
        "results": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"spec_bench_{args.tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    base = next((r for r in rows if r["method"] == "none"), None)
    md = [f"# Spec-Bench through vLLM ({args.tag})", "",
          f"{report['date']}; {report['machine']}; vLLM {report['vllm']}; {args.model} float32; "
          f"{report['prompts']}; up to {args.max_tokens} new tokens; greedy; batch 1.", "",
          _table(rows, base), ""]
    (RESULTS / f"spec_bench_{args.tag}.md").write_text("\n".join(md))
    print("\n" + _table(rows, base))


def _table(rows, base=None) -> str:
    lines = ["| method | tokens per step | vLLM mean acceptance length | tokens/s | speed-up | tokens |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        mal = r["vllm_mean_acceptance_length"]
        lines.append(f"| {r['method']} | {r['tokens_per_step']:.2f} | "
                     f"{'-' if mal is None else f'{mal:.2f}'} | {r['tokens_per_s']:.1f} | "
                     f"{speedup} | {r['tokens']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
