"""Fused verification read: top-k and argmax of each logits row, scattered into the matrix.

For every verification row t (one per tree node of every request), ``table[rows[t]] =
top-k(logits[t])`` and ``argmax[t] = top-1(logits[t])``.

Rules, shared by the kernel and the reference:
- ties: among equal logits the lower token id ranks first (so argmax is the first maximum,
  as ``torch.argmax`` gives);
- duplicate rows (the same token at several nodes): the last row in order wins, i.e. the
  node latest in breadth-first order of the latest request in the batch.

The Triton kernel reads each logits row exactly once and writes nothing of size [T, V]:

- grid (T, S): program (t, s) scans split s of row t (S = 1 unless there are too few rows to fill
  the GPU, see ``_num_splits``) in BLOCK_V chunks and keeps a running top-k of K slots
  (unsorted, in registers). Per chunk: one max-reduction; only when the chunk's maximum can
  enter the list (it beats the list's worst entry in the (logit desc, id asc) order) the kernel
  repeatedly moves the chunk's best entry (max logit, then lowest id) over the list's worst,
  at most K times. After the first chunks this almost never happens, so the cost per element
  is a load, a convert to fp32 and a max.
- S > 1: each split stores its list into a small [T, S, KP] workspace and takes a ticket from
  a per-row atomic counter; the split that comes last merges the other lists into its own
  (the order above is a strict total order, so the result does not depend on which split is
  last) and finishes the row.
- finishing a row: each slot's rank is the number of slots that beat it (a K x K compare), which
  gives the ordered top-k (argmax = rank 0, the first maximum). The row is written into
  ``table[rows[t]]`` only if no later t' has rows[t'] == rows[t] (a scan of rows[t+1:] in
  BLOCK_T blocks, stopping at the first hit: O(T) int64 reads per row, from L2, e.g. ~80 KB on
  average at B = 256 with the 81-node tree), so for duplicates the last t in order wins, as in
  the reference, with no write race and no workspace.

Probabilities (optional ``probs`` / ``probs_out``): the same single pass keeps the row's
logsumexp online (a running maximum m and sum z of exp(logit - m), rescaled when m grows; splits
publish their (m, z) beside their lists and the merging split combines them), so each kept value
v gives exp(v - m) / z, stored as fp16 at its id's position under the same duplicate rule.

Logits are compared in fp32 (exact for fp16 / bf16 / fp32 inputs); rows holding NaN give
unspecified results in the kernel, and so do the probabilities of rows holding +inf or only -inf.
"""

from __future__ import annotations

import torch

from vllm_recycling.kernels import jit, native, next_power_of_2, triton_usable

tl = None  # triton.language, filled in by kernels.jit() when the kernel is first built
_insert = None  # triton.jit(_insert_impl), idem
_lse_merge = None  # triton.jit(_lse_merge_impl), idem

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_KERNEL_K = 64  # larger k goes to the reference: the running list lives in registers


