#!/usr/bin/env python
"""The GPU path's tree attention kernel (``kernels/tree_attention.py``) per layer, with plain
torch + Triton (no vLLM): for each case, one decoder layer's tree rows of a batch of tree
requests (the default 80-node template "2.2.2" or its first nodes) over prefixes in a paged
cache, at a 7B shape (32 query heads, 8 or 32 key/value heads, head size 128) and a small one.

Each case is first checked against the PyTorch reference (max |difference| reported), then the
kernel is timed in a CUDA graph (``triton.testing.do_bench_cudagraph``: GPU time only, and proof
that the launch needs no host synchronisation) and as a plain launch (``do_bench``). For scale,
the same rows through PyTorch's SDPA as dense masked attention over each request's gathered keys
(what a gather-based GPU path would cost; timed as plain launches).

    python benchmarks/tree_attention_gpu.py            # writes results/tree_attention-<device>.md/.json
    python benchmarks/tree_attention_gpu.py --smoke    # one tiny case (CPU: Triton's interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
CASES = [  # (requests, nodes + root per tree, prefix, query heads, kv heads, head size)
    (1, 81, 512, 32, 32, 128),
    (1, 81, 4096, 32, 8, 128),
    (8, 81, 1024, 32, 8, 128),
    (32, 17, 1024, 32, 8, 128),
    (64, 81, 1024, 32, 8, 128),
    (64, 17, 2048, 9, 3, 64),
]
BLOCK_SIZE = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="one tiny case, no timing (CPU: interpreter)")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--out-dir", type=Path, default=ROOT / "results")
    return p.parse_args(argv)


def make_case(requests, width, prefix, heads, kv_heads, dim, dtype, device, seed=0):
    """Query rows, a paged cache holding every request's prefix and tree, and the step's tree
    description, for ``tree_attention``. Trees: the template's first ``width`` nodes (root
    included); the template is "2.2.2" when it has that many nodes, else the first nodes of it."""
    from vllm_recycling.tree import load_tree
    from vllm_recycling.tree_step import TreeLayout, TreeStep

    gen = torch.Generator(device="cpu").manual_seed(seed)
    layout = TreeLayout.from_template(load_tree("2.2.2", topk=8), device)
    num_draft = [width - 1] * requests
    qsl = np.arange(requests + 1) * width
    step = TreeStep.plan(layout, np.array(num_draft), qsl, np.array([prefix] * requests),
                         device)
    tokens = int(qsl[-1])
    blocks_each = -(-(prefix + width) // BLOCK_SIZE)
    num_blocks = requests * blocks_each + 1
    table = torch.randperm(num_blocks - 1, generator=gen)[: requests * blocks_each].view(requests, blocks_each)
    kv = torch.randn(num_blocks, kv_heads, BLOCK_SIZE, 2 * dim, generator=gen).to(dtype)
    query = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return dict(
        query=to(query), kv_cache=to(kv), block_table=to(table.int()), req_index=step.req_index,
        rows=step.rows, num_rows=step.num_rows, prefix_len=step.prefix_len, mask=step.mask,
        output=to(torch.zeros(tokens, heads, dim, dtype=dtype)), scale=dim ** -0.5,
    )


def sdpa_equivalent(case):
    """The same rows as dense masked attention per request over its gathered keys (SDPA)."""
    q, kv, table = case["query"], case["kv_cache"], case["block_table"]
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, bs = kv.shape[1], kv.shape[2]
    r, width = case["rows"].shape
    prefix = int(case["prefix_len"][0])
    positions = torch.arange(prefix + width, device=q.device)
    blocks = table[:, positions // bs].long()  # [R, P]
    gathered = kv[blocks, :, positions % bs]  # [R, P, H_kv, 2D]
    k = gathered[..., :dim].transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    v = gathered[..., dim:].transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    qr = q[case["rows"]].transpose(1, 2)  # [R, H, W, D]
    allowed = torch.cat([torch.ones(r, width, prefix, dtype=torch.bool, device=q.device), case["mask"]], 2)
    return torch.nn.functional.scaled_dot_product_attention(qr, k, v, attn_mask=allowed[:, None])


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_recycling.kernels.tree_attention import tree_attention_reference, tree_attention_triton

    dtype = getattr(torch, args.dtype)
    cuda = torch.cuda.is_available()
    if args.smoke or not cuda:
        if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            print("no CUDA: run with TRITON_INTERPRET=1 for the interpreter smoke case, or on a GPU")
            return 0
        device = "cuda" if cuda else "cpu"
        case = make_case(2, 9, 37, 4, 2, 64, torch.float32 if not cuda else dtype, device)
        ref = dict(case, output=case["output"].clone())
        tree_attention_triton(**case)
        tree_attention_reference(**ref)
        err = (case["output"].float() - ref["output"].float()).abs().max().item()
        print(f"smoke ({device}): max |kernel - reference| = {err:.3g}")
        return 0 if err < 1e-2 else 1

    import triton.testing as tt

    name = torch.cuda.get_device_name()
    results = []
    header = "| requests | tree rows | prefix | heads / kv heads x dim | max abs diff | graph us | launch us | SDPA gather us |"
    print(header)
    for requests, width, prefix, heads, kv_heads, dim in CASES:
        case = make_case(requests, width, prefix, heads, kv_heads, dim, dtype, "cuda")
        ref = dict(case, output=case["output"].clone())
        tree_attention_triton(**case)
        tree_attention_reference(**ref)
        err = (case["output"].float() - ref["output"].float()).abs().max().item()
        run = lambda: tree_attention_triton(**case)  # noqa: E731
        graph_us = tt.do_bench_cudagraph(run, rep=100, return_mode="median") * 1000
        launch_us = tt.do_bench(run, warmup=25, rep=100) * 1000
        sdpa_us = tt.do_bench(lambda: sdpa_equivalent(case), warmup=25, rep=100) * 1000
        row = dict(requests=requests, rows=width, prefix=prefix, heads=heads, kv_heads=kv_heads,
                   dim=dim, max_abs_diff=err, graph_us=graph_us, launch_us=launch_us, sdpa_us=sdpa_us)
        results.append(row)
        print(f"| {requests} | {width} | {prefix} | {heads} / {kv_heads} x {dim} | {err:.2g} | "
              f"{graph_us:.1f} | {launch_us:.1f} | {sdpa_us:.1f} |")
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "dtype": args.dtype, "torch": torch.__version__,
            "triton": __import__("triton").__version__, "block_size": BLOCK_SIZE}
    (args.out_dir / f"tree_attention-{slug}.json").write_text(json.dumps({"meta": meta, "cases": results}, indent=2) + "\n")
    lines = [f"# Tree attention kernel: {name}", ""] + [f"- {k}: {v}" for k, v in meta.items()] + ["", header,
             "|" + "---|" * 8]
    lines += [f"| {r['requests']} | {r['rows']} | {r['prefix']} | {r['heads']} / {r['kv_heads']} x {r['dim']} | "
              f"{r['max_abs_diff']:.2g} | {r['graph_us']:.1f} | {r['launch_us']:.1f} | {r['sdpa_us']:.1f} |"
              for r in results]
    (args.out_dir / f"tree_attention-{slug}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
