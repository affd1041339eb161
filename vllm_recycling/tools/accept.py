"""Tree acceptance for the reference decoder, by the plugin's own rule.

The plugin samples every row of a tree as a plain step samples the row's output position
(greedy: the argmax; sampled: the processed target with the position's noise, shared by the
nodes of a depth) and walks the tree as greedy verification does: a child is accepted when its
token is the token sampled at its parent (``paths.walk_sampled``). ``accept_tree`` does the
same for the reference decoder, with the noise of vLLM's ``random_sample`` (an exponential
race) drawn from one generator. Each emitted token is then the one its position samples,
whatever the tree, so the emitted tokens are distributed as the target's
(tests/test_accept.py counts it).

So greedy output, accepted lengths and matrix updates of the reference equal the plugin's,
step by step, wherever the two models' logits agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_recycling.paths import StepRows, StepRowsOnDevice, walk_sampled
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
    num_draft = np.full(batch, width - 1)
    step = TreeStep.plan(
        layout, num_draft, np.arange(batch + 1) * width, np.zeros(batch, np.int64), device,
        None if nodes is None else [np.asarray(nodes)] * batch,
    )  # None for a chain template: each request's rows are a chain
    rows = StepRowsOnDevice.of(StepRows.build(num_draft, step), device)
    sampled = sample_rows(logits, rows, temperature, top_k, top_p, generator)
    accepted, output = walk_sampled(rows, flat, sampled)
    local = torch.where(accepted >= 0, accepted - rows.start[:, None], -1)
    return AcceptedPaths((accepted >= 0).sum(1) - 1, local, output.long())


def sample_rows(
    logits: torch.Tensor,
    rows: StepRowsOnDevice,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[T] int64: the token each row of logits [T, V] samples, as the plugin samples it: the
    argmax for a greedy request, else exponential-race sampling (vLLM's ``random_sample``) from
    the processed target with the noise of the row's output position, one vector per depth of
    each request drawn from ``generator`` and shared by the depth's nodes."""
    argmax = logits.argmax(-1)  # the lowest id among equal logits, as torch and vLLM take it
    if temperature is None or not bool((temperature > 0).any()):
        return argmax
    batch, vocab = rows.start.shape[0], logits.shape[1]
    noise = torch.empty((batch, rows.max_depth + 1, vocab), device=logits.device)
    noise.exponential_(generator=generator)
    greedy = temperature <= 0
    at = lambda t: None if t is None else t[rows.row_req]  # noqa: E731
    p = target_probs(logits, at(torch.where(greedy, 1.0, temperature.float())), at(top_k), at(top_p))
    drawn = (p / noise[rows.row_req, rows.depth]).argmax(-1)
    return torch.where(greedy[rows.row_req], argmax, drawn)


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
