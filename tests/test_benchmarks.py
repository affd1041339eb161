"""The benchmark scripts' own logic: prompt sampling, method names, figures and tables (no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_recycling.tools.prompts import seeded_sample, spec_bench_questions

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS / "studies"))  # the one-off studies: budget_ceiling, verify_cost, ...
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks a user runs, and spec_bench and server they share
import revisions  # noqa: E402
import serve_bench  # noqa: E402
import snapshot_restart  # noqa: E402
import spec_bench  # noqa: E402
import verify_cost  # noqa: E402


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
    assert spec_bench.speculative_config("recycling auto") == {"method": "recycling"}
    assert spec_bench.speculative_config("recycling 2.2.2 cold") == {
        "method": "recycling", "tree": "2.2.2", "matrix_scope": "per_request", "budget": "fixed"}
    assert spec_bench.speculative_config("recycling chain6 hot") == {
        "method": "recycling", "verify": "chain", "budget": "fixed"}
    assert spec_bench.speculative_config("recycling 2.2.2 warm") == spec_bench.METHODS["recycling 2.2.2 hot"]
    assert spec_bench.speculative_config("suffix warm") == {"method": "suffix"}
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


def test_cpu_model_names_the_processor_avx512_and_amx():
    # /proc/cpuinfo pads keys with tabs; only the first processor's block is read.
    xeon = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz\n"
            "flags\t\t: fpu sse2 avx2 avx512f avx512bw\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    amx = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: avx512f amx_bf16 amx_tile\n"
    epyc = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512_bf16\n"
    assert spec_bench.cpu_model(xeon) == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz with AVX-512, without AMX"
    assert spec_bench.cpu_model(amx) == "Intel(R) Xeon(R) Processor with AVX-512, with AMX"
    assert spec_bench.cpu_model(epyc) == "AMD EPYC without AVX-512, without AMX"
    assert spec_bench.cpu_model("processor\t: 0\n") == "unknown CPU without AVX-512, without AMX"


def test_results_name_the_engine_and_the_variables_that_shape_it(monkeypatch):
    pytest.importorskip("vllm")
    for name in spec_bench.ENGINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["spec_bench.py", "--tag", "x"])
    assert spec_bench.run_header("spec_bench.py", "smollm2")["command"] == "python benchmarks/spec_bench.py --tag x"
    assert spec_bench.engine_mode().startswith("the engine in the benchmark's process")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert spec_bench.run_header("spec_bench.py", "smollm2")["command"] == (
        "VLLM_ENABLE_V1_MULTIPROCESSING=1 VLLM_CPU_OMP_THREADS_BIND=0-1 python benchmarks/spec_bench.py --tag x")
    assert spec_bench.engine_mode().startswith("vLLM's engine and worker processes")


def test_figures_count_every_step():
    # 10 tokens in 4 steps (1 prefill + 3 decode steps that accepted 6 drafts in all).
    f = spec_bench._figures({"prompts": 1, "tokens": 10, "accepted": 6, "drafts": 3,
                             "draft_tokens": 48, "seconds": 2.0})
    assert f["steps"] == 4 and f["tokens_per_step"] == 2.5 and f["ms_per_step"] == 500.0
    assert f["vllm_mean_acceptance_length"] == 3.0 and f["tokens_per_s"] == 5.0
    f = spec_bench._figures({"prompts": 1, "tokens": 10, "accepted": 0, "drafts": 0,
                             "draft_tokens": 0, "seconds": 1.0})
    assert f["tokens_per_step"] == 1.0 and f["vllm_mean_acceptance_length"] is None


def _level(c, tps):
    return {"concurrency": c, "requests": 8, "tokens": 100, "seconds": 1.0, "tokens_per_s": tps,
            "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "tpot_p50_ms": 7.0, "tpot_p99_ms": 12.0,
            "itl_p50_ms": 5.0, "itl_p99_ms": 9.0, "tokens_per_step": 1.5, "vllm_acceptance_length": 1.4}


def test_a_level_counts_every_step_from_the_servers_counters():
    """Tokens per step from the server's counters, every step counted (vLLM's acceptance
    length, kept beside it, leaves out the steps that drafted nothing)."""
    result = {"completed": 8, "total_output_tokens": 300, "duration": 2.345, "output_throughput": 127.93,
              "p50_ttft_ms": 10.04, "p99_ttft_ms": 20.0, "p50_tpot_ms": 7.0, "p99_tpot_ms": None,
              "p50_itl_ms": 5.0, "p99_itl_ms": 9.0, "spec_decode_acceptance_length": 2.5}
    row = serve_bench._level_row(4, 8, result, {"accepted": 50, "tokens": 400}, {"accepted": 150, "tokens": 700})
    assert row["tokens_per_step"] == 1.5 and row["vllm_acceptance_length"] == 2.5
    assert (row["seconds"], row["tokens_per_s"], row["ttft_p50_ms"], row["tpot_p99_ms"]) == (2.35, 127.93, 10.0, None)


def test_paired_ratios_cancel_a_linear_drift():
    # the machine speeds up by 1 token/s per run; A is 10% faster than none at every moment
    methods = ["none", "A", "A", "none", "none", "A"]
    rows = [{"method": m, "levels": [_level(16, (10.0 + i) * (1.1 if m == "A" else 1.0))]}
            for i, m in enumerate(methods)]
    paired = serve_bench.paired_ratios(rows, 16)
    # bracketed runs: exact; the last (no none after it) against the nearest none run
    assert [round(r, 6) for r in paired["A"]] == [1.1, 1.1, round(1.1 * 15 / 14, 6)]
    assert "none" not in paired
    assert serve_bench.paired_ratios(rows, 64) == {}


def test_serve_tables_and_plot(tmp_path):
    report = {"date": "2026-11-22", "machine": "x86_64, 2 CPUs, Linux", "vllm": "0.32.0",
              "model": "smollm2", "server_args": ["--dtype", "float32"], "prompts": "p",
              "max_tokens": 48, "requests": "r", "command": "c",
              "results": [{"method": "none", "levels": [_level(1, 10.0), _level(4, 20.0)]},
                          {"method": "recycling 2.2.2 hot",
                           "levels": [_level(1, 15.0), _level(4, 10.0)]}]}
    md = serve_bench.markdown(report)
    assert "| recycling 2.2.2 hot | 1.50x | 0.50x |" in md
    assert "| none | 4 | 20.0 | 1.50 | 1.40 | 10 / 20 | 7 / 12 | 5 / 9 | 8 |" in md
    # a method run more than once: medians over none's median, with the range of its runs
    report["results"] += [{"method": "none", "levels": [_level(1, 12.0), _level(4, 20.0)]},
                          {"method": "none", "levels": [_level(1, 11.0)]},
                          {"method": "recycling 2.2.2 hot", "levels": [_level(1, 13.2)]}]
    md = serve_bench.markdown(report)
    assert "| none (3 runs) | 1.00x (0.91-1.09) | 1.00x (1.00-1.00) |" in md
    assert "| recycling 2.2.2 hot (2 runs) | 1.28x (1.20-1.36) | 0.50x |" in md
    # each run against none interpolated at its place: the first run 15 / (10 + (12 - 10) / 2),
    # the last 13.2 / 11 (no none after it); at c=4 only the first run has that level
    assert "| recycling 2.2.2 hot | 1.28x (1.20-1.36) | 0.50x (0.50-0.50) |" in md
    pytest.importorskip("matplotlib")
    serve_bench.plot(report, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_bench_keeps_the_budgets_profile_and_last_summary(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) INFO starting\n"
        "(Worker pid=2) INFO [adaptive_budget.py:110] recycling: step cost profiled in 6.9 s: 1 tokens 47.1 ms\n"
        "(Worker pid=2) INFO [adaptive_budget.py:263] recycling budget: 10 decode steps, 0.50 drafts\n"
        "(Worker pid=2) INFO [adaptive_budget.py:263] recycling budget: 20 decode steps, 0.25 drafts\n")
    lines = serve_bench.budget_log(log)
    assert lines == ["recycling: step cost profiled in 6.9 s: 1 tokens 47.1 ms",
                     "recycling budget: 20 decode steps, 0.25 drafts"]
    (tmp_path / "none.log").write_text("(APIServer pid=1) INFO no speculation\n")
    assert serve_bench.budget_log(tmp_path / "none.log") == []
    level = {**_level(4, 20.0), "budget_log": lines}
    md = serve_bench.markdown({"date": "d", "machine": "m", "vllm": "0.32.0", "model": "smollm2",
                               "server_args": [], "prompts": "p", "max_tokens": 48, "requests": "r",
                               "command": "c", "results": [{"method": "none", "levels": [_level(4, 20.0)]},
                                                           {"method": "recycling auto", "levels": [level]}]})
    assert ("- recycling auto (run 2), c=4: `recycling: step cost profiled in 6.9 s: 1 tokens 47.1 ms`; "
            "`recycling budget: 20 decode steps, 0.25 drafts`") in md


def test_verify_cost_tree_step_computes_each_path_as_a_sequence():
    """The benchmark times a real tree step: with the tree's mask and depth positions, every
    node's logits equal a plain causal forward of its root-to-node path over the same prefix."""
    import torch

    from vllm_recycling.tree import load_tree

    torch.manual_seed(0)
    model = verify_cost.Decoder(verify_cost.SHAPES["tiny"], torch.float32, torch.device("cpu"))
    tree, prefix = load_tree("tree16", topk=8), 5
    ids, positions, mask = verify_cost.step_inputs(tree, 2, prefix, 512, "cpu")
    assert mask.shape == (2, 1, 17, prefix + 17) and mask[..., :prefix].all()
    assert torch.equal(positions[0], prefix + tree.depth)
    history = torch.randint(0, 512, (2, prefix))

    def run(tokens, pos, step_mask, length):
        """Prefill the history (attending only to itself), then the step over it."""
        cache = model.cache(2, length, torch.float32, torch.device("cpu"))
        causal = torch.zeros(prefix, length, dtype=torch.bool)
        causal[:, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
        model.forward(history, torch.arange(prefix).expand(2, prefix), causal.expand(2, 1, prefix, length), cache, 0)
        return model.forward(tokens, pos, step_mask, cache, prefix)

    tree_logits = run(ids, positions, mask, prefix + 17)
    for node in (3, 16):
        path = [int(i) for i in tree.ancestors[node].nonzero()]  # breadth-first: root first
        n = len(path)
        seq_mask = torch.ones(n, prefix + n, dtype=torch.bool)
        seq_mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool).tril()
        seq = run(ids[:, path], (prefix + torch.arange(n)).expand(2, n), seq_mask.expand(2, 1, n, prefix + n),
                  prefix + n)
        torch.testing.assert_close(tree_logits[:, node], seq[:, -1], rtol=1e-4, atol=1e-5)


