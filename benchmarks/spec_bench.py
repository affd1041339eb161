"""Spec-Bench through vLLM: tokens per step and output tokens/s per speculative method, all on
the same prompts, model and machine in one invocation.

    python benchmarks/spec_bench.py                  # every method, the sample below (~27 min on 2 CPU cores)
    python benchmarks/spec_bench.py --methods none,"recycling 2.2.2" --per-category 1
    python benchmarks/spec_bench.py --held-out --tag ngram_sweep \\
        --methods ngram:k=3:min=1:max=3,ngram:k=5:min=2:max=4   # tune on the other prompts

Prompts: the shipped Spec-Bench sample (4 questions in each of 13 categories), ``turns[0]``
with the model's chat template; ``--per-category`` of each category drawn with ``--seed``
(``--held-out`` takes the questions that draw leaves out). Greedy (``--temperature`` T > 0:
sampled, prompt i with seed i), up to ``--max-tokens`` new tokens (exactly that many with
``--ignore-eos``), sent one at a time (batch 1) in file order; with ``--batch B`` all at once to
an engine that runs at most B at a time (``max_num_seqs``; timed as a whole, one row "all"
in place of the categories).

Methods: no speculation; vLLM's ``ngram`` with vLLM's own defaults and with a setting tuned on
the held-out prompts (any ``ngram:k=K:min=A:max=B`` can be named, and any recycling config as
``recycling:KEY=VALUE:...``); ``suffix`` (needs
``arctic-inference==0.1.1``) with vLLM's defaults; recycling with every shipped tree and in
chain mode, each with a hot matrix (shared and kept across the prompts: the paper's hot start,
cold only at the first prompt) and a cold one (``matrix_scope: per_request``: every request
starts from a new matrix). Every matrix starts from the model's prior (``matrix_init:
"model"``, the default); a method named ``... empty`` starts from an empty one instead. Tree
methods hold the context branch (``context_match``, the default); ``... no context`` does not. A method named ``... warm`` (``suffix warm``, ``recycling 2.2.2
warm``) first answers the prompts the measured sample leaves out, one at a time and unmeasured,
so its state (the matrix, suffix decoding's cache of earlier answers) starts warm from other
questions than those it is measured on. Each method runs in its own process (one vLLM engine per process;
an ``ngram`` engine also poisons later engines in its process), one after another so they never
share the CPU.

Acceptance is counted two ways: tokens per step, ``tokens / (tokens - accepted)`` (every step
emits one token plus its accepted drafts, the prefill step included), which is what speeds
decoding up, and vLLM's own mean acceptance length ``1 + accepted / drafts``, which skips the
steps where a method drafted nothing. ``ms/step`` is decoding time over steps: what a step of
that method costs on this machine. Writes ``benchmarks/results/spec_bench_<tag>.{json,md}`` and
a heat map of tokens per step per category, ``spec_bench_<tag>.png``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# vLLM 0.32's ngram defaults: prompt_lookup_min = prompt_lookup_max = 5
# (vllm/config/speculative.py, SpeculativeConfig.__post_init__); num_speculative_tokens has no
# default, 5 is the value of vLLM's documentation examples.
NGRAM_DEFAULT = {"method": "ngram", "num_speculative_tokens": 5}
# Tuned on the held-out half of the sample (see the module docstring and the README).
NGRAM_TUNED = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
               "prompt_lookup_max": 3}

METHODS = {
    "none": None,
    "ngram default": NGRAM_DEFAULT,
    "ngram tuned": NGRAM_TUNED,
    "suffix": {"method": "suffix"},
}
# The default: budget "auto" over the default tree (each step verifies what pays off here).
METHODS["recycling auto"] = {"method": "recycling"}
for _tree in ("chain6", "tree16", "tree32", "2.2.2"):  # every node of the tree, every step
    _spec = {"method": "recycling", "verify": "chain", "budget": "fixed"} if _tree == "chain6" else \
        {"method": "recycling", "tree": _tree, "budget": "fixed"}
    METHODS[f"recycling {_tree} hot"] = _spec
    METHODS[f"recycling {_tree} cold"] = {**_spec, "matrix_scope": "per_request"}
# Without the model's prior (``matrix_init: "model"``, the default): an empty matrix's cold start.
EMPTY = " empty"
for _name in ("recycling auto", "recycling 2.2.2 hot", "recycling 2.2.2 cold"):
    METHODS[_name + EMPTY] = {**METHODS[_name], "matrix_init": "empty"}
# Without the context branch (``context_match: true``, the default): the matrix's tree alone.
NO_CONTEXT = " no context"
for _name in ("recycling auto", "recycling 2.2.2 hot"):
    METHODS[_name + NO_CONTEXT] = {**METHODS[_name], "context_match": False}
# Warmed on the questions outside the measured sample first (``run_method``).
WARM = " warm"
METHODS["suffix" + WARM] = METHODS["suffix"]
METHODS["recycling 2.2.2" + WARM] = METHODS["recycling 2.2.2 hot"]
DEFAULT_METHODS = ",".join(METHODS)


def speculative_config(method: str) -> dict | None:
    """A named method's config, ``ngram:k=K:min=A:max=B``, or ``recycling:KEY=VALUE:...`` with
    the plugin's config keys (``recycling:tree=2.2.2:num_speculative_tokens=8``)."""
    if method in METHODS:
        return METHODS[method]
    fields = dict(part.split("=", 1) for part in method.split(":")[1:] if "=" in part)
    if method.startswith("recycling:"):
        return {"method": "recycling",
                **{k: int(v) if v.isdigit() and k != "tree" else v for k, v in fields.items()}}
    if method.startswith("ngram:"):
        unknown = set(fields) - {"k", "min", "max"}
        if unknown:
            raise ValueError(f"{method!r}: unknown field(s) {sorted(unknown)}; use k, min, max")
        spec = {"method": "ngram", "num_speculative_tokens": int(fields.get("k", 5))}
        for key, name in (("min", "prompt_lookup_min"), ("max", "prompt_lookup_max")):
            if key in fields:
                spec[name] = int(fields[key])
        return spec
    raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}, "
                     "ngram:k=K:min=A:max=B or recycling:KEY=VALUE:...")


