"""Every place vllm-recycling touches vLLM 0.32. Nothing else in the package changes vLLM.

``PATCHES`` lists them; ``apply_all()`` applies each once per process (the plugin entry point
runs in every vLLM process, possibly several times). Each patch wraps one vLLM function,
names it in its docstring with the file:line it was read from (vLLM 0.32.0, paths relative to
the ``vllm`` package), and says what it relies on there.

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
- ``FeedVerificationLogits`` gives the proposer the verification logits, which vLLM does
  not pass to any proposer.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

# Under "vllm." so that vLLM's logging configuration (format, level) applies to our lines too.
logger = logging.getLogger("vllm.plugins.vllm_recycling")

PROPOSER_CLASS = "vllm_recycling.proposer.RecyclingProposer"
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

    @classmethod
    def apply(cls) -> bool:
        """Install the wrapper; False if it was already installed."""
        owner, attr = cls.target()
        current = owner.__dict__.get(attr)
        if current is None:
            raise RuntimeError(
                f"vllm-recycling patch {cls.name}: {owner.__module__}.{owner.__qualname__}.{attr} "
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
    engine_args.additional_config = {**extra, ADDITIONAL_CONFIG_KEY: config.to_dict()}
    engine_args.speculative_config = {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": config.num_speculative_tokens,
    }
    logger.info(
        "recycling: verify=%s, chain of %d drafted from a %s top-%d adjacency matrix%s",
        config.verify, config.num_speculative_tokens, config.matrix_scope, config.topk,
        f" (snapshot {config.matrix_snapshot})" if config.matrix_snapshot else "",
    )
    if config.tree is not None:
        logger.warning(
            "recycling: tree %r is not used: verify='chain' drafts the top-1 chain, and tree "
            "verification is not available in this version", config.tree,
        )


class FeedVerificationLogits(MethodPatch):
    """``GPUModelRunner._sample`` (v1/worker/gpu_model_runner.py:3437-3466), inherited
    unchanged by ``CPUModelRunner`` (v1/worker/cpu_model_runner.py).

    ``sample_tokens`` (4303-4340) passes it this step's logits ``[sum(N) + B, V]`` (computed at
    4241-4242 as ``compute_logits(hidden_states[logits_indices])``, grammar-masked in place at
    4334-4338) and the ``SpecDecodeMetadata`` (v1/spec_decode/metadata.py:9-27, built at
    2625-2698) before the rejection sampler runs (3460). Logits row j was computed for the
    input token ``input_ids.gpu[logits_indices[j]]`` (the way 2687 reads the draft tokens; the
    -1 placeholders were clamped to 0 before the forward, 3309-3311); rows are grouped per
    request in ``input_batch.req_ids`` order, ``num_draft_tokens[i] + 1`` each.

    When the runner's drafter has ``observe_verification`` (our proposer), the wrapper hands
    it those rows before calling the original, so the matrix sees the raw logits (samplers may
    modify their inputs) and the proposer, called later in the same ``sample_tokens`` (4362-4375,
    4477-4489), drafts from the updated matrix. ``self.requests`` (the runner's live requests;
    finished ones are popped at 1183-1186) lets a per-request matrix be returned. Dummy and
    profiling runs call the rejection sampler directly (6023, 6037), not ``_sample``, so they
    never reach the matrix.
    """

    name = "feed_verification_logits"

    @staticmethod
    def target():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner, "_sample"

    @staticmethod
    def wrap(original):
        def _sample(self, logits, spec_decode_metadata):
            observe = getattr(getattr(self, "drafter", None), "observe_verification", None)
            if observe is not None and logits is not None and spec_decode_metadata is not None:
                observe(
                    req_ids=self.input_batch.req_ids,
                    live_req_ids=self.requests.keys(),
                    tokens=self.input_ids.gpu[spec_decode_metadata.logits_indices],
                    logits=logits,
                    num_draft_tokens=spec_decode_metadata.num_draft_tokens,
                )
            return original(self, logits, spec_decode_metadata)

        return _sample


PATCHES: tuple[type[MethodPatch], ...] = (TranslateRecyclingSpecConfig, FeedVerificationLogits)


def apply_all() -> list[str]:
    """Apply every patch (idempotent). Returns the names newly applied."""
    applied = [patch.name for patch in PATCHES if patch.apply()]
    if applied:
        logger.debug("vllm-recycling patches applied: %s", ", ".join(applied))
    return applied
