"""What a row costs in a model's linear layers on this CPU: vLLM's own CPU linear kernels (the
dispatch vLLM's worker makes for every dense layer, ``dispatch_cpu_unquantized_gemm``: zentorch,
the packed small-GEMM kernel or oneDNN, whichever it picks here) at the shapes of a model's
layers (attention's qkv and output projections, the MLP's gate-up and down, times the layers,
and the vocabulary's head once), for a step of 1 to 32 rows.

A decode step's linear layers read every weight once whatever the rows; a speculative step adds
a row per draft. This separates the cost of the rows' arithmetic from the rest of a step
(attention, sampling, the engine's own work), which ``budget_ceiling.py`` measures whole.
Weights are random in the model's dtype (the timing does not depend on their values); each size
is timed in rounds that alternate ascending and descending order, the median of 5 rounds kept.

    python benchmarks/studies/linear_rows.py --model qwen2.5-coder-0.5b --dtype bfloat16 [--threads 1]

``--threads 1``: what vLLM's CPU worker computes with in a server on two cores (one core bound,
one left to the front end); the default, this process's threads, what the engine in a
benchmark's process gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: spec_bench
from spec_bench import run_header, write_results  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


def linear_shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """Each dense layer of a decoder as (out features, in features, how many in the model)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden, layers),
        "o": (hidden, heads * head_dim, layers),
        "gate_up": (2 * config["intermediate_size"], hidden, layers),
        "down": (hidden, config["intermediate_size"], layers),
        "lm_head": (config["vocab_size"], hidden, 1),
    }


def vllm_linear(out_features: int, in_features: int, dtype: torch.dtype):
    """A layer with the CPU linear vLLM's worker gives it here, and the kernel's name."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features).to(dtype) * 0.02,
                                      requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    if current_platform.is_zen_cpu() and hasattr(torch.ops, "zentorch"):
        kernel = "zentorch"
    elif utils.check_cpu_sgl_kernel(out_features, in_features, dtype):
        kernel = "sgl packed"
    elif ops._supports_onednn:
        kernel = "oneDNN"
    else:
        kernel = "torch linear"
    return layer, kernel


def time_rows(layers: dict, dtype: torch.dtype, rows: tuple[int, ...], rounds: int = 5,
              repeat: int = 10) -> dict[int, float]:
    """Milliseconds of one step's linear layers for each row count (median of ``rounds``)."""
    inputs = {m: {name: torch.randn(m, layer.weight.shape[1]).to(dtype) for name, (layer, _, _) in layers.items()}
              for m in rows}
    samples: dict[int, list[float]] = {m: [] for m in rows}
    for r in range(rounds):
        for m in (rows if r % 2 == 0 else rows[::-1]):
            total = 0.0
            for name, (layer, _, count) in layers.items():
                x = inputs[m][name]
                layer.cpu_linear(x, layer.weight, None)  # warm
                start = time.perf_counter()
                for _ in range(repeat):
                    layer.cpu_linear(x, layer.weight, None)
                total += (time.perf_counter() - start) / repeat * count
            samples[m].append(1000 * total)
    return {m: statistics.median(v) for m, v in samples.items()}


def markdown(report: dict) -> str:
    flop_per_row = report["flop_per_row"]
    first = report["ms"]["1"]
    lines = [
        f"# A row's cost in the linear layers: {report['model']}, {report['dtype']}",
        "",
        f"{report['date']}; {report['machine']}; LD_PRELOAD {report['ld_preload']}; vLLM {report['vllm']}; "
        f"torch {report['torch']} ({report['threads']} threads). Command: `{report['command']}`.",
        "",
        "vLLM's CPU linear kernels at this model's shapes: "
        + ", ".join(f"{name} {o} x {i} x {n} ({report['kernels'][name]})"
                    for name, (o, i, n) in report["shapes"].items())
        + f"; {flop_per_row / 1e9:.2f} GFLOP per row. Median of 5 rounds in alternating order.",
        "",
        "| rows | ms per step | over 1 row, ms | per row over the size above, ms | GFLOP/s |",
        "|---|---|---|---|---|",
    ]
    previous = None
    for m, ms in report["ms"].items():
        rows = int(m)
        marginal = "-" if previous is None else f"{(ms - previous[1]) / (rows - previous[0]):.2f}"
        lines.append(f"| {rows} | {ms:.1f} | {ms - first:+.1f} | {marginal} | {rows * flop_per_row / ms / 1e6:.0f} |")
        previous = (rows, ms)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    from vllm_recycling.tools.models import prepare_model

    config = json.loads((prepare_model(args.model) / "config.json").read_text())
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    shapes = linear_shapes(config)
    layers = {name: (*vllm_linear(o, i, dtype), n) for name, (o, i, n) in shapes.items()}
    print("kernels: " + ", ".join(f"{name} {kernel}" for name, (_, kernel, _) in layers.items()), flush=True)
    ms = time_rows(layers, dtype, ROWS)
    report = run_header("studies/linear_rows.py", args.model) | {
        "dtype": args.dtype, "torch": torch.__version__, "threads": args.threads,
        "shapes": shapes, "kernels": {name: kernel for name, (_, kernel, _) in layers.items()},
        "flop_per_row": sum(2 * o * i * n for o, i, n in shapes.values()),
        "ms": {str(m): round(v, 3) for m, v in ms.items()},
    }
    threads = f"{args.threads}thread" + ("s" if args.threads > 1 else "")
    write_results(f"linear_rows_{args.model}_{args.dtype}_{threads}", report, markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
