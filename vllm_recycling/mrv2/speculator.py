"""The Token Recycling speculator of Model Runner V2 (vLLM 0.34): the core's adjacency matrix on
the device, drafted from and taught without a host list or a host sync, and the tree step.

vLLM builds it with ``init_speculator(vllm_config, device, req_states)``
(v1/worker/gpu/spec_decode/__init__.py:18-49) from ``config.RecyclingSpeculatorConfig``, then
calls, on the last pipeline rank's worker:

- ``add_request(req_index)`` when a request takes a request-state slot (model_runner.py:
  1305-1306): the matrix slot of the same index starts empty (``AdjacencyMatrix.clear_slot``);
  a request's matrix slot is its request-state index, so no host map of request ids is kept;
- ``learn(logits, input_batch)`` (``patches.LearnFromPlainSteps`` / ``LearnFromVerifiedSteps``,
  before the sampler or the rejection sampler runs on the step's logits):
  ``adj[token[row]] = top-k(logits[row])`` for every logits row, each row's token and slot
  gathered on the device;
- ``propose(input_batch, ..., last_sampled, ...)`` after the step's tokens were sampled and
  recorded (model_runner.py:2358-2390): each request's drafts (the template's nodes: a tree, or
  the chain) drafted from its last sampled token, the whole batch in one launch
  (``AdjacencyMatrix.draft``); vLLM writes the [B, K] tensor into ``req_states.draft_tokens``
  and verifies it next step in its rejection sampler, where ``verify.accept_tree`` (or
  ``accept_chain``) takes the ratio test's place (``patches``);
- with trees, ``begin_step`` (``patches.TreePositions``, after vLLM's slots) and ``end_step``
  (``patches.LearnFromVerifiedSteps``, after verification): tree positions and the tree rows
  for the attention layers, then the accepted nodes' KV moved into place;
- ``reset_state()`` after the warm-up's dummy requests (warmup.py:795-797): the matrix back to
  where it started, so nothing learnt from dummy logits drafts.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from vllm_recycling import LOGGER_NAME
from vllm_recycling.matrix import AdjacencyMatrix, Scope
from vllm_recycling.mrv2.config import recycling_config
from vllm_recycling.paths import compaction
from vllm_recycling.prior import find_prior
from vllm_recycling.ranks import tensor_parallel_mean
from vllm_recycling.slots import is_first_rank
from vllm_recycling.step import ACTIVE_TREE
from vllm_recycling.tree_step import TreeLayout, TreeStep
from vllm_recycling.triton_path import layer_kv_caches, move_all

logger = init_logger(LOGGER_NAME)
# The attribute of vLLM's ``RequestState`` (shared by the runner's sampler, its rejection
# sampler and this speculator, model_runner.py:296-306, 500-510) under which the speculator
# can be found by ``patches.LearnFromPlainSteps`` and ``LearnFromVerifiedSteps``.
LEARNER_ATTR = "recycling_learner"


class RecyclingSpeculator(BaseSpeculator):
    """Drafts each request's tree (or top-1 chain) from the matrix; learns from every logits
    row; carries a tree step from positions to the KV moves."""

    def __init__(self, vllm_config, device: torch.device, req_states) -> None:
        spec = vllm_config.speculative_config
        self.config = recycling_config(spec.speculator_options)
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.num_speculative_steps = spec.num_speculative_tokens
        self.max_num_reqs = req_states.max_num_reqs
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.template = self.config.draft_template().to(self.device)
        self.prior, self.prior_watch = None, None
        if self.config.matrix_init == "model":
            # tensor-parallel ranks start from the rows all of them loaded
            self.prior, self.prior_watch = find_prior(vllm_config.model_config, self.config.topk,
                                                      tensor_parallel_mean())
        self.matrix = self._new_matrix()
        self.drafts = torch.zeros((self.max_num_reqs, self.num_speculative_steps), dtype=torch.int64,
                                  device=self.device)
        self.trees = self.config.drafts_trees
        if self.trees:
            self._init_trees()
        self.step: tuple[TreeStep, torch.Tensor] | None = None
        self.tree_steps = 0  # steps verified with a branching tree (host count, for tests and logs)
        self._kv_caches: list[torch.Tensor] | None = None
        setattr(req_states, LEARNER_ATTR, self)

    def _init_trees(self) -> None:
        """The template's tables by local index (every request's drafts are the template's first
        nodes, breadth-first: vLLM cuts them to a prefix, which is still a tree), on the device."""
        template, device = self.template, self.device
        self.layout = TreeLayout.from_template(template, device)
        self.max_depth = template.max_depth
        self.depth_of_local = template.depth.to(device)
        self.parent_of_local = template.parent.clamp(min=0).to(device)
        # what each row's position gains: prefix + depth(j) in place of vLLM's prefix + j
        self.offset_of_local = self.depth_of_local - torch.arange(template.num_nodes + 1, device=device)
        # each request-state slot's accepted path of the step being verified (local indices)
        self.paths = torch.full((self.max_num_reqs, self.max_depth), -1, dtype=torch.int64, device=device)

    def _new_matrix(self) -> AdjacencyMatrix:
        config = self.config
        initial = config.initial_matrix(self.vocab_size)
        return AdjacencyMatrix(
            self.vocab_size, topk=config.topk, scope=config.matrix_scope,
            max_requests=self.max_num_reqs, device=self.device, initial=initial,
            overlay_rows=config.overlay_rows,
            prior=None if self.prior is None else (self.prior.table, self.prior.probs),
        )

    def _slots(self, idx_mapping: torch.Tensor) -> torch.Tensor | None:
        """Each row's matrix slot: its request-state index (None for the shared matrix)."""
        return None if self.matrix.scope == Scope.SHARED else idx_mapping.long()

    # -- vLLM's hooks ------------------------------------------------------------------------------
    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        del cudagraph_mode  # one gather launch a step: nothing to capture

    def capture(self) -> None:
        return None

    def add_request(self, req_index: int) -> None:
        self.matrix.clear_slot(req_index)

    def reset_state(self) -> None:
        self.matrix = self._new_matrix()
        self.step, self.tree_steps = None, 0
        ACTIVE_TREE.clear()

    @torch.inference_mode()
    def learn(self, logits: torch.Tensor, input_batch) -> None:
        """logits [L, V]: one row per ``input_batch.logits_indices`` entry; the token fed at
        each row and its request's slot are gathered on the device."""
        if logits.shape[0] == 0:
            return
        tokens = input_batch.input_ids[input_batch.logits_indices].long()
        # a placeholder draft (-1) never indexes the matrix
        tokens = tokens.clamp(0, self.vocab_size - 1)
        slots = self._slots(input_batch.expanded_idx_mapping)
        self.matrix.update(tokens[:, None], logits, slots)

    @torch.inference_mode()
    def propose(
        self,
        input_batch,
        attn_metadata: Any,
        slot_mappings: Any,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state=None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs=None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        """[B, K] int64 drafts: each request's nodes from its last sampled token (a request
        that sampled nothing yet drafts from token 0; vLLM does not verify its drafts)."""
        num_reqs = input_batch.num_reqs
        if dummy_run or num_reqs == 0:
            return self.drafts[:num_reqs]
        if self.prior_watch is not None:
            self._take_prior()
        idx_mapping = input_batch.idx_mapping
        roots = last_sampled.view(-1)[idx_mapping].clamp(0, self.vocab_size - 1)
        tokens = self.matrix.draft(roots, self.template, self._slots(idx_mapping))
        self.drafts[:num_reqs].copy_(tokens[:, 1:])
        return self.drafts[:num_reqs]

    # -- trees (patches.TreePositions, TreePlaceholders, SampleEveryRowAsAPlainStep, LearnFromVerifiedSteps)
    def begin_step(self, input_batch, slot_mappings: torch.Tensor) -> None:
        """After vLLM computed the step's positions and slots (``GPUModelRunner.prepare_attn``):
        the tree nodes move to their depth's position (slots stay those of consecutive
        positions: every node its own), and the step's tree rows are published for the
        attention layers. A step without a branching tree publishes none.

        The tree's rows come from exact host values (each request's scheduled drafts and query
        start); each tree's prefix from the device (``seq_lens - num_rows``): the host's
        ``num_computed_tokens_np`` is an upper bound under async scheduling (states.py:64), so
        the step's ``prefix_np`` is one too and nothing on this path reads it."""
        ACTIVE_TREE.publish(None)
        self.step = None
        if not self.trees or input_batch.num_draft_tokens == 0:
            return
        num_reqs = input_batch.num_reqs
        step = TreeStep.plan(
            self.layout, input_batch.num_draft_tokens_per_req[:num_reqs],
            input_batch.query_start_loc_np[: num_reqs + 1], input_batch.num_computed_tokens_np[:num_reqs],
            self.device,
        )
        if step is None:  # every request's drafts a chain: vLLM's positions are right
            return
        positions, rows = input_batch.positions, input_batch.logits_indices
        positions[rows] += self.offset_of_local[input_batch.expanded_local_pos.long()]
        step.prefix_len = input_batch.seq_lens[step.req_index].long() - step.num_rows
        self.step = (step, slot_mappings[0])
        self.tree_steps += 1
        ACTIVE_TREE.publish(step)

    def end_step(self, input_batch) -> None:
        """After the step's verification (``RejectionSampler.__call__``): every tree request's
        accepted nodes' keys and values move from their node slots to their positions' slots in
        every layer (``paths.compaction``), before anything reads them."""
        ACTIVE_TREE.clear()
        if self.step is None:
            return
        step, slot_mapping = self.step
        self.step = None
        path = self.paths[input_batch.idx_mapping[step.req_index].long()]
        src, dst = compaction(step, path, slot_mapping)
        if self._kv_caches is None:
            context = self.vllm_config.compilation_config.static_forward_context
            self._kv_caches = layer_kv_caches(context, context.keys())
        move_all(self._kv_caches, src, dst)

    def _take_prior(self) -> None:
        """Between two steps: the rows of the model's prior computed since the last look."""
        watch = self.prior_watch
        prior = watch.poll()
        if prior is None:
            return
        self.prior = prior
        filled = self.matrix.take_prior(prior, watch.taken)
        watch.took(prior)
        if watch.done:
            self.prior_watch = None
        if is_first_rank():
            logger.info("recycling: initial matrix taken in up to token %d of %d (%d rows filled)",
                        prior.rows, watch.vocab_size, filled)
