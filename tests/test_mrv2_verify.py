"""``mrv2.verify.accept_chain``: each request's drafts accepted while each is the token its
predecessor row sampled, on the device, in the layout vLLM 0.34's rejection sampler returns;
``accept_tree``: the same through a tree of the template's first nodes."""

import torch

from vllm_recycling.mrv2.verify import accept_chain, accept_tree


def test_drafts_are_accepted_while_each_is_its_predecessors_sample():
    # request 0: fed 5, drafts 7 9 4; rows sample 7 9 2 8: 7 and 9 accepted, 4 is not 2
    # request 1: fed 3 only (no drafts): its one sample
    # request 2: fed 6, drafts 1 1 1; rows sample 1 1 1 0: all three accepted, then the bonus
    # request 3: fed 2, drafts -1 -1 -1 (placeholders): none accepted
    draft = torch.tensor([5, 7, 9, 4, 3, 6, 1, 1, 1, 2, -1, -1, -1])
    sampled_rows = torch.tensor([7, 9, 2, 8, 11, 1, 1, 1, 0, 4, 4, 4, 4])
    cu = torch.tensor([0, 4, 5, 9, 13], dtype=torch.int32)
    local = torch.tensor([0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 2, 3], dtype=torch.int32)
    sampled, num_sampled = accept_chain(sampled_rows, draft, cu, local, 3)
    assert num_sampled.dtype == torch.int32 and sampled.dtype == torch.int64
    assert num_sampled.tolist() == [3, 1, 4, 1]
    assert sampled.tolist() == [[7, 9, 2, 8], [11, -1, -1, -1], [1, 1, 1, 0], [4, 4, 4, 4]]
    emitted = [row[:n] for row, n in zip(sampled.tolist(), num_sampled.tolist())]
    assert emitted == [[7, 9, 2], [11], [1, 1, 1, 0], [4]]


def test_an_empty_step():
    empty = torch.zeros(0, dtype=torch.int64)
    sampled, num_sampled = accept_chain(empty, empty, torch.zeros(1, dtype=torch.int32), empty, 3)
    assert sampled.shape == (0, 4) and num_sampled.shape == (0,)


def without_host_reads(monkeypatch, call):
    """``call()`` with every Tensor method that copies a value to the host refused: the CPU
    stand-in of a GPU sync check."""
    def refuse(*args, **kwargs):
        raise AssertionError("read back to the host")

    with monkeypatch.context() as patched:
        for name in ("tolist", "item", "cpu", "numpy", "__bool__"):
            patched.setattr(torch.Tensor, name, refuse)
        return call()


def test_it_reads_nothing_back_from_the_device(monkeypatch):
    draft = torch.tensor([5, 7, 9, 3])
    rows = torch.tensor([7, 9, 2, 11])
    cu, local = torch.tensor([0, 3, 4]), torch.tensor([0, 1, 2, 0])
    sampled, num_sampled = without_host_reads(monkeypatch, lambda: accept_chain(rows, draft, cu, local, 2))
    assert num_sampled.tolist() == [3, 1]


# A "2.2" template: root 0; children 1 (rank 0) and 2 (rank 1); 3, 4 under 1; 5, 6 under 2.
PARENT = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
DEPTH = torch.tensor([0, 1, 1, 2, 2, 2, 2])


def test_a_tree_is_walked_from_the_root_along_each_rows_sample():
    # request 0, 7 rows: root samples 8; nodes 1 (token 7) and 2 (token 8): 2 accepted; under 2,
    #   node 5 (token 4) and 6 (token 9), node 2 samples 9: node 6 accepted; node 6 samples 3 (bonus)
    # request 1, 3 rows (a prefix of the template): root samples 5, node 1 (5) accepted, node 2 (5)
    #   too but the lowest rank wins; node 1 samples 2 (bonus)
    # request 2, 1 row (no drafts); request 3: placeholders, never accepted
    draft = torch.tensor([1, 7, 8, 0, 0, 4, 9, 2, 5, 5, 6, 3, -1, -1])
    rows = torch.tensor([8, 1, 9, 0, 0, 0, 3, 5, 2, 6, 12, 4, 4, 4])
    cu = torch.tensor([0, 7, 10, 11, 14], dtype=torch.int32)
    local = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0, 1, 2], dtype=torch.int32)
    sampled, num_sampled, path = accept_tree(rows, draft, cu, local, PARENT, DEPTH, 2, 6)
    assert sampled.dtype == torch.int64 and num_sampled.dtype == torch.int32 and sampled.shape == (4, 7)
    assert num_sampled.tolist() == [3, 2, 1, 1]
    assert [row[:n] for row, n in zip(sampled.tolist(), num_sampled.tolist())] == [[8, 9, 3], [5, 2], [12], [4]]
    assert path.tolist() == [[2, 6], [1, -1], [-1, -1], [-1, -1]]


def test_on_a_chain_template_it_is_accept_chain():
    gen = torch.Generator().manual_seed(0)
    k = 4
    parent, depth = torch.arange(-1, k), torch.arange(k + 1)
    counts = torch.tensor([5, 1, 3, 5, 5, 2])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    local = torch.cat([torch.arange(n) for n in counts.tolist()])
    for _ in range(20):
        rows = torch.randint(0, 3, (int(cu[-1]),), generator=gen)
        draft = torch.randint(-1, 3, (int(cu[-1]),), generator=gen)
        want = accept_chain(rows, draft, cu, local, k)
        got = accept_tree(rows, draft, cu, local, parent, depth, k, k)
        assert torch.equal(got[1], want[1])  # then the tokens vLLM reads, the first num_sampled
        assert [r[:n] for r, n in zip(got[0].tolist(), got[1].tolist())] == [
            r[:n] for r, n in zip(want[0].tolist(), want[1].tolist())]


def test_a_tree_reads_nothing_back_from_the_device(monkeypatch):
    draft = torch.tensor([1, 7, 8, 3])
    rows = torch.tensor([8, 1, 9, 5])
    cu, local = torch.tensor([0, 3, 4]), torch.tensor([0, 1, 2, 0])
    sampled, num_sampled, path = without_host_reads(
        monkeypatch, lambda: accept_tree(rows, draft, cu, local, PARENT, DEPTH, 2, 6))
    assert num_sampled.tolist() == [2, 1] and path.tolist() == [[2, -1], [-1, -1]]


def test_the_paths_rows_go_where_vllm_scores_the_emitted_tokens(monkeypatch):
    """vLLM scores ``sampled[b, i]`` with row ``start_b + i``: request 0 (rows 0-5, the "2.2"
    template above) accepted local nodes 2 then 5, so rows 1 and 2 take rows 2 and 5; request 1 (rows 6-7) accepted
    nothing; request 2 (rows 8-10) accepted local 1: row 9 is its own. Reading rows first and
    writing after moves them all as one."""
    from vllm_recycling.mrv2.verify import emitted_rows

    cu = torch.tensor([0, 6, 8, 11], dtype=torch.int32)
    path = torch.tensor([[2, 5], [-1, -1], [1, -1]])
    dst, src = without_host_reads(monkeypatch, lambda: emitted_rows(cu, path))
    logits = torch.arange(11.0)[:, None].repeat(1, 3)
    logits[dst] = logits[src]
    assert logits[:, 0].tolist() == [0, 2, 5, 3, 4, 5, 6, 7, 8, 9, 10]
