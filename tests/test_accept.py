"""The acceptance rule the plugin and the reference decoder share (every row sampled with its
output position's noise, the tree walked by the sampled tokens: ``paths.walk_sampled``,
``tools.accept``), exactly for greedy requests and by its output distribution for sampled ones."""

import math

import pytest
import torch
from engines import biased_walk

from vllm_recycling.kernels.draft_tree import draft_tree as draft_tokens
from vllm_recycling.tools import accept as accept_module
from vllm_recycling.tools.accept import accept_tree, apply_top_k_top_p
from vllm_recycling.tree import compile_tree
from vllm_recycling.tree_step import TreeLayout

# nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
TREE = compile_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], topk=2)
LAYOUT = TreeLayout.from_template(TREE, "cpu")


def _logits(targets: torch.Tensor, vocab: int = 128) -> torch.Tensor:
    """Rows [B * M, V] whose argmax is each node's target token (others below it by id)."""
    rows = -torch.arange(vocab, dtype=torch.float32).repeat(targets.numel(), 1) / vocab
    rows[torch.arange(targets.numel()), targets.reshape(-1)] = 10.0
    return rows


def test_greedy_accepts_the_argmax_chain():
    tokens = torch.tensor([
        [10, 11, 12, 13, 14, 15, 16],
        [10, 11, 12, 13, 14, 15, 16],
        [10, 11, 12, 13, 14, 15, 16],
    ])
    target = torch.tensor([
        [11, 13, 99, 16, 98, 97, 42],  # 11 -> 13 -> 16, bonus 42 (all 3 accepted)
        [12, 14, 15, 77, 78, 79, 80],  # 12 -> 15, bonus 79
        [50, 51, 52, 53, 54, 55, 56],  # nothing; correction 50
    ])
    out = accept_tree(LAYOUT, tokens, _logits(target))
    assert out.num_accepted.tolist() == [3, 2, 0]
    assert out.nodes.tolist() == [[0, 1, 3, 6], [0, 2, 5, -1], [0, -1, -1, -1]]
    assert out.output_tokens.tolist() == [[11, 13, 16, 42], [12, 15, 79, -1], [50, -1, -1, -1]]


def test_duplicate_siblings_the_lower_rank_wins():
    # [0] and [1] both hold 11; only the subtree of [1] would continue to match. The walk takes
    # the child holding the argmax, the lower rank among equals, as the plugin does in vLLM.
    tokens = torch.tensor([[10, 11, 11, 20, 21, 13, 30]])
    target = torch.tensor([[11, 99, 13, 0, 0, 44, 0]])
    out = accept_tree(LAYOUT, tokens, _logits(target))
    assert out.output_tokens.tolist() == [[11, 99, -1, -1]] and out.nodes.tolist() == [[0, 1, -1, -1]]


def test_chain_template_and_one_node_tree():
    chain = TreeLayout.from_template(compile_tree([[0], [0, 0]], topk=1), "cpu")
    tokens = torch.tensor([[5, 6, 7], [5, 6, 7]])
    out = accept_tree(chain, tokens, _logits(torch.tensor([[6, 7, 8], [6, 1, 2]])))
    assert out.output_tokens.tolist() == [[6, 7, 8], [6, 1, -1]]
    one = TreeLayout.from_template(compile_tree([[0]], topk=1), "cpu")
    out = accept_tree(one, torch.tensor([[5, 6], [5, 6]]), _logits(torch.tensor([[6, 7], [1, 2]])))
    assert out.output_tokens.tolist() == [[6, 7], [1, -1]]


def test_top_k_top_p_masks_like_vllm():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    k = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isinf(k).tolist() == [[False, False, False, True], [False, False, False, False]]  # tie kept
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    p = apply_top_k_top_p(logits, None, torch.tensor([0.6, 0.75]))
    assert torch.isinf(p).tolist() == [[False, False, True, True], [False, False, False, True]]
    assert not torch.isinf(apply_top_k_top_p(logits, None, torch.tensor([0.01, 0.01]))).all(-1).any()


# --- Monte Carlo: the sampled rule keeps the target distribution ---------------------------
V = 4
SEQ = 3  # compare the joint distribution of the first three generated tokens: 64 cells


def _run(temperature: float, top_k, top_p, samples: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(V, V, V, generator=torch.Generator().manual_seed(1)) * 1.5
    # duplicate siblings with different subtrees: row t = [t+1, t+1, t+2, t+3]
    adj = torch.stack([(torch.arange(V) + d) % V for d in (1, 1, 2, 3)], 1).int()
    tree = compile_tree([[0], [1], [2], [0, 0], [1, 2], [1, 3], [0, 0, 0]], topk=4)
    layout = TreeLayout.from_template(tree, "cpu")
    hist = torch.zeros(samples, 2 + SEQ * (tree.max_depth + 1), dtype=torch.int64)
    hist[:, 0], hist[:, 1] = 2, 0  # the prompt
    count = torch.full((samples,), 2)
    rows = torch.arange(samples)
    temp = torch.full((samples,), temperature)
    tk = None if top_k is None else torch.full((samples,), top_k, dtype=torch.int64)
    tp = None if top_p is None else torch.full((samples,), top_p)
    while (count < 2 + SEQ).any():
        roots = hist[rows, count - 1]
        tokens = draft_tokens(adj, roots, tree).long()
        prev = torch.cat([hist[rows, count - 2][:, None], tokens[:, tree.parent[1:]]], 1)
        logits = table[prev, tokens].view(-1, V)
        out = accept_tree(layout, tokens, logits, temp, tk, tp, gen)
        n = out.num_accepted + 1
        for j in range(out.output_tokens.shape[1]):  # depth levels, not nodes
            write = j < n
            hist[rows[write], count[write] + j] = out.output_tokens[write, j]
        count += n
    cells = (hist[:, 2] * V + hist[:, 3]) * V + hist[:, 4]
    observed = torch.bincount(cells, minlength=V**SEQ).double()
    # exact: product of the processed conditionals
    flat = table.view(-1, V) / temperature
    n_rows = flat.shape[0]
    flat = apply_top_k_top_p(
        flat, None if top_k is None else torch.full((n_rows,), top_k),
        None if top_p is None else torch.full((n_rows,), top_p))
    probs = flat.softmax(-1).view(V, V, V).double()
    # P(a, b, c) = p(a | 2, 0) p(b | 0, a) p(c | a, b), probs indexed [prev, last, next]
    exact = probs[2, 0][:, None, None] * probs[0][:, :, None] * probs
    return observed, exact.reshape(-1) * samples


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty quantile of chi-square(df) at the normal quantile z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, 3, 0.9)])
def test_sampled_acceptance_keeps_target_distribution(temperature, top_k, top_p):
    observed, expected = _run(temperature, top_k, top_p, samples=40000, seed=0)
    possible = expected > 0
    assert observed[~possible].sum() == 0  # nothing the processed target rules out
    chi2 = float(((observed - expected)[possible] ** 2 / expected[possible]).sum())
    tv = float((observed - expected).abs().sum() / (2 * observed.sum()))
    assert chi2 < _chi_square_critical(int(possible.sum()) - 1), (chi2, tv)
    assert tv < 0.02


def test_a_biased_walk_fails_the_same_test(monkeypatch):
    """The statistic has power: a walk that takes each parent's sampled token to be one of its
    children's (every drafted child accepted, the drafts emitted) is rejected."""
    monkeypatch.setattr(accept_module, "walk_sampled", biased_walk(accept_module.walk_sampled))
    observed, expected = _run(1.0, None, None, samples=40000, seed=0)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 > 10 * _chi_square_critical(V**SEQ - 1)
