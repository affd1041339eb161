"""Draft-tree build: every node's token for every request of the batch.

``token[b, node] = table[row_base[b] + token[b, parent[node]], rank[node]]``, level by level
from the roots. ``table`` is the adjacency matrix ``[R, k]`` int32: one ``[V, k]`` matrix (shared
scope, row_base 0) or a pool of per-request matrices (row_base = slot * V).
"""

from __future__ import annotations

import torch


def draft_tree_reference(
    table: torch.Tensor,
    roots: torch.Tensor,
    parent: torch.Tensor,
    rank: torch.Tensor,
    level_starts: tuple[int, ...],
    row_base: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference.

    table [R, k] int32; roots [B] int; parent, rank [N+1] int64 (breadth-first, root first);
    row_base [B] int64 or None. Returns tokens [B, N+1] int32 with tokens[:, 0] = roots.
    """
    tokens = torch.empty((roots.shape[0], parent.shape[0]), dtype=torch.int32, device=table.device)
    tokens[:, 0] = roots
    base = 0 if row_base is None else row_base[:, None]
    for d in range(1, len(level_starts) - 1):  # one gather per level, never per node
        s, e = level_starts[d], level_starts[d + 1]
        rows = tokens[:, parent[s:e]].long() + base
        tokens[:, s:e] = table[rows, rank[s:e]]
    return tokens


def draft_tree(table, roots, parent, rank, level_starts, row_base=None) -> torch.Tensor:
    """Build the batch's draft trees (see ``draft_tree_reference`` for shapes)."""
    return draft_tree_reference(table, roots, parent, rank, level_starts, row_base)
