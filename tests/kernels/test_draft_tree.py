"""The draft-tree kernel equals its PyTorch reference exactly (interpreter on CPU, or CUDA)."""

from __future__ import annotations

import pytest
import torch

from vllm_recycling.kernels.draft_tree import draft_tree as draft_tokens
from vllm_recycling.kernels import draft_tree as dt
from vllm_recycling.kernels import triton_usable
from vllm_recycling.tree import compile_tree, load_tree

ONE_NODE = [[0]]


def _tree(spec, k, device):
    tree = compile_tree(spec, topk=k) if isinstance(spec, list) else load_tree(spec, topk=k)
    return tree.to(device)


def _case(vocab, k, batch, slots, device, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (slots * vocab, k), generator=g, dtype=torch.int32)
    roots = torch.randint(0, vocab, (batch,), generator=g)
    base = torch.randint(0, slots, (batch,), generator=g) * vocab if slots > 1 else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(table), to(roots), to(base)


def _reference(table, roots, tree, base):
    return dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, base)


@pytest.mark.parametrize("spec", ["2.2.2", ONE_NODE, "tree16"])
@pytest.mark.parametrize("slots", [1, 3], ids=["shared", "per_request"])
@pytest.mark.parametrize("batch", [0, 1, 5])
def test_random_matches_reference(device, spec, slots, batch):
    tree = _tree(spec, 8, device)
    table, roots, base = _case(50, 8, batch, slots, device, seed=batch * 10 + slots)
    tokens = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, base)
    assert tokens.dtype == torch.int32 and tokens.shape == (batch, tree.num_nodes + 1)
    assert torch.equal(tokens, _reference(table, roots, tree, base))


def _overlay_case(vocab, k, batch, slots, size, device, seed):
    """A shared [V, k] matrix followed by `slots * size` overlay rows and a scratch row; keys
    that hold a token for about half the entries (some colliding: t & (size - 1) != t)."""
    g = torch.Generator().manual_seed(seed)
    entries = slots * size + 1
    table = torch.randint(0, vocab, (vocab + entries, k), generator=g, dtype=torch.int32)
    tok = torch.randint(0, vocab, (entries,), generator=g, dtype=torch.int32)
    slot_of_entry = torch.arange(entries) % size
    keys = torch.where((tok & (size - 1)) == slot_of_entry, tok, -1).to(torch.int32)
    keys = torch.where(torch.rand(entries, generator=g) < 0.8, keys, -1).to(torch.int32)
    # make sure hits exist: every slot's entry for token e (e < size) holds e half the time
    for e in range(0, min(size, vocab), 2):
        keys[torch.arange(slots) * size + e] = e
    keys[-1] = -1
    roots = torch.randint(0, vocab, (batch,), generator=g)
    key_base = torch.randint(0, slots, (batch,), generator=g) * size
    overlay = dt.Overlay(keys.to(device), key_base.to(device), vocab, size)
    return table.to(device), roots.to(device), overlay


@pytest.mark.parametrize("spec", ["2.2.2", "tree16"])
@pytest.mark.parametrize("batch", [0, 1, 5])
def test_overlay_matches_reference(device, spec, batch):
    """Each request reads its own overlay entry where the key holds the token, the shared row
    elsewhere; the reference does the same per level, the kernel per node along its path."""
    tree = _tree(spec, 8, device)
    table, roots, overlay = _overlay_case(12, 8, batch, 3, 4, device, seed=batch)
    got = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, overlay=overlay)
    want = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, None, overlay)
    assert torch.equal(got, want)
    if batch:  # the overlay changes the trees: without it they differ
        plain = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts)
        assert not torch.equal(plain, want)


