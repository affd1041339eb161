"""Verification of a step's chains as plain steps sample (Model Runner V2).

vLLM 0.34's rejection sampler accepts a draft a model did not propose with the probability the
target gives it (a ratio test): the target's distribution is kept, but a seeded request's
tokens are not those it gets without speculation. Here every logits row is sampled exactly as a
plain step at that position samples it (vLLM's own ``Sampler.sample``: the request's sampling
parameters, its seed and the position keying the noise), and a draft is accepted while it is
the token its predecessor row sampled. Every emitted token is then the one a plain step would
have emitted after the same tokens: greedy and seeded output identical to no speculation, and
any request's distribution the target's. A draft is accepted with the same probability as
under the ratio test (the chance the sample equals it)."""

from __future__ import annotations

import torch

from vllm_recycling.paths import StepRowsOnDevice, walk_sampled


def accept_chain(
    sampled_rows: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    local_pos: torch.Tensor,
    num_speculative_steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's accepted chain, on the device (no host sync).

    sampled_rows [L] int: the token each logits row samples; draft_sampled [L] int: the token
    fed at each row (row 0 of a request: its last token; row i > 0: its i-th draft, -1 for a
    placeholder, which never matches); cu_num_logits [B+1] int: each request's rows;
    local_pos [L] int: a row's index within its request. Returns ``sampled`` [B, K+1] int64
    (row i of request b at [b, i]; only the first ``num_sampled[b]`` are read) and
    ``num_sampled`` [B] int32: 1 + the drafts accepted, the rows up to the first draft that is
    not its predecessor's sample."""
    num_rows = sampled_rows.shape[0]
    num_reqs = cu_num_logits.shape[0] - 1
    device = sampled_rows.device
    local = local_pos.long()
    rows = torch.arange(num_rows, device=device)
    request = torch.searchsorted(cu_num_logits[1:].long(), rows, right=True)
    previous = sampled_rows.roll(1)
    rejected = (local > 0) & (draft_sampled.long() != previous.long())
    rows_of = (cu_num_logits[1:] - cu_num_logits[:-1]).long()
    first_rejected = rows_of.clone().scatter_reduce_(
        0, request, torch.where(rejected, local, rows_of[request]), "amin")
    sampled = torch.full((num_reqs, num_speculative_steps + 1), -1, dtype=torch.int64, device=device)
    sampled[request, local] = sampled_rows.long()
    return sampled, first_rejected.to(torch.int32)


def accept_tree(
    sampled_rows: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    local_pos: torch.Tensor,
    parent_of_local: torch.Tensor,
    depth_of_local: torch.Tensor,
    max_depth: int,
    num_speculative_steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's accepted path through its tree, on the device (no host sync): what
    ``accept_chain`` is for a chain. A request's rows are the first nodes of one template in
    breadth-first order (vLLM cuts drafts to a prefix, which is still a tree), so a row's parent
    and depth are the template's for its local index: parent_of_local [N+1] int64 (the parent's
    local index; anything for the root) and depth_of_local [N+1] int64 (at most ``max_depth``).
    A node is accepted when its parent is and its token is the token its parent's row sampled,
    the lowest rank among siblings holding it (``paths.walk_sampled``); placeholders (-1) never
    are. Returns ``sampled`` [B, K+1] int64 (the tokens sampled at the path's rows, root first:
    the accepted drafts, then the token after the last; -1 past them), ``num_sampled`` [B] int32
    (1 + the path's depth) and ``path`` [B, max_depth] int64 (the accepted nodes' local indices
    below the root, -1 padded: where their KV must move)."""
    num_rows = sampled_rows.shape[0]
    num_reqs = cu_num_logits.shape[0] - 1
    device = sampled_rows.device
    local = local_pos.long()
    cu = cu_num_logits.long()
    start = cu[:-1]
    request = torch.searchsorted(cu[1:], torch.arange(num_rows, device=device), right=True)
    rows = StepRowsOnDevice(row_req=request, depth=depth_of_local[local], start=start, max_depth=max_depth,
                            parent=start[request] + parent_of_local.clamp(min=0)[local])
    table, output = walk_sampled(rows, draft_sampled, sampled_rows)
    sampled = torch.full((num_reqs, num_speculative_steps + 1), -1, dtype=torch.int64, device=device)
    sampled[:, : max_depth + 1] = output
    num_sampled = (table >= 0).sum(1).to(torch.int32)
    below = table[:, 1:]
    path = torch.where(below >= 0, below - start[:, None], -1)
    return sampled, num_sampled, path


def emitted_rows(cu_num_logits: torch.Tensor, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) logits rows [B * D] int64: vLLM scores ``sampled[b, i]`` (logprobs, sampling
    masks) with its request's row ``start_b + i``; for a tree the token after the path's i-th
    node was sampled at that node's row, ``start_b + path[b, i - 1]``. Rows past the path copy
    the root onto itself. path [B, D]: ``accept_tree``'s."""
    start = cu_num_logits[:-1].long()[:, None]
    level = torch.arange(1, path.shape[1] + 1, device=path.device)[None, :]
    moves = path >= 0
    dst = torch.where(moves, start + level, start)
    src = torch.where(moves, start + path, start)
    return dst.reshape(-1), src.reshape(-1)
