"""What the budget's per-chain cost counts (``TreeStep.extra_chains``, ``cost_model.StepCost``'s
e): the chains ``cpu_attention.PathPlan`` computes a tree as, beyond one per tree; and the
budget times each tree step with them."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_recycling.cpu_attention import node_chains
from vllm_recycling.tree import compile_tree, hybrid_tree, load_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

BUSHY = [[i] for i in range(16)]  # 16 nodes, 16 leaves
DEEP = [[0] * d for d in range(1, 15)] + [[1], [2]]  # 16 nodes, 3 leaves


def _step(paths, requests, cut=None, prefix=40):
    layout = TreeLayout.from_template(compile_tree(sorted(paths, key=len), topk=16), "cpu")
    num_draft = np.array(cut if cut is not None else [len(paths)] * requests)
    qsl = np.concatenate([[0], np.cumsum(num_draft + 1)])
    return TreeStep.plan(layout, num_draft, qsl, np.full(len(num_draft), prefix), "cpu")


def _chains(step):
    return sum(len(node_chains(step.parent_np[r, : int(step.num_rows_np[r])])) - 1
               for r in range(len(step.req_index_np)))


def test_extra_chains_are_the_chains_the_cpu_pass_computes_beyond_one_per_tree():
    for paths, requests, want in ((BUSHY, 16, 15 * 16), (DEEP, 16, 2 * 16), (BUSHY, 1, 15), (DEEP, 3, 6)):
        step = _step(paths, requests)
        assert step.extra_chains == _chains(step) == want
    # trees the scheduler cut: the first 3 nodes (the root's 3 children), the first (a chain, no tree)
    cut = _step(DEEP, 4, cut=[16, 3, 1, 0])
    assert cut.req_index_np.tolist() == [0, 1] and cut.extra_chains == _chains(cut) == 2 + 2


def test_a_bushy_tree_takes_more_waves_than_a_deep_one():
    """At 16 requests every chain beyond the first is a wave (a kernel call per layer): 16 for
    16 leaves, 3 for 3, at the same number of nodes."""
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(ops, "cpu_attn_get_scheduler_metadata"):
        pytest.skip("vLLM's CPU attention ops are not built here")
    from vllm_recycling.cpu_attention import PathPlan
    from vllm_recycling.cpu_kv_cache import attention_isa

    waves = {}
    for name, paths in (("bushy", BUSHY), ("deep", DEEP)):
        step, bs, requests = _step(paths, 16), 16, 16
        blocks = -(-(40 + len(paths) + 1) // bs)
        table = torch.arange(requests * blocks, dtype=torch.int32).view(requests, blocks)
        positions = 40 + torch.arange(len(paths) + 1)
        slots = torch.cat([table[r].long()[positions // bs] * bs + positions % bs for r in range(requests)])
        impl = SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=32, sliding_window=-1, kv_cache_dtype="auto")
        plan = PathPlan.build(step, table, slots, impl, attention_isa(torch.float32, bs, 32), torch.float32, bs,
                              range(requests * blocks, requests * blocks + 8))
        waves[name] = len(plan.waves)
    assert waves == {"bushy": 16, "deep": 3}


def test_the_budget_times_each_tree_step_with_its_chains(monkeypatch):
    from vllm_recycling.adaptive_budget import AdaptiveBudget
    from vllm_recycling.step import NO_PROPOSAL, StepPlan, StepRecord, Verification

    hybrid = hybrid_tree(load_tree("2.2.2", 8), 0, 8)
    budget = AdaptiveBudget(hybrid, 8, torch.device("cpu"))
    layout = TreeLayout.from_template(hybrid.tree, "cpu")
    nodes = [np.array([1, 2, 3, 4, 5]), np.array([1, 2]), np.array([1])]
    num_draft = np.array([5, 2, 1])
    step = TreeStep.plan(layout, num_draft, np.concatenate([[0], np.cumsum(num_draft + 1)]), np.array([9, 9, 9]),
                         "cpu", nodes)
    assert step.extra_chains == _chains(step) > 0
    seen = []
    monkeypatch.setattr(budget.cost, "observe", lambda *args, **kwargs: seen.append((args, kwargs)))
    plan = StepPlan(num_tokens=int(num_draft.sum()) + 3, num_draft=tuple(num_draft), decode_only=True, tree=step)
    record = StepRecord(("a", "b", "c"), NO_PROPOSAL, plan, Verification(step.req_index_np, None, 0.004, None))
    budget.learn(record, [[1], [1], [1]])
    budget.learn(record, [[1], [1], [1]])  # the first step only starts the clock
    (args, kwargs), = seen
    assert args[1:3] == (step.req_index_np.size, 0.004) and kwargs["extra_chains"] == step.extra_chains
