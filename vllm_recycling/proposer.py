"""The drafter vLLM's V1 model runner holds: it wires the plugin's rooms to vLLM's interface.

vLLM builds it as a ``custom_class`` proposer (``patches.engine_args.TranslateRecyclingSpecConfig``
turns ``method="recycling"`` into that). Its rooms: the adjacency matrix and who holds which
slot of it (``slots.MatrixSlots``), the adaptive budget (``adaptive_budget.AdaptiveBudget``,
``budget: "auto"``) and tree verification (``verifier.TreeVerifier``, ``verify: "tree"``).
A step calls it three times, all inside one ``execute_model`` / ``sample_tokens`` pair, and
``step.py`` describes the records that pass between the calls:

1. ``begin_step`` (``patches.runner.TreePositions``, before the forward): the batch, and for a
   tree step its tree rows and the offsets that move the nodes to their depth positions.
2. ``verify`` (``patches.sampler.VerifyTree``, before sampling): every logits row updates the
   matrix; a step with a sampled request, penalties, bad words or a logit bias is verified row
   by row (``verifier.verify_sampled``), another greedy tree step's paths by vLLM's rejection
   sampler.
3. ``propose`` (vLLM's own call, after bookkeeping, with CPU lists of the tokens each request
   just emitted): the budget learns from the step, then the next drafts are chosen.

The patches hand it plain values (arrays, tensors, lists, callables) taken from vLLM's model
runner; nothing here reads the runner.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME
from vllm_recycling.adaptive_budget import AdaptiveBudget
from vllm_recycling.drafts import Context, draft
from vllm_recycling.config import RecyclingConfig
from vllm_recycling.matrix import AdjacencyMatrix, Scope
from vllm_recycling.prior import find_prior
from vllm_recycling.ranks import layout_checked, tensor_parallel_mean
from vllm_recycling.slots import MatrixSlots, is_first_rank
from vllm_recycling.support import TreesUnsupported, chain_instead
from vllm_recycling.step import ACTIVE_TREE, NO_PROPOSAL, Proposal, StepPlan, StepRecord, Verification
from vllm_recycling.transfer import StagedBuffer, to_device
from vllm_recycling.tree import hybrid_tree
from vllm_recycling.node_sampler import NO_STATES, NodeSampler, plain_greedy, samples_rows
from vllm_recycling.node_sampler import self_check as sampler_self_check
from vllm_recycling.verifier import TreeVerifier, verify_greedy, verify_sampled

_NO_NODES = np.zeros(0, dtype=np.int64)
logger = init_logger(LOGGER_NAME)


class RecyclingProposer:
    """The Token Recycling drafter of one worker."""

    def __init__(self, vllm_config) -> None:
        self.config = RecyclingConfig.from_vllm_config(vllm_config)
        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        vocab_size = model_config.get_vocab_size()
        device = torch.device(vllm_config.device_config.device)
        max_requests = vllm_config.scheduler_config.max_num_seqs
        self.max_model_len = model_config.max_model_len
        self.device = device
        auto = self.config.budget == "auto"
        # the tensor-parallel ranks' mean (None in a single process): what they agree through
        self.tp_mean = tensor_parallel_mean()
        prior, self.prior_watch = None, None
        if self.config.matrix_init == "model":
            prior, self.prior_watch = find_prior(model_config, self.config.topk, self.tp_mean)
        initial, initial_probs = self.config.initial_matrix(vocab_size, with_probs=True) or (None, None)
        self.matrix = AdjacencyMatrix(
            vocab_size,
            topk=self.config.topk,
            scope=self.config.matrix_scope,
            max_requests=max_requests,  # one slot per live request
            device=device,
            initial=initial,
            overlay_rows=self.config.overlay_rows,
            with_probs=auto,
            salt_matrices=self.config.salt_matrices,
            prior=None if prior is None else (prior.table, prior.probs),
            initial_probs=initial_probs,
        )
        self.slots = MatrixSlots(self.matrix, self.config, max_requests)
        self._drafting(self.config)
        self.batch: list[str] = []  # the step's request ids, in batch order
        # per request of the batch: True when it must get no drafts (structured output)
        self._no_drafts: list[bool] = []
        self.proposal = NO_PROPOSAL  # what the last propose sent, verified by the next step
        self.record: StepRecord | None = None  # the step under way
        self._roots = StagedBuffer(max_requests, torch.int64, device)
        self._node_sampler: NodeSampler | None = None  # built from vLLM's sampler at start-up

    def _drafting(self, config: RecyclingConfig) -> None:
        """The rooms that depend on what is drafted (a tree or the chain): the template, with the
        context branch (``hybrid``), the budget and the tree verifier."""
        self.config = config
        self.template = config.draft_template().to(self.device)
        self.hybrid = hybrid_tree(self.template, config.context_length, config.topk).to(self.device)
        self.budget = AdaptiveBudget(self.hybrid, config.topk, self.device) if config.budget == "auto" else None
        self.verifier = TreeVerifier(self.hybrid.tree, self.device) if config.drafts_trees else None

    # -- start-up ---------------------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        """Nothing to load: the target model verifies, the matrix drafts. (The CPU runner calls
        this unconditionally, cpu_model_runner.py:74-76; the GPU runner if it exists,
        gpu_model_runner.py:5070-5073.) Tree mode checks here, at start-up, that this vLLM
        set-up is one tree verification supports: where it is not, an explicit verify "tree"
        refuses to start, an unset one drafts the matrix's chain instead (every rank alike: they
        load one model) and says why once (``support.chain_instead``, which the front end's
        decision from the model's config also goes through)."""
        if self.verifier is None:
            return
        try:
            self.verifier.check_support(self.vllm_config, target_model)
        except TreesUnsupported as e:
            self._drafting(chain_instead(self.config, e, log=is_first_rank()))

    def check_sampler(self, runner) -> None:
        """At start-up (``patches.runner.CheckDrafter``): the node sampler, built from the
        runner's own sampler, samples as a plain step samples (``node_sampler.self_check``), or
        the engine refuses to start, saying what differs."""
        sampler = runner.rejection_sampler.sampler
        problem = sampler_self_check(sampler, runner.input_batch.logitsprocs, self.device)
        if problem is not None:
            raise RuntimeError(
                f"vllm-recycling: speculative rows would not be sampled as this vLLM samples a plain "
                f"step ({problem}); method 'recycling' supports vLLM 0.32's sampler"
            )
        self._node_sampler = NodeSampler(sampler)

    def profile_step_cost(self, run_tokens: Callable[[int], Any], max_tokens: int) -> None:
        """budget "auto", at start-up (``patches.runner.ProfileStepCost``): the cost model's
        profile from timed forward passes (``AdaptiveBudget.profile``)."""
        self.budget.profile(run_tokens, max_tokens)

    def save_snapshot(self) -> None:
        self.slots.save_snapshot()

    # -- 1. before the forward ------------------------------------------------------------------
    def begin_step(
        self,
        req_ids: list[str],
        sampling_params: Callable[[str], Any],
        num_draft_tokens: list[int] | None,
        query_start_loc: np.ndarray,
        num_computed_tokens: np.ndarray,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor | None:
        """Start the step's record; return the [num_tokens] int64 offsets (on the slots' device)
        to add to its positions, None when it has no branching tree.

        req_ids: the batch in order; sampling_params(req_id): its ``SamplingParams`` (None if
        unknown); num_draft_tokens [B] (None without speculative metadata), query_start_loc
        [B+1], num_computed_tokens [B] (before this step): the runner's host values;
        slot_mapping [>= num_tokens] int64: this step's slots, where accepted nodes move.
        A request with structured output is then drafted nothing: vLLM advances its grammar
        along the drafts as a chain (v1/structured_output/__init__.py:404-436), which is wrong
        for siblings."""
        self.batch = list(req_ids)
        self.slots.note_salts(req_ids, sampling_params)
        self._no_drafts = [
            getattr(sampling_params(r), "structured_outputs", None) is not None for r in req_ids
        ]
        tree = None
        if num_draft_tokens is not None and self.verifier is not None:
            nodes = None  # every request the template's first nodes (budget fixed, no context)
            if self.budget is not None or self.hybrid.context_length:
                # no record: drafts this proposer did not send (verified as chains)
                nodes = [self.proposal.sent.get(r, (_NO_NODES,))[0] for r in self.batch]
                if self.tp_mean is not None:  # every rank lays out the same trees, or none runs
                    layout_checked(self.tp_mean, nodes)
            tree = self.verifier.plan(num_draft_tokens, query_start_loc, num_computed_tokens, nodes)
        ACTIVE_TREE.publish(tree)
        num_tokens, num_reqs = int(query_start_loc[-1]), len(query_start_loc) - 1
        drafted = 0 if num_draft_tokens is None else int(np.sum(num_draft_tokens))
        plan = StepPlan(
            num_tokens=num_tokens,
            num_draft=None if num_draft_tokens is None else tuple(int(n) for n in num_draft_tokens),
            # every request decodes (one token + its drafts): prefill chunks cost what the
            # profile of decode steps does not say
            decode_only=num_tokens == num_reqs + drafted,
            tree=tree,
            slot_mapping=None if tree is None else slot_mapping,
        )
        self.record = StepRecord(tuple(self.batch), self.proposal, plan)
        if tree is None:
            return None
        return to_device(tree.position_offsets(), torch.int64, slot_mapping.device)

    # -- 2. before sampling ---------------------------------------------------------------------
    @torch.inference_mode()
    def verify(
        self,
        req_ids: list[str],
        live_req_ids,
        tokens: torch.Tensor,
        logits: torch.Tensor,
        spec_decode_metadata,
        sampling_metadata,
        rejection_sampler: Callable,
        kv_caches: Callable[[], list[torch.Tensor]],
    ):
        """Update the matrix from every logits row; for a step with drafts, or a tree step,
        return its ``SamplerOutput`` (None otherwise: vLLM samples): where every row emits its
        argmax (``plain_greedy``) from the argmax the update computed, with a sampled request
        (penalties, ...) row by row, other greedy tree steps through vLLM's rejection sampler.

        tokens [T] int (the token fed at each logits row); logits [T, V] (vLLM's
        ``[sum(N) + B, V]``: per request, in batch order, the root row then one row per draft);
        spec_decode_metadata: vLLM's chain layout of the step; live_req_ids: every request the
        runner still holds (finished ones are gone), to free their slots; kv_caches(): every
        attention layer's cache (``TreeVerifier.verify``)."""
        batch = self.batch = list(req_ids)
        rows = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64) + 1
        self.slots.assign(batch, set(live_req_ids))
        argmax = self.matrix.update(tokens[:, None], logits, self.slots.of_rows(batch, rows))
        attention_seconds = ACTIVE_TREE.clear()
        record = self.record
        tree = None if record is None or record.plan is None else record.plan.tree
        started = time.perf_counter()
        drafted = any(spec_decode_metadata.num_draft_tokens)
        if drafted and plain_greedy(sampling_metadata):
            output, path = verify_greedy(tree, argmax, tokens, spec_decode_metadata.num_draft_tokens)
            if tree is not None:
                self.verifier.move_accepted(tree, path, record.plan.slot_mapping, kv_caches())
            generators = NO_STATES
        elif drafted and samples_rows(sampling_metadata):
            if self._node_sampler is None:  # not started through vLLM's worker (tests)
                self._node_sampler = NodeSampler(rejection_sampler.sampler)
            output, path, generators = verify_sampled(
                self._node_sampler, tree, logits, tokens, spec_decode_metadata.num_draft_tokens,
                sampling_metadata,
            )
            if tree is not None:
                self.verifier.move_accepted(tree, path, record.plan.slot_mapping, kv_caches())
        elif tree is not None and self.verifier is not None:
            output, path = self.verifier.verify(
                tree, record.plan.slot_mapping, logits, tokens, spec_decode_metadata,
                sampling_metadata, rejection_sampler, kv_caches(),
            )
            generators = NO_STATES
        else:
            return None
        if record is not None:
            # a tree's attention and verification, timed apart for the cost model
            seconds = 0.0 if tree is None else attention_seconds + time.perf_counter() - started
            req_index = _NO_NODES if tree is None else tree.req_index_np
            self.record = StepRecord(
                record.batch, record.proposal, record.plan,
                Verification(req_index, path, seconds, generators),
            )
        return output

    # -- 3. after bookkeeping -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        """sampled_token_ids: per request (batch order) the tokens emitted this step, empty for
        a partial prefill; num_tokens_no_spec [max_num_reqs] int32. Returns per request its
        drafts in breadth-first order: with budget "fixed" every node of the template (or the
        chain), with budget "auto" the nodes the budget chose; [] for none."""
        self.slots.maybe_save()
        if self.prior_watch is not None:
            self._take_prior()
        record = self.record or StepRecord(tuple(self.batch), self.proposal, None)
        if record.verification is not None:  # seeded generators back to the emitted positions
            record.verification.generators.rewind(sampled_token_ids)
        self.record, self.proposal = None, NO_PROPOSAL
        if self.budget is not None:
            self.budget.learn(record, sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        no_drafts = self._no_drafts or [False] * len(sampled_token_ids)
        salted = self.matrix.scope == Scope.SALT  # a salt without a matrix yet drafts nothing
        active = [
            i for i, sampled in enumerate(sampled_token_ids)
            if sampled and num_tokens_no_spec[i] < self.max_model_len and not no_drafts[i]
            and not (salted and not self.slots.can_draft(self.batch[i]))
        ]
        if not active:
            return drafts
        roots = self._roots.fill([sampled_token_ids[i][-1] for i in active])
        slots = self.slots.of([self.batch[i] for i in active]) if self.slots.scoped else None
        context = Context.find(token_ids_cpu, active, np.asarray(num_tokens_no_spec)[active],
                               self.hybrid.context_length)
        if self.budget is None:
            return self._every_node(drafts, active, roots, slots, context)
        num_decoding = sum(1 for x in sampled_token_ids if x)
        chosen, self.proposal = self.budget.propose(
            self.matrix, roots, slots, active, self.batch, num_decoding, len(sampled_token_ids),
            context,
        )
        for i, tokens in chosen.items():
            drafts[i] = tokens
        return drafts

    def _take_prior(self) -> None:
        """Between two steps: the rows of the model's prior computed since the last look (every
        rank at the same step), into the matrix (``AdjacencyMatrix.take_prior``)."""
        watch = self.prior_watch
        prior = watch.poll()
        if prior is None:
            return
        filled = self.matrix.take_prior(prior, watch.taken)
        watch.took(prior)
        if watch.done:
            self.prior_watch = None
        logger.info("recycling: initial matrix taken in up to token %d of %d (%d rows filled; rows learnt "
                    "from traffic kept)%s", prior.rows, watch.vocab_size, filled, "" if watch.done else
                    "; the rest follows as it is computed")

    def _every_node(self, drafts: list[list[int]], active: list[int], roots: torch.Tensor,
                    slots: torch.Tensor | None, context: Context | None) -> list[list[int]]:
        """budget "fixed": every node of the template (or the chain) for the requests
        ``active``; with the context branch, every matrix node and the context nodes that have
        a token, recorded in the proposal (each request's tree is then its own)."""
        tokens = draft(self.matrix, self.hybrid, roots, slots, context)[:, 1:].cpu().numpy()
        if not self.hybrid.context_length:
            for i, row in zip(active, tokens.tolist()):
                drafts[i] = row
            return drafts
        send = self.hybrid.sendable(len(active), None if context is None else context.valid)
        sent = {}
        for k, i in enumerate(active):  # vLLM takes one Python list of drafts per request
            nodes = np.flatnonzero(send[k])
            drafts[i] = tokens[k, nodes].tolist()
            sent[self.batch[i]] = (nodes + 1, np.zeros(nodes.size, dtype=np.int64))
        self.proposal = Proposal(sent=sent)
        return drafts

