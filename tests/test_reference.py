"""The reference decoder on tiny-random: greedy output equals plain greedy decoding
(``test_smollm2.py`` checks it on the real model)."""

import pytest
import torch

from vllm_recycling.matrix import AdjacencyMatrix
from vllm_recycling.tools.prompts import chat_prompt_ids
from vllm_recycling.tools.reference import ReferenceDecoder, SamplingSettings, _keep_path
from vllm_recycling.tree import load_tree


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def _plain_greedy(model, ids, n, eos):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def test_sampling_is_seeded_and_completes(tiny):
    model, tok = tiny
    ids = chat_prompt_ids(tok, "Write a haiku about speculative decoding.")
    settings = SamplingSettings(temperature=0.8, top_k=50, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        decoder = ReferenceDecoder(model, load_tree("tree32", 8), AdjacencyMatrix(model.config.vocab_size, 8))
        runs.append(decoder.generate(ids, 24, sampling=settings))
    assert runs[0].tokens == runs[1].tokens
    assert len(runs[0].tokens) == 24 and all(0 <= t < model.config.vocab_size for t in runs[0].tokens)


@pytest.mark.parametrize("tree,scope,context", [
    ("chain6", "per_request", 0), ("tree16", "per_request", 0), ([[0]], "per_request", 0),
    ("tree16", "overlay", 0), ("tree16", "shared", 0), ("tree16", "per_request", 16),
])
def test_tiny_random_greedy_equals_generate(tiny, tree, scope, context):
    """Every tree shape and scope, with the context branch too (its nodes verified only as deep
    as the match has tokens): greedy output as plain greedy decoding."""
    model, tok = tiny
    matrix = AdjacencyMatrix(model.config.vocab_size, 8, scope=scope, max_requests=1, overlay_rows=16)
    decoder = ReferenceDecoder(model, load_tree(tree, 8), matrix, context_length=context)
    steps = []
    for i, text in enumerate(["the tree of tokens", "a matrix of next words", "weather"]):
        ids = chat_prompt_ids(tok, text)
        got = decoder.generate(ids, 32, request_id=str(i))  # no EOS: the full 32 tokens
        assert got.tokens == _plain_greedy(model, ids, 32, None)[:32]
        assert len(got.tokens) == 32
        steps += got.tokens_per_step
    if scope != "per_request" or context:  # a matrix kept across the prompts, or the prompt's own
        assert sum(steps) > len(steps)  # text: some drafts are accepted


def test_max_new_tokens_one_and_eos_stop(tiny):
    model, tok = tiny
    decoder = ReferenceDecoder(model, load_tree("chain6", 8), AdjacencyMatrix(model.config.vocab_size, 8))
    ids = chat_prompt_ids(tok, "stop early")
    first = decoder.generate(ids, 1)
    assert len(first.tokens) == 1 and first.tokens_per_step == []
    full = decoder.generate(ids, 16).tokens
    eos = full[5]  # pretend the sixth token is EOS: generation stops right after it
    assert decoder.generate(ids, 16, eos_token_id=eos).tokens == full[: full.index(eos) + 1]


def test_keep_path_compacts_kv():
    class Layer:
        def __init__(self):
            self.keys = torch.arange(10.0).view(1, 1, 10, 1)
            self.values = -self.keys

    class Cache:
        layers = [Layer(), Layer()]

    cache = Cache()
    _keep_path(cache, prefix=4, nodes=torch.tensor([0, 2, 5]))
    for layer in cache.layers:
        assert layer.keys.flatten().tolist() == [0, 1, 2, 3, 4, 6, 9]
        assert layer.values.flatten().tolist() == [0, -1, -2, -3, -4, -6, -9]
