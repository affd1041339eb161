"""The adaptive verification budget: which draft nodes a step verifies.

A node is worth verifying when the tokens it is expected to add outweigh what it costs on this
hardware at this batch size. Per step, over all requests of the batch:

- ``Calibration``: the probability that a node is accepted given that its parent was, as a
  function of its edge confidence (the probability of its token under the logits that wrote
  its matrix row, ``AdjacencyMatrix.probs``). Learned online from verification outcomes:
  sqrt-spaced confidence bins, each a hit / trial count, forgotten by ``FORGET`` at every
  step that teaches it (so it follows the traffic), on top of a prior (a fraction of the
  confidence, worth ``PRIOR_TRIALS`` trials) that a forgotten bin returns to; tables for
  edges from the root and deeper edges (apart for rows the model's prior filled) and for context
  edges, each kept non-decreasing in confidence.
- ``RequestFit``: each request's factor on those edges, its accepted edges over the ones the
  calibration expected (shrunk toward 1): one table serves every request, and requests differ.
- survival of a node: the product of its path's calibrated edges, each times its request's
  factor and at most 1 (the chance that the node and all its ancestors are accepted), computed
  level by level, so a child never survives more than its parent.
- ``cost_model.StepCost``: seconds per step as a function of its tokens, its branching trees,
  their chains beyond one per tree and whether it drafts (a start-up profile plus an online fit).
- ``admit``: the global top-B nodes by survival (ancestor-closed per request, since survival
  never grows along a path), B* = argmax_B (R + sum of the admitted survivals) / cost(base + B),
  B = 0 (plain decoding) included; once over the rank-0 chain of each request (vLLM verifies a
  chain without tree attention) and once over the whole tree (paying the tree term for each
  request that gets a node off its chain, and, where the cost prices chains, the chain term for
  each chain its tree adds: nodes of equal survival are taken chain by chain, so of two shapes
  that give as many tokens the one with fewer chains is sent). ``nothing_pays`` answers
  B = 0 first when even the most likely node cannot pay (``cost_model.break_even``, cached per cost
  agreement): then neither the sort nor the cost curve is evaluated, and the proposer does not
  even draft when the calibration's largest edge is below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vllm_recycling.cost_model import break_even

NUM_BINS = 16
# edges from the root, deeper edges; the same two for rows the model's prior filled; context
# edges (the context branch: a match of the request's own history, not a matrix row)
NUM_TABLES = 5
PRIOR_TRIALS = 4.0
# A context edge's "confidence" is CONTEXT_CONF + its bin (``context_bins``): matrix
# confidences lie in [-1, 1], so one tensor carries both through the survival product.
CONTEXT_CONF = 2.0
# The context table's bins: a match of at least CONTEXT_MATCH[g] tokens (the last group that
# holds), at a depth of 1, 2, 3, 4 or more; its prior rate for each group. Learnt on SmolLM2 (13
# Spec-Bench prompts x 128 tokens, 2026-11-26): 1-token matches ~0.1, 2-token 0.3-0.55,
# 3-token 0.6-0.7, 4+ 0.85-0.9, better deeper (the parent was accepted). Deeper still the chain
# is copying a span: on Qwen2.5-Coder-0.5B (the full tree every step, 13 prompts x 128 tokens,
# 2026-11-27) a context node was accepted below an accepted parent 0.69, 0.63, 0.71 and 0.77 of
# the time at depths 1 to 4, and 0.88-1.0 at every depth from 5 to 15: depths from 5 on get a
# bin of their own, or the chain's deep nodes read as unlikely as its first ones.
CONTEXT_MATCH = (1, 2, 3, 4, 8)
CONTEXT_DEPTHS = 5
CONTEXT_BINS = len(CONTEXT_MATCH) * CONTEXT_DEPTHS
CONTEXT_PRIOR = (0.1, 0.3, 0.5, 0.7, 0.8)
# The prior acceptance of a bin: this times its confidence, for edges from the root and for
# deeper ones (stale rows are confident; deeper edges learn only from drafts sent, so their
# prior must let some be sent). The measurements behind it: docs/design.md, "Constants".
PRIOR_SCALE = (0.25, 0.5)
# Every step that teaches the calibration multiplies the bins' learnt counts by this: a memory
# of ~1 / (1 - FORGET) steps, so the table follows the traffic. The prior is not forgotten: a
# bin nobody tries any more returns to it.
FORGET = 0.995
SYNC_STEPS = 32
# ``RequestFit``'s prior: a request's factor starts at 1 and moves as its accepted edges
# outweigh this many expected ones (2 and 8 calibrated alike on Qwen2.5-Coder-0.5B, 4 between).
REQUEST_PRIOR = 4.0


def confidence_bins(conf: torch.Tensor | np.ndarray, num_bins: int = NUM_BINS):
    """Bin index of each confidence in [0, 1]: sqrt-spaced, so low confidences (most nodes)
    get finer bins. Works on tensors and arrays."""
    if isinstance(conf, np.ndarray):
        return np.minimum((np.sqrt(np.clip(conf, 0.0, 1.0)) * num_bins).astype(np.int64), num_bins - 1)
    return (conf.clamp(0.0, 1.0).sqrt() * num_bins).long().clamp(max=num_bins - 1)


def monotone(rates: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest to ``rates`` in ``weights``-weighted least squares
    (pool adjacent violators): neighbouring bins that disagree with the order of their
    confidences are pooled into their weighted mean."""
    values, sizes, counts = [], [], []
    for rate, weight in zip(rates.tolist(), weights.tolist()):
        values.append(rate)
        sizes.append(weight)
        counts.append(1)
        while len(values) > 1 and values[-2] > values[-1]:
            size = sizes[-2] + sizes[-1]
            values[-2] = (values[-2] * sizes[-2] + values[-1] * sizes[-1]) / size
            sizes[-2] = size
            counts[-2] += counts[-1]
            del values[-1], sizes[-1], counts[-1]
    return np.repeat(values, counts)


