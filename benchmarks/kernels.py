#!/usr/bin/env python
"""Benchmark the Triton kernels against their PyTorch references.

For every batch size B and vocabulary V (template "2.2.2", k = 8 by default):

- draft: ``draft_tree_triton`` (one launch for the batch) vs ``draft_tree_reference`` (one gather
  per level);
- update: ``topk_update_triton`` (one read of the logits) vs ``topk_update_reference`` (exact
  tie and duplicate rules, with host syncs) and vs plain ``torch.topk`` + scatter (no tie or
  duplicate rule: the floor a PyTorch version could reach);
- the memory-bandwidth bound: bytes that must move / peak bandwidth (``--peak-gbps``, default by
  device name: H100 3350, H200 4800 GB/s).

On the GPU it also times the adaptive budget's work per step on the device (survival and
admission of 80-node trees at batch 1..64, ``budget_projection.time_budget``).

Kernels are timed twice: inside a CUDA graph (``triton.testing.do_bench_cudagraph``: GPU time
only, as in vLLM's captured decode step; it also proves the launchers are sync-free) and as plain
launches (``do_bench``: includes the Python launch overhead, which dominates microsecond
kernels). References are timed as plain launches. ``do_bench`` flushes L2 between runs.

Every case is checked for exact equality with the reference before it is timed. Results go to
``benchmarks/results/kernels-<device>.json`` and ``.md``.

Without CUDA the script says so and exits 0 after (unless ``--no-cpu-references``) timing only
the PyTorch references on CPU for a small subset.

    python benchmarks/kernels.py                       # full sweep on the GPU
    python benchmarks/kernels.py --batch 1 8 --vocab 32000 --tune
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
# (substring of the device name, peak HBM bandwidth in GB/s), first match wins.
PEAK_GBPS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256], help="requests per batch")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152, 128256, 151936], help="vocabulary sizes")
    p.add_argument("--tree", default="2.2.2", help="tree template (shipped name or JSON file)")
    p.add_argument("--topk", type=int, default=8, help="k of the adjacency matrix")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    p.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth (default: by device name)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--tune", action="store_true", help="also sweep block_v / num_warps / splits of the update kernel")
    p.add_argument("--no-check", action="store_true", help="skip the exactness check against the reference")
    p.add_argument("--no-reference", action="store_true", help="do not time the PyTorch references")
    p.add_argument("--no-cpu-references", action="store_true", help="without CUDA: time nothing")
    p.add_argument("--out-dir", type=Path, default=ROOT / "results", help="where the .json and .md go")
    return p.parse_args(argv)


# -- helpers -------------------------------------------------------------------------------------
def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def default_peak(name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key.lower() in name.lower():
            return gbps
    return None


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_version = f"unavailable ({type(e).__name__})"
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def fmt(us) -> str:
    if us is None:
        return "-"
    if isinstance(us, str):
        return us
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def case_inputs(batch, vocab, tree, k, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    n1 = tree.num_nodes + 1
    table = torch.randint(0, vocab, (vocab, k), generator=g, device=device, dtype=torch.int32)
    roots = torch.randint(0, vocab, (batch,), generator=g, device=device)
    tokens = torch.randint(0, vocab, (batch, n1), generator=g, device=device)
    logits = torch.randn((batch * n1, vocab), generator=g, device=device, dtype=torch.float32).to(dtype)
    return table, roots, tokens.reshape(-1), logits


def update_bytes(rows, vocab, k, elem) -> int:
    """Logits read once, rows read, top-k rows written into the table, argmax written."""
    return rows * vocab * elem + rows * 8 + rows * k * 4 + rows * 8


def draft_bytes(batch, n1) -> int:
    """Roots read, one int32 table entry per edge walked (a lower bound: sectors are 32 B), tokens
    written. The draft is latency-bound (dependent gathers), not bandwidth-bound."""
    return batch * 8 + batch * (n1 - 1) * 4 + batch * n1 * 4


# -- GPU -----------------------------------------------------------------------------------------
def run_gpu(args, device: torch.device | None = None) -> int:
    import triton.testing as tt

    from vllm_recycling.kernels import triton_mode
    from vllm_recycling.kernels.draft_tree import draft_tree_reference, draft_tree_triton
    from vllm_recycling.kernels.topk_update import topk_update_reference, topk_update_triton
    from vllm_recycling.tree import load_tree

    mode = triton_mode()
    if mode != "compiled":
        print(f"Triton is not usable compiled in this process (mode: {mode}); unset TRITON_INTERPRET.")
        return 1
    device = device or torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or default_peak(name)
    dtype = DTYPES[args.dtype]
    elem = torch.finfo(dtype).bits // 8
    tree = load_tree(args.tree, topk=args.topk).to(device)
    n1 = tree.num_nodes + 1
    meta = {"device": name, **versions(), "peak_gbps": peak, "tree": args.tree, "nodes": tree.num_nodes,
            "topk": args.topk, "logits_dtype": args.dtype,
            "sm_count": torch.cuda.get_device_properties(device).multi_processor_count, "notes": NOTES}
    print(f"{name} | torch {meta['torch']} | triton {meta['triton']} | peak {peak or 'unknown'} GB/s | "
          f"tree {args.tree} ({tree.num_nodes} nodes) | k {args.topk} | logits {args.dtype}")
    if peak is None:
        print("  (unknown device: pass --peak-gbps for the bandwidth bound)")

    def bench(fn):
        return tt.do_bench(fn, warmup=args.warmup, rep=args.rep) * 1000.0  # us

    props = torch.cuda.get_device_properties(device)
    l2_bytes = getattr(props, "L2_cache_size", 0) or (64 << 20)
    flush_buffer = torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device=device)

    def bench_graph(fn, cold=False):
        """GPU time of fn replayed in a CUDA graph. Warm: the same inputs every replay, so what
        fits in L2 stays there. Cold: L2 overwritten before each call, that write's own time
        subtracted (noisier: a difference of two measurements)."""
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        try:
            if not cold:
                return tt.do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1000.0

            def flushed():
                flush_buffer.zero_()
                fn()

            both = tt.do_bench_cudagraph(flushed, rep=args.rep, return_mode="median")
            alone = tt.do_bench_cudagraph(flush_buffer.zero_, rep=args.rep, return_mode="median")
            return max(both - alone, 0.0) * 1000.0
        except Exception as e:  # noqa: BLE001
            return f"no graph ({type(e).__name__})"

    def measure(batch, vocab, case):
        rows = batch * n1
        table, roots, flat_rows, logits = case_inputs(batch, vocab, tree, args.topk, dtype, device)
        # draft
        draft_k = lambda: draft_tree_triton(table, roots, tree.rank_path, tree.depth)  # noqa: E731
        draft_r = lambda: draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts)  # noqa: E731
        if not args.no_check:
            case["draft_exact"] = bool(torch.equal(draft_k(), draft_r()))
        case["draft_kernel_us"] = bench_graph(draft_k)
        case["draft_kernel_launch_us"] = bench(draft_k)
        if not args.no_reference:
            case["draft_reference_us"] = bench(draft_r)
        nbytes = draft_bytes(batch, n1)
        case["draft_bytes"] = nbytes
        case["draft_bound_us"] = nbytes / (peak * 1e3) if peak else None
        # update
        table_k, table_r = table.clone(), table.clone()
        update_k = lambda: topk_update_triton(logits, flat_rows, table_k)  # noqa: E731
        update_r = lambda: topk_update_reference(logits, flat_rows, table_r)  # noqa: E731

        def update_plain():
            ids = torch.topk(logits, args.topk, dim=-1).indices
            table_r[flat_rows] = ids.int()
            return ids[:, 0]

        if not args.no_check:
            a, b = update_k(), update_r()
            case["update_exact"] = bool(torch.equal(a, b) and torch.equal(table_k, table_r))
        case["update_kernel_us"] = bench_graph(update_k)
        case["update_kernel_cold_us"] = bench_graph(update_k, cold=True)
        case["update_kernel_launch_us"] = bench(update_k)
        if not args.no_reference:
            case["update_reference_us"] = bench(update_r)
            case["update_topk_scatter_us"] = bench(update_plain)
        nbytes = update_bytes(rows, vocab, args.topk, elem)
        case["update_bytes"] = nbytes
        if peak:
            case["update_bound_us"] = nbytes / (peak * 1e3)
            t = case["update_kernel_cold_us"]
            if isinstance(t, float) and t > 0:
                case["update_kernel_gbps"] = nbytes / (t * 1e3)
                case["update_pct_of_peak"] = 100.0 * case["update_kernel_gbps"] / peak
        if args.tune:
            case["tune"] = tune(bench_graph, topk_update_triton, logits, flat_rows, table_k)

    cases = []
    for batch in args.batch:
        for vocab in args.vocab:
            case = {"batch": batch, "vocab": vocab, "rows": batch * n1}
            try:
                measure(batch, vocab, case)
            except torch.cuda.OutOfMemoryError:
                case["error"] = "out of memory"
            except Exception as e:  # noqa: BLE001 -- keep the sweep going, record what broke
                case["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            torch.cuda.empty_cache()
            cases.append(case)
            print_row(case, header=len(cases) == 1)
    # the adaptive budget's own work per step on this device (survival + admission of 80-node
    # trees, the admitted mask read on the host), median ms per batch size: the projection's
    # timing of it (studies/budget_projection.py)
    sys.path.insert(0, str(ROOT / "studies"))
    from budget_projection import BATCHES, time_budget

    meta["budget_ms_per_step"] = {b: round(1e3 * time_budget(b, device=device), 3) for b in BATCHES}
    print("budget per step, ms:", meta["budget_ms_per_step"])
    write_results(args.out_dir, device_slug(name), meta, cases)
    failures = [c for c in cases if c.get("draft_exact") is False or c.get("update_exact") is False]
    errors = [c for c in cases if c.get("error") not in (None, "out of memory")]
    if failures:
        print(f"MISMATCH against the reference in {len(failures)} case(s)")
    if errors:
        print(f"{len(errors)} case(s) failed with an error (see the exact column and the tracebacks above)")
    return 1 if failures or errors else 0


def tune(bench_graph, launcher, logits, rows, table):
    results = []
    for block_v in (1024, 2048, 4096, 8192):
        for num_warps in (4, 8, 16):
            for splits in (None, 1):
                try:
                    us = bench_graph(lambda: launcher(logits, rows, table, block_v=block_v, num_warps=num_warps, splits=splits))
                except Exception as e:  # noqa: BLE001
                    us = f"{type(e).__name__}"
                results.append({"block_v": block_v, "num_warps": num_warps, "splits": splits or "auto", "us": us})
    timed = [r for r in results if isinstance(r["us"], float)]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    if best:
        print(f"    tune best: block_v={best['block_v']} num_warps={best['num_warps']} splits={best['splits']} "
              f"{best['us']:.1f} us")
    return {"best": best, "all": results}


NOTES = (
    "Times in us. kern: GPU time in a CUDA graph, inputs warm in L2 when they fit; cold L2: the same "
    "with L2 flushed before each call; launch: plain launch via do_bench (L2 flushed, Python launch "
    "overhead included); ref: PyTorch reference (plain launches, host syncs included); topk+scat: "
    "torch.topk + index scatter without the tie/duplicate rules; bound: update bytes / peak "
    "bandwidth; %peak: update bytes / cold-L2 kernel time / peak."
)

COLUMNS = [
    ("B", "batch"), ("V", "vocab"),
    ("draft kern", "draft_kernel_us"), ("launch", "draft_kernel_launch_us"),
    ("ref", "draft_reference_us"),
    ("upd kern", "update_kernel_us"), ("cold L2", "update_kernel_cold_us"), ("launch", "update_kernel_launch_us"),
    ("ref", "update_reference_us"),
    ("topk+scat", "update_topk_scatter_us"), ("bound", "update_bound_us"), ("%peak", "update_pct_of_peak"),
    ("exact", None),
]


def row_cells(case) -> list[str]:
    cells = []
    for _, key in COLUMNS:
        if key is None:
            if "error" in case:
                cells.append(case["error"][:40])
            else:
                flags = [case.get("draft_exact"), case.get("update_exact")]
                cells.append("-" if None in flags else ("yes" if all(flags) else "NO"))
        elif key in ("batch", "vocab"):
            cells.append(str(case[key]))
        elif key == "update_pct_of_peak":
            v = case.get(key)
            cells.append("-" if v is None else f"{v:.0f}%")
        else:
            cells.append(fmt(case.get(key)))
    return cells


def print_row(case, header=False, notes=None):
    if header:
        print(notes or NOTES)
        print(" ".join(f"{h:>10}" for h, _ in COLUMNS))
    print(" ".join(f"{c:>10}" for c in row_cells(case)))


def write_results(out_dir: Path, slug: str, meta: dict, cases: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"kernels-{slug}.json", out_dir / f"kernels-{slug}.md"
    json_path.write_text(json.dumps({"meta": meta, "cases": cases}, indent=2) + "\n")
    lines = [f"# Kernel benchmark: {meta['device']}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "notes"]
    lines += ["", meta.get("notes", ""), ""]
    lines.append("| " + " | ".join(h for h, _ in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    lines += ["| " + " | ".join(row_cells(c)) + " |" for c in cases]
    md_path.write_text("\n".join(lines) + "\n")
    print(f"wrote {json_path} and {md_path}")


# -- CPU (references only) -----------------------------------------------------------------------
def run_cpu(args) -> int:
    from vllm_recycling.kernels.draft_tree import draft_tree_reference
    from vllm_recycling.kernels.topk_update import topk_update_reference
    from vllm_recycling.tree import load_tree

    tree = load_tree(args.tree, topk=args.topk)
    dtype = DTYPES[args.dtype]
    meta = {"device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            **versions(), "tree": args.tree, "nodes": tree.num_nodes, "topk": args.topk, "logits_dtype": args.dtype,
            "notes": "No CUDA: PyTorch references only (median of 5 runs, us), on a small subset; "
                     "the Triton kernels need a GPU."}
    print("Timing the PyTorch references on CPU for a small subset (B in {1, 8}, V = 32000).")

    def bench(fn, reps=5):
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)

    cases = []
    for batch in [b for b in (1, 8) if b in args.batch] or [1]:
        vocab = 32000
        table, roots, flat_rows, logits = case_inputs(batch, vocab, tree, args.topk, dtype, torch.device("cpu"))
        table_r = table.clone()

        def update_plain():
            ids = torch.topk(logits, args.topk, dim=-1).indices
            table_r[flat_rows] = ids.int()

        case = {
            "batch": batch, "vocab": vocab, "rows": flat_rows.numel(),
            "draft_reference_us": bench(lambda: draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts)),
            "update_reference_us": bench(lambda: topk_update_reference(logits, flat_rows, table_r)),
            "update_topk_scatter_us": bench(update_plain),
        }
        cases.append(case)
        print_row(case, header=len(cases) == 1, notes=meta["notes"])
    write_results(args.out_dir, "cpu", meta, cases)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: the Triton kernels are not benchmarked (they need a GPU).")
        if not args.no_cpu_references:
            try:
                run_cpu(args)
            except Exception:  # noqa: BLE001 -- the CPU part is optional; never fail the script for it
                traceback.print_exc()
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
