"""The adaptive budget (``vllm_recycling.budget``, ``vllm_recycling.cost_model``): admissions on crafted survivals and costs,
exactly; the calibration and the cost model."""

import numpy as np
import pytest
import torch

from vllm_recycling.budget import (
    FORGET,
    PRIOR_SCALE,
    PRIOR_TRIALS,
    REQUEST_PRIOR,
    Calibration,
    RequestFit,
    TreeShape,
    admit,
    chain_nodes,
    confidence_bins,
    monotone,
    nothing_pays,
)
from vllm_recycling.cost_model import PRIOR_STD_S, STEP_NOISE_S, StepCost, break_even, profile_seconds, profile_sizes
from vllm_recycling.tree import compile_tree, load_tree


def linear(per_token: float, per_tree: float = 0.0, per_drafting_step: float = 0.0):
    def cost(tokens, trees, drafted=0):
        return (1.0 + per_token * np.asarray(tokens, dtype=np.float64) + per_tree * np.asarray(trees)
                + per_drafting_step * np.asarray(drafted, dtype=np.float64))

    return cost


# nodes 1 (rank 0, depth 1), 2 (rank 1, depth 1), 3 (rank 0 under 1): the rank-0 chain is 1, 3
CHAIN = torch.tensor([True, False, True])
SURVIVAL = torch.tensor([[0.9, 0.5, 0.45]])


def test_chain_nodes_of_a_template():
    tree = compile_tree([[0], [1], [0, 0]], topk=2)
    assert chain_nodes(tree.parent, tree.rank).tolist() == CHAIN.tolist()
    tree = load_tree("2.2.2", 8)
    chain = chain_nodes(tree.parent, tree.rank)
    assert int(chain.sum()) == tree.max_depth
    assert (tree.depth[1:][chain] == torch.arange(1, tree.max_depth + 1)).all()


def test_whole_tree_when_tokens_are_cheap():
    # tree plan: gains 0 .9 1.4 1.85 over costs 1.1 1.2 1.3 1.4 -> B = 3 (2.85 / 1.4)
    got = admit(SURVIVAL, CHAIN, num_decoding=1, base_tokens=1, cost=linear(0.1))
    assert got.mask.tolist() == [[True, True, True]] and got.trees == 1 and got.num_admitted == 3
    assert got.expected == pytest.approx(2.85) and got.seconds == pytest.approx(1.4)


def test_chain_when_tree_attention_costs_more_than_it_brings():
    # chain plan: nodes 1 and 3, 2.35 / 1.3 = 1.808; the tree plan pays 0.5: at best 2.85 / 1.9
    got = admit(SURVIVAL, CHAIN, num_decoding=1, base_tokens=1, cost=linear(0.1, per_tree=0.5))
    assert got.mask.tolist() == [[True, False, True]] and got.trees == 0 and got.num_admitted == 2
    assert got.expected == pytest.approx(2.35)


def test_nothing_when_every_draft_costs_more_than_it_brings():
    got = admit(SURVIVAL, CHAIN, num_decoding=1, base_tokens=1, cost=linear(10.0))
    assert not got.mask.any() and got.num_admitted == 0 and got.trees == 0
    assert got.expected == 1.0 and got.seconds == pytest.approx(11.0)


def test_break_even_of_a_linear_cost_and_a_staircase():
    # 1 + 0.1 t: a node pays when R * 0.1 / (1 + 0.1 * base) < its survival; base 1: 1 / 11
    assert break_even(linear(0.1), 1, 1, 3) == pytest.approx(0.1 / 1.1)
    assert break_even(linear(0.1), 4, 4, 10) == pytest.approx(0.4 / 1.4)
    assert nothing_pays(0.09, linear(0.1), 1, 1, 3) and not nothing_pays(0.091, linear(0.1), 1, 1, 3)

    def stairs(tokens, trees, drafted=0):  # 2 tokens cost as much as 1 more, 3 and 4 nothing more than 2
        return np.array([{1: 1.0, 2: 1.3, 3: 1.3, 4: 1.3}.get(int(t), 9.0) for t in np.atleast_1d(tokens)])

    # B = 3 at 0.3 / 3 = 0.1 is the cheapest per node, lower than B = 1 (0.3)
    assert break_even(stairs, 1, 1, 3) == pytest.approx(0.1)
    survival = torch.tensor([[0.11, 0.11, 0.11]])  # each node alone does not pay, three do
    assert not nothing_pays(0.11, stairs, 1, 1, 3)
    assert admit(survival, torch.tensor([True, True, True]), 1, 1, stairs).num_admitted == 3
    assert nothing_pays(0.0999, stairs, 1, 1, 3)


def test_nothing_pays_agrees_with_the_full_admission(monkeypatch):
    import vllm_recycling.budget as budget

    tree = load_tree("2.2.2", 8)
    chain = chain_nodes(tree.parent, tree.rank)
    cal = Calibration()
    g = torch.Generator().manual_seed(1)
    for per_token in (0.001, 0.01, 0.03, 0.1, 0.3):
        for batch in (1, 3, 8):
            conf = (torch.rand((batch, tree.num_nodes + 1), generator=g) ** 3).numpy()
            survival = cal.survival(conf, tree.parent.clamp(min=0).numpy(), tree.level_starts)[:, 1:]
            cost = linear(per_token, per_tree=0.01)
            quick = nothing_pays(float(survival.max()), cost, batch, batch, survival.size)
            with monkeypatch.context() as m:
                m.setattr(budget, "nothing_pays", lambda *a: False)
                full = admit(survival, chain, batch, batch, cost)
            if quick:
                assert full.num_admitted == 0
            assert admit(survival, chain, batch, batch, cost).mask.tolist() == full.mask.tolist()


def test_step_cost_caches_break_even_until_the_next_agreement():
    cost = StepCost([1, 2, 4], [1.0, 1.1, 1.2])
    cost.agree()
    first = break_even(cost, 1, 1, 3)
    assert first == pytest.approx(0.2 / 3)  # B = 1: 0.1, B = 2: 0.15 / 2, B = 3: 0.2 / 3
    cost.theta = np.array([0.0, 1.0, 0.0])  # a dear token, not agreed yet: the cached value stays
    assert break_even(cost, 1, 1, 3) == first
    cost.agree()
    assert break_even(cost, 1, 1, 3) > first


def test_ties_go_to_the_earlier_request_and_the_parent():
    def cost(tokens, trees, drafted=0):  # a second draft token costs too much
        return np.array([{2: 1.2, 3: 1.3}.get(int(t), 2.0) for t in np.atleast_1d(tokens)])

    survival = torch.tensor([[0.5], [0.5]])
    got = admit(survival, torch.tensor([True]), num_decoding=2, base_tokens=2, cost=cost)
    assert got.mask.tolist() == [[True], [False]]
    # one request, a node and its child equally likely: the parent first
    def cost1(tokens, trees, drafted=0):
        return np.array([{1: 1.0, 2: 1.1}.get(int(t), 5.0) for t in np.atleast_1d(tokens)])

    got = admit(torch.tensor([[0.5, 0.5]]), torch.tensor([True, True]), 1, 1, cost1)
    assert got.mask.tolist() == [[True, False]]


def test_admitted_set_is_ancestor_closed_per_request():
    tree = load_tree("2.2.2", 8)
    cal = Calibration()
    torch.manual_seed(0)
    conf = torch.rand(5, tree.num_nodes + 1).numpy()
    survival = torch.from_numpy(cal.survival(conf, tree.parent.clamp(min=0).numpy(), tree.level_starts))
    chain = chain_nodes(tree.parent, tree.rank)
    parent = tree.parent.clamp(min=0)
    for per_token in (0.001, 0.01, 0.05):
        got = admit(survival[:, 1:], chain, 5, 5, linear(per_token))
        full = torch.cat([torch.ones(5, 1, dtype=torch.bool), torch.from_numpy(got.mask)], dim=1)
        assert full[:, parent].ge(full).all()  # every admitted node's parent is admitted
        assert got.num_admitted == int(got.mask.sum())


def test_survival_is_the_product_along_the_path():
    cal = Calibration()
    cal.rates = np.full(2 * cal.num_bins, 0.5, dtype=np.float32)
    cal.rates[0] = 0.1
    cal.rates[cal.num_bins:] = 0.4  # edges below the first level: the second table
    # root, 1 and 2 under the root, 3 under 1
    parent = np.array([0, 0, 0, 1])
    conf = np.array([[1.0, 0.9, 0.0, 0.9]], dtype=np.float32)
    survival = cal.survival(conf, parent, (0, 1, 3, 4))
    assert survival[0].tolist() == pytest.approx([1.0, 0.5, 0.1, 0.2])
    assert cal.bins(np.array([0.9, 0.9]), np.array([0, 1])).tolist() == [15, 31]


