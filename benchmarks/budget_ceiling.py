"""How much of the tree's acceptance the adaptive budget takes: the whole tree verified every step
(``budget: "fixed"``, every node of "2.2.2" and the context chain) against the default, on the
same prompts, and the best fixed subsets of the tree read from the whole tree's accepted paths.

    python benchmarks/budget_ceiling.py --model qwen2.5-coder-0.5b --dtype bfloat16

The whole tree's run records, per decode step, the template nodes of the path it accepted.
A subset of nodes (closed under parents) would have accepted the longest prefix of that path
inside it, so the best subset of B nodes (grown greedily, a node at a time, by what it adds) is
what a fixed tree of B nodes could accept at most on those steps, had the matrix learnt what it
learnt from the whole tree (every verified row writes its successors: a smaller tree teaches it
less). Writes ``benchmarks/results/budget_ceiling_<model>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import RESULTS, benchmark_questions, ensure_model_prior, run_header  # noqa: E402

SIZES = (4, 6, 8, 10, 12, 15, 20, 30)


def run(args, spec: dict) -> dict:
    """One engine over the prompts, one at a time: tokens, steps, seconds, drafts per step, and
    with budget fixed each decode step's accepted path as template nodes."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    import vllm_recycling.proposer as proposer_module
    from vllm_recycling.metrics import spec_decode_counters
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids

    paths: list[list[int]] = []
    verify = proposer_module.RecyclingProposer.verify

    def recording(self, *a, **k):  # the accepted path of the step's (one) request, as template nodes
        out = verify(self, *a, **k)
        record = self.record
        if record is not None and record.verification is not None and record.verification.path is not None:
            sent = record.proposal.sent.get(self.batch[0])
            if sent is not None:
                paths.append([int(sent[0][j - 1]) for j in record.verification.path[0].tolist() if j > 0])
        return out

    proposer_module.RecyclingProposer.verify = recording
    model = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, q["turns"][0])} for q in benchmark_questions(args)]
    llm = LLM(model, dtype=args.dtype, enforce_eager=True, max_model_len=2048, seed=0, disable_log_stats=False,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    before, tokens, started = spec_decode_counters(llm), 0, time.perf_counter()
    for p in prompts:
        tokens += len(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
    seconds = time.perf_counter() - started
    after = spec_decode_counters(llm)
    parents = llm.collective_rpc(lambda w: w.model_runner.drafter.hybrid.tree.parent.tolist())[0]
    steps = tokens - (after["accepted"] - before["accepted"])
    return {"tokens": tokens, "steps": steps, "seconds": round(seconds, 1), "tokens_per_step": round(tokens / steps, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "drafts_per_step": round((after["draft_tokens"] - before["draft_tokens"]) / steps, 2),
            "paths": paths, "parents": parents}


def best_subsets(paths: list[list[int]], parents: list[int]) -> dict[int, float]:
    """B -> accepted tokens per decode step (the bonus token included) of the best B-node subset."""
    chosen: set[int] = set()
    out = {}

    def accepted(nodes: set[int]) -> int:
        total = 0
        for path in paths:
            for node in path:
                if node not in nodes:
                    break
                total += 1
        return total

    for size in range(1, max(SIZES) + 1):
        grow = [v for v in range(1, len(parents)) if v not in chosen and (parents[v] == 0 or parents[v] in chosen)]
        chosen.add(max(grow, key=lambda v: accepted(chosen | {v})))
        if size in SIZES:
            out[size] = round(1 + accepted(chosen) / len(paths), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--questions")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = {"method": "recycling", **({"budget": "fixed"} if args.worker == "whole" else {})}
        Path(args.out).write_text(json.dumps(run(args, spec)))
        return
    import subprocess
    import tempfile

    ensure_model_prior(args.model, args.dtype)
    runs = {}
    for worker in ("whole", "default"):  # each in a process of its own
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "--worker", worker, "--out", f.name, "--model", args.model,
                            "--dtype", args.dtype, "--per-category", str(args.per_category), "--seed",
                            str(args.seed), "--max-tokens", str(args.max_tokens)], check=True)
            runs[worker] = json.loads(Path(f.name).read_text())
    whole = runs["whole"]
    subsets = best_subsets(whole["paths"], whole["parents"])
    decode_steps = len(whole["paths"])
    head = run_header("budget_ceiling.py", args.model)
    rows = [f"| the whole tree, every step (`budget: fixed`, 96 nodes) | {whole['tokens_per_step']:.2f} | "
            f"{1 + sum(map(len, whole['paths'])) / decode_steps:.2f} | {whole['drafts_per_step']:.1f} | "
            f"{1000 * whole['seconds'] / whole['steps']:.0f} | {whole['tokens_per_s']:.1f} |",
            f"| the default (`budget: auto`) | {runs['default']['tokens_per_step']:.2f} | - | "
            f"{runs['default']['drafts_per_step']:.1f} | {1000 * runs['default']['seconds'] / runs['default']['steps']:.0f} | "
            f"{runs['default']['tokens_per_s']:.1f} |"]
    text = "\n".join([
        f"# How much of the tree's acceptance the budget takes: {args.model}, {args.dtype}", "",
        f"{head['date']}; {head['machine']}; LD_PRELOAD {head['ld_preload']}; vLLM {head['vllm']}; "
        f"{len(benchmark_questions(args))} Spec-Bench prompts, up to {args.max_tokens} tokens, batch 1, greedy, "
        f"the engine in the benchmark's process. Command: `{head['command']}`.", "",
        "| run | tokens per step (every step) | per decode step | drafts per step | ms per step | tokens/s |",
        "|---|---|---|---|---|---|", *rows, "",
        f"The best fixed subsets of the whole tree's nodes, from its {decode_steps} decode steps' accepted paths "
        "(accepted tokens per decode step, the bonus token included, had the matrix learnt what the whole tree "
        "taught it):", "",
        "| nodes | " + " | ".join(str(b) for b in subsets) + " |", "|---|" + "---|" * len(subsets),
        "| tokens per decode step | " + " | ".join(f"{v:.2f}" for v in subsets.values()) + " |", ""])
    (RESULTS / f"budget_ceiling_{args.model}.md").write_text(text)
    (RESULTS / f"budget_ceiling_{args.model}.json").write_text(json.dumps(
        {**head, "runs": {k: {x: y for x, y in v.items() if x not in ("paths", "parents")} for k, v in runs.items()},
         "best_subsets": subsets, "decode_steps": decode_steps}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
