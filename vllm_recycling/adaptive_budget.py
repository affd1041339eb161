"""Owns the adaptive budget of one worker (``budget: "auto"``): its calibration, its step-cost
model, the start-up profile, and each step's decision of which drafted nodes to send.

``budget.py`` and ``cost_model.py`` hold the arithmetic (``Calibration``, ``admit``,
``StepCost``); this class runs it against the steps: ``propose`` decides what the next step verifies and returns it as a
``step.Proposal``, ``learn`` folds a finished ``step.StepRecord`` back in (its measured time
into the cost model, which sent nodes were accepted into the calibration).
"""

from __future__ import annotations

import time
import zlib
from typing import Any, Callable

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME
from vllm_recycling.budget import (
    SYNC_STEPS,
    Admission,
    Calibration,
    RequestFit,
    TreeShape,
    admit,
    chain_nodes,
    context_bins,
    no_drafts,
    nothing_pays,
    to_host,
)
from vllm_recycling.cost_model import EXACT_PROFILE_TOKENS, StepCost, profile_seconds, profile_sizes
from vllm_recycling.drafts import Context, draft
from vllm_recycling.matrix import AdjacencyMatrix
# layout_checked and RanksDisagree stay importable from here, where the proposer and its tests take them
from vllm_recycling.ranks import RanksDisagree, digest_checked, layout_checked, tensor_parallel_mean  # noqa: F401
from vllm_recycling.step import Proposal, StepRecord
from vllm_recycling.tree import HybridTree, load_tree

logger = init_logger(LOGGER_NAME)

PROFILE_MAX_TOKENS = 512
# Rounds of the start-up profile at sizes up to EXACT_PROFILE_TOKENS (docs/design.md, "Step
# cost", says why rounds and how many).
PROFILE_REPEATS = 5
LOG_INTERVAL_S = 30.0


