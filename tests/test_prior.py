"""The initial matrix from the model (``prior.py``, ``warm.py``): its cache, its content
computed through vLLM against the model's own next-token top-k in plain transformers, and
its arrival while an engine serves."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from vllm_recycling import prior as prior_module
from vllm_recycling.cache import cache_root
from vllm_recycling.matrix import AdjacencyMatrix
from vllm_recycling.prior import (
    Prior,
    PriorError,
    PriorWatch,
    load_complete_prior,
    load_prior,
    model_identity,
    prior_key,
    prior_path,
    read_prior,
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
    assert torch.equal(got.table, table) and torch.equal(got.probs, probs) and got.complete
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
    from vllm_recycling.warm import PRIOR_BLOCK, context_ids, ensure_prior

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    args = EngineArgs(tiny_model, **ENGINE)
    model_config = args.create_model_config()
    path = ensure_prior(args, model_config, 8)
    prior = load_prior(path, 1024, 8)
    table, probs = prior.table, prior.probs
    assert prior.complete and path.stat().st_mtime == ensure_prior(args, model_config, 8).stat().st_mtime  # cached

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prefix = context_ids(tokenizer)
    opening = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                            add_generation_prompt=True)
    assert tokenizer.decode(prefix).endswith(opening) and len(prefix) % PRIOR_BLOCK == 0
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


# -- taken in while serving ------------------------------------------------------------------------

def test_take_prior_fills_only_rows_nothing_wrote():
    """The matrix takes a prior in while serving: rows that traffic (or a snapshot) wrote keep
    theirs, the others take the prior's rows and its probabilities negated (what the budget
    calibrates apart), and every matrix created afterwards starts from it."""
    vocab, k = 16, 4
    table, probs = _prior(vocab, k)
    for scope in ("shared", "per_request", "overlay", "salt"):
        m = AdjacencyMatrix(vocab, k, scope=scope, max_requests=2, with_probs=True, salt_matrices=2,
                            overlay_rows=4)
        m.allocate("a", "tenant")
        written = torch.tensor([[3, 1, 2, 0]], dtype=torch.int32)
        m.table[5:6] = written
        m.probs[5:6] = 0.5
        filled = m.take_prior(Prior(table, probs, vocab))
        matrices = 2 if scope in ("per_request", "salt") else 1
        matrices += 1 if scope == "salt" else 0  # the shared matrix and each salt's
        assert filled == matrices * vocab - 1, scope
        assert torch.equal(m.table[5:6], written) and float(m.probs[5, 0]) == 0.5
        rest = torch.ones(vocab, dtype=torch.bool)
        rest[5] = False
        assert torch.equal(m.table[:vocab][rest], table[rest])
        assert torch.equal(m.probs[:vocab][rest], -probs[rest])
        if scope == "per_request":  # a matrix handed out after the swap starts from the prior
            m.table[vocab:] = 7
            m.free("a")
            m.allocate("b")
            slot = m._slot_of["b"]
            assert torch.equal(m.table[slot * vocab:(slot + 1) * vocab], table)
        if scope == "salt":  # so does a new salt's
            assert torch.equal(m.table[2 * vocab:3 * vocab], table)


def test_prior_watch_takes_rows_as_they_are_computed(tmp_path, monkeypatch):
    """A file that does not load is never taken; a partial prior's rows are taken as they grow
    (each poll returns it only when it has rows not taken yet), until it is complete."""
    monkeypatch.setattr(prior_module, "POLL_S", 0.0)
    path = tmp_path / "p.safetensors"
    watch = PriorWatch(path, 16, 4)
    assert watch.poll() is None  # no file yet
    path.write_bytes(b"torn")
    assert watch.poll() is None  # a file that does not load is not taken
    table, probs = _prior()
    partial = table.clone()
    partial[6:] = 0
    save_prior(path, partial, probs, "m", 1.0, rows=6)
    got = watch.poll()
    assert got is not None and got.rows == 6 and not got.complete and torch.equal(got.table, partial)
    watch.took(got)
    assert watch.poll() is None and not watch.done  # nothing new
    save_prior(path, table, probs, "m", 2.0)
    got = watch.poll()
    assert got is not None and got.complete
    watch.took(got)
    assert watch.done


def test_prior_watch_looks_at_most_every_poll_s(tmp_path, monkeypatch):
    path = tmp_path / "p.safetensors"
    save_prior(path, *_prior(), "m", 1.0)
    monkeypatch.setattr(prior_module, "POLL_S", 3600.0)
    watch = PriorWatch(path, 16, 4)
    assert watch.poll() is not None  # the first step looks
    watch = PriorWatch(path, 16, 4)
    watch._next_look = time.monotonic() + 3600
    assert watch.poll() is None  # then not before POLL_S has passed


def test_prior_watch_tries_a_file_that_failed_to_load_again(tmp_path, monkeypatch):
    """Review B3: a version of the file that failed to load once (a transient read error) is
    tried again, at most every RETRY_S; once the complete file is taken, the file is not
    looked at any more."""
    from types import SimpleNamespace

    clock = [100.0]
    monkeypatch.setattr(prior_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(prior_module, "POLL_S", 0.0)
    path = tmp_path / "p.safetensors"
    save_prior(path, *_prior(), "m", 1.0)
    real, calls = prior_module.load_prior, []

    def flaky(*args):
        calls.append(args)
        if len(calls) == 1:
            raise PriorError("prior: unreadable (Input/output error)")
        return real(*args)

    monkeypatch.setattr(prior_module, "load_prior", flaky)
    watch = PriorWatch(path, 16, 4)
    assert watch.poll() is None and len(calls) == 1
    clock[0] += prior_module.RETRY_S - 1
    assert watch.poll() is None and len(calls) == 1  # the same file: not before RETRY_S
    clock[0] += 1
    got = watch.poll()
    assert got is not None and got.complete and len(calls) == 2
    watch.took(got)
    assert watch.done
    watch.path = SimpleNamespace(stat=lambda: pytest.fail("looked at the file after taking all of it"))
    assert watch.poll() is None and len(calls) == 2


def _two_ranks(other_rows: list[int]):
    """all_reduce_mean of this rank with another whose loaded rows are other_rows[0]: the mean
    of what this rank sends and what the other sends through the same ``ranks_agree``."""

    def mean(values):
        theirs = []
        prior_module.ranks_agree(lambda sent: theirs.append(sent) or sent, other_rows[0])
        return (values + theirs[0]) / 2

    return mean


def test_ranks_agree_exactly():
    """Review D2: ranks whose row counts differ by 1 do not agree (a variance test with a
    tolerance of 0.5 let them pass)."""
    assert prior_module.ranks_agree(_two_ranks([16]), 16)
    assert prior_module.ranks_agree(_two_ranks([-1]), -1)
    assert not prior_module.ranks_agree(_two_ranks([15]), 16)
    assert not prior_module.ranks_agree(_two_ranks([151935]), 151936)
    assert not prior_module.ranks_agree(_two_ranks([-1]), 0)


def test_tensor_parallel_ranks_take_the_same_rows_at_the_same_step(tmp_path):
    """With several ranks, a rank that has loaded more rows waits for the others: the rows
    each rank loaded (and whether they are final: ``2 * rows + final``) are compared every
    POLL_STEPS steps and taken when every rank has the same."""
    path = tmp_path / "p.safetensors"
    other = [0]
    watch = PriorWatch(path, 16, 4, all_reduce_mean=_two_ranks(other))
    save_prior(path, *_prior(), "m", 1.0)
    steps = prior_module.POLL_STEPS
    assert all(watch.poll() is None for _ in range(steps - 1))
    assert watch.poll() is None  # this rank has 16 rows, the other none yet
    other[0] = 2 * 6
    assert all(watch.poll() is None for _ in range(steps))  # the other has 6: still different
    other[0] = 2 * 15
    assert all(watch.poll() is None for _ in range(steps))  # 15: still different
    other[0] = 2 * 16
    assert all(watch.poll() is None for _ in range(steps))  # 16, but not the final file yet
    other[0] = 2 * 16 + 1
    assert all(watch.poll() is None for _ in range(steps - 1))  # only at agreement steps
    assert watch.poll().rows == 16


def test_ranks_that_find_different_files_at_start_up_all_watch(tmp_path, monkeypatch):
    """B2: the file appears between two ranks' looks at start-up. Every rank then starts without
    it and keeps a watch (the same collectives on every rank), rather than one rank holding the
    prior and no watch."""
    from types import SimpleNamespace

    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path))
    config = SimpleNamespace(model="m", revision=None, get_vocab_size=lambda: 16)
    path = prior_module.prior_path("m", None, 16, 4)
    save_prior(path, *_prior(), "m", 1.0)
    prior, watch = prior_module.find_prior(config, 4, all_reduce_mean=_two_ranks([-1]))  # the other: none
    assert prior is None and watch is not None and watch.taken == 0
    prior, watch = prior_module.find_prior(config, 4, all_reduce_mean=_two_ranks([15]))  # the other: 15 rows
    assert prior is None and watch is not None and watch.taken == 0
    prior, watch = prior_module.find_prior(config, 4, all_reduce_mean=_two_ranks([16]))
    assert prior.complete and watch is None
    prior, watch = prior_module.find_prior(config, 4)  # one rank
    assert prior.complete and watch is None


def test_take_prior_takes_a_slice_of_rows():
    """Rows [start, rows) only: earlier rows are not looked at again, later ones stay unwritten."""
    vocab, k = 16, 4
    table, probs = _prior(vocab, k)
    m = AdjacencyMatrix(vocab, k, scope="overlay", max_requests=1, with_probs=True, overlay_rows=4)
    assert m.take_prior(Prior(table, probs, 6)) == 6
    m.table[2] = 0  # as if an earlier row were unwritten again: not refilled from a later slice
    assert m.take_prior(Prior(table, probs, 10), start=6) == 4
    assert torch.equal(m.table[6:10], table[6:10]) and not m.table[10:vocab].any() and not m.table[2].any()
    assert torch.equal(m.fresh[:10], table[:10]) and not m.fresh[10:].any()


def test_a_snapshot_saved_before_the_prior_gets_the_priors_rows():
    """B1: a snapshot saved before the prior arrived has rows nothing wrote (all token 0); at the
    next start they take the prior's rows, the written ones keep the snapshot's."""
    vocab, k = 16, 4
    table, probs = _prior(vocab, k)
    snapshot = torch.zeros(vocab, k, dtype=torch.int32)
    snapshot[3] = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    snapshot_probs = torch.zeros(vocab, k, dtype=torch.float16)
    snapshot_probs[3] = 0.25
    m = AdjacencyMatrix(vocab, k, initial=snapshot, initial_probs=snapshot_probs, prior=(table, probs),
                        with_probs=True)
    want = table.clone()
    want[3] = snapshot[3]
    assert torch.equal(m.table[:vocab], want)
    assert float(m.probs[3, 0]) == 0.25 and float(m.probs[4, 0]) == -0.125


def _fake_llm(vocab, asked):
    """An offline engine for ``compute_prior``: token t's top-2 are t+1 and t+2; ``asked``
    records the tokens it was given."""
    from types import SimpleNamespace

    def generate(prompts, params, use_tqdm=False):
        out = []
        for p in prompts:
            t = p["prompt_token_ids"][-1]
            asked.append(t)
            lp = {(t + 1) % vocab: SimpleNamespace(logprob=-0.1), (t + 2) % vocab: SimpleNamespace(logprob=-2.0)}
            out.append(SimpleNamespace(outputs=[SimpleNamespace(logprobs=[lp])]))
        return out

    return SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab)),
                           get_tokenizer=lambda: SimpleNamespace(chat_template=None), generate=generate)


def test_a_stopped_computation_resumes_from_its_partial_file(tmp_path):
    """``compute_prior`` from a partial prior keeps its rows and computes the rest; saves of the
    rows done so far come at most every PARTIAL_SAVE_S."""
    from vllm_recycling import warm

    vocab, k = 40, 2
    asked = []
    llm = _fake_llm(vocab, asked)
    done = torch.zeros(vocab, k, dtype=torch.int32)
    done[:10] = 7
    got = warm.compute_prior(llm, k, resume=Prior(done, torch.zeros(vocab, k, dtype=torch.float16), 10))
    table = got.table
    assert got.complete and not got.stopped
    assert asked == list(range(10, vocab))  # the rows already there are not computed again
    assert (table[:10] == 7).all() and table[10:, 0].tolist() == [(t + 1) % vocab for t in range(10, vocab)]
    saves = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warm, "PROMPTS_PER_CALL", 8)
        mp.setattr(warm, "PARTIAL_SAVE_S", 0.0)
        warm.compute_prior(llm, k, save=lambda p: saves.append(p.rows))
    assert saves == [8, 16, 24, 32]  # the last batch is the complete file, saved by the caller


def test_a_computation_beside_a_server_stops_once_the_rest_cost_more_than_they_buy(monkeypatch):
    """Issue 72: with a ``RowPlan``, the computation stops after the first batch at or past the
    rows that pay when the rest would take more than rest_limit_s at the rate measured so far,
    and says it stopped (``Prior.stopped``); when the rest is cheap it computes every row."""
    from vllm_recycling import warm

    vocab, k, asked = 40, 2, []
    monkeypatch.setattr(warm, "PROMPTS_PER_CALL", 8)
    clock = iter(range(0, 1000, 10))  # every look at the clock: 10 s later
    monkeypatch.setattr(warm.time, "monotonic", lambda: float(next(clock)))
    got = warm.compute_prior(_fake_llm(vocab, asked), k, plan=warm.RowPlan(pay=12, share=0.9, rest_limit_s=5.0))
    assert asked == list(range(16)) and got.rows == 16 and got.stopped and not got.complete
    assert (got.table[16:] == 0).all() and got.table[15, 0] == 16
    asked.clear()
    got = warm.compute_prior(_fake_llm(vocab, asked), k, plan=warm.RowPlan(pay=12, share=0.9, rest_limit_s=1e6))
    assert asked == list(range(vocab)) and got.complete and not got.stopped


def test_rows_that_pay_are_the_leading_ids_that_hold_the_share_of_a_samples_tokens(monkeypatch):
    from vllm_recycling import warm

    monkeypatch.setattr(warm, "PROMPTS_PER_CALL", 4)
    monkeypatch.setattr("vllm_recycling.tools.prompts.spec_bench_questions",
                        lambda: [{"turns": ["a", "b"]}, {"turns": ["c"]}])
    ids = {"a": [0, 1, 2, 3, 4], "b": [1, 2, 5, 6], "c": [30]}  # 10 tokens
    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": ids[text]}
    assert warm.rows_that_pay(tokenizer, 100, 0.9) == 8  # 9 of 10 tokens are ids < 7: two batches of 4
    assert warm.rows_that_pay(tokenizer, 100, 1.0) == 32  # id 30 too
    assert warm.rows_that_pay(tokenizer, 20, 1.0) == 20  # never past the vocabulary
    assert warm.rows_that_pay(tokenizer, 100, 0.5) == 4


def test_a_prior_stopped_on_purpose_is_final_for_servers_and_resumed_when_asked(tmp_path, monkeypatch):
    """A file saved with stopped=True reads back stopped and final; servers load it as it is
    (``load_complete_prior(..., stopped_is_final=True)``, ``find_prior`` gives no watch, a
    ``PriorWatch`` ends with it), while an explicit computation (``vllm-recycling warm``) takes it
    for a partial one and resumes it."""
    from types import SimpleNamespace

    from vllm_recycling import prior as prior_module

    monkeypatch.setattr(prior_module, "POLL_S", 0.0)
    path = tmp_path / "p.safetensors"
    table, probs = _prior()
    table[6:], probs[6:] = 0, 0
    save_prior(path, table, probs, "m", 1.0, rows=6, stopped=True)
    got = read_prior(path)
    assert got.rows == 6 and got.stopped and got.final and not got.complete
    with pytest.raises(PriorError) as e:
        load_complete_prior(path, 16, 4)
    assert e.value.partial
    assert load_complete_prior(path, 16, 4, stopped_is_final=True).rows == 6
    watch = PriorWatch(path, 16, 4)
    got = watch.poll()
    watch.took(got)
    assert watch.done and watch.poll() is None
    monkeypatch.setattr(prior_module, "prior_path", lambda *args: path)
    config = SimpleNamespace(get_vocab_size=lambda: 16, model="m", revision=None)
    found, watch = prior_module.find_prior(config, 4)
    assert found.rows == 6 and watch is None
    # a watch that took the same rows before the file said it stopped ends when it does
    save_prior(path, table, probs, "m", 1.0, rows=6)
    watch = PriorWatch(path, 16, 4)
    watch.took(watch.poll())
    assert not watch.done and watch.poll() is None
    time.sleep(0.01)
    save_prior(path, table, probs, "m", 1.0, rows=6, stopped=True)
    got = watch.poll()
    assert got is not None and got.stopped
    watch.took(got)
    assert watch.done
    # "stopped" is never written on a complete file
    save_prior(path, *_prior(), "m", 1.0, stopped=True)
    assert not read_prior(path).stopped


def test_the_child_takes_a_stopped_prior_as_done_only_when_asked_for_the_rows_that_pay(tmp_path, monkeypatch):
    from vllm_recycling import warm

    path = tmp_path / "p.safetensors"
    table, probs = _prior()
    table[6:], probs[6:] = 0, 0
    save_prior(path, table, probs, "m", 1.0, rows=6, stopped=True)
    calls = []

    def fake_warm(kwargs, topk, out, progress, resume, pay_only=False):
        calls.append((resume.rows, pay_only))
        full = _prior()
        return Prior(full[0], full[1], 16), None, 1.0

    monkeypatch.setattr(warm, "warm", fake_warm)
    monkeypatch.setattr(warm, "prefer_oom_kill", lambda: None)  # not this test process
    argv = ["--engine-args", json.dumps({"model": "m"}), "--topk", "4", "--out", str(path)]
    assert warm.main(argv + ["--rows", "pay"]) == 0 and calls == []
    assert warm.main(argv) == 0 and calls == [(6, False)]


def _watched(caplog, argv, path, line):
    """``warm.watch`` of a child running ``argv`` for the prior ``path``, until its log ``line``;
    the handler is attached before the child starts, so the watch thread's line cannot come first."""
    from vllm_recycling import LOGGER_NAME
    from vllm_recycling.warm_launch import watch

    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(caplog.handler)
    try:
        watch(subprocess.Popen(argv), "m", path).wait()
        for _ in range(200):
            if line in caplog.text:
                break
            time.sleep(0.05)
    finally:
        logger.removeHandler(caplog.handler)
    assert line in caplog.text


