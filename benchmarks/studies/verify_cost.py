#!/usr/bin/env python
"""What one verification step costs against the number of tokens it verifies, on this machine.

A Llama-shaped decoder with random weights (the cost does not depend on their values) runs one
forward of ``n`` tokens per request over a cached prefix of ``P`` tokens: n = 1 is plain
decoding, n = nodes + 1 verifies a tree (each node sees the prefix and its ancestors, the
tree's mask; position = P + depth; the n new K/V rows are written in place into a preallocated
cache, as vLLM's paged cache does; logits for all n rows). For each shape, batch size and tree:

- ``ms``: median time of one step;
- ``x plain``: cost(n) / cost(1), the tokens per step a tree must yield to break even;
- ``projected``: MAT / (x plain), with the hot-start MAT of the reference decoder
  (``benchmarks/results/reference_mat.json``, SmolLM2 on Spec-Bench): what the method would
  gain if every other cost were zero. A projection, not a measurement of vLLM.

On CUDA a step is replayed from a CUDA graph, as vLLM runs decode steps (``--eager`` adds op-by-op
launches: on a GPU those measure Python launch overhead, 15-25 ms a step for either shape, and
vary more between runs than the compute does). On the CPU a step runs op by op.

    python benchmarks/studies/verify_cost.py                           # GPU: both shapes; CPU: smollm2-135m
    python benchmarks/studies/verify_cost.py --shapes smollm2-135m --batch 1 4 --prefix 256

Writes ``verify_cost_<device>.json`` and ``.md`` under ``--out-dir`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_recycling.tree import load_tree

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/
# The decoder shapes: SmolLM2-135M (the default model here) and Llama-2-7B (Vicuna-7B, the paper's).
SHAPES = {
    "tiny": dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=512),
    "smollm2-135m": dict(hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, vocab=49152),
    "llama2-7b": dict(hidden=4096, inter=11008, layers=32, heads=32, kv_heads=32, vocab=32000),
}
TREES = ["chain6", "tree16", "tree32", "2.2.2"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Decoder:
    """The compute of a Llama decoder step: fused QKV, RoPE, in-place KV write, masked SDPA with
    grouped KV heads, SwiGLU MLP, RMSNorm, LM head."""

    def __init__(self, shape: dict, dtype: torch.dtype, device: torch.device) -> None:
        self.s = s = shape
        self.head_dim = s["hidden"] // s["heads"]
        g = torch.Generator(device=device).manual_seed(0)

        def w(*size):
            return (torch.randn(size, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

        qkv = (s["heads"] + 2 * s["kv_heads"]) * self.head_dim
        self.embed = w(s["vocab"], s["hidden"])
        self.layers = [dict(wqkv=w(s["hidden"], qkv), wo=w(s["heads"] * self.head_dim, s["hidden"]),
                            w13=w(s["hidden"], 2 * s["inter"]), w2=w(s["inter"], s["hidden"]))
                       for _ in range(s["layers"])]
        self.lm_head = w(s["hidden"], s["vocab"])
        half = self.head_dim // 2
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half))

    def cache(self, batch: int, length: int, dtype: torch.dtype, device: torch.device):
        shape = (batch, self.s["kv_heads"], length, self.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in self.layers]

    def _rope(self, x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    @torch.no_grad()
    def forward(self, ids, positions, mask, cache, prefix: int) -> torch.Tensor:
        """ids, positions [B, n]; mask [B, 1, n, prefix + n] bool; cache from ``cache()``."""
        s, hd = self.s, self.head_dim
        b, n = ids.shape
        angles = positions[..., None].float() * self.inv_freq  # [B, n, hd/2]
        cos, sin = angles.cos()[:, None].to(self.embed.dtype), angles.sin()[:, None].to(self.embed.dtype)
        x = self.embed[ids]
        for layer, (kc, vc) in zip(self.layers, cache):
            y = F.rms_norm(x, (s["hidden"],))
            q, k, v = (y @ layer["wqkv"]).split([s["heads"] * hd, s["kv_heads"] * hd, s["kv_heads"] * hd], -1)
            q = self._rope(q.view(b, n, s["heads"], hd).transpose(1, 2), cos, sin)
            k = self._rope(k.view(b, n, s["kv_heads"], hd).transpose(1, 2), cos, sin)
            kc[:, :, prefix:prefix + n] = k
            vc[:, :, prefix:prefix + n] = v.view(b, n, s["kv_heads"], hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask,
                                               enable_gqa=s["kv_heads"] != s["heads"])
            x = x + o.transpose(1, 2).reshape(b, n, s["heads"] * hd) @ layer["wo"]
            gate, up = (F.rms_norm(x, (s["hidden"],)) @ layer["w13"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w2"]
        return F.rms_norm(x, (s["hidden"],)) @ self.lm_head


def step_inputs(tree, batch: int, prefix: int, vocab: int, device):
    """Tokens, positions and the [B, 1, n, prefix + n] mask of one step; tree None = plain."""
    n = 1 if tree is None else tree.num_nodes + 1
    depth = torch.zeros(1, dtype=torch.long) if tree is None else tree.depth.cpu()
    ancestors = torch.ones(1, 1, dtype=torch.bool) if tree is None else tree.ancestors.cpu()
    ids = torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(n))
    positions = (prefix + depth).expand(batch, n)
    mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), ancestors], dim=1).expand(batch, 1, n, prefix + n)
    return ids.to(device), positions.contiguous().to(device), mask.contiguous().to(device)


def time_step(fn, device, reps: int, warmup: int = 3) -> float:
    """Median ms of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph; returns the replay (same inputs, same output buffers)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay, graph


