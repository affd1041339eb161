"""The plugin end to end in vLLM's engine, on tiny-random (``test_smollm2.py`` has the real
model): every request's output with recycling equals its output without speculation
(``conftest.tiny_base``), greedy at batch 12, with penalties, stop strings, stop tokens,
max_tokens, aborts, preemption, trees cut by the step's token budget, mixed greedy and sampled
batches; sampled output keeps the target distribution; seeded requests repeat with
per-request matrices (``test_seeded.py``: and give the tokens of no speculation); snapshots.

One engine per configuration, shared by the tests that need it (module fixtures). Tests that
start engines of their own come after the last test of the module's engine: an in-process
engine that shuts down tears down the parallel state the module's engine still uses.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engines import (  # noqa: E402
    SAMPLED_REQUESTS, TINY_PROMPTS, TINY_TOKENS, TINY_VOCAB, biased_walk, check_greedy_identity, chi_square,
    chi_square_critical, engine, greedy, pin_step_cost, random_prompts, run_seeded, run_tiny_suite,
    sampled_params, spec_counters, token_ids, unpin_step_cost,
)

# The default configuration (overlay matrix, tree "2.2.2") with every node verified every step
# (budget "fixed"): tree verification at its widest, on every step.
RECYCLING = {"method": "recycling", "budget": "fixed"}


@pytest.fixture(scope="module")
def tiny_recycling(tiny_model):
    """``RECYCLING``, kept for the whole module."""
    with engine(tiny_model, speculative_config=RECYCLING, disable_log_stats=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def recycled(tiny_recycling):
    """``run_tiny_suite`` through the default configuration, with its spec-decode counters."""
    out = run_tiny_suite(tiny_recycling)
    out["counters"] = spec_counters(tiny_recycling)
    return out


def test_greedy_identical(tiny_base, recycled):
    result = check_greedy_identity(tiny_base["greedy"], token_ids(recycled["greedy"]))
    assert result["near_ties"] == []
    c = recycled["counters"]
    assert c["drafts"] > 0 and c["accepted"] > 0


def test_penalties_read_the_path_as_history(tiny_base, recycled):
    """Repetition and frequency penalties see each draft's own ancestors, not its siblings."""
    base, got = tiny_base["penalty"], token_ids(recycled["penalty"])
    assert token_ids(base) != token_ids(tiny_base["greedy"])  # the penalties change the text
    assert check_greedy_identity(base, got)["near_ties"] == []


def test_stop_strings_cut_where_they_do_without_speculation(tiny_base, recycled):
    """A stop string is matched by the detokenizer on the emitted tokens, several of which
    arrive in one tree step: the text must still end exactly where it ends without drafts."""
    assert sum(reason == "stop" for _, reason in tiny_base["stop"]) >= len(TINY_PROMPTS) // 2
    assert recycled["stop"] == tiny_base["stop"]


def test_sampled_distribution_equals_no_speculation(tiny_base, recycled):
    """The joint distribution of the first tokens of SAMPLED_REQUESTS requests (temperature 1,
    top-k 4, top-p 0.95, presence penalty; unseeded) with recycling against without: every row
    of a tree is sampled with its output position's noise and the tree walked by the sampled
    tokens, so each emitted token is what its position samples and the two must agree
    (two-sample chi-square, p = 0.001)."""
    stat, df = chi_square(tiny_base["sampled"], recycled["sampled"])
    accepted = recycled["counters"]["accepted"]
    print(f"\nsampled: chi-square {stat:.1f} on {df} degrees of freedom "
          f"(critical {chi_square_critical(df):.1f}); {accepted} drafts accepted in the whole suite")
    assert df >= 5  # enough distinct outcomes for the test to mean something
    assert stat < chi_square_critical(df)
    assert len(set(recycled["sampled"])) > 1 and len(recycled["sampled"]) == SAMPLED_REQUESTS


