"""Mean accepted tokens per step (MAT) of the reference decoder on Spec-Bench prompts.

For every template and for hot start (one matrix kept across the prompts, in file order: the
paper's setting) and cold start (a fresh matrix per prompt), greedy decoding at batch 1 on the
default model. MAT counts the bonus token, so plain decoding scores 1.00; "pooled" divides all
tokens by all steps, "mean" averages the per-prompt MATs.

    python benchmarks/reference_mat.py                 # all shipped trees, 52 prompts, 128 tokens
    python benchmarks/reference_mat.py --trees 2.2.2 --per-category 2
    python benchmarks/reference_mat.py --trees chain6 --merge   # add rows to the existing table

Writes benchmarks/results/reference_mat.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from vllm_recycling.matrix import AdjacencyMatrix
from vllm_recycling.tools.models import prepare_model
from vllm_recycling.tools.prompts import chat_prompt_ids, seeded_sample, spec_bench_questions
from vllm_recycling.tools.reference import ReferenceDecoder, SamplingSettings
from vllm_recycling.tree import load_tree, shipped_trees

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trees", default=",".join(sorted(shipped_trees(), key=_largest_first)),
                   help="comma-separated names")
    p.add_argument("--starts", default="hot,cold")
    p.add_argument("--questions", default=None, help="a Spec-Bench question.jsonl (default: the shipped sample)")
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above: sampled, prompt i with seed i (as spec_bench.py)")
    p.add_argument("--ignore-eos", action="store_true", help="every answer --max-new-tokens long")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="draw --per-category questions with this seed, as spec_bench.py --seed "
                        "does (default: the first of each category)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel, one thread each")
    p.add_argument("--out", default=str(RESULTS / "reference_mat"), help="path stem for .json and .md")
    p.add_argument("--merge", action="store_true",
                   help="keep the other (tree, start) rows of an existing result with the same settings")
    args = p.parse_args(argv)

    if args.sample_seed is None:
        questions = spec_bench_questions(args.questions, args.per_category)
    else:
        questions = seeded_sample(spec_bench_questions(args.questions), args.per_category, args.sample_seed)
    categories = list(dict.fromkeys(q["category"] for q in questions))
    combos = [(t, s) for t in args.trees.split(",") for s in args.starts.split(",")]
    out = Path(args.out)
    runs: list[dict] = []
    if args.merge and out.with_name(out.name + ".json").exists():
        runs = [r for r in json.loads(out.with_name(out.name + ".json").read_text())["runs"]
                if (r["tree"], r["start"]) not in combos]
    order = [(r["tree"], r["start"]) for r in runs] + combos
    # Results are written after every finished run, so a long sweep keeps what it has done.
    for run in _runs(args, questions, categories, combos):
        runs.append(run)
        runs.sort(key=lambda r: order.index((r["tree"], r["start"])))
        table = _write(args, out, runs, categories, len(questions))
    print(table)
    return 0


def _runs(args, questions, categories, combos):
    if args.jobs <= 1:
        for c in combos:
            yield _run_one(args, questions, categories, c)
        return
    # One thread per process: batch-1 decoding of a small model scales better this way on few
    # cores, and the runs are independent.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        yield from pool.imap_unordered(_run_star, [(args, questions, categories, c) for c in combos])


def _run_star(job):
    return _run_one(*job)


def _write(args, out: Path, runs: list[dict], categories: list[str], prompts: int) -> str:
    meta = {
        "benchmark": "reference decoder MAT (batch 1)",
        "temperature": args.temperature, "ignore_eos": args.ignore_eos, "sample_seed": args.sample_seed,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores"
        if not torch.cuda.is_available() else torch.cuda.get_device_name(),
        "model": args.model, "dtype": args.dtype, "topk": args.topk,
        "prompts": prompts, "jobs": args.jobs, "per_category": args.per_category,
        "questions": args.questions or "shipped Spec-Bench sample",
        "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
    }
    table = _markdown(meta, runs, categories)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    out.with_name(out.name + ".md").write_text(table)
    return table


def _run_one(args, questions: list[dict], categories: list[str], combo: tuple[str, str]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tree_name, start = combo
    path = prepare_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    tree = load_tree(tree_name, args.topk)
    # hot: one shared matrix for all prompts; cold: a fresh matrix for each prompt
    scope = {"hot": "shared", "cold": "per_request"}[start]
    decoder = ReferenceDecoder(model, tree, AdjacencyMatrix(model.config.vocab_size, args.topk, scope))
    steps: dict[str, list[int]] = defaultdict(list)
    per_prompt, tokens_out, t0 = [], 0, time.time()
    for i, q in enumerate(questions):
        ids = chat_prompt_ids(tokenizer, q["turns"][0])
        sampling = SamplingSettings(args.temperature, seed=i if args.temperature > 0 else None)
        eos = None if args.ignore_eos else tokenizer.eos_token_id
        g = decoder.generate(ids, args.max_new_tokens, eos_token_id=eos, sampling=sampling)
        steps[q["category"]] += g.tokens_per_step
        per_prompt.append(g.mat)
        tokens_out += len(g.tokens)
        print(f"{tree_name:>7} {start}: {i + 1}/{len(questions)} prompts, "
              f"MAT so far {_mat(sum(steps.values(), [])):.2f}", file=sys.stderr, flush=True)
    all_steps = sum(steps.values(), [])
    return {
        "tree": tree_name, "nodes": tree.num_nodes, "start": start,
        "mat_pooled": _mat(all_steps), "mat_mean_of_prompts": sum(per_prompt) / len(per_prompt),
        "per_category": {c: _mat(steps[c]) for c in categories},
        "steps": len(all_steps), "tokens": tokens_out, "seconds": round(time.time() - t0, 1),
    }


def _decoding(meta: dict) -> str:
    t = meta.get("temperature", 0.0)
    how = "greedy" if not t else f"temperature {t:g} (prompt i seeded with i; the tree rule)"
    return how + (", every answer full length" if meta.get("ignore_eos") else "")


def _largest_first(name: str) -> int:
    return -load_tree(name, 64).num_nodes


def _mat(steps: list[int]) -> float:
    return sum(steps) / max(len(steps), 1)


def _markdown(meta: dict, runs: list[dict], categories: list[str]) -> str:
    lines = [
        f"# Reference decoder MAT, {meta['model']} ({meta['dtype']}), {meta['date']}",
        "",
        f"{meta['machine']}; {_decoding(meta)}, batch 1, top-k {meta['topk']}; {meta['prompts']} "
        f"prompts ({meta['questions']}, {meta['per_category']} per category"
        f"{'' if meta.get('sample_seed') is None else ' drawn with seed %d' % meta['sample_seed']}"
        ", turns[0], chat template), "
        f"{meta['max_new_tokens']} new tokens; {meta['jobs']} run(s) in parallel (the seconds "
        "column is wall time of each run). MAT = tokens per verification step, bonus included "
        "(pooled over steps); hot = one matrix kept across prompts in file order, cold = fresh "
        "matrix per prompt.",
        "",
        "| tree | nodes | start | MAT | mean of prompts | " + " | ".join(categories) + " | s |",
        "|---|---|---|---|---|" + "---|" * len(categories) + "---|",
    ]
    for r in runs:
        cats = " | ".join(f"{r['per_category'][c]:.2f}" for c in categories)
        lines.append(
            f"| {r['tree']} | {r['nodes']} | {r['start']} | **{r['mat_pooled']:.2f}** | "
            f"{r['mat_mean_of_prompts']:.2f} | {cats} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
