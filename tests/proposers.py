"""Building a ``RecyclingProposer`` without an engine, and handing it what the patches would;
reading an ``AdjacencyMatrix``'s rows."""

from __future__ import annotations


def matrix_rows(matrix, request_id: str | None = None):
    """The [V, k] matrix a request reads under per_request and salt scope (its own, its
    salt's), else the shared one: a view of ``matrix.table``, writable."""
    if matrix.scope == "per_request":
        index = int(matrix.slots([request_id])[0])
    else:
        index = max(matrix.matrix_of(request_id), 0) if request_id is not None else 0
    return matrix.table[index * matrix.vocab_size : (index + 1) * matrix.vocab_size]


def make_proposer(scope: str, max_num_seqs: int = 2, vocab_size: int = 16, snapshot=None,
                  tree=None, budget="fixed", matrix_init="empty", model="tiny", context_match=False):
    """A proposer with a top-4 matrix over 16 tokens: a 3-token chain, or the given tree; every
    node drafted every step unless budget="auto"; an empty matrix unless matrix_init="model";
    no context branch unless context_match."""
    from vllm_recycling.config import RecyclingConfig

    config = RecyclingConfig(
        topk=4, matrix_scope=scope, matrix_snapshot=snapshot, budget=budget, matrix_init=matrix_init,
        context_match=context_match,
        **({"verify": "chain", "num_speculative_tokens": 3} if tree is None else {"tree": tree}),
    )
    return proposer_of(config, vocab_size, max_num_seqs, 64, model)


def proposer_of(config, vocab_size: int, max_num_seqs: int, max_model_len: int, model: str):
    """A ``RecyclingProposer`` of ``config`` on the CPU, given what it reads of vLLM's config."""
    from types import SimpleNamespace

    from vllm_recycling.proposer import RecyclingProposer

    return RecyclingProposer(SimpleNamespace(
        additional_config={"recycling": config.to_dict()},
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab_size, max_model_len=max_model_len,
                                     model=model, revision=None),
        device_config=SimpleNamespace(device="cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    ))


def begin(proposer, req_ids, num_draft=None, computed=None, params=None, slots=None):
    """What ``patches.runner.TreePositions`` hands the proposer before a step's forward: the
    batch and the runner's host arrays (one token per request, then its drafts)."""
    import numpy as np
    import torch

    rows = [1 + (0 if num_draft is None else n) for n in (num_draft or [0] * len(req_ids))]
    qsl = np.concatenate([[0], np.cumsum(rows)])
    computed = np.array(computed if computed is not None else [10] * len(req_ids))
    slots = torch.arange(int(qsl[-1])) if slots is None else slots
    return proposer.begin_step(req_ids, params or (lambda r: None), num_draft, qsl, computed, slots)


def observe(proposer, req_ids, live_req_ids, tokens, logits, num_draft_tokens):
    """What ``patches.sampler.VerifyTree`` hands the proposer before sampling (no tree step;
    every request greedy)."""
    from types import SimpleNamespace

    return proposer.verify(
        req_ids, live_req_ids, tokens, logits, SimpleNamespace(num_draft_tokens=num_draft_tokens),
        greedy_metadata(), None, lambda: [],
    )


def greedy_metadata():
    """vLLM's ``SamplingMetadata`` as the proposer reads it for a batch where every request is
    greedy, without penalties or logits processors."""
    from types import SimpleNamespace

    return SimpleNamespace(all_greedy=True, no_penalties=True, bad_words_token_ids={},
                           logitsprocs=SimpleNamespace(non_argmax_invariant=[]), allowed_token_ids_mask=None,
                           max_num_logprobs=None, thinking_budget_state_holder=None)


def verification_rows(next_tokens: list[int], vocab_size: int = 16):
    """Logits rows whose argmax is the given token (then ids in ascending order)."""
    import torch

    logits = -torch.arange(vocab_size, dtype=torch.float32).repeat(len(next_tokens), 1)
    logits[range(len(next_tokens)), next_tokens] = 100.0
    return logits
