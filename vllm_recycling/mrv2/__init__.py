"""The adapter for vLLM's Model Runner V2 (vLLM 0.34, ``plugin.ADAPTERS``): method "recycling"
in vLLM's own speculator registry, over the same core as the V1 adapter (``vllm_recycling.patches``):
the adjacency matrix, its templates and kernels.

- ``config.RecyclingSpeculatorConfig``: registered as method "recycling" with
  ``register_speculative_method`` (v1/worker/gpu/spec_decode/speculator_config.py:317-339); the
  plugin's settings in ``speculator_options``.
- ``speculator.RecyclingSpeculator``: vLLM's ``BaseSpeculator``; drafts each request's top-1 chain
  from the matrix in one launch, on the device.
- ``verify``: every row of a step with drafts sampled as a plain step samples it, the drafts
  accepted while each is its predecessor's sample (greedy and seeded output identical to no
  speculation), in vLLM's rejection sampler's place.
- ``patches``: the user's dict into ``speculator_options`` (front end), the matrix's update
  from every logits row before vLLM samples, and the verification above.

What differs from vLLM 0.32/0.33 (README's table): the chain only (tree verification is not yet
built on Model Runner V2: an explicit verify "tree" is refused, an unset one drafts the chain),
no budget (the whole chain every step; ``budget`` is accepted and has no effect),
matrix_scope "salt" refused, ``min_p`` and ``logit_bias`` refused as vLLM refuses them for every
speculative method.
"""

from __future__ import annotations

from vllm_recycling.config import METHOD
from vllm_recycling.method_patch import MethodPatch, PatchMismatch

CONFIG_CLASS = "vllm_recycling.mrv2.config.RecyclingSpeculatorConfig"


def patch_set() -> tuple[type[MethodPatch], ...]:
    from vllm_recycling.mrv2.patches import (
        LearnFromPlainSteps,
        LearnFromVerifiedSteps,
        RecyclingSpeculatorOptions,
        SampleEveryRowAsAPlainStep,
    )

    return (RecyclingSpeculatorOptions, LearnFromPlainSteps, LearnFromVerifiedSteps,
            SampleEveryRowAsAPlainStep)


def apply_all() -> list[str]:
    """Register method "recycling" and apply every patch (idempotent), or none: each target is
    checked first and a mismatch raises ``PatchMismatch`` naming each."""
    try:
        from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

        found = patch_set()
    except ImportError as e:
        raise PatchMismatch(f"vLLM's speculator registry is missing ({e})") from e
    problems = [p for p in (patch.problem() for patch in found) if p is not None]
    if problems:
        raise PatchMismatch("; ".join(problems))
    register_speculative_method(METHOD, CONFIG_CLASS)
    return [patch.name for patch in found if patch.apply()]
