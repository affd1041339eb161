"""RecyclingConfig: what a user may write in speculative_config for method "recycling", and the
exact message for everything else."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vllm_recycling.config import RecyclingConfig, RecyclingConfigError
from vllm_recycling.matrix import AdjacencyMatrix


def parse(**keys) -> RecyclingConfig:
    return RecyclingConfig.from_dict({"method": "recycling", **keys})


def refused(message: str, **keys) -> None:
    with pytest.raises(RecyclingConfigError, match=f"^{re.escape(message)}$"):
        parse(**keys)


def test_defaults():
    config = parse()
    assert config == RecyclingConfig(
        tree=None, topk=8, matrix_scope="overlay", overlay_rows=4096, salt_matrices=16,
        matrix_snapshot=None, matrix_snapshot_interval=300.0, verify=None,
        num_speculative_tokens=80, budget="auto", matrix_init="model", context_match=True,
    )
    assert config.drafts_trees and config.max_drafts == 96  # trees, with the context branch
    # where trees cannot be verified, an unset verify becomes the chain (support.py decides)
    fallback = config.as_chain()
    assert fallback.verify == "chain" and fallback.max_drafts == 6 and not fallback.drafts_trees
    assert parse(tree="2.2.2").as_chain().draft_template().num_nodes == 6
    assert config.tree_template().name == "2.2.2" and config.tree_template().num_nodes == 80
    assert config.draft_template().name == "2.2.2" and config.draft_template().num_nodes == 80
    assert config.initial_matrix(vocab_size=100) is None
    chain = parse(verify="chain")
    assert chain.num_speculative_tokens == 6
    assert chain.draft_template().paths == (
        (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0)
    )


def test_every_field_accepted():
    config = parse(
        tree=[[0], [1], [0, 0]], topk=2, matrix_scope="per_request", verify="chain",
        num_speculative_tokens=3,
    )
    assert config.tree == ((0,), (1,), (0, 0))
    assert config.tree_template().num_nodes == 3
    assert config.draft_template().paths == ((0,), (0, 0), (0, 0, 0))
    assert parse(tree="tree16").tree_template().num_nodes == 16
    assert parse(tree="tree16").num_speculative_tokens == 16
    assert parse(topk=1, verify="chain").topk == 1 and parse(topk=64).topk == 64
    assert parse(verify="chain", num_speculative_tokens=16).draft_template().num_nodes == 16
    assert parse(matrix_snapshot_interval=0).matrix_snapshot_interval == 0


def test_a_smaller_tree_is_the_first_nodes_breadth_first():
    config = parse(num_speculative_tokens=5)
    assert config.draft_template().paths == config.tree_template().paths[:5]
    assert config.draft_template().name == "2.2.2[:5]"
    assert parse(tree=[[0], [1], [0, 0]], topk=2).num_speculative_tokens == 3


@pytest.mark.parametrize("value", [0, 65, -1, True, "8", 8.0, None])
def test_topk(value):
    refused(f'speculative_config["topk"] = {value!r} is not valid: expected an integer from 1 to 64',
            topk=value)


def test_topk_larger_than_the_vocabulary():
    with pytest.raises(RecyclingConfigError, match=re.escape(
        'speculative_config["topk"] = 8 is not valid: at most the model\'s vocabulary size 4'
    )):
        parse().initial_matrix(vocab_size=4)


@pytest.mark.parametrize("value", ["global", "", None, "Shared"])
def test_matrix_scope(value):
    refused(
        f'speculative_config["matrix_scope"] = {value!r} is not valid: '
        "expected one of 'shared', 'per_request', 'overlay', 'salt'",
        matrix_scope=value,
    )


@pytest.mark.parametrize("value", [0, -1, 4097, 2.0, True, "8", None])
def test_salt_matrices(value):
    refused(
        f'speculative_config["salt_matrices"] = {value!r} is not valid: '
        "expected an integer from 1 to 4096",
        matrix_scope="salt", salt_matrices=value,
    )
    assert parse(matrix_scope="salt", salt_matrices=4096).salt_matrices == 4096


def test_salt_matrices_need_the_salt_scope():
    refused(
        'speculative_config["salt_matrices"] = 4 is not valid: it only applies to matrix_scope '
        "'salt', not 'overlay'",
        salt_matrices=4,
    )


@pytest.mark.parametrize("value", [0, 8, 100, 131072, 64.0, True, "512"])
def test_overlay_rows(value):
    refused(
        f'speculative_config["overlay_rows"] = {value!r} is not valid: '
        "expected a power of two from 16 to 65536",
        overlay_rows=value,
    )
    assert parse(matrix_scope="overlay", overlay_rows=16).overlay_rows == 16


@pytest.mark.parametrize("value", ["adaptive", "", None, "AUTO", 1])
def test_budget(value):
    refused(
        f'speculative_config["budget"] = {value!r} is not valid: expected one of \'auto\', \'fixed\'',
        budget=value,
    )
    assert parse(budget="fixed").budget == "fixed"


@pytest.mark.parametrize("value", ["prior", "", None, "Model", 0])
def test_matrix_init(value):
    refused(
        f'speculative_config["matrix_init"] = {value!r} is not valid: expected one of \'model\', \'empty\'',
        matrix_init=value,
    )
    assert parse(matrix_init="empty").matrix_init == "empty"


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "true"])
def test_context_match(value):
    refused(f'speculative_config["context_match"] = {value!r} is not valid: expected true or false',
            context_match=value)
    assert parse(context_match=False).context_match is False


@pytest.mark.parametrize("value", ["beam", "", "CHAIN", 1])
def test_verify(value):
    refused(
        f'speculative_config["verify"] = {value!r} is not valid: expected one of \'chain\', \'tree\'',
        verify=value,
    )
    assert parse(verify=None) == parse()  # JSON null: unset


@pytest.mark.parametrize("value", [0, 17, -3, True, "6", 6.5])
def test_num_speculative_tokens_chain(value):
    refused(
        f'speculative_config["num_speculative_tokens"] = {value!r} is not valid: '
        "expected an integer from 1 to 16 (the chain length)",
        num_speculative_tokens=value, verify="chain",
    )


@pytest.mark.parametrize("value", [0, 81, True, 6.5])
def test_num_speculative_tokens_tree(value):
    refused(
        f'speculative_config["num_speculative_tokens"] = {value!r} is not valid: '
        "expected an integer from 1 to 80 (the nodes of tree '2.2.2')",
        num_speculative_tokens=value,
    )


@pytest.mark.parametrize("value", [-1, True, "60", float("inf"), float("nan"), None])
def test_matrix_snapshot_interval(value):
    refused(
        f'speculative_config["matrix_snapshot_interval"] = {value!r} is not valid: '
        "expected a number of seconds >= 0",
        matrix_snapshot_interval=value,
    )


@pytest.mark.parametrize(
    "tree, topk, message",
    [
        ([[0], [0, 9]], 8, "tree 'inline' node 1 [0, 9]: rank 9 outside 0..7 (topk=8)"),
        ([[0], [1, 0]], 8, "tree 'inline' node 1 [1, 0]: its parent [1] is not listed before it"),
        ([[0], [0]], 8, "tree 'inline' node 1 [0]: duplicate of node 0"),
        ([[0], []], 8, "tree 'inline' node 1 []: a path must be a non-empty list of integer ranks"),
        ([], 8, "tree 'inline': expected a non-empty list of paths, got []"),
        ("2.2.2", 4, "tree '2.2.2' node 4 [4]: rank 4 outside 0..3 (topk=4)"),
    ],
)
def test_bad_tree_names_the_node(tree, topk, message):
    refused(f'speculative_config["tree"]: {message}', tree=tree, topk=topk)


def test_unknown_tree_name():
    with pytest.raises(RecyclingConfigError, match=re.escape(
        "speculative_config[\"tree\"]: tree 'nope' is neither a shipped template (2.2.2, chain6, "
    )):
        parse(tree="nope")


def test_tree_type():
    refused(
        'speculative_config["tree"] = 5 is not valid: expected a shipped template name, a JSON '
        "file path, or a list of paths",
        tree=5,
    )


def test_tree_from_a_file(tmp_path):
    good = tmp_path / "mine.json"
    good.write_text(json.dumps({"name": "mine", "paths": [[0], [1], [0, 0]]}))
    config = parse(tree=str(good))
    assert config.tree == str(good) and config.tree_template().name == "mine"
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [0, 0")
    with pytest.raises(RecyclingConfigError, match=re.escape(f'speculative_config["tree"]: tree file {bad}: ')):
        parse(tree=str(bad))


def test_unknown_key():
    refused(
        "speculative_config has unknown key(s) 'draft_model', 'top_k' for method 'recycling'; "
        "allowed keys: method, tree, topk, matrix_scope, overlay_rows, salt_matrices, matrix_snapshot, "
        "matrix_snapshot_interval, verify, num_speculative_tokens, budget, matrix_init, context_match",
        top_k=8, draft_model="x",
    )


def test_method_must_be_recycling():
    with pytest.raises(RecyclingConfigError, match=re.escape(
        'speculative_config["method"] = \'ngram\' is not valid: expected \'recycling\' for this parser'
    )):
        RecyclingConfig.from_dict({"method": "ngram"})


# -- snapshots ---------------------------------------------------------------------------------

def _snapshot(path, vocab_size=100, topk=8):
    matrix = AdjacencyMatrix(vocab_size, topk=topk)
    matrix.table[:, 0] = torch.arange(vocab_size, dtype=torch.int32).flip(0)
    matrix.save(path)
    return matrix.table.clone()


def test_snapshot_loaded(tmp_path):
    path = tmp_path / "adj.safetensors"
    table = _snapshot(path)
    loaded = parse(matrix_snapshot=str(path)).initial_matrix(vocab_size=100)
    assert torch.equal(loaded, table)


def test_snapshot_not_there_yet_starts_cold(tmp_path):
    """The first run creates the file (saves at intervals and at shutdown); its folder must
    exist, and only the shared matrix has a snapshot."""
    path = tmp_path / "absent.safetensors"
    assert parse(matrix_snapshot=str(path)).initial_matrix(vocab_size=100) is None
    folder = tmp_path / "nope"
    refused(
        f'speculative_config["matrix_snapshot"] = {str(folder / "adj.safetensors")!r} is not '
        f"valid: its folder {folder} does not exist",
        matrix_snapshot=str(folder / "adj.safetensors"),
    )
    refused(
        f'speculative_config["matrix_snapshot"] = {str(path)!r} is not valid: a snapshot holds '
        "the shared matrix; it needs matrix_scope 'shared', 'overlay' or 'salt'",
        matrix_snapshot=str(path), matrix_scope="per_request",
    )


def test_snapshot_corrupt(tmp_path):
    path = tmp_path / "adj.safetensors"
    _snapshot(path)
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    with pytest.raises(RecyclingConfigError, match=re.escape(
        f'speculative_config["matrix_snapshot"]: matrix snapshot {path}: unreadable (')):
        parse(matrix_snapshot=str(path)).initial_matrix(vocab_size=100)
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(RecyclingConfigError, match=re.escape(
        f'speculative_config["matrix_snapshot"]: matrix snapshot {path}: unreadable (')):
        parse(matrix_snapshot=str(path)).initial_matrix(vocab_size=100)


def test_snapshot_for_another_vocabulary_or_topk(tmp_path):
    path = tmp_path / "adj.safetensors"
    _snapshot(path, vocab_size=100, topk=8)
    refused_vocab = (
        f'speculative_config["matrix_snapshot"]: matrix snapshot {path}: made for vocab_size=100, '
        "topk=8; this model needs vocab_size=200, topk=8"
    )
    with pytest.raises(RecyclingConfigError, match=f"^{re.escape(refused_vocab)}$"):
        parse(matrix_snapshot=str(path)).initial_matrix(vocab_size=200)
    with pytest.raises(RecyclingConfigError, match=re.escape("this model needs vocab_size=100, topk=4")):
        parse(matrix_snapshot=str(path), topk=4, verify="chain").initial_matrix(vocab_size=100)


def test_snapshot_type():
    refused('speculative_config["matrix_snapshot"] = 3 is not valid: expected a file path (a string)',
            matrix_snapshot=3)


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _snapshot(tmp_path / "adj.safetensors")
    (tmp_path / "t.json").write_text("[[0], [0, 0]]")
    config = parse(matrix_snapshot="adj.safetensors", tree="t.json")
    assert config.matrix_snapshot == str(tmp_path / "adj.safetensors")
    assert config.tree == str(tmp_path / "t.json")


# -- the forms a config arrives in --------------------------------------------------------------

def test_parsed_from_the_json_a_server_gets():
    text = (
        '{"method": "recycling", "topk": 4, "matrix-scope": "per_request", '
        '"num_speculative_tokens": 3, "tree": [[0], [1], [0, 0]]}'
    )
    config = RecyclingConfig.from_dict(text)
    assert config == RecyclingConfig(
        tree=((0,), (1,), (0, 0)), topk=4, matrix_scope="per_request", num_speculative_tokens=3
    )
    with pytest.raises(RecyclingConfigError, match="^speculative_config is not valid JSON: "):
        RecyclingConfig.from_dict('{"method": "recycling",')
    with pytest.raises(RecyclingConfigError, match="^speculative_config must be a JSON object / dict, got list$"):
        RecyclingConfig.from_dict('["recycling"]')


def test_round_trip_through_additional_config():
    """The front end ships ``to_dict()`` to the workers in additional_config (JSON-hashed)."""
    config = parse(tree=[[0], [1], [0, 0]], topk=4, matrix_scope="per_request", num_speculative_tokens=2)
    shipped = json.loads(json.dumps(config.to_dict()))

    class FakeVllmConfig:
        additional_config = {"recycling": shipped, "other": 1}

    assert RecyclingConfig.from_vllm_config(FakeVllmConfig) == config


def test_proposer_without_the_plugin_translation():
    class FakeVllmConfig:
        additional_config = {}

    with pytest.raises(RecyclingConfigError, match=re.escape(
        "vllm_recycling.proposer.RecyclingProposer needs additional_config['recycling']"
    )):
        RecyclingConfig.from_vllm_config(FakeVllmConfig)
