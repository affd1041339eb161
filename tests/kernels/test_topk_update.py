"""The fused top-k update kernel equals its PyTorch reference exactly (interpreter on CPU, or
CUDA): the same argmax, the same ordered top-k, the same table after the scatter."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_recycling.kernels import topk_update as tu
from vllm_recycling.kernels import triton_usable
from vllm_recycling.matrix import AdjacencyMatrix

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(logits, rows, table, with_probs=False, **kw):
    """Run kernel and reference on copies of table; compare argmax, table and every row's top-k.

    with_probs: also pass both probability buffers (sentinel-filled, so untouched rows count)
    and compare them within fp16 rounding (kernel and reference round slightly different fp32
    values); returns (table, probs, probs_out) then.
    """
    k = table.shape[1]
    got_table, want_table = table.clone(), table.clone()
    topk = torch.full((logits.shape[0], k), -5, dtype=torch.int32, device=logits.device)
    got, want = {}, {}
    if with_probs:
        for bufs in (got, want):
            bufs["probs"] = torch.full(table.shape, -1.0, dtype=torch.float16, device=logits.device)
            bufs["probs_out"] = torch.full((logits.shape[0], k), -1.0, dtype=torch.float16, device=logits.device)
    argmax = tu.topk_update_triton(logits, rows, got_table, topk_out=topk, **got, **kw)
    want_argmax = tu.topk_update_reference(logits, rows.long(), want_table, **want)  # the reference takes int64 rows
    assert argmax.dtype == torch.int64
    assert torch.equal(argmax, want_argmax)
    assert torch.equal(topk.long(), tu.topk_lowest_id_first(logits, k))
    assert torch.equal(got_table, want_table)
    if not with_probs:
        return got_table
    torch.testing.assert_close(got["probs_out"], want["probs_out"], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got["probs"], want["probs"], atol=1e-3, rtol=1e-3)
    return got_table, got["probs"], got["probs_out"]


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


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k", [1, 8])
def test_probs_random_rows(device, dtype, k):
    # Partial last chunk, repeated rows (the last t's probabilities win), a row whose maximum
    # grows chunk after chunk (the running sum is rescaled each time) and one that falls.
    vocab = 100
    logits = _logits(6, vocab, dtype, device, seed=20 + k).float()
    logits[1] += torch.arange(vocab, device=device) * 0.2
    logits[4] -= torch.arange(vocab, device=device) * 0.2
    rows = torch.tensor([5, 99, 5, 0, 42, 99], device=device)
    table = torch.zeros((vocab, k), dtype=torch.int32, device=device)
    _check(logits.to(dtype), rows, table, with_probs=True, block_v=32)


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_probs_split_rows_merge(device, splits):
    # Each split publishes its (max, sum) and the merging split combines them: ties across split
    # boundaries, a row that is -inf in all splits but one (their sums are 0, their max -inf).
    vocab, k = 37, 8
    logits = torch.cat([
        _logits(2, vocab, torch.float32, device, seed=splits, ties=True),
        _logits(2, vocab, torch.float32, device, seed=splits + 1),
        torch.full((1, vocab), float("-inf"), device=device),
    ])
    logits[4, [30, 33]] = torch.tensor([1.0, 2.0], device=device)
    rows = torch.tensor([1, 2, 1, 36, 0], device=device)
    for dtype in DTYPES:
        _check(logits.to(dtype), rows, torch.zeros((vocab, k), dtype=torch.int32, device=device),
               with_probs=True, block_v=8, splits=splits)
    _, probs, _ = _check(logits, rows, torch.zeros((vocab, 16), dtype=torch.int32, device=device),
                         with_probs=True, block_v=4, splits=splits)
    assert probs[0, 2:].eq(0).all()  # the -inf tokens of the last row


def test_probs_by_hand(device):
    # softmax([0, ln 3]) = (0.25, 0.75): exact in fp16 from fp32 and fp16 logits; -inf tokens get
    # 0; a uniform row over V = 4096 gives 2**-12 for every kept token, with or without splits.
    for dtype in (torch.float32, torch.float16):
        logits = torch.tensor([[0.0, math.log(3.0)]], dtype=dtype, device=device)
        probs = torch.full((3, 2), -1.0, dtype=torch.float16, device=device)
        probs_out = torch.full((1, 2), -1.0, dtype=torch.float16, device=device)
        table = torch.zeros((3, 2), dtype=torch.int32, device=device)
        tu.topk_update_triton(logits, torch.tensor([2], device=device), table, probs=probs, probs_out=probs_out)
        assert table[2].tolist() == [1, 0]
        assert probs.tolist() == [[-1.0, -1.0], [-1.0, -1.0], [0.75, 0.25]]
        assert probs_out.tolist() == [[0.75, 0.25]]
    # each buffer on its own (k = 1)
    row, table = torch.tensor([1], device=device), torch.zeros((3, 1), dtype=torch.int32, device=device)
    probs = torch.zeros((3, 1), dtype=torch.float16, device=device)
    tu.topk_update_triton(logits, row, table, probs=probs)
    assert probs[:, 0].tolist() == [0.0, 0.75, 0.0]
    probs_out = torch.zeros((1, 1), dtype=torch.float16, device=device)
    tu.topk_update_triton(logits, row, table, probs_out=probs_out)
    assert probs_out.tolist() == [[0.75]]
    logits = torch.full((2, 4096), float("-inf"), device=device)
    logits[0] = 0.0
    logits[1, [7, 4000]] = 3.5
    for splits in (1, 4):
        _, probs, probs_out = _check(logits, torch.tensor([0, 1], device=device),
                                     torch.zeros((2, 4), dtype=torch.int32, device=device),
                                     with_probs=True, block_v=512, splits=splits)
        assert probs_out[0].eq(2.0**-12).all() and probs_out[1].tolist() == [0.5, 0.5, 0.0, 0.0]


def test_probs_fp16_logits_large_vocab(device):
    # V = 4096 fp16 logits in 256-wide chunks (16 per row) and in a single chunk (the default).
    logits = _logits(3, 4096, torch.float16, device, seed=31)
    rows = torch.tensor([7, 3, 7], device=device)
    table = torch.zeros((8, 4), dtype=torch.int32, device=device)
    _check(logits, rows, table, with_probs=True, block_v=256)
    _check(logits, rows, table, with_probs=True)


def test_probs_duplicates_last_wins(device):
    # Token 1 at three nodes: its probabilities come from the last, row 4 of the logits.
    logits = _logits(6, 16, torch.float32, device, seed=12)
    rows = torch.tensor([1, 2, 1, 3, 1, 0], device=device)
    table, probs, probs_out = _check(logits, rows, torch.zeros((16, 4), dtype=torch.int32, device=device),
                                     with_probs=True, block_t=2)
    want = torch.softmax(logits[4], -1)[table[1].long()]
    torch.testing.assert_close(probs[1], want.half(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(probs_out[4], want.half(), atol=1e-3, rtol=1e-3)
    assert probs[4:].eq(-1).all()  # rows no node holds are left alone
    # many duplicates, more than one block of the duplicate scan
    logits = _logits(40, 16, torch.bfloat16, device, seed=6)
    rows = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(6)).to(device)
    _check(logits, rows, torch.zeros((16, 4), dtype=torch.int32, device=device), with_probs=True, block_t=8)


def test_probs_bad_arguments_raise(device):
    logits = torch.zeros((2, 4), device=device)
    rows = torch.zeros(2, dtype=torch.int64, device=device)
    table = torch.zeros((4, 2), dtype=torch.int32, device=device)
    half = dict(dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="probs: expected float16"):
        tu.topk_update_triton(logits, rows, table, probs=torch.zeros((4, 2), device=device))
    with pytest.raises(ValueError, match="probs: expected float16"):
        tu.topk_update_triton(logits, rows, table, probs=torch.zeros((3, 2), **half))
    with pytest.raises(ValueError, match="probs: expected float16"):
        tu.topk_update_triton(logits, rows, table, probs=torch.zeros((2, 4), **half).t())
    with pytest.raises(ValueError, match="probs: expected float16"):
        tu.topk_update_triton(logits, rows, table, probs=torch.zeros((4, 2), dtype=torch.float16, device="meta"))
    with pytest.raises(ValueError, match="probs_out: expected float16"):
        tu.topk_update_triton(logits, rows, table, probs_out=torch.zeros((4, 2), **half))
    with pytest.raises(ValueError, match="probs_out: expected float16"):
        tu.topk_update_triton(logits, rows, table, probs_out=torch.zeros((2, 2), dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="probs_out: expected float16"):
        tu.topk_update_triton(logits, rows, table, probs_out=torch.zeros((2, 4), **half)[:, ::2])


def test_probs_dispatcher_under_interpreter(interpreter, monkeypatch):
    calls = []
    launcher = tu.topk_update_triton
    monkeypatch.setattr(tu, "topk_update_triton", lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    logits = _logits(6, 20, torch.bfloat16, "cpu", seed=9)
    rows = torch.tensor([3, 19, 3, 0, 3, 7])
    got = [torch.zeros((20, 4), dtype=torch.int32), torch.zeros((20, 4), dtype=torch.float16),
           torch.zeros((6, 4), dtype=torch.float16)]
    want = [t.clone() for t in got]
    argmax = tu.topk_update(logits, rows, got[0], probs=got[1], probs_out=got[2])
    assert calls == [1]
    assert torch.equal(argmax, tu.topk_update_reference(logits, rows, *want[:1], probs=want[1], probs_out=want[2]))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1:], want[1:], atol=1e-3, rtol=1e-3)
    # fp32 probabilities are not a kernel buffer: the reference runs
    probs32 = torch.zeros((20, 4))
    tu.topk_update(logits, rows, got[0], probs=probs32)
    assert calls == [1]
    torch.testing.assert_close(probs32.half(), want[1], atol=1e-3, rtol=1e-3)


def test_probs_programs_in_reverse_order(reversed_programs):
    # Duplicates resolved by the kernel, not by the order of the programs; with splits another
    # split of each row merges the (max, sum) pairs.
    rows = torch.tensor([4, 1, 4, 4, 0, 1, 2, 4])
    logits = _logits(8, 37, torch.float16, "cpu", seed=8)
    _, probs, _ = _check(logits, rows, torch.zeros((37, 3), dtype=torch.int32), with_probs=True)
    want = torch.softmax(logits[7].float(), -1)
    torch.testing.assert_close(probs[4], want[tu.topk_lowest_id_first(logits[7:], 3)[0]].half(), atol=1e-3, rtol=1e-3)
    _check(logits, rows, torch.zeros((37, 3), dtype=torch.int32), with_probs=True, block_v=8, splits=3, block_t=2)


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
    from vllm_recycling.kernels.draft_tree import draft_tree as draft_tokens
    from vllm_recycling.tree import load_tree

    tree = load_tree("2.2.2", 8).to("cuda")
    vocab = 32000
    table = torch.randint(0, vocab, (vocab, 8), dtype=torch.int32, device="cuda")
    roots = torch.randint(0, vocab, (2,), device="cuda")
    tokens = torch.empty((2, tree.num_nodes + 1), dtype=torch.int32, device="cuda")
    logits = torch.randn((2 * (tree.num_nodes + 1), vocab), device="cuda").bfloat16()
    argmax = torch.empty(logits.shape[0], dtype=torch.int64, device="cuda")

    def step():
        tokens.copy_(draft_tokens(table, roots, tree))
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
