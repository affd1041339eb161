"""Greedy (and seeded) output with speculation against output without it, prompt by prompt, on a
real model in its serving dtype: where two runs differ, the first differing token, and the
no-speculation run's top-2 logprob gap there (a near-tie or not).

    python benchmarks/greedy_identity.py --model qwen2.5-coder-0.5b --dtype bfloat16

Runs, each an engine of its own, in this order: no speculation at batch 1 (prompts one at a
time) and at batch 8 (all prompts at once, at most 8 running), then the default recycling
configuration at batch 1 and at batch 8. Every recycling run is compared with the
no-speculation run of the same batch size; and, as the yardstick of what vLLM itself does, the
no-speculation run at batch 8 with the one at batch 1 (a different batch shape computes the
same positions with other matmul shapes: in bfloat16 a near-tie can then flip without any
speculation). Seeded: the same prompts sampled (temperature 0.8, top-p 0.95, seed per prompt)
with and without speculation at batch 1.

A greedy divergence passes as a near-tie when, at its first token, the token the other run took
is among the no-speculation run's top 5 there with a logprob within ``NEAR_TIE`` of the dtype
of the top one (as in ``tests/engines.py``; in bfloat16 three tokens can tie), and the two runs'
top-5 logprobs there differ by at most ``LOGPROB_NOISE``: a tree pass that computes another
distribution (a faulty kernel) is a failure even where its token lands near the top. A seeded
sampled divergence cannot be judged by a logprob gap (the noise picks among all tokens): for it
the table gives how far the two runs' top-5 logprobs differ at the first differing token, the
numerics of a tree pass against a plain one (0: the same distribution, and a divergence there
would come from the noise, which is a defect). Writes ``benchmarks/results/greedy_identity_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import benchmark_questions, ensure_model_prior, run_header, write_results  # noqa: E402

# Measured on the CPU (benchmarks/results/greedy_identity_*_bfloat16*.json, 41 greedy divergences
# of Qwen2.5-Coder-0.5B and SmolLM2, every tree row bit for bit a plain step's, so each comes from
# the batch's shape in the linear layers): the gap at the first difference reached 0.25 (SmolLM2,
# prompt 11, token 67, at batch 1 and 8; vLLM alone, batch 8 against 1: 0.1875). bfloat16 gaps
# come in steps of a logit's last bit, 0.0625 to 0.25 at these logits: a tighter gap would fail
# those runs. What separates them from a faulty kernel is the distribution: the two runs' top-5
# logprobs at the first difference were at most 0.14 apart there (0.27 over 22 seeded ones);
# LOGPROB_NOISE allows about twice that. float32: no divergence measured; 1e-2 is 100 times its gap.
NEAR_TIE = {"float32": 1e-4, "bfloat16": 0.25}
LOGPROB_NOISE = {"float32": 1e-2, "bfloat16": 0.5}
SEEDED = dict(temperature=0.8, top_p=0.95)
TOP = 5  # logprobs kept per position


def run(args) -> dict:
    """One engine (args.worker: "none" or "recycling", args.batch, args.seeded): per prompt, its
    tokens and each position's top-5 logprobs."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids

    model = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, q["turns"][0])} for q in benchmark_questions(args)]
    spec = json.loads(args.spec) if args.worker == "recycling" else None
    llm = LLM(model, dtype=args.dtype, enforce_eager=True, max_model_len=2048, seed=0, speculative_config=spec,
              max_num_seqs=args.batch)
    if args.seeded:
        params = [SamplingParams(max_tokens=args.max_tokens, logprobs=TOP, seed=i, **SEEDED) for i in range(len(prompts))]
    else:
        params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=TOP)] * len(prompts)
    if args.batch == 1:
        outputs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "top": [[sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])[:TOP]
                      for pos in o.outputs[0].logprobs] for o in outputs]}


def compare(base: dict, other: dict, near_tie: float, logprob_noise: float | None = None) -> dict:
    """Prompt by prompt: identical, or the first differing position with the base run's gap
    there between its top token and the token the other run took (None when that token is not
    in its top 5), how far the two runs' top-5 logprobs differ there (over the tokens in both
    lists; None when they share none), and whether that is a near-tie: gap <= near_tie and,
    given logprob_noise, logprobs at most that far apart."""
    rows = []
    for i, (a, b) in enumerate(zip(base["tokens"], other["tokens"])):
        j = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            # identical tokens: and the top-5 logprobs of every position, to the last bit?
            rows.append({"prompt": i, "identical": a == b, "length": len(a),
                         "same_logprobs": base["top"][i] == other["top"][i]})
            continue
        mine, theirs = dict(base["top"][i][j]), dict(other["top"][i][j])
        top = max(mine.values())
        gap = top - mine[b[j]] if b[j] in mine else None
        shared = set(mine) & set(theirs)
        apart = max((abs(mine[t] - theirs[t]) for t in shared), default=None)
        same_distribution = logprob_noise is None or (apart is not None and apart <= logprob_noise)
        rows.append({"prompt": i, "identical": False, "first_difference": j, "gap": gap,
                     "near_tie": gap is not None and gap <= near_tie and same_distribution,
                     "logprob_difference": apart, "length": len(a)})
    return {"identical": sum(r["identical"] for r in rows), "near_ties": sum(r.get("near_tie", False) for r in rows),
            "same_logprobs": sum(r.get("same_logprobs", False) for r in rows), "prompts": len(rows), "rows": rows}


