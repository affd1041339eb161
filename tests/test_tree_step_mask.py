"""``TreeStep.mask`` ([R, W, W] bool) is built only when read: the Triton pass reads it, a CPU
step (planning, ``cpu_attention.PathPlan``, the paths and the KV moves) never does."""

import numpy as np
import pytest
import torch

from vllm_recycling.paths import ChainPlan, StepRows, choose_paths, compaction
from vllm_recycling.tree import compile_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

# root -> a(0), b(1); a -> c(0,0), d(0,1); c -> e(0,0,0)
PATHS = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def _step():
    layout = TreeLayout.from_template(compile_tree(PATHS, topk=2), "cpu")
    # a 3-token prefill chunk, a full tree (prefix 10), a root alone, a tree cut to 4 rows (prefix 7)
    return TreeStep.plan(layout, np.array([0, 5, 0, 3]), np.array([0, 3, 9, 10, 14]), np.array([0, 10, 4, 7]),
                         "cpu")


def test_planning_a_step_does_not_build_the_mask():
    step = _step()
    assert "mask" not in step.__dict__  # cached_property: present once read
    mask = step.mask
    assert step.mask is mask and "mask" in step.__dict__
    # ancestor-or-self over the scheduled nodes: request 1 holds the first 4 nodes (root, a, b, c)
    assert mask[1].tolist() == [[True, False, False, False, False, False],
                                [True, True, False, False, False, False],
                                [True, False, True, False, False, False],
                                [True, True, False, True, False, False],
                                [False] * 6, [False] * 6]
    assert mask[0, 5].tolist() == [True, True, False, True, False, True]


class _Unread:
    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise AssertionError("a CPU step read TreeStep.mask")


def test_a_cpu_step_never_reads_the_mask(monkeypatch):
    monkeypatch.setattr(TreeStep, "mask", _Unread())
    step = _step()
    logits = torch.randn(step.num_tokens, 7)
    tokens = torch.randint(0, 7, (step.num_tokens,))
    path = choose_paths(step, logits, tokens, step.root_row)
    chains = ChainPlan.build(step, path, np.array([0, 5, 0, 3]), np.array([0, 3, 9, 10]), "cpu")
    chains.compaction(step, torch.zeros(4, 4, dtype=torch.int64), torch.arange(step.num_tokens))
    compaction(step, path, torch.arange(step.num_tokens))
    StepRows.build([0, 5, 0, 3], step)
    step.position_offsets()
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(ops, "cpu_attn_get_scheduler_metadata"):
        pytest.skip("vLLM's CPU attention ops are not built here")
    from vllm_recycling.cpu_kv_cache import attention_isa
    from vllm_recycling.support import paths_match_plain_steps

    # plans a tree step and runs PathPlan on it (the CPU tree pass of every layer)
    isa = attention_isa(torch.float32, 16, 32)
    assert paths_match_plain_steps(isa, torch.float32, 4, 2, 32, 16) is None
