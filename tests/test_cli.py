"""The command line's own decisions, without vLLM's parsers: which import errors of
``vllm-recycling bench`` mean the ``bench`` extra is missing, and which models
``serve``/``warm`` refuse at once (``model_lookup``)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_recycling import cli, model_lookup

REPO = Path(__file__).resolve().parents[1]


def test_bench_modules_are_the_bench_extras_packages():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    packages = {re.split(r"[<>=!~;\[ ]", requirement)[0].replace("-", "_") for requirement in extra}
    assert packages == set(cli.BENCH_MODULES)


def _bench_raising(monkeypatch, error: ImportError) -> None:
    def dispatch(namespace):
        raise error

    monkeypatch.setattr(cli, "bench_arguments", lambda args: SimpleNamespace(dispatch_function=dispatch))


@pytest.mark.parametrize("name", ["pandas", "matplotlib.pyplot", "arctic_inference"])
def test_a_missing_package_of_the_bench_extra_says_what_to_install(monkeypatch, capsys, name):
    _bench_raising(monkeypatch, ModuleNotFoundError(f"No module named {name!r}", name=name))
    assert cli.main(["bench", "serve"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        f"vllm-recycling: error: vLLM's benchmarks need {name}: install them with "
        "pip install 'vllm-recycling[bench]'\n"
    )


@pytest.mark.parametrize("error", [
    ModuleNotFoundError("No module named 'vllm_recycling.gone'", name="vllm_recycling.gone"),
    ImportError("cannot import name 'thing' from 'vllm.benchmarks.serve'", name="vllm.benchmarks.serve"),
    ImportError("raised by hand"),
])
def test_other_import_errors_of_bench_are_not_hidden(monkeypatch, error):
    """Review D7: only a package of the extra is reported as the extra missing; any other
    import error is a bug, raised as it is."""
    _bench_raising(monkeypatch, error)
    with pytest.raises(ImportError) as raised:
        cli.main(["bench", "serve"])
    assert raised.value is error


def test_a_path_that_does_not_exist_is_refused_at_once(tmp_path):
    with pytest.raises(cli.CliError, match=r"^no such model directory: \./nowhere\. Give a checkpoint directory"):
        model_lookup.check_model_exists("./nowhere")
    model_lookup.check_model_exists(str(tmp_path))  # a directory: vLLM reads it
    model_lookup.check_model_exists("s3://bucket/model")  # vLLM's own loaders


def test_a_hub_id_not_in_the_cache_is_refused_while_the_hub_is_offline(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(cli.CliError, match=r"^cannot load model 'org/absent': it is not in the local Hugging Face "
                       r"cache and HF_HUB_OFFLINE is set\. Download it where the hub is reachable"):
        model_lookup.check_model_exists("org/absent", download_dir=str(tmp_path))
