"""The initial matrix from the model (``prior.py``, ``warm.py``): its cache, and its content
computed through vLLM against the model's own next-token top-k in plain transformers."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_recycling.prior import (
    PriorError,
    cache_root,
    load_prior,
    model_identity,
    prior_key,
    prior_path,
    save_prior,
)


def _prior(vocab=16, k=4):
    table = torch.stack([(torch.arange(vocab) + d) % vocab for d in range(1, k + 1)], 1).int()
    return table, torch.full((vocab, k), 0.125, dtype=torch.float16)


def test_round_trip_and_atomic_write(tmp_path):
    table, probs = _prior()
    path = tmp_path / "priors" / "p.safetensors"
    save_prior(path, table, probs, "m", 1.5)
    got = load_prior(path, 16, 4)
    assert torch.equal(got[0], table) and torch.equal(got[1], probs)
    assert [p.name for p in path.parent.iterdir()] == ["p.safetensors"]  # no temporary left
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_a_corrupt_or_mismatched_prior_is_never_loaded(tmp_path):
    table, probs = _prior()
    path = tmp_path / "p.safetensors"
    with pytest.raises(PriorError, match="unreadable"):
        load_prior(path, 16, 4)
    save_prior(path, table, probs, "m", 1.0)
    with pytest.raises(PriorError, match=r"shape \(16, 4\), expected \(32, 4\)"):
        load_prior(path, 32, 4)
    with pytest.raises(PriorError, match=r"expected \(16, 8\)"):
        load_prior(path, 16, 8)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(PriorError, match="unreadable"):
        load_prior(path, 16, 4)
    bad = table.clone()
    bad[3, 0] = 99
    save_prior(path, bad, probs, "m", 1.0)
    with pytest.raises(PriorError, match="outside the vocabulary"):
        load_prior(path, 16, 4)
    save_prior(path, table, probs * 16, "m", 1.0)
    with pytest.raises(PriorError, match=r"outside \[0, 1\]"):
        load_prior(path, 16, 4)


def test_cache_path_keyed_by_model_identity_vocabulary_and_k(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 16}))
    (model / "model.safetensors").write_bytes(b"x" * 10)
    path = prior_path(str(model), None, 16, 4)
    assert path.parent == tmp_path / "cache" / "priors" and path.suffix == ".safetensors"
    assert path == prior_path(str(model), None, 16, 4)
    assert len({path, prior_path(str(model), None, 32, 4), prior_path(str(model), None, 16, 8),
                prior_path(str(model), "v2", 16, 4), prior_path("org/other", None, 16, 4)}) == 5
    key = prior_key(str(model), None, 16, 4)
    (model / "model.safetensors").write_bytes(b"y" * 11)  # the weights were rebuilt in place
    assert prior_key(str(model), None, 16, 4) != key
    assert model_identity(str(model))["model"] == str(model.resolve())


@pytest.mark.slow
def test_prior_through_vllm_is_the_models_own_top_k(tiny_model, monkeypatch):
    """``ensure_prior`` computes the prior in a child process through vLLM, once (the suite's
    engines share it): its rows are the model's top-k after the assistant turn's opening and
    the token, as transformers computes them (float32: the same ranks wherever the logits are
    not near-equal)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs

    from engines import ENGINE
    from vllm_recycling.warm import context_ids, ensure_prior

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    args = EngineArgs(tiny_model, **ENGINE)
    model_config = args.create_model_config()
    path = ensure_prior(args, model_config, 8)
    table, probs = load_prior(path, 1024, 8)
    assert path.stat().st_mtime == ensure_prior(args, model_config, 8).stat().st_mtime  # cached

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prefix = context_ids(tokenizer)
    assert prefix == tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    tokens = torch.arange(0, 1024, 37)
    ids = torch.cat([torch.tensor(prefix).repeat(len(tokens), 1), tokens[:, None]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1].float()
    want = logits.softmax(-1)
    top = want.topk(8).indices
    agree = (table[tokens].long() == top).float().mean().item()
    assert agree > 0.98, agree
    got = probs[tokens].float()
    torch.testing.assert_close(got, want.gather(1, table[tokens].long()), atol=2e-3, rtol=2e-2)
