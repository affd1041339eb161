"""What a matrix snapshot keeps across a restart, under the default budget: tokens per step on
prompts decoded after the engine learnt from other prompts, with and without a restart between.

    python benchmarks/snapshot_restart.py                       # 16 + 16 prompts, ~6 min on 2 cores
    python benchmarks/snapshot_restart.py --matrix-init empty   # without the model's prior

The shipped Spec-Bench sample (52 questions, ``turns[0]`` with the chat template), shuffled
with ``--seed``: the first ``--prompts`` are learnt from, the next ``--prompts`` measured, one
request at a time, greedy, up to ``--max-tokens`` new tokens, speculative config ``{"method":
"recycling", "matrix_init": --matrix-init}`` (budget "auto"). Each engine runs in its own
process:

- ``fresh``: a new engine decodes the measured prompts (nothing learnt before);
- ``no restart``: one engine learns, then decodes the measured prompts;
- ``restored``: one engine learns and saves its snapshot at shutdown; a new engine loads it and
  decodes the measured prompts;
- ``restored, table only``: as ``restored`` from the same snapshot rewritten without its rows'
  confidences (format version 1, what snapshots held before version 2).

Tokens per step: ``tokens / (tokens - accepted)`` over the measured prompts (as
``spec_bench.py``). Writes ``benchmarks/results/<--out>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import RESULTS, run_header  # noqa: E402

VARIANTS = ("fresh", "no restart", "restored", "restored, table only")


def prompts(args) -> tuple[list[list[int]], list[list[int]]]:
    """(learnt, measured) token-id prompts."""
    import random

    from transformers import AutoTokenizer

    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids, spec_bench_questions

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_model(args.model)))
    questions = spec_bench_questions()
    random.Random(args.seed).shuffle(questions)
    ids = [chat_prompt_ids(tokenizer, q["turns"][0]) for q in questions[: 2 * args.prompts]]
    return ids[: args.prompts], ids[args.prompts :]


def engine_run(args) -> dict:
    """One engine (this process): learn from the first prompts when ``--learn``, then decode the
    measured ones when ``--measure``; returns the measured counts."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_recycling.metrics import spec_decode_counters
    from vllm_recycling.tools.models import prepare_model

    learnt, measured = prompts(args)
    spec = {"method": "recycling", "matrix_init": args.matrix_init}
    if args.snapshot:
        spec |= {"matrix_snapshot": args.snapshot, "matrix_snapshot_interval": 0}
    llm = LLM(str(prepare_model(args.model)), dtype="float32", enforce_eager=True, max_model_len=2048,
              seed=0, disable_log_stats=False, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    counts = {"tokens": 0, "accepted": 0, "drafts": 0, "draft_tokens": 0}
    if args.learn:
        for p in learnt:
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    if args.measure:
        before = spec_decode_counters(llm)
        for p in measured:
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            counts["tokens"] += len(out.outputs[0].token_ids)
        after = spec_decode_counters(llm)
        for key in ("accepted", "drafts", "draft_tokens"):
            counts[key] = after[key] - before[key]
    llm.llm_engine.engine_core.shutdown()  # saves the snapshot
    return counts


def table_only(path: str) -> None:
    """Rewrite a snapshot as format version 1: the table, without the rows' confidences."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_recycling.matrix import SNAPSHOT_KEY

    with safe_open(path, framework="pt") as f:
        meta, table = dict(f.metadata()), f.get_tensor(SNAPSHOT_KEY)
    save_file({SNAPSHOT_KEY: table}, path, metadata={**meta, "version": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=16, help="learnt, and as many measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--matrix-init", choices=("empty", "model"), default="model")
    parser.add_argument("--out", default="snapshot_restart")
    for flag in ("--learn", "--measure"):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.result:
        Path(args.result).write_text(json.dumps(engine_run(args)))
        return

    def run(*flags: str, snapshot: str | None = None) -> dict:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--result", f.name, "--model", args.model,
                   "--prompts", str(args.prompts), "--seed", str(args.seed),
                   "--max-tokens", str(args.max_tokens), "--matrix-init", args.matrix_init, *flags]
            subprocess.run(cmd + (["--snapshot", snapshot] if snapshot else []), check=True)
            return json.loads(Path(f.name).read_text())

    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        learnt = Path(folder) / "learnt.safetensors"
        snapshot = str(Path(folder) / "adj.safetensors")  # each measuring engine saves over it
        for variant in VARIANTS:
            print(f"[{variant}]", flush=True)
            if variant == "fresh":
                rows[variant] = run("--measure")
            elif variant == "no restart":
                rows[variant] = run("--learn", "--measure")
            else:
                if not learnt.exists():
                    run("--learn", snapshot=str(learnt))
                shutil.copyfile(learnt, snapshot)
                if variant == "restored, table only":
                    table_only(snapshot)
                rows[variant] = run("--measure", snapshot=snapshot)
    for r in rows.values():
        r["tokens_per_step"] = round(r["tokens"] / (r["tokens"] - r["accepted"]), 3)
    report = {**run_header("snapshot_restart.py", args.model), "prompts": args.prompts,
              "seed": args.seed, "max_tokens": args.max_tokens, "matrix_init": args.matrix_init,
              "results": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(report))
    print("\n" + markdown(report))


def markdown(report: dict) -> str:
    rows = report["results"]
    lines = ["# Tokens per step after a restart from a matrix snapshot", "",
             f"{report['date']}; {report['machine']}; vLLM {report['vllm']}; {report['model']} float32; "
             f"the shipped Spec-Bench sample shuffled with seed {report['seed']}: "
             f"{report['prompts']} prompts learnt, the next {report['prompts']} measured, batch 1, "
             f"greedy, up to {report['max_tokens']} new tokens; budget \"auto\", matrix_init "
             f"\"{report['matrix_init']}\". Command: `{report['command']}`.", "",
             "| variant | tokens per step | vs. no restart | tokens | accepted | drafts | draft tokens |",
             "|---|---|---|---|---|---|---|"]
    base = rows["no restart"]["tokens_per_step"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tokens_per_step']:.3f} | {r['tokens_per_step'] / base:.3f}x | "
                     f"{r['tokens']} | {r['accepted']} | {r['drafts']} | {r['draft_tokens']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
