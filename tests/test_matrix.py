import pytest
import torch
from proposers import matrix_rows

from vllm_recycling.matrix import (
    AdjacencyMatrix,
    MatrixPoolExhausted,
    SnapshotError,
    load_snapshot,
)


def test_initial_content_is_zero_and_sizes():
    m = AdjacencyMatrix(49152, 8)
    # 49152 * 8 * 4 bytes = 1.5 MiB: under the paper's 2 MB
    assert m.table.shape == (49152, 8) and m.table.dtype == torch.int32
    assert m.table.eq(0).all()


def test_update_topk_rows_and_argmax():
    m = AdjacencyMatrix(6, 2)
    logits = torch.tensor([
        [0.0, 5.0, 1.0, 4.0, 0.0, 0.0],  # node token 2 -> [1, 3]
        [9.0, 0.0, 0.0, 0.0, 0.0, 8.0],  # node token 5 (V-1) -> [0, 5]
    ])
    argmax = m.update(torch.tensor([[2, 5]]), logits)
    assert argmax.tolist() == [1, 0]
    assert m.table.tolist() == [[0, 0], [0, 0], [1, 3], [0, 0], [0, 0], [0, 5]]


def test_update_ties_lower_id_first():
    m = AdjacencyMatrix(5, 3)
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0]])
    argmax = m.update(torch.tensor([[0]]), logits)
    assert argmax.tolist() == [1]
    assert m.table[0].tolist() == [1, 2, 4]
    m.update(torch.tensor([[1]]), torch.zeros(1, 5, dtype=torch.bfloat16))
    assert m.table[1].tolist() == [0, 1, 2]


def test_update_duplicates_last_in_order_wins():
    m = AdjacencyMatrix(4, 1)
    eye = torch.eye(4)
    # two requests; token 1 appears at request 0 nodes 0 and 2 and at request 1 node 1
    tokens = torch.tensor([[1, 2, 1], [3, 1, 0]])
    logits = eye[[0, 1, 2, 3, 3, 2]]
    m.update(tokens, logits)
    # token 1: last occurrence is request 1 node 1 -> row 3 of logits... = eye[3] -> 3
    assert m.table[:, 0].tolist() == [2, 3, 1, 3]


def test_update_k1_and_per_request_rows():
    m = AdjacencyMatrix(3, 1, scope="per_request", max_requests=2)
    assert m.allocate("a") == 0 and m.allocate("b") == 1 and m.allocate("a") == 0
    slots = m.slots(["b", "a"])
    assert slots.tolist() == [1, 0] and m.lookup(slots)[0].tolist() == [3, 0]
    m.update(torch.tensor([[2], [2]]), torch.eye(3)[[0, 1]], slots)
    assert matrix_rows(m, "b")[:, 0].tolist() == [0, 0, 0]
    assert matrix_rows(m, "a")[:, 0].tolist() == [0, 0, 1]
    assert m.table[:, 0].tolist() == [0, 0, 1, 0, 0, 0]


def test_update_empty_batch():
    m = AdjacencyMatrix(3, 2)
    argmax = m.update(torch.empty(0, 5, dtype=torch.int64), torch.empty(0, 3))
    assert argmax.shape == (0,) and m.table.eq(0).all()


def test_per_request_pool_reset_and_exhaustion():
    init = torch.tensor([[1], [2], [0]], dtype=torch.int32)
    m = AdjacencyMatrix(3, 1, scope="per_request", max_requests=1, prior=(init, torch.zeros(3, 1)))
    m.allocate("a")
    matrix_rows(m, "a")[:] = 2
    with pytest.raises(MatrixPoolExhausted, match="all 1 per-request matrices are in use"):
        m.allocate("b")
    m.free("a")
    m.free("a")  # idempotent
    m.allocate("b")
    assert matrix_rows(m, "b")[:, 0].tolist() == [1, 2, 0]  # reset to the prior


