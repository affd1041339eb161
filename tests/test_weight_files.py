"""Which files of a checkpoint folder are its weights, for the prior's cache key
(``prior.model_identity``) and the memory check beside a server (``warm_checks.weights_bytes``):
the ones vLLM 0.32's default loader reads, one definition for both."""

from __future__ import annotations

from vllm_recycling import prior, warm_checks


def test_a_gguf_file_in_a_folder_is_not_a_weight_file(tmp_path):
    """vLLM 0.32 loads a folder's .safetensors, else .bin, else .pt files
    (model_executor/model_loader/default_loader.py:185-233); it has no GGUF loader."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.Q4_1.gguf").write_bytes(b"x" * 7)
    assert prior.model_identity(str(folder))["weights"] == []
    assert warm_checks.weights_bytes(folder) is None
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    assert [name for name, _, _ in prior.model_identity(str(folder))["weights"]] == ["model.safetensors"]
    assert warm_checks.weights_bytes(folder) == 10


def test_one_definition_of_the_weight_files():
    assert warm_checks.WEIGHT_SUFFIXES is prior.WEIGHT_SUFFIXES == (".safetensors", ".bin", ".pt")