def test_seeded_requests_give_the_tokens_of_no_speculation(tiny_base, recycled, tiny_recycling):
    """Sixteen seeded requests of eight settings (temperature 0.7-1.0, top-p, top-k, min-p,
    repetition / presence / frequency penalties, logit bias, greedy with a logit bias) mixed
    in batches of 8, and four alone: every token as without speculation, and again when
    repeated on the hotter matrix the suite left (other drafts, the same tokens)."""
    base = tiny_base["seeded"]
    assert len(set(map(tuple, base))) == len(base)  # the settings and seeds all tell apart
    assert tiny_base["seeded_one"] == base[:4]  # no speculation: batch 1 as batch 8
    assert recycled["seeded"] == base
    assert recycled["seeded_one"] == base[:4]
    # each emitted position's logprobs (raw, as a plain step returns them), sampled rows too
    for want, got in zip(tiny_base["seeded_logprobs"], recycled["seeded_logprobs"], strict=True):
        assert [sorted(p) for p in got] == [sorted(p) for p in want]
        for p, q in zip(want, got):
            assert all(abs(p[t] - q[t]) < 1e-4 for t in p)
    before = spec_counters(tiny_recycling)
    assert run_seeded(tiny_recycling) == base
    after = spec_counters(tiny_recycling)
    assert after["accepted"] > before["accepted"]


def test_chi_square_sees_a_biased_sampler(tiny_base):
    """The statistic above detects a sampler that is off: draws from a different top-k."""
    shifted = [(t[1], t[0], *t[2:]) for t in tiny_base["sampled"]]  # first two tokens swapped
    stat, df = chi_square(tiny_base["sampled"], shifted)
    assert stat > 10 * chi_square_critical(df)


def test_mixed_greedy_and_sampled_batch(tiny_base, recycled):
    """Greedy and seeded sampled requests in one batch (``mixed_params``), as the suite ran them
    (``run_tiny_suite`` runs this batch on every engine: reading its answer here, rather than
    running the batch again, checks the same outputs of the same engine)."""
    out = recycled["mixed"]
    for i, tokens in enumerate(out):
        assert len(tokens) == TINY_TOKENS and all(0 <= t < TINY_VOCAB for t in tokens)
        if i % 2 == 0:
            assert tokens == list(tiny_base["greedy"][i].outputs[0].token_ids), i
    assert out == tiny_base["mixed"]  # the seeded half too: the tokens of no speculation


def test_stop_tokens_and_max_tokens_inside_an_accepted_path(tiny_base, tiny_recycling):
    """Stop at a token of the greedy output (often emitted in the middle of an accepted
    path) and at short max_tokens: the output is cut exactly where it is without speculation."""
    params, expected = [], []
    for i, b in enumerate(tiny_base["greedy"]):
        ref = list(b.outputs[0].token_ids)
        if i % 2 == 0:
            stop = ref[17]
            params.append(greedy(stop_token_ids=[stop]))
            expected.append(ref[: ref.index(stop) + 1])
        else:
            params.append(greedy(max_tokens=5 + i))
            expected.append(ref[: 5 + i])
    assert token_ids(tiny_recycling.generate(TINY_PROMPTS, params, use_tqdm=False)) == expected


def test_min_tokens_masks_stops_where_it_does_without_speculation(tiny_base, recycled):
    """Review A1: a greedy request with ``min_tokens`` and a stop token: without speculation the
    token is masked before min_tokens and stops the answer after. A path accepted across
    min_tokens must not mask it there (vLLM's rejection sampler masks the bonus row whatever its
    position), nor emit it before: steps of such requests are verified row by row, each row
    masked by its own position."""
    assert recycled["min_tokens"] == tiny_base["min_tokens"]
    assert all(len(t) >= 12 for t in tiny_base["min_tokens"][0])  # none stopped before min_tokens