def test_verify_cost_tables(tmp_path):
    assert verify_cost._options(["--batch", "1", "--out-dir", "/x", "--out-dir=/y", "--reps", "2"]) == [
        "--batch", "1", "--reps", "2"]
    assert verify_cost.main(["--shapes", "tiny", "--batch", "1", "2", "--trees", "chain6", "2.2.2",
                             "--prefix", "8", "--reps", "1", "--device", "cpu",
                             "--out-dir", str(tmp_path)]) == 0
    report = __import__("json").loads((tmp_path / "verify_cost_cpu.json").read_text())
    rows = report["rows"]
    assert [(r["batch"], r["tree"], r["tokens"]) for r in rows] == [
        (1, "plain", 1), (1, "chain6", 7), (1, "2.2.2", 81), (2, "plain", 2), (2, "chain6", 14), (2, "2.2.2", 162)]
    assert all(r["eager_x_plain"] == r["eager_ms"] / rows[3 * (r["batch"] - 1)]["eager_ms"] for r in rows)
    mat = report["meta"]["mats"].get("2.2.2")
    if mat:  # the shipped reference_mat.json gives the projection
        assert rows[2]["eager_projected"] == mat / rows[2]["eager_x_plain"]
    text = (tmp_path / "verify_cost_cpu.md").read_text()
    assert "| tiny | 2 | 2.2.2 | 162 |" in text and "--out-dir" not in text


