import torch
from proposers import matrix_rows

from vllm_recycling.kernels.draft_tree import draft_tree as draft_tokens
from vllm_recycling.matrix import AdjacencyMatrix
from vllm_recycling.tree import compile_tree, load_tree


def _matrix(vocab: int, k: int) -> AdjacencyMatrix:
    m = AdjacencyMatrix(vocab, k)
    # row t = [(t*k + r) % V for r in range(k)]: every entry predictable
    m.table.copy_((torch.arange(vocab * k, dtype=torch.int32) % vocab).view(vocab, k))
    return m


def test_draft_exact_values():
    tree = compile_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]], topk=2)
    m = _matrix(10, 2)
    tokens = draft_tokens(m.table, torch.tensor([3, 9]), tree)
    # root 3: row 3 = [6, 7]; row 6 = [2, 3]; row 2 = [4, 5]
    # root 9: row 9 = [8, 9]; row 8 = [6, 7]; row 6 = [2, 3]
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == [[3, 6, 7, 2, 3, 4], [9, 8, 9, 6, 7, 2]]


def test_draft_empty_batch_and_k1_and_last_token():
    tree = load_tree("chain6", topk=1)
    m = AdjacencyMatrix(5, 1)
    assert draft_tokens(m.table, torch.empty(0, dtype=torch.int64), tree).shape == (0, 7)
    m.table[:, 0] = torch.tensor([1, 2, 3, 4, 4], dtype=torch.int32)  # 4 = V-1 points to itself
    assert draft_tokens(m.table, torch.tensor([4, 2]), tree).tolist() == [[4] * 7, [2, 3, 4, 4, 4, 4, 4]]


def test_draft_per_request_rows():
    tree = compile_tree([[0], [0, 0]], topk=1)
    m = AdjacencyMatrix(4, 1, scope="per_request", max_requests=2)
    m.allocate("a"), m.allocate("b")
    matrix_rows(m, "a")[:, 0] = torch.tensor([1, 2, 3, 0], dtype=torch.int32)
    matrix_rows(m, "b")[:, 0] = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    tokens = m.draft(torch.tensor([0, 0]), tree, m.slots(["a", "b"]))
    assert tokens.tolist() == [[0, 1, 2], [0, 3, 2]]


def test_draft_of_cold_matrix_is_token_zero():
    tree = load_tree("2.2.2", topk=8)
    m = AdjacencyMatrix(49152, 8)
    tokens = draft_tokens(m.table, torch.tensor([49151]), tree)
    assert tokens[0, 0] == 49151 and tokens[0, 1:].eq(0).all()
