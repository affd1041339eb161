"""Tokens per second and tokens per step of one speculative method on a real checkpoint, at
batch 1 (prompts one at a time) and at batch B (all prompts at once, at most B running), greedy,
in one engine (``carry_smollm2.sh`` runs it for none, ngram and recycling on SmolLM2).

    python benchmarks/gpu/speed.py --model DIR --method "recycling auto" --out F.json

--method is a name of ``benchmarks/spec_bench.py`` (``none``, ``ngram default``, ``recycling
auto``, ...). Prompts: the shipped Spec-Bench sample in file order, as chats; batch 1 takes the
first --prompts-1, batch B the first --prompts-b. Figures as ``spec_bench.py`` computes them
(tokens per step: every emitted token over every verification step). Ratios only mean
something against no speculation run the same way on the same machine.
"""

from __future__ import annotations

import argparse
import time

import common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompts-1", type=int, default=13)
    parser.add_argument("--prompts-b", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from spec_bench import _figures, speculative_config
    from vllm_recycling.metrics import spec_decode_counters

    spec = speculative_config(args.method)
    prompts = [{"prompt_token_ids": p} for p in common.chat_prompts(args.model, max(args.prompts_1, args.prompts_b))]
    result = {"method": args.method, "speculative_config": spec, "model": args.model, "dtype": args.dtype,
              "max_tokens": args.tokens, "machine": common.machine(), "runs": {}}
    started = time.perf_counter()
    llm = LLM(args.model, **common.engine_kwargs(args.dtype, args.batch, spec))
    result["start_seconds"] = round(time.perf_counter() - started, 1)
    if spec is not None and spec.get("method") == "recycling":
        result["worker"] = llm.collective_rpc(common.worker_state)[0]
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    llm.generate([prompts[-1]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    common.write_json(args.out, result)
    for name, group, at_once in (("batch 1", prompts[: args.prompts_1], False),
                                 (f"batch {args.batch}", prompts[: args.prompts_b], True)):
        c0 = spec_decode_counters(llm)
        t0 = time.perf_counter()
        if at_once:
            outs = llm.generate(group, params, use_tqdm=False)
        else:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in group]
        seconds = time.perf_counter() - t0
        c1 = spec_decode_counters(llm)
        totals = {"prompts": len(outs), "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds,
                  **{k: c1[k] - c0[k] for k in ("accepted", "drafts", "draft_tokens")}}
        result["runs"][name] = {**_figures(totals), "answers": [list(o.outputs[0].token_ids) for o in outs]}
        common.write_json(args.out, result)
        f = result["runs"][name]
        print(f"speed: {args.method}, {name}: {f['tokens']} tokens, {f['tokens_per_s']} tokens/s, "
              f"{f['tokens_per_step']} tokens per step", flush=True)
    common.shutdown(llm)


if __name__ == "__main__":
    main()