def test_spec_bench_table_names_the_warm_up():
    def row(method, tokens, accepted, warm_prompts=0):
        figures = spec_bench._figures({"prompts": 2, "tokens": tokens, "accepted": accepted,
                                       "drafts": 4, "draft_tokens": 40, "seconds": 2.0})
        return {"method": method, "warm_up": {"prompts": warm_prompts, "tokens": 96 * warm_prompts},
                **figures, "per_category": {"qa": figures}}

    report = {"date": "2026-11-22", "machine": "x86_64, 2 CPUs", "vllm": "0.32.0", "model": "smollm2",
              "dtype": "float32", "prompts": "p", "max_tokens": 48,
              "command": "python benchmarks/spec_bench.py",
              "results": [row("none", 96, 0), row("recycling 2.2.2 warm", 96, 48, warm_prompts=2)]}
    md = spec_bench.markdown(report)
    assert "| recycling 2.2.2 warm | 2.00 | 13.00 | 48.0 | 1.00x | 42 | 96 |" in md
    assert "Warm-up, unmeasured, on the questions outside the sample: recycling 2.2.2 warm: " \
           "2 prompts, 192 tokens." in md
    assert "| qa |" in md and md.count("Warm-up") == 1


def test_snapshot_restart_table_only_is_a_version_1_snapshot(tmp_path):
    """The benchmark's "table only" variant: the same table, no confidences, format 1."""
    import torch

    from vllm_recycling.matrix import AdjacencyMatrix, load_snapshot

    m = AdjacencyMatrix(7, 2, with_probs=True)
    m.table[3] = torch.tensor([4, 1], dtype=torch.int32)
    m.probs[3] = torch.tensor([0.5, 0.25], dtype=torch.float16)
    path = tmp_path / "adj.safetensors"
    m.save(path)
    snapshot_restart.table_only(str(path))
    table, probs = load_snapshot(path, 7, 2, with_probs=True)
    assert torch.equal(table, m.table) and probs is None
    report = {"date": "d", "machine": "m", "vllm": "v", "model": "x", "seed": 0, "prompts": 2,
              "max_tokens": 8, "matrix_init": "model", "command": "c",
              "results": {"no restart": {"tokens_per_step": 1.5, "tokens": 3, "accepted": 1, "drafts": 1,
                                         "draft_tokens": 2},
                          "restored": {"tokens_per_step": 1.2, "tokens": 6, "accepted": 1, "drafts": 1,
                                       "draft_tokens": 2}}}
    assert "| restored | 1.200 | 0.800x | 6 | 1 | 1 | 2 |" in snapshot_restart.markdown(report)


