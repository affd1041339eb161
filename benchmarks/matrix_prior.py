"""Which initial matrix (``matrix_init: "model"``) drafts best: the model's own top-k after each
vocabulary token, computed in different contexts, against an empty matrix.

    python benchmarks/matrix_prior.py                 # SmolLM2, 13 prompts x 64 tokens (~15 min on 2 cores)

Each prior is computed with plain transformers (batches of one-token continuations, the
context's KV computed once and shared), then the reference decoder (``tools.reference``,
greedy, batch 1, the whole "2.2.2" tree, a new matrix for every prompt: the cold start the
prior is for) answers one Spec-Bench question per category. Contexts:

- ``empty``: no prior (every row token 0), today's cold start;
- ``alone``: the token alone, at position 0;
- ``assistant``: the token as the first of an assistant turn (the chat template's generation
  prompt before it), where the answers the drafts are for are written;
- ``chat``: what the plugin computes (``warm.context_ids``): the chat template's whole opening
  of an assistant reply to a one-word user message (its system prompt included), padded to
  whole KV blocks so that vLLM's prefix cache computes it once.

Prints a table (tokens per step, the prior's compute time and size) and writes
``benchmarks/results/matrix_prior.{json,md}``.

    python benchmarks/matrix_prior.py --startup       # engine start-up with the cached prior vs empty

``--startup`` times ``LLM(model, speculative_config={"method": "recycling", "matrix_init": ...})``
from its creation to its first answer, each in a fresh process, alternating "model" (the prior
cached) and "empty" ``--rounds`` times, and writes ``benchmarks/results/matrix_prior_startup.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import RESULTS, run_header  # noqa: E402

CONTEXTS = ("empty", "alone", "assistant", "chat")


def context_ids(tokenizer, context: str) -> list[int]:
    """The tokens before each vocabulary token: none, the chat template's generation prompt, or
    the plugin's context."""
    if context == "alone":
        return []
    if context == "chat":
        from vllm_recycling.warm import context_ids as plugin_context

        return plugin_context(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=True)
    full = tokenizer(text, add_special_tokens=False).input_ids
    user = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    return full[len(tokenizer(user, add_special_tokens=False).input_ids):]


@torch.no_grad()
def transformers_prior(model, prefix: list[int], topk: int, batch: int = 512):
    """(table [V, k] int32, probs [V, k] float16): each token's top-k next tokens after
    ``prefix + [token]`` and their probabilities (lower id first among equal logits)."""
    from transformers import DynamicCache

    from vllm_recycling.kernels.topk_update import topk_lowest_id_first

    vocab = model.config.vocab_size
    table = torch.zeros((vocab, topk), dtype=torch.int32)
    probs = torch.zeros((vocab, topk), dtype=torch.float16)
    prefix_cache = None
    if prefix:
        prefix_cache = DynamicCache()
        model(input_ids=torch.tensor([prefix]), past_key_values=prefix_cache, use_cache=True)
    for start in range(0, vocab, batch):
        ids = torch.arange(start, min(start + batch, vocab))[:, None]
        cache = None if prefix_cache is None else _expanded(prefix_cache, ids.shape[0])
        positions = torch.full_like(ids, len(prefix))
        logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=cache is not None).logits[:, -1].float()
        top = topk_lowest_id_first(logits, topk)
        table[start:start + ids.shape[0]] = top.int()
        probs[start:start + ids.shape[0]] = logits.softmax(-1).gather(1, top).half()
    return table, probs


def _expanded(cache, batch: int):
    """A copy of a batch-1 ``DynamicCache`` repeated ``batch`` times."""
    import copy

    out = copy.deepcopy(cache)
    for layer in out.layers:
        layer.keys = layer.keys.expand(batch, -1, -1, -1).contiguous()
        layer.values = layer.values.expand(batch, -1, -1, -1).contiguous()
    return out


def time_startup(model: str, init: str) -> float:
    """Seconds from creating an engine with ``matrix_init: init`` to its first answer (in this
    process: run it in a fresh one)."""
    from vllm import LLM, SamplingParams

    from vllm_recycling.tools.models import prepare_model

    path = str(prepare_model(model))
    started = time.perf_counter()
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=2048,
              speculative_config={"method": "recycling", "matrix_init": init})
    llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
    return time.perf_counter() - started


