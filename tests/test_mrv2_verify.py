"""``mrv2.verify.accept_chain``: each request's drafts accepted while each is the token its
predecessor row sampled, on the device, in the layout vLLM 0.34's rejection sampler returns."""

import torch

from vllm_recycling.mrv2.verify import accept_chain


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


def test_it_reads_nothing_back_from_the_device(monkeypatch):
    """The CPU stand-in of a GPU sync check: no call that copies a tensor to the host."""
    draft = torch.tensor([5, 7, 9, 3])
    rows = torch.tensor([7, 9, 2, 11])
    cu, local = torch.tensor([0, 3, 4]), torch.tensor([0, 1, 2, 0])

    def refuse(*args, **kwargs):
        raise AssertionError("read back to the host")

    with monkeypatch.context() as patched:
        for name in ("tolist", "item", "cpu", "numpy", "__bool__"):
            patched.setattr(torch.Tensor, name, refuse)
        sampled, num_sampled = accept_chain(rows, draft, cu, local, 2)
    assert num_sampled.tolist() == [3, 1]