class Calibration:
    """P(node accepted | parent accepted) per confidence bin, learned online, in five tables
    (``NUM_TABLES``): edges from the root and deeper edges, each for rows verification wrote and
    for rows the model's prior filled (``AdjacencyMatrix``: their confidences come negated), and
    context edges (by match length and depth: ``context_bins``). A confident
    edge is accepted less often from the root (its row was written in another context) than
    below an accepted draft (the context matches again); a prior row's confidence is the
    model's after the token alone, not after any text that was served. Each table is kept
    non-decreasing in confidence (``monotone``): a bin's own count is noisy, and the budget
    sends the nodes whose bins read highest, so an unpooled table sent bins that were lucky
    (docs/design.md, "Constants")."""

    def __init__(self, num_bins: int = NUM_BINS) -> None:
        centers = ((np.arange(num_bins) + 0.5) / num_bins) ** 2  # the confidence at each bin's middle
        # NUM_TABLES tables of num_bins: edges from the root (the first level), deeper edges,
        # then the same two for prior rows, then context edges; learnt counts (forgotten) and
        # the prior's (kept)
        scales = PRIOR_SCALE + PRIOR_SCALE
        context = np.repeat(CONTEXT_PRIOR, CONTEXT_DEPTHS)  # CONTEXT_BINS
        size = (NUM_TABLES - 1) * num_bins + CONTEXT_BINS
        self.prior_trials = np.full(size, PRIOR_TRIALS)
        self.prior_hits = np.concatenate(
            [scale * centers * PRIOR_TRIALS for scale in scales] + [context * PRIOR_TRIALS]
        )
        self.trials = np.zeros(size)
        self.hits = np.zeros(size)
        self.num_bins = num_bins
        self._max_edge = self._set_rates()
        self._deep: dict[tuple, np.ndarray] = {}

    def bins(self, conf, deep):
        """The table index of each edge: the bin of its confidence |conf|, in the second table
        when ``deep`` (its parent is not the root), two tables further when conf < 0 (a prior
        row); a context edge (conf >= CONTEXT_CONF) in the context table, at bin conf -
        CONTEXT_CONF. conf and deep: host arrays."""
        n = self.num_bins
        prior = (conf < 0).astype(np.int64)
        matrix = confidence_bins(np.abs(conf), n) + n * (deep + 2 * prior)
        context = 4 * n + np.clip(conf - CONTEXT_CONF, 0, CONTEXT_BINS - 1).astype(np.int64)
        return np.where(conf >= CONTEXT_CONF, context, matrix)

    def observe(self, bins: np.ndarray, accepted: np.ndarray) -> None:
        """bins [n] int (``bins``): the edges of nodes whose parent was accepted; accepted [n]
        bool."""
        if bins.size == 0:
            return
        self.trials *= FORGET
        self.hits *= FORGET
        np.add.at(self.trials, bins, 1.0)
        np.add.at(self.hits, bins, accepted.astype(np.float64))
        self._max_edge = self._set_rates()

    @property
    def max_edge(self) -> float:
        """The largest edge acceptance of the table (host float): no node survives more."""
        return self._max_edge

    def _set_rates(self) -> float:
        """Set ``rates``, the pooled rate of each bin of each table; returns the largest."""
        n = self.num_bins
        trials = self.trials + self.prior_trials
        raw = (self.hits + self.prior_hits) / trials
        # the matrix tables kept non-decreasing in confidence; the context table's bins are
        # (match length, depth) pairs, with no order to keep
        rates = np.concatenate(
            [monotone(raw[t * n : (t + 1) * n], trials[t * n : (t + 1) * n]) for t in range(4)]
            + [raw[4 * n :]]
        )
        self.rates = rates.astype(np.float32)
        return float(max(rates[n - 1 : 4 * n : n].max(), rates[4 * n :].max()))

    def survival(self, conf: np.ndarray, parent: np.ndarray, level_starts: tuple[int, ...],
                 scale: np.ndarray | None = None) -> np.ndarray:
        """conf [R, M] (node 0 the root, breadth-first) -> survival [R, M] (1 at the root);
        parent [M] int64: each node's parent; scale [R]: each request's factor on its edges
        (``RequestFit``), an edge never above 1. On the host: a few numpy calls per level cost
        less than torch's launches, on a GPU too (measured on an H200 with the drafts copied
        over first: 0.41 against 1.02 ms a step at batch 1, 0.92 against 1.21 at 256)."""
        key = (conf.shape[-1], level_starts[2])
        deep = self._deep.get(key)
        if deep is None:  # 1 below the first level; made once per template
            deep = self._deep[key] = (np.arange(key[0]) >= key[1]).astype(np.int64)
        edge = self.rates[self.bins(conf, deep)]
        if scale is not None:
            edge = np.minimum(edge * scale.astype(edge.dtype)[:, None], 1.0)
        survival = np.ones_like(edge)
        for d in range(1, len(level_starts) - 1):  # one product per level, never per node
            s, e = level_starts[d], level_starts[d + 1]
            survival[:, s:e] = survival[:, parent[s:e]] * edge[:, s:e]
        return survival


