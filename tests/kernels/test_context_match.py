"""The context match (``kernels.context_match``): the C version against the numpy reference on
random histories, and exact values where the answer is known by hand."""

import numpy as np
import pytest

from vllm_recycling.kernels import native
from vllm_recycling.kernels.context_match import context_match, context_match_reference


def test_by_hand():
    history = np.zeros((3, 16), dtype=np.int32)
    history[0, :9] = [3, 9, 4, 7, 1, 3, 9, 4, 7]  # "3 9 4 7" repeats: 1 3 9 4 7 followed it
    history[1, :7] = [5, 1, 2, 5, 1, 2, 5]  # "5 1 2 5" twice overlapping: the most recent
    history[2, :3] = [5, 6, 8]  # nothing repeats
    tokens, match_len = context_match_reference(history, np.array([0, 1, 2]), np.array([9, 7, 3]), 1, 8, 6)
    assert match_len.tolist() == [4, 4, 0]
    assert tokens.tolist() == [[1, 3, 9, 4, 7, -1], [1, 2, 5, -1, -1, -1], [-1] * 6]
    capped, length = context_match_reference(history, np.array([0]), np.array([9]), 1, 2, 3)
    assert length.tolist() == [2] and capped.tolist() == [[1, 3, 9]]  # the longest within max_n
    none, _ = context_match_reference(history, np.array([1]), np.array([1]), 1, 8, 2)
    assert none.tolist() == [[-1, -1]]


@pytest.mark.skipif(not native.available(), reason="no C compiler")
@pytest.mark.parametrize("min_n,max_n,length", [(1, 3, 4), (2, 8, 8), (1, 1, 2), (3, 16, 5)])
def test_c_equals_the_reference(min_n, max_n, length):
    rng = np.random.default_rng(min_n * 100 + max_n)
    for _ in range(200):
        history = rng.integers(0, rng.integers(2, 6), (5, 64)).astype(np.int32)
        rows = rng.permutation(5)[:3]
        num_tokens = rng.integers(0, 65, 3)
        got = native.context_match(history, rows, num_tokens, min_n, max_n, length)
        want = context_match_reference(history, rows, num_tokens, min_n, max_n, length)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert context_match(history, rows, num_tokens, min_n, max_n, length)[1].shape == (3,)