def test_revisions_stage_a_commit_as_the_installed_package(tmp_path):
    """A staged revision is what a process with it first on PYTHONPATH imports: its package,
    kernels and configs, not this checkout's editable install."""
    commit, site = revisions.stage("HEAD", tmp_path / "head")
    assert len(commit) == 40
    assert (site / "vllm_recycling" / "kernels" / "native.c").is_file()
    assert (site / "vllm_recycling" / "configs").is_dir()
    assert not (site / "vllm_recycling" / "kernels" / "__pycache__").exists()


def _revision_runs(per_step, per_s, answers):
    return [{"tokens_per_step": a, "tokens_per_s": b, "answers_sha256": c}
            for a, b, c in zip(per_step, per_s, answers)]


def test_revisions_verdict_is_a_paired_comparison_with_a_tolerance():
    """Each round's ratio head / base; the verdict from their mean's one-sided 95% t bounds
    (t = 2.920 for three rounds) and the 5% tolerance."""
    base = [20.0, 24.0, 22.0]

    def verdict(ratios, tolerance=revisions.TOLERANCE):
        return revisions.paired(base[:len(ratios)], [b * r for b, r in zip(base, ratios)], tolerance)

    # 8% slower in every round: the old rule (head's mean 20.24 at least base's lowest round,
    # 20) called it "within or above"
    v = verdict([0.92, 0.92, 0.92])
    assert v["verdict"] == "slower" and v["mean"] == pytest.approx(0.92)
    assert v["low"] == pytest.approx(0.92) and v["high"] == pytest.approx(0.92)
    v = verdict([1.01, 1.0, 1.02])  # mean 1.01, stdev 0.01: 1.01 -/+ 2.920 * 0.01 / sqrt(3)
    assert v["verdict"] == "not slower"
    assert (v["low"], v["high"]) == (pytest.approx(1.01 - 0.016859, abs=1e-6), pytest.approx(1.01 + 0.016859, abs=1e-6))
    assert verdict([0.98, 0.97, 0.975])["verdict"] == "slower within tolerance"  # 0.975 -/+ 0.0084
    assert verdict([0.98, 0.97, 0.975], tolerance=0.02)["verdict"] == "slower"  # low 0.9666 < 0.98
    assert verdict([0.8, 1.0, 1.2])["verdict"] == "inconclusive"  # 1.0 -/+ 0.337
    assert verdict([0.9]) == {"ratios": [0.9], "mean": 0.9, "low": None, "high": None,
                              "verdict": "too few rounds"}
    with pytest.raises(ValueError, match="rounds do not pair: 3 base, 2 head"):
        revisions.paired(base, base[:2])


