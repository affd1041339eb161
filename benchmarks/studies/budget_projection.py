"""A projection, not a measurement, and an upper bound: what the adaptive budget (``budget:
"auto"``) would gain on an H100, from the H100's measured verification costs and acceptance
measured here. Upper bound: the costs are CUDA-graph replays of whole steps, while tree mode
runs attention outside graphs (piecewise graphs), and the budget's own work per step is not
charged (it is timed here on this machine, and by ``make gpu`` on a GPU).

    python benchmarks/studies/budget_projection.py          # trace SmolLM2, project, time the budget

1. Acceptance: the reference decoder (``vllm_recycling.tools.reference``, plain transformers, batch 1,
   greedy) verifies the whole "2.2.2" tree at every step on the shipped Spec-Bench sample and
   records, per step, each node's confidence (what the budget sees) and whether its token is the
   target's at its parent (what any subtree of it would have accepted).
2. Cost: ``benchmarks/results/verify_cost_nvidia-h100-80gb-hbm3.json`` (CUDA-graph replays of
   Llama-shaped decoders at batch 1..64 for 1, 7, 17, 33 and 81 tokens per request). A step of
   T tokens costs what the next measured size up costs (a staircase: conservative for the
   budget, whose steps fall between the measured sizes; the fixed trees sit on them).
3. Per batch size b: rounds of b trace steps drawn at random (seeded), as b requests verified
   together; the budget code of the plugin (``budget.Calibration``, ``budget.admit``) learns
   its calibration online from the nodes it admits and from the first-level nodes of requests
   it sends nothing, as the proposer does (50 rounds of warm-up, then 300 measured)
   and chooses each round's nodes with the H100 cost of that batch size. Fixed trees verify
   the rank-0 chain of "2.2.2" (6 nodes, as chain6) or its first 16, 32 or 80 nodes. Speed-up
   = tokens per second over plain decoding's at the same batch size.

Also times the budget's own work per step on this machine (survival + admission, after the
drafts exist) at each batch size. Writes ``benchmarks/results/budget_projection.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: spec_bench
from spec_bench import RESULTS, run_header  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64)
UPPER_BOUND = (
    "an upper bound: the costs are whole-step CUDA-graph replays, while tree mode runs attention outside graphs (piecewise), and the budget's own work per step (0.21-0.51 ms on an H200, `make gpu`) is not charged"
)
COST_TABLE = RESULTS / "verify_cost_nvidia-h100-80gb-hbm3.json"
# fixed choices: the matrix's rank-0 chain, the first N nodes of the matrix's "2.2.2", all of
# them, and all of them with the context branch (as deep as each match has tokens)
FIXED = {"chain6": "chain", "first 16": 16, "first 32": 32, "2.2.2 (80)": 80, "2.2.2 + context": "all"}
WARMUP_ROUNDS, ROUNDS = 50, 300


def trace_reference(args) -> dict:
    """Run the reference decoder over the sample; returns {"conf": [S, M], "match": [S, M]}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_recycling.config import CONTEXT_LENGTH
    from vllm_recycling.matrix import AdjacencyMatrix
    from vllm_recycling.prior import PriorError, load_prior, prior_path
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids, spec_bench_questions
    from vllm_recycling.tools.reference import ReferenceDecoder
    from vllm_recycling.tree import load_tree

    path = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    try:  # the plugin's default start: the model's prior (`vllm-recycling warm` caches it)
        loaded = load_prior(prior_path(path, None, vocab, 8), vocab, 8)
        prior = (loaded.table, loaded.probs)
    except PriorError:
        prior = None
    matrix = AdjacencyMatrix(vocab, 8, with_probs=True, prior=prior)
    decoder = ReferenceDecoder(model, load_tree("2.2.2", 8), matrix, context_length=CONTEXT_LENGTH)
    decoder.trace = []
    for q in spec_bench_questions(per_category=args.per_category):
        decoder.generate(chat_prompt_ids(tokenizer, q["turns"][0]), args.max_tokens,
                         eos_token_id=model.config.eos_token_id)
    conf = np.array([c for c, _ in decoder.trace], dtype=np.float32)
    match = np.array([m for _, m in decoder.trace], dtype=bool)
    return {"conf": conf, "match": match}


def h100_costs() -> dict:
    """{shape: {batch: (tokens [5], seconds [5])}} from the H100 table."""
    rows = json.loads(COST_TABLE.read_text())["rows"]
    out: dict = {}
    for r in rows:
        out.setdefault(r["shape"], {}).setdefault(r["batch"], []).append((r["tokens"], r["graph_ms"] / 1e3))
    return {s: {b: tuple(np.array(v).T) for b, v in sorted(by.items())} for s, by in out.items()}


def staircase(tokens: np.ndarray, seconds: np.ndarray):
    order = np.argsort(tokens)
    tokens, seconds = tokens[order], np.maximum.accumulate(seconds[order])

    def cost(t, trees=0, drafted=0):
        t = np.asarray(t, dtype=np.float64)
        i = np.minimum(np.searchsorted(tokens, t, side="left"), len(tokens) - 1)
        beyond = t > tokens[-1]
        slope = (seconds[-1] - seconds[-2]) / (tokens[-1] - tokens[-2])
        return np.where(beyond, seconds[-1] + (t - tokens[-1]) * slope, seconds[i])

    return cost