def reference_mats(path: Path) -> dict[str, float]:
    """Hot-start pooled MAT per tree from a reference_mat.json, {} if absent."""
    try:
        runs = json.loads(path.read_text())["runs"]
    except (OSError, KeyError, ValueError):
        return {}
    return {r["tree"]: r["mat_pooled"] for r in runs if r.get("start") == "hot"}


def measure(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    shapes = args.shapes or (["smollm2-135m", "llama2-7b"] if device.type == "cuda" else ["smollm2-135m"])
    modes = (["eager"] if args.eager else []) + ["graph"] if device.type == "cuda" else ["eager"]
    trees = {name: load_tree(name, topk=8).to(device) for name in args.trees}
    mats = reference_mats(args.mat_from)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU, {os.cpu_count()} cores"
    meta = {"date": dt.date.today().isoformat(), "device": name, "torch": torch.__version__,
            "python": platform.python_version(), "dtype": str(dtype).removeprefix("torch."),
            "prefix": args.prefix, "reps": args.reps, "modes": modes,
            "mat_source": str(args.mat_from.relative_to(ROOT.parent)) if mats and args.mat_from.is_relative_to(ROOT.parent) else str(args.mat_from) if mats else None,
            "mats": mats,
            "command": " ".join(["python benchmarks/studies/verify_cost.py"] + _options(sys.argv[1:]))}
    print(f"{name} | torch {torch.__version__} | {meta['dtype']} | prefix {args.prefix} | modes {', '.join(modes)}")
    rows = []
    for shape_name in shapes:
        model = Decoder(SHAPES[shape_name], dtype, device)
        for batch in args.batch:
            for tree_name in ["plain"] + list(trees):
                tree = None if tree_name == "plain" else trees[tree_name]
                ids, positions, mask = step_inputs(tree, batch, args.prefix, SHAPES[shape_name]["vocab"], device)
                n = ids.shape[1]
                cache = model.cache(batch, args.prefix + n, dtype, device)
                row = {"shape": shape_name, "batch": batch, "tree": tree_name, "tokens_per_request": n,
                       "tokens": batch * n}

                def step():
                    return model.forward(ids, positions, mask, cache, args.prefix)

                for mode in modes:
                    try:
                        if mode == "graph":
                            replay, graph = graphed(step)
                            row["graph_ms"] = time_step(replay, device, args.reps)
                            del graph
                        else:
                            row["eager_ms"] = time_step(step, device, args.reps)
                    except torch.OutOfMemoryError as e:
                        row[f"{mode}_ms"] = None
                        row[f"{mode}_error"] = f"out of memory: {str(e).splitlines()[0]}"
                    except RuntimeError as e:
                        row[f"{mode}_ms"] = None
                        row[f"{mode}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                print("  " + " | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in row.items()), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _derive(rows, modes, mats)
    return {"meta": meta, "rows": rows}


def _options(argv: list[str]) -> list[str]:
    """The command line without --out-dir (where the files went is not part of the result)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out-dir":
            skip = True
        elif not a.startswith("--out-dir="):
            out.append(a)
    return out


def _derive(rows: list[dict], modes: list[str], mats: dict[str, float]) -> None:
    """Cost relative to plain decoding at the same shape and batch, and the projected speed-up."""
    plain = {(r["shape"], r["batch"]): r for r in rows if r["tree"] == "plain"}
    for r in rows:
        base = plain[(r["shape"], r["batch"])]
        for mode in modes:
            ms, ms0 = r.get(f"{mode}_ms"), base.get(f"{mode}_ms")
            ratio = ms / ms0 if ms and ms0 else None
            r[f"{mode}_x_plain"] = ratio
            mat = 1.0 if r["tree"] == "plain" else mats.get(r["tree"])
            r[f"{mode}_projected"] = mat / ratio if ratio and mat else None


def markdown(report: dict) -> str:
    meta, rows = report["meta"], report["rows"]
    modes = meta["modes"]
    mat_note = (f"MAT: hot-start reference decoder, `{meta['mat_source']}` "
                + ", ".join(f"{t} {m:.2f}" for t, m in meta["mats"].items())) if meta["mats"] else "no MAT file: no projection"
    lines = [
        f"# Verification step cost against tokens verified ({meta['device']})", "",
        f"{meta['date']}; torch {meta['torch']}; {meta['dtype']}; random-weight Llama-shaped decoders; "
        f"cached prefix {meta['prefix']} tokens per request; median of {meta['reps']} steps. "
        f"Command: `{meta['command']}`.", "",
        "`x plain` = step cost / plain decoding's step cost at the same batch: the tokens per step a tree "
        "must yield to break even. `projected` = MAT / `x plain`, every other cost taken as zero "
        f"({mat_note}). " + " ".join(
            {"graph": "`graph`: replayed from a CUDA graph, as vLLM runs decode steps.",
             "eager": "`eager`: launched op by op."}[m] for m in modes), "",
    ]
    head = ["shape", "batch", "tree", "tokens"]
    for mode in modes:
        head += [f"{mode} ms", f"{mode} x plain", f"{mode} projected"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        cells = [r["shape"], str(r["batch"]), r["tree"], str(r["tokens"])]
        for mode in modes:
            cells += [f(r.get(f"{mode}_ms"), ".2f"), f(r.get(f"{mode}_x_plain"), ".2f"),
                      f(r.get(f"{mode}_projected"), ".2f") + ("x" if r.get(f"{mode}_projected") else "")]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {r['shape']} batch {r['batch']} {r['tree']} {m}: {r[m + '_error']}"
              for r in rows for m in modes if r.get(f"{m}_error")]
    if errors:
        lines += ["", "Not measured:", *errors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                   help="decoder shapes (default: GPU smollm2-135m llama2-7b, CPU smollm2-135m)")
    p.add_argument("--batch", type=int, nargs="+", default=None,
                   help="requests per step (default: GPU 1 2 4 8 16 32 64, CPU 1 4 16)")
    p.add_argument("--trees", nargs="+", default=TREES, help="shipped tree names")
    p.add_argument("--prefix", type=int, default=512, help="cached tokens per request")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--reps", type=int, default=None, help="timed steps per case (default: GPU 20, CPU 5)")
    p.add_argument("--eager", action="store_true", help="on CUDA, also time op-by-op launches")
    p.add_argument("--mat-from", type=Path, default=ROOT / "results" / "reference_mat.json")
    p.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = p.parse_args(argv)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.batch = args.batch or ([1, 2, 4, 8, 16, 32, 64] if cuda else [1, 4, 16])
    args.reps = args.reps or (20 if cuda else 5)
    report = measure(args)
    slug = re.sub(r"[^a-z0-9]+", "-", report["meta"]["device"].lower()).strip("-")
    slug = "cpu" if not cuda else slug
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"verify_cost_{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out_dir / f"verify_cost_{slug}.md").write_text(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
