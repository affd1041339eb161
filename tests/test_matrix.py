import pytest
import torch

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
    base = m.row_base(["b", "a"])
    assert base.tolist() == [3, 0]
    m.update(torch.tensor([[2], [2]]), torch.eye(3)[[0, 1]], base)
    assert m.view("b")[:, 0].tolist() == [0, 0, 0]
    assert m.view("a")[:, 0].tolist() == [0, 0, 1]
    assert m.table[:, 0].tolist() == [0, 0, 1, 0, 0, 0]


def test_update_empty_batch():
    m = AdjacencyMatrix(3, 2)
    argmax = m.update(torch.empty(0, 5, dtype=torch.int64), torch.empty(0, 3))
    assert argmax.shape == (0,) and m.table.eq(0).all()


def test_per_request_pool_reset_and_exhaustion():
    init = torch.tensor([[1], [2], [0]], dtype=torch.int32)
    m = AdjacencyMatrix(3, 1, scope="per_request", max_requests=1, initial=init)
    m.allocate("a")
    m.view("a")[:] = 2
    with pytest.raises(MatrixPoolExhausted, match="all 1 per-request matrices are in use"):
        m.allocate("b")
    m.free("a")
    m.free("a")  # idempotent
    m.allocate("b")
    assert m.view("b")[:, 0].tolist() == [1, 2, 0]  # reset to the initial matrix


def test_shared_scope_never_resets():
    m = AdjacencyMatrix(3, 1)
    m.allocate("a")
    m.table[0] = 2
    m.free("a")
    m.allocate("b")
    assert m.table[0].tolist() == [2] and m.row_base(["b"]) is None


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
