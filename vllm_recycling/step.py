"""One decode step as the plugin sees it: the records that carry it from call to call.

A worker runs one step at a time, and vLLM calls into the plugin in this order:

1. ``RecyclingProposer.propose`` (the end of step N-1) drafts for step N and keeps a
   ``Proposal``: which template nodes each request was sent, their calibration bins, and what
   the budget predicted.
2. ``RecyclingProposer.begin_step`` (``patches.runner.TreePositions``, in ``_prepare_inputs``
   of step N) makes the step's ``StepRecord``: the batch, the proposal it verifies, and its
   ``StepPlan`` (the tree rows, ``tree_step.TreeStep``, when a request has a branching tree).
   It publishes the tree in ``ACTIVE_TREE``, the one module global: attention layers cannot be
   passed a value, so they look it up there.
3. The forward: ``patches.attention`` reads ``ACTIVE_TREE`` in every attention layer and adds
   the time its tree pass took.
4. ``RecyclingProposer.verify`` (``patches.sampler.VerifyTree``, in ``_sample``) updates the
   matrix from every logits row and, for a tree step, verifies each request's path; it clears
   ``ACTIVE_TREE`` and returns the record with its ``Verification``.
5. ``RecyclingProposer.propose`` (the end of step N) retires the record: the budget learns
   from it (step time, accepted nodes), then a new ``Proposal`` is drafted.

``begin_step`` retires a record that never reached ``propose`` (a step vLLM abandoned), and
clears ``ACTIVE_TREE`` whatever the drafter, so no attention layer reads a stale tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from vllm_recycling.tree_step import TreeStep


@dataclass(frozen=True)
class Proposal:
    """What ``propose`` sent for the next step (host values).

    sent: request id -> (template node ids [n] int64, breadth-first, root excluded; their
        confidence bins [n]) of the drafts it was sent, budget "auto" only.
    unsent: request id -> (tokens [m], bins [m]) of its first-level nodes when it was sent no
        drafts: the token the step emits is the target's own, so whether each would have been
        accepted is known without verifying it.
    predicted_seconds: the budget's predicted duration of the step (0 without a decision).
    """

    sent: Mapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    unsent: Mapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    predicted_seconds: float = 0.0

    def nodes_of(self, req_id: str) -> np.ndarray | None:
        """The template nodes sent to ``req_id``, None when it was sent nothing we know of."""
        sent = self.sent.get(req_id)
        return None if sent is None else sent[0]


NO_PROPOSAL = Proposal()


@dataclass(frozen=True)
class StepPlan:
    """How vLLM laid the step out. num_tokens: rows in the step; num_draft: each request's
    scheduled drafts (None without speculative metadata); decode_only: every request decodes
    (one token + its drafts), the steps the cost model fits; tree: the branching trees' rows
    (None when there are none); slot_mapping [>= num_tokens] int64: the step's KV slots, where
    the accepted nodes move after verification."""

    num_tokens: int
    num_draft: tuple[int, ...] | None
    decode_only: bool
    tree: TreeStep | None = None
    slot_mapping: torch.Tensor | None = None

    @property
    def drafted(self) -> bool:
        return bool(self.num_draft) and sum(self.num_draft) > 0

    @property
    def num_trees(self) -> int:
        return 0 if self.tree is None else int(self.tree.req_index_np.size)


@dataclass(frozen=True)
class Verification:
    """What verification chose. req_index [R] (host) and path [R, D] (device, read only once
    vLLM has read the step's output; None without trees): each tree request's path
    (``paths``); tree_seconds: host time spent on tree attention and verification;
    generators: the seeded generators' states, rewound by ``propose`` once the emitted tokens
    are known (``node_sampler.GeneratorStates``)."""

    req_index: np.ndarray
    path: torch.Tensor | None
    tree_seconds: float
    generators: Any


@dataclass(frozen=True)
class StepRecord:
    """One step, from ``begin_step`` to the ``propose`` that retires it. batch: request ids in
    batch order; plan: None for a ``propose`` no ``begin_step`` started (nothing to learn from
    its timing or its drafts)."""

    batch: tuple[str, ...]
    proposal: Proposal
    plan: StepPlan | None
    verification: Verification | None = None


class ActiveTree:
    """The tree of the step this process is executing, for the attention layers: set by
    ``RecyclingProposer.begin_step``, read by ``patches.attention``, cleared by
    ``RecyclingProposer.verify`` (and by every ``begin_step``). ``seconds`` sums the time the
    layers' tree passes took."""

    def __init__(self) -> None:
        self.tree: TreeStep | None = None
        self.seconds = 0.0

    def publish(self, tree: TreeStep | None) -> None:
        self.tree, self.seconds = tree, 0.0

    def clear(self) -> float:
        """Clear it; returns the attention layers' tree seconds."""
        seconds, self.tree, self.seconds = self.seconds, None, 0.0
        return seconds


ACTIVE_TREE = ActiveTree()