def test_aborted_request_leaves_the_others_exact(tiny_base, tiny_recycling):
    eng = tiny_recycling.llm_engine
    for i, p in enumerate(TINY_PROMPTS[:6]):
        eng.add_request(f"abort-{i}", p, greedy())
    done: dict[str, list[int]] = {}
    for step in range(200):
        if step == 3:
            eng.abort_request(["abort-2"])
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not eng.has_unfinished_requests():
            break
    assert "abort-2" not in done or len(done["abort-2"]) < TINY_TOKENS
    for i in (0, 1, 3, 4, 5):
        assert done[f"abort-{i}"] == list(tiny_base["greedy"][i].outputs[0].token_ids), i



def test_drafts_reach_the_scheduler_without_their_own_rpc(tiny_base, tiny_recycling, monkeypatch):
    """Each step's drafts ride on the step's output (``patches.DraftsWithSampledTokens``): the
    engine core never asks the workers for them separately, and every step still drafts."""
    core = tiny_recycling.llm_engine.engine_core.engine_core
    asked = []
    take = core.model_executor.take_draft_token_ids
    monkeypatch.setattr(core.model_executor, "take_draft_token_ids", lambda: asked.append(1) or take())
    before = spec_counters(tiny_recycling)
    out = token_ids(tiny_recycling.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
    after = spec_counters(tiny_recycling)
    assert asked == []
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []
    assert after["drafts"] > before["drafts"] and after["accepted"] > before["accepted"]

# -- other configurations ------------------------------------------------------------------------

def test_chi_square_sees_a_biased_tree_rule(tiny_model, tiny_base, monkeypatch):
    """The same test through the engine fails for a biased tree rule: each sampled request's
    walk takes the token sampled at a node to be one of its children's, so that every drafted
    child is accepted and emitted."""
    import vllm_recycling.verifier as verifier

    monkeypatch.setattr(verifier, "walk_sampled", biased_walk(verifier.walk_sampled))
    # the matrix's tree alone: the power of the test against a biased walk over matrix children
    # (the lossless test above runs with the context branch, the default)
    spec = {**RECYCLING, "context_match": False}
    with engine(tiny_model, speculative_config=spec, disable_log_stats=False) as llm:
        llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False)  # a hot matrix, as in the suite
        draws = token_ids(llm.generate([TINY_PROMPTS[0]] * SAMPLED_REQUESTS,
                                       sampled_params([None] * SAMPLED_REQUESTS), use_tqdm=False))
        assert spec_counters(llm)["accepted"] > 0
    stat, df = chi_square(tiny_base["sampled"], [tuple(d) for d in draws])
    print(f"\nbiased tree rule: chi-square {stat:.1f} on {df} degrees of freedom "
          f"(critical {chi_square_critical(df):.1f})")
    assert stat > chi_square_critical(df)


def test_seeded_requests_repeat_and_survive_chunked_prefill(tiny_model):
    """Seeded sampled requests whose prompts are prefilled in chunks (vLLM 0.32 on the CPU
    killed the engine there: ``patches.SeededChunkedPrefillOnCPU``): without speculation their
    tokens are those of an unchunked run; with recycling, chunked too, the very same tokens,
    sampled walks through the trees included."""
    from vllm import SamplingParams

    prompts = random_prompts(4, seed=11, vocab_size=TINY_VOCAB, lengths=(150, 200))
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True)
              for s in (1, 2, 3, 4)]
    runs = []
    for spec, budget in ((None, 64), (None, None), (RECYCLING, 128), (RECYCLING, 128)):
        extra = {} if budget is None else {"max_num_batched_tokens": budget, "max_num_seqs": 4}
        if spec is not None:
            extra["speculative_config"] = spec
        with engine(tiny_model, disable_log_stats=False, **extra) as llm:
            runs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
            if spec is not None:
                assert spec_counters(llm)["accepted"] > 0
    assert runs[0] == runs[1]
    assert runs[2] == runs[3] == runs[0]