def test_each_requests_factor_scales_its_edges_never_above_one():
    """A request that accepted more edges than the calibration expected gets every edge scaled
    up by (hits + prior) / (expected + prior), one that accepted fewer scaled down, one that
    tried nothing keeps the calibration's; no edge goes above 1."""
    fit = RequestFit()
    fit.observe("copying", accepted=6, expected=2.0)
    fit.observe("copying", accepted=2, expected=2.0)  # steps add up
    fit.observe("prose", accepted=0, expected=4.0)
    up, down = (8 + REQUEST_PRIOR) / (4 + REQUEST_PRIOR), REQUEST_PRIOR / (4 + REQUEST_PRIOR)
    assert fit.scale(["copying", "prose", "new"]).tolist() == pytest.approx([up, down, 1.0])
    cal = Calibration()
    cal.rates = np.full(2 * cal.num_bins, 0.5, dtype=np.float32)
    cal.rates[cal.num_bins:] = 0.8
    parent = np.array([0, 0, 1])
    conf = np.array([[1.0, 0.9, 0.9]] * 3, dtype=np.float32)
    survival = cal.survival(conf, parent, (0, 1, 2, 3), fit.scale(["copying", "prose", "new"]))
    assert survival[:, 1].tolist() == pytest.approx([0.5 * up, 0.5 * down, 0.5])
    assert survival[:, 2].tolist() == pytest.approx([0.5 * up * min(1.0, 0.8 * up), 0.5 * down * 0.8 * down, 0.4])
    fit.keep({"prose"})  # the others finished
    assert fit.scale(["copying", "prose"]).tolist() == pytest.approx([1.0, down])


def test_prior_rows_are_calibrated_in_their_own_tables():
    """A row the model's prior filled carries its confidences negated: its edges fall in the
    third (from the root) and fourth (deeper) tables, learnt apart from verified rows."""
    cal = Calibration()
    n = cal.num_bins
    assert cal.bins(np.array([-0.9, -0.9, -0.0, 0.9]), np.array([0, 1, 0, 0])).tolist() == [3 * n - 1, 4 * n - 1, 0, n - 1]
    assert cal.bins(np.array([-0.25, 0.25]), np.array([1, 1])).tolist() == [3 * n + 8, n + 8]
    verified, prior = float(cal.rates[n - 1]), float(cal.rates[3 * n - 1])
    cal.observe(np.array([3 * n - 1] * 50), np.zeros(50, dtype=bool))  # prior rows never accepted
    assert cal.rates[3 * n - 1] < prior / 4 and cal.rates[n - 1] == verified
    rates = np.full_like(cal.rates, 0.5)
    rates[2 * n : 3 * n] = 0.1
    cal.rates = rates
    parent = np.array([0, 0, 1])
    survival = cal.survival(np.array([[1.0, -0.9, 0.9]], dtype=np.float32), parent, (0, 1, 2, 3))
    assert survival[0].tolist() == pytest.approx([1.0, 0.1, 0.05])


def test_monotone_pools_adjacent_violators():
    rates = np.array([0.0, 0.3, 0.1, 0.2, 0.5, 0.4])
    weights = np.array([1.0, 1.0, 1.0, 2.0, 3.0, 1.0])
    # 0.3 > 0.1 pooled (0.2), then equal to 0.2: fine; 0.5 > 0.4 pooled by weight: 1.9 / 4
    assert monotone(rates, weights).tolist() == pytest.approx([0.0, 0.2, 0.2, 0.2, 0.475, 0.475])
    assert monotone(np.array([0.1, 0.2]), np.ones(2)).tolist() == pytest.approx([0.1, 0.2])


def test_calibration_table_never_falls_with_confidence():
    """A bin that read lucky (few trials, all hits) is pooled with the confident bins above it
    instead of outranking them."""
    cal = Calibration()
    cal.observe(np.array([9] * 6), np.ones(6, dtype=bool))  # bin 9: 6 hits in 6 + the prior
    table = cal.rates.copy()
    assert all(np.all(np.diff(table[t * 16 : (t + 1) * 16]) >= 0) for t in range(4))  # each table
    raw = (cal.hits + cal.prior_hits) / (cal.trials + cal.prior_trials)
    assert raw[9] > raw[10] and table[9] == pytest.approx(table[15]) and table[9] < raw[9]
    # the top bin of each matrix table, and any context bin
    assert cal.max_edge == pytest.approx(float(max(table[15:64:16].max(), table[64:].max())))
    cal.observe(np.array([31] * 40), np.ones(40, dtype=bool))  # deeper edges: their own table
    # (bin 15 moves only by what forgetting takes from bin 9, pooled with it)
    assert cal.max_edge == pytest.approx(float(cal.rates[31]), rel=1e-6) and cal.rates[15] == pytest.approx(table[15], abs=1e-3)