class AdaptiveBudget:
    """hybrid: the pool of nodes (on the matrix's device): the matrix template's, and the
    context chain's when it has one; topk: the matrix's k."""

    def __init__(self, hybrid: HybridTree, topk: int, device: torch.device) -> None:
        self.hybrid = hybrid
        self.template = template = hybrid.tree
        self.calibration = Calibration()
        self.request_fit = RequestFit()
        # A flat prior until the start-up profile (patches.runner.ProfileStepCost) replaces it.
        self.cost = StepCost([1, 1 << 20], [0.0, 0.0])
        # the chains verified without tree attention: the matrix's rank-0 chain, the context chain
        self.chains = np.stack([chain_nodes(template.parent, template.rank).numpy()] + (
            [np.isin(np.arange(1, template.num_nodes + 1), hybrid.context_nodes.cpu().numpy())]
            if hybrid.context_length else []
        ))
        self._parent_np = template.parent.clamp(min=0).cpu().numpy()
        self.shape = TreeShape.of(self._parent_np, template.level_starts)  # admit counts chains with it
        # per non-root node: 1 below the first level (the calibration's second table)
        self._deep = (np.arange(1, template.num_nodes + 1) >= template.level_starts[2]).astype(np.int64)
        # the hybrid nodes of the matrix's first level, in rank order (what ``_unsent`` reads)
        self._first_nodes = hybrid.matrix_nodes[1 : 1 + sum(len(p) == 1 for p in hybrid.matrix.paths)].cpu().numpy()
        first_level = [p for p in hybrid.matrix.paths if len(p) == 1]
        self._first_level = load_tree(first_level, topk).to(device)
        self._last_end: float | None = None
        self._prev_batch: set[str] = set()
        self._steps = 0
        self._stats = np.zeros(4)  # timed steps, measured s, predicted s, drafts (for the log)
        self._last_log = time.perf_counter()
        self.last_admission: Admission | None = None  # the last decision (benchmarks, tests)
        # a checksum of every decision so far, compared across tensor-parallel ranks at each cost
        # agreement (``digest_checked``)
        self.decision_digest = 0

    # -- start-up --------------------------------------------------------------------------------
    def profile(self, run_tokens: Callable[[int], Any], max_tokens: int) -> None:
        """Time ``run_tokens(n)`` (a forward pass of n tokens) for the sizes of
        ``cost_model.profile_sizes`` up to min(max_tokens, PROFILE_MAX_TOKENS): up to
        EXACT_PROFILE_TOKENS the median of PROFILE_REPEATS rounds, each timing every such size
        once, ascending and descending by turns (a drift of the machine's speed spreads over all
        sizes instead of making one look cheap), above it one run; averaged over tensor-parallel
        ranks so that all of them decide alike. The result is the cost model's profile."""
        sizes = profile_sizes(max(2, min(max_tokens, PROFILE_MAX_TOKENS)))
        started = time.perf_counter()
        run_tokens(sizes[0])  # warm-up
        small = [n for n in sizes if n <= EXACT_PROFILE_TOKENS]
        runs: dict[int, list[float]] = {n: [] for n in sizes}
        for round_ in range(PROFILE_REPEATS):
            for n in small if round_ % 2 == 0 else small[::-1]:
                t0 = time.perf_counter()
                run_tokens(n)
                runs[n].append(time.perf_counter() - t0)
        for n in sizes[len(small):]:
            t0 = time.perf_counter()
            run_tokens(n)
            runs[n].append(time.perf_counter() - t0)
        seconds = profile_seconds(sizes, runs)
        mean = tensor_parallel_mean()
        if mean is not None:
            seconds = mean(seconds)
        self.cost = StepCost(sizes, seconds)
        logger.info(
            "recycling: step cost profiled in %.1f s: %s",
            time.perf_counter() - started,
            ", ".join(f"{n} tokens {1e3 * t:.1f} ms" for n, t in zip(sizes, seconds)),
        )

    # -- each step -------------------------------------------------------------------------------
    def propose(
        self,
        matrix: AdjacencyMatrix,
        roots: torch.Tensor,
        slots: torch.Tensor | None,
        active: list[int],
        batch: list[str],
        num_decoding: int,
        base_tokens: int,
        context: Context | None = None,
    ) -> tuple[dict[int, list[int]], Proposal]:
        """The drafts of the requests ``active`` (batch indices; roots [len(active)] their last
        tokens, slots their matrix slots, context their context matches): batch index -> drafts
        in breadth-first order, for those sent any, and the ``Proposal`` that records them.
        num_decoding: requests of the batch that decode; base_tokens: the step's tokens without
        drafts."""
        num_nodes = self.template.num_nodes
        scale = self.request_fit.scale([batch[i] for i in active])
        max_edge = min(1.0, self.calibration.max_edge * float(scale.max(initial=1.0)))
        if nothing_pays(max_edge, self.cost, num_decoding, base_tokens, len(active) * num_nodes):
            # no node survives more than the calibration's best edge, and that does not pay:
            # plain decoding, decided without drafting the tree (what admit would decide)
            decision = no_drafts(len(active), num_nodes, num_decoding, base_tokens, self.cost)
            self._record(decision)
            tokens, conf = matrix.draft(roots, self._first_level, slots, with_probs=True)
            tokens_np, conf_np = to_host(tokens[:, 1:], conf[:, 1:])
            every = np.ones(len(active), dtype=bool)
            unsent = self._unsent(active, batch, tokens_np, conf_np, every, context)
            return {}, Proposal(unsent=unsent, predicted_seconds=decision.seconds)
        tokens, conf = draft(matrix, self.hybrid, roots, slots, context, with_probs=True)
        tokens_np, conf_np = to_host(tokens, conf)  # one copy from the device, survival on the host
        survival = self.calibration.survival(conf_np, self._parent_np, self.template.level_starts, scale)
        tokens_np, conf_np, survival_np = tokens_np[:, 1:], conf_np[:, 1:], survival[:, 1:]
        if self.hybrid.context_length:  # a context node without a token is never sent
            survival_np *= self.hybrid.sendable(len(active), None if context is None else context.valid)
        decision = admit(survival_np, self.chains, num_decoding, base_tokens, self.cost, self.shape)
        mask = self._record(decision)
        bins = self.calibration.bins(conf_np, self._deep)
        drafts, sent = {}, {}
        for k, i in enumerate(active):  # vLLM takes one Python list of drafts per request
            nodes = np.flatnonzero(mask[k])
            if nodes.size:
                drafts[i] = tokens_np[k, nodes].tolist()
                sent[batch[i]] = (nodes + 1, bins[k, nodes])
        first = tokens_np[:, self._first_nodes - 1], conf_np[:, self._first_nodes - 1]
        unsent = self._unsent(active, batch, *first, ~mask.any(axis=1), context)
        return drafts, Proposal(sent=sent, unsent=unsent, predicted_seconds=decision.seconds)

    def _unsent(self, active: list[int], batch: list[str], tokens: np.ndarray, conf: np.ndarray,
                rows: np.ndarray, context: Context | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """For the requests ``active[k]`` with ``rows[k]`` (sent no drafts), the tokens and
        confidence bins of their first-level matrix nodes from written rows, and of the context
        chain's first node where it has one, for ``learn``. tokens / conf [len(active), >=
        first-level nodes]: the matrix's first level, in rank order (host arrays the caller
        already holds)."""
        if not rows.any():
            return {}
        end = self._first_level.num_nodes
        first_tokens, first_conf = tokens[:, :end], conf[:, :end]
        if context is not None and self.hybrid.context_length:  # a match's first token too
            has = context.match_len > 0
            first_tokens = np.concatenate([first_tokens, np.where(has, context.tokens[:, 0], -1)[:, None]], 1)
            ctx_conf = context_bins(context.match_len, 1)
            first_conf = np.concatenate([first_conf, ctx_conf], 1)
        first_bins = self.calibration.bins(first_conf, 0)
        # the first level is the root's row: one never written (every probability 0) drafts
        # token 0 at every rank, no trials (a prior row's are negative: trials of its tables);
        # a node without a token (-1: no match) is no trial either
        out = {}
        for k in np.flatnonzero(rows & (np.abs(first_conf).max(axis=1) > 0)):
            keep = first_tokens[k] >= 0
            out[batch[active[k]]] = (first_tokens[k][keep], first_bins[k][keep])
        return out

    def _record(self, decision: Admission) -> np.ndarray:
        """Keep the step's decision (benchmarks, tests, the log) and its checksum (the ranks of
        a tensor-parallel group must agree); returns its mask on the host."""
        self.last_admission = decision
        self.decision_digest = zlib.crc32(decision.mask.tobytes(), self.decision_digest)
        return decision.mask

    def learn(self, record: StepRecord, sampled_token_ids: list[list[int]]) -> None:
        """Fold the step that just ended into the cost model (its measured duration, from the end
        of one ``propose`` to the start of the next) and the calibration (which sent nodes were
        accepted). sampled_token_ids: per request of ``record.batch``, the tokens it emitted."""
        now = time.perf_counter()
        plan, batch = record.plan, set(record.batch)
        # A step right after one whose requests all ended may include idle time: not timed.
        if self._last_end is not None and plan is not None and plan.decode_only and batch & self._prev_batch:
            seconds = now - self._last_end
            tree_seconds = 0.0 if record.verification is None else record.verification.tree_seconds
            extra_chains = 0 if plan.tree is None else plan.tree.extra_chains
            self.cost.observe(plan.num_tokens, plan.num_trees, tree_seconds, seconds, drafted=plan.drafted,
                              extra_chains=extra_chains)
            self._stats += np.array(
                [1, seconds, record.proposal.predicted_seconds, plan.num_tokens - len(batch)]
            )
        self._prev_batch = batch
        self._steps += 1
        # Every rank calls this at the same steps: at 1, 2, 4, ... 32, then every 32.
        if self._steps % SYNC_STEPS == 0 or (self._steps < SYNC_STEPS and not self._steps & (self._steps - 1)):
            mean = tensor_parallel_mean()  # the ranks' costs and decision digests, one all-reduce
            self.cost.agree(None if mean is None else digest_checked(mean, self.decision_digest))
        if now - self._last_log >= LOG_INTERVAL_S and self._stats[0] > 0:
            self._log(len(batch))
            self._last_log = now
        trial_bins, hits = self._trials(record, sampled_token_ids)
        self.request_fit.keep(batch)
        if trial_bins:
            self.calibration.observe(np.concatenate(trial_bins), np.concatenate(hits))
        self._last_end = now

    def _trials(self, record: StepRecord, sampled_token_ids: list[list[int]]):
        """The calibration's trials of the step: (bins, accepted) arrays, for every sent node
        whose parent was accepted and every first-level node of a request sent nothing."""
        paths = {}
        if record.verification is not None and record.verification.path is not None:
            # vLLM has read this step's output: no wait here
            v = record.verification
            paths = {int(b): p[p >= 0] for b, p in zip(v.req_index, v.path.cpu().numpy())}
        num_draft = None if record.plan is None else record.plan.num_draft
        trial_bins, hits = [], []
        if num_draft is not None:
            for i, req_id in enumerate(record.batch):  # host bookkeeping of sent drafts
                n = int(num_draft[i]) if i < len(num_draft) else 0
                sent = record.proposal.sent.get(req_id)
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
                self.request_fit.observe(req_id, int(hits[-1].sum()),
                                         float(self.calibration.rates[trial_bins[-1]].sum()))
        unsent = record.proposal.unsent
        if unsent:  # first-level nodes not sent: accepted if the step emitted their token
            for i, req_id in enumerate(record.batch[: len(sampled_token_ids)]):
                first = unsent.get(req_id)
                if first is not None and len(sampled_token_ids[i]) == 1:
                    trial_bins.append(first[1])
                    hits.append(first[0] == sampled_token_ids[i][0])
                    self.request_fit.observe(req_id, int(hits[-1].sum()),
                                             float(self.calibration.rates[first[1]].sum()))
        return trial_bins, hits

    def _log(self, batch_size: int) -> None:
        n, measured, predicted, drafts = self._stats
        a, b, c, d = self.cost.agreed
        logger.info(
            "recycling budget: %d decode steps, %.2f drafts per request per step; step %.1f ms "
            "measured, %.1f ms predicted; residual %.1f ms + %.3f ms/token; %.1f ms per tree + "
            "%.2f ms per chain beyond its first; %.1f ms per drafting step",
            n, drafts / max(n * batch_size, 1), 1e3 * measured / n, 1e3 * predicted / n,
            1e3 * a, 1e3 * b, 1e3 * c, 1e3 * getattr(self.cost, "chain_seconds", 0.0), 1e3 * d,
        )
        self._stats[:] = 0
