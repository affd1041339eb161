"""The Model Runner V2 adapter (vLLM 0.34) against the V1 one (vLLM 0.32) on a real model: the
same chain configuration in both, greedy, the shipped Spec-Bench sample in one batch; tokens per
step counting every step (tokens / (tokens - accepted)) and whether each prompt's tokens are
those of no speculation on the same vLLM and attention backend. vLLM 0.32's default (trees and
the budget) is run beside them for reference; the whole "2.2.2" tree every step (the matrix's
alone) on vLLM 0.32's CPU attention and on vLLM 0.34's Triton attention (the GPU path, through
Triton's interpreter) compares the two adapters' trees.

    python benchmarks/studies/mrv2_parity.py            # needs .venv (vLLM 0.32) and .venv034 (make venv034)
    python benchmarks/studies/mrv2_parity.py --only tree,none   # the runs whose label has either

Each run is an engine in a process of its own, in the Python of its vLLM (0.34's with Triton's
interpreter: its steps are slow, so only acceptance is compared, not time). Every recycling run
starts from an empty matrix (``matrix_init: "empty"``: the model's initial matrix would take
longer to compute than the runs). Writes ``benchmarks/results/mrv2_parity_<model>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: spec_bench

CHAIN = {"method": "recycling", "verify": "chain", "num_speculative_tokens": 4, "budget": "fixed",
         "matrix_init": "empty"}
DEFAULT = {"method": "recycling", "matrix_init": "empty"}
# the whole "2.2.2" tree every step, the matrix's alone: what vLLM 0.34 verifies
TREE = {"method": "recycling", "verify": "tree", "budget": "fixed", "context_match": False,
        "matrix_init": "empty"}
TRITON = "TRITON_ATTN"  # vLLM 0.34 runs trees on vLLM's Triton attention (Triton's interpreter here)
# (label, Python, speculative_config, attention)
RUNS = [
    ("vLLM 0.32, none", ".venv", None, None),
    ("vLLM 0.32, chain of 4", ".venv", CHAIN, None),
    ("vLLM 0.32, default (trees, budget)", ".venv", DEFAULT, None),
    ("vLLM 0.32, tree 2.2.2 whole", ".venv", TREE, None),
    ("vLLM 0.34, none", ".venv034", None, None),
    ("vLLM 0.34, chain of 4", ".venv034", CHAIN, None),
    ("vLLM 0.34 on TRITON_ATTN, none", ".venv034", None, TRITON),
    ("vLLM 0.34 on TRITON_ATTN, tree 2.2.2 whole", ".venv034", TREE, TRITON),
]


def worker(args) -> dict:
    """One engine: every prompt's greedy tokens, and the spec-decode counters."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import spec_bench_questions

    questions = [q["turns"][0] for q in spec_bench_questions(None, per_category=1)][: args.prompts or None]
    spec = json.loads(args.spec) if args.spec else None
    llm = LLM(str(prepare_model(args.model)), speculative_config=spec, dtype="float32",
              enforce_eager=True, max_model_len=2048, max_num_seqs=len(questions), seed=0,
              disable_log_stats=False)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                       SamplingParams(temperature=0, max_tokens=args.max_tokens))
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {"vllm": vllm.__version__, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "drafts": counters.get("vllm:spec_decode_num_drafts") or 0,
            "accepted": counters.get("vllm:spec_decode_num_accepted_tokens") or 0}


def run(label: str, venv: str, spec: dict | None, attention: str | None, args) -> dict:
    python = ROOT / venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"{python} is missing: {'make venv034' if venv == '.venv034' else 'make setup'}")
    env = {**os.environ, "TRITON_INTERPRET": "1"} if venv == ".venv034" else dict(os.environ)
    if attention == TRITON:
        env["VLLM_RECYCLING_GPU_PATH_ON_CPU"] = "1"
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        argv = [str(python), __file__, "--worker", out.name, "--model", args.model,
                "--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts), "--spec", json.dumps(spec) if spec else ""]
        print(f"{label} ...", flush=True)
        started = time.monotonic()
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        print(f"  {time.monotonic() - started:.0f} s", flush=True)
        return {"label": label, "spec": spec, "attention": attention, **json.loads(Path(out.name).read_text())}


def markdown(report: dict) -> str:
    lines = [f"# Model Runner V2 (vLLM 0.34) against V1 (vLLM 0.32): {report['model']}, float32, greedy",
             "", f"{report['date']}, {report['machine']}", "", f"Command: `{report['command']}`", "",
             f"{report['prompts']} prompts (the first of each of the first {report['prompts']} Spec-Bench categories in the shipped sample, chat template) in one batch, "
             f"up to {report['max_tokens']} new tokens; every recycling run from an empty matrix. "
             "Tokens per step = tokens / (tokens - accepted), every step counted.", "",
             "| run | tokens | drafting steps | accepted | tokens per step | prompts identical to none |",
             "|---|---|---|---|---|---|"]
    for r in report["runs"]:
        tokens = sum(len(t) for t in r["tokens"])
        per_step = tokens / max(tokens - r["accepted"], 1)
        lines.append(f"| {r['label']} | {tokens} | {r['drafts']} | {r['accepted']} | {per_step:.3f} | "
                     f"{r.get('identical', '-')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=0,
                        help="the first N categories' prompts (0: all 13); trees on Triton's interpreter are slow")
    parser.add_argument("--only", default="", help="run the runs whose label contains this (e.g. 'tree,none')")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker).write_text(json.dumps(worker(args)))
        return
    from spec_bench import run_header, write_results

    report = {**run_header("studies/mrv2_parity.py", args.model), "max_tokens": args.max_tokens}
    report.pop("vllm")
    wanted = [w for w in args.only.split(",") if w]
    runs = [run(label, venv, spec, attention, args) for label, venv, spec, attention in RUNS
            if not wanted or any(w in label for w in wanted)]
    none = {(r["vllm"], r.get("attention")): r["tokens"] for r in runs if r["spec"] is None}
    for r in runs:
        if r["spec"] is not None and (r["vllm"], r.get("attention")) in none:
            base = none[r["vllm"], r.get("attention")]
            r["identical"] = f"{sum(a == b for a, b in zip(r['tokens'], base))} of {len(base)}"
    report["runs"], report["prompts"] = runs, len(runs[0]["tokens"])
    suffix = "".join(f"_{w.strip().replace(' ', '_')}" for w in wanted)
    write_results(f"mrv2_parity_{args.model}{suffix}", report, markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