def test_profile_keeps_a_dip_only_when_every_round_agrees():
    sizes = [1, 2, 3, 4]
    runs = {
        1: [0.050, 0.060, 0.058, 0.052, 0.061],
        2: [0.045, 0.062, 0.047, 0.055, 0.046],  # median below 1 token, but slower in 2 rounds
        3: [0.048, 0.058, 0.050, 0.050, 0.059],  # faster than 1 token in every round
        4: [0.065, 0.066, 0.064, 0.067, 0.066],
    }
    got = profile_seconds(sizes, runs)
    assert got.tolist() == pytest.approx([0.058, 0.058, 0.050, 0.066])
    assert profile_seconds([1, 2], {1: [0.05], 2: [0.04]}).tolist() == pytest.approx([0.05, 0.05])


def test_calibration_learns_per_bin():
    cal = Calibration()
    bins = confidence_bins(np.array([0.0, 0.25, 0.25, 1.0]))
    assert bins.tolist() == [0, 8, 8, 15]
    assert confidence_bins(torch.tensor([0.0, 0.25, 1.0])).tolist() == [0, 8, 15]
    before = float(cal.rates[8])
    cal.observe(bins[1:3], np.array([True, True]))
    center = ((8 + 0.5) / 16) ** 2
    assert cal.trials[8] == 2 and cal.hits[8] == 2
    raw = (cal.hits[8] + cal.prior_hits[8]) / (cal.trials[8] + cal.prior_trials[8])
    assert raw == pytest.approx((PRIOR_SCALE[0] * center * PRIOR_TRIALS + 2) / (PRIOR_TRIALS + 2))
    assert float(cal.rates[8]) > before
    cal.observe(np.array([8] * 40), np.zeros(40, dtype=bool))
    assert float(cal.rates[8]) < before


def test_calibration_forgets_back_to_its_prior():
    """Each step that teaches the calibration forgets a share of what it learnt before; a bin
    no longer tried returns to its prior instead of keeping another traffic's rate."""
    cal = Calibration()
    prior = cal.rates.copy()
    cal.observe(np.array([9] * 100), np.ones(100, dtype=bool))
    assert float(cal.rates[9]) > 0.8  # pooled with the confident bins above it
    for _ in range(2000):  # steps that try only bin 0, never accepted
        cal.observe(np.array([0]), np.array([False]))
    assert cal.trials[9] == pytest.approx(100 * FORGET**2000) and cal.hits[9] == cal.trials[9]
    assert cal.trials[0] == pytest.approx((1 - FORGET**2000) / (1 - FORGET))
    assert float(cal.rates[9]) == pytest.approx(float(prior[9]), abs=2e-3)
    assert cal.rates[16:].tolist() == prior[16:].tolist()  # the other tables were never tried


def test_step_cost_profile_and_online_fit():
    # the profile as given (4 tokens cheaper than 2: a dip profile_seconds kept)
    cost = StepCost([1, 2, 4, 8], [1.0, 1.2, 1.1, 2.0])
    assert cost.profile(np.array([1, 3, 4, 6, 8, 10])).tolist() == pytest.approx(
        [1.0, 1.15, 1.1, 1.55, 2.0, 2.45])  # beyond the profile: the last slope, 0.9 / 4 per token
    assert cost(np.array([4]), 1).tolist() == pytest.approx([1.1])  # nothing learnt yet
    rng = np.random.default_rng(0)
    for _ in range(3000):
        t, trees, drafted = int(rng.integers(1, 40)), int(rng.integers(0, 3)), bool(rng.integers(0, 2))
        tree_s = 0.3 * trees
        seconds = float(cost.profile(np.array([t]))[0]) + 0.5 + 0.01 * t + tree_s + 0.02 * drafted
        cost.observe(t, trees, tree_s, seconds, drafted=drafted)
    assert cost.observed == 3000 - 2  # the first TREE_WARMUP_STEPS tree steps are not timed
    assert cost(np.array([4]), 1).tolist() == pytest.approx([1.1])  # not agreed yet
    cost.agree()
    assert cost.agreed == pytest.approx([0.5, 0.01, 0.3, 0.02], abs=1e-5)
    assert cost(np.array([4, 4]), 1, np.array([0, 1])).tolist() == pytest.approx(
        [1.1 + 0.54 + 0.3, 1.1 + 0.56 + 0.3], abs=1e-4)
    cost.agree(lambda params: params * 0 + 1.0)  # what the ranks agree on is what decides
    assert cost(np.array([2]), 1).tolist() == pytest.approx([1.2 + 1 + 2 + 1])
    cost.theta[1] = cost.theta[2] = -0.5
    cost.agree()
    assert cost.agreed[1] == 0.0 and cost.agreed[3] == 0.0  # never a negative cost


