"""The GPU path's pieces that need no engine: the engine settings it forces on CUDA (and leaves
alone when it refuses), the layers it refuses, the KV move through vLLM's logical view, and the CPU switch's preconditions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm_recycling import patches, triton_path  # noqa: E402  (needs vLLM)
from vllm_recycling.config import RecyclingConfigError  # noqa: E402


def _engine_args(backend=None, config_backend=None, mode=None):
    from vllm.config import AttentionConfig, CompilationConfig

    return SimpleNamespace(
        attention_backend=backend,
        attention_config=AttentionConfig(backend=config_backend),
        compilation_config=CompilationConfig(cudagraph_mode=mode),
    )


def test_engine_settings_default_to_triton_attention_and_piecewise_graphs():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    args = _engine_args()
    triton_path.engine_settings(args)
    assert args.attention_backend == AttentionBackendEnum.TRITON_ATTN
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("mode", ["PIECEWISE", "NONE"])
def test_engine_settings_keep_a_user_choice_that_works(mode):
    from vllm.config.compilation import CUDAGraphMode

    args = _engine_args(backend="TRITON_ATTN", mode=mode)
    triton_path.engine_settings(args)
    assert args.attention_backend == "TRITON_ATTN"
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode[mode]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(backend="FLASH_ATTN"), "attention_backend is FLASH_ATTN"),
        (dict(config_backend="FLASHINFER"), "attention_backend is AttentionBackendEnum.FLASHINFER"),
        (dict(mode="FULL_AND_PIECEWISE"), "cudagraph_mode is FULL_AND_PIECEWISE"),
        (dict(mode="FULL_DECODE_ONLY"), "cudagraph_mode is FULL_DECODE_ONLY"),
    ],
)
def test_engine_settings_refuse_what_would_skip_the_tree_pass(kwargs, named):
    from vllm_recycling.support import TreesUnsupported

    with pytest.raises(TreesUnsupported, match="tree verification on GPUs needs") as err:
        triton_path.engine_settings(_engine_args(**kwargs))
    assert named in err.value.why
    assert isinstance(err.value, RecyclingConfigError)


@pytest.mark.parametrize(
    "kwargs",
    [dict(mode="FULL_AND_PIECEWISE"), dict(mode="FULL"), dict(backend="FLASH_ATTN"),
     dict(config_backend="FLASHINFER")],
)
def test_engine_settings_refusal_leaves_the_engine_args_as_they_were(kwargs):
    """Review C1: everything is checked before anything is set, so the chain a refusal falls
    back to does not run on a forced TRITON_ATTN (before the fix a FULL graph mode refused
    after the backend had been set)."""
    args = _engine_args(**kwargs)
    before = (args.attention_backend, args.attention_config.backend, args.compilation_config.cudagraph_mode)
    with pytest.raises(RecyclingConfigError):
        triton_path.engine_settings(args)
    after = (args.attention_backend, args.attention_config.backend, args.compilation_config.cudagraph_mode)
    assert after == before


def _impl(**overrides):
    impl = dict(
        kv_cache_dtype="auto", kv_sharing_target_layer_name=None, alibi_slopes=None,
        logits_soft_cap=None, sinks=None, sliding_window=None, head_size=64,
    )
    impl.update(overrides)
    return SimpleNamespace(**impl)


@pytest.mark.parametrize(
    "overrides, layer, named",
    [
        ({}, {}, None),
        (dict(kv_cache_dtype="fp8"), {}, "kv_cache_dtype='fp8'"),
        (dict(kv_sharing_target_layer_name="model.layers.0.attn"), {}, "share another layer"),
        (dict(sliding_window=(511, 0)), {}, "sliding-window"),
        (dict(logits_soft_cap=30.0), {}, "soft-capping"),
        (dict(sinks=torch.zeros(2)), {}, "sinks"),
        ({}, dict(attn_type="encoder"), "attention type 'encoder'"),
        ({}, dict(head_size_v=128), "value head size"),
    ],
)
def test_unsupported_layer_names_what_it_refuses(overrides, layer, named):
    from vllm_recycling.support import unsupported_layer

    why = unsupported_layer(_impl(**overrides), SimpleNamespace(**{"attn_type": "decoder", **layer}))
    if named is None:
        assert why is None
    else:
        assert named in why


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC"])
def test_move_slots_through_the_logical_view(physical):
    blocks, heads, block_size, dim = 5, 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    if physical == "LBNHC":  # [blocks, block_size, heads, 2D] seen as [blocks, heads, block_size, 2D]
        storage = torch.randn(blocks, block_size, heads, 2 * dim, generator=gen)
        kv = storage.transpose(1, 2)
    else:
        storage = torch.randn(blocks, heads, block_size, 2 * dim, generator=gen)
        kv = storage
    before = kv.clone()
    slot = lambda s: (s // block_size, s % block_size)  # noqa: E731
    # a swap, a chain of moves and a no-op: every source is read before any write
    src = torch.tensor([3, 9, 17, 6, 12])
    dst = torch.tensor([9, 3, 18, 7, 12])
    triton_path.move_slots(kv, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(kv[slot(d)[0], :, slot(d)[1]], before[slot(s)[0], :, slot(s)[1]])
    untouched = set(range(blocks * block_size)) - set(dst.tolist())
    for u in untouched:
        assert torch.equal(kv[slot(u)[0], :, slot(u)[1]], before[slot(u)[0], :, slot(u)[1]])


def test_gpu_path_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        patches.use_triton_attention_on_cpu()


def test_gpu_path_switch(monkeypatch):
    for value, on in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv(triton_path.GPU_PATH_ON_CPU_ENV, value)
        assert triton_path.requested_on_cpu() is on