def checked_config(method: str) -> dict | None:
    """``speculative_config``, refused at once (ValueError) where this venv cannot run it, not
    after the methods before it have run: vLLM's ``suffix`` needs arctic-inference (``make
    bench`` builds it)."""
    spec = speculative_config(method)
    if spec and spec.get("method") == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        raise ValueError(f"{method!r} needs arctic-inference==0.1.1, not installed in this environment: "
                         "`make bench` builds it (README, benchmarks/README.md)")
    return spec


def benchmark_questions(args, held_out: bool | None = None) -> list[dict]:
    """The measured sample; ``held_out=not args.held_out`` gives the questions it leaves out."""
    from vllm_recycling.tools.prompts import seeded_sample, spec_bench_questions

    return seeded_sample(spec_bench_questions(args.questions), args.per_category, args.seed,
                         held_out=args.held_out if held_out is None else held_out)


def run_method(args) -> dict:
    """One engine, every prompt one at a time; returns the method's figures."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # The engine in this process (starts in ~2 s instead of ~17 s) unless the caller sets
    # VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's own default): see ``engine_mode``.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", IN_PROCESS)
    from transformers import AutoTokenizer
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from vllm_recycling.metrics import spec_decode_counters
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids

    model = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = benchmark_questions(args)
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, q["turns"][0])} for q in questions]
    spec = speculative_config(args.worker)
    batch = {"max_num_seqs": args.batch} if args.batch > 1 else {}
    llm = LLM(model, dtype=args.dtype, enforce_eager=True, max_model_len=2048, seed=0,
              disable_log_stats=False, speculative_config=spec, **batch)
    # Sampled runs: prompt i draws with seed i, so every method answers the same requests.
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    prompt_params = [params if args.temperature == 0 else params.clone() for _ in prompts]
    for i, sp in enumerate(prompt_params):
        sp.seed = i if args.temperature > 0 else None
    # Warm-up on a prompt outside the sample, so a hot matrix starts cold at the first prompt
    # measured only up to these few tokens.
    llm.generate([{"prompt_token_ids": chat_prompt_ids(tokenizer, "Hello!")}],
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    warm_up = {"prompts": 0, "tokens": 0}
    if args.worker.endswith(WARM):
        others = benchmark_questions(args, held_out=not args.held_out)
        for q in tqdm(others, desc=f"{args.worker}: warm-up", unit="prompt"):
            out = llm.generate([{"prompt_token_ids": chat_prompt_ids(tokenizer, q["turns"][0])}],
                               params, use_tqdm=False)[0]
            warm_up["prompts"] += 1
            warm_up["tokens"] += len(out.outputs[0].token_ids)
    per_category: dict[str, dict[str, float]] = {}
    answers = []  # every answer's token ids, in prompt order: their digests in the results
    if args.batch > 1:  # every prompt at once, at most args.batch running
        c0 = spec_decode_counters(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, prompt_params, use_tqdm=False)
        seconds = time.perf_counter() - start
        c1 = spec_decode_counters(llm)
        answers += [list(o.outputs[0].token_ids) for o in outs]
        per_category["all"] = {"prompts": len(outs), "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                               "seconds": seconds, **{k: c1[k] - c0[k] for k in ("accepted", "drafts", "draft_tokens")}}
        questions = []
    for q, p, sp in zip(tqdm(questions, desc=args.worker, unit="prompt"), prompts, prompt_params):
        c0 = spec_decode_counters(llm)
        start = time.perf_counter()
        out = llm.generate([p], sp, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        c1 = spec_decode_counters(llm)
        cat = per_category.setdefault(q["category"], dict.fromkeys(
            ("prompts", "tokens", "accepted", "drafts", "draft_tokens", "seconds"), 0))
        answers.append(list(out.outputs[0].token_ids))
        cat["prompts"] += 1
        cat["tokens"] += len(out.outputs[0].token_ids)
        cat["seconds"] += seconds
        for key in ("accepted", "drafts", "draft_tokens"):
            cat[key] += c1[key] - c0[key]
    total = {key: sum(c[key] for c in per_category.values()) for key in
             ("prompts", "tokens", "accepted", "drafts", "draft_tokens", "seconds")}
    return {"method": args.worker, "speculative_config": spec, "warm_up": warm_up, **_figures(total),
            "answers_sha256": [hashlib.sha256(json.dumps(a).encode()).hexdigest()[:12] for a in answers],
            "per_category": {k: _figures(v) for k, v in per_category.items()}}


def _figures(c: dict) -> dict:
    steps = c["tokens"] - c["accepted"]
    return {
        "prompts": c["prompts"],
        "tokens": c["tokens"],
        "steps": steps,
        "accepted": c["accepted"],
        "drafts": c["drafts"],
        "draft_tokens": c["draft_tokens"],
        "seconds": round(c["seconds"], 2),
        "tokens_per_s": round(c["tokens"] / c["seconds"], 2),
        "ms_per_step": round(1000 * c["seconds"] / steps, 1),
        "tokens_per_step": round(c["tokens"] / steps, 3),
        "vllm_mean_acceptance_length":
            round(1 + c["accepted"] / c["drafts"], 3) if c["drafts"] else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma-separated, from: {', '.join(METHODS)}, "
                             "ngram:k=K:min=A:max=B or recycling:KEY=VALUE:...")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the model's dtype (bfloat16: what users run; on CPUs with AMX vLLM "
                        "then picks its amx KV layout)")
    parser.add_argument("--questions", help="a Spec-Bench question.jsonl (default: the shipped "
                                            "52-question sample)")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true",
                        help="the questions the seeded draw leaves out (for tuning)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above: sampled, prompt i with seed i")
    parser.add_argument("--ignore-eos", action="store_true", help="every answer --max-tokens long")
    parser.add_argument("--batch", type=int, default=1,
                        help="1: one prompt at a time; B: all at once, at most B running")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the plot from the existing results file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(run_method(args)))
        return
    if args.plot_only:
        report = json.loads((RESULTS / f"spec_bench_{args.tag}.json").read_text())
        plot(report, RESULTS / f"spec_bench_{args.tag}.png")
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        try:
            checked_config(method)
        except ValueError as e:
            parser.error(str(e))
    ensure_model_prior(args.model, args.dtype)
    questions = benchmark_questions(args)
    print(f"{len(methods)} methods x {len(questions)} prompts, up to {args.max_tokens} tokens each",
          flush=True)
    rows = []
    for i, method in enumerate(methods, 1):
        print(f"[{i}/{len(methods)}] {method}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--worker", method, "--out", f.name,
                   "--model", args.model, "--dtype", args.dtype, "--per-category", str(args.per_category),
                   "--seed", str(args.seed), "--max-tokens", str(args.max_tokens),
                   "--temperature", str(args.temperature), "--batch", str(args.batch)]
            cmd += ["--ignore-eos"] if args.ignore_eos else []
            cmd += ["--questions", args.questions] if args.questions else []
            cmd += ["--held-out"] if args.held_out else []
            subprocess.run(cmd, check=True)
            rows.append(json.loads(Path(f.name).read_text()))
        print(_table(rows[-1:]), flush=True)
    report = {
        **run_header("spec_bench.py", args.model),
        "engine": engine_mode(),
        "dtype": args.dtype,
        "prompts": (f"Spec-Bench turns[0] with the chat template: the shipped 52-question sample, "
                    f"{'the questions left out by ' if args.held_out else ''}{args.per_category} "
                    f"per category drawn with seed {args.seed} ({len(questions)} prompts)"),
        "question_ids": [q["question_id"] for q in questions],
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "batch": args.batch,
        "results": rows,
    }
    write_results(f"spec_bench_{args.tag}", report, markdown, plot)
    print("\n" + markdown(report))

def cpu_model(cpuinfo: str | None = None) -> str:
    """The processor's name and whether it has AVX-512 and AMX, from ``/proc/cpuinfo`` (or the
    text given). The development machine is not the same from one day to the next (the kernel
    build and the CPU change), and a CPU step's cost moves with it, so times compare only
    within one results file."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or "unknown CPU"
    first = cpuinfo.split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, v in
              (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    flags = fields.get("flags", "").split()
    avx512 = "with" if "avx512f" in flags else "without"
    amx = "with" if "amx_tile" in flags else "without"
    return f"{fields.get('model name', 'unknown CPU')} {avx512} AVX-512, {amx} AMX"


def ensure_model_prior(model: str, dtype: str = "bfloat16", topk: int = 8) -> None:
    """The model's initial matrix computed and cached before anything is measured (an engine
    that starts without it takes it in while it runs, which would blur a measurement)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.warm import ensure_prior

    args = EngineArgs(str(prepare_model(model)), dtype=dtype)
    ensure_prior(args, args.create_model_config(), topk, progress="bar")


# VLLM_ENABLE_V1_MULTIPROCESSING unless the caller sets it: the engine in this process.
IN_PROCESS = "0"
# Variables that change what a run measures, named in its command when set: the engine in
# this process or vLLM's own processes, and how vLLM binds the CPU worker's threads.
ENGINE_VARIABLES = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU")


def engine_mode() -> str:
    """Where spec_bench's engine runs, which decides how many cores compute the model on a CPU."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", IN_PROCESS) == "1":
        return ("vLLM's engine and worker processes (vLLM's default: the CPU worker's threads bound "
                "to the cores vLLM does not reserve, one of two here)")
    return "the engine in the benchmark's process (no thread binding: the model on every core)"


def run_header(script: str, model: str) -> dict:
    """What every results file starts with: date, machine, vLLM version, model, the command
    (with the ``ENGINE_VARIABLES`` set in the environment before it)."""
    import vllm

    env = [f"{k}={os.environ[k]}" for k in ENGINE_VARIABLES if k in os.environ]
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}",
        "vllm": vllm.__version__,
        # what vLLM's CPU worker asks for in LD_PRELOAD (Intel OpenMP, tcmalloc): file names only
        "ld_preload": " ".join(Path(p).name for p in os.environ.get("LD_PRELOAD", "").split(":") if p)
        or "none",
        "model": model,
        "command": " ".join(env + [f"python benchmarks/{script}"] + [
            f"'{a}'" if " " in a or "," in a else a for a in sys.argv[1:]]),
    }