def test_step_cost_stays_bounded_when_every_step_drafts():
    # every step drafts: d and a cannot be told apart; forgetting must not blow the fit up
    cost = StepCost([1, 64], [0.01, 0.05])
    for i in range(20000):
        t = 2 + i % 3
        cost.observe(t, 0, 0.0, float(cost.profile(np.array([t]))[0]) + 0.004 + 0.001 * t, drafted=True)
    cost.agree()
    prior_trace = float(np.sum((np.asarray(PRIOR_STD_S) / STEP_NOISE_S) ** 2))
    assert np.trace(cost.cov) <= prior_trace * (1 + 1e-9) and np.isfinite(cost.theta).all()
    assert float(cost(3, 0, 1)) == pytest.approx(float(cost.profile(np.array([3]))[0]) + 0.007, abs=1e-6)


def test_step_cost_learns_a_drafting_step_from_noisy_steps():
    # steps of 4 requests, a third with 1-5 drafts; a drafting step costs 2 ms beyond its tokens,
    # under 3 ms of noise: within a few hundred steps the fit finds it (a prior given in
    # seconds^2, not in units of the noise, held d at 0 for thousands of steps)
    rng = np.random.default_rng(0)
    cost = StepCost([1, 4, 8, 64], [0.027, 0.025, 0.028, 0.05])
    for _ in range(500):
        drafted = bool(rng.random() < 1 / 3)
        t = 4 + (int(rng.integers(1, 6)) if drafted else 0)
        seconds = float(cost.profile(np.array([t]))[0]) + 0.015 + 0.0003 * t + 0.002 * drafted
        cost.observe(t, 0, 0.0, seconds + rng.normal(0.0, 0.003), drafted=drafted)
    cost.agree()
    a, b, _, d = cost.agreed
    assert 0.001 < d < 0.003
    # what decisions compare: a drafting step of 7 tokens against a plain one of 4
    assert float(cost(7, 0, 1) - cost(4, 0, 0)) == pytest.approx(
        float(cost.profile(np.array([7]))[0] - cost.profile(np.array([4]))[0]) + 0.0029, abs=5e-4)


def test_a_drafting_step_cost_keeps_marginal_drafts_out():
    # one request, one node surviving 0.1, tokens at 0.1: pays (1.1 / 1.2 > 1 / 1.1); with 0.05
    # per drafting step it does not (1.1 / 1.25 < 1 / 1.1)
    survival = torch.tensor([[0.1]])
    assert admit(survival, torch.tensor([True]), 1, 1, linear(0.1)).num_admitted == 1
    got = admit(survival, torch.tensor([True]), 1, 1, linear(0.1, per_drafting_step=0.05))
    assert got.num_admitted == 0 and got.seconds == pytest.approx(1.1)
    assert break_even(linear(0.1, per_drafting_step=0.05), 1, 1, 1) == pytest.approx(0.15 / 1.1)


def test_tree_cost_skips_first_tree_steps_and_decays_without_trees():
    from vllm_recycling.cost_model import TREE_COST_DECAY, TREE_WARMUP_STEPS

    cost = StepCost([1, 2], [0.0, 0.0])
    for _ in range(TREE_WARMUP_STEPS):  # first calls of the tree path: dear, not learnt
        cost.observe(3, 1, 30.0, 31.0)
    cost.agree()
    assert cost.agreed[2] == 0.0 and cost.observed == 0
    cost.observe(3, 1, 0.008, 0.04)
    cost.agree()
    assert cost.agreed[2] == pytest.approx(0.008)
    cost.agree()  # no tree step since the last agreement: the term decays
    cost.agree()
    assert cost.agreed[2] == pytest.approx(0.008 * TREE_COST_DECAY ** 2)
    cost.observe(3, 2, 0.02, 0.06)  # 0.01 per tree, averaged with the decayed 0.00648
    cost.agree()
    assert 0.00648 < cost.agreed[2] < 0.01


