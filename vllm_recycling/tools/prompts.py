"""Spec-Bench prompts: a 52-question sample ships with the package (the first 4 questions of
each of the 13 categories, ``turns[0]`` only); any Spec-Bench ``question.jsonl`` can be given."""

from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources
from pathlib import Path


def shipped_sample() -> Path:
    """The shipped sample's file (Spec-Bench's question.jsonl format: what ``vllm bench serve
    --dataset-name spec_bench`` reads)."""
    return Path(str(resources.files("vllm_recycling.data") / "spec_bench_sample.jsonl"))


def spec_bench_questions(path: str | Path | None = None, per_category: int | None = None) -> list[dict]:
    """Questions in file order: dicts with question_id, category and turns; at most
    ``per_category`` from each category."""
    text = Path(shipped_sample() if path is None else path).read_text()
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


def seeded_sample(questions: list[dict], per_category: int, seed: int = 0,
                  held_out: bool = False) -> list[dict]:
    """``per_category`` questions drawn at random (``seed``) from each category, in file order;
    with ``held_out`` the questions that draw leaves out instead (to tune settings on prompts
    the measurement does not use)."""
    import random

    by_category: dict[str, list[int]] = defaultdict(list)
    for i, q in enumerate(questions):
        by_category[q["category"]].append(i)
    rng = random.Random(seed)
    chosen = set()
    for category in sorted(by_category):
        indices = by_category[category]
        if per_category > len(indices):
            raise ValueError(f"category {category!r} has {len(indices)} questions, "
                             f"fewer than per_category={per_category}")
        chosen.update(rng.sample(indices, per_category))
    return [q for i, q in enumerate(questions) if (i in chosen) != held_out]