def write_results(name: str, report: dict, markdown, plot=None) -> None:
    """benchmarks/results/<name>.{json,md}, and .png with a ``plot``, each written whole or not
    at all (``write_atomically``): a run killed while it writes leaves the previous files."""
    RESULTS.mkdir(exist_ok=True)
    text = json.dumps(report, indent=2) + "\n"
    write_atomically(RESULTS / f"{name}.json", lambda path: path.write_text(text))
    table = markdown(report)
    write_atomically(RESULTS / f"{name}.md", lambda path: path.write_text(table))
    if plot is not None:
        write_atomically(RESULTS / f"{name}.png", lambda path: plot(report, path))


def write_atomically(path: Path, write) -> None:
    """``write(temporary)`` writes a temporary file beside ``path`` (same folder, same suffix,
    so a plot's format is still read from it), which is flushed to disk and then renamed over
    ``path`` (``os.replace``, atomic within one file system); on any error it is removed and
    ``path`` is left as it was."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    temporary = Path(name)
    try:
        write(temporary)
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would make results unreadable to others
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def markdown(report: dict) -> str:
    rows = report["results"]
    base = next((r for r in rows if r["method"] == "none"), None)
    categories = list(rows[0]["per_category"])
    lines = ["# Spec-Bench through vLLM", "",
             f"{report['date']}; {report['machine']}; LD_PRELOAD {report.get('ld_preload', 'none')}; "
             f"vLLM {report['vllm']}; {report['model']} "
             f"{report['dtype']}; {report['prompts']}; up to {report['max_tokens']} new tokens; "
             f"{_decoding(report)}; batch {report.get('batch', 1)}"
             + (f"; {report['engine']}" if "engine" in report else "")
             + f". Command: `{report['command']}`.", "",
             _table(rows, base), ""]
    warm = [r for r in rows if r.get("warm_up", {}).get("prompts")]
    if warm:
        lines += ["Warm-up, unmeasured, on the questions outside the sample: " + "; ".join(
            f"{r['method']}: {r['warm_up']['prompts']} prompts, {r['warm_up']['tokens']} tokens"
            for r in warm) + ".", ""]
    lines += ["Tokens per step by category:", "",
             "| method | " + " | ".join(categories) + " |",
             "|---|" + "---|" * len(categories)]
    for r in rows:
        lines.append(f"| {r['method']} | " + " | ".join(
            f"{r['per_category'][c]['tokens_per_step']:.2f}" for c in categories) + " |")
    return "\n".join(lines) + "\n"


def _decoding(report: dict) -> str:
    t = report.get("temperature", 0.0)
    how = "greedy" if not t else f"temperature {t:g} (prompt i seeded with i)"
    return how + ("; every answer full length (ignore_eos)" if report.get("ignore_eos") else "")


def _table(rows, base=None) -> str:
    lines = ["| method | tokens per step | vLLM mean acceptance length | tokens/s | speed-up | "
             "ms/step | tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        mal = r["vllm_mean_acceptance_length"]
        lines.append(f"| {r['method']} | {r['tokens_per_step']:.2f} | "
                     f"{'-' if mal is None else f'{mal:.2f}'} | {r['tokens_per_s']:.1f} | "
                     f"{speedup} | {r['ms_per_step']:.0f} | {r['tokens']} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Heat map: tokens per step, methods (rows) by category (columns), overall last."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = report["results"]
    categories = list(rows[0]["per_category"])
    values = np.array([[r["per_category"][c]["tokens_per_step"] for c in categories]
                       + [r["tokens_per_step"]] for r in rows])
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * (len(categories) + 1), 1.2 + 0.42 * len(rows)))
    image = ax.imshow(values, cmap="viridis", aspect="auto", vmin=1.0)
    ax.set_xticks(range(len(categories) + 1), categories + ["overall"], rotation=40, ha="right")
    ax.set_yticks(range(len(rows)), [r["method"] for r in rows])
    ax.axvline(len(categories) - 0.5, color="white", linewidth=2)
    middle = values.min() + 0.6 * (values.max() - values.min())
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                color="black" if v > middle else "white")
    ax.set_title(f"Tokens per step on Spec-Bench, {report['model']}, vLLM {report['vllm']}, "
                 f"{_decoding(report)}, batch {report.get('batch', 1)}, up to {report['max_tokens']} new tokens",
                 fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