def test_revisions_summary_and_table():
    base_runs = _revision_runs([1.9, 1.8], [25.0, 23.0], [["a", "b", "c"], ["a", "x", "c"]])
    head_runs = _revision_runs([1.9, 1.8], [22.5, 20.7], [["a", "b", "y"], ["a", "b", "y"]])
    base, head = revisions.summary(base_runs), revisions.summary(head_runs)
    assert base["same_answer"] == 2 and head["same_answer"] == 3
    assert revisions.same_answers(base_runs + head_runs) == 1
    assert base["tokens_per_s"] == {"rounds": [25.0, 23.0], "mean": 24.0, "min": 23.0, "max": 25.0}
    verdict = revisions.verdicts(base, head)
    assert {k: v["verdict"] for k, v in verdict.items()} == {"tokens_per_step": "not slower",
                                                             "tokens_per_s": "slower"}
    report = {"date": "d", "machine": "m", "ld_preload": "none", "vllm": "0.32.0", "model": "x",
              "dtype": "bfloat16", "method": "recycling auto", "prompts": "p", "max_tokens": 8,
              "order": "o", "command": "c", "tolerance": 0.05, "base": {"rev": "B", "commit": "1" * 40},
              "head": {"rev": "H", "commit": "2" * 40},
              "configurations": [{"batch": 8, "temperature": 1.0, "base": base, "head": head,
                                  "verdict": verdict, "prompts": 3, "same_answer_both": 1}]}
    md = revisions.markdown(report)
    assert md.startswith("# Two revisions in alternating rounds: is head slower?\n")
    assert ("\"not slower\": lower bound at least 0.95 (a tolerance of 5%) and upper bound at least 1; "
            "\"slower within tolerance\": lower bound at least 0.95, upper below 1; \"slower\": lower "
            "bound below 0.95, upper below 1; \"inconclusive\": lower bound below 0.95, upper at least 1 "
            "(more rounds would tell).") in md
    assert "| same answer in every round | verdict: head / base per round, mean (95% bounds), tolerance 5% |" in md
    assert "| 8 | 1 | base | 1.900 / 1.800 | 1.850 | 25.0 / 23.0 | 24.0 | 2 of 3 |  |" in md
    # both rounds' tokens/s 0.9 of base's: mean 0.9, no spread
    assert ("| 8 | 1 | head | 1.900 / 1.800 | 1.850 | 22.5 / 20.7 | 21.6 | 3 of 3 (1 in both revisions' "
            "rounds) | tokens_per_step: not slower (1.000, 1.000-1.000), tokens_per_s: slower "
            "(0.900, 0.900-0.900) |") in md