def test_auto_budget_greedy_identical(tiny_model, tiny_base):
    """The default budget ("auto") sends each request a subset of the tree that changes from
    step to step, none at all at times. Steps without drafts still go through vLLM's rejection
    sampler, which killed the engine for a request with a top-k and no top-p
    (``patches.ConstraintsWithoutDrafts``)."""
    from vllm import SamplingParams

    with engine(tiny_model, speculative_config={"method": "recycling"}, disable_log_stats=False) as llm:
        # On the random tiny model drafting rarely pays, and the budget learns that within a few
        # steps (it then sends nothing): pin a cost model where a token costs 0.1% of a step, so
        # the admitted subsets follow the calibration and keep changing; then put the learnt one
        # back for the sampled requests, whose steps then mostly carry no drafts.
        llm.collective_rpc(pin_step_cost(0.001))
        out = token_ids(llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
        counters = spec_counters(llm)
        seeded = run_seeded(llm)
        seeded_drafts = spec_counters(llm)["drafts"] - counters["drafts"]
        llm.collective_rpc(unpin_step_cost)
        top_k_only = SamplingParams(max_tokens=20, temperature=1.0, top_k=4, ignore_eos=True)
        sampled = token_ids(llm.generate(TINY_PROMPTS[:4], top_k_only, use_tqdm=False))
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []
    assert counters["drafts"] > 0 and counters["accepted"] > 0
    assert [len(t) for t in sampled] == [20] * 4
    # the subsets change, not the tokens; drafts were sent (on the random model few are accepted)
    assert seeded == tiny_base["seeded"] and seeded_drafts > 0


@pytest.mark.parametrize(
    "scope,verify,init",
    [("per_request", "tree", "model"), ("per_request", "chain", "model"), ("shared", "tree", "model"),
     ("per_request", "tree", "empty")],
)
def test_other_scopes_greedy_identical(tiny_model, tiny_base, scope, verify, init):
    """Every scope and verify mode, from the model's prior (the default) and from an empty
    matrix: greedy output as without speculation."""
    from vllm_recycling.config import CONTEXT_LENGTH, DEFAULT_CHAIN_LENGTH
    from vllm_recycling.tree import load_tree

    spec = {**RECYCLING, "matrix_scope": scope, "verify": verify, "matrix_init": init}
    seeded = sampled_params(range(7, 23))
    with engine(tiny_model, speculative_config=spec, disable_log_stats=False) as llm:
        out = token_ids(llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
        counters = spec_counters(llm)
        draws = [token_ids(llm.generate([TINY_PROMPTS[0]] * 16, seeded, use_tqdm=False)) for _ in range(2)]
        mixed = run_seeded(llm)
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []
    assert mixed == tiny_base["seeded"]  # seeded tokens as without speculation, chains too
    nodes = load_tree("2.2.2", 8).num_nodes if verify == "tree" else DEFAULT_CHAIN_LENGTH
    context = CONTEXT_LENGTH if verify == "tree" else 0  # the context nodes that have a token
    assert counters["drafts"] > 0
    assert counters["drafts"] * nodes <= counters["draft_tokens"] <= counters["drafts"] * (nodes + context)
    assert counters["accepted"] > 0
    # seeded draws are those of no speculation, whatever the drafts (the matrix of a shared
    # scope depends on the traffic before)
    assert draws[0] == draws[1] and len(set(map(tuple, draws[0]))) > 1


@pytest.mark.parametrize("scope", ["shared", "overlay"])
def test_preempted_requests_resume_identically(tiny_model, tiny_base, scope):
    """A KV cache of 12 blocks (of 32 tokens) cannot hold 12 requests of up to 100 tokens plus
    80 draft slots each: the scheduler preempts and later resumes requests. With per-request
    slots (overlay), every slot is back in the pool once the requests are done: after one more
    request, it alone holds one."""
    spec = {**RECYCLING, "matrix_scope": scope}
    with engine(tiny_model, speculative_config=spec, num_gpu_blocks_override=12, block_size=32,
                max_model_len=256, max_num_seqs=16, disable_log_stats=False) as llm:
        out = token_ids(llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
        seeded = run_seeded(llm, batch=16)  # preempted too: the tokens of no speculation
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        llm.generate(TINY_PROMPTS[:1], greedy(8), use_tqdm=False)
        (pool,) = llm.collective_rpc(
            lambda w: (len(w.model_runner.drafter.slots.holders), len(w.model_runner.drafter.matrix._free))
        )
    assert preemptions > 0
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []
    assert seeded == tiny_base["seeded"]
    if scope == "overlay":
        assert pool == (1, 15)


def test_salt_scope_isolates_tenants_and_stays_exact(tiny_model, tiny_base):
    """matrix_scope="salt" with 2 salt matrices and 3 salts in one batch of 12: salts A and B
    take the matrices, C drafts nothing until one is free, unsalted requests use the shared
    matrix; every output stays exact. Afterwards, requests of salt A alone change A's matrix
    and nothing else: B's and the shared matrix are bit for bit as they were."""
    import torch

    spec = {**RECYCLING, "matrix_scope": "salt", "salt_matrices": 2}
    salts = ["A", "B", "C", None]
    prompts = [
        {**p, "cache_salt": salts[i % 4]} if salts[i % 4] else p for i, p in enumerate(TINY_PROMPTS)
    ]

    def matrices(w):
        m = w.model_runner.drafter.matrix
        v = m.vocab_size
        return [m.table[i * v : (i + 1) * v].clone() for i in range(3)], dict(m._salt_matrix)

    with engine(tiny_model, speculative_config=spec, disable_log_stats=False) as llm:
        out = token_ids(llm.generate(prompts, greedy(), use_tqdm=False))
        counters = spec_counters(llm)
        (before, owners) = llm.collective_rpc(matrices)[0]
        only_a = [{**p, "cache_salt": "A"} for p in random_prompts(3, seed=9, vocab_size=TINY_VOCAB)]
        llm.generate(only_a, greedy(16), use_tqdm=False)
        (after, owners_after) = llm.collective_rpc(matrices)[0]
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []
    assert counters["drafts"] > 0 and counters["accepted"] > 0
    assert set(owners) == {"A", "B"} or set(owners) == {"A", "C"} or set(owners) == {"B", "C"}
    assert all(int((t != 0).any(1).sum()) > 0 for t in before)  # every matrix learned
    a = owners_after["A"]
    assert not torch.equal(before[a], after[a])
    assert all(torch.equal(before[i], after[i]) for i in range(3) if i != a)


def test_requests_near_max_model_len_with_the_auto_budget(tiny_model):
    """A request whose sequence comes within num_speculative_tokens of max_model_len: vLLM 0.32
    then replaced every request's drafts with 80 zeros, drafts the auto budget never sent (an
    engine crash). With ``patches.DraftsNearMaxModelLen`` the proposer keeps drafting, the
    scheduler caps the long request at the context end, and every output stays exact."""
    prompts = [*TINY_PROMPTS[:3], *random_prompts(1, seed=21, vocab_size=TINY_VOCAB, lengths=(960, 961))]
    outs = []
    for spec in (None, {"method": "recycling"}):
        extra = {} if spec is None else {"speculative_config": spec}
        with engine(tiny_model, disable_log_stats=False, **extra) as llm:
            outs.append(llm.generate(prompts, greedy(logprobs=2), use_tqdm=False))
            counters = spec_counters(llm)
    assert [len(o.outputs[0].token_ids) for o in outs[1]] == [TINY_TOKENS] * 4  # the last to 1000
    assert check_greedy_identity(outs[0], token_ids(outs[1]))["near_ties"] == []
    # without the patch: 156 drafts of 11,037 zeros, none accepted; with it about 4 per draft
    assert counters["drafts"] > 0 and counters["draft_tokens"] < 20 * counters["drafts"]


def test_trees_cut_by_the_token_budget_stay_exact(tiny_model, tiny_base):
    """A step budget of 256 tokens holds three 81-row trees and part of a fourth: the scheduler
    cuts the last scheduled request's tree to a breadth-first prefix and leaves the rest of the
    batch for later steps."""
    from vllm_recycling.tree import load_tree

    with engine(tiny_model, speculative_config=RECYCLING, max_num_batched_tokens=256, max_model_len=256,
                disable_log_stats=False) as llm:
        out = token_ids(llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    assert counters["draft_tokens"] < counters["drafts"] * load_tree("2.2.2", 8).num_nodes  # cut trees
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []


def test_snapshot_saved_at_shutdown_and_loaded_at_start(tiny_model, tmp_path):
    import torch

    from vllm_recycling.matrix import load_snapshot

    path = tmp_path / "adj.safetensors"
    spec = {**RECYCLING, "matrix_snapshot": str(path), "matrix_snapshot_interval": 0}
    with engine(tiny_model, speculative_config=spec) as llm:
        llm.generate(random_prompts(4, seed=5, vocab_size=TINY_VOCAB), greedy(16), use_tqdm=False)
        (live,) = llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.table[:TINY_VOCAB].clone())
        assert not path.exists()  # interval 0: only at shutdown
    saved = load_snapshot(path, TINY_VOCAB, 8)
    assert torch.equal(saved, live) and int((saved != 0).any(1).sum()) > 0
    with engine(tiny_model, speculative_config=spec) as llm:
        (start,) = llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.table[:TINY_VOCAB].clone())
    assert torch.equal(start, saved)


def test_restored_rows_are_sent_under_the_auto_budget(tiny_model, tiny_base, tmp_path):
    """budget "auto" with a snapshot: the restored rows carry the confidences they were saved
    with, so the budget sends them from the first steps after a restart. (Restored with zero
    confidences, they fell in the calibration's lowest bin and were sent nothing until
    verification wrote them again: a restart drafted like a cold start.) An empty initial
    matrix and no context branch: every draft comes from a matrix row, and the first tokens
    of a request read rows its own steps have not written yet."""
    import torch

    path = tmp_path / "adj.safetensors"
    spec = {"method": "recycling", "matrix_snapshot": str(path), "matrix_snapshot_interval": 0,
            "matrix_init": "empty", "context_match": False}
    first_tokens, probs = [], []
    for restart in (False, True):
        with engine(tiny_model, speculative_config=spec, disable_log_stats=False) as llm:
            llm.collective_rpc(pin_step_cost(0.001))
            probs += llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.probs[:TINY_VOCAB].clone())
            llm.generate(TINY_PROMPTS, greedy(3), use_tqdm=False)
            first_tokens.append(spec_counters(llm))
            if not restart:  # learn, then save at shutdown
                out = token_ids(llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
                probs += llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.probs[:TINY_VOCAB].clone())
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []
    assert first_tokens[0]["drafts"] == 0  # a cold start: nothing written, nothing sent
    assert first_tokens[1]["drafts"] >= len(TINY_PROMPTS) and first_tokens[1]["accepted"] > 0, first_tokens
    fresh, learnt, restored = probs
    assert not fresh.any() and int((learnt.abs().amax(1) > 0).sum()) > 100
    assert torch.equal(restored, learnt)


def test_start_after_a_kill_during_a_snapshot_save(tiny_model, tmp_path):
    """The engine that starts after a process was SIGKILLed mid-save loads the last complete
    snapshot and removes the half-written temporary file."""
    import torch

    from engines import kill_during_snapshot_save

    path = tmp_path / "adj.safetensors"
    first, temporaries = kill_during_snapshot_save(path, TINY_VOCAB, 8)
    assert len(temporaries) == 1
    spec = {**RECYCLING, "matrix_snapshot": str(path), "matrix_snapshot_interval": 0}
    with engine(tiny_model, speculative_config=spec) as llm:
        (start,) = llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.table[:TINY_VOCAB].clone())
        assert torch.equal(start, first) and not temporaries[0].exists()