def test_shared_scope_never_resets():
    m = AdjacencyMatrix(3, 1)
    m.allocate("a")
    m.table[0] = 2
    m.free("a")
    m.allocate("b")
    assert m.table[0].tolist() == [2] and m.slots(["b"]) is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="matrix scope 'global'"):
        AdjacencyMatrix(4, 2, scope="global")
    with pytest.raises(ValueError, match="1 <= topk <= vocab_size"):
        AdjacencyMatrix(4, 5)


def test_snapshot_round_trip(tmp_path):
    m = AdjacencyMatrix(7, 2)
    m.table.copy_(torch.arange(14, dtype=torch.int32).view(7, 2) % 7)
    path = tmp_path / "sub" / "adj.safetensors"
    m.save(path)
    table = load_snapshot(path, 7, 2)
    assert torch.equal(table, m.table)
    warm = AdjacencyMatrix(7, 2, initial=table)
    assert torch.equal(warm.table, m.table)
    assert [p.name for p in path.parent.iterdir()] == ["adj.safetensors"]  # no temp file left


def test_snapshot_keeps_the_rows_confidences(tmp_path):
    """budget "auto": the snapshot (format 2) holds each row's confidences beside the table,
    and a matrix started from it reads them back (the prior's negated ones included); saved
    without confidences (budget "fixed") it holds the table alone."""
    m = AdjacencyMatrix(7, 2, with_probs=True)
    m.update(torch.tensor([[3, 5]]), _rows(7, [4, 1]))
    m.probs[6] = torch.tensor([-0.5, -0.25], dtype=torch.float16)  # a prior row
    path = tmp_path / "adj.safetensors"
    m.save(path)
    table, probs = load_snapshot(path, 7, 2, with_probs=True)
    assert torch.equal(table, m.table) and torch.equal(probs, m.probs)
    assert probs[3].tolist()[0] > 0.9 and probs[0].tolist() == [0, 0]
    warm = AdjacencyMatrix(7, 2, initial=table, initial_probs=probs, with_probs=True)
    assert torch.equal(warm.probs, m.probs)
    AdjacencyMatrix(7, 2).save(path)
    assert load_snapshot(path, 7, 2, with_probs=True)[1] is None


def test_a_version_1_snapshot_still_loads(tmp_path):
    """Format 1 held the table only: its rows equal to the prior's take the prior's (negated)
    confidences, the others none."""
    from safetensors.torch import save_file

    prior_table = torch.tensor([[1, 2]] * 7, dtype=torch.int32)
    prior_probs = torch.full((7, 2), 0.25, dtype=torch.float16)
    saved = prior_table.clone()
    saved[3] = torch.tensor([4, 0])  # a row verification wrote
    path = tmp_path / "adj.safetensors"
    meta = {"format": "vllm-recycling-adjacency", "version": "1", "vocab_size": "7", "topk": "2"}
    save_file({"adjacency": saved}, str(path), metadata=meta)
    table, probs = load_snapshot(path, 7, 2, with_probs=True)
    assert torch.equal(table, saved) and probs is None
    m = AdjacencyMatrix(7, 2, initial=table, initial_probs=probs, with_probs=True,
                        prior=(prior_table, prior_probs))
    assert torch.equal(m.table, saved)
    assert m.probs[3].tolist() == [0, 0]
    assert m.probs[[0, 1, 2, 4, 5, 6]].eq(-0.25).all()