def test_tree_term_counts_requests_off_their_chain():
    # two requests; request 0's rank-1 node (0.5) is worth it when a tree costs 0.05, and then
    # request 1's too: two trees
    survival = torch.tensor([[0.9, 0.5, 0.45], [0.9, 0.5, 0.45]])
    got = admit(survival, CHAIN, 2, 2, linear(0.01, per_tree=0.05))
    assert got.trees == 2 and got.num_admitted == 6
    # a tree costs 0.3 per request: chains only
    got = admit(survival, CHAIN, 2, 2, linear(0.01, per_tree=0.3))
    assert got.trees == 0 and got.mask.tolist() == [[True, False, True]] * 2


def test_drafts_where_more_tokens_cost_less():
    # one request; 2 tokens dearer than 1, 4 tokens cheaper (measured on 2 CPU cores): even
    # nodes that are never accepted are worth sending, three of them, never one
    cost = StepCost([1, 2, 3, 4, 8], [0.027, 0.029, 0.025, 0.0245, 0.028])
    cost.agree()
    survival = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    got = admit(survival, torch.tensor([True, True, True, True]), 1, 1, cost)
    assert got.num_admitted == 3 and got.seconds == pytest.approx(0.0245)
    assert not nothing_pays(0.0, cost, 1, 1, 4)


def test_step_cost_needs_two_sizes():
    with pytest.raises(ValueError, match="two increasing"):
        StepCost([1], [1.0])


def test_profile_sizes():
    assert profile_sizes(2) == [1, 2]
    assert profile_sizes(20) == [1, 2, 3, 4, 6, 9, 14, 20]



def drafting_steps_after_a_stall(stall: int, steps: int) -> list[bool]:
    """Whether each step drafts, with 16 requests decoding, 4 nodes each surviving at most 0.5,
    each step timed into the fit and the fit agreed on as ``AdaptiveBudget.learn`` does: 300
    steps drafting every other step (a drafting step costs 2 ms beyond its tokens), then
    ``stall`` pairs of a drafting step of 2 s (the machine stalled) and a plain step at normal
    speed, then ``steps`` steps at normal speed, drafting where the budget says so."""
    from vllm_recycling.budget import SYNC_STEPS

    cost = StepCost([1, 16, 64, 256], [0.03, 0.06, 0.15, 0.5])
    forced = [i % 2 == 0 for i in range(300)] + [True, False] * stall
    drafts = []
    for i in range(len(forced) + steps):
        drafting = forced[i] if i < len(forced) else not nothing_pays(0.5, cost, 16, 16, 64)
        tokens = 16 + 64 * drafting
        seconds = float(cost.profile(np.array([tokens]))[0]) + 0.01 + 0.002 * drafting
        if i >= 300 and i < len(forced) and drafting:
            seconds = 2.0
        cost.observe(tokens, 0, 0.0, seconds, drafted=drafting)
        drafts.append(drafting)
        n = i + 1
        if n % SYNC_STEPS == 0 or (n < SYNC_STEPS and not n & (n - 1)):
            cost.agree()
    return drafts[len(forced):]


def test_drafting_resumes_after_a_few_slow_steps():
    """A few drafting steps during a stall of the machine make a drafting step look dear; plain
    steps never measure it again, so its cost decays (as the tree term's does) and a stalled
    step moves the fit by a bounded amount: drafting comes back within a few agreements, and
    stays (without either, 20 slow steps stopped drafting for good)."""
    assert all(drafting_steps_after_a_stall(0, 200))
    for stall in (1, 5, 20):
        after = drafting_steps_after_a_stall(stall, 2000)
        assert True in after, f"{stall} slow steps: no drafting in the 2000 steps after them"
        resumed = after.index(True)
        assert resumed <= 10 * 32 and all(after[resumed:]), (stall, resumed)


# -- the tree's shape: chains beyond one per tree ------------------------------------------------
# root -> 1 [0], 2 [1], 3 [2], 4 [3]; 2 -> 5 [1, 0] -> 6 [1, 0, 0]: the rank-0 chain is node 1 alone
SHAPED = [[0], [1], [2], [3], [1, 0], [1, 0, 0]]


def shaped_template():
    tree = compile_tree(SHAPED, topk=4)
    parent = tree.parent.clamp(min=0).numpy()
    return TreeShape.of(parent, tree.level_starts), chain_nodes(tree.parent, tree.rank)