def startup(args) -> int:
    import os
    import statistics
    import subprocess

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    times: dict[str, list[float]] = {"model": [], "empty": []}
    subprocess.run([sys.executable, __file__, "--startup-once", "model", "--model", args.model], check=True)  # the prior cached
    for _ in range(args.rounds):
        for init in ("model", "empty"):
            out = subprocess.run([sys.executable, __file__, "--startup-once", init, "--model", args.model],
                                 check=True, capture_output=True, text=True).stdout
            times[init].append(float(out.strip().splitlines()[-1]))
            print(init, times[init][-1], flush=True)
    header = run_header("matrix_prior.py", args.model)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        "# Engine start-up with the cached prior", "",
        f"{header['date']}; {header['machine']}; torch {torch.__version__}. Command: `{header['command']}`.", "",
        "Seconds from `LLM(...)` to its first answer, each in a fresh process (in-process engine, "
        "float32, eager), alternating `matrix_init` \"model\" (the prior already cached) and \"empty\".", "",
        "| matrix_init | runs (s) | median (s) |",
        "|---|---|---|",
    ] + [f"| {k} | {', '.join(f'{t:.1f}' for t in v)} | {med[k]:.1f} |" for k, v in times.items()] + [
        "", f"model / empty: {med['model'] / med['empty']:.3f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "matrix_prior_startup.md").write_text(text)
    (RESULTS / "matrix_prior_startup.json").write_text(json.dumps({"header": header, "times": times}, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--contexts", default=",".join(CONTEXTS))
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--startup", action="store_true", help="time engine start-up instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--startup-once", choices=("model", "empty"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.startup_once:
        print(time_startup(args.model, args.startup_once))
        return 0
    if args.startup:
        return startup(args)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_recycling.matrix import AdjacencyMatrix
    from vllm_recycling.tools.models import prepare_model
    from vllm_recycling.tools.prompts import chat_prompt_ids, spec_bench_questions
    from vllm_recycling.tools.reference import ReferenceDecoder
    from vllm_recycling.tree import load_tree

    torch.manual_seed(0)
    path = prepare_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    questions = spec_bench_questions(per_category=args.per_category)
    prompts = [chat_prompt_ids(tokenizer, q["turns"][0]) for q in questions]
    tree = load_tree("2.2.2", args.topk)
    rows = []
    for context in args.contexts.split(","):
        prior, seconds = None, 0.0
        if context != "empty":
            started = time.perf_counter()
            prior = transformers_prior(model, context_ids(tokenizer, context), args.topk)
            seconds = time.perf_counter() - started
        steps, tokens = 0, 0
        for ids in prompts:
            matrix = AdjacencyMatrix(model.config.vocab_size, args.topk, initial=None if prior is None else prior[0])
            decoder = ReferenceDecoder(model, tree, matrix)
            got = decoder.generate(ids, args.max_tokens, eos_token_id=model.config.eos_token_id)
            steps += len(got.tokens_per_step) + 1  # the prefill step emits one token too
            tokens += len(got.tokens)
        row = {"context": context, "tokens_per_step": tokens / steps, "tokens": tokens, "steps": steps,
               "compute_s": round(seconds, 1),
               "prior_bytes": 0 if prior is None else prior[0].numel() * 4 + prior[1].numel() * 2}
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = run_header("matrix_prior.py", args.model)
    base = rows[0]["tokens_per_step"] if rows[0]["context"] == "empty" else None
    lines = [
        "# Initial matrix from the model: which context", "",
        f"{header['date']}; {header['machine']}; torch {torch.__version__}. Command: `{header['command']}`.", "",
        f"Reference decoder, greedy, batch 1, tree 2.2.2, k = {args.topk}, a new matrix for each of "
        f"{len(prompts)} Spec-Bench prompts (one per category), up to {args.max_tokens} tokens. Tokens "
        "per step counts every step, the prefill's included. Compute: the prior over the whole "
        "vocabulary with transformers on this machine.", "",
        "| context | tokens per step | vs empty | compute s | prior size |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tokens_per_step'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['context']} | {r['tokens_per_step']:.3f} | {ratio} | {r['compute_s']} | "
                     f"{r['prior_bytes'] / 2**20:.2f} MiB |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "matrix_prior.md").write_text(text)
    (RESULTS / "matrix_prior.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
