"""Is head slower than base? One method measured on two revisions of the plugin, in alternating
rounds.

    python benchmarks/revisions.py --base REV [--head HEAD] [--rounds 3] [--tolerance 0.05]
        [--model qwen2.5-coder-0.5b] [--dtype bfloat16] [--batches 1,8] [--temperatures 0,1]
        [--method "recycling auto"] [--per-category 1] [--max-tokens 128] [--tag TAG]

Each revision is taken from git (``git archive``, committed code only) and laid out as the
installed package is (``vllm_recycling/`` with ``kernels/`` and ``configs/`` inside it) in a
temporary folder put first on ``PYTHONPATH``, so vLLM's plugin entry point imports that
revision's code, and its C kernels compile from its own sources. Every measurement is one
``spec_bench.py`` worker (one fresh engine, the same prompts, batch and sampling for both
revisions); round r runs base then head when r is even, head then base when odd
(A B B A A B ...), each configuration (batch x temperature) in turn, one process at a time.
The worker is this tree's ``spec_bench.py`` for both revisions, run against the base
revision's package too: an API of the plugin that the worker uses and the base revision lacks
fails the run.

Per configuration and revision: tokens per step (every step counted) and output tokens/s of
every round, and how many prompts got the same answer (token ids) in every round, and in every
round of both revisions. The adaptive budget verifies trees of different sizes from one run to
the next (it follows the step times measured), and in bfloat16 another batch shape can flip a
near-tie of the target's logits, so an answer can differ between two runs of one revision; an
answer that differs only between revisions would say the code changed the output.

The verdict per figure (``paired``) is a paired comparison over the rounds: in each round the
two revisions ran back to back (A B / B A / A B ...), so each round gives one ratio head / base
of two runs close in time (the machine's speed drifts over a long invocation), and the
alternating order cancels a steady drift over pairs of rounds. Over the rounds' ratios, their mean and
its one-sided 95% Student-t bounds (``mean -/+ t(0.95, rounds - 1) * stdev / sqrt(rounds)``)
give, with the tolerance ``--tolerance`` (default 5%):

- "not slower": lower bound at least 1 - tolerance and upper bound at least 1;
- "slower within tolerance": lower bound at least 1 - tolerance, upper bound below 1;
- "slower": lower bound below 1 - tolerance, upper bound below 1;
- "inconclusive": lower bound below 1 - tolerance, upper bound at least 1 (the rounds spread
  too much to tell: run more rounds);
- "too few rounds": one round has no spread to test.

Writes benchmarks/results/revisions_<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from spec_bench import ensure_model_prior, run_header, speculative_config, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("tokens_per_step", "tokens_per_s")
TOLERANCE = 0.05
# One-sided 95% quantiles of Student's t for 1..30 degrees of freedom; more rounds use 30's
# (larger than theirs: the bounds come out a little wider, never narrower).
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
       1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
       1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def stage(rev: str, into: Path) -> tuple[str, Path]:
    """The revision's package laid out as installed, under ``into/site``; (its commit, site)."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.strip()
    src, site = into / "src", into / "site"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    shutil.copytree(src / "vllm_recycling", site / "vllm_recycling")
    for sub in ("kernels", "configs"):  # pyproject: vllm_recycling.kernels = kernels/, ...
        shutil.copytree(src / sub, site / "vllm_recycling" / sub)
    check = subprocess.run(
        [sys.executable, "-c", "import vllm_recycling.kernels.native as n, vllm_recycling as v; "
                               "print(v.__file__); print(n.__file__)"],
        env={**os.environ, "PYTHONPATH": str(site)}, cwd=into, check=True, capture_output=True, text=True)
    for line in check.stdout.split():
        if not Path(line).resolve().is_relative_to(site.resolve()):
            raise SystemExit(f"{rev}: imported {line}, not the staged copy under {site}")
    return commit, site