def test_snapshot_errors(tmp_path):
    m = AdjacencyMatrix(7, 2)
    path = tmp_path / "adj.safetensors"
    m.save(path)
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(tmp_path / "missing.safetensors", 7, 2)
    with pytest.raises(SnapshotError, match="made for vocab_size=7, topk=2; this model needs vocab_size=8"):
        load_snapshot(path, 8, 2)
    with pytest.raises(SnapshotError, match="made for vocab_size=7, topk=2; .* topk=4"):
        load_snapshot(path, 7, 4)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(SnapshotError, match="unreadable"):
        load_snapshot(corrupt, 7, 2)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(SnapshotError, match="garbage.safetensors"):
        load_snapshot(garbage, 7, 2)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(7, 2, dtype=torch.int32)}, str(other))
    with pytest.raises(SnapshotError, match="not a vllm-recycling snapshot"):
        load_snapshot(other, 7, 2)
    forged = tmp_path / "forged.safetensors"
    meta = {"format": "vllm-recycling-adjacency", "version": "1", "vocab_size": "7", "topk": "2"}
    save_file({"adjacency": torch.full((7, 2), 9, dtype=torch.int32)}, str(forged), metadata=meta)
    with pytest.raises(SnapshotError, match=r"token ids outside 0..6"):
        load_snapshot(forged, 7, 2)
    with pytest.raises(SnapshotError, match="per_request"):
        AdjacencyMatrix(7, 2, scope="per_request").save(tmp_path / "x.safetensors")
    meta["version"] = "3"
    save_file({"adjacency": torch.zeros(7, 2, dtype=torch.int32)}, str(forged), metadata=meta)
    with pytest.raises(SnapshotError, match="format version '3', expected one of '1', '2'"):
        load_snapshot(forged, 7, 2)
    meta["version"] = "2"
    bad = torch.full((7, 2), 1.5, dtype=torch.float16)
    save_file({"adjacency": torch.zeros(7, 2, dtype=torch.int32), "probs": bad}, str(forged), metadata=meta)
    assert load_snapshot(forged, 7, 2).eq(0).all()  # the table alone does not read them
    with pytest.raises(SnapshotError, match=r"confidences torch.float16 \(7, 2\), expected .* within \[-1, 1\]"):
        load_snapshot(forged, 7, 2, with_probs=True)


# -- overlay scope: the shared matrix read through each request's own recent rows --------------

def _rows(vocab: int, next_tokens: list[int]) -> torch.Tensor:
    """Logits rows whose top-2 is (next token, then token 0 or 1)."""
    logits = -torch.arange(vocab, dtype=torch.float32).repeat(len(next_tokens), 1)
    logits[range(len(next_tokens)), next_tokens] = 100.0
    return logits


def test_overlay_reads_own_rows_then_shared():
    """Two requests verify token 5 in one step (a: 5 -> 7, then b: 5 -> 9): the shared row gets
    the last (b's), each request's own entry its own, and a third request reads the shared row."""
    from vllm_recycling.tree import compile_tree

    m = AdjacencyMatrix(16, 2, scope="overlay", max_requests=3, overlay_rows=4)
    for r in ("a", "b", "c"):
        m.allocate(r)
    m.update(torch.tensor([[5], [5]]), _rows(16, [7, 9]), m.slots(["a", "b"]))
    assert m.table[5].tolist() == [9, 0]
    chain = compile_tree([[0]], topk=1)
    roots = torch.tensor([5, 5, 5])
    assert m.draft(roots, chain, m.slots(["a", "b", "c"]))[:, 1].tolist() == [7, 9, 9]
    assert m.draft(roots, chain)[:, 1].tolist() == [9, 9, 9]  # no slots: the shared matrix


def test_overlay_collision_latest_wins_and_falls_back():
    """Entries are token % overlay_rows: token 9 evicts token 5 (both entry 1) from a's rows,
    so a reads token 5 from the shared matrix again. In one step the last row wins."""
    m = AdjacencyMatrix(16, 1, scope="overlay", max_requests=1, overlay_rows=4)
    m.allocate("a")
    slot = m.slots(["a"])
    m.update(torch.tensor([[5, 5]]), _rows(16, [7, 8]), slot)  # a's 5 -> 8 (the later row)
    assert m.keys[:4].tolist() == [-1, 5, -1, -1] and m.table[16 + 1, 0] == 8
    m.table[5, 0] = 3  # another request's write to the shared row
    m.update(torch.tensor([[9]]), _rows(16, [2]), slot)
    assert m.keys[:4].tolist() == [-1, 9, -1, -1]
    row_base, overlay = m.lookup(slot)
    from vllm_recycling.kernels.draft_tree import _overlay_rows

    assert row_base is None
    assert _overlay_rows(overlay, torch.tensor([[5, 9]]), torch.tensor([[5, 9]])).tolist() == [[5, 17]]


