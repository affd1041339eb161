"""The Token Recycling speculator of Model Runner V2 (vLLM 0.34): the core's adjacency matrix on
the device, drafted from and taught without a host list or a host sync.

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
  recorded (model_runner.py:2358-2390): each request's chain drafted from its last sampled
  token, the whole batch in one launch (``AdjacencyMatrix.draft``); vLLM writes the [B, K]
  tensor into ``req_states.draft_tokens`` and verifies it next step in its rejection sampler,
  where ``verify.accept_chain`` takes the ratio test's place (``patches``);
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
from vllm_recycling.prior import find_prior
from vllm_recycling.ranks import tensor_parallel_mean
from vllm_recycling.slots import is_first_rank

logger = init_logger(LOGGER_NAME)
# The attribute of vLLM's ``RequestState`` (shared by the runner's sampler, its rejection
# sampler and this speculator, model_runner.py:296-306, 500-510) under which the speculator
# can be found by ``patches.LearnFromPlainSteps`` and ``LearnFromVerifiedSteps``.
LEARNER_ATTR = "recycling_learner"


class RecyclingSpeculator(BaseSpeculator):
    """Drafts each request's top-1 chain from the matrix; learns from every logits row."""

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
        setattr(req_states, LEARNER_ATTR, self)

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
        """[B, K] int64 drafts: each request's chain from its last sampled token (a request
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
