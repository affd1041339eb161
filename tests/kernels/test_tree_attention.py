"""The tree-attention kernel equals its PyTorch reference (interpreter on CPU, or CUDA), the
reference equals attention over explicitly gathered keys, and both equal the CPU path's
``cpu_attention.tree_attention_reference`` on a planned step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_recycling.kernels import tree_attention as ta
from vllm_recycling.kernels import triton_usable
from vllm_recycling.tree import compile_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

# A branching template, breadth-first (parent of each node, the root's -1): 24 nodes, depth 6.
PARENT = (-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4, 5, 7, 9, 9, 10, 10, 13, 14, 16, 16, 18, 20)

# Ancestor-closed subsets of the template (template node ids, breadth-first, root first).
FULL = list(range(len(PARENT)))
CUT = list(range(7))  # the scheduler kept the first 7 rows
SPARSE = [0, 2, 3, 7, 8, 9, 13, 14, 15, 18, 19]
PATH = [0, 1, 4, 10, 16, 20, 23]  # one chain (still attended as a tree here)
ONE = [0, 3]  # root and one node
ROOT = [0]  # root only: nothing to write

# (prefix length, subtree) per tree request: prefixes crossing several 16-token blocks, and 1
MIXED = [(37, FULL), (130, SPARSE), (300, CUT), (1, PATH), (16, ONE), (5, ROOT)]

# |kernel - reference| allowed per dtype (the reference accumulates in float32, then rounds to
# the output's dtype: 2^-11 relative for fp16, 2^-8 for bf16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# bfloat16 runs through the interpreter too, whose tl.dot multiplies it in float32 (the
# kernel's UPCAST): that checks the indexing, the compiled bfloat16 dot needs CUDA.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ancestors(node):
    chain = {node}
    while PARENT[node] >= 0:
        node = PARENT[node]
        chain.add(node)
    return chain


class Case:
    """A step: tree requests (batch indices 1, 3, 5, ...), a 2-row non-tree request before each
    (a prefill chunk or chain), and 3 padding rows at the end of query / output.

    The cache is allocated in ``layout``: "block_major" [num_blocks, block_size, H_kv, 2D]
    permuted to the logical view, "head_major" [num_blocks, H_kv, block_size, 2D] as is,
    "padded" [num_blocks, H_kv, block_size, 3D] sliced to 2D. Block ids are shuffled. Every
    cache slot that holds none of the tree requests' positions 0 .. prefix + n - 1 is NaN, so a
    stray read shows. query is a slice of a wider (qkv-like) tensor; output starts as random
    sentinel content."""

    def __init__(self, specs, heads, kv_heads, dim, dtype, device, layout="block_major",
                 block_size=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.specs, self.heads, self.kv_heads, self.dim = specs, heads, kv_heads, dim
        self.block_size, self.scale = block_size, dim ** -0.5
        num_req = len(specs)
        batch = 2 * num_req
        widths = [len(nodes) for _, nodes in specs]
        width = max(widths, default=1)
        max_blocks = max([-(-(p + n) // block_size) for (p, _), n in zip(specs, widths)], default=1) + 1
        num_blocks = batch * max_blocks + 4
        self.block_table = torch.randperm(num_blocks, generator=g)[: batch * max_blocks]
        self.block_table = self.block_table.view(batch, max_blocks).to(torch.int32)

        self.rows = torch.zeros((num_req, width), dtype=torch.int64)
        self.mask = torch.zeros((num_req, width, width), dtype=torch.bool)
        self.written = []  # output rows the kernel must write
        row = 0
        for r, (_, nodes) in enumerate(specs):
            row += 2  # the non-tree request before it
            n = len(nodes)
            self.rows[r] = row + torch.arange(width).clamp(max=n - 1)  # padding: the last node
            for i, node in enumerate(nodes):
                above = _ancestors(node)
                for j, other in enumerate(nodes):
                    self.mask[r, i, j] = other in above
            self.written += list(range(row + 1, row + n))
            row += n
        self.total = row + 3
        self.req_index = 2 * torch.arange(num_req, dtype=torch.int64) + 1
        self.num_rows = torch.tensor(widths, dtype=torch.int64)
        self.prefix_len = torch.tensor([p for p, _ in specs], dtype=torch.int64)

        values = torch.randn((num_blocks, block_size, kv_heads, 2 * dim), generator=g)
        owned = torch.zeros((num_blocks, block_size), dtype=torch.bool)
        for r, ((prefix, _), n) in enumerate(zip(specs, widths)):
            pos = torch.arange(prefix + n)
            owned[self.block_table[2 * r + 1, pos // block_size].long(), pos % block_size] = True
        values[~owned] = float("nan")
        if layout == "block_major":
            kv = values.to(dtype).permute(0, 2, 1, 3)
        elif layout == "head_major":
            kv = values.permute(0, 2, 1, 3).contiguous().to(dtype)
        elif layout == "padded":
            wide = torch.randn((num_blocks, kv_heads, block_size, 3 * dim), generator=g).to(dtype)
            wide[..., : 2 * dim] = values.permute(0, 2, 1, 3)
            # sliced on the device: moving a non-dense view to CUDA makes it contiguous
            kv = wide.to(device)[..., : 2 * dim]
        else:
            raise ValueError(layout)
        self.kv_cache = kv.to(device)
        qkv = torch.randn((self.total, heads + 2 * kv_heads, dim), generator=g)
        self.query = qkv.to(device=device, dtype=dtype)[:, :heads]
        self.sentinel = torch.randn((self.total, heads, dim), generator=g).to(device=device, dtype=dtype)
        self.block_table, self.rows, self.mask = (t.to(device) for t in (self.block_table, self.rows, self.mask))
        self.req_index, self.num_rows, self.prefix_len = (
            t.to(device) for t in (self.req_index, self.num_rows, self.prefix_len))

    def args(self):
        return (self.query, self.kv_cache, self.block_table, self.req_index, self.rows,
                self.num_rows, self.prefix_len, self.mask)

    def run(self, fn, **kw):
        out = self.sentinel.clone()
        fn(*self.args(), out, self.scale, **kw)
        return out

    def untouched(self):
        keep = torch.ones(self.total, dtype=torch.bool)
        keep[self.written] = False
        return keep.to(self.query.device)

    def oracle(self):
        """float64 [T, H, D]: for every written row and head, softmax attention over the key
        list gathered position by position (prefix, then the node's ancestors and itself)."""
        out = torch.zeros((self.total, self.heads, self.dim), dtype=torch.float64)
        kv = self.kv_cache.cpu().double()
        table = self.block_table.cpu().tolist()
        group = self.heads // self.kv_heads
        q = self.query.cpu().double()
        for r, (prefix, nodes) in enumerate(self.specs):
            b = int(self.req_index[r])
            root = int(self.rows[r, 0])
            for i in range(1, len(nodes)):
                positions = list(range(prefix))
                positions += [prefix + j for j, other in enumerate(nodes) if other in _ancestors(nodes[i])]
                blocks = torch.tensor([table[b][p // self.block_size] for p in positions])
                offsets = torch.tensor([p % self.block_size for p in positions])
                for h in range(self.heads):
                    entries = kv[blocks, h // group, offsets]  # [L, 2D]
                    w = torch.softmax(entries[:, : self.dim] @ q[root + i, h] * self.scale, dim=0)
                    out[root + i, h] = w @ entries[:, self.dim :]
        return out


def _compare(case, got, want, dtype):
    """Written rows within the dtype's tolerance, every other row bit for bit the sentinel."""
    keep = case.untouched()
    assert torch.equal(got[keep], case.sentinel[keep])
    assert torch.equal(want[keep], case.sentinel[keep])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[~keep].float(), want[~keep].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (3, 3), (6, 2)], ids=lambda h: f"H{h[0]}_kv{h[1]}")
def test_matches_reference(device, dtype, heads):
    case = Case(MIXED, *heads, 64, dtype, device, seed=heads[0])
    got = case.run(ta.tree_attention_triton)
    want = case.run(ta.tree_attention_reference)
    _compare(case, got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_size_not_a_power_of_two(device, dtype):
    case = Case([(37, FULL), (70, SPARSE)], 4, 2, 80, dtype, device, seed=80)
    _compare(case, case.run(ta.tree_attention_triton), case.run(ta.tree_attention_reference), dtype)


@pytest.mark.parametrize("layout", ["block_major", "head_major", "padded"])
def test_cache_layouts(device, layout):
    case = Case([(37, SPARSE), (130, CUT)], 4, 2, 64, torch.float32, device, layout=layout, seed=3)
    assert case.kv_cache.is_contiguous() == (layout == "head_major")
    _compare(case, case.run(ta.tree_attention_triton), case.run(ta.tree_attention_reference), torch.float32)


def test_small_tiles(device):
    """Several row tiles per request (BLOCK_ROWS = 2) and several key tiles in both phases
    (BLOCK_N = 16 < 24 nodes), with 8 query heads on one key/value head."""
    case = Case([(40, FULL), (3, SPARSE), (16, CUT)], 8, 1, 32, torch.float32, device, seed=5)
    got = case.run(ta.tree_attention_triton, block_rows=2, block_n=16)
    _compare(case, got, case.run(ta.tree_attention_reference), torch.float32)


def test_reference_and_kernel_match_explicit_attention(device):
    """The oracle: attention over each node's key list gathered position by position."""
    case = Case(MIXED, 6, 2, 32, torch.float32, device, seed=11)
    want = case.oracle()
    rows = case.written
    for fn in (ta.tree_attention_reference, ta.tree_attention_triton):
        got = case.run(fn)
        torch.testing.assert_close(got[rows].cpu().double(), want[rows], atol=1e-5, rtol=1e-5)


def test_matches_cpu_tree_attention_on_a_planned_step(device):
    """A ``TreeStep`` planned from vLLM's host arrays (a prefill chunk, two cut trees, a
    request with no drafts): the kernel over the paged cache equals attention over each node's
    prefix and ancestors, gathered position by position."""
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]
    layout = TreeLayout.from_template(compile_tree(paths, topk=3), "cpu")
    num_draft, computed = np.array([0, 9, 0, 5]), np.array([0, 40, 7, 18])
    qsl = np.array([0, 4, 14, 15, 21])
    step = TreeStep.plan(layout, num_draft, qsl, computed, "cpu")
    assert step.req_index.tolist() == [1, 3]
    heads, kv_heads, dim, block_size = 4, 2, 32, 16
    g = torch.Generator().manual_seed(2)
    total = int(qsl[-1])
    query = torch.randn((total, heads, dim), generator=g)
    key, value = torch.randn((2, total, kv_heads, dim), generator=g)
    max_blocks = 4
    block_table = torch.randperm(4 * max_blocks, generator=g).view(4, max_blocks).to(torch.int32)
    kv = torch.randn((4 * max_blocks, block_size, kv_heads, 2 * dim), generator=g)
    # vLLM wrote this step's keys and values to the slots of positions computed + (row - start)
    for b in range(4):
        for row in range(qsl[b], qsl[b + 1]):
            pos = computed[b] + row - qsl[b]
            kv[block_table[b, pos // block_size], pos % block_size] = torch.cat([key[row], value[row]], -1)
    kv_cache = kv.permute(0, 2, 1, 3)

    before = torch.randn((total, heads, dim), generator=g)
    want = before.clone()
    for r in range(len(step.req_index)):
        b, root, prefix = int(step.req_index[r]), int(step.root_row[r]), int(step.prefix_len[r])
        for j in range(1, int(step.num_rows[r])):
            seen = list(range(prefix)) + [prefix + i for i in range(j + 1) if step.mask[r, j, i]]
            entries = torch.stack([kv[block_table[b, p // block_size], p % block_size] for p in seen])
            for h in range(heads):
                kv_head = entries[:, h // (heads // kv_heads)]
                w = torch.softmax(kv_head[:, :dim] @ query[root + j, h] * 0.2, dim=0)
                want[root + j, h] = w @ kv_head[:, dim:]
    got = before.to(device)
    args = (block_table.to(device), step.req_index.to(device), step.rows.to(device),
            step.num_rows.to(device), step.prefix_len.to(device), step.mask.to(device))
    ta.tree_attention_triton(query.to(device), kv_cache.to(device), *args, got, 0.2)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    ref = before.clone()
    ta.tree_attention_reference(query, kv_cache, *(t.cpu() for t in args), ref, 0.2)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(want[:5], before[:5]) and torch.equal(want[14:16], before[14:16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_check(device, dtype):
    assert ta.self_check(device, dtype) < TOLERANCE[dtype]


def test_nothing_to_write(device):
    """No tree request at all, and tree requests with only their root: output untouched."""
    for specs in ([], [(20, ROOT), (3, ROOT)]):
        case = Case(specs, 4, 2, 16, torch.float16, device)
        got = case.run(ta.tree_attention_triton)
        assert torch.equal(got, case.sentinel)


def test_dispatcher_picks_triton_under_interpreter(interpreter, monkeypatch):
    case = Case([(37, SPARSE), (9, CUT)], 4, 2, 32, torch.float32, "cpu", seed=4)
    calls = []
    launcher = ta.tree_attention_triton
    monkeypatch.setattr(ta, "tree_attention_triton", lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    assert triton_usable(case.query, case.kv_cache)
    got = case.run(ta.tree_attention)
    assert calls == [1]
    want = case.run(ta.tree_attention_reference)
    _compare(case, got, want, torch.float32)
    # without TRITON_INTERPRET, CPU tensors take the reference
    monkeypatch.delenv("TRITON_INTERPRET")
    assert torch.equal(case.run(ta.tree_attention), want) and calls == [1]


def test_bad_arguments_raise():
    case = Case([(5, CUT)], 4, 2, 16, torch.float32, "cpu")
    args = case.args()
    out = case.sentinel.clone()
    with pytest.raises(ValueError, match="output"):
        ta.tree_attention_triton(*args, out.half(), 1.0)
    with pytest.raises(ValueError, match="output"):
        ta.tree_attention_triton(*args, out[:-1], 1.0)
    with pytest.raises(ValueError, match="query"):
        ta.tree_attention_triton(case.query.transpose(1, 2).contiguous().transpose(1, 2), *args[1:], out, 1.0)
    with pytest.raises(ValueError, match="kv_cache"):
        ta.tree_attention_triton(args[0], args[1][..., :16], *args[2:], out, 1.0)
    with pytest.raises(ValueError, match="mask"):
        ta.tree_attention_triton(*args[:7], args[7][:, :3], out, 1.0)
    with pytest.raises(ValueError, match="key/value heads"):
        ta.tree_attention_triton(args[0][:, :3], *args[1:], out[:, :3], 1.0)
    with pytest.raises(ValueError, match="block_rows"):
        ta.tree_attention_triton(*args, out, 1.0, block_rows=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_large_step(dtype):
    """A serving-sized step: 48 requests, full and cut trees, prefixes up to 3000, 32 query
    heads on 8 key/value heads of 128."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    subtrees = [FULL, SPARSE, CUT, PATH, ONE]
    specs = [(int(torch.randint(1, 3000, (1,), generator=g)), subtrees[i % 5]) for i in range(48)]
    case = Case(specs, 32, 8, 128, dtype, "cuda", seed=1)
    _compare(case, case.run(ta.tree_attention_triton), case.run(ta.tree_attention_reference), dtype)