def test_overlay_slots_reset_and_memory():
    m = AdjacencyMatrix(16, 8, scope="overlay", max_requests=2, overlay_rows=16)
    assert m.table.shape == (16 + 2 * 16 + 1, 8) and m.keys.shape == (2 * 16 + 1,)
    m.allocate("a")
    m.update(torch.tensor([[3]]), _rows(16, [4]), m.slots(["a"]))
    assert (m.keys >= 0).sum() == 1
    m.free("a")
    m.allocate("b")  # gets a's slot back, with every entry empty
    assert m.slots(["b"]).tolist() == [0] and (m.keys >= 0).sum() == 0
    assert m.table[3, 0] == 4  # the shared row stays
    with pytest.raises(ValueError, match="overlay_rows must be a power of two"):
        AdjacencyMatrix(16, 8, scope="overlay", overlay_rows=12)


def test_overlay_snapshot_holds_the_shared_rows(tmp_path):
    m = AdjacencyMatrix(16, 2, scope="overlay", max_requests=2, overlay_rows=4)
    m.allocate("a")
    m.update(torch.tensor([[5]]), _rows(16, [7]), m.slots(["a"]))
    m.save(tmp_path / "adj.safetensors")
    assert torch.equal(load_snapshot(tmp_path / "adj.safetensors", 16, 2), m.table[:16])


def test_probabilities_beside_the_ids_shared_and_overlay():
    """With probabilities, every written row also gets its successors' probabilities (the shared
    row and the request's own entry), and drafting returns each node's."""
    import math

    from vllm_recycling.tree import compile_tree

    m = AdjacencyMatrix(4, 2, scope="overlay", max_requests=2, overlay_rows=4, with_probs=True)
    assert m.probs.shape == m.table.shape and m.probs.dtype == torch.float16 and not m.probs.any()
    for r in ("a", "b"):
        m.allocate(r)
    # token 1 -> successors 3 (p 3/4), 0 (p 1/4) for a; token 1 -> 2 (p 1/2), 0 (1/4) for b
    la = torch.tensor([[0.0, -math.inf, -math.inf, math.log(3)]])
    lb = torch.tensor([[0.0, -math.inf, math.log(2), 0.0]])
    m.update(torch.tensor([[1], [1]]), torch.cat([la, lb]), m.slots(["a", "b"]))
    assert m.table[1].tolist() == [2, 0] and m.probs[1].tolist() == [0.5, 0.25]  # the last: b
    tree = compile_tree([[0], [1]], topk=2)
    tokens, conf = m.draft(torch.tensor([1, 1]), tree, m.slots(["a", "b"]), with_probs=True)
    assert tokens.tolist() == [[1, 3, 0], [1, 2, 0]]
    assert conf.tolist() == [[1.0, 0.75, 0.25], [1.0, 0.5, 0.25]]
    assert AdjacencyMatrix(4, 2).probs is None  # not kept unless asked


# -- salt scope: tenants keyed by cache_salt -----------------------------------------------------

def _salted(salt_matrices: int = 2, with_probs: bool = False, prior=None) -> AdjacencyMatrix:
    return AdjacencyMatrix(16, 2, scope="salt", max_requests=8, overlay_rows=4,
                           salt_matrices=salt_matrices, with_probs=with_probs, prior=prior)


def test_salt_scope_layout_and_matrices():
    m = _salted(with_probs=True)
    assert m.table.shape == (16 * 3 + 8 * 4 + 1, 2) and m.probs.shape == m.table.shape
    assert m.keys.shape == (8 * 4 + 1,)
    m.allocate("x")  # no salt: the shared matrix
    m.allocate("a1", "A")
    m.allocate("b1", "B")
    m.allocate("a2", "A")
    assert [m.matrix_of(r) for r in ("x", "a1", "b1", "a2")] == [0, 1, 2, 1]
    assert m.slots(["b1", "x"]).tolist() == [[2, 2], [0, 0]]
    row_base, overlay = m.lookup(m.slots(["b1", "x"]))
    assert row_base.tolist() == [32, 0] and overlay.offset == 48 and overlay.key_base.tolist() == [8, 0]


