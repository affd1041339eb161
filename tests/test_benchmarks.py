"""The benchmark scripts' own logic: prompt sampling, method names, figures and tables (no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_recycling.prompts import seeded_sample, spec_bench_questions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_bench  # noqa: E402
import spec_bench  # noqa: E402


def test_seeded_sample_and_held_out_split_every_category():
    questions = spec_bench_questions()
    chosen = seeded_sample(questions, 2, seed=0)
    held_out = seeded_sample(questions, 2, seed=0, held_out=True)
    assert len(chosen) == len(held_out) == 26
    ids = [q["question_id"] for q in chosen]
    assert not set(ids) & {q["question_id"] for q in held_out}
    assert sorted(ids + [q["question_id"] for q in held_out]) == sorted(q["question_id"] for q in questions)
    categories = [q["category"] for q in chosen]
    assert all(categories.count(c) == 2 for c in set(categories)) and len(set(categories)) == 13
    assert ids == [q["question_id"] for q in seeded_sample(questions, 2, seed=0)]  # same draw
    assert ids != [q["question_id"] for q in seeded_sample(questions, 2, seed=1)]
    assert ids == sorted(ids, key=[q["question_id"] for q in questions].index)  # file order
    with pytest.raises(ValueError, match="has 4 questions, fewer than per_category=5"):
        seeded_sample(questions, 5)


def test_method_names():
    assert spec_bench.speculative_config("none") is None
    assert spec_bench.speculative_config("recycling 2.2.2 cold") == {
        "method": "recycling", "tree": "2.2.2", "matrix_scope": "per_request"}
    assert spec_bench.speculative_config("recycling chain6 hot") == {
        "method": "recycling", "verify": "chain"}
    assert spec_bench.speculative_config("ngram:k=4:min=1:max=3") == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
    assert spec_bench.speculative_config("recycling:tree=2.2.2:num_speculative_tokens=8") == {
        "method": "recycling", "tree": "2.2.2", "num_speculative_tokens": 8}
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['n'\]"):
        spec_bench.speculative_config("ngram:n=3")
    with pytest.raises(ValueError, match="unknown method 'eagle'"):
        spec_bench.speculative_config("eagle")
    assert set(serve_bench.DEFAULT_METHODS.split(",")) <= set(spec_bench.METHODS)


def test_figures_count_every_step():
    # 10 tokens in 4 steps (1 prefill + 3 decode steps that accepted 6 drafts in all).
    f = spec_bench._figures({"prompts": 1, "tokens": 10, "accepted": 6, "drafts": 3,
                             "draft_tokens": 48, "seconds": 2.0})
    assert f["steps"] == 4 and f["tokens_per_step"] == 2.5 and f["ms_per_step"] == 500.0
    assert f["vllm_mean_acceptance_length"] == 3.0 and f["tokens_per_s"] == 5.0
    f = spec_bench._figures({"prompts": 1, "tokens": 10, "accepted": 0, "drafts": 0,
                             "draft_tokens": 0, "seconds": 1.0})
    assert f["tokens_per_step"] == 1.0 and f["vllm_mean_acceptance_length"] is None


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert serve_bench.percentile(values, 50) == 51.0
    assert serve_bench.percentile(values, 99) == 99.0
    assert serve_bench.percentile([3.0], 99) == 3.0
    assert serve_bench.percentile([], 50) is None


def _level(c, tps):
    return {"concurrency": c, "requests": 8, "tokens": 100, "seconds": 1.0, "tokens_per_s": tps,
            "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "itl_p50_ms": 5.0, "itl_p99_ms": 9.0,
            "tokens_per_step": 1.5}


def test_serve_tables_and_plot(tmp_path):
    report = {"date": "2026-11-22", "machine": "x86_64, 2 CPUs, Linux", "vllm": "0.32.0",
              "model": "smollm2", "server_args": ["--dtype", "float32"], "prompts": "p",
              "max_tokens": 48, "requests": "r", "command": "c",
              "results": [{"method": "none", "levels": [_level(1, 10.0), _level(4, 20.0)]},
                          {"method": "recycling 2.2.2 hot",
                           "levels": [_level(1, 15.0), _level(4, 10.0)]}]}
    md = serve_bench.markdown(report)
    assert "| recycling 2.2.2 hot | 1.50x | 0.50x |" in md
    assert "| none | 4 | 20.0 | 1.50 | 10 / 20 | 5 / 9 | 8 |" in md
    pytest.importorskip("matplotlib")
    serve_bench.plot(report, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