class RequestFit:
    """Each request's factor on the calibration's edges: (its accepted edges + REQUEST_PRIOR) /
    (the calibration's expected accepted edges + REQUEST_PRIOR), over the edges it tried (nodes
    whose parent was accepted: sent ones, and the first level's when it was sent nothing).
    The calibration is one table for all requests, and requests differ: code that copies
    earlier lines accepts far more than its confidences say, free prose less. Measured on
    Qwen2.5-Coder-0.5B (the whole tree every step, 466 steps, 13 prompts; benchmarks/studies/budget_ceiling.py):
    the calibration alone expected 2.04 tokens a step of its top 8 nodes, which gave 2.25;
    with each request's factor it expected 2.23 and they gave 2.26 (and at 4 nodes 1.92 / 1.93,
    at 30 2.70 / 2.75), so the budget sizes its trees by what they will give. A factor for
    the whole batch, or one per template node, overestimated (2.58 and 2.63 expected at 8)."""

    def __init__(self) -> None:
        self.hits: dict[str, float] = {}
        self.expected: dict[str, float] = {}

    def scale(self, req_ids: list[str]) -> np.ndarray:
        """[len(req_ids)] the factors of these requests (1 for one that tried nothing yet)."""
        return np.array([(self.hits.get(r, 0.0) + REQUEST_PRIOR) / (self.expected.get(r, 0.0) + REQUEST_PRIOR)
                         for r in req_ids], dtype=np.float64)

    def observe(self, req_id: str, accepted: int, expected: float) -> None:
        """A step's tried edges of one request: how many were accepted, how many the calibration
        expected (the sum of their edges' rates)."""
        self.hits[req_id] = self.hits.get(req_id, 0.0) + accepted
        self.expected[req_id] = self.expected.get(req_id, 0.0) + expected

    def keep(self, req_ids) -> None:
        """Forget the requests not in ``req_ids`` (finished ones)."""
        for table in (self.hits, self.expected):
            for r in [r for r in table if r not in req_ids]:
                del table[r]


