"""Every row of a speculative step sampled as a plain step samples its output position
(``node_sampler.NodeSampler``), against vLLM 0.32's own ``Sampler`` run on that row alone, as a
plain step at that position would run it: the same token, row by row; and the seeded
generator rewound to the emitted positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_recycling.paths import StepRows  # noqa: E402

V = 64


def _metadata(temperature, generators, output, spec, penalties: bool, top_k=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temperature)
    return SamplingMetadata(
        temperature=torch.tensor(temperature),
        all_greedy=False,
        all_random=all(t > 0 for t in temperature),
        top_p=None,
        top_k=None if top_k is None else torch.tensor(top_k),
        generators=generators,
        max_num_logprobs=None,
        no_penalties=not penalties,
        prompt_token_ids=torch.tensor([[1, 2, 3]] * n),
        frequency_penalties=torch.full((n,), 0.5 if penalties else 0.0),
        presence_penalties=torch.full((n,), 0.3 if penalties else 0.0),
        repetition_penalties=torch.full((n,), 1.4 if penalties else 1.0),
        output_token_ids=output,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=spec,
    )


@pytest.mark.parametrize("penalties", [False, True])
def test_each_row_is_the_plain_step_of_its_position(penalties):
    """Request 0 (seeded, temperature 0.8, top-k 9) has a tree: root, a and b at depth 1, c under
    a; request 1 (greedy) a chain of one draft. A node at depth d samples what a plain step
    with the request's generator d draws further on and the node's path as history samples."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_recycling.node_sampler import NodeSampler
    from vllm_recycling.tree_step import TreeLayout, TreeStep
    from vllm_recycling.tree import compile_tree

    layout = TreeLayout.from_template(compile_tree([[0], [1], [0, 0]], topk=2), "cpu")
    step = TreeStep.plan(layout, np.array([3, 1]), np.array([0, 4, 6]), np.array([10, 12]), "cpu")
    rows = StepRows.build([3, 1], step)
    assert rows.depth.tolist() == [0, 1, 1, 2, 0, 1]
    output, spec = [[5, 6, 7], [8, 9]], [[11, 12, 13], [14]]
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3
    generator = torch.Generator().manual_seed(42)
    start = generator.get_state()
    sampling = _metadata([0.8, 0.0], {0: generator}, output, spec, penalties, top_k=[9, V])
    sampler = NodeSampler(Sampler())
    out, states = sampler.sample(
        logits.clone(), rows, torch.from_numpy(rows.row_req), torch.from_numpy(rows.depth), sampling, spec,
    )
    got = out.sampled_token_ids[:, 0].tolist()
    assert sampler.noise.seeds is None and sampler.noise.noise is None  # nothing of the step kept
    histories = [output[0], output[0] + [11], output[0] + [12], output[0] + [11, 13], output[1], output[1] + [14]]
    for t in range(6):
        b, depth = int(rows.row_req[t]), int(rows.depth[t])
        plain = torch.Generator()
        plain.set_state(start)
        for _ in range(depth):  # the draws of the positions before
            torch.randint(0, 2**31, (1,), generator=plain, dtype=torch.long)
        one = _metadata([[0.8, 0.0][b]], {0: plain} if b == 0 else {}, [histories[t]], None, penalties,
                        top_k=[[9, V][b]])
        want = Sampler()(logits[t : t + 1].clone(), one).sampled_token_ids[0, 0].item()
        assert got[t] == want, t
    # emitted 2 tokens: the generator is left after two draws, as two plain steps leave it
    states.rewind([[1, 2], [3]])
    plain = torch.Generator()
    plain.set_state(start)
    for _ in range(2):
        torch.randint(0, 2**31, (1,), generator=plain, dtype=torch.long)
    assert torch.equal(generator.get_state(), plain.get_state())


def _runner_logitsprocs():
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    proc = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # the state expand_logitsprocs reads
    proc.min_p, proc.min_p_count = torch.zeros(2), 0
    return LogitsProcessors([proc])


def test_self_check_passes_on_this_vllms_sampler():
    from vllm.v1.sample.sampler import Sampler

    from vllm_recycling.node_sampler import self_check

    assert self_check(Sampler(), _runner_logitsprocs(), torch.device("cpu")) is None


def test_self_check_names_a_noise_drawn_otherwise(monkeypatch):
    """Review R2: a vLLM that draws its per-position seeds otherwise (a later one draws 62-bit
    seeds) would change seeded output silently; the start-up check refuses it, and a processor
    without the state the rows' expansion reads is named."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_recycling import node_sampler

    real = torch.randint

    def wider(low, high, *args, **kwargs):  # what a plain step would draw from, not the node rows'
        return real(low, 2**62 if high == 2**31 else high, *args, **kwargs)

    class Plain(Sampler):
        def forward(self, *args, **kwargs):
            monkeypatch.setattr(torch, "randint", wider)
            try:
                return super().forward(*args, **kwargs)
            finally:
                monkeypatch.setattr(torch, "randint", real)

    problem = node_sampler.self_check(Plain(), _runner_logitsprocs(), torch.device("cpu"))
    assert problem is not None and "draws its sampling noise otherwise" in problem
    procs = _runner_logitsprocs()
    del procs.argmax_invariant[0].min_p_count
    assert node_sampler.self_check(Sampler(), procs, torch.device("cpu")) == (
        "vLLM's MinPLogitsProcessor has no min_p_count")
