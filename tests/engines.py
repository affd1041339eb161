"""Running vLLM engines in tests: one at a time, in the test process.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ~2 s to start) and one at
a time. Never start an ``ngram`` engine in a test process: every engine started after one in
the same process fails (numba).

Greedy output with speculation must be the output without it. A prompt may still diverge where
two tokens tie to within float noise (a speculative step computes the same positions in a
different batch shape, and tree attention sums in another order); such a prompt passes only
if, at the first differing token, the no-speculation run's top-2 logprobs are within
``NEAR_TIE`` and the recycling run took the other of the two.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest

NEAR_TIE = 1e-4
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)


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


@contextmanager
def engine(model: str, **kwargs):
    from vllm import LLM

    llm = LLM(model, **{**ENGINE, **kwargs})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def spec_counters(llm) -> dict[str, int]:
    from vllm_recycling.metrics import spec_decode_counters

    return spec_decode_counters(llm)


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