def accepted_nodes(mask: np.ndarray, match: np.ndarray, parent: np.ndarray, levels) -> np.ndarray:
    """[b, M] bool: the nodes a greedy verification of the admitted ones accepts: admitted
    nodes whose token and every ancestor's match. mask, match [b, M] (root included, accepted)."""
    ok = np.zeros_like(mask)
    ok[:, 0] = True
    for d in range(1, len(levels) - 1):
        s, e = levels[d], levels[d + 1]
        ok[:, s:e] = ok[:, parent[s:e]] & mask[:, s:e] & match[:, s:e]
    return ok


def accepted_tokens(mask: np.ndarray, match: np.ndarray, parent: np.ndarray, levels) -> np.ndarray:
    """Per request, the draft tokens accepted (``accepted_nodes`` below the root)."""
    return accepted_nodes(mask, match, parent, levels)[:, 1:].sum(axis=1)


def simulate(trace, cost, batch: int, seed: int) -> dict:
    from vllm_recycling.budget import CONTEXT_CONF, Calibration, admit, chain_nodes
    from vllm_recycling.config import CONTEXT_LENGTH
    from vllm_recycling.tree import hybrid_tree, load_tree

    hybrid = hybrid_tree(load_tree("2.2.2", 8), CONTEXT_LENGTH, 8)
    tree = hybrid.tree
    parent = tree.parent.clamp(min=0)
    parent_np, levels = parent.numpy(), tree.level_starts
    context = np.zeros(tree.num_nodes + 1, dtype=bool)
    context[hybrid.context_nodes.numpy()] = True
    chain_np = np.concatenate([[True], chain_nodes(tree.parent, tree.rank).numpy()])
    chains = np.stack([chain_np[1:], context[1:]])
    deep = (np.arange(tree.num_nodes + 1) >= levels[2]).astype(np.int64)
    cal = Calibration()
    rng = np.random.default_rng(seed)
    fixed_masks = {}
    matrix_nodes = hybrid.matrix_nodes.numpy()
    for name, n in FIXED.items():
        if n == "chain":
            m = chain_np.copy()
        elif n == "all":
            m = np.ones(tree.num_nodes + 1, dtype=bool)  # context nodes: where they have a token
        else:
            m = np.zeros(tree.num_nodes + 1, dtype=bool)
            m[matrix_nodes[: n + 1]] = True
        fixed_masks[name] = m
    totals = {"plain": [0, 0.0], "auto": [0, 0.0], **{k: [0, 0.0] for k in FIXED}}
    admitted = 0
    for r in range(WARMUP_ROUNDS + ROUNDS):
        idx = rng.integers(0, len(trace["conf"]), size=batch)
        conf = trace["conf"][idx]
        match = trace["match"][idx]
        has_token = ~context | (conf >= CONTEXT_CONF)  # a context node without a token is never sent
        survival = cal.survival(conf, parent_np, levels) * has_token
        got = admit(survival[:, 1:], chains, batch, batch, cost)
        mask = np.concatenate([np.ones((batch, 1), bool), got.mask], axis=1)
        ok = accepted_nodes(mask, match, parent_np, levels)
        acc = ok[:, 1:].sum(axis=1)
        # what the proposer learns: admitted nodes whose parent was accepted, and for a request
        # sent nothing (from a written row) its first-level nodes, judged by the emitted token
        tried = mask & ok[:, parent_np]
        tried[:, 0] = False
        hit = ok.copy()
        first = slice(1, levels[2])
        idle = ~mask[:, 1:].any(axis=1) & (np.abs(conf[:, first]).max(axis=1) > 0)
        tried[idle, first] = True
        hit[idle, first] = match[idle, first]
        tried &= has_token
        cal.observe(cal.bins(conf, deep)[tried], hit[tried])
        if r < WARMUP_ROUNDS:
            continue
        admitted += got.num_admitted
        totals["auto"][0] += batch + int(acc.sum())
        totals["auto"][1] += float(cost(np.array([batch + got.num_admitted]))[0])
        totals["plain"][0] += batch
        totals["plain"][1] += float(cost(np.array([batch]))[0])
        for name, m in fixed_masks.items():
            sent = np.broadcast_to(m, mask.shape) & has_token
            a = accepted_tokens(sent.copy(), match, parent_np, levels)
            totals[name][0] += batch + int(a.sum())
            totals[name][1] += float(cost(np.array([int(sent.sum())]))[0])
    plain_rate = totals["plain"][0] / totals["plain"][1]
    out = {"admitted_per_request": admitted / ROUNDS / batch}
    for name, (tokens, seconds) in totals.items():
        out[name] = {"tokens_per_step": tokens / ROUNDS / batch, "ms_per_step": 1e3 * seconds / ROUNDS,
                     "speedup": tokens / seconds / plain_rate}
    return out


