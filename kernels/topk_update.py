"""Fused verification read: top-k and argmax of each logits row, scattered into the matrix.

For every verification row t (one per tree node of every request), ``table[rows[t]] =
top-k(logits[t])`` and ``argmax[t] = top-1(logits[t])``.

Rules, shared by the kernel and the reference:
- ties: among equal logits the lower token id ranks first (so argmax is the first maximum,
  as ``torch.argmax`` gives);
- duplicate rows (the same token at several nodes): the last row in order wins, i.e. the
  node latest in breadth-first order of the latest request in the batch.
"""

from __future__ import annotations

import torch


def topk_update_reference(logits: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """PyTorch reference.

    logits [T, V] float (any dtype); rows [T] int64 (matrix row of each node's token);
    table [R, k] int32, updated in place. Returns argmax [T] int64.
    """
    top = topk_lowest_id_first(logits, table.shape[1])
    uniq, inverse = torch.unique(rows, return_inverse=True)
    order = torch.arange(rows.shape[0], device=rows.device)
    last = torch.zeros_like(uniq).scatter_reduce_(0, inverse, order, "amax", include_self=False)
    table[uniq] = top[last].to(table.dtype)
    return top[:, 0]


def topk_lowest_id_first(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k token ids [T, k] int64 of logits [T, V], ordered by (logit desc, token id asc).

    torch.topk leaves the order of ties unspecified and a stable full sort costs ~50x more, so
    take topk, put its k entries in (value desc, id asc) order, and redo only the rows where a
    token outside the set ties the k-th value (there the lowest ids must win).
    """
    values, ids = torch.topk(logits, k, dim=-1)
    ids = _order_by_value_then_id(logits, ids)
    kth = values[:, -1:]
    outside_tie = (logits == kth).sum(-1) > (values == kth).sum(-1)
    if outside_tie.any():
        rows = outside_tie.nonzero()[:, 0]
        sub, sub_kth = logits[rows], kth[rows]
        above, equal = sub > sub_kth, sub == sub_kth
        room = k - above.sum(-1, keepdim=True)
        chosen = above | (equal & (equal.cumsum(-1) <= room))
        ids[rows] = _order_by_value_then_id(sub, chosen.nonzero()[:, 1].view(-1, k))
    return ids


def _order_by_value_then_id(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.sort(dim=-1).values
    order = torch.sort(logits.gather(1, ids), dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order)


def topk_update(logits: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Update ``table`` from the verification logits; returns the argmax of each row."""
    return topk_update_reference(logits, rows, table)
