"""The fused top-k update kernel equals its PyTorch reference exactly (interpreter on CPU, or
CUDA): the same argmax, the same ordered top-k, the same table after the scatter."""

from __future__ import annotations

import pytest
import torch

from vllm_recycling.kernels import topk_update as tu
from vllm_recycling.kernels import triton_usable
from vllm_recycling.matrix import AdjacencyMatrix

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(logits, rows, table, **kw):
    """Run kernel and reference on copies of table; compare argmax, table and every row's top-k."""
    k = table.shape[1]
    got_table, want_table = table.clone(), table.clone()
    topk = torch.full((logits.shape[0], k), -5, dtype=torch.int32, device=logits.device)
    argmax = tu.topk_update_triton(logits, rows, got_table, topk_out=topk, **kw)
    want_argmax = tu.topk_update_reference(logits, rows.long(), want_table)  # the reference takes int64 rows
    assert argmax.dtype == torch.int64
    assert torch.equal(argmax, want_argmax)
    assert torch.equal(topk.long(), tu.topk_lowest_id_first(logits, k))
    assert torch.equal(got_table, want_table)
    return got_table


def _logits(rows, vocab, dtype, device, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: ties everywhere, within chunks and across them
        x = torch.randint(-3, 3, (rows, vocab), generator=g).float()
    else:
        x = torch.randn((rows, vocab), generator=g) * 4
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_random_rows(device, dtype, k):
    # V = 100 with 32-wide chunks: the last chunk is partial; rows repeat (shared scope).
    vocab = 100
    logits = _logits(6, vocab, dtype, device, seed=k)
    rows = torch.tensor([5, 99, 5, 0, 42, 99], device=device)
    table = torch.zeros((vocab, k), dtype=torch.int32, device=device)
    _check(logits, rows, table, block_v=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k", [2, 8])
def test_ties_lower_id_first(device, dtype, k):
    vocab = 37  # not a multiple of the 16-wide chunks
    logits = _logits(4, vocab, dtype, device, seed=11, ties=True)
    special = torch.zeros((5, vocab))
    special[1, [3, 20, 36]] = 5.0  # the maximum three times, in three chunks: argmax is the first
    special[2, :] = float("-inf")
    special[2, [36, 1]] = 0.0  # -inf everywhere else: real -inf entries fill the rest, lowest ids first
    special[3, 36] = float("inf")  # the last token id is the unique argmax
    special[3, 7] = float("inf")
    special[4, ::2] = -0.0  # -0.0 and +0.0 tie
    logits = torch.cat([logits, special.to(dtype).to(device)])
    rows = torch.arange(logits.shape[0], device=device)
    table = _check(logits, rows, torch.zeros((vocab, k), dtype=torch.int32, device=device), block_v=16)
    # the special rows are logits rows (and table rows) 4..8
    assert table[4].tolist() == list(range(k)) and table[5, 0] == 3
    assert table[6, :2].tolist() == [1, 36] and table[7, :2].tolist() == [7, 36]
    assert table[8].tolist() == list(range(k))


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_rows_merge_exactly(device, splits):
    # Forced splits of each row (the small-batch GPU path) with ties across split boundaries and
    # a last split shorter than k (its empty slots must not reach the merge).
    vocab, k = 37, 8
    logits = torch.cat([
        _logits(3, vocab, torch.float32, device, seed=splits, ties=True),
        _logits(2, vocab, torch.float32, device, seed=splits + 1),
    ])
    rows = torch.tensor([1, 2, 1, 36, 0], device=device)
    table = torch.zeros((vocab, k), dtype=torch.int32, device=device)
    _check(logits, rows, table, block_v=8, splits=splits)
    _check(logits.bfloat16(), rows, table, block_v=8, splits=splits)
    # splits smaller than k: several lists with empty slots meet in the merge
    _check(logits, rows, torch.zeros((vocab, 16), dtype=torch.int32, device=device), block_v=4, splits=splits)


def test_duplicate_rows_last_wins_within_and_across_requests(device):
    # Two requests of three nodes each (shared scope): token 1 at request 0 nodes 0 and 2 and
    # at request 1 node 1 -> row 4 of the logits wins; per-request scope: rows offset by the slot.
    eye = torch.eye(6, device=device)
    tokens = torch.tensor([[1, 2, 1], [3, 1, 0]], device=device)
    logits = eye[[0, 1, 2, 3, 4, 2]]
    table = _check(logits, tokens.reshape(-1), torch.zeros((6, 1), dtype=torch.int32, device=device))
    assert table[:, 0].tolist() == [2, 4, 1, 3, 0, 0]
    base = torch.tensor([6, 0], device=device)
    rows = (tokens + base[:, None]).reshape(-1)
    table = _check(logits, rows, torch.zeros((12, 1), dtype=torch.int32, device=device))
    assert table[:, 0].tolist() == [2, 4, 0, 3, 0, 0, 0, 2, 1, 0, 0, 0]
    # many duplicates, more than one block of the duplicate scan
    logits = _logits(40, 16, torch.float32, device, seed=5)
    rows = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(5)).to(device)
    _check(logits, rows, torch.zeros((16, 4), dtype=torch.int32, device=device), block_t=8)


def test_empty_and_single_row(device):
    table = torch.full((5, 2), 3, dtype=torch.int32, device=device)
    argmax = tu.topk_update_triton(torch.empty((0, 5), device=device), torch.empty(0, dtype=torch.int64, device=device), table)
    assert argmax.shape == (0,) and table.eq(3).all()
    _check(torch.tensor([[0.0, 1.0, 1.0, 2.0, 1.0]], device=device), torch.tensor([4], device=device), table)


def test_strided_logits_int32_rows_and_out(device):
    wide = _logits(4, 60, torch.float16, device, seed=2)
    logits = wide[:, 5:50]  # row stride 60
    assert not logits.is_contiguous()
    rows = torch.tensor([3, 1, 3, 44], dtype=torch.int32, device=device)
    _check(logits, rows, torch.zeros((45, 5), dtype=torch.int32, device=device), block_v=16)
    transposed = _logits(30, 3, torch.float32, device, seed=4).t()  # column stride 3
    _check(transposed, torch.tensor([0, 1, 2], device=device), torch.zeros((3, 4), dtype=torch.int32, device=device))
    out = torch.empty(4, dtype=torch.int64, device=device)
    table = torch.zeros((45, 5), dtype=torch.int32, device=device)
    assert tu.topk_update_triton(logits, rows, table, argmax_out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, logits.float().argmax(-1))


def test_bad_arguments_raise(device):
    logits = torch.zeros((2, 4), device=device)
    rows = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="k = 5"):
        tu.topk_update_triton(logits, rows, torch.zeros((4, 5), dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="logits"):
        tu.topk_update_triton(logits.double(), rows, torch.zeros((4, 2), dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="rows"):
        tu.topk_update_triton(logits, rows[:1], torch.zeros((4, 2), dtype=torch.int32, device=device))


def test_dispatcher_picks_triton_under_interpreter(interpreter, monkeypatch):
    calls = []
    launcher = tu.topk_update_triton
    monkeypatch.setattr(tu, "topk_update_triton", lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    logits = _logits(6, 20, torch.bfloat16, "cpu", seed=9, ties=True)
    m, ref = AdjacencyMatrix(20, 4), AdjacencyMatrix(20, 4)
    tokens = torch.tensor([[3, 19, 3], [0, 3, 7]])
    assert triton_usable(logits, m.table)
    argmax = m.update(tokens, logits)
    assert calls == [1]
    assert torch.equal(argmax, tu.topk_update_reference(logits, tokens.reshape(-1), ref.table))
    assert torch.equal(m.table, ref.table)
    # fp64 logits are not a kernel input: the reference runs
    assert torch.equal(tu.topk_update(logits.double(), tokens.reshape(-1), m.table), argmax) and calls == [1]
    # without TRITON_INTERPRET, CPU tensors take the reference
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_usable(logits, m.table)
    assert torch.equal(m.update(tokens, logits), argmax) and calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936])
@pytest.mark.parametrize("num_rows", [1, 81, 648, 20736])
def test_cuda_realistic_sizes(vocab, num_rows):
    """Default tuning (splits chosen from the SM count), bf16 and fp32, real vocabularies."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(num_rows)
    for dtype in (torch.bfloat16, torch.float32):
        if num_rows * vocab * torch.finfo(dtype).bits // 8 > 4 << 30:
            continue
        logits = (torch.randn((num_rows, vocab), generator=g, device="cuda") * 3).to(dtype)
        logits[:, -1] = logits.max(-1).values  # a tie at the maximum with the last token id
        rows = torch.randint(0, vocab, (num_rows,), generator=g, device="cuda")
        rows[::7] = int(rows[0])  # duplicates (a Python int: rows[0] would overlap rows[::7])
        _check(logits, rows, torch.zeros((vocab, 8), dtype=torch.int32, device="cuda"))


def test_programs_in_reverse_order(reversed_programs):
    # Duplicates must be resolved by the kernel, not by the order the programs happen to run in;
    # with splits, another split of each row arrives last and does the merge.
    rows = torch.tensor([4, 1, 4, 4, 0, 1, 2, 4])
    logits = _logits(8, 37, torch.bfloat16, "cpu", seed=8, ties=True)
    table = _check(logits, rows, torch.zeros((37, 3), dtype=torch.int32))
    assert torch.equal(table[4].long(), tu.topk_lowest_id_first(logits[7:], 3)[0])
    _check(logits, rows, torch.zeros((37, 3), dtype=torch.int32), block_v=8, splits=3, block_t=2)
    tokens = torch.tensor([[1, 1, 2]])  # draft + update through the dispatcher too
    m = AdjacencyMatrix(37, 3)
    m.update(tokens, logits[:3])
    assert torch.equal(m.table[1].long(), tu.topk_lowest_id_first(logits[1:2], 3)[0])


@pytest.mark.gpu
def test_dispatcher_picks_triton_on_cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    calls = []
    launcher = tu.topk_update_triton
    monkeypatch.setattr(tu, "topk_update_triton", lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    logits = _logits(6, 500, torch.bfloat16, "cuda", seed=9)
    m, ref = AdjacencyMatrix(500, 8, device="cuda"), AdjacencyMatrix(500, 8, device="cuda")
    tokens = torch.tensor([[3, 499, 3], [0, 3, 7]], device="cuda")
    argmax = m.update(tokens, logits)
    assert calls == [1]
    assert torch.equal(argmax, tu.topk_update_reference(logits, tokens.reshape(-1), ref.table))
    assert torch.equal(m.table, ref.table)


@pytest.mark.gpu
def test_cuda_graph_capture_draft_and_update():
    """Both launchers are sync-free: they capture in a CUDA graph and replay exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vllm_recycling.draft import draft_tokens
    from vllm_recycling.tree import load_tree

    tree = load_tree("2.2.2", 8).to("cuda")
    vocab = 32000
    table = torch.randint(0, vocab, (vocab, 8), dtype=torch.int32, device="cuda")
    roots = torch.randint(0, vocab, (2,), device="cuda")
    prefix = torch.tensor([5, 9], device="cuda")
    tokens = torch.empty((2, tree.num_nodes + 1), dtype=torch.int32, device="cuda")
    positions = torch.empty((2, tree.num_nodes + 1), dtype=torch.int64, device="cuda")
    logits = torch.randn((2 * (tree.num_nodes + 1), vocab), device="cuda").bfloat16()
    argmax = torch.empty(logits.shape[0], dtype=torch.int64, device="cuda")

    def step():
        draft_tokens(table, roots, tree, prefix_len=prefix, out=tokens, positions_out=positions)
        tu.topk_update_triton(logits, tokens.reshape(-1).long(), table, argmax_out=argmax)

    want_table = table.clone()
    want_tokens = draft_tokens(want_table, roots, tree)
    tu.topk_update_reference(logits, want_tokens.reshape(-1).long(), want_table)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    table.copy_(want_table)  # (the warm-up step changed it: restart from the reference's state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # replay from the reference's state after one step, compare with one more reference step
    expect_table = want_table.clone()
    expect_tokens = draft_tokens(expect_table, roots, tree)
    expect_argmax = tu.topk_update_reference(logits, expect_tokens.reshape(-1).long(), expect_table)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tokens, expect_tokens) and torch.equal(argmax, expect_argmax)
    assert torch.equal(table, expect_table)
    assert torch.equal(positions, prefix[:, None] + tree.depth[None])