def nothing_pays(max_survival: float, cost: Callable, num_decoding: int, base_tokens: int, max_nodes: int) -> bool:
    """Whether ``admit`` would choose B = 0 whatever the nodes, given that none survives with
    more than max_survival (with a margin for rounding: when this says so, admit agrees)."""
    return max_survival * (1.0 + 1e-6) + 1e-12 <= break_even(cost, num_decoding, base_tokens, max_nodes)


@dataclass
class Admission:
    """What ``admit`` chose. mask [R, N] bool (host) over the non-root nodes; trees: requests
    given a node off their rank-0 chain (a branching tree); expected: R + the admitted
    survivals; seconds: predicted step cost; extra_chains: the admitted trees' chains beyond one
    per tree (counted only where the cost prices chains, else 0)."""

    mask: np.ndarray
    num_admitted: int
    trees: int
    expected: float
    seconds: float
    extra_chains: int = 0


@dataclass(frozen=True)
class TreeShape:
    """What ``admit`` needs of the template to count a tree's chains, made once per template.
    N = non-root nodes, breadth-first.

    siblings [N] int64: the nodes ordered by parent (stable), so each parent's children are one
        run; starts [G] int64: where each run starts, G = nodes with children; run [N] int64:
        the run of each position of ``siblings``.
    parent [N] int64: each node's parent as a non-root column (-1: the root).
    jumps: pointer doublings that reach the root from the deepest node (ceil(log2(depth))).
    """

    siblings: np.ndarray
    starts: np.ndarray
    run: np.ndarray
    parent: np.ndarray
    jumps: int

    @classmethod
    def of(cls, parent: np.ndarray, level_starts: tuple[int, ...]) -> "TreeShape":
        """parent [M] int (the template's, root first, its own parent anything); level_starts:
        the template's (``TreeTemplate.level_starts``)."""
        column = np.asarray(parent, dtype=np.int64)[1:] - 1
        siblings = np.argsort(column, kind="stable")
        runs = column[siblings]
        new_run = np.concatenate([[True], runs[1:] != runs[:-1]]) if runs.size else np.zeros(0, dtype=bool)
        depth = len(level_starts) - 2
        return cls(siblings, np.flatnonzero(new_run), np.cumsum(new_run) - 1, column,
                   math.ceil(math.log2(depth)) if depth > 1 else 0)

    def extra_chains(self, survival: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """survival [R, N] -> (extra [R, N] bool: the node adds a chain, it is not the first of
        its siblings in ``admit``'s order (the likeliest, ties the lowest index), so admitted
        with its parent's first child it adds a leaf; head [R, N] int64: the first node of the
        node's chain (the chain of first children it lies on; -1: the root's). Numpy over the
        nodes, flat indices (a 1-d gather costs a fraction of a 2-d one): a few calls for the
        siblings, then pointer doubling up the chains."""
        num_req, num_nodes = survival.shape
        ordered = survival[:, self.siblings]
        likeliest = ordered == np.maximum.reduceat(ordered, self.starts, axis=1)[:, self.run]
        position = np.where(likeliest, np.arange(num_nodes), num_nodes)
        offset = (np.arange(num_req) * num_nodes)[:, None]
        first = self.siblings[np.minimum.reduceat(position, self.starts, axis=1)] + offset  # [R, G]
        extra = np.ones(num_req * num_nodes, dtype=bool)
        extra[first.ravel()] = False
        # each node points at itself where its chain starts (it adds one, or the root is its
        # parent), else at its parent; doubling the pointers reaches every chain's first node
        up = (np.where(extra.reshape(num_req, num_nodes) | (self.parent < 0), np.arange(num_nodes), self.parent)
              + offset).ravel()
        for _ in range(self.jumps):
            up = up[up]
        up = up.reshape(num_req, num_nodes)
        head = np.where(extra[up], up - offset, -1)
        return extra.reshape(num_req, num_nodes), head


def admit(
    survival: np.ndarray | torch.Tensor,
    chain: np.ndarray | torch.Tensor,
    num_decoding: int,
    base_tokens: int,
    cost: Callable[[np.ndarray, np.ndarray], np.ndarray],
    shape: TreeShape | None = None,
) -> Admission:
    """survival [R, N] of the non-root nodes (breadth-first, host values or a tensor); chain
    [N] bool, or [C, N] for several: the nodes of a chain of the template (its rank-0 chain,
    the context chain), each verified without tree attention; num_decoding: tokens the step
    yields without drafts (R);
    base_tokens: the step's tokens without drafts; cost(tokens, trees, drafted) -> seconds,
    elementwise (drafted: 1 for B >= 1). shape: the template's (``TreeShape``); with it, a cost
    whose ``chain_seconds`` is above 0 prices the whole tree's chains too, as
    cost(tokens, trees, drafted, extra_chains).

    Ties keep the lower (request, node) first, so a parent (never less likely than its child,
    and earlier) is always admitted before its child. Where chains are priced, ties in the whole
    tree are taken chain by chain (by the first node of each node's chain, ``TreeShape.
    extra_chains``: the root's chain first, then the earliest), then as before: a chain is
    finished before another is opened, and a parent's chain never starts after its child's.
    """
    num_req, num_nodes = survival.shape
    # on the host, in numpy: a few hundred to a few thousand values, where each torch call
    # costs more than the work (docs/design.md, "Constants")
    surv = _host(survival).astype(np.float64, copy=False).reshape(-1)
    if not surv.size or nothing_pays(float(surv.max()), cost, num_decoding, base_tokens, surv.size):
        return no_drafts(num_req, num_nodes, num_decoding, base_tokens, cost)
    chains = np.atleast_2d(_host(chain).astype(bool))
    sizes = np.arange(surv.size + 1)
    request = np.arange(surv.size) // num_nodes
    # a tree's shape is priced only where its chains cost something (the CPU tree pass)
    priced = shape is not None and float(getattr(cost, "chain_seconds", 0.0)) > 0.0
    if priced:
        extra, head = shape.extra_chains(surv.reshape(num_req, num_nodes))
        extra, head = extra.reshape(-1), head.reshape(-1)
    best = None
    # each chain alone (every request on it: no tree attention), then the whole tree
    for on_chain in [np.tile(c, num_req) for c in chains] + [None]:
        tree = on_chain is None
        flat = surv if tree else surv * on_chain
        if tree and priced:  # descending; ties: chain by chain (the root's first), then the lower index
            order = np.lexsort((head, -flat))
        else:
            order = np.argsort(-flat, kind="stable")  # descending; ties keep the lower index first
        gains = np.zeros(surv.size + 1)
        gains[1:] = np.cumsum(flat[order], dtype=np.float64)
        trees = np.zeros(surv.size + 1)
        if tree:
            # a request's nodes form a tree once they lie on no single chain: from the position
            # in the order of its first node off each chain, the latest of those
            position = np.empty(surv.size, dtype=np.int64)
            position[order] = np.arange(surv.size)
            onset = np.zeros(num_req, dtype=np.int64)
            for c in chains:
                off = ~np.tile(c, num_req)
                first = np.full(num_req, surv.size, dtype=np.int64)
                np.minimum.at(first, request[off], position[off])
                onset = np.maximum(onset, first)
            trees[1:] = np.cumsum(np.bincount(onset[onset < surv.size], minlength=surv.size))
        added = np.zeros(surv.size + 1)  # chains beyond one per tree; a chain plan adds none
        if priced:
            if tree:
                added[1:] = np.cumsum(extra[order])
            value = (num_decoding + gains) / cost(base_tokens + sizes, trees, sizes > 0, added)
        else:
            value = (num_decoding + gains) / cost(base_tokens + sizes, trees, sizes > 0)
        b = int(np.argmax(value))
        if best is None or value[b] > best[0] * (1 + 1e-9):
            best = (value[b], b, order, int(trees[b]), float(gains[b]), int(added[b]))
    value, b, order, trees, gain, added = best
    mask = np.zeros(surv.size, dtype=bool)
    mask[order[:b]] = True
    return Admission(mask.reshape(num_req, num_nodes), b, trees, num_decoding + gain,
                     (num_decoding + gain) / value, added)


def _host(values) -> np.ndarray:
    return values.cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)


