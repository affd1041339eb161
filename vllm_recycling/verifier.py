"""Owns tree mode's work in a step (``verify: "tree"``): the tree rows of the step before the
forward, then each tree request's path verified (greedy steps: by vLLM's rejection sampler;
steps with a sampled request, penalties, bad words or a logit bias: ``verify_sampled``, which
serves chain mode too) and the accepted
nodes' KV moved to their positions after it.

The pieces are pure PyTorch (``tree_step``, ``paths``, ``cpu_attention``); this class applies
them to what the patches hand over from vLLM's model runner. It uses vLLM's own types only
where it feeds vLLM's rejection sampler (``SpecDecodeMetadata``, ``SamplingMetadata``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from vllm_recycling.paths import (
    ChainPlan, StepRows, StepRowsOnDevice, choose_paths, compaction, tree_paths, walk_sampled,
)
from vllm_recycling.support import check_tree_support
from vllm_recycling.transfer import to_device
from vllm_recycling.tree import TreeTemplate
from vllm_recycling.tree_step import TreeLayout, TreeStep


class TreeVerifier:
    """template: the draft template (its nodes are what requests are sent subsets of)."""

    def __init__(self, template: TreeTemplate, device: torch.device) -> None:
        self.layout = TreeLayout.from_template(template, device)
        self.device = device
        # where accepted nodes' keys and values move (kv_caches, src, dst): the paged caches of
        # the attention the tree pass runs on, in their layout, from check_support
        self.move_kv: Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None] = _layout_unknown
        # KV cache blocks beside vLLM's, where the CPU tree pass lays out chains (ScratchKVBlocks)
        self.scratch_blocks: tuple[int, ...] = ()

    def check_support(self, vllm_config, model) -> None:
        """At start-up: refuse a set-up tree verification cannot serve exactly
        (``support.check_tree_support``), else note how its KV caches are laid out."""
        self.move_kv = check_tree_support(vllm_config, model)

    def plan(
        self,
        num_draft_tokens: list[int],
        query_start_loc: np.ndarray,
        num_computed_tokens: np.ndarray,
        nodes: list[np.ndarray | None] | None,
    ) -> TreeStep | None:
        """The step's tree rows (``TreeStep.plan``; None when no request has a branching tree).
        nodes: per request, the template nodes it was sent (None: the template's first ones)."""
        step = TreeStep.plan(
            self.layout, np.asarray(num_draft_tokens), query_start_loc, num_computed_tokens,
            self.device, nodes,
        )
        if step is not None:
            step.scratch_blocks = self.scratch_blocks
            step.kv_isa = getattr(getattr(self.move_kv, "__self__", None), "isa", None)
        return step

    def verify(
        self,
        tree: TreeStep,
        slot_mapping: torch.Tensor,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        spec_decode_metadata,
        sampling_metadata,
        rejection_sampler: Callable,
        kv_caches: list[torch.Tensor],
    ):
        """A greedy step (every request greedy): the step's ``SamplerOutput`` and each tree
        request's path [R, D] (on the device).

        logits [sum(N) + B, V] and tokens [sum(N) + B] (the token fed at each row: per request,
        in batch order, the root row then one row per scheduled draft); spec_decode_metadata:
        vLLM's chain layout of the step; sampling_metadata: the batch's ``SamplingMetadata``;
        rejection_sampler: vLLM's ``RejectionSampler``; kv_caches: every attention layer's
        cache, where the accepted nodes' keys and values move to their positions (slot_mapping
        [>= num_tokens]: the step's slots)."""
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        num_draft = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
        logits_start = np.cumsum(num_draft + 1) - (num_draft + 1)
        device = logits.device
        starts = to_device(logits_start[tree.req_index_np], torch.int64, device)
        path = choose_paths(tree, logits, tokens, starts)
        plan = ChainPlan.build(tree, path, num_draft, logits_start, device)
        chain = SpecDecodeMetadata(
            draft_token_ids=plan.draft_tokens(tokens),
            num_draft_tokens=plan.num_draft_tokens,
            cu_num_draft_tokens=plan.cu_num_draft_tokens,
            cu_num_sampled_tokens=plan.cu_num_sampled_tokens,
            target_logits_indices=plan.target_logits_indices,
            bonus_logits_indices=plan.bonus_logits_indices,
            logits_indices=spec_decode_metadata.logits_indices[plan.rows],
        )
        output = rejection_sampler(chain, None, logits[plan.rows], sampling_metadata)
        self.move_kv(kv_caches, *plan.compaction(tree, output.sampled_token_ids, slot_mapping))
        return output, plan.path

    def move_accepted(self, tree: TreeStep, path: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_caches: list[torch.Tensor]) -> None:
        """Move the accepted nodes of each tree request's ``path`` [R, D] (local indices, -1
        past them) to their positions' slots in every cache."""
        self.move_kv(kv_caches, *compaction(tree, path, slot_mapping))


def verify_greedy(tree: TreeStep | None, argmax: torch.Tensor, tokens: torch.Tensor, num_draft_tokens):
    """A step where every row emits its argmax (``node_sampler.plain_greedy``), trees and
    chains alike: each request's tree walked by the argmax of its rows (``paths.walk_sampled``),
    which the matrix update computed, so no row is read again. Returns (vLLM's ``SamplerOutput``
    in chain format; each tree request's accepted path [R, D] or None without trees).
    argmax [T] int, tokens [T]: the step's rows; num_draft_tokens [B]: each request's drafts."""
    from vllm.v1.outputs import SamplerOutput

    rows = StepRowsOnDevice.of(StepRows.build(num_draft_tokens, tree), argmax.device)
    accepted, output = walk_sampled(rows, tokens, argmax)
    path = None if tree is None else tree_paths(tree, accepted, rows.start[tree.req_index])
    return SamplerOutput(sampled_token_ids=output, logprobs_tensors=None), path


def verify_sampled(node_sampler, tree: TreeStep | None, logits: torch.Tensor, tokens: torch.Tensor,
                   num_draft_tokens, sampling_metadata):
    """A step with a sampled request, trees (``tree``) and chains alike: every row sampled as
    a plain step samples its position (``node_sampler.NodeSampler``), then each request's tree
    walked by the sampled tokens (``paths.walk_sampled``). Returns (vLLM's ``SamplerOutput``
    in chain format, with the emitted positions' logprobs when asked; each tree request's
    accepted path [R, D] or None without trees; the seeded generators' states,
    ``GeneratorStates``, to rewind once the emitted tokens are known). logits [T, V] (modified
    in place), tokens [T]: the step's rows; num_draft_tokens [B]: each request's drafts."""
    from vllm.v1.outputs import LogprobsTensors, SamplerOutput

    rows = StepRows.build(num_draft_tokens, tree)
    on_device = StepRowsOnDevice.of(rows, logits.device)
    per_row, states = node_sampler.sample(
        logits, rows, on_device.row_req, on_device.depth, sampling_metadata,
        sampling_metadata.spec_token_ids,
    )
    accepted, output = walk_sampled(on_device, tokens, per_row.sampled_token_ids[:, 0])
    logprobs = per_row.logprobs_tensors
    if logprobs is not None:  # the emitted positions' rows; past them any row (vLLM drops it)
        emitted = accepted.clamp(min=0).reshape(-1)
        logprobs = LogprobsTensors(
            logprobs.logprob_token_ids[emitted], logprobs.logprobs[emitted],
            logprobs.selected_token_ranks[emitted],
        )
    path = None
    if tree is not None:
        path = tree_paths(tree, accepted, on_device.start[tree.req_index])
    return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs), path, states


def _layout_unknown(kv_caches, src, dst) -> None:
    raise RuntimeError("tree verification moved KV before check_support read the caches' layout")
