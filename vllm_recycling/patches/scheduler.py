"""The engine core: its requests, its scheduler and its step loop."""

from __future__ import annotations

import copy

from vllm_recycling.matrix import CACHE_SALT_KEY
from vllm_recycling.patches.base import DRAFTS_ATTR, MethodPatch


class TagCacheSalt(MethodPatch):
    """``Request.__init__`` (v1/request.py:61-185), in the engine core: every request, from
    ``Request.from_engine_core_request`` (v1/request.py:246-270).

    vLLM keeps a request's ``cache_salt`` (request.py:185) in the scheduler, for its prefix-cache
    block hashes; the workers never see it: ``NewRequestData`` (v1/core/sched/output.py:40-75)
    carries the ``sampling_params`` but no salt. The wrapper writes the salt into a copy of the
    request's ``SamplingParams`` as ``extra_args[matrix.CACHE_SALT_KEY]``
    (sampling_params.py:412: free-form arguments for plugins), which reaches the model runner's
    ``requests[req_id].sampling_params``; ``matrix_scope="salt"`` reads it there
    (``slots.MatrixSlots.note_salts``). A value a client put under that key itself is dropped,
    so nobody can claim another tenant's salt without knowing it. The copy leaves a
    ``SamplingParams`` that callers share across prompts untouched.
    """

    target = "vllm.v1.request:Request.__init__"
    signature = (
        "(self, request_id, prompt_token_ids, sampling_params, pooling_params, client_index=0, "
        "arrival_time=None, prompt_embeds=None, prompt_is_token_ids=None, mm_features=None, "
        "lora_request=None, cache_salt=None, priority=0, trace_headers=None, block_hasher=None, "
        "resumable=False, session_id=None, reasoning_ended=None, reasoning_parser_kwargs=None, "
        "abort_immediately=False, kv_hints=None)"
    )

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


# Set on the scheduler by DraftsFromSampledOutput, read and cleared by SkipDraftRpc.
DELIVERED_ATTR = "recycling_drafts_delivered"


class DraftsFromSampledOutput(MethodPatch):
    """``Scheduler.update_from_output`` (v1/core/sched/scheduler.py:2026-2030), in the engine
    core, called by ``EngineCore.step`` (v1/engine/core.py:680-682) with the output of
    ``sample_tokens``. When that output carries drafts (``DraftsWithSampledTokens``) the
    wrapper hands them to ``update_draft_token_ids`` (2550-2569) after the step's own update,
    in the order ``post_step`` would have (it runs after ``step``), and tells ``SkipDraftRpc``
    that this step's drafts arrived."""

    target = "vllm.v1.core.sched.scheduler:Scheduler.update_from_output"
    signature = "(self, scheduler_output, model_runner_output)"

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

    target = "vllm.v1.engine.core:EngineCore.post_step"
    signature = "(self, model_executed)"

    @staticmethod
    def wrap(original):
        def post_step(self, model_executed):
            if getattr(self.scheduler, DELIVERED_ATTR, False):
                setattr(self.scheduler, DELIVERED_ATTR, False)
                return None
            return original(self, model_executed)

        return post_step