def test_a_failed_background_computation_is_logged_and_recorded(tmp_path, caplog):
    """A child that ended with an error without recording it is recorded as failed by the server;
    one that recorded its error keeps it."""
    pytest.importorskip("vllm")
    from vllm_recycling.warm_checks import record_failure, recorded_failure

    path = tmp_path / "k.safetensors"
    _watched(caplog, [sys.executable, "-c", "import sys; sys.exit(7)"], path,
             "computing the initial matrix of m failed (exit 7, see the log above); serving goes on with matrix "
             "rows learnt from traffic only; a server start tries again after ")
    assert recorded_failure(path)["error"] == "exit 7"
    record_failure(path, "ValueError: its own")  # as the child records what it raised, then exits 1
    _watched(caplog, [sys.executable, "-c", "import sys; sys.exit(1)"], path, "failed (exit 1")
    assert recorded_failure(path)["error"] == "ValueError: its own"


def test_a_background_computation_killed_by_a_signal_is_recorded_as_failed(tmp_path, caplog):
    """The child is the out-of-memory killer's first choice (oom_score_adj 1000) and, killed, it
    records nothing itself: the server records it, so that its next start does not launch it again."""
    pytest.importorskip("vllm")
    from vllm_recycling.warm_checks import recorded_failure

    path = tmp_path / "k.safetensors"
    _watched(caplog, [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], path,
             "computing the initial matrix of m failed (killed by SIGKILL: likely the out-of-memory killer, see "
             "the log above)")
    failure = recorded_failure(path)
    assert failure is not None and failure["error"] == "killed by SIGKILL: likely the out-of-memory killer"


