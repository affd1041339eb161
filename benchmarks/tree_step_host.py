"""The host work of one tree step on the CPU path, piece by piece, at SmolLM2-135M's shapes (30
layers, 9 heads, 3 key/value heads, head size 64, vocabulary 49,152), for 1 and 16 requests of
17-row trees (the default template's first 16 nodes) over 300-token prefixes: what a step costs
beyond the model's forward, where the budget's tree cost comes from.

- plan: ``TreeStep.plan`` and ``position_offsets`` (once per step);
- tree attention: ``cpu_attention.PathPlan`` built once and run in 30 layers (vLLM's own kernel
  on each node's path);
- path choice: ``choose_paths`` + ``ChainPlan.build`` over the step's logits;
- KV moves: ``compaction`` + ``native.move_slots`` of a 4-node path in 30 layers' caches in one
  call (what the CPU path runs), and layer by layer with ``cpu_attention.move_slots`` (PyTorch);
- drafts: ``native.draft`` of the 80-node template; context match: ``context_match`` over
  300-token histories.

    python benchmarks/tree_step_host.py     # writes benchmarks/results/tree_step_host.{md,json}
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import cpu_model  # noqa: E402

from vllm_recycling.cpu_attention import PathPlan, attention_isa, move_slots  # noqa: E402
from vllm_recycling.kernels import native  # noqa: E402
from vllm_recycling.kernels.context_match import context_match  # noqa: E402
from vllm_recycling.paths import ChainPlan, choose_paths, compaction  # noqa: E402
from vllm_recycling.tree import load_tree  # noqa: E402
from vllm_recycling.tree_step import TreeLayout, TreeStep  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, BLOCK = 9, 3, 64, 30, 49152, 128
NODES, PREFIX = 16, 300


def _ms(fn, repeat: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return 1000 * best


def measure(template, layout, requests: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    num_draft = np.full(requests, NODES)
    qsl = np.concatenate([[0], np.cumsum(num_draft + 1)])
    computed = np.full(requests, PREFIX)
    total = int(qsl[-1])
    per = -(-(PREFIX + NODES + 1) // BLOCK)
    scratch = 64  # the tree pass's scratch blocks (patches.runner.ScratchKVBlocks: at most 64)
    caches = [torch.randn(requests * per + scratch, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=gen)
              for _ in range(LAYERS)]
    table = torch.randperm(requests * per, generator=gen).view(requests, per).int()
    pos = torch.from_numpy(computed[:, None] + np.arange(NODES + 1)[None]).reshape(-1)
    slots = (table.long().gather(1, (pos.view(requests, -1) // BLOCK)) * BLOCK + pos.view(requests, -1) % BLOCK).reshape(-1)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    out = torch.zeros(total, HEADS * HEAD_DIM)
    logits = torch.randn(total, VOCAB, generator=gen)
    tokens = torch.randint(0, VOCAB, (total,), generator=gen)

    def plan():
        step = TreeStep.plan(layout, num_draft, qsl, computed, "cpu")
        step.position_offsets()
        return step

    step = plan()

    from types import SimpleNamespace

    isa = attention_isa(torch.float32, BLOCK, HEAD_DIM)
    k_new, v_new = torch.randn(2, total, KV_HEADS, HEAD_DIM, generator=gen)
    impl = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, scale=0.125,
                           sliding_window=-1, alibi_slopes=None, logits_soft_cap=0.0, sinks=None,
                           kv_cache_dtype="auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)

    def attention():
        tree = PathPlan.build(step, table, slots, impl, isa, torch.float32, BLOCK,
                              range(requests * per, requests * per + scratch))
        for cache in caches:
            tree(impl, layer, q, k_new, v_new, cache, out)

    starts = torch.from_numpy(qsl[:-1])

    def paths():
        path = choose_paths(step, logits, tokens, starts)
        ChainPlan.build(step, path, num_draft, qsl[:-1], "cpu")

    path = torch.full((requests, layout.max_depth), -1, dtype=torch.int64)
    path[:, :4] = torch.tensor([1, 3, 7, 15])

    def moves():
        src, dst = compaction(step, path, slots)
        native.move_slots(caches, src, dst, "vec")

    def moves_torch():
        src, dst = compaction(step, path, slots)
        for cache in caches:
            move_slots(cache, src, dst, "vec")

    k = template.rank.max().item() + 1
    matrix = torch.randint(0, VOCAB, (VOCAB, max(k, 8)), dtype=torch.int32, generator=gen)
    roots = torch.randint(0, VOCAB, (requests,), generator=gen)

    def drafts():
        native.draft(matrix, roots, template.parent, template.rank)

    history = np.random.default_rng(0).integers(0, VOCAB, (requests, PREFIX)).astype(np.int32)
    rows, lengths = np.arange(requests), np.full(requests, PREFIX)

    def match():
        context_match(history, rows, lengths, 2, 8, 8)

    return {"requests": requests, "plan_ms": _ms(plan), "attention_ms": _ms(attention, 5),
            "paths_ms": _ms(paths), "moves_ms": _ms(moves), "moves_torch_ms": _ms(moves_torch),
            "drafts_ms": _ms(drafts),
            "context_match_ms": _ms(match)}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: vLLM's CPU worker on 2 cores binds one, "
                             "the other core is reserved for the engine's other processes)")
    torch.set_num_threads(parser.parse_args().threads)
    template = load_tree("2.2.2", topk=8)
    layout = TreeLayout.from_template(template, "cpu")
    rows = [measure(template, layout, r) for r in (1, 16)]
    keys = ["plan_ms", "attention_ms", "paths_ms", "moves_ms", "moves_torch_ms", "drafts_ms", "context_match_ms"]
    lines = ["| requests | plan | tree attention (30 layers) | path choice | KV moves (30 layers, C) | "
             "KV moves (30 layers, PyTorch) | drafts (80 nodes) | context match |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['requests']} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")
        print(lines[-1], flush=True)
    threads = torch.get_num_threads()
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__} ({threads} "
               f"thread{'s' if threads != 1 else ''})")
    header = (f"# A tree step's host work on the CPU path, ms per step\n\n{datetime.date.today().isoformat()}; "
              f"{machine}; {NODES + 1}-row trees over {PREFIX}-token prefixes, SmolLM2-135M shapes. "
              "Command: `python benchmarks/tree_step_host.py`.\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tree_step_host.md").write_text(header + "\n".join(lines) + "\n")
    (RESULTS / "tree_step_host.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
