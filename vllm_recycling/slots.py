"""Owns which request holds which part of the adjacency matrix, and the matrix snapshot.

Under every scope but ``shared`` a request holds a slot while it is live: its own matrix
(``per_request``) or its own overlay rows (``overlay``, ``salt``), and under ``salt`` its
tenant's matrix. Slots come from a pool of ``max_num_seqs`` and go back when a request
finishes, or to a new request when the pool is full and the holder is preempted. The shared
matrix is saved to ``matrix_snapshot`` every ``matrix_snapshot_interval`` seconds and at
shutdown.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_recycling import LOGGER_NAME
from vllm_recycling.config import RecyclingConfig
from vllm_recycling.matrix import CACHE_SALT_KEY, NO_MATRIX, AdjacencyMatrix, Scope, remove_stale_temporaries
from vllm_recycling.transfer import to_device

logger = init_logger(LOGGER_NAME)


class MatrixSlots:
    """The matrix of one worker and who holds which slot of it."""

    def __init__(self, matrix: AdjacencyMatrix, config: RecyclingConfig, max_requests: int) -> None:
        self.matrix = matrix
        self.snapshot = config.matrix_snapshot
        self.snapshot_interval = config.matrix_snapshot_interval
        self.max_requests = max_requests
        # the requests holding a slot, least recently scheduled first (every rank of a
        # tensor-parallel group evicts alike: no order here depends on string hashing)
        self.holders: OrderedDict[str, None] = OrderedDict()
        self.evictions = 0  # slots taken from preempted requests (tests, benchmarks)
        self._salt_of: dict[str, str | None] = {}  # salt scope: each request's cache_salt
        self._last_save = time.monotonic()
        if self.snapshot is not None and is_first_rank():
            for tmp in remove_stale_temporaries(self.snapshot):
                logger.warning("recycling: removed %s, left by a snapshot save that was killed", tmp)

    @property
    def scoped(self) -> bool:
        """Whether requests hold slots (every scope but ``shared``)."""
        return self.matrix.scope != Scope.SHARED

    def note_salts(self, req_ids: Iterable[str], sampling_params: Callable[[str], Any]) -> None:
        """Salt scope: remember each request's ``cache_salt`` (``patches.scheduler.TagCacheSalt``
        put it in the request's ``SamplingParams``), for when it gets a slot."""
        if self.matrix.scope == Scope.SALT:
            self._salt_of = {r: cache_salt(sampling_params(r)) for r in req_ids}

    def assign(self, batch: list[str], live: set[str]) -> None:
        """Give every request of the batch a slot: free those of finished requests, and when the
        pool is full, those of requests not in this batch (preempted), least recently scheduled
        first."""
        if not self.scoped:
            return
        for req_id in [r for r in self.holders if r not in live]:
            self.matrix.free(req_id)
            del self.holders[req_id]
        in_batch = set(batch)
        idle = (r for r in list(self.holders) if r not in in_batch)  # oldest first
        for req_id in batch:
            if req_id in self.holders:
                self.holders.move_to_end(req_id)
                if self.matrix.matrix_of(req_id) == NO_MATRIX:
                    self.matrix.allocate(req_id)  # salt scope: a matrix may be free now
                continue
            if len(self.holders) >= self.max_requests:
                evicted = next(idle, None)
                if evicted is not None:
                    self.matrix.free(evicted)
                    del self.holders[evicted]
                    self.evictions += 1
            self.matrix.allocate(req_id, self._salt_of.get(req_id))
            self.holders[req_id] = None

    def of(self, req_ids: list[str]) -> torch.Tensor | None:
        """The slots of ``req_ids`` on the device (``AdjacencyMatrix.slots``), None when shared."""
        return self.matrix.slots(req_ids) if self.scoped else None

    def of_rows(self, batch: list[str], rows_per_request: np.ndarray) -> torch.Tensor | None:
        """The slot of every logits row: ``rows_per_request[b]`` rows of request ``batch[b]``."""
        if not self.scoped:
            return None
        request_of_row = np.repeat(np.arange(len(batch)), rows_per_request)
        return self.matrix.slots(batch)[to_device(request_of_row, torch.int64, self.matrix.device)]

    def can_draft(self, req_id: str) -> bool:
        """False for a salted request whose salt has no matrix yet (every one is held)."""
        return self.matrix.scope != Scope.SALT or self.matrix.matrix_of(req_id) != NO_MATRIX

    # -- the snapshot ---------------------------------------------------------------------------
    def save_snapshot(self) -> None:
        """Write the shared matrix to ``matrix_snapshot`` (atomically; tensor-parallel rank 0
        only: every rank holds the same matrix). Called every ``matrix_snapshot_interval``
        seconds from ``propose`` and at shutdown (``patches.runner.SaveSnapshotAtShutdown``)."""
        self._last_save = time.monotonic()
        if self.snapshot is None or not is_first_rank():
            return
        try:
            self.matrix.save(self.snapshot)
        except OSError as e:  # a full disk must not stop serving; the next save tries again
            logger.warning("recycling: could not save the matrix snapshot %s: %s", self.snapshot, e)
            return
        filled = int((self.matrix.table != 0).any(dim=1).sum())
        logger.info(
            "recycling: matrix snapshot saved to %s (%d of %d rows filled)",
            self.snapshot, filled, self.matrix.table.shape[0],
        )

    def maybe_save(self) -> None:
        """Save when ``matrix_snapshot_interval`` seconds passed since the last save."""
        interval = self.snapshot_interval
        if self.snapshot is not None and interval > 0 and time.monotonic() - self._last_save >= interval:
            self.save_snapshot()


def cache_salt(sampling_params) -> str | None:
    """The request's ``cache_salt``, as ``patches.scheduler.TagCacheSalt`` recorded it."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(CACHE_SALT_KEY)


def is_first_rank() -> bool:
    """Whether this worker is the first tensor-parallel rank, or the only one: without a
    parallel group (get_tp_group asserts, distributed/parallel_state.py:1588-1590) or without
    torch.distributed, a single process."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except (AssertionError, ImportError, RuntimeError):  # no parallel state: a single process
        return True
