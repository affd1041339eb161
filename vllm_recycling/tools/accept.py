"""Tree acceptance: which drafted path the target model confirms, and the token after it.

Both rules look at one target token per node: ``target[b, n]`` is the token the target model
chooses after node n's prefix (its argmax for greedy requests, a sample from its processed
distribution for sampled requests). A draft node n matches when its token equals the target
token at its parent; a node is accepted when it and all its ancestors match.

- greedy: the deepest accepted node (the first in breadth-first order among equally deep ones),
  i.e. the longest root-to-leaf prefix that equals the target's argmax chain.
- sampled: the walk from the root that moves to the child holding the sampled token, and to the
  first such child when siblings hold the same token. Each emitted token is then one sample from
  the target distribution given exactly the tokens before it, and the drafts depend only on
  state fixed before the step, so the output distribution is the target's. (Taking the deeper
  of two duplicate siblings instead would pick between two independent samples by their
  outcome: that is biased, and tests/test_accept.py shows it.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_recycling.tree import TreeTemplate


@dataclass(frozen=True)
class AcceptedPaths:
    """num_accepted [B] int64: accepted draft nodes (depth of the deepest accepted node).
    nodes [B, D+1] int64: node indices from the root to that node, -1 padded.
    next_token [B] int64: the target token after that node (the bonus / correction token).
    output_tokens [B, D+1] int64: vLLM's chain format: the accepted draft tokens in depth order,
    then next_token, then -1.
    """

    num_accepted: torch.Tensor
    nodes: torch.Tensor
    next_token: torch.Tensor
    output_tokens: torch.Tensor


def accept(
    tree: TreeTemplate, tokens: torch.Tensor, target: torch.Tensor, greedy: torch.Tensor | bool
) -> AcceptedPaths:
    """tokens, target [B, N+1] int; greedy [B] bool or one bool for the batch."""
    batch = tokens.shape[0]
    tokens, target = tokens.long(), target.long()
    parent = tree.parent.clamp(min=0)
    match = tokens == target[:, parent]
    match[:, 0] = True
    greedy = torch.as_tensor(greedy, device=tokens.device).expand(batch)
    # For sampled requests only the first sibling holding a token may match.
    dup = (tree.earlier_sibling[None] & (tokens[:, :, None] == tokens[:, None, :])).any(-1)
    match &= ~(dup & ~greedy[:, None])
    accepted = ~(tree.ancestors[None] & ~match[:, None, :]).any(-1)
    score = torch.where(accepted, tree.depth[None], -1)
    deepest = score.argmax(-1)  # the first maximum: breadth-first order breaks ties
    num_accepted = tree.depth[deepest]
    nodes = tree.node_path[deepest]
    next_token = target.gather(1, deepest[:, None])[:, 0]
    levels = torch.arange(nodes.shape[1], device=tokens.device)
    path_tokens = tokens.gather(1, nodes.clamp(min=0))
    drafted = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)  # shift off the root
    output = torch.where(levels[None] < num_accepted[:, None], drafted, -1)
    output.scatter_(1, num_accepted[:, None], next_token[:, None])
    return AcceptedPaths(num_accepted, nodes, next_token, output)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits [T, V] as vLLM's sampler does: keep the k largest (ties at the k-th value
    kept), then the smallest set whose probability exceeds p (at least one token). top_k [T]
    int (>= V: off), top_p [T] float (1.0: off)."""
    if top_k is None and top_p is None:
        return logits
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = ascending.gather(1, (logits.shape[1] - top_k.long().clamp(1, logits.shape[1]))[:, None])
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    if top_p is not None:
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p[:, None]
        drop[:, -1] = False
        ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def sample_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One target token per row of logits [T, V]: argmax where temperature [T] is 0, else a
    sample of softmax(top-k/top-p(logits / temperature)). Returns [T] int64."""
    greedy = temperature <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature.float())[:, None]
    probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(-1)
    # argmax(p / q) with q ~ Exp(1) is a sample of p (the exponential race vLLM also uses).
    race = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / race).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)
