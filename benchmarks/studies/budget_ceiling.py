"""How much of the tree's acceptance the adaptive budget takes: the whole tree verified every step
(``budget: "fixed"``, every node of "2.2.2" and the context chain) against the default, on the
same prompts, and the best fixed subsets of the tree read from the whole tree's accepted paths.

    python benchmarks/studies/budget_ceiling.py --model qwen2.5-coder-0.5b --dtype bfloat16

The whole tree's run records, per decode step, the template nodes of the path it accepted.
A subset of nodes (closed under parents) would have accepted the longest prefix of that path
inside it, so the best subset of B nodes (grown greedily, a node at a time, by what it adds) is
what a fixed tree of B nodes could accept at most on those steps, had the matrix learnt what it
learnt from the whole tree (every verified row writes its successors: a smaller tree teaches it
less). How much less: ``--taught`` sizes run again with each step verifying only its top B nodes by
the budget's survival, against the same choice read from the whole tree's run. Writes
``benchmarks/results/budget_ceiling_<model>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: spec_bench
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
    predicted: list[list[float]] = []  # per decode step with a path: the budget's survival of every node
    requests: list[str] = []  # per decode step with a path: its request
    by_proposal: dict[int, list[float]] = {}
    verify = proposer_module.RecyclingProposer.verify

    def recording(self, *a, **k):  # the accepted path of the step's (one) request, as template nodes
        out = verify(self, *a, **k)
        record = self.record
        if record is not None and record.verification is not None and record.verification.path is not None:
            sent = record.proposal.sent.get(self.batch[0])
            if sent is not None:
                paths.append([int(sent[0][j - 1]) for j in record.verification.path[0].tolist() if j > 0])
                requests.append(self.batch[0])
                if by_proposal:
                    predicted.append(by_proposal.pop(id(record.proposal), None))
        return out

    proposer_module.RecyclingProposer.verify = recording
    budget = spec.get("budget", "")
    if budget == "every node" or budget.startswith("top "):  # the budget's machinery, its admission fixed
        import vllm_recycling.adaptive_budget as budget_module
        from vllm_recycling.budget import Admission

        size = None if budget == "every node" else int(budget.split()[1])
        last: list = []
        propose = budget_module.AdaptiveBudget.propose

        def proposing(self, *a, **k):
            drafts, proposal = propose(self, *a, **k)
            if last:
                by_proposal[id(proposal)] = last.pop()
            return drafts, proposal

        def admit_fixed(survival, chain, num_decoding, base_tokens, cost):
            """every node, or the `size` nodes of highest survival (ties: the lower node, so a
            parent before its child, as ``budget.admit`` and ``ranked_subsets`` take them)"""
            survival = np.asarray(survival)
            last[:] = [survival[0].tolist()]  # one request: its nodes' predicted survival
            mask = np.ones(survival.size, dtype=bool)
            if size is not None:
                mask[np.argsort(-survival.reshape(-1), kind="stable")[size:]] = False
            mask = mask.reshape(survival.shape)
            return Admission(mask, int(mask.sum()), survival.shape[0], float(num_decoding + survival[mask].sum()),
                             float(cost(base_tokens + mask.sum(), survival.shape[0], 1)))

        budget_module.admit = admit_fixed
        budget_module.nothing_pays = lambda *a, **k: False
        budget_module.AdaptiveBudget.propose = proposing
        spec = {key: value for key, value in spec.items() if key != "budget"}
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
            "paths": paths, "parents": parents, "predicted": predicted, "requests": requests}


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


def ranked_subsets(paths: list[list[int]], scores: list, parents: list[int]) -> dict[int, float]:
    """B -> accepted tokens per decode step (the bonus token included) when each step verifies
    the B nodes a ranking scores highest (scores[i][v - 1]: node v's at step i; a node is taken
    only after its parent, so every step's choice is a tree)."""
    out = {}
    steps = [(p, s) for p, s in zip(paths, scores) if s is not None]
    for size in SIZES:
        total = 0
        for path, score in steps:
            chosen: set[int] = set()
            frontier = {v for v in range(1, len(parents)) if parents[v] == 0}
            while len(chosen) < size and frontier:
                v = max(frontier, key=lambda u: (score[u - 1], -u))
                chosen.add(v)
                frontier.discard(v)
                frontier |= {u for u in range(1, len(parents)) if parents[u] == v}
            for node in path:
                if node not in chosen:
                    break
                total += 1
        out[size] = round(1 + total / max(len(steps), 1), 3)
    return out


def expected_tokens(scores: list, parents: list[int]) -> dict[int, float]:
    """B -> what a ranking expects of its own top B nodes per decode step: 1 + the sum of their
    scores (a survival is the chance that the node is accepted), averaged over the steps. Against
    ``ranked_subsets`` it shows whether the ranking over- or underestimates."""
    out = {}
    steps = [s for s in scores if s is not None]
    for size in SIZES:
        total = 0.0
        for score in steps:
            chosen: set[int] = set()
            frontier = {v for v in range(1, len(parents)) if parents[v] == 0}
            while len(chosen) < size and frontier:
                v = max(frontier, key=lambda u: (score[u - 1], -u))
                chosen.add(v)
                total += score[v - 1]
                frontier.discard(v)
                frontier |= {u for u in range(1, len(parents)) if parents[u] == v}
        out[size] = round(1 + total / max(len(steps), 1), 3)
    return out


def online_scores(paths: list[list[int]], scores: list, parents: list[int], prior: float = 2.0) -> dict[str, list]:
    """Rankings learnt online from the steps before each step (what a budget could know then),
    per step over the nodes: "per node": each node's acceptance rate below an accepted parent
    (hits + prior * 0.1 over trials + prior), multiplied along its path; "budget x per node":
    the budget's own edges (survival over the parent's survival), each times its node's
    learnt ratio of hits to the budget's expected hits (shrunk toward 1 by ``prior`` trials)."""
    n = len(parents)
    trials, hits, expected = np.zeros(n), np.zeros(n), np.zeros(n)
    per_node, corrected = [], []
    order = sorted(range(1, n), key=lambda v: (depth_of(v, parents), v))
    for path, score in zip(paths, scores):
        if score is None:
            per_node.append(None)
            corrected.append(None)
            continue
        surv = np.concatenate([[1.0], np.asarray(score, dtype=np.float64)])
        edge = np.where(surv[parents] > 0, surv / np.maximum(surv[parents], 1e-12), 0.0)
        rate = (hits + 0.1 * prior) / (trials + prior)
        ratio = (hits + prior) / (expected + prior)
        a, b = np.ones(n), np.ones(n)
        for v in order:
            a[v] = a[parents[v]] * rate[v]
            b[v] = b[parents[v]] * min(1.0, edge[v] * ratio[v])
        per_node.append(a[1:].tolist())
        corrected.append(b[1:].tolist())
        won = np.zeros(n, dtype=bool)
        won[0] = True
        won[path] = True
        tried = won[parents]
        tried[0] = False
        trials[tried] += 1
        hits[tried & won] += 1
        expected[tried] += edge[tried]
    return {"per node": per_node, "budget x per node": corrected}


def depth_of(v: int, parents: list[int]) -> int:
    d = 0
    while v:
        v, d = parents[v], d + 1
    return d


def taught_table(runs: dict, taught: list[int], whole_ranked: dict[int, float]) -> list[str]:
    """What verifying fewer nodes does to what the matrix learns: each step's top B nodes by the
    budget's survival verified alone (the matrix and the calibration taught by those rows only)
    against the same choice read from the whole tree's run (taught by every node)."""
    if not taught:
        return []
    rows = []
    for b in taught:
        alone = runs[f"top{b}"]
        per_decode = 1 + sum(map(len, alone["paths"])) / max(len(alone["paths"]), 1)
        alone["tokens_per_decode_step"] = round(per_decode, 3)
        rows.append(f"| {b} | {whole_ranked[b]:.2f} | {per_decode:.2f} | {per_decode / whole_ranked[b]:.3f} | "
                    f"{alone['tokens_per_step']:.2f} | {alone['drafts_per_step']:.1f} | "
                    f"{1000 * alone['seconds'] / alone['steps']:.0f} | {alone['tokens_per_s']:.1f} |")
    return [
        "What verifying fewer nodes does to what the matrix learns (every verified row writes its token's "
        "successors; a node not verified teaches nothing): each step's top B nodes by the budget's survival, "
        "verified alone, against the same choice read from the whole tree's run above (accepted tokens per "
        "decode step, the bonus token included):", "",
        "| B | taught by the whole tree | taught by the B nodes alone | ratio | alone: tokens per step (every step) "
        "| drafts per step | ms per step | tokens/s |",
        "|---|---|---|---|---|---|---|---|", *rows, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--questions")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--taught", default="4,8,15",
                        help="sizes B (from %s) run alone: each step verifies only its top B nodes by the budget's "
                        "survival, so the matrix learns from those rows only (empty: none)" % (SIZES,))
    parser.add_argument("--steps", help="also write the whole tree's steps (paths, survivals) to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    taught = [int(b) for b in args.taught.split(",") if b]
    if any(b not in SIZES for b in taught):
        parser.error(f"--taught: each size one of {SIZES}")
    if args.worker:
        budget = {"whole": "every node", "default": None}.get(args.worker, f"top {args.worker.removeprefix('top')}")
        spec = {"method": "recycling", **({"budget": budget} if budget else {})}
        Path(args.out).write_text(json.dumps(run(args, spec)))
        return
    import subprocess
    import tempfile

    ensure_model_prior(args.model, args.dtype)
    runs = {}
    for worker in ("whole", "default", *(f"top{b}" for b in taught)):  # each in a process of its own
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "--worker", worker, "--out", f.name, "--model", args.model,
                            "--dtype", args.dtype, "--per-category", str(args.per_category), "--seed",
                            str(args.seed), "--max-tokens", str(args.max_tokens)], check=True)
            runs[worker] = json.loads(Path(f.name).read_text())
    whole = runs["whole"]
    subsets = best_subsets(whole["paths"], whole["parents"])
    rankings = {"the budget's survival": ranked_subsets(whole["paths"], whole["predicted"], whole["parents"])}
    expected = expected_tokens(whole["predicted"], whole["parents"])
    for name, scores in online_scores(whole["paths"], whole["predicted"], whole["parents"]).items():
        rankings[name] = ranked_subsets(whole["paths"], scores, whole["parents"])
    decode_steps = len(whole["paths"])
    head = run_header("studies/budget_ceiling.py", args.model)
    rows = [f"| the whole tree, every step (every node admitted, {len(whole['parents']) - 1} nodes) | {whole['tokens_per_step']:.2f} | "
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
        "| best fixed subset | " + " | ".join(f"{v:.2f}" for v in subsets.values()) + " |",
        *(f"| each step's top nodes by {name} | " + " | ".join(f"{v:.2f}" for v in ranked.values()) + " |"
          for name, ranked in rankings.items()),
        "| what the budget expected of its top nodes | " + " | ".join(f"{v:.2f}" for v in expected.values()) + " |",
        "",
        "Each step's top nodes: the B nodes a ranking scores highest at that step (taken parent first), the "
        "rankings learnt online from the steps before it: the budget's survival as the run computed it; "
        "per node, each template node's own acceptance below an accepted parent, multiplied along its path; "
        "the budget's edges times each node's learnt ratio of hits to the budget's expected hits.", "",
        *taught_table(runs, taught, rankings["the budget's survival"])])
    (RESULTS / f"budget_ceiling_{args.model}.md").write_text(text)
    (RESULTS / f"budget_ceiling_{args.model}.json").write_text(json.dumps(
        {**head, "runs": {k: {x: y for x, y in v.items() if x not in ("paths", "parents", "predicted", "requests")} for k, v in runs.items()},
         "best_subsets": subsets, "rankings": rankings, "expected": expected, "decode_steps": decode_steps},
        indent=1) + "\n")
    if args.steps:  # every decode step's accepted path and the budget's survivals, for other analyses
        Path(args.steps).write_text(json.dumps({k: whole[k] for k in ("paths", "predicted", "parents", "requests")}))
    print(text)


if __name__ == "__main__":
    main()
