"""Who holds which slot of the matrix (``slots.MatrixSlots``), and what tensor-parallel ranks
compare so that they never verify different trees (``adaptive_budget.digest_checked``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")


def overlay_slots(max_requests: int):
    from vllm_recycling.config import RecyclingConfig
    from vllm_recycling.matrix import AdjacencyMatrix
    from vllm_recycling.slots import MatrixSlots

    matrix = AdjacencyMatrix(16, 2, scope="overlay", max_requests=max_requests, overlay_rows=4)
    return MatrixSlots(matrix, RecyclingConfig(matrix_scope="overlay"), max_requests)


def test_a_full_pool_evicts_the_least_recently_scheduled():
    """16 slots held; a batch of 8 new requests evicts the 8 preempted holders scheduled
    longest ago, whatever the order of a set of their ids (string hashing differs between
    processes: tensor-parallel ranks spawned apart would evict different requests)."""
    slots = overlay_slots(16)
    names = [f"request-{i}" for i in range(24)]
    live = set(names)
    slots.assign(names[:16], live)
    recent = [names[i] for i in (9, 3, 14, 0, 7, 12, 5, 1)]  # scheduled again, in this order
    for name in recent:
        slots.assign([name], live)
    slots.assign(names[16:], live)
    assert list(slots.holders) == recent + names[16:] and slots.evictions == 8
    assert sorted(slots.matrix._slot_of) == sorted(recent + names[16:])


def test_finished_requests_free_their_slots_in_holding_order():
    """Slots go back to the pool in the order their requests were scheduled, so the next
    requests get the same slots on every rank."""
    slots = overlay_slots(4)
    slots.assign(["d", "b", "c", "a"], {"a", "b", "c", "d"})
    first = dict(slots.matrix._slot_of)
    slots.assign(["x", "y"], {"x", "y"})  # a, b, c, d finished
    assert list(slots.holders) == ["x", "y"]
    assert [slots.matrix._slot_of[r] for r in "xy"] == [first["a"], first["c"]]


def two_ranks(other_digest: int, num_params: int = 5):
    """A tensor-parallel mean over this rank and another whose decision digest is
    ``other_digest`` and whose ``num_params`` cost parameters (the cost model shares five:
    a, b, c, d and the per-chain e) are all 1."""
    from vllm_recycling.ranks import digest_checked

    sent = []
    digest_checked(lambda v: sent.append(v) or v, other_digest)(np.ones(num_params))
    return lambda values: (values + sent[0]) / 2


def test_ranks_compare_their_decision_digests_at_each_agreement():
    from vllm_recycling.ranks import RanksDisagree, digest_checked

    for digest in (0, 1, 0xFFFFFFFF, 0x8000_0001):
        agreed = digest_checked(two_ranks(digest, 4), digest)(np.array([3.0, 0.0, 1.0, -1.0]))
        assert agreed.tolist() == [2.0, 0.5, 1.0, 0.0]  # the cost parameters, averaged
    for mine, other in ((1, 2), (0x10000, 0), (0xFFFFFFFF, 0xFFFFFFFE), (5, 0x50000)):
        with pytest.raises(RanksDisagree, match=f"decision digest {mine:08x} on this rank"):
            digest_checked(two_ranks(other, 4), mine)(np.zeros(4))


def test_learn_stops_when_another_rank_decided_otherwise(monkeypatch):
    """The budget's first cost agreement (its first step) all-reduces the digest with the cost."""
    from proposers import make_proposer

    from vllm_recycling import adaptive_budget
    from vllm_recycling.step import NO_PROPOSAL, StepRecord

    budget = make_proposer("shared", budget="auto", tree=[[0], [1]]).budget
    budget.decision_digest = 7
    monkeypatch.setattr(adaptive_budget, "tensor_parallel_mean", lambda: two_ranks(7))
    budget.learn(StepRecord(("a",), NO_PROPOSAL, None), [[1]])  # step 1: an agreement, alike
    monkeypatch.setattr(adaptive_budget, "tensor_parallel_mean", lambda: two_ranks(8))
    with pytest.raises(adaptive_budget.RanksDisagree):
        budget.learn(StepRecord(("a",), NO_PROPOSAL, None), [[1]])  # step 2: they differ


def test_ranks_that_lay_out_different_trees_stop_before_the_forward():
    """Review A4: every rank lays the scheduled drafts out as template nodes from its own
    proposal; before the step's forward (``begin_step``) the ranks compare those layouts, every
    step, so ranks that would verify different trees stop there (not at the next cost
    agreement, up to 32 steps later, or never with budget "fixed")."""
    from proposers import begin, make_proposer

    from vllm_recycling.ranks import RanksDisagree
    from vllm_recycling.step import Proposal

    def rank(nodes: list[int]):
        proposer = make_proposer("shared", budget="auto", tree=[[0], [1], [0, 0]])
        proposer.proposal = Proposal(sent={"a": (np.array(nodes), np.zeros(len(nodes), dtype=np.int64)),
                                           "b": (np.array([1]), np.zeros(1, dtype=np.int64))})
        return proposer

    sent = []
    first = rank([1, 2])
    first.tp_mean = lambda values: sent.append(values) or values  # what rank 0 contributes
    begin(first, ["a", "b", "c"], num_draft=[2, 1, 0])
    assert len(sent) == 1
    alike, other = rank([1, 2]), rank([1, 3])  # rank 1: the same layout, or node 3 for node 2
    for proposer in (alike, other):
        proposer.tp_mean = lambda values: (values + sent[0]) / 2
    assert begin(alike, ["a", "b", "c"], num_draft=[2, 1, 0]) is not None
    with pytest.raises(RanksDisagree):
        begin(other, ["a", "b", "c"], num_draft=[2, 1, 0])
    assert other.record is None  # stopped before the step's record, before any row ran


@pytest.mark.parametrize("error", [AssertionError, ImportError, RuntimeError])
def test_one_first_rank_helper_a_single_process_without_parallel_state(monkeypatch, error):
    """Review D2: the proposer and the slots ask one helper, which takes every way vLLM says
    there is no parallel state (no group: AssertionError; torch.distributed not set up:
    RuntimeError) for a single process, the first rank."""
    from vllm.distributed import parallel_state

    from vllm_recycling import proposer, slots

    assert proposer.is_first_rank is slots.is_first_rank

    def no_group():
        raise error("no tensor-parallel group")

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", no_group)
    assert slots.is_first_rank()
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    assert not slots.is_first_rank()
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    assert slots.is_first_rank()
