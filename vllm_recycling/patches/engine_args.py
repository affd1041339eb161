"""The front end: where ``speculative_config={"method": "recycling", ...}`` becomes what vLLM
0.32 knows, before any engine is built."""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME
from vllm_recycling.patches.base import MethodPatch
from vllm_recycling.proposer import RecyclingProposer
from vllm_recycling.support import trees_in_front_end

logger = init_logger(LOGGER_NAME)

PROPOSER_CLASS = f"{RecyclingProposer.__module__}.{RecyclingProposer.__qualname__}"


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
    including the snapshot against the target's vocabulary), decides from
    ``target_model_config`` whether trees can be verified (``support.trees_in_front_end``:
    where they cannot, an unset verify becomes the chain and an explicit "tree" is refused,
    with ``engine_args`` untouched; on CUDA, where they can, it sets the attention backend and
    CUDA graph mode trees need), stores the parsed config in
    ``self.additional_config["recycling"]`` (a free-form dict vLLM hashes and ships to every
    worker, config/vllm.py:421, 549-557) and replaces the dict with what vLLM's
    ``custom_class`` branch takes (config/speculative.py:1131-1135, 1230-1241:
    ``draft_model_config = target_model_config``). Other methods pass through untouched.
    """

    target = "vllm.engine.arg_utils:EngineArgs.create_speculative_config"
    signature = "(self, target_model_config, target_parallel_config)"

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
    pipeline = engine_args.pipeline_parallel_size
    if pipeline > 1:
        # vLLM builds the drafter on the last stage only (v1/worker/gpu_model_runner.py:590), and
        # the drafts, tree positions and verification all live in one runner
        raise RecyclingConfigError(
            f"speculative method 'recycling' does not run with pipeline parallelism "
            f"(pipeline_parallel_size={pipeline}): vLLM builds the drafter on the last pipeline stage "
            "only; tensor parallelism works (tensor_parallel_size)"
        )
    # a bad snapshot (its table or its confidences) fails now, not in a worker
    config.initial_matrix(target_model_config.get_vocab_size(), with_probs=True)
    plugins = logits_processor_plugins()
    if plugins:  # review A3: a plain step applies them, the drafts' verification could not
        raise RecyclingConfigError(
            f"speculative method 'recycling' cannot apply the logits processors installed as vLLM "
            f"plugins ({', '.join(plugins)}; entry point group vllm.logits_processors): uninstall "
            "them, or serve without speculation"
        )
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
    if config.drafts_trees:
        # trees or the chain, from the model's config, before any engine setting is touched;
        # on CUDA, TRITON_ATTN and piecewise CUDA graphs where trees stay
        config = trees_in_front_end(config, engine_args, target_model_config)
    if config.matrix_init == "model":  # computed once per model; on the CPU beside serving
        from vllm.platforms import current_platform

        from vllm_recycling.warm import start_prior

        start_prior(engine_args, target_model_config, config.topk, background=current_platform.is_cpu())
    engine_args.additional_config = {**extra, ADDITIONAL_CONFIG_KEY: config.to_dict()}
    engine_args.speculative_config = {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": config.max_drafts,
    }
    logger.info(
        "recycling: verify=%s, %d draft tokens per step (%s%s) from a %s top-%d adjacency matrix "
        "starting %s%s",
        config.verify or "tree (the chain where trees cannot be verified)", config.max_drafts,
        config.draft_template().name,
        f" and a context branch of {config.context_length}" if config.context_length else "",
        config.matrix_scope, config.topk,
        "from the model's prior" if config.matrix_init == "model" else "empty",
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


def logits_processor_plugins() -> list[str]:
    """The logits processors installed as vLLM plugins, which every plain step of vLLM applies
    (v1/sample/logits_processor/__init__.py:57-83, 219-224): "name (module:Class)" each."""
    from importlib.metadata import entry_points

    from vllm.v1.sample.logits_processor import LOGITSPROCS_GROUP

    return sorted(f"{e.name} ({e.value})" for e in entry_points(group=LOGITSPROCS_GROUP))


class SampleLikeAPlainStep(MethodPatch):
    """``SamplingParams._validate_spec_decode`` (sampling_params.py:1182-1195): vLLM refuses
    ``min_p`` and ``logit_bias`` with any speculative method, since its rejection sampler does
    not apply them to draft rows. A recycling step with a sampled request samples every row as
    a plain step does, with both (``node_sampler``), so the wrapper lets them through for the
    recycling drafter only; every other method keeps vLLM's refusal. It refuses
    ``thinking_token_budget`` instead, whose per-step state (``ThinkingBudgetStateHolder``)
    rows sampled apart from their requests cannot share, here at the request rather than
    in the step, and ``logprob_token_ids``, which no verification of drafts returns (review
    A2)."""

    target = "vllm.sampling_params:SamplingParams._validate_spec_decode"
    signature = "(self, speculative_config)"

    @staticmethod
    def wrap(original):
        def _validate_spec_decode(self, speculative_config):
            if (
                speculative_config is not None
                and getattr(speculative_config, "method", None) == "custom_class"
                and getattr(speculative_config, "model", None) == PROPOSER_CLASS
            ):
                if getattr(self, "logprob_token_ids", None):
                    from vllm.exceptions import VLLMValidationError

                    # review A2: neither vLLM's rejection sampler nor the row-by-row sampler
                    # returns them: an answer would carry them at some positions only
                    raise VLLMValidationError(
                        "logprob_token_ids is not supported with speculative method 'recycling'",
                        parameter="logprob_token_ids",
                        value=self.logprob_token_ids,
                    )
                if getattr(self, "thinking_token_budget", None) is not None:
                    from vllm.exceptions import VLLMValidationError

                    raise VLLMValidationError(
                        "thinking_token_budget is not supported with speculative method "
                        "'recycling'",
                        parameter="thinking_token_budget",
                        value=self.thinking_token_budget,
                    )
                return None
            return original(self, speculative_config)

        return _validate_spec_decode