class Priced:
    """``linear`` plus ``chain_seconds`` per chain beyond one per tree (StepCost's e)."""

    def __init__(self, per_token, per_chain, per_tree=0.0, steps=None):
        self.per_token, self.per_tree, self.chain_seconds, self.steps = per_token, per_tree, per_chain, steps

    def __call__(self, tokens, trees, drafted=0, extra_chains=0):
        t = np.asarray(tokens, dtype=np.float64)
        base = (np.array([self.steps.get(int(n), 9.0) for n in np.atleast_1d(t)]) if self.steps
                else 1.0 + self.per_token * t)
        return base + self.per_tree * np.asarray(trees) + self.chain_seconds * np.asarray(extra_chains)


def test_tree_shape_counts_each_nodes_chains():
    shape, _ = shaped_template()
    survival = np.array([[0.9, 0.6, 0.6, 0.6, 0.6, 0.5],   # node 1 leads the root's children
                         [0.5, 0.7, 0.7, 0.1, 0.7, 0.7]])  # node 2 does, ties to the lower index
    extra, head = shape.extra_chains(survival)
    assert extra.tolist() == [[False, True, True, True, False, False], [True, False, True, True, False, False]]
    # columns: node - 1; -1 the root's chain (first children from the root down)
    assert head.tolist() == [[-1, 1, 2, 3, 1, 1], [0, -1, 2, 3, -1, -1]]


def test_bushy_and_deep_trees_of_equal_size_cost_apart_once_chains_cost():
    shape, chain = shaped_template()
    bushy = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.01, 0.01]])  # nodes 1-4: four leaves
    deep = torch.tensor([[0.5, 0.5, 0.01, 0.01, 0.5, 0.5]])   # nodes 1, 2, 5, 6: two leaves
    for per_chain in (0.0, 0.02):
        cost = Priced(0.01, per_chain, per_tree=0.05)
        wide, narrow = admit(bushy, chain, 1, 1, cost, shape), admit(deep, chain, 1, 1, cost, shape)
        assert wide.num_admitted == narrow.num_admitted == 4 and wide.trees == narrow.trees == 1
        assert wide.expected == narrow.expected == pytest.approx(3.0)
        if per_chain:
            assert (wide.extra_chains, narrow.extra_chains) == (3, 1)
            assert wide.seconds - narrow.seconds == pytest.approx(2 * per_chain)
        else:  # no price on chains: the budget is blind to the shape, as before
            assert wide.seconds == narrow.seconds and wide.extra_chains == narrow.extra_chains == 0


def test_at_equal_tokens_the_shape_with_fewer_chains_is_sent():
    # 3 nodes pay, a 4th does not (the staircase); nodes 3 and 5 tie at 0.6: 3 adds a chain, 5
    # (below 2) does not
    shape, chain = shaped_template()
    survival = torch.tensor([[0.9, 0.6, 0.6, 0.1, 0.6, 0.1]])
    steps = {1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2}
    blind = admit(survival, chain, 1, 1, Priced(0.0, 0.0, steps=steps), shape)
    assert blind.mask.tolist() == [[True, True, True, False, False, False]]  # ties by index, as before
    got = admit(survival, chain, 1, 1, Priced(0.0, 0.01, steps=steps), shape)
    assert got.mask.tolist() == [[True, True, False, False, True, False]] and got.extra_chains == 1
    assert got.expected == blind.expected == pytest.approx(3.1)
    assert got.seconds == pytest.approx(1.21)


def test_priced_chains_keep_the_admission_ancestor_closed():
    tree = load_tree("2.2.2", 8)
    parent = tree.parent.clamp(min=0)
    shape, chain = TreeShape.of(parent.numpy(), tree.level_starts), chain_nodes(tree.parent, tree.rank)
    cal = Calibration()
    g = torch.Generator().manual_seed(3)
    counted = []
    for per_chain in (0.0, 0.0005, 0.002, 0.01):
        # survivals from few distinct edge rates (many ties, children as likely as parents)
        conf = torch.randint(0, 3, (6, tree.num_nodes + 1), generator=g).numpy() / 2.0
        survival = cal.survival(conf, parent.numpy(), tree.level_starts)[:, 1:]
        survival = np.where(survival > 0.2, 1.0, survival)
        got = admit(survival, chain, 6, 6, Priced(0.002, per_chain, per_tree=0.01), shape)
        full = np.concatenate([np.ones((6, 1), dtype=bool), got.mask], axis=1)
        assert (full[:, parent.numpy()] >= full).all()  # every admitted node's parent is admitted
        internal = np.zeros_like(full)
        for r in range(6):
            internal[r, parent.numpy()[1:][got.mask[r]]] = True
        leaves = full.sum(axis=1) - internal.sum(axis=1)
        if per_chain:  # what admit priced: the admitted trees' leaves beyond one each
            assert got.extra_chains == int((leaves - 1).sum())
            counted.append(got.extra_chains)
    assert max(counted) > 0