@pytest.mark.parametrize("batch", [1, 5])
def test_salt_matrices_under_the_overlay_match_reference(device, batch):
    """matrix_scope="salt": each request reads its overlay entry where the key holds the token,
    else its salt's matrix (row_base, one of 3 matrices of 12 rows) instead of the shared one."""
    tree = _tree("2.2.2", 8, device)
    vocab, salts, slots, size = 12, 3, 3, 4
    g = torch.Generator().manual_seed(batch)
    table, roots, overlay = _overlay_case(vocab, 8, batch, slots, size, device, seed=batch)
    matrices = torch.randint(0, vocab, ((salts - 1) * vocab, 8), generator=g, dtype=torch.int32)
    table = torch.cat([table[:vocab], matrices.to(device), table[vocab:]])
    overlay = overlay._replace(offset=salts * vocab)
    base = (torch.randint(0, salts, (batch,), generator=g) * vocab).to(device)
    got = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, base, overlay=overlay)
    want = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, base, overlay)
    assert torch.equal(got, want)


def test_overlay_by_hand():
    """Shared: 1 -> 2, 2 -> 3. Request 0's overlay (size 2) holds token 2 -> 0 at entry 0;
    request 1's holds nothing. Chain of 3 from root 1: request 0 reads 1 -> 2 (shared, key miss),
    2 -> 0 (its own), 0 -> 0 (shared); request 1 reads the shared matrix only."""
    tree = compile_tree([[0], [0, 0], [0, 0, 0]], topk=1)
    table = torch.tensor([[0], [2], [3], [0], [0], [0], [0], [0], [9]], dtype=torch.int32)  # V = 4
    keys = torch.tensor([2, -1, -1, -1, -1], dtype=torch.int32)  # slot 0: entries 0-1, slot 1: 2-3
    overlay = dt.Overlay(keys, torch.tensor([0, 2]), 4, 2)
    table[4 + 0, 0] = 0
    roots = torch.tensor([1, 1])
    want = torch.tensor([[1, 2, 0, 0], [1, 2, 3, 0]], dtype=torch.int32)
    got = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, None, overlay)
    assert torch.equal(got, want)


def test_duplicates_last_token_and_small_vocab(device):
    # V = 3: every tree is full of repeated tokens, within a tree and across the batch; token
    # V-1 is a root and fills whole rows; the same root twice in the batch.
    tree = _tree("2.2.2", 8, device)
    table = torch.tensor([[2] * 8, [1, 2, 0, 1, 2, 0, 1, 2], [2, 2, 1, 1, 0, 0, 2, 2]], dtype=torch.int32)
    table = table.to(device)
    roots = torch.tensor([2, 0, 2, 1], device=device)
    tokens = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth)
    want = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts)
    assert torch.equal(tokens, want)
    assert torch.equal(tokens[0], tokens[2]) and tokens.eq(2).any() and tokens.eq(0).any()


def test_per_request_scope_reads_each_slot(device):
    tree = _tree([[0], [0, 0], [1]], 2, device)
    vocab = 4
    a = torch.tensor([[1, 3], [2, 0], [3, 1], [0, 2]], dtype=torch.int32)
    b = torch.tensor([[3, 3], [0, 1], [1, 0], [2, 3]], dtype=torch.int32)
    table = torch.cat([a, b]).to(device)
    roots = torch.tensor([0, 0, 3], device=device)
    base = torch.tensor([0, vocab, vocab], device=device)
    tokens = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, base)
    # nodes in breadth-first order: root, [0], [1], [0, 0]
    assert tokens.tolist() == [[0, 1, 3, 2], [0, 3, 3, 2], [3, 2, 3, 1]]


def test_node_blocks_and_int32_roots(device):
    # Several node blocks per request, int32 roots.
    tree = _tree("2.2.2", 8, device)
    table, roots, base = _case(40, 8, 3, 2, device, seed=7)
    got = dt.draft_tree_triton(table, roots.int(), tree.rank_path, tree.depth, base, block_n=32)
    assert torch.equal(got, _reference(table, roots, tree, base))


