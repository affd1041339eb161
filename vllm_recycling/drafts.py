"""Each step's draft trees: the matrix's gather and, with the context branch, each request's
context match, in one tensor per batch ordered as the hybrid template (``tree.HybridTree``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_recycling.budget import context_bins
from vllm_recycling.kernels.context_match import context_match
from vllm_recycling.matrix import AdjacencyMatrix
from vllm_recycling.transfer import to_device
from vllm_recycling.tree import HybridTree

# A context match is a suffix of 1 to MATCH_MAX tokens of the request's history seen earlier in
# it; the budget calibrates by its length (``budget.CONTEXT_MATCH``: 4-7 alike, 8 and more alike).
MATCH_MIN, MATCH_MAX = 1, 16


@dataclass(frozen=True)
class Context:
    """The context matches of the drafted requests: tokens [A, C] int64 (-1 where the match
    has no more tokens), match_len [A] int64 (0: no match)."""

    tokens: np.ndarray
    match_len: np.ndarray

    @classmethod
    def find(cls, history: np.ndarray | None, rows: list[int], num_tokens: np.ndarray, length: int) -> "Context | None":
        """The matches of requests ``rows`` (their rows in vLLM's ``token_ids_cpu`` ``history``,
        ``num_tokens`` [A] their histories' lengths); None without a history or a chain."""
        if history is None or length == 0:
            return None
        tokens, match_len = context_match(history, np.asarray(rows), num_tokens, MATCH_MIN, MATCH_MAX, length)
        return cls(tokens, match_len)

    @property
    def valid(self) -> np.ndarray:
        """[A, C] bool: the context nodes with a token (an ancestor-closed prefix per request)."""
        return self.tokens >= 0


def draft(matrix: AdjacencyMatrix, hybrid: HybridTree, roots: torch.Tensor, slots: torch.Tensor | None,
          context: Context | None, with_probs: bool = False):
    """tokens [A, N+1] int64 over the hybrid template's nodes (node 0: the roots): matrix nodes
    from the matrix (``AdjacencyMatrix.draft``), context nodes from ``context`` (0 where it has
    none: such nodes must not be sent); with_probs also conf [A, N+1] float32: matrix nodes'
    confidences, context nodes' ``budget.context_bins`` (0 without a token)."""
    drafted = matrix.draft(roots, hybrid.matrix, slots, with_probs=with_probs)
    tokens_m, conf_m = drafted if with_probs else (drafted, None)
    if hybrid.context_length == 0:
        return (tokens_m.long(), conf_m) if with_probs else tokens_m.long()
    num, device = tokens_m.shape[0], tokens_m.device
    width = hybrid.tree.num_nodes + 1
    tokens = torch.zeros((num, width), dtype=torch.int64, device=device)
    tokens[:, hybrid.matrix_nodes] = tokens_m.long()
    if context is not None:
        tokens[:, hybrid.context_nodes] = to_device(np.maximum(context.tokens, 0), torch.int64, device)
    if not with_probs:
        return tokens
    conf = torch.zeros((num, width), dtype=torch.float32, device=device)
    conf[:, hybrid.matrix_nodes] = conf_m
    if context is not None:
        bins = context_bins(context.match_len, hybrid.context_length)
        conf[:, hybrid.context_nodes] = to_device(np.where(context.valid, bins, 0.0), torch.float32, device)
    return tokens, conf