def test_write_results_replaces_each_file_whole(tmp_path, monkeypatch):
    """Each file is written to a temporary in the results folder and renamed over the old one:
    until the rename the previous file is whole, and a failed write leaves it (review D7: a
    killed run truncated the previous results)."""
    import os

    monkeypatch.setattr(spec_bench, "RESULTS", tmp_path)
    for suffix in (".json", ".md", ".png"):
        (tmp_path / f"r{suffix}").write_text("old")
    replaced = []
    real_replace = os.replace

    def replace(src, dst):
        src, dst = Path(src), Path(dst)
        # the previous file is still whole; the new one waits beside it, same suffix
        replaced.append((dst.name, dst.read_text(), src.parent == tmp_path, src.suffix))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)

    def plot(report, path):
        assert path.suffix == ".png" and path != tmp_path / "r.png"
        path.write_bytes(b"png")

    spec_bench.write_results("r", {"a": 1}, lambda report: "# table\n", plot)
    assert replaced == [("r.json", "old", True, ".json"), ("r.md", "old", True, ".md"),
                        ("r.png", "old", True, ".png")]
    assert (tmp_path / "r.json").read_text() == '{\n  "a": 1\n}\n'
    assert (tmp_path / "r.md").read_text() == "# table\n"
    assert (tmp_path / "r.png").read_bytes() == b"png"
    assert (tmp_path / "r.md").stat().st_mode & 0o777 == 0o644

    def broken(report, path):
        path.write_bytes(b"half a pl")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        spec_bench.write_results("r", {"a": 2}, lambda report: "# new\n", broken)
    assert (tmp_path / "r.png").read_bytes() == b"png"  # the previous plot, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.png"]  # no temporary left