def test_progress_writes_a_line_at_most_every_progress_s_the_engine_start_included(monkeypatch, caplog):
    """The background computation's log: nothing silent for longer than ``PROGRESS_EVERY_S``
    while the engine starts (no progress call comes then) or while the first batch runs; then
    the share done and the time left, counted from the engine's start."""
    from vllm_recycling import warm

    monkeypatch.setattr(warm, "PROGRESS_EVERY_S", 0.2)
    progress = warm._Progress(False, 0, "m")
    progress.log.addHandler(caplog.handler)
    try:
        time.sleep(0.5)  # the lock: another process computes it
        waiting = caplog.text.count("waiting for another process computing it")
        progress.engine_starting()
        time.sleep(0.7)
        starting = caplog.text.count("the engine is starting")
        progress(0, 100)  # the engine is up
        time.sleep(0.5)
        first_batch = caplog.text.count("the first batch is running")
        progress(50, 100)
        progress(100, 100)
    finally:
        progress.stop()
        progress.log.removeHandler(caplog.handler)
    assert waiting >= 1 and starting >= 2 and first_batch >= 1, caplog.text
    assert "m: the engine is up in " in caplog.text and "100 rows to compute" in caplog.text
    assert "100% (100 of 100 tokens), about 0 s left" in caplog.text