def test_salts_never_read_each_others_rows_and_same_salt_shares():
    """a1 (salt A) learns 5 -> 7, b1 (salt B) 5 -> 9, x (no salt) 5 -> 11. A request drafts from
    its own rows first (the overlay), then its salt's matrix: a2, a new request of salt A, sees
    A's 7; b2 (salt B) B's 9; y (no salt) the shared 11; z (salt C, never written) the zeros."""
    from vllm_recycling.tree import compile_tree

    m = _salted(salt_matrices=3)
    for r, salt in (("a1", "A"), ("b1", "B"), ("x", None)):
        m.allocate(r, salt)
    m.update(torch.tensor([[5], [5], [5]]), _rows(16, [7, 9, 11]), m.slots(["a1", "b1", "x"]))
    for r, salt in (("a2", "A"), ("b2", "B"), ("y", None), ("z", "C")):
        m.allocate(r, salt)
    chain = compile_tree([[0]], topk=1)
    drafted = m.draft(torch.tensor([5] * 4), chain, m.slots(["a2", "b2", "y", "z"]))
    assert drafted[:, 1].tolist() == [7, 9, 11, 0]
    assert matrix_rows(m, "a2")[5].tolist() == [7, 0] and matrix_rows(m, "b2")[5].tolist() == [9, 0]
    assert m.table[5].tolist() == [11, 0] and matrix_rows(m, "z").eq(0).all()


def test_salt_eviction_least_recently_used_idle_starts_cold():
    m = _salted(salt_matrices=2)
    m.allocate("a1", "A")
    m.allocate("b1", "B")
    m.update(torch.tensor([[5], [5]]), _rows(16, [7, 9]), m.slots(["a1", "b1"]))
    m.free("a1")
    m.free("b1")
    m.allocate("b2", "B")  # B used last: A is the least recently used
    m.allocate("c1", "C")  # evicts A (idle), its matrix zeroed
    assert m.matrix_of("c1") == 1 and matrix_rows(m, "c1").eq(0).all()
    assert matrix_rows(m, "b2")[5].tolist() == [9, 0]
    m.free("c1")
    m.allocate("a3", "A")  # A comes back cold, in C's matrix (B is held by b2)
    assert m.matrix_of("a3") == 1 and matrix_rows(m, "a3").eq(0).all()


def test_salt_without_a_free_matrix_drafts_nothing_writes_nothing_then_gets_one():
    """Both matrices are held by live requests: d1 (salt D) gets NO_MATRIX; its verified rows
    go to the scratch row (no other tenant's matrix changes) and to its own overlay entries.
    Once a's request ends, the next allocate gives D a matrix (cold)."""
    from vllm_recycling.matrix import NO_MATRIX

    m = _salted(salt_matrices=2)
    m.allocate("a1", "A")
    m.allocate("b1", "B")
    m.allocate("d1", "D")
    assert m.matrix_of("d1") == NO_MATRIX
    before = m.table[: 16 * 3].clone()
    m.update(torch.tensor([[5]]), _rows(16, [7]), m.slots(["d1"]))
    assert torch.equal(m.table[: 16 * 3], before)
    assert m.table[-1].tolist() == [7, 0]  # the scratch row
    m.free("a1")
    m.allocate("d1")  # a step later: retried
    assert m.matrix_of("d1") == 1 and matrix_rows(m, "d1").eq(0).all()
    m.free("d1")
    m.free("b1")
    assert m._salt_users == [0, 0, 0]


def test_salt_scope_snapshot_holds_only_the_shared_rows(tmp_path):
    m = _salted()
    m.allocate("a1", "A")
    m.update(torch.tensor([[5]]), _rows(16, [7]), m.slots(["a1"]))
    m.save(tmp_path / "adj.safetensors")
    assert load_snapshot(tmp_path / "adj.safetensors", 16, 2).eq(0).all()
    with pytest.raises(ValueError, match="salt_matrices >= 1"):
        AdjacencyMatrix(16, 2, scope="salt", max_requests=1, salt_matrices=0)


