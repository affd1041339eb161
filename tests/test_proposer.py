"""The proposer on its own (no engine): what it drafts, sends, learns and saves, from the plain
values the patches hand it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from proposers import begin, make_proposer, matrix_rows, observe, verification_rows  # noqa: E402


def test_proposer_updates_from_every_row_then_drafts_the_chain():
    import numpy as np
    import torch

    proposer = make_proposer("shared")
    # request a: a prefill (one row, token 5 -> 7); b: root 3 and drafts 4, 6 (three rows)
    observe(
        proposer, req_ids=["a", "b"], live_req_ids={"a", "b"},
        tokens=torch.tensor([5, 3, 4, 6], dtype=torch.int32),
        logits=verification_rows([7, 4, 5, 1]), num_draft_tokens=[0, 2],
    )
    adj = matrix_rows(proposer.matrix)
    assert adj[5].tolist() == [7, 0, 1, 2] and adj[3, 0] == 4 and adj[4, 0] == 5 and adj[6, 0] == 1
    drafts = proposer.propose(
        [[7], [4, 5], [], [2]], np.array([10, 20, 30, 64], dtype=np.int32), np.zeros((4, 64), np.int32)
    )
    # a: root 7 (row still zeros); b: root 5 -> 7 -> 0; partial prefill and full request: none
    assert drafts == [[0, 0, 0], [7, 0, 0], [], []]


def test_proposer_auto_budget_sends_what_pays_and_learns_from_it():
    """budget="auto": a confident successor is sent, unlikely ones are not; the next step's
    outcome (accepted) is counted in the calibration, and the step's time in the cost model."""
    import numpy as np
    import torch

    from vllm_recycling.budget import confidence_bins
    from vllm_recycling.cost_model import StepCost

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]], budget="auto")
    budget = proposer.budget
    budget.cost = StepCost([1, 101], [1.0, 2.0])  # 10 ms per token on a 1 s step
    budget.calibration.rates[:] = 0.0
    budget.calibration.rates[15] = 0.9  # only confidences above 0.88 get accepted, first level
    begin(proposer, ["a"])
    # token 5 -> 7 with probability ~1; 7's row was never verified (probabilities 0)
    observe(proposer, ["a"], {"a"}, torch.tensor([5]), verification_rows([7]), [0])
    assert proposer.matrix.probs[5, 0] == 1.0 and proposer.matrix.probs[7].eq(0).all()
    assert proposer.propose([[5]], np.array([10]), None) == [[7]]  # node 1 only
    assert budget.last_admission.num_admitted == 1 and budget.last_admission.trees == 0
    assert proposer.proposal.nodes_of("a").tolist() == [1]
    # next step: a chain of one draft (no tree step), accepted, then the bonus token 3
    offsets = begin(proposer, ["a"], num_draft=[1], computed=[11])
    assert offsets is None and proposer.record.plan.decode_only and proposer.record.plan.tree is None
    observe(proposer, ["a"], {"a"}, torch.tensor([5, 7]), verification_rows([7, 3]), [1])
    trials = budget.calibration.trials.copy()
    proposer.propose([[7, 3]], np.array([12]), None)
    top = int(confidence_bins(np.array([1.0]))[0])
    assert trials[top] == 0 and budget.calibration.trials[top] == 1
    assert budget.cost.observed == 1 and proposer.record is None


def test_profile_times_small_sizes_in_rounds(monkeypatch):
    """The start-up profile times every size up to EXACT_PROFILE_TOKENS once per round, rounds
    ascending and descending by turns, so a slow moment of the machine touches every size alike;
    each size's profile is its median."""
    import numpy as np

    from vllm_recycling import adaptive_budget
    from vllm_recycling.cost_model import EXACT_PROFILE_TOKENS, profile_sizes

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]], budget="auto")
    clock, calls = [0.0], []

    def run_tokens(n):
        calls.append(n)
        slow = 10.0 if len(calls) in (3, 4) else 0.0  # one slow moment, early in round one
        clock[0] += n * 1e-3 + slow

    monkeypatch.setattr(adaptive_budget.time, "perf_counter", lambda: clock[0])
    proposer.profile_step_cost(run_tokens, 100)
    sizes = profile_sizes(100)
    small = [n for n in sizes if n <= EXACT_PROFILE_TOKENS]
    rounds = [small if r % 2 == 0 else small[::-1] for r in range(adaptive_budget.PROFILE_REPEATS)]
    assert calls == [sizes[0]] + [n for r in rounds for n in r] + sizes[len(small):]
    assert proposer.budget.cost.sizes.tolist() == sizes
    assert proposer.budget.cost.seconds == pytest.approx(np.array(sizes) * 1e-3)  # medians: no slow size


