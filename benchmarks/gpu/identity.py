"""One engine's answers for the greedy-identity check of ``check.sh``: a model (the randomly
initialised SmolLM2-shaped checkpoint there), a dtype, and either no speculation or recycling's
default configuration.

    python benchmarks/gpu/identity.py --model DIR --dtype float32 --method recycling --out F.json

Per prompt (the first --prompts of the shipped Spec-Bench sample, as chats): greedy answers at
batch 1 (one prompt at a time) and at batch --batch (all at once), each position's top-5
logprobs kept; seeded sampled answers (temperature 0.8, top-p 0.95, seed = the prompt's index)
of the first --seeded prompts at batch 1. With recycling also what the worker reports
(``common.worker_state``: tree verification on, the attention implementations, the initial
matrix) and the priors in the plugin's cache. The JSON is rewritten after each part, so a run
stopped midway keeps what it did. ``report.py`` compares the runs prompt by prompt
(``benchmarks/greedy_identity.py``'s ``compare``).
"""

from __future__ import annotations

import argparse
import time

import common

SEEDED = dict(temperature=0.8, top_p=0.95)  # as benchmarks/greedy_identity.py samples
TOP = 5


def answers(outputs) -> dict:
    """Token ids and, per position, the top-5 (token, logprob) pairs, best first."""
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "top": [[sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])[:TOP]
                     for pos in (o.outputs[0].logprobs or [])] for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--method", choices=("none", "recycling"), required=True)
    parser.add_argument("--spec", help="speculative_config JSON for --method recycling (default: its default)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seeded", type=int, default=4)
    args = parser.parse_args()

    import json

    from vllm import LLM, SamplingParams

    from vllm_recycling.metrics import spec_decode_counters

    spec = None
    if args.method == "recycling":
        spec = json.loads(args.spec) if args.spec else {"method": "recycling"}
    prompts = [{"prompt_token_ids": p} for p in common.chat_prompts(args.model, args.prompts)]
    result = {"method": args.method, "dtype": args.dtype, "speculative_config": spec, "model": args.model,
              "prompts": len(prompts), "max_tokens": args.tokens, "batch": args.batch, "machine": common.machine()}
    started = time.perf_counter()
    llm = LLM(args.model, **common.engine_kwargs(args.dtype, args.batch, spec))
    result["start_seconds"] = round(time.perf_counter() - started, 1)
    if spec is not None:
        result["worker"] = llm.collective_rpc(common.worker_state)[0]
        result["priors"] = common.priors()
    common.write_json(args.out, result)
    print(f"identity: {args.method} {args.dtype}: engine up in {result['start_seconds']} s; "
          f"{result.get('worker', '')}", flush=True)

    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, logprobs=TOP)
    t0 = time.perf_counter()
    result["greedy_batch_1"] = answers([llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts])
    result["seconds_batch_1"] = round(time.perf_counter() - t0, 2)
    result["counters_after_batch_1"] = spec_decode_counters(llm)
    common.write_json(args.out, result)
    t0 = time.perf_counter()
    result[f"greedy_batch_{args.batch}"] = answers(llm.generate(prompts, greedy, use_tqdm=False))
    result[f"seconds_batch_{args.batch}"] = round(time.perf_counter() - t0, 2)
    common.write_json(args.out, result)
    seeded = [SamplingParams(max_tokens=args.tokens, logprobs=TOP, seed=i, **SEEDED) for i in range(args.seeded)]
    result["seeded_batch_1"] = answers([llm.generate([p], sp, use_tqdm=False)[0]
                                        for p, sp in zip(prompts[: args.seeded], seeded)])
    result["counters"] = spec_decode_counters(llm)
    common.write_json(args.out, result)
    tokens = sum(len(t) for t in result["greedy_batch_1"]["tokens"])
    c = result["counters_after_batch_1"]
    print(f"identity: {args.method} {args.dtype}: batch 1 {tokens} tokens in {result['seconds_batch_1']} s, "
          f"{tokens / max(1, tokens - c['accepted']):.2f} tokens per step; counters {result['counters']}", flush=True)
    common.shutdown(llm)


if __name__ == "__main__":
    main()