def test_without_a_chain_price_admit_is_unchanged():
    tree = load_tree("2.2.2", 8)
    parent = tree.parent.clamp(min=0)
    shape, chain = TreeShape.of(parent.numpy(), tree.level_starts), chain_nodes(tree.parent, tree.rank)
    cal = Calibration()
    g = torch.Generator().manual_seed(2)
    for per_token in (0.001, 0.01, 0.05):
        conf = (torch.rand((4, tree.num_nodes + 1), generator=g) ** 2).numpy()
        survival = cal.survival(conf, parent.numpy(), tree.level_starts)[:, 1:]
        cost = linear(per_token, per_tree=0.01)
        before, now = admit(survival, chain, 4, 4, cost), admit(survival, chain, 4, 4, cost, shape)
        priced0 = admit(survival, chain, 4, 4, Priced(per_token, 0.0, per_tree=0.01), shape)
        for got in (now, priced0):
            assert got.mask.tolist() == before.mask.tolist() and got.seconds == before.seconds
            assert got.trees == before.trees and got.extra_chains == 0


def tree_steps(cost, per_tree, per_chain, steps=3000, seed=0):
    """Timed drafting steps with 1-8 tree requests and 0-3 extra chains per tree, their tree
    seconds per_tree * trees + per_chain * extra_chains + 0.2 ms of noise."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        trees = int(rng.integers(1, 9))
        extra = int(rng.integers(0, 3 * trees + 1))
        tree_s = per_tree * trees + per_chain * extra + rng.normal(0.0, 2e-4)
        tokens = 16 + 8 * trees
        cost.observe(tokens, trees, tree_s, float(cost.profile(np.array([tokens]))[0]) + 0.01 + tree_s,
                     drafted=True, extra_chains=extra)
    cost.agree()


def test_tree_fit_recovers_a_per_chain_cost():
    cost = StepCost([1, 64, 256], [0.02, 0.04, 0.1])
    tree_steps(cost, 0.002, 0.0005)
    assert cost.agreed[2] == pytest.approx(0.002, rel=0.03)
    assert cost.chain_seconds == pytest.approx(0.0005, rel=0.05)
    small = StepCost([1, 64, 256], [0.02, 0.04, 0.1])  # 0.05 ms a chain, under 0.2 ms of noise a step
    tree_steps(small, 0.002, 0.00005)
    assert small.chain_seconds == pytest.approx(0.00005, rel=0.15)
    # where chains cost nothing (one kernel call whatever the shape) the noise does not make a
    # chain term: it is 0, not below its error, so the budget does not weigh shapes for nothing
    flat = StepCost([1, 64, 256], [0.02, 0.04, 0.1])
    tree_steps(flat, 0.003, 0.0)
    assert flat.agreed[2] == pytest.approx(0.003, rel=0.03) and flat.chain_seconds == 0.0
    # and the cost model prices a step's chains with it
    assert cost(100, 2, 1, 6) - cost(100, 2, 1, 0) == pytest.approx(6 * cost.chain_seconds)
    from vllm_recycling.cost_model import TREE_COST_DECAY

    c, e = cost.agreed[2], cost.chain_seconds
    cost.agree()  # no tree step since: both decay
    assert cost.agreed[2] == pytest.approx(c * TREE_COST_DECAY) and cost.chain_seconds == pytest.approx(
        e * TREE_COST_DECAY)


def test_tree_fit_without_chains_is_the_mean_tree_seconds_per_tree():
    """Steps that never vary their chains: c is the forgotten sum of tree seconds over the
    forgotten sum of tree requests, as before the chain term, and e stays 0."""
    cost = StepCost([1, 2], [0.0, 0.0])
    rng = np.random.default_rng(1)
    mean, weight = 0.0, 0.0
    for i in range(200):
        trees, tree_s = int(rng.integers(1, 5)), float(rng.uniform(0.001, 0.02))
        cost.observe(3, trees, tree_s, 0.05)
        if i >= 2:  # TREE_WARMUP_STEPS
            w = cost.forget * weight
            mean, weight = (w * mean + tree_s) / (w + trees), w + trees
    cost.agree()
    assert cost.agreed[2] == pytest.approx(mean, rel=1e-12) and cost.chain_seconds == 0.0