def test_proposer_auto_budget_does_not_draft_when_nothing_can_pay():
    """budget="auto": when no edge the calibration knows is likely enough to pay for a token,
    the step decodes plainly without drafting (what the admission would decide)."""
    import numpy as np
    import torch

    from vllm_recycling.cost_model import StepCost

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]], budget="auto")
    budget = proposer.budget
    budget.cost = StepCost([1, 101], [1.0, 2.0])  # 10 ms per token on a 1 s step
    budget.calibration.prior_hits[:] = 0.0
    budget.calibration.observe(np.array([0]), np.array([False]))  # every bin at 0: nothing pays
    assert budget.calibration.max_edge == 0.0
    begin(proposer, ["a"])
    observe(proposer, ["a"], {"a"}, torch.tensor([5]), verification_rows([7]), [0])

    draft = proposer.matrix.draft
    drafted = []

    def first_level_only(roots, tree, *args, **kwargs):
        drafted.append(tree.num_nodes)
        return draft(roots, tree, *args, **kwargs)

    proposer.matrix.draft = first_level_only
    assert proposer.propose([[5]], np.array([10]), None) == [[]]
    assert budget.last_admission.num_admitted == 0 and not budget.last_admission.mask.any()
    assert drafted == [2]  # the first level (nodes [0] and [1]) for the calibration, not the tree


def test_proposer_auto_budget_learns_while_sending_nothing():
    """A request sent no drafts still teaches the calibration: the token its step emits is the
    target's own, so each of its first-level nodes would have been accepted iff it is that
    token."""
    import numpy as np
    import torch

    from vllm_recycling.budget import FORGET, REQUEST_PRIOR, confidence_bins
    from vllm_recycling.cost_model import StepCost

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]], budget="auto")
    calibration = proposer.budget.calibration
    proposer.budget.cost = StepCost([1, 101], [1.0, 2.0])
    calibration.prior_hits[:] = 0.0
    calibration.observe(np.array([0]), np.array([False]))  # nothing pays
    begin(proposer, ["a", "b"])
    # 5 -> 7 (probability ~1), then 0 (~0); 6's row never written: nodes 0 and 0
    observe(proposer, ["a", "b"], {"a", "b"}, torch.tensor([5, 9]), verification_rows([7, 2]), [0, 0])
    assert proposer.propose([[5], [6]], np.array([10, 10]), None) == [[], []]
    trials, hits = calibration.trials.copy(), calibration.hits.copy()
    begin(proposer, ["a", "b"], num_draft=[0, 0], computed=[11, 11])
    observe(proposer, ["a", "b"], {"a", "b"}, torch.tensor([5, 6]), verification_rows([7, 0]), [0, 0])
    proposer.propose([[7], [0]], np.array([11, 11]), None)  # a emitted 7, b emitted 0
    top, low = (int(b) for b in confidence_bins(np.array([1.0, 0.0])))
    # a: node [0] (token 7, bin top) accepted, node [1] (token 0, bin low, written) not;
    # b: its root's row was never written (token 0 at every rank, confidence 0): no trials
    learnt = calibration.trials - FORGET * trials, calibration.hits - FORGET * hits
    assert learnt[0][[top, low]].tolist() == pytest.approx([1, 1])
    assert learnt[1][[top, low]].tolist() == pytest.approx([1, 0])
    # and a's own factor (RequestFit): one of its two first-level edges accepted where the
    # calibration (its prior zeroed, one failure seen) expected none; b tried nothing
    fit = proposer.budget.request_fit
    assert fit.hits == {"a": 1.0} and fit.expected == {"a": 0.0}
    assert fit.scale(["a", "b"]).tolist() == pytest.approx([(1 + REQUEST_PRIOR) / REQUEST_PRIOR, 1.0])


def test_proposer_per_request_matrices():
    import numpy as np
    import torch

    proposer = make_proposer("per_request", max_num_seqs=2)
    tokens = torch.tensor([5, 5], dtype=torch.int32)
    observe(proposer, ["a", "b"], {"a", "b"}, tokens, verification_rows([7, 9]), [0, 0])
    assert proposer.propose([[5], [5]], np.array([3, 3]), None) == [[7, 0, 0], [9, 0, 0]]
    # a finished; c gets a fresh matrix (the pool holds 2)
    observe(proposer, ["b", "c"], {"b", "c"}, tokens, verification_rows([9, 2]), [0, 0])
    assert proposer.propose([[5], [8]], np.array([4, 3]), None) == [[9, 0, 0], [0, 0, 0]]
    # b preempted (live but not scheduled): its matrix makes room for d
    observe(proposer, ["c", "d"], {"b", "c", "d"}, tokens, verification_rows([2, 11]), [0, 0])
    assert proposer.propose([[5], [5]], np.array([4, 3]), None) == [[2, 0, 0], [11, 0, 0]]
    assert list(proposer.slots.holders) == ["c", "d"]


