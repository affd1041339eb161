"""The drafter vLLM's V1 model runner calls: Token Recycling in chain mode.

vLLM builds it as a ``custom_class`` proposer (``patches.TranslateRecyclingSpecConfig`` turns
``method="recycling"`` into that) and talks to it twice per step, both inside
``GPUModelRunner.sample_tokens``:

1. ``observe_verification``, from ``patches.FeedVerificationLogits`` just before the rejection
   sampler: the step's logits rows (every request's root row and one row per scheduled draft
   token) and the token fed at each row. ``adj[token] = top-k(logits row)`` for all of them.
2. ``propose``, after bookkeeping, with CPU lists of the tokens each request just emitted: the
   top-1 chain of the updated matrix from each request's last token.

vLLM's stock rejection sampler verifies the chain, so the output is the target model's.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_recycling.config import RecyclingConfig
from vllm_recycling.draft import draft_tokens
from vllm_recycling.matrix import AdjacencyMatrix


class RecyclingProposer:
    """Holds the adjacency matrix and the draft template of one worker."""

    def __init__(self, vllm_config) -> None:
        self.config = RecyclingConfig.from_vllm_config(vllm_config)
        model_config = vllm_config.model_config
        vocab_size = model_config.get_vocab_size()
        device = torch.device(vllm_config.device_config.device)
        self.max_model_len = model_config.max_model_len
        self.template = self.config.draft_template().to(device)
        self.matrix = AdjacencyMatrix(
            vocab_size,
            topk=self.config.topk,
            scope=self.config.matrix_scope,
            max_requests=vllm_config.scheduler_config.max_num_seqs,  # per_request: one each
            device=device,
            initial=self.config.initial_matrix(vocab_size),
        )
        # The request ids of the current step's batch, in batch order (per_request scope).
        self._batch_req_ids: list[str] = []
        self._slot_holders: set[str] = set()
        self._num_slots = vllm_config.scheduler_config.max_num_seqs

    def load_model(self, target_model) -> None:
        """Nothing to load: the target model verifies, the matrix drafts. (The CPU runner calls
        this unconditionally, cpu_model_runner.py:74-76.)"""

    # -- step part 1: verification rows update the matrix ----------------------------------------
    @torch.inference_mode()
    def observe_verification(
        self,
        req_ids: list[str],
        live_req_ids,
        tokens: torch.Tensor,
        logits: torch.Tensor,
        num_draft_tokens: list[int],
    ) -> None:
        """tokens [T] int (the token fed at each logits row); logits [T, V] (vLLM's
        ``[sum(N) + B, V]``: per request, in batch order, the root row then one row per draft);
        num_draft_tokens [B] (N of each request); live_req_ids: every request the runner still
        holds (finished ones are gone), to return their per-request matrices."""
        self._batch_req_ids = list(req_ids)
        row_base = None
        if self.matrix.scope == "per_request":
            self._assign_slots(self._batch_req_ids, set(live_req_ids))
            bases = self.matrix.row_base(self._batch_req_ids)
            rows = torch.tensor(num_draft_tokens, device=bases.device) + 1
            row_base = bases.repeat_interleave(rows)
        self.matrix.update(tokens[:, None], logits, row_base)

    def _assign_slots(self, batch: list[str], live: set[str]) -> None:
        """Give every request of the batch a matrix: free those of finished requests, and when
        the pool (max_num_seqs) is full, those of requests not in this batch (preempted)."""
        for req_id in self._slot_holders - live:
            self.matrix.free(req_id)
        self._slot_holders &= live
        in_batch = set(batch)
        idle = [r for r in self._slot_holders if r not in in_batch]
        for req_id in batch:
            if req_id in self._slot_holders:
                continue
            if len(self._slot_holders) >= self._num_slots and idle:
                evicted = idle.pop()
                self.matrix.free(evicted)
                self._slot_holders.discard(evicted)
            self.matrix.allocate(req_id)
            self._slot_holders.add(req_id)

    # -- step part 2: drafts for the next step ---------------------------------------------------
    @torch.inference_mode()
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        """sampled_token_ids: per request (batch order) the tokens emitted this step, empty for
        a partial prefill; num_tokens_no_spec [max_num_reqs] int32. Returns per request the
        draft chain (num_speculative_tokens ids), or [] where there is nothing to draft."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        active = [
            i for i, sampled in enumerate(sampled_token_ids)
            if sampled and num_tokens_no_spec[i] < self.max_model_len
        ]
        if not active:
            return drafts
        roots = torch.tensor(
            [sampled_token_ids[i][-1] for i in active], dtype=torch.int64, device=self.matrix.device
        )
        row_base = None
        if self.matrix.scope == "per_request":
            row_base = self.matrix.row_base([self._batch_req_ids[i] for i in active])
        chains = draft_tokens(self.matrix.table, roots, self.template, row_base)[:, 1:].tolist()
        for i, chain in zip(active, chains):
            drafts[i] = chain
        return drafts
