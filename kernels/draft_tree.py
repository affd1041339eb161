"""Draft-tree build: every node's token for every request of the batch.

``token[b, node] = table[row(b, token[b, parent[node]]), rank[node]]``, level by level from the
roots. ``table`` is the adjacency matrix ``[R, k]`` int32: one ``[V, k]`` matrix (shared scope,
row(b, t) = t), a pool of per-request matrices (row(b, t) = row_base[b] + t), or the shared
matrix with a per-request overlay (``Overlay``: ``size`` entries per request, a power of two;
with e = key_base[b] + (t & (size - 1)), row(b, t) = offset + e when keys[e] == t, else t).
See ``vllm_recycling.matrix`` for the scopes.

The Triton kernel builds the trees of the whole batch in one launch. It needs no barrier between
levels: each node walks from the root along its own rank path (``TreeTemplate.rank_path``),
``tok = root; for d < depth[node]: tok = table[base + tok, rank_path[node, d]]``, so a node of
depth d does d dependent gathers (at most MAX_DEPTH = 16), all of them hitting rows its
ancestors read too (L1/L2 hits after the first). Given the successors' probabilities ``probs``
[R, k] float16, the same launch also writes each node's ``conf[b, node] = probs[row, rank]`` at
its last gather (float32, 1 at the root).

Token ids in the table must lie in ``0..V-1`` of their matrix: the reference raises on an
out-of-range row, the kernel does not check (a corrupt table reads out of bounds).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_recycling.kernels import jit, native, next_power_of_2, triton_usable

tl = None  # triton.language, filled in by kernels.jit() when the kernel is first built


class Overlay(NamedTuple):
    """Per-request overlay entries over a shared matrix. keys [E] int32 (the token an entry
    holds, -1 none); key_base [B] int64 (each request's first entry); offset: the table row of
    entry 0; size: entries per request (a power of two)."""

    keys: torch.Tensor
    key_base: torch.Tensor
    offset: int
    size: int

    def entries(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, n] int64 -> each request's entry for each token, [B, n] int64."""
        return self.key_base[:, None] + (tokens & (self.size - 1))


def draft_tree_reference(
    table: torch.Tensor,
    roots: torch.Tensor,
    parent: torch.Tensor,
    rank: torch.Tensor,
    level_starts: tuple[int, ...],
    row_base: torch.Tensor | None = None,
    overlay: "Overlay | None" = None,
    probs: torch.Tensor | None = None,
):
    """PyTorch reference.

    table [R, k] int32; roots [B] int; parent, rank [N+1] int64 (breadth-first, root first);
    row_base [B] int64 or None; overlay or None; probs [R, k] float16 or None (the
    successors' probabilities, ``AdjacencyMatrix.probs``).
    Returns tokens [B, N+1] int32 with tokens[:, 0] = roots; with probs, ``(tokens, conf)``:
    conf [B, N+1] float32, each node's probability under the row that drafted it,
    ``probs[row(parent), rank[node]]`` (1 at the root).
    """
    tokens = torch.empty((roots.shape[0], parent.shape[0]), dtype=torch.int32, device=table.device)
    tokens[:, 0] = roots
    conf = None
    if probs is not None:
        conf = torch.ones(tokens.shape, dtype=torch.float32, device=table.device)
    base = 0 if row_base is None else row_base[:, None]
    for d in range(1, len(level_starts) - 1):  # one gather per level, never per node
        s, e = level_starts[d], level_starts[d + 1]
        prev = tokens[:, parent[s:e]].long()
        rows = prev + base
        if overlay is not None:
            rows = _overlay_rows(overlay, prev, rows)
        tokens[:, s:e] = table[rows, rank[s:e]]
        if conf is not None:
            conf[:, s:e] = probs[rows, rank[s:e]].float()
    return tokens if conf is None else (tokens, conf)


def _overlay_rows(overlay: "Overlay", tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows [B, n], with each request's own overlay entry wherever its key holds the token."""
    entry = overlay.entries(tok)
    return torch.where(overlay.keys[entry] == tok, overlay.offset + entry, rows)


def _draft_tree_kernel(
    table_ptr, roots_ptr, base_ptr, rank_path_ptr, depth_ptr, out_ptr,
    keys_ptr, key_base_ptr, probs_ptr, conf_ptr,
    num_nodes, overlay_offset,
    stride_table, stride_roots, stride_base, stride_rank_path,
    stride_out_b, stride_out_n, stride_key_base,
    stride_probs, stride_conf_b, stride_conf_n,
    DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BASE: tl.constexpr,
    HAS_OVERLAY: tl.constexpr, OVERLAY_SIZE: tl.constexpr, HAS_PROBS: tl.constexpr,
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
    if HAS_OVERLAY:
        key_base = tl.load(key_base_ptr + b * stride_key_base).to(tl.int64)
    tok = tl.zeros([BLOCK_N], dtype=tl.int64) + root
    conf = tl.full([BLOCK_N], 1.0, tl.float32)  # the root's
    for d in tl.static_range(DEPTH):
        step = live & (depth > d)
        r = tl.load(rank_path_ptr + nodes * stride_rank_path + d, mask=step, other=0)
        row = base + tok
        if HAS_OVERLAY:
            entry = key_base + (tok & (OVERLAY_SIZE - 1))
            key = tl.load(keys_ptr + entry, mask=step, other=-1).to(tl.int64)
            row = tl.where(key == tok, overlay_offset + entry, row)
        nxt = tl.load(table_ptr + row * stride_table + r, mask=step, other=0)
        tok = tl.where(step, nxt.to(tl.int64), tok)
        if HAS_PROBS:
            final = step & (depth == d + 1)  # the node's own gather, from its parent's row
            p = tl.load(probs_ptr + row * stride_probs + r, mask=final, other=1.0)
            conf = tl.where(final, p.to(tl.float32), conf)
    tl.store(out_ptr + b * stride_out_b + nodes * stride_out_n, tok.to(tl.int32), mask=live)
    if HAS_PROBS:
        tl.store(conf_ptr + b * stride_conf_b + nodes * stride_conf_n, conf, mask=live)


def draft_tree_triton(
    table: torch.Tensor,
    roots: torch.Tensor,
    rank_path: torch.Tensor,
    depth: torch.Tensor,
    row_base: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    overlay: Overlay | None = None,
    probs: torch.Tensor | None = None,
):
    """Triton launcher: the whole batch in one launch, no host-device sync.

    table [R, k] int32; roots [B] int; rank_path [N+1, D] int (-1 padded) and depth [N+1] int,
    on the table's device; row_base [B] int or None; overlay or None (its keys int32 and
    key_base [B] int on the table's device); probs [R, k] float16 (the table's shape, unit
    column stride) or None.
    Returns tokens [B, N+1] int32; with probs, ``(tokens, conf)``: conf [B, N+1] float32 (see
    ``draft_tree_reference``).
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
    tokens = torch.empty((batch, n1), dtype=torch.int32, device=device)
    conf = None
    if probs is not None:
        if (tuple(probs.shape) != tuple(table.shape) or probs.dtype != torch.float16
                or probs.device != device or probs.stride(1) != 1):
            raise ValueError(
                f"probs: expected float16 {tuple(table.shape)} with unit column stride on {device}, "
                f"got {probs.dtype} {tuple(probs.shape)} strides {probs.stride()} on {probs.device}"
            )
        conf = torch.empty((batch, n1), dtype=torch.float32, device=device)
    key_base = None if overlay is None else overlay.key_base
    if overlay is not None and (overlay.keys.dtype != torch.int32 or overlay.keys.device != device
                                or overlay.size < 1 or overlay.size & (overlay.size - 1)):
        raise ValueError("overlay: expected int32 keys on the table's device and a power-of-two size")
    for name, t in (("roots", roots), ("row_base", row_base), ("overlay.key_base", key_base)):
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
            rank_path, depth, tokens,
            overlay.keys if overlay is not None else tokens,
            key_base if key_base is not None else roots,
            probs if probs is not None else table,
            conf if conf is not None else tokens,
            n1, overlay.offset if overlay is not None else 0,
            table.stride(0), roots.stride(0),
            row_base.stride(0) if row_base is not None else 0,
            rank_path.stride(0),
            tokens.stride(0), tokens.stride(1),
            key_base.stride(0) if key_base is not None else 0,
            probs.stride(0) if probs is not None else 0,
            conf.stride(0) if conf is not None else 0,
            conf.stride(1) if conf is not None else 0,
            DEPTH=rank_path.shape[1], BLOCK_N=block_n,
            HAS_BASE=row_base is not None,
            HAS_OVERLAY=overlay is not None, OVERLAY_SIZE=overlay.size if overlay is not None else 1,
            HAS_PROBS=probs is not None,
            num_warps=num_warps,
        )
    return tokens if conf is None else (tokens, conf)


def draft_tree(
    table: torch.Tensor,
    roots: torch.Tensor,
    tree,
    row_base: torch.Tensor | None = None,
    *,
    overlay: Overlay | None = None,
    probs: torch.Tensor | None = None,
):
    """Build the batch's draft trees: Triton when usable (``kernels.triton_usable``), else the
    C loop for CPU tensors (``native.draft``), else the reference.

    tree: a ``TreeTemplate`` (its parent, rank, level_starts, rank_path and depth), ideally on the
    table's device; row_base, overlay and probs as in ``draft_tree_reference`` (probs: to also
    return each node's confidence).
    Returns tokens [B, N+1] int32; with probs, ``(tokens, conf)``: conf [B, N+1] float32 (see
    ``draft_tree_reference``).
    """
    tensors = [t for t in (table, roots, row_base, probs) if t is not None]
    if overlay is not None:
        tensors += [overlay.keys, overlay.key_base]
    if triton_usable(*tensors):
        return draft_tree_triton(table, roots, tree.rank_path, tree.depth, row_base, overlay=overlay, probs=probs)
    if native.draft_takes(table, *tensors):
        return native.draft(table, roots, tree.parent, tree.rank, row_base, overlay, probs)
    return draft_tree_reference(
        table, roots, tree.parent, tree.rank, tree.level_starts, row_base, overlay, probs
    )
