"""Method "recycling" in vLLM's speculator registry (Model Runner V2, vLLM 0.34): the
``SpeculatorConfig`` vLLM builds ``RecyclingSpeculator`` from.

vLLM's ``SpeculativeConfig`` moves a registered method's name to ``custom_method`` and calls
``configure`` then ``apply_options`` on this class (config/speculative.py:1359-1404); the
plugin's settings travel in ``speculator_options``, where the front end put them
(``patches.RecyclingSpeculatorOptions``). Nothing here imports the speculator: vLLM reads this
class in every process.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from vllm_recycling.config import METHOD, RecyclingConfig, RecyclingConfigError, TreesUnsupported

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig


def recycling_config(options: Mapping[str, Any] | None) -> RecyclingConfig:
    """The plugin's settings from ``speculator_options`` (None: the defaults), as Model
    Runner V2 runs them: verify "tree" without the context branch (not built on Model Runner V2
    yet: an explicit context_match true is refused, an unset one is off). An unset verify is
    the front end's to decide (``patches.speculator_spec``): workers get "tree" or "chain"."""
    config = RecyclingConfig.from_dict({"method": METHOD, **(options or {})})
    if config.verify == "tree" and config.context_match:
        if (options or {}).get("context_match") is True:
            raise RecyclingConfigError(
                "speculative_config context_match=true is not available on vLLM 0.34 yet (the "
                "context branch reads each request's history on the host; Model Runner V2 drafts "
                "on the device); leave it unset or false"
            )
        config = replace(config, context_match=False)
    if config.matrix_scope == "salt":
        raise RecyclingConfigError(
            "speculative_config matrix_scope='salt' is not available on vLLM 0.34 yet (its "
            "requests' cache_salt does not reach the speculator); use 'overlay' (the default), "
            "'shared' or 'per_request'"
        )
    if config.matrix_snapshot is not None:
        raise RecyclingConfigError(
            "speculative_config matrix_snapshot is not available on vLLM 0.34 yet (the matrix "
            "is not saved there); leave it unset, or serve with vLLM 0.32 or 0.33"
        )
    return config


def tree_problem(engine_args) -> TreesUnsupported | None:
    """Why Model Runner V2 cannot verify trees in this set-up, None where it can, from what the
    front end knows (``support.trees_in_front_end`` then checks the model and, on CUDA, sets
    the attention backend and CUDA graphs). Trees run on vLLM's Triton attention: on CUDA, and
    on vLLM 0.34's CPU engine only with ``triton_path.GPU_PATH_ON_CPU_ENV`` (its own CPU
    attention has no tree pass). The accepted nodes' KV moves run where the sampler runs:
    the last pipeline stage alone would move them, so pipeline parallelism is refused, as is
    context parallelism (``prepare_attn`` hands the step to its own manager,
    model_runner.py:1668-1669)."""
    from vllm.platforms import current_platform

    from vllm_recycling import triton_path

    if current_platform.is_cpu() and not triton_path.requested_on_cpu():
        return TreesUnsupported(
            "vLLM 0.34's CPU attention has no tree pass in vllm-recycling (trees run on vLLM's "
            f"Triton attention: on GPUs, or on the CPU with {triton_path.GPU_PATH_ON_CPU_ENV}=1 and "
            "TRITON_INTERPRET=1, slowly)"
        )
    if not (current_platform.is_cuda() or current_platform.is_cpu()):
        platform = getattr(current_platform, "device_name", None) or type(current_platform).__name__
        return TreesUnsupported(f"vllm-recycling verifies trees on CUDA GPUs, not on {platform}")
    for name, what in (("pipeline_parallel_size", "pipeline parallelism"),
                       ("prefill_context_parallel_size", "prefill context parallelism"),
                       ("decode_context_parallel_size", "decode context parallelism")):
        size = getattr(engine_args, name, 1) or 1
        if size > 1:
            return TreesUnsupported(f"{what} ({name}={size}) is not supported with trees on vLLM 0.34")
    return None


class RecyclingSpeculatorConfig(SpeculatorConfig):
    """No draft model (the target's config stands in, as for ngram); ``num_speculative_tokens``
    is the number of drafts (the tree's nodes, or the chain's length), from the settings when
    the user gave none."""

    speculator_class = "vllm_recycling.mrv2.speculator.RecyclingSpeculator"
    supported_options = frozenset({"speculator_options"})

    @classmethod
    def configure(cls, spec: "SpeculativeConfig") -> None:
        super().configure(spec)
        config = recycling_config(spec.speculator_options)
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = config.max_drafts
        elif spec.num_speculative_tokens != config.max_drafts:
            raise RecyclingConfigError(
                f"num_speculative_tokens {spec.num_speculative_tokens} differs from the "
                f"{config.max_drafts} drafts of speculator_options; give it once, among the "
                "method's keys"
            )
        spec.speculator_options = config.to_dict()  # what every worker builds from