def test_serve_bench_main_leaves_the_module_server_args_alone(tmp_path, monkeypatch):
    """Two runs in one process give their servers the same arguments (review D7: main
    prepended --dtype and appended --server-args to the module's list, so a second call
    carried the first one's)."""
    import vllm_recycling.tools.models as models

    before = list(serve_bench.SERVER_ARGS)
    started, written = [], []

    def run_method(method, args, *rest):
        # the servers' arguments: what this run passes, or (before the fix) the module's list
        started.append(list(rest[0]) if isinstance(rest[0], list) else list(serve_bench.SERVER_ARGS))
        return {"method": method, "speculative_config": None, "levels": []}

    monkeypatch.setattr(serve_bench, "run_method", run_method)
    monkeypatch.setattr(serve_bench, "_write", lambda args, *rest: written.append(rest))
    monkeypatch.setattr(serve_bench, "ensure_model_prior", lambda model, dtype: None)
    monkeypatch.setattr(models, "prepare_model", lambda name: tmp_path)
    monkeypatch.setattr(serve_bench.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(serve_bench, "RESULTS", tmp_path)
    (tmp_path / "serve_bench_t.json").write_text("{}")
    monkeypatch.setattr(serve_bench, "markdown", lambda report: "")
    argv = ["serve_bench.py", "--methods", "none", "--dtype", "float32", "--tag", "t",
            "--server-args", "--no-async-scheduling --seed 3"]
    monkeypatch.setattr(sys, "argv", argv)
    serve_bench.main()
    serve_bench.main()
    expected = ["--dtype", "float32", *before, "--no-async-scheduling", "--seed", "3"]
    assert started == [expected, expected]
    assert list(serve_bench.SERVER_ARGS) == before
    assert serve_bench.server_args("bfloat16") == ["--dtype", "bfloat16", *before]


def test_budget_ceiling_rankings_read_the_accepted_paths(monkeypatch):
    """Root -> 1, 2; 1 -> 3. Paths [1, 3], [2], [1]: the best single node is 1 (two steps'
    tokens), a ranking that scores node 2 highest gets one; rankings learnt online start from
    the prior and learn each node's hits below an accepted parent."""
    import budget_ceiling as bc

    monkeypatch.setattr(bc, "SIZES", (1, 2, 3))
    parents = [0, 0, 0, 1]
    paths = [[1, 3], [2], [1]]
    assert bc.best_subsets(paths, parents) == {1: round(1 + 2 / 3, 3), 2: 2.0, 3: round(1 + 4 / 3, 3)}
    likes_two = [[0.2, 0.9, 0.1]] * 3
    assert bc.ranked_subsets(paths, likes_two, parents) == {1: round(1 + 1 / 3, 3), 2: 2.0, 3: round(1 + 4 / 3, 3)}
    assert bc.ranked_subsets(paths, [None] * 3, parents) == {1: 1.0, 2: 1.0, 3: 1.0}  # no scored step
    learnt = bc.online_scores(paths, likes_two, parents)
    assert np.allclose(learnt["per node"][0], [0.1, 0.1, 0.01])  # the prior's 0.1 per edge
    # after two steps: node 1 tried twice, won once; node 2 likewise; node 3 tried once, won once
    assert np.allclose(learnt["per node"][2], [0.3, 0.3, 0.3 * 0.4])
    # the budget's edges (0.2; 0.9; 0.1 / 0.2 = 0.5 below node 1), times hits over expected hits
    assert np.allclose(learnt["budget x per node"][0], [0.2, 0.9, 0.1])


def test_budget_ceiling_taught_table_compares_with_the_whole_trees_ranking():
    """A top-B run alone: its accepted tokens per decode step (1 + mean path length) against the
    whole tree's ranking at the same B, their ratio, and its own step figures."""
    import budget_ceiling as bc

    alone = {"paths": [[1, 3], [2], []], "tokens_per_step": 1.5, "drafts_per_step": 8.0, "seconds": 2.0,
             "steps": 20, "tokens_per_s": 15.0}
    rows = bc.taught_table({"top8": alone}, [8], {8: 2.5})
    assert rows[-2] == "| 8 | 2.50 | 2.00 | 0.800 | 1.50 | 8.0 | 100 | 15.0 |"
    assert alone["tokens_per_decode_step"] == 2.0  # kept for the JSON
    assert bc.taught_table({}, [], {}) == []


def test_suffix_without_arctic_inference_is_refused_before_anything_runs(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "arctic_inference" else real(name, *a))
    with pytest.raises(ValueError, match=r"^'suffix' needs arctic-inference==0\.1\.1, not installed .*`make bench`"):
        spec_bench.checked_config("suffix")
    assert spec_bench.checked_config("none") is None
    assert spec_bench.checked_config("recycling auto") == {"method": "recycling"}


def test_linear_rows_shapes_and_table():
    import linear_rows

    config = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}
    shapes = linear_rows.linear_shapes(config)
    assert shapes == {"qkv": (1152, 896, 24), "o": (896, 896, 24), "gate_up": (9728, 896, 24),
                             "down": (896, 4864, 24), "lm_head": (151936, 896, 1)}
    assert linear_rows.linear_shapes(config | {"head_dim": 128})["qkv"] == (18 * 128, 896, 24)
    report = {"model": "m", "dtype": "bfloat16", "date": "d", "machine": "x", "ld_preload": "none",
              "vllm": "0.32.0", "torch": "2", "threads": 2, "command": "c", "shapes": shapes,
              "kernels": dict.fromkeys(shapes, "oneDNN"), "flop_per_row": 2e9,
              "ms": {"1": 10.0, "2": 12.0, "4": 20.0}}
    rows = [line for line in linear_rows.markdown(report).splitlines() if line.startswith("| ")][1:]
    assert rows == ["| 1 | 10.0 | +0.0 | - | 200 |", "| 2 | 12.0 | +2.0 | 2.00 | 333 |",
                    "| 4 | 20.0 | +10.0 | 4.00 | 400 |"]


