"""A tree step's work after the forward never waits for the device: no host synchronisation
on the GPU path (CUDA's sync debug mode, where a GPU is lent), and in CI a CPU stand-in that
refuses every call reading a tensor back to the host."""

import numpy as np
import pytest
import torch

from vllm_recycling.paths import (
    ChainPlan, StepRows, StepRowsOnDevice, choose_paths, compaction, tree_paths, walk_sampled,
)
from vllm_recycling.transfer import to_device
from vllm_recycling.tree import compile_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

# the tree of test_tree_verify.py: root -> a(0), b(1); a -> c(0,0), d(0,1); c -> e(0,0,0)
PATHS = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def verify_tree_step(device: torch.device, kv_caches: list, penalties: bool):
    """A greedy tree step's work after the forward, as ``RecyclingProposer.verify`` does it on
    the device: the matrix learns from every row, then with repetition, frequency and presence
    penalties (``penalties``) every row sampled with its path as history and the trees walked
    (``verify_sampled``, vLLM's own ``Sampler`` underneath), without them
    ``TreeVerifier.verify`` (path choice, the chain, vLLM's rejection sampler, here a stub: its
    kernels are vLLM's); then the KV moves. Returns (the step, the step's work as a callable)."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_recycling import triton_path
    from vllm_recycling.cpu_kv_cache import PagedKV
    from vllm_recycling.matrix import AdjacencyMatrix
    from vllm_recycling.node_sampler import NodeSampler, samples_rows
    from vllm_recycling.verifier import TreeVerifier, verify_sampled

    # at start-up, and when the requests join the batch (host bookkeeping)
    verifier = TreeVerifier(compile_tree(PATHS, topk=2), device)
    verifier.move_kv = triton_path.move_all if device.type == "cuda" else PagedKV("vec").move
    node_sampler = NodeSampler(Sampler())
    matrix = AdjacencyMatrix(10, 2, scope="overlay", max_requests=3, device=device, overlay_rows=16,
                             with_probs=True)
    for r in "abc":
        matrix.allocate(r)
    # the step as vLLM hands it over: requests of 5, 0 and 3 drafts, inputs on the device
    num_draft = np.array([5, 0, 3])
    step = verifier.plan(num_draft, np.array([0, 6, 7, 11]), np.array([20, 9, 30]), None)
    chain = SpecDecodeMetadata.make_dummy([[1, 2, 3, 4, 5], [], [6, 7, 8]], device)
    sampling = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False,
        top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=not penalties,
        prompt_token_ids=torch.randint(0, 10, (3, 4), device=device) if penalties else None,
        frequency_penalties=torch.full((3,), 0.4, device=device),
        presence_penalties=torch.full((3,), 0.2, device=device),
        repetition_penalties=torch.full((3,), 1.3 if penalties else 1.0, device=device),
        output_token_ids=[[1, 2], [3], [4, 5, 6]], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(), spec_token_ids=[[1, 2, 3, 4, 5], [], [6, 7, 8]],
    )
    assert samples_rows(sampling) == penalties
    tokens = torch.randint(0, 10, (11,), device=device)
    logits = torch.randn(11, 10, device=device)
    slot_mapping = torch.arange(100, 111, device=device)

    def rejection_sampler(chain, draft_probs, logits, sampling):
        rows = len(chain.num_draft_tokens), max(chain.num_draft_tokens) + 1
        return SamplerOutput(torch.full(rows, -1, dtype=torch.int32, device=device), None)

    def run():
        matrix.update(tokens[:, None], logits, matrix.slots(list("abc"))[
            to_device(np.repeat(np.arange(3), num_draft + 1), torch.int64, device)])
        if penalties:
            _, path, _ = verify_sampled(node_sampler, step, logits.clone(), tokens, list(num_draft), sampling)
            verifier.move_accepted(step, path, slot_mapping, kv_caches)
        else:
            verifier.verify(step, slot_mapping, logits, tokens, chain, sampling, rejection_sampler, kv_caches)

    return step, run


def test_greedy_tree_step_reads_nothing_back_from_the_device(monkeypatch):
    """The CPU stand-in of the GPU test below, in CI: a greedy tree step's verification (with
    and without penalties) calls nothing that copies a tensor to the host or reads a value of
    one (``tolist``, ``item``, ``cpu``, ``numpy``, truth value), which on a GPU would wait
    for it."""
    pytest.importorskip("vllm")
    kv = torch.randn(16, 2, 16, 128)  # one layer's cache [blocks, kv heads, block, 2 x head size]
    runs = [verify_tree_step(torch.device("cpu"), [kv], penalties)[1] for penalties in (False, True)]

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} called in a tree step's verification")
        return call

    with monkeypatch.context() as patched:
        for name in ("tolist", "item", "cpu", "numpy", "__bool__"):
            patched.setattr(torch.Tensor, name, refuse(name))
        for run in runs:
            run()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_step_never_waits_for_the_gpu():
    """The GPU path's work of a tree step after its plan (``verify_tree_step``: the matrix
    update, then the verification of a greedy step with penalties, row by row, and of one
    without, through ``TreeVerifier.verify``) and its tree attention, with CUDA's sync debug
    mode set to raise on any host synchronisation (needs vLLM: where it is missing,
    ``test_tree_step_pieces_never_wait_for_the_gpu`` still runs)."""
    pytest.importorskip("vllm")
    from vllm_recycling.kernels.tree_attention import tree_attention

    device = torch.device("cuda")
    kv = torch.randn(16, 2, 16, 128, device=device, dtype=torch.float16)
    query = torch.randn(11, 4, 64, device=device, dtype=torch.float16)
    table = torch.arange(12, device=device, dtype=torch.int32).view(3, 4)
    steps = [verify_tree_step(device, [kv], penalties) for penalties in (False, True)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, run in steps:
            run()
        tree_attention(query, kv, table, step.req_index, step.rows, step.num_rows, step.prefix_len,
                       step.mask, torch.zeros_like(query), 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_step_pieces_never_wait_for_the_gpu():
    """The GPU path's pieces of a tree step (matrix update, plan, greedy path choice and chain,
    the sampled walk, KV moves, tree attention) with CUDA's sync debug mode set to raise on any
    host synchronisation. Needs no vLLM, so it runs where GPUs are lent without it;
    ``test_tree_step_never_waits_for_the_gpu`` checks ``TreeVerifier.verify`` itself."""
    from vllm_recycling.kernels.tree_attention import tree_attention
    from vllm_recycling.triton_path import move_slots

    from vllm_recycling.matrix import AdjacencyMatrix

    device = torch.device("cuda")
    layout = TreeLayout.from_template(compile_tree(PATHS, topk=2), device)  # at start-up
    matrix = AdjacencyMatrix(10, 2, scope="overlay", max_requests=3, device=device, overlay_rows=16,
                             with_probs=True)
    for r in "abc":
        matrix.allocate(r)  # host bookkeeping, when a request joins the batch
    # the step's inputs, as vLLM hands them over (already on the device)
    tokens = torch.randint(0, 10, (11,), device=device)
    logits = torch.randn(11, 10, device=device)
    sampled_tokens = torch.randint(0, 10, (11,), device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = TreeStep.plan(layout, np.array([5, 0, 3]), np.array([0, 6, 7, 11]),
                             np.array([20, 9, 30]), device)
        # the matrix learns from every row (RecyclingProposer.verify)
        rows = to_device(np.repeat(np.arange(3), [6, 1, 4]), torch.int64, device)
        matrix.update(tokens[:, None], logits, matrix.slots(list("abc"))[rows])
        starts = to_device(np.array([0, 7]), torch.int64, device)
        path = choose_paths(step, logits, tokens, starts)
        plan_ = ChainPlan.build(step, path, np.array([5, 0, 3]), np.array([0, 6, 7]), device)
        plan_.draft_tokens(tokens)
        # a step with a sampled request: the walk by the sampled tokens, the accepted paths
        step_rows = StepRowsOnDevice.of(StepRows.build([5, 0, 3], step), device)
        accepted, _ = walk_sampled(step_rows, tokens, sampled_tokens)
        compaction(step, tree_paths(step, accepted, starts), torch.arange(100, 111, device=device))
        sampled = torch.full((3, max(plan_.num_draft_tokens) + 1), -1, dtype=torch.int32, device=device)
        src, dst = plan_.compaction(step, sampled, torch.arange(100, 111, device=device))
        kv = torch.randn(16, 2, 16, 128, device=device, dtype=torch.float16)
        move_slots(kv, src, dst)
        query = torch.randn(11, 4, 64, device=device, dtype=torch.float16)
        table = torch.arange(12, device=device, dtype=torch.int32).view(3, 4)
        tree_attention(query, kv, table, step.req_index, step.rows, step.num_rows, step.prefix_len,
                       step.mask, torch.zeros_like(query), 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
