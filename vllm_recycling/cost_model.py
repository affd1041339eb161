"""The budget's cost model: what a step costs on this hardware at this batch.

``StepCost``: seconds per step as a function of the tokens in it: a start-up profile of
the forward pass (``profile``, not made monotone up to ``EXACT_PROFILE_TOKENS`` where its
rounds agree on a dip), plus ``a + b * tokens + d * drafted`` fitted online by
recursive least squares on measured step times (sampling, the matrix update, scheduling; d:
what a step with any drafts costs beyond its tokens, the verification path), plus ``c`` per
request with a branching tree: tree attention and path choice, timed where they run and
averaged per tree request (a regression cannot separate it from the tokens it comes with;
the first tree steps are not timed, and the term decays while no tree is verified, so one
dear measurement cannot keep trees out for good; ``d`` decays alike while no step drafts, and
each step's residual is clipped, so a few slow steps cannot stop drafting for good).
Decisions read ``agreed`` parameters, refreshed every ``budget.SYNC_STEPS`` steps (averaged over tensor-parallel ranks there), so every
rank makes the same choice.

``profile_sizes`` / ``profile_seconds``: the start-up profile's sizes and how its timed rounds
become the curve ``StepCost`` interpolates (``adaptive_budget.AdaptiveBudget.profile`` runs it).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

# Up to this many tokens the profile keeps each size's measured time where its rounds agree
# (``profile_seconds``) instead of making it monotone: a step's cost need not grow with its
# tokens (docs/design.md, "Constants").
EXACT_PROFILE_TOKENS = 64
# A dip in the profile is kept only when this share of its paired rounds agree (``profile_seconds``).
DIP_AGREEMENT = 0.85
# The step-time fit's prior, in units of the steps' noise: recursive least squares takes the
# noise variance as 1, so each parameter's prior variance is (its prior std / the noise std)^2.
STEP_NOISE_S = 2e-3
PRIOR_STD_S = (20e-3, 0.5e-3, 5e-3)  # a (per step), b (per token), d (per drafting step)

# The first steps with a branching tree are not timed: they pay the first calls of the tree
# path, and a tree cost learnt from them alone would keep trees out for good.
TREE_WARMUP_STEPS = 2
# Each agreement without a timed tree step multiplies the per-tree cost by this, so a cost
# learnt when trees were dear is retried now and then (one tree step) instead of never again.
TREE_COST_DECAY = 0.9
# The same for the drafting-step cost d: without a timed drafting step since the last agreement
# it decays, so a few slow steps that made drafting look dear stop it for a while, not for good
# (no step drafts, so none would measure d again).
DRAFT_COST_DECAY = 0.9
# A step's residual (measured minus predicted seconds) enters the fit clipped to this share of
# the predicted step (at least STEP_NOISE_S): a stall of the machine moves the fit by a bounded
# amount, while a real change of cost still shows in every step that follows.
RESIDUAL_CLIP = 0.5


class StepCost:
    """Seconds per step: ``profile(tokens) + a + b * tokens + c * trees + d * drafted`` (trees:
    requests with a branching tree in the step; drafted: 1 when any request has drafts, what
    verifying costs beyond the tokens whatever their number: vLLM's rejection sampler instead of
    its sampler, the step plan, the calibration's bookkeeping)."""

    def __init__(self, sizes, seconds, forget: float = 0.998) -> None:
        """sizes / seconds: the start-up profile as ``profile_seconds`` made it (its dips are
        the ones every round agreed on), interpolated as given."""
        sizes = np.asarray(sizes, dtype=np.float64)
        seconds = np.asarray(seconds, dtype=np.float64)
        if sizes.ndim != 1 or sizes.size < 2 or np.any(np.diff(sizes) <= 0) or seconds.shape != sizes.shape:
            raise ValueError("StepCost needs at least two increasing profile sizes")
        self.sizes, self.seconds = sizes, seconds
        # beyond the profile: the slope of its last two points
        self.tail_slope = max(0.0, (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]))
        self.theta = np.zeros(3)
        # prior: 0 +- PRIOR_STD_S; the trace never grows past the prior's (forgetting inflates
        # directions the steps do not vary in, e.g. d while every step drafts)
        self.cov = np.diag((np.asarray(PRIOR_STD_S) / STEP_NOISE_S) ** 2)
        self._max_trace = float(np.trace(self.cov))
        self.forget = forget
        self.per_tree = 0.0  # c: running mean of measured tree seconds per tree request
        self.tree_weight = 0.0
        self.agreed = np.zeros(4)  # a, b, c, d as decisions use them
        self.observed = 0
        self.tree_steps = 0  # steps with a branching tree seen (the first TREE_WARMUP_STEPS untimed)
        self._tree_timed = False  # a tree step timed since the last agreement
        self._draft_timed = False  # a drafting step timed since the last agreement
        self._break_even: dict[tuple[int, int, int], float] = {}  # break_even() per agreement

    def profile(self, tokens: np.ndarray | torch.Tensor):
        t = tokens.double().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens, np.float64)
        inside = np.interp(t, self.sizes, self.seconds)
        return np.where(t > self.sizes[-1], self.seconds[-1] + (t - self.sizes[-1]) * self.tail_slope, inside)

    def __call__(self, tokens, trees=0, drafted=0) -> np.ndarray:
        """Predicted seconds for steps of ``tokens`` with ``trees`` branching requests, drafted
        (1) or not (0) (arrays or scalars), with the agreed parameters."""
        t = np.asarray(tokens, dtype=np.float64)
        a, b, c, d = self.agreed
        extra = c * np.asarray(trees, dtype=np.float64) + d * np.asarray(drafted, dtype=np.float64)
        return np.maximum(self.profile(t) + a + b * t + extra, 1e-6)

    def observe(self, tokens: int, trees: int, tree_seconds: float, seconds: float, drafted: bool = False) -> None:
        """One measured step of ``seconds``, ``tree_seconds`` of them on its ``trees`` branching
        requests, ``drafted`` when any request had drafts (recursive least squares with
        forgetting on the rest)."""
        if trees > 0:
            self.tree_steps += 1
            if self.tree_steps <= TREE_WARMUP_STEPS:
                return
            self._tree_timed = True
            w = self.forget * self.tree_weight
            self.per_tree = (w * self.per_tree + tree_seconds) / (w + trees)
            self.tree_weight = w + trees
        self._draft_timed |= bool(drafted)
        x = np.array([1.0, float(tokens), float(drafted)])
        profile = float(self.profile(np.array([tokens]))[0])
        y = seconds - tree_seconds - profile
        predicted = x @ self.theta
        limit = RESIDUAL_CLIP * max(profile + predicted, STEP_NOISE_S)
        px = self.cov @ x
        gain = px / (self.forget + x @ px)
        self.theta = self.theta + gain * float(np.clip(y - predicted, -limit, limit))
        self.cov = (self.cov - np.outer(gain, px)) / self.forget
        trace = float(np.trace(self.cov))
        if trace > self._max_trace:
            self.cov *= self._max_trace / trace
        self.observed += 1

    def agree(self, all_reduce_mean: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Make the current fit the one decisions use (averaged over ranks when given). A token
        or a drafting step never costs less than nothing: b and d are kept >= 0. Without a timed
        tree step since the last agreement the per-tree cost decays (``TREE_COST_DECAY``),
        without a timed drafting step the drafting-step cost (``DRAFT_COST_DECAY``); every rank
        verified the same steps, so every rank decays alike."""
        if not self._tree_timed:
            self.per_tree *= TREE_COST_DECAY
        if not self._draft_timed:
            self.theta[2] *= DRAFT_COST_DECAY
        self._tree_timed = self._draft_timed = False
        params = np.array([self.theta[0], max(self.theta[1], 0.0), self.per_tree, max(self.theta[2], 0.0)])
        if all_reduce_mean is not None:
            params = all_reduce_mean(params)
        self.agreed = np.asarray(params, dtype=np.float64).copy()
        self._break_even.clear()


def break_even(cost: Callable, num_decoding: int, base_tokens: int, max_nodes: int) -> float:
    """The survival below which no set of nodes pays: nodes each surviving with probability
    at most s raise R + B * s over cost(base + B) no higher than plain decoding's R / cost(base)
    for every B in 1..max_nodes when s <= min over B of R * (cost(base + B) / cost(base) - 1) / B
    (trees only add cost; cost(base + B) is a drafting step's, cost(base) a plain one's). Cached
    per agreement by a ``StepCost``."""
    key = (num_decoding, base_tokens, max_nodes)
    cache = getattr(cost, "_break_even", None)
    if cache is not None and key in cache:
        return cache[key]
    sizes = np.arange(1, max_nodes + 1, dtype=np.float64)
    seconds = cost(base_tokens + np.concatenate([[0.0], sizes]), 0, np.concatenate([[0.0], np.ones(max_nodes)]))
    value = float(np.min(num_decoding * (seconds[1:] / seconds[0] - 1.0) / sizes)) if max_nodes else math.inf
    if cache is not None:
        cache[key] = value
    return value


def profile_seconds(sizes: list[int], runs: dict[int, list[float]]) -> np.ndarray:
    """A start-up profile from its timed runs: each size's median, except that a size measured
    cheaper than a smaller one (a dip) keeps its median only when it was the faster of the two
    in at least ``DIP_AGREEMENT`` of their paired rounds; otherwise it takes the smaller size's
    value (sizes timed once are made monotone). A dip kept on one noisy round makes the budget
    send drafts as if they were free (docs/design.md, "Constants")."""
    seconds = np.array([np.median(runs[n]) for n in sizes], dtype=np.float64)
    top = 0  # the size holding the largest value so far
    for i in range(1, len(sizes)):
        if seconds[i] >= seconds[top]:
            top = i
            continue
        here, there = np.asarray(runs[sizes[i]]), np.asarray(runs[sizes[top]])
        if here.size != there.size or here.size < 2 or np.mean(here < there) < DIP_AGREEMENT:
            seconds[i] = seconds[top]
    return seconds


def profile_sizes(max_tokens: int) -> list[int]:
    """Token counts a start-up profile measures: dense at small sizes, then x1.5 steps."""
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n = n + 1 if n < 4 else int(math.ceil(n * 1.5))
    sizes.append(max_tokens)
    return sizes
