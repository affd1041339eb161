"""Each request's tree verified against the target, greedy and sampled alike.

Greedy steps (every request greedy): ``choose_paths`` walks every tree request's tree from its
root to the child whose token has the highest target logit, and ``ChainPlan`` lays those paths
out as chains in vLLM's own terms (``SpecDecodeMetadata`` rows), built on the device without
reading the paths; vLLM's rejection sampler then verifies them with every sampling feature it
has and emits its chain-format output: the target's argmax chain.

Steps with a sampled request, penalties, bad words or a logit bias: every row of the step is
sampled as a plain step of vLLM's sampler would sample it at the row's output position
(``node_sampler.NodeSampler``), and ``walk_sampled`` walks each request's tree (``StepRows``)
as greedy verification does: a child is accepted when its token is the token sampled at its
parent. The emitted tokens are those a
plain step would have emitted, position by position.

``compaction`` then moves the accepted nodes' KV from their node slots (prefix + j) to their
positions' slots (prefix + depth), the layout vLLM expects once the scheduler rolls back the
rejected drafts.

The reference decoder (``tools.reference``) accepts with the same functions. Nothing here
imports vLLM.
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
) -> torch.Tensor:
    """[R, D] int64: local node indices of each greedy tree request's path from the root
    (excluded) down to a leaf of its scheduled tree, -1 padded: at each node the walk takes the
    child whose token has the highest logit in the node's row; among equal logits the lower
    rank. logits [rows, V] are vLLM's verification logits, tokens [rows] the token fed at each
    logits row, logits_start [R] the logits row of each request's root (local node j is row
    logits_start + j)."""
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
    for level in range(layout.max_depth):
        cand = step.children.gather(1, current[:, None, None].expand(-1, 1, num_children))[:, 0]
        cand_ok = cand >= 0
        cand_score = torch.where(
            cand_ok, score.gather(1, cand.clamp(min=0)), float("-inf")
        )
        best_score, best = cand_score.max(dim=1)  # the first maximum: the lowest rank
        alive &= cand_ok.any(dim=1) & (best_score > float("-inf"))
        current = torch.where(alive, cand.gather(1, best[:, None])[:, 0], current)
        path[:, level] = torch.where(alive, current, -1)
    return path


@dataclass(frozen=True)
class StepRows:
    """Every logits row of a step as a node of its request's tree (host arrays). A request's
    rows are its root (the token it emitted last) then its drafts; a request without a
    branching tree has a chain (node j's parent is node j - 1). T = rows, B = requests.

    row_req [T] int64: the request (batch index) of each row.
    depth [T] int64: the node's depth (0: the root), the output position it samples is the
        request's next one plus depth.
    parent [T] int64: the row of the node's parent (the root: itself).
    start [B] int64: each request's root row. max_depth: the deepest node of the step.
    """

    row_req: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    start: np.ndarray
    max_depth: int

    @classmethod
    def build(cls, num_draft_tokens, tree: TreeStep | None) -> "StepRows":
        """num_draft_tokens [B]: each request's scheduled drafts; tree: the step's branching
        trees (their requests' rows in ``tree.parent_np`` / ``tree.depth_np``), or None."""
        num_rows = np.asarray(num_draft_tokens, dtype=np.int64) + 1
        start = np.cumsum(num_rows) - num_rows
        row_req = np.repeat(np.arange(num_rows.size), num_rows)
        local = np.arange(row_req.size) - start[row_req]
        depth = local.copy()
        parent_local = np.maximum(local - 1, 0)
        if tree is not None:
            width = tree.depth_np.shape[1]
            valid = np.arange(width)[None, :] < tree.num_rows_np[:, None]
            rows = start[tree.req_index_np][:, None] + np.arange(width)[None, :]
            depth[rows[valid]] = tree.depth_np[valid]
            parent_local[rows[valid]] = tree.parent_np[valid]
        return cls(row_req, depth, start[row_req] + parent_local, start, int(depth.max(initial=0)))


def walk_sampled(
    rows: "StepRowsOnDevice",
    tokens: torch.Tensor,
    sampled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's tree against the token sampled at each of its rows, as greedy
    verification does: a child is accepted when its parent is and its token is the token
    sampled at its parent (the lowest rank among siblings holding it). tokens [T] (the token
    fed at each row) and sampled [T] (the token sampled at each row), on the device.

    Returns (accepted [B, D+1] int64: the accepted rows by depth, root first, -1 padded;
    output [B, D+1] int32: vLLM's chain format, the token sampled at each accepted row: the
    accepted drafts, then the token after the last, then -1). On the device, no host reads."""
    tokens = tokens.long()
    sampled = sampled.long()
    parent, depth, row_req, start = rows.parent, rows.depth, rows.row_req, rows.start
    accepted = depth == 0
    matches = tokens == sampled[parent]
    before = torch.where(start > 0, start - 1, 0)
    for level in range(1, rows.max_depth + 1):
        candidate = (depth == level) & accepted[parent] & matches
        count = candidate.long().cumsum(0)
        earlier = torch.where(start > 0, count[before], 0)[row_req]  # before the request's rows
        accepted |= candidate & (count - earlier == 1)
    num_req, width = start.shape[0], rows.max_depth + 1
    column = torch.where(accepted, depth, width)  # the others go to a spare column
    table = torch.full((num_req, width + 1), -1, dtype=torch.int64, device=tokens.device)
    table[row_req, column] = torch.arange(tokens.shape[0], device=tokens.device)
    table = table[:, :width]
    output = torch.where(table >= 0, sampled[table.clamp(min=0)], -1).to(torch.int32)
    return table, output


@dataclass(frozen=True)
class StepRowsOnDevice:
    """``StepRows`` on the step's device (int64 tensors), for ``walk_sampled``."""

    row_req: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    start: torch.Tensor
    max_depth: int

    @classmethod
    def of(cls, rows: StepRows, device) -> "StepRowsOnDevice":
        t = lambda a: to_device(a, torch.int64, device)  # noqa: E731
        return cls(t(rows.row_req), t(rows.depth), t(rows.parent), t(rows.start), rows.max_depth)


def tree_paths(step: TreeStep, accepted: torch.Tensor, logits_start: torch.Tensor) -> torch.Tensor:
    """[R, D] int64: each tree request's accepted nodes below the root (local indices, -1
    padded) from ``walk_sampled``'s accepted rows [B, D+1]; logits_start [R]: each tree
    request's root row."""
    rows = accepted[step.req_index, 1:]
    path = torch.where(rows >= 0, rows - logits_start[:, None], -1)
    depth = step.layout.max_depth
    if path.shape[1] < depth:
        path = torch.cat([path, path.new_full((path.shape[0], depth - path.shape[1]), -1)], 1)
    return path[:, :depth]


def compaction(step: TreeStep, path: torch.Tensor, slot_mapping: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) slot pairs [R * D] int64 that move every accepted node of ``path`` [R, D]
    (local indices, -1 past the accepted nodes) to the slot of its position; on the device.
    slot_mapping [T]: this step's slots (slot of row root + j = slot of position prefix + j).
    A pair that moves nothing copies a slot of its own request onto itself: a node row not
    accepted (local index >= depth > accepted) or the root, never a destination of a real move."""
    device = slot_mapping.device
    level = torch.arange(1, path.shape[1] + 1, device=device)[None, :]
    moves = path >= 0
    node_rows = step.root_row[:, None] + path.clamp(min=0)
    dst_rows = torch.where(moves, step.root_row[:, None] + level, node_rows)
    return slot_mapping[node_rows.reshape(-1)].long(), slot_mapping[dst_rows.reshape(-1)].long()


@dataclass
class ChainPlan:
    """The greedy paths as vLLM chains, built on the device without reading the paths: each
    tree request's chain has the depth of its deepest scheduled node (known on the host), its
    path followed by padding drafts (token -1, on the row of the path's last node), which vLLM's
    rejection sampler rejects: -1 never equals the argmax and the argmax of that row is
    emitted, so the output is that of the unpadded path (its bonus token comes from the same
    row). B = batch size.

    rows [S] int64: logits rows that form the chain logits (per request: root, then the chain),
        S = sum(L) + B.
    num_draft_tokens: per request, its chain length L (0 for requests without drafts).
    draft_rows [sum(L)] int64: logits rows of the chain's drafts; draft_pad [sum(L)] bool: the
        padding drafts.
    cu_num_draft_tokens, cu_num_sampled_tokens [B] int32; target_logits_indices [sum(L)] int32,
        bonus_logits_indices [B] int32: vLLM's ``SpecDecodeMetadata`` over the chain logits.
    path [R, D] int64: each tree request's path (``choose_paths``), on the device.
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
        )

    def draft_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[sum(L)] the chain's draft tokens (-1 for padding), from the tokens fed at each
        logits row."""
        return torch.where(self.draft_pad, -1, tokens[self.draft_rows])

    def compaction(
        self, step: TreeStep, sampled: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``compaction`` of the path's accepted nodes. sampled [B, L+1]: vLLM's chain output
        (accepted tokens, then one more, then -1)."""
        accepted = (sampled >= 0).sum(dim=1) - 1  # [B]
        level = torch.arange(1, self.path.shape[1] + 1, device=sampled.device)[None, :]
        path = torch.where(level <= accepted[step.req_index][:, None], self.path, -1)
        return compaction(step, path, slot_mapping)


def _ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """concat(arange(n) for n in lengths)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts
