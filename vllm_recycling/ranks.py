"""What the tensor-parallel ranks of a worker group agree on, so that they never verify
different trees: ``tensor_parallel_mean`` averages a small host array over them (the budget's
cost models, the prior's rows), and ``digest_checked`` compares a digest of each rank's
decisions in the same all-reduce (the budget's decision digest, the step's tree layout:
``layout_checked``, the prior rows each rank loaded: ``ranks_agree``), raising
``RanksDisagree`` where they differ.
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np
import torch


def tensor_parallel_mean():
    """A function averaging a small host array over the tensor-parallel ranks (None in a single
    process): what the ranks' cost models agree on."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

        if get_tensor_model_parallel_world_size() == 1:
            return None
        group = get_tp_group().cpu_group
    except (AssertionError, ImportError, RuntimeError):
        return None

    def mean(values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        torch.distributed.all_reduce(t, group=group)
        return (t / torch.distributed.get_world_size(group)).numpy()

    return mean


def layout_checked(mean: Callable[[np.ndarray], np.ndarray], nodes: list[np.ndarray]) -> None:
    """Before a step's forward, in every rank: compare the template nodes each rank lays the
    scheduled drafts out as (per request of the batch, from its own proposal; only rank 0's
    tokens reach the scheduler) with every other rank's, in one all-reduce of four float64 on
    the CPU group (``mean``: ``tensor_parallel_mean``). Ranks that would verify different trees
    raise ``RanksDisagree`` before any row is computed (the decision digest of the cost
    agreements finds it up to 32 steps late, and never with budget "fixed")."""
    sizes = np.array([n.size for n in nodes], dtype=np.int64)
    digest = zlib.crc32(np.concatenate([sizes, *nodes]).astype(np.int64).tobytes())
    digest_checked(mean, digest)(np.zeros(0))


class RanksDisagree(RuntimeError):
    """The ranks of a tensor-parallel group made different draft decisions."""


def digest_checked(mean: Callable[[np.ndarray], np.ndarray], digest: int) -> Callable[[np.ndarray], np.ndarray]:
    """``mean`` (``tensor_parallel_mean``) that also compares this rank's ``decision_digest``
    with every other rank's, in the same all-reduce: the means of the digest's two 16-bit halves
    and of their squares (exact in float64) equal this rank's own on every rank only when all
    ranks hold the same digest (else their spread is above 0 and every rank sees it). On a
    mismatch it raises ``RanksDisagree``: the ranks would verify different trees for the same
    scheduled drafts."""
    halves = np.array([digest >> 16, digest & 0xFFFF], dtype=np.float64)

    def checked(values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        n = values.size
        out = np.asarray(mean(np.concatenate([values, halves, halves * halves])), dtype=np.float64)
        if not (np.array_equal(out[n : n + 2], halves) and np.array_equal(out[n + 2 :], halves * halves)):
            raise RanksDisagree(
                f"recycling: the tensor-parallel ranks made different draft decisions (decision "
                f"digest {digest:08x} on this rank): their matrices, slots or calibrations "
                "differ, and they would verify different trees; stopping"
            )
        return out[:n]

    return checked


def ranks_agree(all_reduce_mean: Callable[[np.ndarray], np.ndarray], rows: int) -> bool:
    """Whether every tensor-parallel rank holds the same number ``rows`` (>= -1), exactly:
    ``digest_checked``'s comparison of a digest over the ranks, in one all-reduce of four
    float64 that every rank makes alike."""
    try:
        digest_checked(all_reduce_mean, rows + 1)(np.zeros(0))
    except RanksDisagree:
        return False
    return True