def test_progress_beside_a_server_counts_the_time_left_to_the_rows_that_pay(caplog):
    from vllm_recycling import warm

    progress = warm._Progress(False, 0, "m")
    progress.log.addHandler(caplog.handler)
    try:
        progress.engine_starting()
        progress.plan = warm.RowPlan(pay=60, share=0.95, rest_limit_s=600.0)
        progress(0, 100)
        progress.started -= 10.0  # 20 rows in 10 s
        progress.done = 20
        progress._line(time.monotonic())
        progress.done = 70
        progress._line(time.monotonic())
    finally:
        progress.stop()
        progress.log.removeHandler(caplog.handler)
    assert ("m: 20% (20 of 100 tokens), about 20 s left to the first 60 (those of 95% of text's tokens; the rest "
            "only if it takes at most 600 s more)") in caplog.text
    assert "m: 70% (70 of 100 tokens), about 4 s left" in caplog.text  # past them: the whole rest


@pytest.mark.slow
def test_engine_serves_before_and_after_its_prior_arrives(tiny_model, tiny_base, tmp_path, monkeypatch):
    """An engine whose prior is not computed yet serves at once, greedy identical to no
    speculation; the prior arrives while it serves and is taken in between two steps (rows the
    traffic wrote keep theirs, the others take the prior's), greedy still identical. The
    background computation is held back by holding its lock, as a concurrent engine would."""
    pytest.importorskip("vllm")
    import engines
    from vllm_recycling.files import FileLock
    from vllm_recycling.warm import lock_path

    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path / "cache"))
    vocab, k = engines.TINY_VOCAB, 8
    path = prior_path(tiny_model, None, vocab, k)
    table = torch.stack([(torch.arange(vocab) * 7 + d) % vocab for d in range(1, k + 1)], 1).int()
    probs = torch.full((vocab, k), 0.1, dtype=torch.float16)

    def shared_rows(worker):
        m = worker.model_runner.drafter.matrix
        return (worker.model_runner.drafter.prior_watch is not None,
                m.table[:vocab].clone(), m.probs[:vocab].clone())

    with FileLock(lock_path(path)):
        with engines.engine(tiny_model, speculative_config={"method": "recycling"}) as llm:
            llm.collective_rpc(engines.pin_step_cost(1e-4))
            before = llm.generate(engines.TINY_PROMPTS, engines.greedy(), use_tqdm=False)
            waiting, table_before, _ = llm.collective_rpc(shared_rows)[0]
            save_prior(path, table, probs, tiny_model, 0.0)
            time.sleep(prior_module.POLL_S + 0.1)
            after = llm.generate(engines.TINY_PROMPTS, engines.greedy(), use_tqdm=False)
            still_waiting, table_after, probs_after = llm.collective_rpc(shared_rows)[0]
    assert waiting and not still_waiting
    for outputs in (before, after):
        assert engines.check_greedy_identity(tiny_base["greedy"], engines.token_ids(outputs))["near_ties"] == []
    written_before = (table_before != 0).any(1)
    from_prior = probs_after[:, 0] < 0
    assert written_before.any() and from_prior.any()
    assert not (written_before & from_prior).any()  # what traffic wrote was kept
    assert torch.equal(table_after[from_prior], table[from_prior])
    assert (from_prior | (probs_after[:, 0] > 0)).all()  # every row: the prior's or the traffic's