def test_proposer_tree_step_from_plain_values():
    """What ``patches.runner.TreePositions`` hands the proposer: the batch's requests (one with
    structured output, which gets no drafts) and the runner's host arrays of the step; the
    step's record and the tree the attention layers read (``step.ACTIVE_TREE``)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from vllm_recycling.step import ACTIVE_TREE

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]])  # nodes at depths 1, 1, 2
    params = {"a": SimpleNamespace(structured_outputs=None),
              "b": SimpleNamespace(structured_outputs=object())}
    assert begin(proposer, ["a", "b", "gone"], params=params.get) is None
    assert proposer.propose([[5], [6], [7]], np.array([3, 3, 3]), None) == [[0, 0, 0], [], [0, 0, 0]]

    slots = torch.arange(100, 105)
    try:
        # a: a 1-token decode without drafts (row 0); b: root row 1, nodes at rows 2, 3, 4
        offsets = begin(proposer, ["a", "b"], num_draft=[0, 3], computed=[10, 20], slots=slots)
        assert offsets.dtype == torch.int64 and offsets.tolist() == [0, 0, 0, -1, -1]
        tree, plan = ACTIVE_TREE.tree, proposer.record.plan
        assert tree is plan.tree and plan.slot_mapping is slots
        assert (tree.num_tokens, tree.req_index_np.tolist(), tree.prefix_len.tolist()) == (5, [1], [20])
        assert proposer.record.batch == ("a", "b") and plan.num_draft == (0, 3) and plan.num_trees == 1
        assert begin(proposer, ["a"], computed=[10], slots=slots) is None
        assert ACTIVE_TREE.tree is None
    finally:
        ACTIVE_TREE.clear()


def test_load_model_verifies_the_chain_where_the_layers_rule_trees_out(monkeypatch):
    """The worker's start-up check sees the attention layers vLLM built; a refusal goes through
    the front end's decision (``support.chain_instead``): an unset verify drafts the chain,
    an explicit "tree" refuses to start."""
    from dataclasses import replace

    from vllm_recycling import support
    from vllm_recycling.support import TreesUnsupported

    def refuse(vllm_config, model):
        raise TreesUnsupported("sliding-window attention ((511, 0))")

    decided = []
    real = support.chain_instead
    monkeypatch.setattr("vllm_recycling.proposer.chain_instead",
                        lambda *a, **kw: decided.append(a[1].why) or real(*a, **kw))
    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]])
    monkeypatch.setattr(proposer.verifier, "check_support", refuse)
    proposer.load_model(None)
    assert decided == ["sliding-window attention ((511, 0))"]
    assert proposer.config.verify == "chain" and proposer.verifier is None
    assert [list(p) for p in proposer.template.paths] == [[0] * d for d in range(1, 7)]  # the top-1 chain

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]])
    proposer.config = replace(proposer.config, verify="tree")
    monkeypatch.setattr(proposer.verifier, "check_support", refuse)
    with pytest.raises(TreesUnsupported, match=r"not available here: sliding-window attention \(\(511, 0\)\)"):
        proposer.load_model(None)


def test_proposer_starts_from_the_snapshot(tmp_path):
    import numpy as np
    import torch

    from vllm_recycling.matrix import AdjacencyMatrix

    saved = AdjacencyMatrix(16, topk=4)
    saved.table[:, 0] = (torch.arange(16, dtype=torch.int32) + 1) % 16  # t -> t + 1
    saved.save(tmp_path / "adj.safetensors")
    proposer = make_proposer("shared", snapshot=str(tmp_path / "adj.safetensors"))
    assert torch.equal(matrix_rows(proposer.matrix), saved.table)
    assert proposer.propose([[3]], np.array([5]), None) == [[4, 5, 6]]



def test_snapshot_saved_every_interval(tmp_path, monkeypatch):
    import numpy as np

    from vllm_recycling import slots

    path = tmp_path / "adj.safetensors"
    proposer = make_proposer("shared", snapshot=str(path))
    clock = [1000.0]
    monkeypatch.setattr(slots.time, "monotonic", lambda: clock[0])
    proposer.slots._last_save = clock[0]
    proposer.propose([[3]], np.array([5]), None)
    assert not path.exists()
    clock[0] += 300.0  # the default interval
    proposer.propose([[3]], np.array([5]), None)
    assert path.exists()



def test_proposer_starts_from_the_cached_prior(tmp_path, monkeypatch):
    """matrix_init="model": the worker's matrices start from the prior the front end cached for
    this model, vocabulary and k; without a usable file they start empty (and say why)."""
    import torch

    from vllm_recycling.prior import prior_path, save_prior

    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path))
    table = torch.stack([(torch.arange(16) + d) % 16 for d in (1, 2, 3, 4)], 1).int()
    probs = torch.full((16, 4), 0.25, dtype=torch.float16)
    save_prior(prior_path("tiny", None, 16, 4), table, probs, "tiny", 1.0)
    proposer = make_proposer("per_request", matrix_init="model", budget="auto", tree=[[0], [1]])
    proposer.matrix.allocate("a")
    assert torch.equal(matrix_rows(proposer.matrix, "a"), table)
    assert torch.equal(proposer.matrix.probs[:16], -probs)  # prior rows: calibrated apart
    other = make_proposer("per_request", matrix_init="model", model="another")  # no prior cached
    assert other.matrix.table.eq(0).all()


def test_context_branch_drafts_the_match_of_the_history():
    """context_match: the tree holds a chain of the tokens that followed the longest recent
    match of the request's own history; budget "fixed" sends every matrix node and the context
    nodes that have a token, recorded (each request's tree is its own), and the step plan
    verifies exactly those nodes."""
    import numpy as np
    import torch

    from vllm_recycling.config import CONTEXT_LENGTH

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]], context_match=True)
    hybrid = proposer.hybrid
    assert hybrid.tree.num_nodes == 3 + CONTEXT_LENGTH and hybrid.context_nodes[0] == 1
    history = np.zeros((2, 64), dtype=np.int32)
    history[0, :9] = [3, 9, 4, 7, 1, 3, 9, 4, 7]  # "3 9 4 7" seen before, followed by "1 3 9 4 7"
    history[1, :3] = [5, 6, 8]  # no repeat: no match
    begin(proposer, ["a", "b"])
    drafts = proposer.propose([[7], [8]], np.array([9, 3]), history)
    # a: the context chain 1 3 9 4 7 (5 tokens), then the matrix's 3 nodes (an empty matrix: 0s)
    assert drafts[0] == [1, 0, 0, 3, 0, 9, 4, 7] and drafts[1] == [0, 0, 0]
    nodes_a, nodes_b = proposer.proposal.nodes_of("a"), proposer.proposal.nodes_of("b")
    assert nodes_a.tolist() == sorted(hybrid.context_nodes[:5].tolist() + hybrid.matrix_nodes[1:].tolist())
    assert nodes_b.tolist() == hybrid.matrix_nodes[1:].tolist()
    # the next step: both trees scheduled whole; a's rows sit at the context chain's depths
    qsl = np.array([0, 9, 13])
    offsets = proposer.begin_step(["a", "b"], lambda r: None, [8, 3], qsl, np.array([9, 3]), torch.arange(13))
    tree = proposer.record.plan.tree
    assert tree.req_index_np.tolist() == [0, 1]
    depth = hybrid.tree.depth[torch.tensor([0] + nodes_a.tolist())]
    assert offsets[:9].tolist() == (depth - torch.arange(9)).tolist()


def test_auto_budget_sends_a_long_context_match_and_learns_from_it():
    """budget "auto" with the context branch: a long match's chain is sent when its calibrated
    survival pays (a chain: no tree attention), its outcome teaches the context table."""
    import numpy as np

    from vllm_recycling.budget import NUM_BINS
    from vllm_recycling.cost_model import StepCost

    proposer = make_proposer("shared", tree=[[0], [1], [0, 0]], budget="auto", context_match=True)
    budget = proposer.budget
    budget.cost = StepCost([1, 101], [1.0, 1.5])  # 5 ms per token on a 1 s step
    history = np.zeros((1, 64), dtype=np.int32)
    history[0, :12] = [3, 9, 4, 7, 1, 2, 3, 9, 4, 7, 1, 2]  # "3 9 4 7 1 2" then again
    begin(proposer, ["a"])
    drafts = proposer.propose([[2]], np.array([6 + 6]), history)
    # the match "3 9 4 7 1 2" (6 tokens) drafts what followed it: 3 9 4 7 1 2; the matrix nodes
    # (an empty matrix: confidence 0) are not worth a token
    assert drafts == [[3, 9, 4, 7, 1, 2]]
    assert budget.last_admission.trees == 0  # the context chain alone: no tree attention
    sent = proposer.proposal.nodes_of("a")
    assert sent.tolist() == proposer.hybrid.context_nodes[:6].tolist()
    before = budget.calibration.trials[4 * NUM_BINS:].sum()
    begin(proposer, ["a"], num_draft=[6], computed=[12])
    proposer.propose([[3, 9, 5]], np.array([15]), history)  # two accepted, the third rejected
    assert budget.calibration.trials[4 * NUM_BINS:].sum() == pytest.approx(before + 3)
