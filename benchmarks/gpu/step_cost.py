"""What a step costs inside vLLM's engine, with everything vLLM and the plugin do per step:
plain steps (no speculation) against steps verifying trees of k nodes per request, at several
batch sizes, on a model of any shape with random weights (``load_format="dummy"``).

    python benchmarks/gpu/step_cost.py --model benchmarks/gpu/llama3-8b-config --method none --out none.json
    python benchmarks/gpu/step_cost.py --model benchmarks/gpu/llama3-8b-config --method recycling --out rec.json

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and each call of
``LLMEngine.step()`` is one scheduler step: schedule, inputs, forward, sampling or
verification, the drafter's work, outputs. For each batch size B, B requests of --prompt-len
random tokens (greedy, ``ignore_eos``) are added and stepped until each has its first token;
then --warmup steps, then --steps timed steps (median, mean, min in ms), then they are aborted.

recycling: the engine starts with ``{"method": "recycling", "matrix_init": "empty"}`` (budget
"auto", the default tree and context branch). First each B under the adaptive budget, the
nodes it sends per request per step recorded, with what its cost model then says a node must
survive to pay (``cost_model.break_even``). Then, for each k of --nodes, the drafter is switched in
place (``collective_rpc``) to budget "fixed" over the first k nodes of the default tree
"2.2.2" (breadth-first) without the context branch: the drafts of the start-up configuration
``{"method": "recycling", "tree": "2.2.2", "budget": "fixed", "num_speculative_tokens": k,
"context_match": false}``, every request k nodes every step, without an engine start per k.
With random weights the accepted tokens say nothing about a real model; the times do.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import common

PLAIN = "plain"


def sent_recorder(worker) -> None:
    """For ``collective_rpc``: record how many drafts each ``propose`` call gives each request
    (``drafter.sent_log``, one list per step)."""
    drafter = worker.model_runner.drafter
    if not hasattr(drafter, "sent_log"):
        original = drafter.propose

        def propose(*args, **kwargs):
            drafts = original(*args, **kwargs)
            drafter.sent_log.append([len(d) for d in drafts])
            return drafts

        drafter.propose = propose
    drafter.sent_log = []


def sent_log(worker) -> list[list[int]]:
    return list(worker.model_runner.drafter.sent_log)


def budget_state(batch: int):
    """For ``collective_rpc``: the adaptive budget's cost model now and the survival a node
    must have to pay at ``batch`` decoding requests (``cost_model.break_even``)."""

    def state(worker) -> dict:
        from vllm_recycling.cost_model import break_even

        drafter = worker.model_runner.drafter
        budget = drafter.budget
        if budget is None:
            return {}
        cost = budget.cost
        nodes = drafter.hybrid.tree.num_nodes
        return {"agreed_abcd": [float(x) for x in cost.agreed], "profile_sizes": [float(x) for x in cost.sizes],
                "profile_ms": [1e3 * float(x) for x in cost.seconds], "observed_steps": int(cost.observed),
                "break_even_survival": break_even(cost, batch, batch, batch * nodes),
                "predicted_ms": {n: 1e3 * float(cost(batch * (1 + n), int(n > 0) * batch, int(n > 0)))
                                 for n in (0, 1, 4, 8, 16, 32, 80)}}

    return state


def fixed_config(config, k: int):
    """``config`` (a ``RecyclingConfig``) drafting the first k nodes of tree "2.2.2", budget
    "fixed", no context branch: the start-up configuration {"tree": "2.2.2", "budget": "fixed",
    "num_speculative_tokens": k, "context_match": false} with config's other keys."""
    import dataclasses

    return dataclasses.replace(config, tree="2.2.2", budget="fixed", context_match=False, num_speculative_tokens=k)


def fixed_nodes(k: int):
    """For ``collective_rpc``: the drafter switched to ``fixed_config(k)`` in place; the
    verifier keeps how KV moves (found at start-up)."""

    def switch(worker) -> int:
        from vllm_recycling.step import NO_PROPOSAL

        drafter = worker.model_runner.drafter
        old = drafter.verifier
        drafter._drafting(fixed_config(drafter.config, k))
        drafter.verifier.move_kv, drafter.verifier.scratch_blocks = old.move_kv, old.scratch_blocks
        drafter.proposal = NO_PROPOSAL
        return drafter.template.num_nodes

    return switch