def test_model_settings_travel_to_the_child_as_json():
    """Review B3: a torch.dtype from the Python API reaches the child as the name vLLM takes; a
    setting that cannot travel (a callable hf_overrides) is named, and the server then starts
    without the initial matrix instead of failing (or, on a GPU, refusing to start)."""
    from types import SimpleNamespace

    from vllm_recycling.warm_launch import NotForAChild, engine_kwargs_of

    args = SimpleNamespace(model="m", dtype=torch.bfloat16, hf_overrides={"a": 1}, seed=3)
    assert engine_kwargs_of(args) == {"model": "m", "dtype": "bfloat16", "hf_overrides": {"a": 1}, "seed": 3}
    with pytest.raises(NotForAChild, match="hf_overrides="):
        engine_kwargs_of(SimpleNamespace(model="m", hf_overrides=lambda config: config))


def test_a_callable_setting_starts_without_the_initial_matrix(tmp_path, monkeypatch, caplog):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_recycling import LOGGER_NAME
    from vllm_recycling import warm_launch as warm

    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path))
    monkeypatch.setattr(warm.subprocess, "Popen", lambda *a, **k: pytest.fail("no child for this configuration"))
    config = SimpleNamespace(model="m", revision=None, get_vocab_size=lambda: 16)
    args = SimpleNamespace(model="m", hf_overrides=lambda c: c)
    logging.getLogger(LOGGER_NAME).propagate = True
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert warm.start_prior(args, config, 4, background=True) is None
    assert "is not computed (hf_overrides=" in caplog.text
