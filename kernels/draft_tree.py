"""Draft-tree build: every node's token for every request of the batch.

``token[b, node] = table[row_base[b] + token[b, parent[node]], rank[node]]``, level by level
from the roots. ``table`` is the adjacency matrix ``[R, k]`` int32: one ``[V, k]`` matrix (shared
scope, row_base 0) or a pool of per-request matrices (row_base = slot * V).

The Triton kernel builds the trees of the whole batch in one launch. It needs no barrier between
levels: each node walks from the root along its own rank path (``TreeTemplate.rank_path``),
``tok = root; for d < depth[node]: tok = table[base + tok, rank_path[node, d]]``, so a node of
depth d does d dependent gathers (at most MAX_DEPTH = 16), all of them hitting rows its
ancestors read too (L1/L2 hits after the first). The same launch can also write the tree's
position ids, ``positions[b, node] = prefix_len[b] + depth[node]``.

Token ids in the table must lie in ``0..V-1`` of their matrix: the reference raises on an
out-of-range row, the kernel does not check (a corrupt table reads out of bounds).
"""

from __future__ import annotations

import torch

from vllm_recycling.kernels import jit, next_power_of_2, triton_usable

tl = None  # triton.language, filled in by kernels.jit() when the kernel is first built


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


def _draft_tree_kernel(
    table_ptr, roots_ptr, base_ptr, prefix_ptr, rank_path_ptr, depth_ptr, out_ptr, pos_ptr,
    num_nodes,
    stride_table, stride_roots, stride_base, stride_prefix, stride_rank_path,
    stride_out_b, stride_out_n, stride_pos_b, stride_pos_n,
    DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BASE: tl.constexpr, HAS_POS: tl.constexpr,
):
    """Grid (B, cdiv(N+1, BLOCK_N)): program (b, j) computes nodes j*BLOCK_N ... of request b."""
    b = tl.program_id(0).to(tl.int64)
    nodes = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = nodes < num_nodes
    depth = tl.load(depth_ptr + nodes, mask=live, other=0)
    root = tl.load(roots_ptr + b * stride_roots).to(tl.int64)
    if HAS_BASE:
        base = tl.load(base_ptr + b * stride_base).to(tl.int64)
    else:
        base = 0
    tok = tl.zeros([BLOCK_N], dtype=tl.int64) + root
    for d in tl.static_range(DEPTH):
        step = live & (depth > d)
        r = tl.load(rank_path_ptr + nodes * stride_rank_path + d, mask=step, other=0)
        nxt = tl.load(table_ptr + (base + tok) * stride_table + r, mask=step, other=0)
        tok = tl.where(step, nxt.to(tl.int64), tok)
    tl.store(out_ptr + b * stride_out_b + nodes * stride_out_n, tok.to(tl.int32), mask=live)
    if HAS_POS:
        prefix = tl.load(prefix_ptr + b * stride_prefix).to(tl.int64)
        tl.store(pos_ptr + b * stride_pos_b + nodes * stride_pos_n, prefix + depth.to(tl.int64), mask=live)


def _check_out(out, shape, dtype, device, name):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name}: expected {dtype} {tuple(shape)} on {device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


def draft_tree_triton(
    table: torch.Tensor,
    roots: torch.Tensor,
    rank_path: torch.Tensor,
    depth: torch.Tensor,
    row_base: torch.Tensor | None = None,
    prefix_len: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
):
    """Triton launcher: the whole batch in one launch, no host-device sync.

    table [R, k] int32; roots [B] int; rank_path [N+1, D] int (-1 padded) and depth [N+1] int,
    on the table's device; row_base [B] int or None; prefix_len [B] int or None.
    Returns tokens [B, N+1] int32 (written into ``out`` when given), or ``(tokens, positions)``
    with positions [B, N+1] int64 when prefix_len is given (into ``positions_out`` when given).
    prefix_len, out and positions_out are not used by the plugin yet: they are for a GPU path
    with persistent buffers.
    """
    if table.dim() != 2 or table.dtype != torch.int32 or table.stride(1) != 1:
        raise ValueError(f"table: expected [R, k] int32 with unit column stride, got {table.dtype} {tuple(table.shape)}")
    device = table.device
    batch, n1 = roots.shape[0], depth.shape[0]
    if rank_path.dim() != 2 or rank_path.shape[0] != n1:
        raise ValueError(f"rank_path {tuple(rank_path.shape)} does not match depth {tuple(depth.shape)}")
    rank_path = rank_path.to(device)
    depth = depth.to(device)
    if rank_path.stride(1) != 1:
        rank_path = rank_path.contiguous()
    tokens = _check_out(out, (batch, n1), torch.int32, device, "out")
    positions = None
    if prefix_len is not None:
        positions = _check_out(positions_out, (batch, n1), torch.int64, device, "positions_out")
    for name, t in (("roots", roots), ("row_base", row_base), ("prefix_len", prefix_len)):
        if t is not None and (t.shape != (batch,) or t.device != device):
            raise ValueError(f"{name}: expected [{batch}] on {device}, got {tuple(t.shape)} on {t.device}")
    if batch > 0:
        if block_n is None:
            block_n = min(next_power_of_2(n1), 256)
        grid = (batch, -(-n1 // block_n))
        kernel = jit(_draft_tree_kernel)
        kernel[grid](
            table, roots,
            row_base if row_base is not None else roots,
            prefix_len if prefix_len is not None else roots,
            rank_path, depth, tokens,
            positions if positions is not None else tokens,
            n1,
            table.stride(0), roots.stride(0),
            row_base.stride(0) if row_base is not None else 0,
            prefix_len.stride(0) if prefix_len is not None else 0,
            rank_path.stride(0),
            tokens.stride(0), tokens.stride(1),
            positions.stride(0) if positions is not None else 0,
            positions.stride(1) if positions is not None else 0,
            DEPTH=rank_path.shape[1], BLOCK_N=block_n,
            HAS_BASE=row_base is not None, HAS_POS=positions is not None,
            num_warps=num_warps,
        )
    return tokens if positions is None else (tokens, positions)


def draft_tree(
    table: torch.Tensor,
    roots: torch.Tensor,
    tree,
    row_base: torch.Tensor | None = None,
    *,
    prefix_len: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
):
    """Build the batch's draft trees: Triton when usable (``kernels.triton_usable``), else the
    reference.

    tree: a ``TreeTemplate`` (its parent, rank, level_starts, rank_path and depth), ideally on the
    table's device; the other arguments and the return value as in ``draft_tree_triton``.
    """
    tensors = [t for t in (table, roots, row_base, prefix_len, out, positions_out) if t is not None]
    if triton_usable(*tensors):
        return draft_tree_triton(
            table, roots, tree.rank_path, tree.depth, row_base, prefix_len, out, positions_out
        )
    tokens = draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, row_base)
    if out is not None:
        tokens = _check_out(out, tokens.shape, torch.int32, table.device, "out").copy_(tokens)
    if prefix_len is None:
        return tokens
    positions = prefix_len.long()[:, None] + tree.depth.to(table.device)[None]
    if positions_out is not None:
        positions = _check_out(positions_out, positions.shape, torch.int64, table.device, "positions_out").copy_(positions)
    return tokens, positions