def test_plain_step_overhead_runs_plain_steps_and_tabulates():
    import torch

    import plain_step_overhead as overhead

    proposer = overhead.make_proposer(vocab_size=512, max_num_seqs=4, max_model_len=overhead.HISTORY + 8)
    # 30 ms a step for one row and 10 ms more for each: no draft pays at a fraction of a token
    proposer.budget.cost = overhead.step_cost({"1": 30.0, "2": 40.0, "4": 60.0})
    times = overhead.run_batch(proposer, 4, 3, 512, torch.bfloat16, np.random.default_rng(0))
    assert set(times) == set(overhead.PHASES) and all(len(v) == 3 and min(v) > 0 for v in times.values())
    report = {"model": "m", "dtype": "bfloat16", "date": "d", "machine": "x", "vllm": "0.32.0",
              "torch": "2", "threads": 1, "command": "c", "vocab": 512, "steps": 3, "rounds": 1,
              "linear_source": "results/l.md", "linear_ms": {"1": 30.0, "4": 60.0},
              "ms": {"1": {"begin_step": 0.05, "verify": 0.1, "propose": 0.15},
                     "4": {"begin_step": 0.1, "verify": 0.5, "propose": 0.6}}}
    rows = [line for line in overhead.markdown(report).splitlines() if line.startswith("| ")][1:]
    assert rows == ["| 1 | 0.050 | 0.100 | 0.150 | 0.300 | 30.0 | 1.00% |",
                    "| 4 | 0.100 | 0.500 | 0.600 | 1.200 | 60.0 | 2.00% |"]


def test_greedy_identity_near_tie_needs_the_same_distribution():
    import greedy_identity

    top = [[(5, -0.1), (6, -0.35), (7, -3.0)]]  # token 6 is 0.25 below the top: bfloat16's largest tie
    base = {"tokens": [[5]], "top": [top]}

    def other(logprobs):
        return {"tokens": [[6]], "top": [[logprobs]]}

    near, noise = greedy_identity.NEAR_TIE["bfloat16"], greedy_identity.LOGPROB_NOISE["bfloat16"]
    # the other run's logprobs 0.2 apart (within the noise measured at legitimate divergences)
    row = greedy_identity.compare(base, other([(6, -0.15), (5, -0.3), (7, -3.0)]), near, noise)["rows"][0]
    assert row["near_tie"] and row["gap"] == pytest.approx(0.25) and row["logprob_difference"] == pytest.approx(0.2)
    # the same token at another distribution: what a faulty tree kernel gives
    got = greedy_identity.compare(base, other([(6, -0.05), (5, -3.0), (7, -4.0)]), near, noise)
    assert not got["rows"][0]["near_tie"] and got["near_ties"] == 0
    assert not greedy_identity.compare(base, other([(8, -0.1), (9, -1.0)]), near, noise)["rows"][0]["near_tie"]
    # a gap beyond the threshold is no near-tie whatever the logprobs
    far = {"tokens": [[5]], "top": [[[(5, -0.1), (6, -0.5)]]]}
    assert not greedy_identity.compare(far, other([(5, -0.1), (6, -0.5)]), near, noise)["rows"][0]["near_tie"]
    # measured: the largest legitimate bfloat16 gap is 0.25, the runs' logprobs at most 0.27 apart
    assert near >= 0.25 and 0.27 < noise <= 0.5


def test_the_studies_import_from_their_own_folder(tmp_path):
    """A script of benchmarks/studies/ run from there (its folder first on sys.path, nothing of
    benchmarks/ or tests/) finds spec_bench and the tests' proposer helpers by its own path."""
    import subprocess

    names = sorted(p.stem for p in (BENCHMARKS / "studies").glob("*.py"))
    assert {"budget_ceiling", "verify_cost"} <= set(names)
    code = ("import importlib, sys; sys.path[0] = sys.argv[1]\n"
            "for name in sys.argv[2:]: importlib.import_module(name)")
    subprocess.run([sys.executable, "-c", code, str(BENCHMARKS / "studies"), *names], cwd=tmp_path, check=True)
