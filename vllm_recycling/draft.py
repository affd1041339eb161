"""Drafting: the batch's trees from the adjacency matrix, one breadth-first gather."""

from __future__ import annotations

import torch

from vllm_recycling.kernels.draft_tree import draft_tree
from vllm_recycling.tree import TreeTemplate


def draft_tokens(
    table: torch.Tensor, roots: torch.Tensor, tree: TreeTemplate, row_base: torch.Tensor | None = None
) -> torch.Tensor:
    """tokens [B, N+1] int32: node 0 is the root, node i is ``table[row(parent), rank[i]]``.

    table [R, k] int32 (``AdjacencyMatrix.table``); roots [B] int (each request's last token);
    row_base [B] int64 for the per-request scope, None for the shared one.
    """
    return draft_tree(table, roots, tree.parent, tree.rank, tree.level_starts, row_base)
