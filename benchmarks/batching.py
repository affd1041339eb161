"""Acceptance under batching: tokens per step of each matrix scope at several batch sizes.

    python benchmarks/batching.py [--prompts 32] [--max-tokens 128] [--batches 1,8,32]
                                  [--scopes shared,per_request,overlay] [--tree 2.2.2]
                                  [--overlay-rows R] [--budget fixed]

Every (scope, batch) pair runs in its own process with a fresh engine (so every matrix starts
empty) on the same prompts from the shipped Spec-Bench sample (one per category in turn, chat
template, greedy). Batch 1 answers the prompts one at a time; batch B submits them all with
``max_num_seqs=B``. Tokens per step = output tokens / (output tokens - accepted drafts), every
step counted; the prompts whose greedy output differs from the first run's are counted (a
different batch shape can flip a near-tie of the target's logits).

Also prints the memory of each scope's per-request part for the model and k, per request and at
256 requests, for vocabularies of 49,152 (SmolLM2) and 151,936 (Qwen2).

Writes benchmarks/results/batching_<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from spec_bench import RESULTS, ensure_model_prior, run_header  # noqa: E402


def prompts(args) -> list[dict]:
    """``args.prompts`` questions: the k-th of each category for k = 0, 1, ... (all categories
    before any repeats), in that order."""
    from vllm_recycling.tools.prompts import spec_bench_questions

    questions = spec_bench_questions()
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    chosen = []
    for k in range(max(len(v) for v in by_category.values())):
        chosen += [v[k] for v in by_category.values() if k < len(v)]
    if args.prompts > len(chosen):
        raise SystemExit(f"--prompts {args.prompts}: the sample has {len(chosen)} questions")
    return chosen[: args.prompts]


def run_one(args) -> dict:
    """One engine: every prompt at the given batch size; its figures and output tokens."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_recycling.metrics import spec_decode_counters
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids

    scope, batch = args.worker.split(":")
    batch = int(batch)
    model = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    inputs = [{"prompt_token_ids": chat_prompt_ids(tokenizer, q["turns"][0])} for q in prompts(args)]
    spec = {"method": "recycling", "matrix_scope": scope, "tree": args.tree, "budget": args.budget}
    if scope == "overlay" and args.overlay_rows:
        spec["overlay_rows"] = args.overlay_rows
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              disable_log_stats=False, speculative_config=spec, max_num_seqs=max(batch, 2))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    before = spec_decode_counters(llm)
    if batch == 1:
        outs = [llm.generate([x], params, use_tqdm=False)[0] for x in inputs]
    else:
        outs = llm.generate(inputs, params, use_tqdm=False)
    after = spec_decode_counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    accepted = after["accepted"] - before["accepted"]
    total = sum(map(len, tokens))
    return {"scope": scope, "batch": batch, "tokens": total, "accepted": accepted,
            "steps": total - accepted, "tokens_per_step": round(total / (total - accepted), 3),
            "outputs": tokens}


def memory_rows(topk: int, overlay_rows: int) -> list[dict]:
    rows = []
    for vocab in (49152, 151936):
        per_request = vocab * topk * 4
        overlay = overlay_rows * (topk + 1) * 4
        rows.append({"vocab": vocab, "shared": vocab * topk * 4,
                     "per_request_each": per_request, "per_request_256": 256 * per_request,
                     "overlay_each": overlay, "overlay_256": 256 * overlay})
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def markdown(report: dict) -> str:
    rows, batches = report["results"], report["batches"]
    by = {(r["scope"], r["batch"]): r for r in rows}
    lines = ["# Acceptance under batching: tokens per step by matrix scope", "",
             f"{report['date']}; {report['machine']}; vLLM {report['vllm']}; {report['model']} "
             f"float32; {report['prompts']} Spec-Bench prompts (one per category in turn); up to "
             f"{report['max_tokens']} new tokens; greedy; tree {report['tree']}, k = 8, budget "
             f"{report.get('budget', 'auto')}, the other keys their defaults. "
             f"Command: `{report['command']}`.", "",
             "Tokens per step = output tokens / (output tokens - accepted drafts), every step counted.",
             "", "| scope | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for scope in report["scopes"]:
        cells = [f"{by[scope, b]['tokens_per_step']:.2f}" if (scope, b) in by else "-" for b in batches]
        lines.append(f"| {scope} | " + " | ".join(cells) + " |")
    differ = ", ".join(f"{r['scope']} batch {r['batch']}: {r['prompts_differing']}" for r in rows)
    lines += ["", f"Prompts whose greedy output differs from the first run's (near-ties of the "
              f"target's logits under another batch shape): {differ}.", "",
              f"Memory of the per-request part (k = 8, overlay_rows = {report['overlay_rows']}):", "",
              "| vocabulary | shared matrix | per_request: each | per_request: 256 | overlay: each | overlay: 256 |",
              "|---|---|---|---|---|---|"]
    for m in report["memory"]:
        lines.append(f"| {m['vocab']:,} | {_mib(m['shared'])} | {_mib(m['per_request_each'])} | "
                     f"{_mib(m['per_request_256'])} | {_mib(m['overlay_each'])} | {_mib(m['overlay_256'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--scopes", default="shared,per_request,overlay")
    parser.add_argument("--tree", default="2.2.2")
    parser.add_argument("--budget", default="fixed", choices=("fixed", "auto"),
                        help="fixed (default): the whole tree every step, so acceptance alone is compared")
    parser.add_argument("--overlay-rows", type=int, help="overlay scope: rows per request "
                        "(default: the config's default)")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(run_one(args)))
        return
    from vllm_recycling.matrix import DEFAULT_OVERLAY_ROWS

    ensure_model_prior(args.model)
    overlay_rows = args.overlay_rows or DEFAULT_OVERLAY_ROWS
    batches = [int(b) for b in args.batches.split(",")]
    scopes = args.scopes.split(",")
    report = {**run_header("batching.py", args.model), "prompts": args.prompts,
              "max_tokens": args.max_tokens, "tree": args.tree, "budget": args.budget, "batches": batches, "scopes": scopes,
              "overlay_rows": overlay_rows, "memory": memory_rows(8, overlay_rows),
              "results": []}
    outputs = {}
    name = f"batching_{args.tag}"
    for scope in scopes:
        for batch in batches:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                argv = [sys.executable, __file__, *sys.argv[1:], "--worker", f"{scope}:{batch}", "--out", f.name]
                subprocess.run(argv, check=True)
                result = json.loads(Path(f.name).read_text())
            outputs[scope, batch] = result.pop("outputs")
            first = next(iter(outputs.values()))
            # greedy outputs are the same up to near-ties of the target's logits (batch shapes sum
            # in another order): count the prompts whose output differs from the first run's
            result["prompts_differing"] = sum(a != b for a, b in zip(first, outputs[scope, batch]))
            report["results"].append(result)
            print(f"{scope} batch {batch}: {result['tokens_per_step']} tokens per step, "
                  f"{result['prompts_differing']} prompts differ from the first run", flush=True)
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
            (RESULTS / f"{name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
