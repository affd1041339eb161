"""smollm2 (float32) through vLLM with recycling: greedy output identical to vLLM without
speculation on 32 Spec-Bench prompts at batch 8 and batch 1, for the default tree, a small tree
and chain mode; vLLM's MAT against the reference decoder's; a seeded sampled run.

One engine per mode, each fed the same prompts: first one by one (batch 1, the matrix cold at
the first prompt and kept across them, as the reference decoder's hot mode), then all 32 with
at most 8 running at once (batch 8).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from engines import (  # noqa: E402,F401  (in_process_engines: an autouse fixture)
    check_greedy_identity, engine, in_process_engines, spec_counters, token_ids,
)

NUM_PROMPTS = 32
NEW_TOKENS = 32
MAX_SEQS = 8
MODES = {
    "2.2.2": {"method": "recycling"},  # the default: verify="tree", tree "2.2.2" (80 nodes)
    "tree16": {"method": "recycling", "tree": "tree16"},
    "chain6": {"method": "recycling", "verify": "chain"},
}
MAT_TOLERANCE = 0.03

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_model() -> str:
    from vllm_recycling.models import prepare_model

    return str(prepare_model("smollm2"))


@pytest.fixture(scope="module")
def prompts(smollm2_model):
    from transformers import AutoTokenizer

    from vllm_recycling.prompts import chat_prompt_ids, spec_bench_questions

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    questions = spec_bench_questions(per_category=3)[:NUM_PROMPTS]
    assert len(questions) == NUM_PROMPTS
    return [chat_prompt_ids(tokenizer, q["turns"][0]) for q in questions]


def _generate(llm, prompts, params, one_by_one: bool):
    inputs = [{"prompt_token_ids": p} for p in prompts]
    if one_by_one:
        return [llm.generate([x], params, use_tqdm=False)[0] for x in inputs]
    return llm.generate(inputs, params, use_tqdm=False)


@pytest.fixture(scope="module")
def runs(smollm2_model, prompts):
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=2)
    out, seconds = {}, {}
    with engine(smollm2_model, max_num_seqs=MAX_SEQS) as llm:
        for batch in (1, 8):
            start = time.perf_counter()
            out["base", batch] = _generate(llm, prompts, greedy, one_by_one=batch == 1)
            seconds["none", batch] = time.perf_counter() - start
    for mode, spec in MODES.items():
        with engine(
            smollm2_model, max_num_seqs=MAX_SEQS, speculative_config=spec, disable_log_stats=False
        ) as llm:
            before = spec_counters(llm)
            for batch in (1, 8):
                start = time.perf_counter()
                out[mode, batch] = token_ids(_generate(llm, prompts, greedy, one_by_one=batch == 1))
                seconds[mode, batch] = time.perf_counter() - start
                after = spec_counters(llm)
                out[mode, batch, "counters"] = {k: after[k] - before[k] for k in after}
                before = after
            if mode == "2.2.2":
                sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=1234)
                out["sampled"] = _generate(llm, prompts[:8], sampled, one_by_one=False)
                out["sampled", "counters"] = spec_counters(llm)
    out["seconds"] = seconds
    return out


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_identical(runs, mode, batch):
    result = check_greedy_identity(runs["base", batch], runs[mode, batch])
    c = runs[mode, batch, "counters"]
    tokens = sum(len(t) for t in runs[mode, batch])
    print(
        f"\nsmollm2 {mode}, batch {batch}: {result['identical']}/{result['prompts']} identical, "
        f"near-ties {result['near_ties']}; {c}, MAT {1 + c['accepted'] / c['drafts']:.3f}; "
        f"{tokens} tokens in {runs['seconds'][mode, batch]:.1f} s "
        f"(no speculation {runs['seconds']['none', batch]:.1f} s)"
    )
    assert len(result["near_ties"]) <= 2, "more than a few near-ties means a bug, not numerics"
    assert c["drafts"] > 0 and c["accepted"] > 0


def test_mat_matches_the_reference_decoder(runs, smollm2_model, prompts):
    """vLLM's mean acceptance length (1 + accepted / drafts) at batch 1 for the default tree,
    against the reference decoder's tokens per tree step on the same prompts in the same order
    (one matrix, cold at the first prompt)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_recycling.matrix import AdjacencyMatrix
    from vllm_recycling.reference import ReferenceDecoder
    from vllm_recycling.tree import load_tree

    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).eval()
    decoder = ReferenceDecoder(model, load_tree("2.2.2", 8), AdjacencyMatrix(model.config.vocab_size, 8))
    steps, same = [], 0
    for ids, vllm_tokens in zip(prompts, runs["2.2.2", 1]):
        got = decoder.generate(ids, NEW_TOKENS, eos_token_id=model.config.eos_token_id)
        steps += got.tokens_per_step
        same += got.tokens == vllm_tokens
    reference = sum(steps) / len(steps)
    c = runs["2.2.2", 1, "counters"]
    ours = 1 + c["accepted"] / c["drafts"]
    print(
        f"\nMAT 2.2.2 batch 1: vLLM {ours:.3f} ({c['drafts']} steps), reference {reference:.3f} "
        f"({len(steps)} steps); outputs equal on {same}/{len(prompts)} prompts"
    )
    assert abs(ours - reference) <= MAT_TOLERANCE * reference


def test_seeded_sampling_completes(runs):
    for out in runs["sampled"]:
        tokens = out.outputs[0].token_ids
        assert 0 < len(tokens) <= 16 and all(0 <= t < 49152 for t in tokens)
        assert out.outputs[0].finish_reason in ("stop", "length")
    assert runs["sampled", "counters"]["drafts"] > 0


needs_cuda = pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA and vLLM for GPUs"
)


@pytest.mark.gpu
@needs_cuda
def test_gpu_chain_greedy_identical(smollm2_model, prompts):
    """On a GPU install: chain mode against no speculation (bf16 and batch 8 as users run it)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with engine(smollm2_model, max_num_seqs=MAX_SEQS) as llm:
        base = llm.generate(inputs, greedy, use_tqdm=False)
    with engine(smollm2_model, max_num_seqs=MAX_SEQS, speculative_config=MODES["chain6"]) as llm:
        out = token_ids(llm.generate(inputs, greedy, use_tqdm=False))
    assert len(check_greedy_identity(base, out)["near_ties"]) <= 2


@pytest.mark.gpu
@needs_cuda
def test_gpu_tree_refused_at_start_up(smollm2_model):
    from vllm_recycling.config import RecyclingConfigError

    with pytest.raises(Exception) as e:
        with engine(smollm2_model, speculative_config=MODES["2.2.2"]):
            pass
    assert isinstance(e.value, RecyclingConfigError) or "verify='tree' is not available" in str(e.value)