def measure(llm, batch: int, args, tag: str) -> dict:
    """B requests, stepped to their first token, --warmup steps, --steps timed ones, aborted."""
    from vllm import SamplingParams

    from vllm_recycling.metrics import spec_decode_counters

    engine = llm.llm_engine
    vocab = engine.model_config.get_vocab_size()
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_model_len - args.prompt_len - 8,
                            ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    produced = dict.fromkeys(ids, 0)

    def step() -> float:
        t0 = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - t0
        for out in outs:
            if out.request_id in produced:
                produced[out.request_id] = len(out.outputs[0].token_ids)
        return seconds

    for _ in range(64):  # the prefill (possibly chunked)
        if min(produced.values()) > 0:
            break
        step()
    for _ in range(args.warmup):
        step()
    before, counted = sum(produced.values()), spec_decode_counters(llm)
    times = [step() for _ in range(args.steps)]
    tokens = sum(produced.values()) - before
    drafted = spec_decode_counters(llm)["draft_tokens"] - counted["draft_tokens"]
    engine.abort_request(ids)
    for _ in range(16):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    ms = [1e3 * t for t in times]
    return {"batch": batch, "steps": len(ms), "ms_median": round(statistics.median(ms), 3),
            "ms_mean": round(statistics.fmean(ms), 3), "ms_min": round(min(ms), 3),
            "tokens_per_step_per_request": round(tokens / (len(ms) * batch), 3),
            # what vLLM counted as drafted in the timed steps (the nodes verified)
            "drafted_per_step_per_request": round(drafted / (len(ms) * batch), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a folder with config.json (weights: dummy)")
    parser.add_argument("--method", choices=("none", "recycling"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--nodes", default="1,4,8,16,32,80")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--auto-steps", type=int, default=40, help="timed steps under the adaptive budget")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--sync", action="store_true",
                        help="async scheduling off (vLLM turns it on for plain engines, off for recycling's)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    batches = [int(b) for b in args.batches.split(",")]
    spec = {"method": "recycling", "matrix_init": "empty"} if args.method == "recycling" else None
    kwargs = common.engine_kwargs(args.dtype, max(batches), spec, max_model_len=args.max_model_len,
                                  load_format="dummy", skip_tokenizer_init=True,
                                  max_num_batched_tokens=max(4096, max(batches) * 97))
    if args.sync:
        kwargs["async_scheduling"] = False
    if common.on_gpu():
        kwargs["gpu_memory_utilization"] = float(os.environ.get("UTIL", "0.6"))
    result = {"method": args.method, "model": args.model, "dtype": args.dtype, "speculative_config": spec,
              "machine": common.machine(), "rows": []}
    started = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    result["start_seconds"] = round(time.perf_counter() - started, 1)
    config = llm.llm_engine.vllm_config
    result["async_scheduling"] = bool(config.scheduler_config.async_scheduling)
    result["model_runner_v2"] = bool(getattr(config, "use_v2_model_runner", False))
    if spec is not None:
        result["worker"] = llm.collective_rpc(common.worker_state)[0]
    common.write_json(args.out, result)
    print(f"step_cost: {args.method}: engine up in {result['start_seconds']} s", flush=True)

    if spec is None:
        for b in batches:
            mode = "plain, async scheduling off" if args.sync else PLAIN
            row = {"mode": mode, "nodes": 0, **measure(llm, b, args, f"plain{b}")}
            result["rows"].append(row)
            common.write_json(args.out, result)
            print("step_cost:", row, flush=True)
        common.shutdown(llm)
        return
    auto = argparse.Namespace(**{**vars(args), "steps": args.auto_steps})
    for b in batches:
        llm.collective_rpc(sent_recorder)
        row = {"mode": "auto", "nodes": None, **measure(llm, b, auto, f"auto{b}")}
        log = llm.collective_rpc(sent_log)[0]
        timed = [n for step in log[-args.auto_steps:] for n in step]
        row["nodes_sent_mean"] = round(statistics.fmean(timed), 3) if timed else None
        row["nodes_sent_max"] = max(timed) if timed else None
        row["budget"] = llm.collective_rpc(budget_state(b))[0]
        result["rows"].append(row)
        common.write_json(args.out, result)
        print("step_cost:", {k: v for k, v in row.items() if k != "budget"}, flush=True)
    for k in [int(n) for n in args.nodes.split(",")]:
        nodes = llm.collective_rpc(fixed_nodes(k))[0]
        for b in batches:
            row = {"mode": "fixed", "nodes": nodes, **measure(llm, b, args, f"fixed{k}-{b}")}
            result["rows"].append(row)
            common.write_json(args.out, result)
            print("step_cost:", row, flush=True)
    common.shutdown(llm)


if __name__ == "__main__":
    main()
