"""What the V1 adapter's patch modules share: ``MethodPatch`` (``method_patch``), the step
output's drafts attribute, and how a patch finds the recycling drafter of a model runner."""

from __future__ import annotations

from vllm_recycling.method_patch import _MARK, MethodPatch, PatchMismatch, parameters
from vllm_recycling.proposer import RecyclingProposer

__all__ = ["DRAFTS_ATTR", "MethodPatch", "PatchMismatch", "_MARK", "parameters", "recycling_drafter"]

# The attribute under which a worker's step output carries the step's drafts to the engine core
# (``runner.DraftsWithSampledTokens`` sets it, ``scheduler.DraftsFromSampledOutput`` reads it).
DRAFTS_ATTR = "recycling_draft_token_ids"


def recycling_drafter(runner) -> RecyclingProposer | None:
    """The runner's drafter when it is ours (``runner.CheckDrafter`` makes sure, at start-up,
    that a runner built for method "recycling" holds it), else None."""
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, RecyclingProposer) else None
