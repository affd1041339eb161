"""Whether the initial matrix's rows that text uses most come first: the share of the tokens of
the 480 Spec-Bench questions (``turns[0]``, each model's tokenizer) whose id lies in the first
5%, 10%, 25%, 50% and 75% of the vocabulary. ``warm.compute_prior`` computes rows in id order and
a server takes them in as they come, so this is the share of a prompt's tokens whose rows are in
after that share of the computation (the order of a BPE vocabulary is its merges', which follow
how common a pair was in the tokenizer's training text).

    python benchmarks/prior_order.py --questions question.jsonl   # Spec-Bench's whole question file
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import RESULTS  # noqa: E402

SHARES = (0.05, 0.10, 0.25, 0.50, 0.75)


def coverage(model: str, texts: list[str]) -> dict:
    from transformers import AutoTokenizer

    from vllm_recycling.tools.models import prepare_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_model(model))
    ids = np.concatenate([np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts])
    vocab = len(tokenizer)
    return {"model": model, "vocabulary": vocab, "tokens": int(ids.size),
            "covered": {f"{s:.0%}": float(np.mean(ids < s * vocab)) for s in SHARES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", required=True, help="a Spec-Bench question.jsonl")
    parser.add_argument("--models", default="qwen2.5-coder-0.5b,smollm2")
    args = parser.parse_args()
    texts = [json.loads(line)["turns"][0] for line in Path(args.questions).read_text().splitlines() if line.strip()]
    rows = [coverage(m, texts) for m in args.models.split(",")]
    lines = ["# Which rows of the initial matrix text uses: the share of tokens by id", "",
             f"{datetime.date.today().isoformat()}; the {len(texts)} questions of {Path(args.questions).name} "
             "(`turns[0]`), each model's tokenizer. Command: `python benchmarks/prior_order.py --questions "
             f"{Path(args.questions).name}`.", "",
             "| model | vocabulary | tokens | " + " | ".join(f"ids in the first {s:.0%}" for s in SHARES) + " |",
             "|---|---|---|" + "---|" * len(SHARES)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['vocabulary']:,} | {r['tokens']:,} | "
                     + " | ".join(f"{v:.1%}" for v in r["covered"].values()) + " |")
    text = "\n".join(lines) + "\n"
    (RESULTS / "prior_order.md").write_text(text)
    (RESULTS / "prior_order.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
