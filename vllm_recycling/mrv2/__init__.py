"""The adapter for vLLM's Model Runner V2 (vLLM 0.34, ``plugin.ADAPTERS``): method "recycling"
in vLLM's own speculator registry, over the same core as the V1 adapter (``vllm_recycling.patches``):
the adjacency matrix, its templates and kernels.

- ``config.RecyclingSpeculatorConfig``: registered as method "recycling" with
  ``register_speculative_method`` (v1/worker/gpu/spec_decode/speculator_config.py:317-339); the
  plugin's settings in ``speculator_options``.
- ``speculator.RecyclingSpeculator``: vLLM's ``BaseSpeculator``; drafts each request's tree (the
  template's first nodes) or chain from the matrix in one launch, on the device, and carries a
  tree step: positions, the tree rows for the attention layers, the accepted nodes' KV moves.
- ``verify``: every row of a step with drafts sampled as a plain step samples it, a draft
  accepted while it is its parent's (the chain: its predecessor's) sample (greedy and seeded
  output identical to no speculation), in vLLM's rejection sampler's place.
- ``patches``: the user's dict into ``speculator_options`` (front end), tree positions after
  vLLM's slots, the matrix's update from every logits row before vLLM samples, the
  verification above and the requests trees cannot serve; ``patches.attention.TreeAttentionTriton``
  (the V1 adapter's own patch: the same target and parameters in 0.34) recomputes the tree
  nodes' attention rows.

What differs from vLLM 0.32/0.33 (README's table): trees only where vLLM's Triton attention runs
(CUDA; the 0.34 CPU engine with ``triton_path.GPU_PATH_ON_CPU_ENV``), without the context branch;
no budget (every node every step; ``budget`` is accepted and has no effect); matrix_scope
"salt" and the snapshot refused; with trees, requests with penalties, bad words, a thinking
budget or structured outputs refused; ``min_p`` and ``logit_bias`` refused as vLLM refuses them
for every speculative method.
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
        TreePlaceholders,
        TreePositions,
        TreeRequestParams,
    )
    from vllm_recycling.patches.attention import TreeAttentionTriton

    return (RecyclingSpeculatorOptions, LearnFromPlainSteps, LearnFromVerifiedSteps,
            SampleEveryRowAsAPlainStep, TreePositions, TreePlaceholders, TreeRequestParams,
            TreeAttentionTriton)


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
    _triton_attention_on_cpu_if_requested()
    register_speculative_method(METHOD, CONFIG_CLASS)
    return [patch.name for patch in found if patch.apply()]


def _triton_attention_on_cpu_if_requested() -> None:
    """On a CPU platform where ``triton_path.GPU_PATH_ON_CPU_ENV`` asks for the GPU path:
    vLLM's Triton attention in ``CPU_ATTN``'s place, as the V1 adapter does
    (``patches.apply_all``). vLLM 0.34's CPU platform still answers every backend choice with
    ``CPU_ATTN``'s path (platforms/cpu.py:188-197), which ``register_backend`` overrides."""
    from vllm_recycling import triton_path

    if not triton_path.requested_on_cpu():
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_recycling.patches.attention import use_triton_attention_on_cpu

        use_triton_attention_on_cpu()
