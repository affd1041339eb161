"""The sampler's entry: where a step's logits are verified."""

from __future__ import annotations

import torch

from vllm_recycling.patches.base import MethodPatch, recycling_drafter


class VerifyTree(MethodPatch):
    """``GPUModelRunner._sample`` (v1/worker/gpu_model_runner.py:3437-3466), inherited
    unchanged by ``CPUModelRunner``.

    ``sample_tokens`` (4303-4340) passes it this step's logits ``[sum(N) + B, V]`` (computed at
    4241-4242, grammar-masked in place at 4334-4338) and the ``SpecDecodeMetadata``
    (v1/spec_decode/metadata.py:9-27) before the rejection sampler runs (3460). Row j was
    computed for the input token ``input_ids.gpu[logits_indices[j]]``; rows come per request
    in ``input_batch.req_ids`` order, ``num_draft_tokens[i] + 1`` each.

    When the drafter is ours, the wrapper (1) hands it every row so the matrix learns from the
    whole tree (``RecyclingProposer.verify``), and (2) for a step with drafts and a sampled
    request (trees and chains alike) lets it sample every row as a plain step samples the
    row's output position, with the runner's ``Sampler`` (``rejection_sampler.sampler``) and
    the batch's sampling metadata, and walk each tree by the sampled tokens
    (``verifier.verify_sampled``); for a greedy tree step, lets it pick each request's path
    and verify that path as a chain with vLLM's own rejection sampler
    (``RejectionSampler.forward``, v1/sample/rejection_sampler.py:106-216); then (3) moves the
    accepted nodes' KV to their positions' slots (given the runner's KV caches). The output is
    vLLM's chain format, so bookkeeping
    (3530-3584), the scheduler's rollback of ``len(drafts) - accepted`` tokens
    (v1/core/sched/scheduler.py:2110-2128), stop checks and metrics work unchanged. Dummy and
    profiling runs call the rejection sampler directly (6023, 6037), never ``_sample``.

    On such a step the wrapper does not run vLLM's ``_sample`` body (3443-3460): it skips
    ``input_batch.update_async_output_token_ids()`` and ``_get_spec_decode_draft_probs``, which
    is right only because ``custom_class`` turns async scheduling off (see the module
    docstring) and our drafts have no probabilities (None).

    (4) A step where no request has drafts (the budget admitted nothing) is sampled by vLLM's
    plain ``Sampler`` (3447-3451), as without speculation: with speculation configured vLLM
    sends every step through the rejection sampler (2184-2229), which for zero drafts samples
    each request's bonus row with the same ``Sampler`` (rejection_sampler.py:141-155; its
    ``predict_bonus_token`` only appends the empty draft lists to penalty histories, 379-420)
    after copying the logits rows, and returns one token per request. Its output has one
    column, so bookkeeping takes the path of no speculative tokens (3517-3525).
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample"
    signature = "(self, logits, spec_decode_metadata)"

    @staticmethod
    def wrap(original):
        def _sample(self, logits, spec_decode_metadata):
            drafter = recycling_drafter(self)
            if drafter is None or logits is None or spec_decode_metadata is None:
                return original(self, logits, spec_decode_metadata)
            sampling_metadata = self.input_batch.sampling_metadata
            output = drafter.verify(
                req_ids=self.input_batch.req_ids,
                live_req_ids=self.requests.keys(),
                tokens=self.input_ids.gpu[spec_decode_metadata.logits_indices],
                logits=logits,
                spec_decode_metadata=spec_decode_metadata,
                sampling_metadata=sampling_metadata,
                rejection_sampler=self.rejection_sampler,
                kv_caches=lambda: _kv_caches(self),
            )
            if output is None and not any(spec_decode_metadata.num_draft_tokens):
                output = self.sampler(logits=logits, sampling_metadata=sampling_metadata)
            if output is None:
                output = original(self, logits, spec_decode_metadata)
            return output

        return _sample


def _kv_caches(runner) -> list[torch.Tensor]:
    """Every attention layer's own KV cache tensor (layers sharing a cache counted once)."""
    from vllm_recycling.triton_path import layer_kv_caches

    names = [name for group in runner.kv_cache_config.kv_cache_groups for name in group.layer_names]
    return layer_kv_caches(runner.compilation_config.static_forward_context, names)