def no_drafts(num_req: int, num_nodes: int, num_decoding: int, base_tokens: int, cost: Callable) -> Admission:
    """The decision B = 0: plain decoding."""
    mask = np.zeros((num_req, num_nodes), dtype=bool)
    return Admission(mask, 0, 0, float(num_decoding), float(np.asarray(cost(base_tokens, 0, 0))))


def chain_nodes(parent: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """[N] bool over the non-root nodes: the template's rank-0 chain (rank 0 all the way)."""
    on = torch.zeros(parent.shape[0], dtype=torch.bool)
    on[0] = True
    parent, rank = parent.cpu(), rank.cpu()
    for node in range(1, parent.shape[0]):  # template set-up, once
        on[node] = bool(on[int(parent[node])]) and int(rank[node]) == 0
    return on[1:]


def context_bins(match_len: np.ndarray, length: int) -> np.ndarray:
    """[B, length] float: the context table's "confidence" (CONTEXT_CONF + bin) of each context
    chain node of requests whose match has ``match_len`` [B] tokens: bin = group * CONTEXT_DEPTHS
    + min(depth, CONTEXT_DEPTHS) - 1, the group the last of CONTEXT_MATCH the match reaches;
    0 (no confidence) where there is no match."""
    n = np.asarray(match_len, dtype=np.int64)
    group = np.searchsorted(np.asarray(CONTEXT_MATCH), n, side="right") - 1
    depth = np.minimum(np.arange(length), CONTEXT_DEPTHS - 1)
    conf = CONTEXT_CONF + group[:, None] * CONTEXT_DEPTHS + depth[None, :]
    return np.where(n[:, None] >= CONTEXT_MATCH[0], conf, 0.0).astype(np.float32)


def to_host(tokens: torch.Tensor, *floats: torch.Tensor) -> list[np.ndarray]:
    """tokens [R, N] int and float tensors [R, N] on the host in one copy (one wait for the
    device, not one per tensor): token ids travel as float32, exact below 2^24. CPU tensors are
    read in place."""
    if tokens.device.type == "cpu":
        return [tokens.numpy().astype(np.int64), *(f.float().numpy() for f in floats)]
    host = torch.stack([tokens.float(), *(f.float() for f in floats)]).cpu().numpy()
    return [host[0].astype(np.int64), *host[1:]]
