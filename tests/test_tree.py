import json

import pytest
import torch

from vllm_recycling.tree import MAX_DEPTH, TreeTemplateError, compile_tree, load_tree, shipped_trees


def test_shipped_templates_compile():
    assert set(shipped_trees()) == {"2.2.2", "chain6", "tree16", "tree32"}
    sizes = {name: load_tree(name, topk=8) for name in shipped_trees()}
    assert sizes["2.2.2"].num_nodes == 80 and sizes["2.2.2"].max_depth == 6
    assert sizes["chain6"].num_nodes == 6 and sizes["chain6"].max_depth == 6
    assert sizes["tree16"].num_nodes == 16 and sizes["tree32"].num_nodes == 32
    assert sizes["2.2.2"].level_starts == (0, 1, 9, 30, 55, 70, 78, 81)


def test_small_tree_tensors_exact():
    # Given depth-first; compiled breadth-first: [0], [1], [0,0], [0,1], [0,0,0]
    t = compile_tree([[0], [0, 0], [0, 0, 0], [0, 1], [1]], topk=2)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert t.parent.tolist() == [-1, 0, 0, 1, 1, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert t.level_starts == (0, 1, 3, 5, 6)
    assert t.ancestors.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert t.rank_path.tolist() == [
        [-1, -1, -1], [0, -1, -1], [1, -1, -1], [0, 0, -1], [0, 1, -1], [0, 0, 0],
    ]


def test_one_node_template():
    t = compile_tree([[0]], topk=1)
    assert t.num_nodes == 1 and t.max_depth == 1
    assert t.parent.tolist() == [-1, 0] and t.level_starts == (0, 1, 2)


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "non-empty list of paths"),
        ([[0], []], "node 1 []: a path must be a non-empty list"),
        ([[0], [0, "1"]], "node 1 [0, '1']: a path must be"),
        ([[0], [2]], "node 1 [2]: rank 2 outside 0..1"),
        ([[0], [-1]], "node 1 [-1]: rank -1 outside"),
        ([[0], [1], [0]], "node 2 [0]: duplicate of node 0"),
        ([[0, 0], [0]], "node 0 [0, 0]: its parent [0] is not listed before it"),
        ([[1], [0, 0]], "node 1 [0, 0]: its parent [0] is not listed"),
        ([[0] * d for d in range(1, MAX_DEPTH + 2)], f"depth {MAX_DEPTH + 1} exceeds the limit"),
    ],
)
def test_bad_templates_name_the_node(paths, message):
    with pytest.raises(TreeTemplateError, match=message.replace("[", r"\[").replace("]", r"\]")):
        compile_tree(paths, topk=2, name="t")


def test_rank_checked_against_topk():
    load_tree("2.2.2", topk=8)
    with pytest.raises(TreeTemplateError, match=r"rank 4 outside 0..3 \(topk=4\)"):
        load_tree("2.2.2", topk=4)


def test_load_from_file_and_inline(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"name": "mine", "paths": [[0], [0, 0]]}))
    assert load_tree(str(f), topk=1).name == "mine"
    g = tmp_path / "plain.json"
    g.write_text("[[0], [1]]")
    assert load_tree(g, topk=2).paths == ((0,), (1,))
    assert load_tree([[0], [1]], topk=2).name == "inline"
    with pytest.raises(TreeTemplateError, match="neither a shipped template"):
        load_tree("no-such-tree", topk=8)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TreeTemplateError, match="bad.json"):
        load_tree(bad, topk=8)


def test_to_device_keeps_everything():
    t = load_tree("tree16", topk=8)
    u = t.to("cpu")
    assert u.paths == t.paths and torch.equal(u.ancestors, t.ancestors)


def test_hybrid_tree_puts_the_context_chain_first_in_each_level():
    """The context branch: a chain under the root, its node first in every level it reaches;
    the matrix template's nodes keep their order and ranks, mapped by ``matrix_nodes``."""
    from vllm_recycling.tree import hybrid_tree

    matrix = compile_tree([[0], [1], [0, 0]], topk=2)
    hybrid = hybrid_tree(matrix, 3, topk=2)
    tree = hybrid.tree
    assert tree.num_nodes == 6 and tree.level_starts == (0, 1, 4, 6, 7)
    assert hybrid.context_nodes.tolist() == [1, 4, 6]  # first in levels 1, 2, 3
    assert tree.parent[hybrid.context_nodes].tolist() == [0, 1, 4]
    assert hybrid.matrix_nodes.tolist() == [0, 2, 3, 5]
    assert [tree.paths[i - 1] for i in hybrid.matrix_nodes[1:].tolist()] == list(matrix.paths)
    assert tree.rank[hybrid.context_nodes].tolist() == [2, 0, 0]  # rank topk: no matrix rank
    assert hybrid_tree(matrix, 0, topk=2).tree is matrix
