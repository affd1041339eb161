"""Tree acceptance for the reference decoder, by the plugin's own rule.

The plugin accepts in two parts: ``paths.choose_paths`` picks one root-to-leaf path per tree
from the verification logits (greedy: the child whose token has the highest target logit;
sampled: a child drawn from the target distribution restricted to the children), then vLLM's
rejection sampler verifies that path as a chain. ``accept_tree`` does the same for the
reference decoder: the same ``choose_paths``, then ``verify_chain``, which follows vLLM's
rejection sampler (v1/sample/rejection_sampler.py) in plain PyTorch:

- greedy: each draft is accepted while it equals the target's argmax at its parent; the token
  after the last accepted one is the argmax there (the bonus or the correction).
- sampled: draft x, drawn from q, is accepted with probability min(1, p(x) / q(x)), p the
  target distribution after temperature, top-k and top-p; a rejected draft is replaced by a
  draw from max(p - q, 0) renormalised, and after the last accepted draft a token is drawn from
  p. Any chain fixed before the draws is verified losslessly this way, and the emitted tokens
  are distributed as the target's (tests/test_accept.py counts it).

So greedy output, accepted lengths and matrix updates of the reference equal the plugin's,
step by step, wherever the two models' logits agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_recycling.paths import choose_paths
from vllm_recycling.tree_step import TreeLayout, TreeStep


@dataclass(frozen=True)
class AcceptedPaths:
    """num_accepted [B] int64: accepted draft nodes (the depth of the deepest accepted node).
    nodes [B, D+1] int64: node indices from the root to that node, -1 padded.
    output_tokens [B, D+1] int64: vLLM's chain format: the accepted draft tokens in depth order,
    then the next token, then -1."""

    num_accepted: torch.Tensor
    nodes: torch.Tensor
    output_tokens: torch.Tensor


def accept_tree(
    layout: TreeLayout,
    tokens: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    nodes: np.ndarray | None = None,
) -> AcceptedPaths:
    """tokens [B, M] (each request's tree, root first: every node of the layout, or the root
    and ``nodes``, template node ids breadth-first and ancestor-closed, the same for every
    request); logits [B * M, V] (row b * M + j: the target's logits after local node j of
    request b); temperature [B] (0: greedy; None: all greedy), top_k [B] int, top_p [B] float
    or None. Paths and nodes come back in local indices (0 .. M-1)."""
    batch, width = tokens.shape
    device = logits.device
    flat = tokens.reshape(-1).long()
    starts = torch.arange(batch, device=device) * width
    sampled = temperature is not None and bool((temperature > 0).any())
    step = TreeStep.plan(
        layout, np.full(batch, width - 1), np.arange(batch + 1) * width, np.zeros(batch, np.int64), device,
        None if nodes is None else [np.asarray(nodes)] * batch,
    )
    q = q_tokens = None
    if step is None:  # a chain template: the path is the chain
        path = torch.arange(1, width, device=device).repeat(batch, 1)
        if sampled:
            q = torch.ones((batch, width - 1, 1), device=device)
            q_tokens = tokens[:, 1:, None].long()
    elif not sampled:
        path = choose_paths(step, logits, flat, starts)
    else:
        uniform = torch.rand((batch, layout.max_depth), generator=generator, device=device)
        path, q, q_tokens = choose_paths(step, logits, flat, starts, temperature, uniform)
    depth = path.shape[1]
    on_path = path >= 0
    nodes = torch.cat([torch.zeros((batch, 1), dtype=torch.int64, device=device), path], 1)
    rows = starts[:, None] + torch.cat([nodes[:, :1], torch.where(on_path, path, 0)], 1)  # [B, D+1]
    drafts = torch.where(on_path, flat.gather(0, rows[:, 1:].reshape(-1)).view(batch, depth), -1)
    draft_q = None
    if q is not None:  # each path node's draft distribution over the vocabulary
        draft_q = torch.zeros((batch, depth, logits.shape[1]), device=device)
        draft_q.scatter_add_(2, q_tokens, q)
    num_accepted, output = verify_chain(
        drafts, logits[rows.reshape(-1)].view(batch, depth + 1, -1), temperature, top_k, top_p,
        draft_q, generator,
    )
    levels = torch.arange(depth + 1, device=device)
    nodes = torch.where(levels[None] <= num_accepted[:, None], nodes, -1)
    return AcceptedPaths(num_accepted, nodes, output)


def verify_chain(
    drafts: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    draft_q: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify draft chains as vLLM's rejection sampler does. drafts [B, D] int (-1: a draft
    that is rejected, as vLLM pads); logits [B, D+1, V]: the target after the root and after
    each draft; temperature [B] (0: greedy), top_k [B], top_p [B] or None; draft_q [B, D, V]:
    the distribution each sampled request's draft was drawn from (None or zero rows: a draft
    that is rejected). Returns (accepted drafts [B], tokens [B, D+1]: the accepted drafts, the
    next token, then -1)."""
    batch, depth = drafts.shape
    vocab = logits.shape[-1]
    device = logits.device
    drafts = drafts.long()
    argmax = logits.argmax(-1)  # the lowest id among equal logits, as torch and vLLM take it
    greedy = torch.ones(batch, dtype=torch.bool, device=device) if temperature is None else temperature <= 0
    p = None
    if not bool(greedy.all()):
        rows = lambda t: None if t is None else t[:, None].expand(batch, depth + 1).reshape(-1)  # noqa: E731
        safe = torch.where(greedy, 1.0, temperature.float())
        p = target_probs(logits.reshape(-1, vocab), rows(safe), rows(top_k), rows(top_p)).view(batch, depth + 1, vocab)
        if draft_q is None:
            draft_q = torch.zeros((batch, depth, vocab), device=device)

    def draw(dist: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(dist, 1, generator=generator)[:, 0]

    output = torch.full((batch, depth + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    for d in range(depth):
        x = drafts[:, d]
        accept = x == argmax[:, d]
        replacement = argmax[:, d]
        if p is not None:
            q = draft_q[:, d]
            qx = q.gather(1, x.clamp(min=0)[:, None])[:, 0]
            px = p[:, d].gather(1, x.clamp(min=0)[:, None])[:, 0]
            u = torch.rand(batch, generator=generator, device=device)
            accept = torch.where(greedy, accept, (x >= 0) & (qx > 0) & (u * qx < px))
            residual = (p[:, d] - q).clamp(min=0)
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, d])
            replacement = torch.where(greedy, replacement, draw(residual))
        accept &= alive
        stop = alive & ~accept
        output[:, d] = torch.where(accept, x, torch.where(stop, replacement, -1))
        num_accepted += accept.long()
        alive &= accept
    bonus = argmax[:, depth]
    if p is not None:
        bonus = torch.where(greedy, bonus, draw(p[:, depth]))
    output[:, depth] = torch.where(alive, bonus, -1)
    return num_accepted, output


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


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target distribution of each row of logits [T, V] at temperature [T] (> 0) after
    top-k and top-p, as vLLM's sampler processes it: [T, V] float32."""
    scaled = logits.float() / temperature.float()[:, None]
    return apply_top_k_top_p(scaled, top_k, top_p).softmax(-1)
