"""The fixes of vLLM 0.32's own CPU bugs (``patches.cpu_fixes``): each test runs vLLM's function
as a user reaches it, and fails without the fix. (``SeededChunkedPrefillOnCPU`` needs a model
runner: tests/test_engine.py::test_seeded_requests_repeat_and_survive_chunked_prefill.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_recycling import plugin  # noqa: E402
from vllm_recycling.patches.cpu_fixes import ConstraintsWithoutDrafts, ExpandOnCPU  # noqa: E402


@pytest.fixture(autouse=True)
def registered():
    plugin.register()


def test_expand_batch_to_tokens_on_cpu_is_exact():
    """vLLM's CPU expansion hands its C++ kernel an int64 copy of the output and never copies
    it back, so the expanded temperatures, top-k and top-p are uninitialised memory."""
    from vllm.v1.sample import rejection_sampler

    assert ExpandOnCPU.is_applied()
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)
    temperature = torch.tensor([0.7, -1.0, 1.3, 0.0])
    out = rejection_sampler.expand_batch_to_tokens(temperature, cu, 6, replace_from=-1.0, replace_to=1)
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.0])
    top_k = torch.tensor([5, 0, 7, 9], dtype=torch.int32)
    out = rejection_sampler.expand_batch_to_tokens(top_k, cu, 6)
    assert out.dtype == torch.int32 and out.tolist() == [5, 5, 0, 0, 0, 9]


def test_sampling_constraints_without_draft_rows():
    """A step with speculative metadata but no draft token, a request sampling with a top-k and
    no top-p: vLLM 0.32 calls ``k.max()`` on zero rows and the engine dies."""
    from vllm.v1.sample import rejection_sampler

    assert ConstraintsWithoutDrafts.is_applied()
    metadata = SimpleNamespace(
        all_greedy=False, temperature=torch.tensor([1.0, 0.8]), top_k=torch.tensor([4, 4]), top_p=None,
    )
    logits = torch.zeros((0, 16))
    cu = torch.zeros(2, dtype=torch.int32)
    out = rejection_sampler.apply_sampling_constraints(logits, cu, metadata)
    assert out.shape == (0, 16)
    with pytest.raises(RuntimeError, match="numel\\(\\) == 0"):  # what the fix keeps away
        rejection_sampler.apply_sampling_constraints.__wrapped__(logits, cu, metadata)