def markdown(report: dict) -> str:
    lines = [f"# Greedy identity, {report['model']} in {report['dtype']}", "", report["header"], "",
             "| comparison | prompts | identical | of them, every top-5 logprob equal to the last bit | "
             "differing at a near-tie | differing otherwise | gaps at the first difference |",
             "|---|---|---|---|---|---|---|"]
    for name, c in report["comparisons"].items():
        if name.startswith("seeded"):
            continue
        gaps = ", ".join("not in the top 5" if r["gap"] is None else f"{r['gap']:.3f}"
                         for r in c["rows"] if not r["identical"]) or "-"
        other = c["prompts"] - c["identical"] - c["near_ties"]
        lines.append(f"| {name} | {c['prompts']} | {c['identical']} | {c.get('same_logprobs', '-')} | {c['near_ties']} | "
                     f"{other} | {gaps} |")
    noise = report.get("logprob_noise")
    lines += ["", f"A near-tie: at the first differing token, the token the other run took is within "
              f"{report['near_tie']} of the top logprob of the first run (the no-speculation one, or batch 1's) "
              "there" + (f", and the two runs' top-5 logprobs there are at most {noise} apart." if noise else "."), "",
              "| seeded sampled | prompts | identical | first difference at (position: the two runs' largest "
              "logprob difference there) |", "|---|---|---|---|"]
    for name, c in report["comparisons"].items():
        if not name.startswith("seeded"):
            continue
        where = ", ".join(f"{r['first_difference']}: {r['logprob_difference']:.3g}"
                          if r["logprob_difference"] is not None else f"{r['first_difference']}: -"
                          for r in c["rows"] if not r["identical"]) or "-"
        lines.append(f"| {name.removeprefix('seeded: ')} | {c['prompts']} | {c['identical']} | {where} |")
    lines += ["", "A seeded request samples each position with its generator's noise; where the two runs' "
              "logprobs differ (a tree pass's numerics against a plain step's), a sample near the noise's "
              "decision boundary can flip and the rest of the answer follows from there."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(NEAR_TIE))
    parser.add_argument("--questions", help="a Spec-Bench question.jsonl (default: the shipped sample)")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="the questions the draw leaves out")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--spec", default='{"method": "recycling"}',
                        help="the speculative config compared with none (default: recycling's default)")
    parser.add_argument("--batches", default="1,8", help="batch sizes compared (and vLLM alone across them)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seeded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(run(args)))
        return
    spec = json.loads(args.spec)
    if spec.get("method") == "recycling":
        ensure_model_prior(args.model, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    plan = ([("none", b, False) for b in batches] + [("recycling", b, False) for b in batches]
            + [("none", batches[0], True), ("recycling", batches[0], True)])
    runs = {}
    for worker, batch, seeded in plan:
        name = f"{worker}, batch {batch}{', seeded' if seeded else ''}"
        print(f"[{len(runs) + 1}/{len(plan)}] {name}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--worker", worker, "--batch", str(batch), "--out", f.name,
                   "--model", args.model, "--dtype", args.dtype, "--per-category", str(args.per_category),
                   "--seed", str(args.seed), "--max-tokens", str(args.max_tokens), "--spec", args.spec]
            cmd += ["--seeded"] if seeded else []
            cmd += ["--questions", args.questions] if args.questions else []
            cmd += ["--held-out"] if args.held_out else []
            subprocess.run(cmd, check=True)
            runs[name] = json.loads(Path(f.name).read_text())
    near_tie, noise = NEAR_TIE[args.dtype], LOGPROB_NOISE[args.dtype]
    method = spec["method"] if spec.get("method") != "recycling" or len(spec) == 1 else json.dumps(spec)
    first = batches[0]
    comparisons = {f"{method} against none, batch {b}": compare(runs[f"none, batch {b}"], runs[f"recycling, batch {b}"],
                                                                near_tie, noise) for b in batches}
    for b in batches[1:]:
        comparisons[f"none at batch {b} against none at batch {first} (vLLM alone)"] = compare(
            runs[f"none, batch {first}"], runs[f"none, batch {b}"], near_tie, noise)
    comparisons[f"seeded: {method} against none, batch {first}"] = compare(
        runs[f"none, batch {first}, seeded"], runs[f"recycling, batch {first}, seeded"], near_tie, noise)
    head = run_header("greedy_identity.py", args.model)
    report = {**head, "dtype": args.dtype, "near_tie": near_tie, "logprob_noise": noise, "max_tokens": args.max_tokens,
              "prompts": len(runs[f"none, batch {first}"]["tokens"]), "comparisons": comparisons, "spec": spec,
              "header": (f"{head['date']}; {head['machine']}; vLLM {head['vllm']}; {len(runs[f'none, batch {first}']['tokens'])} "
                         f"Spec-Bench prompts ({'held out' if args.held_out else 'the sample'}, {args.per_category} per "
                         f"category), up to {args.max_tokens} tokens; LD_PRELOAD {head['ld_preload']}; the engine in "
                         f"the benchmark's process. Command: `{head['command']}`.")}
    tag = args.tag or f"{args.model}_{args.dtype}"
    write_results(f"greedy_identity_{tag}", report, markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
