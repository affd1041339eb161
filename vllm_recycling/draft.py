"""Drafting: the batch's trees from the adjacency matrix, one breadth-first gather."""

from __future__ import annotations

import torch

from vllm_recycling.kernels.draft_tree import Overlay, draft_tree
from vllm_recycling.tree import TreeTemplate


def draft_tokens(
    table: torch.Tensor,
    roots: torch.Tensor,
    tree: TreeTemplate,
    row_base: torch.Tensor | None = None,
    *,
    prefix_len: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
    overlay: Overlay | None = None,
    probs: torch.Tensor | None = None,
):
    """tokens [B, N+1] int32: node 0 is the root, node i is ``table[row(parent), rank[i]]``.

    table [R, k] int32 (``AdjacencyMatrix.table``); roots [B] int (each request's last token);
    row_base [B] int64 for the per-request scope, None for the shared one; overlay for the
    overlay scope (``AdjacencyMatrix.lookup``). The template should
    be on the table's device (``tree.to(device)``). With prefix_len [B] int, also the tree's
    position ids ``prefix_len[b] + depth[node]`` [B, N+1] int64: returns ``(tokens, positions)``.
    out / positions_out: optional persistent buffers to write into (for a later GPU path).
    probs [R, k] float16 (``AdjacencyMatrix.probs``): also return each node's probability under
    the row that drafted it, conf [B, N+1] float32 (1 at the root), last in the tuple.
    """
    return draft_tree(
        table, roots, tree, row_base, prefix_len=prefix_len, out=out, positions_out=positions_out,
        overlay=overlay, probs=probs,
    )
