"""Method "recycling" in vLLM's speculator registry (Model Runner V2, vLLM 0.34): the
``SpeculatorConfig`` vLLM builds ``RecyclingSpeculator`` from.

vLLM's ``SpeculativeConfig`` moves a registered method's name to ``custom_method`` and calls
``configure`` then ``apply_options`` on this class (config/speculative.py:1359-1404); the
plugin's settings travel in ``speculator_options``, where the front end put them
(``patches.RecyclingSpeculatorOptions``). Nothing here imports the speculator: vLLM reads this
class in every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from vllm_recycling.config import METHOD, RecyclingConfig, RecyclingConfigError, TreesUnsupported

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig

# Why Model Runner V2 drafts the chain, until its tree verification is built.
CHAIN_ONLY = TreesUnsupported(
    "on vLLM 0.34 (Model Runner V2) vllm-recycling verifies the matrix's top-1 chain; tree "
    "verification runs on vLLM 0.32 and 0.33"
)


def recycling_config(options: Mapping[str, Any] | None) -> RecyclingConfig:
    """The plugin's settings from ``speculator_options`` (None: the defaults), as Model
    Runner V2 runs them: the chain (an explicit verify "tree" is refused with the reason)."""
    config = RecyclingConfig.from_dict({"method": METHOD, **(options or {})})
    if config.drafts_trees:
        if config.verify == "tree":
            raise CHAIN_ONLY
        config = config.as_chain()
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


class RecyclingSpeculatorConfig(SpeculatorConfig):
    """No draft model (the target's config stands in, as for ngram); ``num_speculative_tokens``
    is the chain's length, from the settings when the user gave none."""

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
                f"num_speculative_tokens {spec.num_speculative_tokens} differs from the chain "
                f"length {config.max_drafts} of speculator_options; give it once, among the "
                "method's keys"
            )
        spec.speculator_options = config.to_dict()  # what every worker builds from
