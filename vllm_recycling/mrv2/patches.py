"""Every place the Model Runner V2 adapter touches vLLM 0.34 besides its speculator registry
(file:line of vLLM 0.34.0, paths relative to the ``vllm`` package). Each is a
``patches.base.MethodPatch``: its target's parameters are checked before any is applied.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME
from vllm_recycling.config import METHOD, RecyclingConfigError
from vllm_recycling.method_patch import MethodPatch
from vllm_recycling.mrv2.config import recycling_config, tree_problem
from vllm_recycling.support import chain_instead, trees_in_front_end
from vllm_recycling.mrv2.speculator import LEARNER_ATTR
from vllm_recycling.mrv2.verify import accept_chain, accept_tree, emitted_rows
from vllm_recycling.step import ACTIVE_TREE

logger = init_logger(LOGGER_NAME)

# Keys of a "recycling" speculative_config that are vLLM's own, not the plugin's settings.
# num_speculative_tokens_per_batch_size: vLLM 0.34's batch-size schedule of the drafts a request
# is sent (config/speculative.py:570-575; the scheduler and the runner keep the first K,
# scheduler.py:324-330, model_runner.py:2388-2389): a tree's breadth-first prefix is a tree.
VLLM_KEYS = ("method", "speculator_options", "num_speculative_tokens_per_batch_size")
PASSED_TO_VLLM = ("num_speculative_tokens_per_batch_size",)


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
    if config.drafts_trees:  # verify "tree", or unset: trees where they can be verified
        problem = tree_problem(engine_args)
        if problem is not None:
            config = chain_instead(config, problem)
        elif target_model_config is not None and engine_args is not None:
            # the model (configs alone); on CUDA, TRITON_ATTN and piecewise CUDA graphs
            config = trees_in_front_end(config, engine_args, target_model_config)
        if config.drafts_trees:  # decided: what every worker builds
            config = recycling_config({**options, "verify": "tree"})
    if target_model_config is not None:
        # topk against the model's vocabulary now, not in a worker
        config.initial_matrix(target_model_config.get_vocab_size())
        if config.matrix_init == "model" and engine_args is not None:
            from vllm.platforms import current_platform

            from vllm_recycling.warm import start_prior

            start_prior(engine_args, target_model_config, config.topk,
                        background=current_platform.is_cpu())
    drafts = (f"tree {config.tree_template().name!r}'s first {config.num_speculative_tokens} nodes"
              if config.drafts_trees else f"the matrix's top-1 chain of {config.num_speculative_tokens} tokens")
    logger.info(
        "recycling: Model Runner V2, %s from a %s top-%d adjacency matrix starting %s", drafts,
        config.matrix_scope, config.topk, "from the model's prior" if config.matrix_init == "model" else "empty",
    )
    return {"method": METHOD, "num_speculative_tokens": config.max_drafts,
            "speculator_options": config.to_dict(),
            **{key: spec[key] for key in PASSED_TO_VLLM if spec.get(key) is not None}}


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
            if learner is None:
                return original(self, logits, input_batch, draft_logits)
            learner.learn(logits, input_batch)
            output = original(self, logits, input_batch, draft_logits)
            learner.end_step(input_batch)  # the accepted nodes' KV moved into place
            return output

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
            speculator = getattr(self.sampler.req_states, LEARNER_ATTR)
            if not speculator.trees:
                sampled, num_sampled = accept_chain(sampled_rows, draft_sampled, cu_num_logits,
                                                    expanded_local_pos, self.num_speculative_steps)
                return processed_logits, sampled, num_sampled
            sampled, num_sampled, path = accept_tree(
                sampled_rows, draft_sampled, cu_num_logits, expanded_local_pos,
                speculator.parent_of_local, speculator.depth_of_local, speculator.max_depth,
                self.num_speculative_steps,
            )
            speculator.paths[idx_mapping.long()] = path
            if self.sampler.return_sampling_mask or self.sampler.get_logprobs_dims(idx_mapping_np) is not None:
                # vLLM scores sampled[b, i] with row start_b + i: put the path's rows there
                dst, src = emitted_rows(cu_num_logits, path)
                logits[dst] = logits[src]
                if processed_logits.data_ptr() != logits.data_ptr():
                    processed_logits[dst] = processed_logits[src]
            return processed_logits, sampled, num_sampled

        return _verify


class TreePositions(MethodPatch):
    """``GPUModelRunner.prepare_attn`` (v1/worker/gpu/model_runner.py:1665-1685), called by
    ``execute_model`` right after ``prepare_inputs`` for a real batch (1924-1927; dummy runs
    take ``prepare_dummy_attn``). vLLM's own computes the block tables and the slot mappings
    from the step's consecutive positions (``compute_slot_mappings``); then the recycling
    speculator moves tree nodes to their depth's position and publishes the step's tree rows
    (``RecyclingSpeculator.begin_step``), before the attention metadata (2035) and the forward
    (2081) read the positions. Prefix context parallelism returns before (1668-1669): refused
    with trees (``mrv2.config``)."""

    target = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_attn"
    signature = "(self, input_batch)"

    @staticmethod
    def wrap(original):
        def prepare_attn(self, input_batch):
            block_tables, slot_mappings = original(self, input_batch)
            speculator = getattr(self.req_states, LEARNER_ATTR, None)
            if speculator is not None:
                speculator.begin_step(input_batch, slot_mappings)
            return block_tables, slot_mappings

        return prepare_attn


class TreePlaceholders(MethodPatch):
    """``gather_draft_sampled`` (v1/worker/gpu/spec_decode/rejection_sampler.py:120-149), which
    ``RejectionSampler.__call__`` calls by its module name (439-446): each logits row's fed
    token and position, a draft row marked a placeholder (-1) when its request's step starts
    inside the prefill, ``pos - local_pos < prefill_len`` (114). With tree positions
    (``TreePositions``) ``pos - local_pos`` is no longer the root's position, so in a tree step
    the rule is applied to the root's position itself, as vLLM means it; the positions are
    returned as they are (a node's sampling noise is keyed by its tree position, what a plain
    step at that position uses)."""

    target = "vllm.v1.worker.gpu.spec_decode.rejection_sampler:gather_draft_sampled"
    signature = ("(input_ids, positions, logits_indices, expanded_idx_mapping, expanded_local_pos, "
                 "prefill_len)")

    @staticmethod
    def wrap(original):
        def gather_draft_sampled(input_ids, positions, logits_indices, expanded_idx_mapping,
                                 expanded_local_pos, prefill_len):
            draft_sampled, pos = original(input_ids, positions, logits_indices, expanded_idx_mapping,
                                          expanded_local_pos, prefill_len)
            if ACTIVE_TREE.tree is None:
                return draft_sampled, pos
            local = expanded_local_pos.long()
            root_pos = pos[torch.arange(local.shape[0], device=local.device) - local]
            placeholder = (local > 0) & (root_pos < prefill_len[expanded_idx_mapping.long()])
            fed = input_ids[logits_indices.long()]
            return torch.where(placeholder, torch.full_like(fed, -1), fed), pos

        return gather_draft_sampled


# Sampling parameters whose processing in vLLM 0.34 reads the tokens before a logits row as a
# chain (a row's predecessors in the step): right for a chain, wrong for a tree's siblings.
CHAIN_READING_PARAMS = (
    # penalties.py:150-158 count the step's earlier draft rows as output tokens
    ("presence_penalty", lambda v: v != 0.0),
    ("frequency_penalty", lambda v: v != 0.0),
    ("repetition_penalty", lambda v: v != 1.0),
    ("bad_words", bool),  # bad_words.py:127-150 matches the rows before as a prefix
    ("thinking_token_budget", lambda v: v is not None),  # thinking_budget.py:125-126
    ("structured_outputs", lambda v: v is not None),  # the grammar advances along the drafts
)


class TreeRequestParams(MethodPatch):
    """``SamplingParams._validate_spec_decode`` (sampling_params.py:1188-1200), which
    ``SamplingParams.verify`` runs for every request in the front end (920): with trees, a
    request whose sampling parameters vLLM 0.34 applies by reading its drafts as a chain
    (``CHAIN_READING_PARAMS``) is refused, naming the parameter, rather than answered with tokens
    a plain step would not give. vLLM's own refusal (min_p, logit_bias) runs first, as for
    every speculative method."""

    target = "vllm.sampling_params:SamplingParams._validate_spec_decode"
    signature = "(self, speculative_config)"

    @staticmethod
    def wrap(original):
        def _validate_spec_decode(self, speculative_config):
            original(self, speculative_config)
            if (speculative_config is None or getattr(speculative_config, "custom_method", None) != METHOD
                    or (speculative_config.speculator_options or {}).get("verify") != "tree"):
                return
            for name, in_use in CHAIN_READING_PARAMS:
                value = getattr(self, name, None)
                if value is not None and in_use(value):
                    from vllm.exceptions import VLLMValidationError

                    raise VLLMValidationError(
                        f"{name} is not supported with speculative method 'recycling' verifying trees "
                        "on vLLM 0.34 (vLLM applies it along the drafts as a chain); serve with "
                        "verify 'chain' for such requests",
                        parameter=name, value=value,
                    )

        return _validate_spec_decode
