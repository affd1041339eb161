"""The budget's cost model: what a step costs on this hardware at this batch.

``StepCost``: seconds per step as a function of the tokens in it: a start-up profile of
the forward pass (``profile``, not made monotone up to ``EXACT_PROFILE_TOKENS`` where its
rounds agree on a dip), plus ``a + b * tokens + d * drafted`` fitted online by
recursive least squares on measured step times (sampling, the matrix update, scheduling; d:
what a step with any drafts costs beyond its tokens, the verification path), plus ``c`` per
request with a branching tree and ``e`` per chain of those trees beyond one per tree: tree
attention and path choice, timed where they run (the step's tree seconds, which a regression
on the step's whole time could not separate from the tokens they come with) and fitted to
``c * trees + e * extra_chains`` by weighted least squares with forgetting. On the CPU a tree
is computed as its chains (``cpu_attention.PathPlan``: a copy and a kernel row per chain, a
call per wave), so a bushy tree costs more than a deep one of as many nodes; ``e`` counts only
where it stands clear of the fit's noise, so where chains cost nothing (the GPU's one kernel
call) it is 0 and decisions are those without it. The first tree steps are not
timed, and both terms decay while no tree is verified, so one dear measurement cannot keep
trees out for good; ``d`` decays alike while no step drafts, and each step's residual is
clipped, so a few slow steps cannot stop drafting for good.
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
# Each agreement without a timed tree step multiplies the per-tree and per-chain costs by this,
# so a cost learnt when trees were dear is retried now and then (one tree step) instead of never.
TREE_COST_DECAY = 0.9
# The tree fit's prior on the per-chain cost e: a pseudo-observation at 0 of this weight (the
# fit's units: extra chains^2 per tree request), so e stays 0 until steps vary their chains
# apart from their trees, and a first tree step is put on c alone.
CHAIN_PRIOR = 1.0
# e is used only where it stands this many standard errors above 0 (else 0, and c is fitted
# alone): where chains cost nothing (a GPU's one kernel call) the fit's noise would otherwise
# give e a small positive value half the time, and the budget would weigh shapes for nothing.
CHAIN_SIGNIFICANCE = 2.0
# The same for the drafting-step cost d: without a timed drafting step since the last agreement
# it decays, so a few slow steps that made drafting look dear stop it for a while, not for good
# (no step drafts, so none would measure d again).
DRAFT_COST_DECAY = 0.9
# A step's residual (measured minus predicted seconds) enters the fit clipped to this share of
# the predicted step (at least STEP_NOISE_S): a stall of the machine moves the fit by a bounded
# amount, while a real change of cost still shows in every step that follows.
RESIDUAL_CLIP = 0.5


class StepCost:
    """Seconds per step: ``profile(tokens) + a + b * tokens + c * trees + d * drafted + e *
    extra_chains`` (trees: requests with a branching tree in the step; drafted: 1 when any
    request has drafts, what verifying costs beyond the tokens whatever their number: vLLM's
    rejection sampler instead of its sampler, the step plan, the calibration's bookkeeping;
    extra_chains: the trees' chains beyond one per tree, ``TreeStep.extra_chains``).

    ``agreed`` holds a, b, c, d and ``chain_seconds`` e, as decisions use them."""

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
        # the tree fit, tree_seconds ~ c * trees + e * extra_chains weighted by 1 / trees
        # (without extra chains, c is the tree seconds per tree request): forgotten sums of
        # x x^T / trees [2, 2], x * tree_seconds / trees [2] and tree_seconds^2 / trees, x =
        # (trees, extra_chains), and the forgotten count of timed tree steps
        self._tree_xx = np.zeros((2, 2))
        self._tree_xy = np.zeros(2)
        self._tree_yy = 0.0
        self._tree_n = 0.0
        self.agreed = np.zeros(4)  # a, b, c, d as decisions use them
        self.chain_seconds = 0.0  # e as decisions use it (``budget.admit`` reads it)
        self.observed = 0
        self.tree_steps = 0  # steps with a branching tree seen (the first TREE_WARMUP_STEPS untimed)
        self._tree_timed = False  # a tree step timed since the last agreement
        self._draft_timed = False  # a drafting step timed since the last agreement
        self._break_even: dict[tuple[int, int, int], float] = {}  # break_even() per agreement

    def profile(self, tokens: np.ndarray | torch.Tensor):
        t = tokens.double().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens, np.float64)
        inside = np.interp(t, self.sizes, self.seconds)
        return np.where(t > self.sizes[-1], self.seconds[-1] + (t - self.sizes[-1]) * self.tail_slope, inside)

    def __call__(self, tokens, trees=0, drafted=0, extra_chains=0) -> np.ndarray:
        """Predicted seconds for steps of ``tokens`` with ``trees`` branching requests, drafted
        (1) or not (0), and ``extra_chains`` chains of their trees beyond one per tree (arrays or
        scalars), with the agreed parameters."""
        t = np.asarray(tokens, dtype=np.float64)
        a, b, c, d = self.agreed
        extra = c * np.asarray(trees, dtype=np.float64) + d * np.asarray(drafted, dtype=np.float64)
        if self.chain_seconds:
            extra = extra + self.chain_seconds * np.asarray(extra_chains, dtype=np.float64)
        return np.maximum(self.profile(t) + a + b * t + extra, 1e-6)

    def observe(self, tokens: int, trees: int, tree_seconds: float, seconds: float, drafted: bool = False,
                extra_chains: int = 0) -> None:
        """One measured step of ``seconds``, ``tree_seconds`` of them on its ``trees`` branching
        requests, whose trees have ``extra_chains`` chains beyond one each, ``drafted`` when any
        request had drafts (recursive least squares with forgetting on the rest)."""
        if trees > 0:
            self.tree_steps += 1
            if self.tree_steps <= TREE_WARMUP_STEPS:
                return
            self._tree_timed = True
            x = np.array([float(trees), float(extra_chains)])
            self._tree_xx = self.forget * self._tree_xx + np.outer(x, x) / trees
            self._tree_xy = self.forget * self._tree_xy + x * (tree_seconds / trees)
            self._tree_yy = self.forget * self._tree_yy + tree_seconds * tree_seconds / trees
            self._tree_n = self.forget * self._tree_n + 1.0
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

    def tree_fit(self) -> tuple[float, float]:
        """(c, e): seconds per tree request and per extra chain, the weighted least squares of
        the timed tree steps with ``CHAIN_PRIOR`` on e, neither below 0. e counts only where it
        stands ``CHAIN_SIGNIFICANCE`` standard errors above 0; else it is 0 and c is fitted
        alone (with extra_chains always 0: the tree seconds per tree request)."""
        xx, xy = self._tree_xx, self._tree_xy
        if xx[0, 0] <= 0.0:
            return 0.0, 0.0
        alone = (max(float(xy[0] / xx[0, 0]), 0.0), 0.0)
        if self._tree_n <= 2.0:
            return alone
        inverse = np.linalg.inv(xx + np.diag([0.0, CHAIN_PRIOR]))  # the prior makes it invertible
        c, e = theta = inverse @ xy
        residual = max(self._tree_yy - 2.0 * theta @ xy + theta @ xx @ theta, 0.0)
        error = math.sqrt(residual / (self._tree_n - 2.0) * inverse[1, 1])
        if e <= CHAIN_SIGNIFICANCE * error:
            return alone
        return (float(c), float(e)) if c >= 0.0 else (0.0, float(xy[1] / (xx[1, 1] + CHAIN_PRIOR)))

    def agree(self, all_reduce_mean: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Make the current fit the one decisions use (averaged over ranks when given). A token
        or a drafting step never costs less than nothing: b and d are kept >= 0. Without a timed
        tree step since the last agreement the per-tree and per-chain costs decay
        (``TREE_COST_DECAY``), without a timed drafting step the drafting-step cost
        (``DRAFT_COST_DECAY``); every rank verified the same steps, so every rank decays alike."""
        if not self._tree_timed:
            self._tree_xy *= TREE_COST_DECAY  # c and e scale with it, their errors alike
            self._tree_yy *= TREE_COST_DECAY ** 2
        if not self._draft_timed:
            self.theta[2] *= DRAFT_COST_DECAY
        self._tree_timed = self._draft_timed = False
        c, e = self.tree_fit()
        params = np.array([self.theta[0], max(self.theta[1], 0.0), c, max(self.theta[2], 0.0), e])
        if all_reduce_mean is not None:
            params = all_reduce_mean(params)
        params = np.asarray(params, dtype=np.float64)
        self.agreed = params[:4].copy()
        self.chain_seconds = float(params[4])
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
