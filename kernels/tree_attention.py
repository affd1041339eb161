"""Tree attention over vLLM's paged KV cache: every draft node attends its request's prefix and
its own ancestors in the tree.

Layout (vLLM 0.32's Triton backend). ``kv_cache`` is one layer's cache as the logical view
``[num_blocks, H_kv, block_size, 2 * D]``, any strides: for block b, key/value head h and offset
o, ``kv_cache[b, h, o, :D]`` is the key and ``kv_cache[b, h, o, D:]`` the value. Position p of
batch request i lives in block ``block_table[i, p // block_size]`` at offset ``p % block_size``.

A step has R tree requests, W = ``rows.shape[1]`` (the widest tree, root included):
req_index [R] int64 (each tree request's batch index, its row of ``block_table``); rows [R, W]
int64 (the query / output row of local node j; padding anywhere valid); num_rows [R] int64
(nodes + root scheduled, local nodes j < num_rows exist); prefix_len [R] int64 (tokens cached
before this step, the root's position); mask [R, W, W] bool (mask[r, i, j]: local node j is node
i or one of its ancestors, both existing). This step's keys and values are already in the cache:
local node j of request r sits at position ``prefix_len[r] + j`` (vLLM wrote the slots of
prefix + j before the forward), so ancestors are read from the cache like the prefix.

For every tree request r, every local node 1 <= i < num_rows[r] and every query head h (key/value
head h // (H // H_kv)), ``output[rows[r, i], h]`` becomes the softmax attention of
``query[rows[r, i], h]`` (scores ``scale * q . k``) over the keys at positions
``0 .. prefix_len[r] - 1`` and ``prefix_len[r] + j`` for every j with ``mask[r, i, j]``. Nothing
else of ``output`` is written: the roots (i = 0) keep the causal result vLLM computed, and so do
the rows of other requests. Accumulation in float32, stored in the output's dtype (float32,
float16 or bfloat16).

The Triton kernel does it in one launch with no host synchronisation and no allocation: grid
(R * cdiv(W, BLOCK_ROWS), H_kv), one program per (request, tile of BLOCK_ROWS local rows, key/value
head). Its query tile stacks the G = H / H_kv query heads of its key/value head under each row
(M = BLOCK_ROWS * G_PAD rows, G padded to a power of two, D padded to BLOCK_D), so every key and
value tile loaded serves all of them. Phase 1 walks the prefix in tiles of BLOCK_N positions (block
ids looked up per position), phase 2 this step's nodes (positions prefix + j, visibility
mask[r, i, j], -inf where hidden); both feed one online softmax (running max, sum and
accumulator in float32, exp2 with log2(e) folded into the scale). Scores and the P @ V product
use ``tl.dot``: q and k in the cache's dtype (float32 at ``input_precision="ieee"``, no TF32),
p cast to the value dtype (under Triton's interpreter, whose ``tl.dot`` cannot multiply
bfloat16, a bfloat16 cache is multiplied in float32 instead). Programs whose rows are all
padding or roots run empty loops and store nothing. Block ids and rows are widened to int64
before they multiply a stride. Tile sizes: ``_tile_defaults``.
"""

from __future__ import annotations

import math

import torch

from vllm_recycling.kernels import jit, next_power_of_2, triton_mode, triton_usable

tl = None  # triton.language, filled in by kernels.jit() when the kernel is first built
_softmax_step = None  # triton.jit(_softmax_step_impl), idem
_dot = None  # triton.jit(_dot_impl), idem

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = math.log2(math.e)