def test_bad_table_raises(device):
    tree = _tree(ONE_NODE, 1, device)
    table = torch.zeros((4, 1), dtype=torch.int32, device=device)
    roots = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="table"):
        dt.draft_tree_triton(table.long(), roots, tree.rank_path, tree.depth)


def test_dispatcher_picks_triton_under_interpreter(interpreter, monkeypatch):
    tree = _tree("2.2.2", 8, "cpu")
    table, roots, base = _case(30, 8, 4, 2, "cpu", seed=3)
    calls = []
    launcher = dt.draft_tree_triton
    monkeypatch.setattr(dt, "draft_tree_triton", lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    assert triton_usable(table, roots)
    tokens = draft_tokens(table, roots, tree, base)
    assert calls == [1]
    want_tokens = _reference(table, roots, tree, base)
    assert torch.equal(tokens, want_tokens)
    # without TRITON_INTERPRET, CPU tensors take the reference
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_usable(table, roots)
    assert torch.equal(draft_tokens(table, roots, tree, base), want_tokens) and calls == [1]


def _probs_like(table, seed):
    """Random fp16 probabilities [R, k], one distinct value per entry (so a wrong row or rank
    shows), on the table's device."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(table.shape, generator=g).half().to(table.device)


@pytest.mark.parametrize("spec", ["2.2.2", ONE_NODE, "tree16"])
@pytest.mark.parametrize("slots", [1, 3], ids=["shared", "per_request"])
@pytest.mark.parametrize("batch", [1, 5])
def test_conf_matches_reference(device, spec, slots, batch):
    """conf is a gather of fp16 values read as fp32: equal to the reference exactly."""
    tree = _tree(spec, 8, device)
    table, roots, base = _case(50, 8, batch, slots, device, seed=batch * 10 + slots)
    probs = _probs_like(table, seed=batch)
    want_tokens, want_conf = dt.draft_tree_reference(
        table, roots, tree.parent, tree.rank, tree.level_starts, base, probs=probs
    )
    tokens, conf = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, base, probs=probs)
    assert conf.dtype == torch.float32 and conf.shape == (batch, tree.num_nodes + 1)
    assert torch.equal(tokens, want_tokens) and torch.equal(conf, want_conf)
    assert conf[:, 0].eq(1).all()


@pytest.mark.parametrize("spec", ["2.2.2", "tree16"])
@pytest.mark.parametrize("batch", [1, 5])
def test_conf_overlay_matches_reference(device, spec, batch):
    """A node drafted from an overlay row takes that row's probability, not the shared one's."""
    tree = _tree(spec, 8, device)
    table, roots, overlay = _overlay_case(12, 8, batch, 3, 4, device, seed=batch)
    probs = _probs_like(table, seed=batch + 100)
    tokens, conf = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, overlay=overlay, probs=probs)
    want_tokens, want_conf = dt.draft_tree_reference(
        table, roots, tree.parent, tree.rank, tree.level_starts, None, overlay, probs
    )
    assert torch.equal(tokens, want_tokens) and torch.equal(conf, want_conf)
    _, plain = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, probs=probs)
    assert not torch.equal(plain, want_conf)


def test_conf_by_hand(device):
    """Per-request scope, nodes root, [0], [1], [0, 0] (the tree of
    test_per_request_scope_reads_each_slot): each node's probability is probs[row(parent), rank]."""
    tree = _tree([[0], [0, 0], [1]], 2, device)
    vocab = 4
    a = torch.tensor([[1, 3], [2, 0], [3, 1], [0, 2]], dtype=torch.int32)
    b = torch.tensor([[3, 3], [0, 1], [1, 0], [2, 3]], dtype=torch.int32)
    table = torch.cat([a, b]).to(device)
    # probs[r, j] = (r + 1) / 16 + j / 256: exact in fp16, and names its row and rank
    probs = ((torch.arange(8)[:, None] + 1) / 16 + torch.arange(2)[None] / 256).half().to(device)
    roots = torch.tensor([0, 0, 3], device=device)
    base = torch.tensor([0, vocab, vocab], device=device)
    tokens, conf = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, base, probs=probs)
    assert tokens.tolist() == [[0, 1, 3, 2], [0, 3, 3, 2], [3, 2, 3, 1]]
    p = lambda row, rank: (row + 1) / 16 + rank / 256  # noqa: E731
    # request 0: [0] and [1] from row 0, [0, 0] from row 1 (token 1); request 1: rows 4 and
    # 4 + 3; request 2: rows 4 + 3 and 4 + 2
    want = [[1.0, p(0, 0), p(0, 1), p(1, 0)], [1.0, p(4, 0), p(4, 1), p(7, 0)], [1.0, p(7, 0), p(7, 1), p(6, 0)]]
    assert conf.tolist() == want
    got = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, base, probs=probs)
    assert got[1].tolist() == want


