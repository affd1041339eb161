"""What the initial matrix's rows cost and what they are worth, on this machine.

    python benchmarks/studies/prior_rows.py cost --model qwen2.5-coder-0.5b --dtypes bfloat16 float32
    python benchmarks/studies/prior_rows.py worth --model smollm2 --rows 0 2048 12288 24064 all
    python benchmarks/studies/prior_rows.py child --model qwen2.5-coder-0.5b --dtype bfloat16

``cost``: rows per second of the prior's engine (``warm.warm``'s settings) in each dtype, over
the first ``--rows`` token ids, each engine in a process of its own, in the balanced order
A B B A; then how far the dtypes' rows agree (top-1, and the share of each row's top-k found in
the other's), which says whether the faster dtype may stand in for the model's own.

``worth``: tokens per step (every step counted: tokens / (tokens - accepted)) of a server's
engine on the shipped Spec-Bench sample (13 categories, greedy, in one batch, the whole default
tree verified every step: ``budget: "fixed"``) when its initial matrix holds only the first N
rows: the complete prior (computed first when the cache has none) written back as one stopped
after N rows (``Prior.stopped``), which is what a server finds after a computation stopped on
purpose. 0 rows: an empty matrix. The cache's prior is restored afterwards.

``child``: the computation a server starts beside itself for a model whose cache has no
initial matrix (``python -m vllm_recycling.warm --rows pay --nice 10``, the server's engine
arguments, a cache of its own), timed, with its log: where it stops, and why.

Writes ``benchmarks/results/prior_rows_<cost|worth|child>_<model>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
WORTH_TOKENS = 32


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return platform.processor()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cores, {' '.join(have)}"


# ---------------------------------------------------------------------------------------- cost

def cost_worker(model: str, dtype: str, rows: int, out: str) -> None:
    from vllm import LLM

    from vllm_recycling.config import DEFAULT_TOPK
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.warm import (
        PRIOR_BLOCK, PRIOR_MAX_SEQS, RowPlan, compute_prior, engine_max_model_len,
    )
    from vllm_recycling.warm_checks import PRIOR_KV_CACHE_BYTES

    import torch

    kwargs = {"model": str(prepare_model(model)), "dtype": dtype, "seed": 0}
    llm = LLM(**kwargs, enforce_eager=True, max_model_len=engine_max_model_len(kwargs),
              enable_prefix_caching=True, block_size=PRIOR_BLOCK, max_num_seqs=PRIOR_MAX_SEQS,
              max_num_batched_tokens=PRIOR_MAX_SEQS * 8, kv_cache_memory_bytes=PRIOR_KV_CACHE_BYTES)
    marks = []
    prior = compute_prior(llm, DEFAULT_TOPK, progress=lambda done, total: marks.append((time.perf_counter(), done)),
                          plan=RowPlan(pay=rows, share=0.0, rest_limit_s=0.0))
    (t0, d0), (t1, d1) = marks[0], marks[-1]
    torch.save({"table": prior.table[:prior.rows], "probs": prior.probs[:prior.rows],
                "rows_per_s": (d1 - d0) / (t1 - t0), "rows": prior.rows, "seconds": t1 - t0}, out)


def agreement(a, b) -> dict:
    """Rows of table a against table b: top-1 equal, and the mean share of a row's top-k in the other's."""
    top1 = (a[:, 0] == b[:, 0]).float().mean().item()
    same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean().item()
    return {"top1_equal": round(top1, 4), "topk_shared": round(same, 4), "rows": a.shape[0]}


def run_cost(args) -> dict:
    import torch

    order = args.dtypes + args.dtypes[::-1]  # A B B A
    runs: dict[str, list] = {d: [] for d in args.dtypes}
    tables = {}
    with_tmp = RESULTS / ".tmp_prior_rows"
    with_tmp.mkdir(exist_ok=True)
    for i, dtype in enumerate(order):
        out = with_tmp / f"{dtype}_{i}.pt"
        subprocess.run([sys.executable, __file__, "_cost", "--model", args.model, "--dtype", dtype,
                        "--rows", str(args.rows), "--out", str(out)], check=True)
        got = torch.load(out)
        runs[dtype].append(got["rows_per_s"])
        tables[dtype] = got["table"]
        print(f"{dtype}: {got['rows']} rows, {got['rows_per_s']:.1f} rows/s", flush=True)
    shutil.rmtree(with_tmp)
    first = args.dtypes[0]
    return {
        "machine": cpu_flags(), "model": args.model, "rows": args.rows, "order": order,
        "rows_per_s": {d: [round(r, 2) for r in v] for d, v in runs.items()},
        "agreement_with_" + first: {d: agreement(tables[d], tables[first]) for d in args.dtypes[1:]},
        "command": "python benchmarks/studies/prior_rows.py cost " + " ".join(sys.argv[2:]),
    }


def cost_table(r: dict) -> str:
    first = next(iter(r["rows_per_s"]))
    lines = [f"# The initial matrix's rows: cost by dtype ({r['model']})", "",
             f"Machine: {r['machine']}. Rows: the first {r['rows']} token ids, each engine in its own process, "
             f"order {' '.join(r['order'])}. Command: `{r['command']}`.", "",
             "| dtype | rows/s (each run) | mean | top-1 equal to " + first + " | top-k shared with " + first + " |",
             "|---|---|---|---|---|"]
    for d, v in r["rows_per_s"].items():
        agree = r["agreement_with_" + first].get(d)
        top1 = "-" if agree is None else f"{100 * agree['top1_equal']:.1f}%"
        topk = "-" if agree is None else f"{100 * agree['topk_shared']:.1f}%"
        each = ", ".join(f"{x:.1f}" for x in v)
        lines.append(f"| {d} | {each} | {sum(v) / len(v):.1f} | {top1} | {topk} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------- worth

def worth_worker(model: str, dtype: str, spec: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import spec_bench_questions

    questions = [q["turns"][0] for q in spec_bench_questions(None, per_category=1)]
    llm = LLM(str(prepare_model(model)), speculative_config=json.loads(spec), dtype=dtype, enforce_eager=True,
              max_model_len=2048, max_num_seqs=len(questions), seed=0, disable_log_stats=False)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                       SamplingParams(temperature=0, max_tokens=WORTH_TOKENS))
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    Path(out).write_text(json.dumps({
        "tokens": tokens, "accepted": counters.get("vllm:spec_decode_num_accepted_tokens") or 0,
        "drafts": counters.get("vllm:spec_decode_num_drafts") or 0}))


def run_worth(args) -> dict:
    from vllm_recycling.prior import load_complete_prior, prior_path, save_prior
    from vllm_recycling.tools.models import prepare_model

    model_path = str(prepare_model(args.model))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    path = prior_path(model_path, None, vocab, 8)
    if not path.exists() or not load_complete_prior(path, vocab, 8).complete:
        cli = Path(sys.executable).with_name("vllm-recycling")
        subprocess.run([str(cli), "warm", model_path, "--dtype", args.prior_dtype], check=True)
    full = load_complete_prior(path, vocab, 8)
    backup = path.with_name(path.name + ".full")
    shutil.copy2(path, backup)
    rows_list = [vocab if r == "all" else min(int(r), vocab) for r in args.rows]
    results = []
    try:
        for n in rows_list:
            spec = {"method": "recycling", "budget": "fixed"}
            if n == 0:
                spec["matrix_init"] = "empty"
            else:
                table = full.table.clone()
                probs = full.probs.clone()
                table[n:], probs[n:] = 0, 0
                save_prior(path, table, probs, model_path, 0.0, rows=n, stopped=n < vocab)
            out = RESULTS / ".worth.json"
            subprocess.run([sys.executable, __file__, "_worth", "--model", args.model, "--dtype", args.dtype,
                            "--spec", json.dumps(spec), "--out", str(out)], check=True)
            got = json.loads(out.read_text())
            out.unlink()
            steps = got["tokens"] - got["accepted"]
            got.update(rows=n, tokens_per_step=round(got["tokens"] / steps, 3))
            results.append(got)
            print(f"{n} rows: {got['tokens_per_step']} tokens per step", flush=True)
    finally:
        shutil.move(backup, path)
    return {"machine": cpu_flags(), "model": args.model, "dtype": args.dtype, "vocab": vocab,
            "new_tokens": WORTH_TOKENS, "results": results,
            "command": "python benchmarks/studies/prior_rows.py worth " + " ".join(sys.argv[2:])}


def worth_table(r: dict) -> str:
    lines = [f"# The initial matrix's rows: what the first N are worth ({r['model']}, {r['dtype']})", "",
             f"Machine: {r['machine']}. The shipped Spec-Bench sample, one question per category (13), greedy, "
             f"{r['new_tokens']} new tokens, one batch, the default tree verified whole every step "
             f"(budget \"fixed\"); the initial matrix stopped after N of {r['vocab']:,} rows (0: empty). "
             f"Command: `{r['command']}`.", "",
             "| rows | share of the vocabulary | tokens | accepted | tokens per step |", "|---|---|---|---|---|"]
    for x in r["results"]:
        lines.append(f"| {x['rows']:,} | {100 * x['rows'] / r['vocab']:.0f}% | {x['tokens']} | {x['accepted']} | "
                     f"{x['tokens_per_step']:.3f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- child

def run_child(args) -> dict:
    import tempfile

    from vllm_recycling.prior import prior_path, read_prior
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.warm_checks import child_env

    model_path = str(prepare_model(args.model))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    with tempfile.TemporaryDirectory() as cache:
        env = child_env({**os.environ, "VLLM_RECYCLING_CACHE": cache})
        os.environ["VLLM_RECYCLING_CACHE"] = cache
        path = prior_path(model_path, None, vocab, 8)
        path.parent.mkdir(parents=True)
        argv = [sys.executable, "-m", "vllm_recycling.warm", "--engine-args",
                json.dumps({"model": model_path, "dtype": args.dtype}), "--topk", "8", "--out", str(path),
                "--progress", "log", "--nice", "10", "--rows", "pay"]
        started = time.monotonic()
        lines = []
        with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) as child:
            for line in child.stderr:
                if "[initial matrix]" in line:  # the model's path as the cache root's, not this machine's
                    text = line.split("] ", 1)[-1].rstrip().replace(str(Path(model_path).parent.parent), "<cache root>")
                    text = text.replace(cache, "<its cache>")
                    lines.append(f"{time.monotonic() - started:7.1f} s  {text}")
                    print(lines[-1], flush=True)
        prior = read_prior(path)
    return {"machine": cpu_flags(), "model": args.model, "dtype": args.dtype, "vocab": vocab,
            "exit": child.returncode, "seconds": round(time.monotonic() - started, 1), "rows": prior.rows,
            "stopped": prior.stopped, "log": lines,
            "command": "python benchmarks/studies/prior_rows.py child " + " ".join(sys.argv[2:])}


def child_table(r: dict) -> str:
    return "\n".join([
        f"# The initial matrix computed beside a server ({r['model']}, {r['dtype']})", "",
        f"Machine: {r['machine']}. The child a server starts (`python -m vllm_recycling.warm --rows pay --nice 10`), "
        f"alone on the machine, an empty cache. Command: `{r['command']}`.", "",
        f"Exit {r['exit']} after {r['seconds']} s: {r['rows']:,} of {r['vocab']:,} rows, "
        f"{'stopped on purpose' if r['stopped'] else 'complete' if r['rows'] == r['vocab'] else 'partial'}. Its log "
        "(seconds since it started):", "", "```", *r["log"], "```", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cost = sub.add_parser("cost")
    cost.add_argument("--model", default="smollm2")
    cost.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    cost.add_argument("--rows", type=int, default=1024)
    worth = sub.add_parser("worth")
    worth.add_argument("--model", default="smollm2")
    worth.add_argument("--dtype", default="float32", help="the serving engine's")
    worth.add_argument("--prior-dtype", default="float32", help="the prior's, when it is computed first")
    worth.add_argument("--rows", nargs="+", default=["0", "2048", "12288", "24064", "all"])
    child = sub.add_parser("child")
    child.add_argument("--model", default="qwen2.5-coder-0.5b")
    child.add_argument("--dtype", default="bfloat16", help="the server's")
    for name in ("_cost", "_worth"):
        w = sub.add_parser(name)
        w.add_argument("--model")
        w.add_argument("--dtype")
        w.add_argument("--rows", type=int)
        w.add_argument("--spec")
        w.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.what == "_cost":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return cost_worker(args.model, args.dtype, args.rows, args.out)
    if args.what == "_worth":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return worth_worker(args.model, args.dtype, args.spec, args.out)
    run, table_of = {"cost": (run_cost, cost_table), "worth": (run_worth, worth_table),
                     "child": (run_child, child_table)}[args.what]
    report = run(args)
    table = table_of(report)
    print(table)
    stem = f"prior_rows_{args.what}_{args.model}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"{stem}.md").write_text(table)


if __name__ == "__main__":
    main()
