"""GGUF files converted to Hugging Face checkpoints (``convert_gguf``): the model dequantised to
bfloat16 with its tokenizer and chat template, written with the keys older readers look for
(``postfix_for_older_readers``) and checked the way users load it (``verify_checkpoint``).

This module imports neither vLLM nor torch; transformers and torch are imported when used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

__all__ = ["convert_gguf", "postfix_for_older_readers", "verify_checkpoint"]

logger = logging.getLogger(__name__)


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


def postfix_for_older_readers(out: Path, config, model_max_length: int) -> None:
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


def verify_checkpoint(out: Path) -> None:
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


def convert_gguf(gguf: Path, out: Path) -> None:
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
    postfix_for_older_readers(out, model.config, model.config.max_position_embeddings)
    logger.info("checking the saved tokenizer and config")
    verify_checkpoint(out)
