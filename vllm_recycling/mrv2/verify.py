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
