"""Every model vLLM serves works exactly or is refused at start-up with the reason.

- bfloat16: vLLM picks its KV layout by dtype and CPU (``amx`` for bfloat16 on CPUs with AMX,
  ``vec`` elsewhere); trees are verified in whichever it picks, greedy output and its logprobs
  as without speculation, bit for bit.
- A model with sliding-window layers beside full ones (Gemma 3's pattern: two KV-cache groups):
  the default configuration verifies the matrix's chain instead of trees and stays exact; an
  explicit ``"verify": "tree"`` is refused, naming why.
"""

from __future__ import annotations

import pytest

from engines import TINY_PROMPTS, check_greedy_identity, engine, greedy, spec_counters, token_ids

pytestmark = pytest.mark.slow

GEMMA_PROMPTS = TINY_PROMPTS[:6]


@pytest.fixture(scope="module")
def tiny_gemma3(tiny_model, tmp_path_factory) -> str:
    """A two-layer random Gemma 3 (a sliding-window layer of 16 positions, then a full one),
    with tiny-random's tokenizer: what vLLM keeps in two KV-cache groups."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    out = tmp_path_factory.mktemp("tiny-gemma3")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = Gemma3TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=2048, initializer_range=0.5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Gemma3ForCausalLM(config).to(torch.float32).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _drafting(worker) -> tuple:
    drafter = worker.model_runner.drafter
    layout = None if drafter.verifier is None else getattr(drafter.verifier.move_kv, "__self__", None)
    return drafter.config.verify, drafter.verifier is not None, getattr(layout, "isa", None)


def _scratch(worker) -> tuple[int, int]:
    """The tree pass's scratch blocks: (how many, how many blocks the layers' caches hold)."""
    runner = worker.model_runner
    return len(runner.drafter.verifier.scratch_blocks), runner.kv_caches[0].shape[0]


def test_sliding_window_model_verifies_the_chain_by_default_and_stays_exact(tiny_gemma3):
    with engine(tiny_gemma3) as llm:
        base = llm.generate(GEMMA_PROMPTS, greedy(logprobs=2), use_tqdm=False)
    spec = {"method": "recycling", "matrix_init": "empty", "budget": "fixed"}
    with engine(tiny_gemma3, speculative_config=spec, disable_log_stats=False) as llm:
        assert llm.collective_rpc(_drafting) == [("chain", False, None)]
        llm.generate(GEMMA_PROMPTS, greedy(), use_tqdm=False)  # the matrix learns
        recycled = token_ids(llm.generate(GEMMA_PROMPTS, greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    assert counters["accepted"] > 0  # chains were drafted and accepted
    check_greedy_identity(base, recycled)


def test_sliding_window_model_refuses_explicit_trees(tiny_gemma3):
    from vllm_recycling.config import RecyclingConfigError

    spec = {"method": "recycling", "matrix_init": "empty", "verify": "tree"}
    with pytest.raises(RecyclingConfigError, match=r"verify='tree' is not available here: sliding-window"):
        with engine(tiny_gemma3, speculative_config=spec):
            pass


@pytest.fixture(scope="module")
def tiny_head128(tiny_model, tmp_path_factory) -> str:
    """A two-layer random Llama with head size 128 (two query heads, one key/value head) and
    tiny-random's tokenizer: with ``block_size=32`` the shape whose scratch the plugin's earlier
    AMX kernel overflowed (head size above twice the block size)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-head128")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=2048,
                         initializer_range=0.5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("model, dtype, block_size, head_size", [
    ("tiny_model", "bfloat16", None, 64), ("tiny_model", "float32", None, 64),
    ("tiny_head128", "bfloat16", 32, 128)])
def test_trees_give_no_speculations_tokens_and_logprobs_bit_for_bit(request, model, dtype, block_size, head_size):
    """Trees on every step (budget fixed), in the KV layout vLLM picked for the model (amx for
    bfloat16 on an AMX CPU): every answer is no speculation's, token for token, and so is each
    token's logprob, to the last bit. Each tree row is computed as vLLM computes a plain step
    (``cpu_attention.PathPlan``); the plugin's earlier kernel summed in another order, which
    gave other logprobs in float32 here (and other tokens at bfloat16 near-ties on AMX), and
    overflowed its scratch with head size 128 in 32-token blocks on AMX (review 2026-12-04 A1)."""
    import torch

    model = request.getfixturevalue(model)
    extra = {} if block_size is None else {"block_size": block_size}

    from vllm_recycling.cpu_kv_cache import attention_isa

    def logprobs(outputs):
        return [[pos[tok].logprob for pos, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]

    prompts = TINY_PROMPTS[:6]  # bfloat16 is slow on CPUs without AVX-512
    with engine(model, dtype=dtype, **extra) as llm:
        base = llm.generate(prompts, greedy(logprobs=1), use_tqdm=False)
    spec = {"method": "recycling", "budget": "fixed", "matrix_init": "empty" if block_size else "model"}
    with engine(model, dtype=dtype, speculative_config=spec, disable_log_stats=False, **extra) as llm:
        isa = attention_isa(getattr(torch, dtype), llm.llm_engine.vllm_config.cache_config.block_size, head_size)
        assert llm.collective_rpc(_drafting) == [(None, True, isa)]
        num_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        assert llm.collective_rpc(_scratch) == [(64, num_blocks + 64)]  # the cache's 4096: the most
        llm.generate(prompts, greedy(), use_tqdm=False)
        recycled = llm.generate(prompts, greedy(logprobs=1), use_tqdm=False)
        counters = spec_counters(llm)
    assert counters["accepted"] > 0
    assert token_ids(recycled) == token_ids(base)
    assert logprobs(recycled) == logprobs(base)