def topk_update_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    topk_out: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference.

    logits [T, V] float (any dtype); rows [T] int64 (matrix row of each node's token);
    table [R, k] int32, updated in place; topk_out [T, k] int32, if given, receives every row's
    top-k. probs [R, k] float16, if given, is updated at the same rows with each successor's
    probability under its row, ``softmax(logits[t].float())[top-k id]``; probs_out [T, k]
    float16, if given, receives every row's. Returns argmax [T] int64.
    """
    top = topk_lowest_id_first(logits, table.shape[1])
    if topk_out is not None:
        topk_out.copy_(top)
    p = None
    if probs is not None or probs_out is not None:
        lf = logits.float()
        p = torch.exp(lf.gather(1, top) - torch.logsumexp(lf, dim=-1, keepdim=True))
        if probs_out is not None:
            probs_out.copy_(p)
    uniq, inverse = torch.unique(rows, return_inverse=True)
    order = torch.arange(rows.shape[0], device=rows.device)
    last = torch.zeros_like(uniq).scatter_reduce_(0, inverse, order, "amax", include_self=False)
    table[uniq] = top[last].to(table.dtype)
    if probs is not None:
        probs[uniq] = p[last].to(probs.dtype)
    return top[:, 0]


def topk_lowest_id_first(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k token ids [T, k] int64 of logits [T, V], ordered by (logit desc, token id asc).

    torch.topk leaves the order of ties unspecified and a stable full sort costs ~50x more, so
    take the top k + 1, put the first k in (value desc, id asc) order, and redo only the rows
    where a token outside the set may tie the k-th value (the (k+1)-th value equals it; there
    the lowest ids must win). No second pass over the row.
    """
    wide = min(k + 1, logits.shape[-1])
    values, ids = torch.topk(logits, wide, dim=-1)
    kth = values[:, k - 1 : k]
    outside_tie = values[:, k] == values[:, k - 1] if wide > k else torch.zeros_like(kth[:, 0], dtype=torch.bool)
    ids = _order_by_value_then_id(logits, ids[:, :k])
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



def _insert_impl(vals, ids, x, cid):
    """Move candidates (x [C] fp32, cid [C] int32; taken / padding: (-inf, 2**31-1)) into the
    running list (vals, ids [KP]) while the best candidate beats the list's worst entry."""
    big = 2147483647
    wv = tl.min(vals, 0)
    wid = tl.max(tl.where(vals == wv, ids, -big), 0)
    bv = tl.max(x, 0)
    if bv >= wv:
        bid = tl.min(tl.where(x == bv, cid, big), 0)
        while (bv > wv) | ((bv == wv) & (bid < wid)):
            hit = (vals == wv) & (ids == wid)
            vals = tl.where(hit, bv, vals)
            ids = tl.where(hit, bid, ids)
            taken = cid == bid
            x = tl.where(taken, float("-inf"), x)
            cid = tl.where(taken, big, cid)
            wv = tl.min(vals, 0)
            wid = tl.max(tl.where(vals == wv, ids, -big), 0)
            bv = tl.max(x, 0)
            bid = tl.min(tl.where(x == bv, cid, big), 0)
    return vals, ids


def _lse_merge_impl(m, z, m2, z2):
    """Merge two online logsumexp states (max m, sum z of exp(logit - m)) into one. While the
    maximum is still -inf (only -inf seen, z = 0) the sums are taken against 0, so that
    -inf - -inf never makes a NaN."""
    m_new = tl.maximum(m, m2)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, z * tl.exp(m - ref) + z2 * tl.exp(m2 - ref)


def _topk_update_kernel(
    logits_ptr, rows_ptr, table_ptr, argmax_ptr, topk_ptr, part_vals_ptr, part_ids_ptr, counter_ptr,
    probs_ptr, probs_out_ptr, part_lse_ptr,
    num_rows, vocab, chunks_per_split, num_splits,
    stride_lt, stride_lv, stride_rows, stride_table, stride_topk, stride_probs, stride_probs_out,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
    SPLIT: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_PROBS_OUT: tl.constexpr,
):
    big = 2147483647
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    s = tl.program_id(1)
    slot = tl.arange(0, KP)
    real = slot < K
    # Empty slots: (-inf, distinct ids above every token), beaten by any real entry; padding
    # slots (K..KP-1): (+inf, negative ids), never the worst, never ranked, never stored.
    vals = tl.where(real, float("-inf"), float("inf"))
    ids = tl.where(real, big - 1 - slot, -1 - slot)
    # Online logsumexp of the logits seen so far (probabilities only): max m, sum z of exp(x - m).
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.full([], 0.0, tl.float32)
    lanes = tl.arange(0, BLOCK_V)
    x_row = logits_ptr + t64 * stride_lt
    first = s * chunks_per_split * BLOCK_V
    stop = tl.minimum(first + chunks_per_split * BLOCK_V, vocab)
    for start in range(first, stop, BLOCK_V):
        # start is a multiple of BLOCK_V: tell the compiler, so that loads vectorize
        cid = tl.max_contiguous(tl.multiple_of(start + lanes, BLOCK_V), BLOCK_V)
        inside = cid < stop
        x = tl.load(x_row + cid.to(tl.int64) * stride_lv, mask=inside, other=float("-inf")).to(tl.float32)
        vals, ids = _insert(vals, ids, x, tl.where(inside, cid, big))
        if HAS_PROBS or HAS_PROBS_OUT:
            m_new = tl.maximum(m, tl.max(x, 0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            z = z * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), 0)  # masked lanes: exp(-inf) = 0
            m = m_new

    if SPLIT:
        # Publish this split's list, then the last split of the row to arrive merges them all.
        part = (t64 * num_splits + s) * KP + slot
        tl.store(part_vals_ptr + part, vals)
        tl.store(part_ids_ptr + part, ids)
        if HAS_PROBS or HAS_PROBS_OUT:
            tl.store(part_lse_ptr + (t64 * num_splits + s) * 2, m)
            tl.store(part_lse_ptr + (t64 * num_splits + s) * 2 + 1, z)
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel")
        owner = ticket == num_splits - 1
        if owner:
            for other in range(0, num_splits):
                if other != s:
                    part = (t64 * num_splits + other) * KP + slot
                    pv = tl.load(part_vals_ptr + part, mask=real, other=float("-inf"), cache_modifier=".cg")
                    pid = tl.load(part_ids_ptr + part, mask=real, other=big, cache_modifier=".cg")
                    keep = real & (pid < vocab)  # drop empty slots of short splits
                    vals, ids = _insert(vals, ids, tl.where(keep, pv, float("-inf")), tl.where(keep, pid, big))
                    if HAS_PROBS or HAS_PROBS_OUT:
                        other_lse = part_lse_ptr + (t64 * num_splits + other) * 2
                        m, z = _lse_merge(
                            m, z, tl.load(other_lse, cache_modifier=".cg"), tl.load(other_lse + 1, cache_modifier=".cg")
                        )
            tl.store(counter_ptr + t, 0)  # ready for reuse
    else:
        owner = True

    if owner:
        # Rank of each slot in (logit desc, id asc) order: how many real slots beat it.
        beats = (vals[None, :] > vals[:, None]) | ((vals[None, :] == vals[:, None]) & (ids[None, :] < ids[:, None]))
        rank = tl.sum((beats & real[None, :]).to(tl.int32), 1)
        tl.store(argmax_ptr + t64, tl.sum(tl.where(real & (rank == 0), ids, 0), 0).to(tl.int64))
        if HAS_TOPK:
            tl.store(topk_ptr + t64 * stride_topk + rank, ids, mask=real)
        if HAS_PROBS or HAS_PROBS_OUT:
            ref = tl.where(m == float("-inf"), 0.0, m)
            p = (tl.exp(tl.where(real, vals, float("-inf")) - ref) / z).to(tl.float16)
        if HAS_PROBS_OUT:
            tl.store(probs_out_ptr + t64 * stride_probs_out + rank, p, mask=real)
        # Duplicate rows: only the last t holding a row writes it.
        row = tl.load(rows_ptr + t64 * stride_rows).to(tl.int64)
        later = t * 0  # an int32 scalar tensor, not a Python int
        nxt = t + 1
        while (nxt < num_rows) & (later == 0):
            offs = nxt + tl.arange(0, BLOCK_T)
            live = offs < num_rows
            other_rows = tl.load(rows_ptr + offs.to(tl.int64) * stride_rows, mask=live, other=-1)
            later = tl.sum(((other_rows.to(tl.int64) == row) & live).to(tl.int32), 0)
            nxt += BLOCK_T
        last = (slot * 0 + later) == 0  # as a [KP] vector: the interpreter mistypes bool [KP] & bool []
        tl.store(table_ptr + row * stride_table + rank, ids, mask=real & last)
        if HAS_PROBS:
            tl.store(probs_ptr + row * stride_probs + rank, p, mask=real & last)


_SM_COUNT: dict[int, int] = {}


def _num_splits(num_rows: int, num_chunks: int, device: torch.device) -> int:
    """Splits per row: enough programs for ~4 per SM when rows are few (small batches), 1 when
    they are many or under the interpreter (which runs programs one by one anyway)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(num_chunks, (4 * _SM_COUNT[index]) // max(num_rows, 1)))


def topk_update_triton(
    logits: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    argmax_out: torch.Tensor | None = None,
    topk_out: torch.Tensor | None = None,
    block_v: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    block_t: int = 1024,
    probs: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher (one launch, no host-device sync): ``table[rows[t]] = topk(logits[t])``
    with the last t winning among duplicate rows; returns argmax [T] int64 (into ``argmax_out``
    when given). ``topk_out`` [T, k] int32, optional: every row's ordered top-k ids (duplicates
    included), for tests and callers that want them. The plugin passes neither buffer yet: they
    are for a GPU path with persistent buffers.
    probs [R, k] float16 (the table's shape), optional: updated at the same rows, with the same
    duplicate rule, with each kept id's probability ``softmax(logits[t])[id]``; probs_out [T, k]
    float16, optional: every row's. Both need a unit column stride.

    logits [T, V] fp32 / bf16 / fp16 (any strides); rows [T] int (table row of each logits row);
    table [R, k] int32 with unit column stride and 1 <= k <= min(V, MAX_KERNEL_K).
    block_v / splits / num_warps: tuning knobs (defaults: 2048 / ``_num_splits`` / 4 on GPU).
    """
    if logits.dim() != 2 or logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"logits: expected [T, V] fp32/bf16/fp16, got {logits.dtype} {tuple(logits.shape)}")
    if table.dim() != 2 or table.dtype != torch.int32 or table.stride(1) != 1:
        raise ValueError(f"table: expected [R, k] int32 with unit column stride, got {table.dtype} {tuple(table.shape)}")
    num_rows, vocab = logits.shape
    k = table.shape[1]
    if not 1 <= k <= min(vocab, MAX_KERNEL_K):
        raise ValueError(f"k = {k}: the kernel needs 1 <= k <= min(V = {vocab}, {MAX_KERNEL_K})")
    if rows.shape != (num_rows,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows: expected [{num_rows}] int, got {rows.dtype} {tuple(rows.shape)}")
    device = logits.device
    if rows.device != device or table.device != device:
        raise ValueError(f"logits, rows, table on {device}, {rows.device}, {table.device}: expected one device")
    if argmax_out is None:
        argmax_out = torch.empty(num_rows, dtype=torch.int64, device=device)
    elif argmax_out.shape != (num_rows,) or argmax_out.dtype != torch.int64 or argmax_out.device != device:
        raise ValueError(f"argmax_out: expected int64 [{num_rows}] on {device}")
    if topk_out is not None and (
        topk_out.shape != (num_rows, k) or topk_out.dtype != torch.int32 or topk_out.device != device
        or topk_out.stride(1) != 1
    ):
        raise ValueError(f"topk_out: expected int32 [{num_rows}, {k}] with unit column stride on {device}")
    for name, buf, shape in (("probs", probs, tuple(table.shape)), ("probs_out", probs_out, (num_rows, k))):
        if buf is not None and (
            tuple(buf.shape) != shape or buf.dtype != torch.float16 or buf.device != device or buf.stride(1) != 1
        ):
            raise ValueError(
                f"{name}: expected float16 {list(shape)} with unit column stride on {device}, "
                f"got {buf.dtype} {tuple(buf.shape)} strides {buf.stride()} on {buf.device}"
            )
    if num_rows == 0:
        return argmax_out
    interpreted = device.type != "cuda"
    if block_v is None:
        # The interpreter pays per operation, not per element: take big chunks there.
        block_v = min(next_power_of_2(vocab), 16384 if interpreted else 2048)
    num_chunks = -(-vocab // block_v)
    if splits is None:
        splits = _num_splits(num_rows, num_chunks, device)
    chunks_per_split = -(-num_chunks // max(1, min(splits, num_chunks)))
    splits = -(-num_chunks // chunks_per_split)  # no empty split
    kp = max(2, next_power_of_2(k))
    if splits > 1:
        part_vals = torch.empty((num_rows, splits, kp), dtype=torch.float32, device=device)
        part_ids = torch.empty((num_rows, splits, kp), dtype=torch.int32, device=device)
        counter = torch.zeros(num_rows, dtype=torch.int32, device=device)
    else:
        part_vals = part_ids = counter = argmax_out  # unused
    lse = probs is not None or probs_out is not None
    if splits > 1 and lse:
        part_lse = torch.empty((num_rows, splits, 2), dtype=torch.float32, device=device)  # (m, z)
    else:
        part_lse = part_vals  # unused
    kernel = jit(_topk_update_kernel, helpers={"_insert": _insert_impl, "_lse_merge": _lse_merge_impl})
    kernel[(num_rows, splits)](
        logits, rows, table, argmax_out, topk_out if topk_out is not None else argmax_out,
        part_vals, part_ids, counter,
        probs if probs is not None else table, probs_out if probs_out is not None else table, part_lse,
        num_rows, vocab, chunks_per_split, splits,
        logits.stride(0), logits.stride(1), rows.stride(0), table.stride(0),
        topk_out.stride(0) if topk_out is not None else 0,
        probs.stride(0) if probs is not None else 0,
        probs_out.stride(0) if probs_out is not None else 0,
        K=k, KP=kp, BLOCK_V=block_v, BLOCK_T=block_t, SPLIT=splits > 1, HAS_TOPK=topk_out is not None,
        HAS_PROBS=probs is not None, HAS_PROBS_OUT=probs_out is not None,
        num_warps=num_warps or 4,
    )
    return argmax_out


def topk_update(
    logits: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    topk_out: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Update ``table`` (and ``probs``, the successors' probabilities, when given) from the
    verification logits; returns the argmax of each row, and writes every row's top-k [T, k]
    int32 into ``topk_out`` and its probabilities [T, k] float16 into ``probs_out`` when given.

    Triton when usable (``kernels.triton_usable``) and the kernel takes the input (fp32 / bf16 /
    fp16 logits, k <= MAX_KERNEL_K, float16 probability buffers with unit column stride); else
    the C kernel for CPU tensors it takes (``native``); the PyTorch reference otherwise.
    """
    buffers = [b for b in (probs, probs_out) if b is not None]
    if (
        triton_usable(logits, rows, table, *buffers)
        and logits.dim() == 2
        and logits.dtype in KERNEL_DTYPES
        and rows.dtype in (torch.int32, torch.int64)
        and table.shape[1] <= min(MAX_KERNEL_K, logits.shape[-1])
        and table.stride(-1) == 1
        and all(b.dtype == torch.float16 and b.stride(-1) == 1 for b in buffers)
    ):
        return topk_update_triton(
            logits, rows, table, topk_out=topk_out, probs=probs, probs_out=probs_out
        )
    if (
        rows.dim() == 1
        and (topk_out is None or topk_out.dtype == torch.int32 and topk_out.is_contiguous())
        and native.takes(logits, table, probs, probs_out)
    ):
        return native.update(logits, rows, table, probs, topk_out, probs_out)
    return topk_update_reference(logits, rows, table, topk_out, probs, probs_out)