def test_conf_node_blocks_and_bad_probs(device):
    # Several node blocks; then rejected probs.
    tree = _tree("2.2.2", 8, device)
    table, roots, base = _case(40, 8, 3, 2, device, seed=7)
    probs = _probs_like(table, seed=7)
    got = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, base, probs=probs, block_n=32)
    want = dt.draft_tree_reference(table, roots, tree.parent, tree.rank, tree.level_starts, base, probs=probs)
    assert len(got) == 2 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    args = (table, roots, tree.rank_path, tree.depth, base)
    for bad in (probs.float(), probs[:-1], probs.t().contiguous().t(), probs.to("meta")):
        with pytest.raises(ValueError, match="probs: expected float16"):
            dt.draft_tree_triton(*args, probs=bad)


def test_conf_empty_batch(device):
    tree = _tree("2.2.2", 8, device)
    table, roots, _ = _case(20, 8, 0, 1, device, seed=0)
    tokens, conf = dt.draft_tree_triton(table, roots, tree.rank_path, tree.depth, probs=_probs_like(table, 0))
    assert tokens.shape == conf.shape == (0, tree.num_nodes + 1) and conf.dtype == torch.float32


def test_conf_dispatcher_under_interpreter(interpreter, monkeypatch):
    tree = _tree("2.2.2", 8, "cpu")
    table, roots, base = _case(30, 8, 4, 2, "cpu", seed=3)
    probs = _probs_like(table, seed=3)
    calls = []
    launcher = dt.draft_tree_triton
    monkeypatch.setattr(dt, "draft_tree_triton", lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    want_tokens, want_conf = dt.draft_tree_reference(
        table, roots, tree.parent, tree.rank, tree.level_starts, base, probs=probs
    )
    tokens, conf = draft_tokens(table, roots, tree, base, probs=probs)
    assert calls == [1]
    assert torch.equal(tokens, want_tokens) and torch.equal(conf, want_conf)
    # the reference path returns the same values in the same order
    monkeypatch.delenv("TRITON_INTERPRET")
    tokens, conf = draft_tokens(table, roots, tree, base, probs=probs)
    assert calls == [1]
    assert torch.equal(tokens, want_tokens) and torch.equal(conf, want_conf)


@pytest.mark.gpu
def test_cuda_large_batch_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tree = _tree("2.2.2", 8, "cuda")
    for slots in (1, 4):
        table, roots, base = _case(151936, 8, 256, slots, "cuda", seed=slots)
        assert torch.equal(draft_tokens(table, roots, tree, base), _reference(table, roots, tree, base))


@pytest.mark.gpu
def test_dispatcher_picks_triton_on_cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tree = _tree("2.2.2", 8, "cuda")
    table, roots, base = _case(1000, 8, 4, 2, "cuda", seed=1)
    calls = []
    launcher = dt.draft_tree_triton
    monkeypatch.setattr(dt, "draft_tree_triton", lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    assert triton_usable(table, roots)
    tokens = draft_tokens(table, roots, tree, base)
    assert calls == [1] and torch.equal(tokens, _reference(table, roots, tree, base))