def tree_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_index: torch.Tensor,
    rows: torch.Tensor,
    num_rows: torch.Tensor,
    prefix_len: torch.Tensor,
    mask: torch.Tensor,
    output: torch.Tensor,
    scale: float,
) -> None:
    """PyTorch reference (the kernel's test oracle): per request, gather its keys and values
    from the cache with the block table, dense masked softmax in float32, write the node rows.
    Arguments as ``tree_attention``."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    for r in range(req_index.shape[0]):
        b, n, prefix = int(req_index[r]), int(num_rows[r]), int(prefix_len[r])
        if n < 2:
            continue
        positions = torch.arange(prefix + n, device=kv_cache.device)
        blocks = block_table[b, positions // block_size].long()
        entries = kv_cache[blocks, :, positions % block_size].float()  # [P + n, H_kv, 2D]
        keys = entries[..., :head_dim].repeat_interleave(group, dim=1)  # [P + n, H, D]
        values = entries[..., head_dim : 2 * head_dim].repeat_interleave(group, dim=1)
        node_rows = rows[r, 1:n].long()
        q = query[node_rows].float()  # [n - 1, H, D]
        scores = torch.einsum("ihd,lhd->hil", q, keys) * scale  # [H, n - 1, P + n]
        allowed = torch.cat(
            [torch.ones((n - 1, prefix), dtype=torch.bool, device=mask.device), mask[r, 1:n, :n].bool()],
            dim=1,
        )
        scores = scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))
        out = torch.einsum("hil,lhd->ihd", torch.softmax(scores, dim=-1), values)
        output[node_rows] = out.to(output.dtype)


def _dot_impl(a, b):
    """a @ b accumulated in float32; float32 operands in IEEE precision (never TF32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


def _softmax_step_impl(s, v, m_i, l_i, acc):
    """One online-softmax update: s [M, N] log2-scaled scores (-inf: hidden), v [N, BLOCK_D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


def _tree_attention_kernel(
    q_ptr, kv_ptr, bt_ptr, req_ptr, rows_ptr, nrows_ptr, prefix_ptr, mask_ptr, out_ptr,
    qk_scale, tiles,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_ko, stride_kd,
    stride_bt_b, stride_bt_n, stride_req, stride_rows_r, stride_rows_j, stride_nrows,
    stride_prefix, stride_mask_r, stride_mask_i, stride_mask_j, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid (R * tiles, H_kv): program (r * tiles + t, h) computes local rows t*BLOCK_ROWS ...
    of tree request r for the query heads of key/value head h."""
    pid = tl.program_id(0)
    r = (pid // tiles).to(tl.int64)
    first = (pid % tiles) * BLOCK_ROWS
    kv_head = tl.program_id(1).to(tl.int64)
    M: tl.constexpr = BLOCK_ROWS * GROUP_PAD
    m = tl.arange(0, M)
    local = first + m // GROUP_PAD  # local node of each query-tile row
    g = m % GROUP_PAD
    num_rows = tl.load(nrows_ptr + r * stride_nrows).to(tl.int64)
    prefix = tl.load(prefix_ptr + r * stride_prefix).to(tl.int64)
    batch = tl.load(req_ptr + r * stride_req).to(tl.int64)
    live = (local >= 1) & (local < num_rows) & (g < GROUP)
    # all-padding or root-only tiles: empty loops, nothing stored
    busy = (first < num_rows) & (first + BLOCK_ROWS > 1)
    prefix_end = tl.where(busy, prefix, 0)
    nodes_end = tl.where(busy, num_rows, 0)

    row = tl.load(rows_ptr + r * stride_rows_r + local * stride_rows_j, mask=live, other=0).to(tl.int64)
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=live[:, None] & d_ok[None, :], other=0.0,
    )
    if UPCAST:  # the interpreter's tl.dot cannot take bfloat16 (numpy has none)
        q = q.to(tl.float32)
    else:
        q = q.to(kv_ptr.dtype.element_ty)
    bt_row = bt_ptr + batch * stride_bt_b
    kv_base = kv_ptr + kv_head * stride_kh
    n = tl.arange(0, BLOCK_N)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, BLOCK_D], dtype=tl.float32)

    # phase 1: the prefix, positions 0 .. prefix - 1, visible to every node
    for start in range(0, prefix_end, BLOCK_N):
        pos = start + n.to(tl.int64)
        ok = pos < prefix
        block = tl.load(bt_row + (pos // KV_BLOCK) * stride_bt_n, mask=ok, other=0).to(tl.int64)
        slot = block * stride_kb + (pos % KV_BLOCK) * stride_ko  # [BLOCK_N]
        k_t = tl.load(kv_base + slot[None, :] + d[:, None] * stride_kd,
                      mask=d_ok[:, None] & ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(kv_base + slot[:, None] + (d[None, :] + HEAD_DIM) * stride_kd,
                    mask=ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        s = _dot(q, k_t) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)

    # phase 2: this step's nodes, position prefix + j, visible where mask[r, i, j]
    mask_rows = mask_ptr + r * stride_mask_r + local[:, None] * stride_mask_i
    for start in range(0, nodes_end, BLOCK_N):
        j = start + n.to(tl.int64)
        ok = j < num_rows
        pos = prefix + j
        block = tl.load(bt_row + (pos // KV_BLOCK) * stride_bt_n, mask=ok, other=0).to(tl.int64)
        slot = block * stride_kb + (pos % KV_BLOCK) * stride_ko
        k_t = tl.load(kv_base + slot[None, :] + d[:, None] * stride_kd,
                      mask=d_ok[:, None] & ok[None, :], other=0.0)
        v = tl.load(kv_base + slot[:, None] + (d[None, :] + HEAD_DIM) * stride_kd,
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        seen = tl.load(mask_rows + j[None, :] * stride_mask_j, mask=live[:, None] & ok[None, :], other=0)
        s = _dot(q, k_t) * qk_scale
        s = tl.where(seen != 0, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :],
    )


def _tile_defaults(dtype: torch.dtype, block_d: int) -> tuple[int, int, int]:
    """(query-tile rows M, BLOCK_N, num_warps) by default. Chosen so that ptxas (Triton 3.9,
    sm_80 / sm_90, compiled ahead of time without a GPU) keeps the kernel in registers with no
    or a few bytes of spills: 16-bit caches use tensor cores and afford M = 64; float32 in IEEE
    precision is FMA work on full tiles in registers, hence M = 16."""
    if dtype == torch.float32:
        return 16, 32 if block_d <= 64 else 16, 4
    if block_d <= 128:
        return 64, 32, 4
    return 64, 16, 8


def _check(query, kv_cache, block_table, req_index, rows, num_rows, prefix_len, mask, output):
    """Shape / dtype / device checks (no host synchronisation); raises ValueError."""
    if query.dim() != 3 or query.stride(2) != 1 or query.dtype not in KERNEL_DTYPES:
        raise ValueError(f"query: expected [T, H, D] float32/float16/bfloat16 with unit last stride, "
                         f"got {query.dtype} {tuple(query.shape)} strides {query.stride()}")
    heads, dim = query.shape[1], query.shape[2]
    if (output.shape != query.shape or output.dtype != query.dtype or output.stride(2) != 1
            or output.device != query.device):
        raise ValueError(f"output: expected {query.dtype} {tuple(query.shape)} with unit last stride on "
                         f"{query.device}, got {output.dtype} {tuple(output.shape)} strides {output.stride()} "
                         f"on {output.device}")
    if kv_cache.dim() != 4 or kv_cache.shape[3] != 2 * dim or kv_cache.dtype not in KERNEL_DTYPES:
        raise ValueError(f"kv_cache: expected [num_blocks, H_kv, block_size, {2 * dim}] float32/float16/"
                         f"bfloat16, got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    if kv_cache.shape[1] < 1 or heads % kv_cache.shape[1]:
        raise ValueError(f"{heads} query heads do not share {kv_cache.shape[1]} key/value heads evenly")
    if block_table.dim() != 2:
        raise ValueError(f"block_table: expected [B, max_blocks], got {tuple(block_table.shape)}")
    num_req = req_index.shape[0]
    if rows.dim() != 2 or rows.shape[0] != num_req:
        raise ValueError(f"rows: expected [{num_req}, W], got {tuple(rows.shape)}")
    width = rows.shape[1]
    for name, t in (("num_rows", num_rows), ("prefix_len", prefix_len)):
        if tuple(t.shape) != (num_req,):
            raise ValueError(f"{name}: expected [{num_req}], got {tuple(t.shape)}")
    if tuple(mask.shape) != (num_req, width, width):
        raise ValueError(f"mask: expected [{num_req}, {width}, {width}], got {tuple(mask.shape)}")
    devices = {t.device for t in (query, kv_cache, block_table, req_index, rows, num_rows, prefix_len, mask, output)}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")


def tree_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_index: torch.Tensor,
    rows: torch.Tensor,
    num_rows: torch.Tensor,
    prefix_len: torch.Tensor,
    mask: torch.Tensor,
    output: torch.Tensor,
    scale: float,
    block_rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Triton launcher: the whole step in one launch, no host-device sync, no allocation.
    Arguments as ``tree_attention``; block_rows (local rows per program, a power of two with
    BLOCK_ROWS * G_PAD >= 16), block_n (keys per tile, a power of two >= 16) and num_warps
    override the defaults (``_tile_defaults``)."""
    _check(query, kv_cache, block_table, req_index, rows, num_rows, prefix_len, mask, output)
    heads, dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    num_req, width = rows.shape
    if num_req == 0 or width == 0 or query.shape[0] == 0:
        return
    group = heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_d = max(16, next_power_of_2(dim))
    least = -(-16 // group_pad)  # tl.dot needs M >= 16
    rows_target, n_default, warps_default = _tile_defaults(kv_cache.dtype, block_d)
    if block_rows is None:  # no more local rows than the widest tree has
        block_rows = max(least, min(max(1, rows_target // group_pad), next_power_of_2(width)))
    if block_n is None:
        block_n = n_default
    if num_warps is None:
        num_warps = warps_default
    if block_rows < least or block_rows & (block_rows - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_rows {block_rows} (a power of two, times {group_pad} >= 16) or "
                         f"block_n {block_n} (a power of two >= 16)")
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same bytes, a plain integer load in the kernel
    tiles = -(-width // block_rows)
    kernel = jit(_tree_attention_kernel, helpers={"_softmax_step": _softmax_step_impl, "_dot": _dot_impl})
    kernel[(num_req * tiles, num_kv_heads)](
        query, kv_cache, block_table, req_index, rows, num_rows, prefix_len, mask, output,
        float(scale) * LOG2E, tiles,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0), block_table.stride(1), req_index.stride(0),
        rows.stride(0), rows.stride(1), num_rows.stride(0), prefix_len.stride(0),
        mask.stride(0), mask.stride(1), mask.stride(2), output.stride(0), output.stride(1),
        HEAD_DIM=dim, BLOCK_D=block_d, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_ROWS=block_rows, BLOCK_N=block_n, KV_BLOCK=block_size,
        UPCAST=kv_cache.dtype == torch.bfloat16 and triton_mode() == "interpreted",
        num_warps=num_warps,
    )


def tree_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_index: torch.Tensor,
    rows: torch.Tensor,
    num_rows: torch.Tensor,
    prefix_len: torch.Tensor,
    mask: torch.Tensor,
    output: torch.Tensor,
    scale: float,
) -> None:
    """Overwrite the node rows of ``output`` [T, H, D] with tree attention (see the module
    docstring): Triton when usable (``kernels.triton_usable``), else the PyTorch reference.

    query [T, H, D] (after RoPE, unit last stride); kv_cache [num_blocks, H_kv, block_size, 2D]
    (the logical view, any strides; this step's keys and values already written at positions
    prefix_len + j); block_table [B, max_blocks] int32; req_index, num_rows, prefix_len [R] int64;
    rows [R, W] int64; mask [R, W, W] bool; scale: the softmax scale.
    """
    if triton_usable(query, kv_cache, block_table, req_index, rows, num_rows, prefix_len, mask, output):
        tree_attention_triton(query, kv_cache, block_table, req_index, rows, num_rows, prefix_len,
                              mask, output, scale)
    else:
        tree_attention_reference(query, kv_cache, block_table, req_index, rows, num_rows, prefix_len,
                                 mask, output, scale)


# self_check's template, breadth-first: root 0; 1, 2, 3 under it; 4, 5 under 1; 6 under 2;
# 7 under 4; 8 under 6.
_CHECK_PARENT = (-1, 0, 0, 0, 1, 1, 2, 4, 6)


def self_check(device: torch.device | str, dtype: torch.dtype = torch.float16) -> float:
    """Run ``tree_attention_triton`` and the reference on a small random case on ``device``
    and return the largest absolute difference of their outputs (inf when either holds a NaN).

    Two tree requests with different ancestor-closed subtrees of a 9-node template (one cut to
    its first nodes), a chain request between them that must stay untouched, GQA with H = 4,
    H_kv = 2, D = 64, block size 16, prefixes of 37 and 130 tokens (crossing blocks), shuffled
    block ids, and a cache allocated [num_blocks, block_size, H_kv, 2D] seen through the
    logical view.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(1234)
    heads, kv_heads, dim, block_size = 4, 2, 64, 16
    trees = [(37, [0, 1, 2, 3, 4, 5, 6, 7, 8]), (130, [0, 2, 3, 6, 8])]  # (prefix, template nodes)
    chain_rows = 3
    blocks_needed = [-(-(prefix + len(nodes)) // block_size) for prefix, nodes in trees]
    max_blocks = max(blocks_needed) + 1
    num_blocks = 3 * max_blocks + 5  # a few never referenced
    ids = torch.randperm(num_blocks, generator=g)
    block_table = ids[: 3 * max_blocks].view(3, max_blocks).to(torch.int32)  # batch: tree, chain, tree
    widths = [len(nodes) for _, nodes in trees]
    width = max(widths)
    roots = [0, widths[0] + chain_rows]
    total = roots[1] + widths[1] + 2  # two rows of padding at the end
    rows = torch.zeros((2, width), dtype=torch.int64)
    mask = torch.zeros((2, width, width), dtype=torch.bool)
    for r, (_, nodes) in enumerate(trees):
        n = len(nodes)
        rows[r] = roots[r] + torch.arange(width).clamp(max=n - 1)
        for i, node in enumerate(nodes):
            chain = {node}
            while _CHECK_PARENT[node] >= 0:
                node = _CHECK_PARENT[node]
                chain.add(node)
            for j, other in enumerate(nodes):
                mask[r, i, j] = other in chain
    physical = torch.randn((num_blocks, block_size, kv_heads, 2 * dim), generator=g)
    kv_cache = physical.to(device=device, dtype=dtype).permute(0, 2, 1, 3)
    query = torch.randn((total, heads, dim), generator=g).to(device=device, dtype=dtype)
    before = torch.randn((total, heads, dim), generator=g).to(device=device, dtype=dtype)
    args = (
        query, kv_cache, block_table.to(device),
        torch.tensor([0, 2], device=device), rows.to(device),
        torch.tensor(widths, device=device), torch.tensor([p for p, _ in trees], device=device),
        mask.to(device),
    )
    got, want = before.clone(), before.clone()
    scale = dim ** -0.5
    tree_attention_triton(*args, got, scale)
    tree_attention_reference(*args, want, scale)
    diff = (got.float() - want.float()).abs()
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    return float(diff.max())
