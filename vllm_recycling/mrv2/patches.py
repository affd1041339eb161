"""Every place the Model Runner V2 adapter touches vLLM 0.34 besides its speculator registry
(file:line of vLLM 0.34.0, paths relative to the ``vllm`` package). Each is a
``patches.base.MethodPatch``: its target's parameters are checked before any is applied.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME
from vllm_recycling.config import METHOD, RecyclingConfigError
from vllm_recycling.method_patch import MethodPatch
from vllm_recycling.mrv2.config import CHAIN_ONLY, recycling_config
from vllm_recycling.mrv2.speculator import LEARNER_ATTR
from vllm_recycling.mrv2.verify import accept_chain

logger = init_logger(LOGGER_NAME)

# Keys of a "recycling" speculative_config that are vLLM's own, not the plugin's settings.
VLLM_KEYS = ("method", "speculator_options")


class RecyclingSpeculatorOptions(MethodPatch):
    """``EngineArgs.create_speculative_config`` (engine/arg_utils.py:2133-2172), in the front
    end, before vLLM builds ``SpeculativeConfig`` (a pydantic dataclass that forbids unknown
    keys) from the user's dict. For method "recycling" the plugin's keys, written at the top
    level as on vLLM 0.32 (or inside ``speculator_options``), are validated
    (``mrv2.config.recycling_config``, and ``topk`` against the model's vocabulary) and
    moved into ``speculator_options``; ``num_speculative_tokens`` becomes the chain's length.
    With ``matrix_init: "model"`` the model's initial matrix is started here, as on 0.32
    (``warm.start_prior``). Other methods pass through untouched."""

    target = "vllm.engine.arg_utils:EngineArgs.create_speculative_config"
    signature = "(self, target_model_config, target_parallel_config)"

    @staticmethod
    def wrap(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            spec = self.speculative_config
            if isinstance(spec, dict) and spec.get("method") == METHOD:
                self.speculative_config = speculator_spec(spec, self, target_model_config)
            return original(self, target_model_config, target_parallel_config)

        return create_speculative_config


def speculator_spec(spec: dict[str, Any], engine_args=None, target_model_config=None) -> dict[str, Any]:
    """The ``speculative_config`` dict vLLM 0.34 takes for the user's recycling ``spec``."""
    nested = spec.get("speculator_options") or {}
    options = {**nested, **{k: v for k, v in spec.items() if k not in VLLM_KEYS}}
    config = recycling_config(options)
    if getattr(engine_args, "enable_batch_sharded_sampling", None):
        # each rank would see its own requests' logits only, and its matrix would draft
        # differently from the others' (config/parallel.py:200-206)
        raise RecyclingConfigError(
            "speculative method 'recycling' cannot run with enable_batch_sharded_sampling: every "
            "tensor-parallel rank's matrix learns from every request's logits; leave it unset"
        )
    if options.get("verify") is None:  # trees by default elsewhere
        logger.warning("recycling: %s: drafting the matrix's top-%d chain", CHAIN_ONLY.why,
                       config.num_speculative_tokens)
    if target_model_config is not None:
        # topk against the model's vocabulary now, not in a worker
        config.initial_matrix(target_model_config.get_vocab_size())
        if config.matrix_init == "model" and engine_args is not None:
            from vllm.platforms import current_platform

            from vllm_recycling.warm import start_prior

            start_prior(engine_args, target_model_config, config.topk,
                        background=current_platform.is_cpu())
    logger.info(
        "recycling: Model Runner V2, the matrix's top-1 chain of %d tokens from a %s top-%d "
        "adjacency matrix starting %s", config.num_speculative_tokens, config.matrix_scope,
        config.topk, "from the model's prior" if config.matrix_init == "model" else "empty",
    )
    return {"method": METHOD, "num_speculative_tokens": config.max_drafts,
            "speculator_options": config.to_dict()}


class LearnFromPlainSteps(MethodPatch):
    """``Sampler.__call__`` (v1/worker/gpu/sample/sampler.py:131-135), called by
    ``GPUModelRunner.sample`` for a step without drafts (model_runner.py:1749-1751) after the
    structured-output mask: the recycling speculator learns from every logits row first."""

    target = "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__"
    signature = "(self, logits, input_batch)"

    @staticmethod
    def wrap(original):
        def __call__(self, logits, input_batch):
            learner = getattr(self.req_states, LEARNER_ATTR, None)
            if learner is not None:
                learner.learn(logits, input_batch)
            return original(self, logits, input_batch)

        return __call__


class LearnFromVerifiedSteps(MethodPatch):
    """``RejectionSampler.__call__`` (v1/worker/gpu/spec_decode/rejection_sampler.py:429-434),
    called by ``GPUModelRunner.sample`` for a step with drafts (model_runner.py:1752-1761): the
    recycling speculator learns from every logits row (the roots' and the drafts') first."""

    target = "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__"
    signature = "(self, logits, input_batch, draft_logits=None)"

    @staticmethod
    def wrap(original):
        def __call__(self, logits, input_batch, draft_logits=None):
            learner = getattr(self.sampler.req_states, LEARNER_ATTR, None)
            if learner is not None:
                learner.learn(logits, input_batch)
            return original(self, logits, input_batch, draft_logits)

        return __call__


class SampleEveryRowAsAPlainStep(MethodPatch):
    """``RejectionSampler._verify`` (v1/worker/gpu/spec_decode/rejection_sampler.py:260-312),
    which ``__call__`` runs on each chunk of requests after gathering each row's fed token and
    position, and before ``get_num_sampled_and_rejected`` and the logprobs. For a recycling
    engine the wrapper samples every row with the plain step's ``Sampler.sample``
    (sample/sampler.py:275-323) and accepts each request's drafts while each is its
    predecessor's sample (``verify.accept_chain``) in place of vLLM's ratio test; other
    speculators keep vLLM's. It returns what ``_verify`` returns: the processed logits, the
    sampled tokens [B, K+1] and their counts [B]."""

    target = "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler._verify"
    signature = (
        "(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, "
        "idx_mapping_np, expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np)"
    )

    @staticmethod
    def wrap(original):
        def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
                    idx_mapping_np, expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np):
            if getattr(self.sampler.req_states, LEARNER_ATTR, None) is None:
                return original(self, logits, draft_logits, draft_sampled, pos, cu_num_logits,
                                idx_mapping, idx_mapping_np, expanded_idx_mapping, expanded_local_pos,
                                seq_lens_upper_bound_np)
            sampled_rows, processed_logits = self.sampler.sample(
                logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, draft_sampled,
                expanded_local_pos, seq_lens_upper_bound_np,
            )
            sampled, num_sampled = accept_chain(sampled_rows, draft_sampled, cu_num_logits,
                                                expanded_local_pos, self.num_speculative_steps)
            return processed_logits, sampled, num_sampled

        return _verify