def time_budget(batch: int, reps: int = 50, device: str | torch.device = "cpu") -> float:
    """Median seconds of the budget's per-step work after drafting, as the proposer does it
    (``AdaptiveBudget.propose``): drafts and confidences read to the host in one copy, survival,
    admission and calibration bins there. With the drafts on ``device``; ``benchmarks/kernels.py``
    calls it on a GPU."""
    from vllm_recycling.budget import Calibration, admit, chain_nodes, to_host
    from vllm_recycling.cost_model import StepCost
    from vllm_recycling.tree import load_tree

    tree = load_tree("2.2.2", 8)
    parent = tree.parent.clamp(min=0).numpy()
    chain = chain_nodes(tree.parent, tree.rank).numpy()
    deep = (np.arange(1, tree.num_nodes + 1) >= tree.level_starts[2]).astype(np.int64)
    cal, cost = Calibration(), StepCost([1, 64, 512], [0.03, 0.06, 0.5])
    gen = torch.Generator().manual_seed(batch)
    conf = torch.rand(batch, tree.num_nodes + 1, generator=gen).to(device)
    tokens = torch.randint(0, 32000, (batch, tree.num_nodes + 1), generator=gen, dtype=torch.int32).to(device)
    runs = []
    for _ in range(reps + 5):  # the first calls (allocations, kernel loads) not counted
        t0 = time.perf_counter()
        _, conf_np = to_host(tokens, conf)
        survival = cal.survival(conf_np, parent, tree.level_starts)
        admit(survival[:, 1:], chain, batch, batch, cost)
        cal.bins(conf_np[:, 1:], deep)
        runs.append(time.perf_counter() - t0)
    return float(np.median(runs[5:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", help="an .npz trace to read (written there when missing)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    if args.trace and Path(args.trace).exists():
        trace = dict(np.load(args.trace))
    else:
        trace = trace_reference(args)
        if args.trace:
            np.savez_compressed(args.trace, **trace)
    from vllm_recycling.tree import load_tree

    tree = load_tree("2.2.2", 8)
    steps = len(trace["conf"])
    full_mat = 1 + accepted_tokens(np.ones_like(trace["match"]), trace["match"],
                                   tree.parent.clamp(min=0).numpy(), tree.level_starts).mean()
    rows = []
    for shape, by_batch in h100_costs().items():
        for batch in BATCHES:
            tokens, seconds = by_batch[batch]
            sim = simulate(trace, staircase(tokens, seconds), batch, args.seed)
            best = max(FIXED, key=lambda k: sim[k]["speedup"])
            rows.append({"shape": shape, "batch": batch, **sim, "best_fixed": best,
                         "auto_vs_best": sim["auto"]["speedup"] / max(sim[best]["speedup"], 1.0)})
    budget_ms = {b: 1e3 * time_budget(b) for b in BATCHES}

    report = {"header": run_header("studies/budget_projection.py", args.model), "model": args.model, "steps": steps,
              "full_tree_tokens_per_step": float(full_mat), "rows": rows, "budget_ms": budget_ms}
    text = markdown(report)
    print(text)
    (RESULTS / "budget_projection.md").write_text(text)
    (RESULTS / "budget_projection.json").write_text(json.dumps(report, indent=1))


def markdown(report: dict) -> str:
    header, rows = report["header"], report["rows"]
    budget_ms = {int(b): ms for b, ms in report["budget_ms"].items()}
    lines = [
        "# Adaptive budget on an H100: a projection", "",
        f"{header['date']}; {header['machine']}; torch {torch.__version__}. "
        f"Command: `{header['command']}`.", "",
        f"**A projection, not a measurement, and {UPPER_BOUND}**. Acceptance from the reference decoder "
        f"({report.get('model', 'smollm2')}, greedy, {report['steps']} steps verifying the whole 2.2.2 tree, mean "
        f"{report['full_tree_tokens_per_step']:.2f} tokens per step), "
        "costs from the H100 verification table (`verify_cost_nvidia-h100-80gb-hbm3.md`, CUDA graphs, "
        "a staircase between measured sizes), the plugin's own budget code choosing the nodes. "
        "Speed-up: tokens per second over plain decoding at the same batch size; `vs best`: auto "
        "over the best of plain decoding and the fixed trees.", "",
        "| shape | batch | auto nodes/request | auto tokens/step | auto | " + " | ".join(FIXED)
        + " | best fixed | auto vs best |",
        "|---|" + "---|" * (len(FIXED) + 6),
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['admitted_per_request']:.1f} | {r['auto']['tokens_per_step']:.2f} | "
            f"{r['auto']['speedup']:.2f}x | " + " | ".join(f"{r[k]['speedup']:.2f}x" for k in FIXED)
            + f" | {r['best_fixed']} | {r['auto_vs_best']:.3f} |")
    lines += ["", "The budget's own work per step on this machine (survival and admission over the batch's "
              "trees, after drafting), median of 50:", "",
              "| batch | " + " | ".join(str(b) for b in BATCHES) + " |",
              "|---|" + "---|" * len(BATCHES),
              "| ms | " + " | ".join(f"{budget_ms[b]:.2f}" for b in BATCHES) + " |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