def test_snapshot_survives_sigkill_during_a_save(tmp_path):
    """A process killed mid-save leaves the previous snapshot whole (saves write a temporary
    file and rename it over the snapshot); the half-written temporary is removed later."""
    from engines import kill_during_snapshot_save

    from vllm_recycling.matrix import remove_stale_temporaries

    path = tmp_path / "adj.safetensors"
    first, temporaries = kill_during_snapshot_save(path, 64, 4)
    assert len(temporaries) == 1 and temporaries[0].stat().st_size > 0
    assert torch.equal(load_snapshot(path, 64, 4), first)
    assert remove_stale_temporaries(path) == temporaries and not temporaries[0].exists()
    assert list(tmp_path.iterdir()) == [path]


def _prior(vocab: int = 16, k: int = 2):
    """A prior where token t's successors are t + 1 and t + 2 (mod vocab), probabilities 0.5, 0.25."""
    table = torch.stack([(torch.arange(vocab) + d) % vocab for d in (1, 2)], 1).int()[:, :k]
    probs = torch.tensor([0.5, 0.25])[:k].repeat(vocab, 1).half()
    return table, probs


def test_every_new_matrix_starts_from_the_prior():
    """Shared (without a snapshot), per-request and overlay matrices start from the prior, with
    its probabilities; a snapshot replaces it for the shared matrix only, in the rows it holds."""
    table, probs = _prior()
    shared = AdjacencyMatrix(16, 2, prior=(table, probs), with_probs=True)
    assert torch.equal(shared.table, table) and torch.equal(shared.probs, -probs)  # marked: the prior's
    pool = AdjacencyMatrix(16, 2, scope="per_request", max_requests=2, prior=(table, probs), with_probs=True)
    pool.allocate("a")
    matrix_rows(pool, "a")[:] = 3
    pool.free("a")
    pool.allocate("b")
    assert torch.equal(matrix_rows(pool, "b"), table) and torch.equal(pool.probs[:16], -probs)
    snapshot = torch.zeros((16, 2), dtype=torch.int32)
    snapshot[4] = torch.tensor([9, 8], dtype=torch.int32)  # the one row traffic wrote
    overlay = AdjacencyMatrix(16, 2, scope="overlay", max_requests=1, prior=(table, probs),
                              initial=snapshot, overlay_rows=16, with_probs=True)
    assert overlay.table[4].tolist() == [9, 8] and overlay.probs[4].eq(0).all()  # the snapshot's
    rest = torch.arange(16) != 4  # rows nothing wrote: the prior's (review B1)
    assert torch.equal(overlay.table[:16][rest], table[rest]) and torch.equal(overlay.probs[:16][rest], -probs[rest])


def test_a_new_salt_starts_from_the_prior_not_from_other_tenants():
    """The prior holds no tenant's data: a new salt's matrix is the prior, never the shared
    matrix or another salt's rows, and an evicted salt's matrix goes back to the prior."""
    table, probs = _prior()
    m = _salted(salt_matrices=2, prior=(table, probs), with_probs=True)
    m.allocate("a1", "A")
    m.allocate("x", None)
    m.update(torch.tensor([[5], [5]]), _rows(16, [9, 11]), m.slots(["a1", "x"]))
    assert matrix_rows(m, "a1")[5].tolist() == [9, 0] and m.table[5].tolist() == [11, 0]
    m.allocate("b1", "B")
    assert torch.equal(matrix_rows(m, "b1"), table)
    assert torch.equal(m.probs[2 * 16 : 3 * 16], -probs)
    m.free("a1")
    m.allocate("c1", "C")  # evicts A (idle): back to the prior
    assert m.matrix_of("c1") == 1 and torch.equal(matrix_rows(m, "c1"), table)
    assert torch.equal(m.probs[16:32], -probs)