def measure(args, site: Path, batch: int, temperature: float) -> dict:
    """One spec_bench worker (one engine) with the staged revision first on the path."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).with_name("spec_bench.py")), "--worker", args.method,
               "--out", f.name, "--model", args.model, "--dtype", args.dtype,
               "--per-category", str(args.per_category), "--seed", "0",
               "--max-tokens", str(args.max_tokens), "--temperature", str(temperature),
               "--batch", str(batch)]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(site)})
        return json.loads(Path(f.name).read_text())


def summary(runs: list[dict]) -> dict:
    out = {}
    for key in FIGURES:
        values = [r[key] for r in runs]
        out[key] = {"rounds": values, "mean": round(statistics.fmean(values), 3),
                    "min": min(values), "max": max(values)}
    out["same_answer"] = same_answers(runs)
    return out


def same_answers(runs: list[dict]) -> int:
    """How many prompts got one answer in every run (``answers_sha256``: a digest per prompt)."""
    return sum(len(set(d)) == 1 for d in zip(*(r["answers_sha256"] for r in runs)))


def paired(base_rounds: list[float], head_rounds: list[float], tolerance: float = TOLERANCE) -> dict:
    """The ratio head / base of each round (both measured back to back in it), their mean, its
    one-sided 95% Student-t bounds and the verdict (the rule is in the module's docstring)."""
    if len(base_rounds) != len(head_rounds) or not base_rounds:
        raise ValueError(f"rounds do not pair: {len(base_rounds)} base, {len(head_rounds)} head")
    ratios = [h / b for b, h in zip(base_rounds, head_rounds)]
    n, mean = len(ratios), statistics.fmean(ratios)
    if n < 2:
        return {"ratios": ratios, "mean": mean, "low": None, "high": None, "verdict": "too few rounds"}
    half = T95[min(n - 1, len(T95)) - 1] * statistics.stdev(ratios) / math.sqrt(n)
    low, high = mean - half, mean + half
    if low >= 1 - tolerance:
        verdict = "not slower" if high >= 1 else "slower within tolerance"
    else:
        verdict = "inconclusive" if high >= 1 else "slower"
    return {"ratios": ratios, "mean": mean, "low": low, "high": high, "verdict": verdict}


def verdicts(base: dict, head: dict, tolerance: float = TOLERANCE) -> dict:
    """Per figure: ``paired`` over the two revisions' rounds (in round order)."""
    return {key: paired(base[key]["rounds"], head[key]["rounds"], tolerance) for key in FIGURES}


def _verdict_cell(verdict: dict) -> str:
    """'tokens_per_step: not slower (0.98, 0.95-1.01), ...': the verdict, the mean ratio and its
    bounds, per figure."""
    cells = []
    for key, v in verdict.items():
        bounds = "" if v["low"] is None else f", {v['low']:.3f}-{v['high']:.3f}"
        cells.append(f"{key}: {v['verdict']} ({v['mean']:.3f}{bounds})")
    return ", ".join(cells)


def markdown(report: dict) -> str:
    tolerance = report["tolerance"]
    lines = ["# Two revisions in alternating rounds: is head slower?", "",
             f"{report['date']}; {report['machine']}; LD_PRELOAD {report['ld_preload']}; "
             f"vLLM {report['vllm']}; {report['model']} {report['dtype']}; method "
             f"`{report['method']}`; {report['prompts']}; up to {report['max_tokens']} new tokens; "
             f"order of each round: {report['order']}. Command: `{report['command']}`.", "",
             f"base {report['base']['rev']} ({report['base']['commit'][:10]}), head "
             f"{report['head']['rev']} ({report['head']['commit'][:10]}).", "",
             "Verdict per figure, a paired comparison over the rounds: each round ran both revisions "
             "back to back (A B / B A / A B ...) and gives one ratio head / base; over the rounds, "
             "the ratios' mean and its one-sided 95% Student-t bounds. \"not slower\": lower bound "
             f"at least {1 - tolerance:g} (a tolerance of {tolerance:.0%}) and upper bound at least 1; "
             "\"slower within tolerance\": lower bound at least "
             f"{1 - tolerance:g}, upper below 1; \"slower\": lower bound below {1 - tolerance:g}, upper "
             f"below 1; \"inconclusive\": lower bound below {1 - tolerance:g}, upper at least 1 (more "
             "rounds would tell).", "",
             "| batch | temperature | revision | tokens per step (rounds) | mean | tokens/s (rounds) "
             f"| mean | same answer in every round | verdict: head / base per round, mean (95% bounds), "
             f"tolerance {tolerance:.0%} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in report["configurations"]:
        for name in ("base", "head"):
            s = c[name]
            verdict = _verdict_cell(c["verdict"]) if name == "head" else ""
            same = f"{s['same_answer']} of {c['prompts']}"
            if name == "head":
                same += f" ({c['same_answer_both']} in both revisions' rounds)"
            lines.append(
                f"| {c['batch']} | {c['temperature']:g} | {name} | "
                + " / ".join(f"{v:.3f}" for v in s["tokens_per_step"]["rounds"])
                + f" | {s['tokens_per_step']['mean']:.3f} | "
                + " / ".join(f"{v:.1f}" for v in s["tokens_per_s"]["rounds"])
                + f" | {s['tokens_per_s']['mean']:.1f} | {same} | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the earlier revision (any git revision)")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--method", default="recycling auto")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="how much slower (a fraction) head may be and still be 'not slower'")
    args = parser.parse_args()
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance {args.tolerance} is not a fraction in [0, 1)")
    speculative_config(args.method)  # a bad name fails here, before anything runs
    configs = [(int(b), float(t)) for b in args.batches.split(",") for t in args.temperatures.split(",")]
    ensure_model_prior(args.model, args.dtype)
    with tempfile.TemporaryDirectory(prefix="revisions-") as tmp:
        revs = {}
        for name in ("base", "head"):
            rev = getattr(args, name)
            commit, site = stage(rev, Path(tmp) / name)
            revs[name] = {"rev": rev, "commit": commit, "site": site}
        runs = {(name, c): [] for name in revs for c in configs}
        total, done = 2 * args.rounds * len(configs), 0
        for r in range(args.rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            for name in order:
                for batch, temperature in configs:
                    done += 1
                    print(f"[{done}/{total}] round {r + 1} {name} ({revs[name]['commit'][:10]}) "
                          f"batch {batch} temperature {temperature:g}", flush=True)
                    result = measure(args, revs[name]["site"], batch, temperature)
                    runs[(name, (batch, temperature))].append(result)
                    print(f"    {result['tokens_per_step']:.3f} tokens/step, "
                          f"{result['tokens_per_s']:.1f} tokens/s", flush=True)
    report = {
        **run_header("revisions.py", args.model),
        "dtype": args.dtype, "method": args.method, "max_tokens": args.max_tokens,
        "tolerance": args.tolerance,
        "prompts": f"Spec-Bench turns[0], the shipped sample, {args.per_category} per category "
                   "drawn with seed 0 (spec_bench.py's; sampled runs: prompt i seeded with i)",
        "order": "base, head in odd rounds, head, base in even ones, every configuration in turn",
        **{name: {"rev": v["rev"], "commit": v["commit"]} for name, v in revs.items()},
        "configurations": [],
    }
    for batch, temperature in configs:
        both = runs[("base", (batch, temperature))] + runs[("head", (batch, temperature))]
        base, head = (summary(runs[(n, (batch, temperature))]) for n in ("base", "head"))
        report["configurations"].append({"batch": batch, "temperature": temperature, "base": base,
                                         "head": head, "verdict": verdicts(base, head, args.tolerance),
                                         "prompts": both[0]["prompts"], "same_answer_both": same_answers(both)})
    write_results(f"revisions_{args.tag}", report, markdown)
    print("\n" + markdown(report))


if __name__ == "__main__":
    main()
