"""Spec-Bench prompts: a 52-question sample ships with the package (the first 4 questions of
each of the 13 categories, ``turns[0]`` only); any Spec-Bench ``question.jsonl`` can be given."""

from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources
from pathlib import Path


def spec_bench_questions(path: str | Path | None = None, per_category: int | None = None) -> list[dict]:
    """Questions in file order: dicts with question_id, category and turns; at most
    ``per_category`` from each category."""
    if path is None:
        text = (resources.files("vllm_recycling.data") / "spec_bench_sample.jsonl").read_text()
    else:
        text = Path(path).read_text()
    taken: dict[str, int] = defaultdict(int)
    questions = []
    for line in text.splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        if per_category is None or taken[q["category"]] < per_category:
            taken[q["category"]] += 1
            questions.append(q)
    return questions


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The token ids of a one-turn chat with the model's chat template, ready for generation."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
