"""Greedy identity through vLLM's server, as a user sees it: the same requests, of every kind an
OpenAI client sends, to a server without speculation and to one with it, answer by answer.

    python benchmarks/greedy_identity_server.py --model qwen2.5-coder-0.5b --dtype bfloat16
        [--spec '{"method": "recycling"}'] [--tag TAG]

Two servers (``vllm-recycling serve``, the worker on one core as vLLM binds it), one after the
other: no speculation, then ``--spec``. Every request kind (``KINDS``: completions and chat,
streamed or not, stop strings, penalties, a logit bias, logprobs, echo, a JSON schema, a long
prompt, n = 2, top-k 1 sampled, a seeded sample, min_tokens, one token) goes to the speculating
server twice (the second time its matrix has learnt from the first) and once to the other.
An answer counts as identical when its text, its finish reason and, where the request asks for
them, every logprob it returns are equal to the last digit the server prints. Writes
``benchmarks/results/greedy_identity_server_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import Server  # noqa: E402
from spec_bench import benchmark_questions, ensure_model_prior, run_header, write_results  # noqa: E402

MAX_TOKENS = 64
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"]}


def kinds(questions: list[str]) -> dict[str, tuple[str, dict]]:
    """Request kind -> (endpoint "chat" or "completions", the request's arguments)."""
    q, other = questions[0], questions[1]
    chat = [{"role": "user", "content": q}]
    long_prompt = "\n\n".join(questions)[:3000]  # the sample's questions one after another (~700 tokens)
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0)
    return {
        "completion": ("completions", dict(prompt=q, **greedy)),
        "completion, streamed": ("completions", dict(prompt=q, stream=True, **greedy)),
        "chat": ("chat", dict(messages=chat, **greedy)),
        "chat, streamed": ("chat", dict(messages=chat, stream=True, **greedy)),
        "stop strings": ("chat", dict(messages=[{"role": "user", "content": other}], stop=[".", "\n\n"], **greedy)),
        "presence and frequency penalties": ("chat", dict(messages=chat, presence_penalty=0.6,
                                                          frequency_penalty=0.4, **greedy)),
        "repetition penalty": ("chat", dict(messages=chat, extra_body={"repetition_penalty": 1.3}, **greedy)),
        "logit bias": ("completions", dict(prompt=q, logit_bias={"13": 2.0, "198": -1.0}, **greedy)),
        "logprobs (chat, top 5)": ("chat", dict(messages=chat, logprobs=True, top_logprobs=5, **greedy)),
        "logprobs (completion, 5)": ("completions", dict(prompt=q, logprobs=5, **greedy)),
        "echo with logprobs": ("completions", dict(prompt=other, echo=True, logprobs=1, **greedy)),
        "JSON schema": ("chat", dict(messages=chat, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, **greedy)),
        "long prompt": ("completions", dict(prompt=long_prompt, **greedy)),
        "n = 2": ("completions", dict(prompt=q, n=2, **greedy)),
        "min_tokens": ("chat", dict(messages=[{"role": "user", "content": other}],
                                    extra_body={"min_tokens": 32}, **greedy)),
        "one token": ("completions", dict(prompt=q, max_tokens=1, temperature=0)),
        "top-k 1, sampled": ("chat", dict(messages=chat, max_tokens=MAX_TOKENS, temperature=1.0,
                                          extra_body={"top_k": 1})),
        "seeded sample": ("chat", dict(messages=chat, max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95,
                                       seed=7)),
    }


def ask(client, model: str, endpoint: str, request: dict) -> list[dict]:
    """One request: per choice, its text, finish reason and logprobs (as the server printed them);
    a request the server refuses answers its status and message."""
    from openai import APIStatusError

    api = client.chat.completions if endpoint == "chat" else client.completions
    try:
        response = api.create(model=model, **request)
    except APIStatusError as e:
        return [{"text": f"HTTP {e.status_code}: {e.message}", "finish": None, "logprobs": None}]
    if request.get("stream"):
        text, finish = "", None
        for chunk in response:
            for c in chunk.choices:
                text += (c.delta.content or "") if endpoint == "chat" else c.text
                finish = c.finish_reason or finish
        return [{"text": text, "finish": finish, "logprobs": None}]
    out = []
    for c in response.choices:
        text = c.message.content if endpoint == "chat" else c.text
        logprobs = None if c.logprobs is None else json.loads(c.logprobs.model_dump_json())
        out.append({"text": text, "finish": c.finish_reason, "logprobs": logprobs})
    return out


def serve_and_ask(args, spec: dict | None, rounds: int, log: Path) -> tuple[list[dict[str, list[dict]]], dict]:
    """One server; every kind asked ``rounds`` times, in order: per round, kind -> answers; and
    the server's token and spec-decode counters after them."""
    from openai import OpenAI

    questions = [q["turns"][0] for q in benchmark_questions(args)]
    requests = kinds(questions)
    server_args = ["--dtype", args.dtype, "--enforce-eager", "--max-model-len", "2048"]
    with Server(args.model, server_args, spec, log, env={"VLLM_CPU_KVCACHE_SPACE": "2"}) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=600)
        model = client.models.list().data[0].id
        answers = [{name: ask(client, model, *requests[name]) for name in requests} for _ in range(rounds)]
        return answers, server.metrics()


def compare(base: dict[str, list[dict]], other: dict[str, list[dict]]) -> dict[str, str]:
    """Kind -> "identical", or what differs first (text, finish reason, logprobs)."""
    out = {}
    for name, answers in base.items():
        theirs = other[name]
        if answers == theirs:
            out[name] = "identical"
        elif [a["text"] for a in answers] != [b["text"] for b in theirs]:
            a, b = answers[0]["text"], theirs[0]["text"]
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out[name] = f"text differs at character {at}: {a[max(0, at - 20):at + 20]!r} / {b[max(0, at - 20):at + 20]!r}"
        elif [a["finish"] for a in answers] != [b["finish"] for b in theirs]:
            out[name] = "finish reason differs"
        else:
            out[name] = "same text, logprobs differ"
    return out


def markdown(report: dict) -> str:
    lines = [f"# Greedy identity through the server, {report['model']} in {report['dtype']}", "",
             report["header"], "", "| request kind | " + " | ".join(report["comparisons"]) + " |",
             "|---|" + "---|" * len(report["comparisons"])]
    for name in report["kinds"]:
        lines.append(f"| {name} | " + " | ".join(c[name] for c in report["comparisons"].values()) + " |")
    totals = [sum(v == "identical" for v in c.values()) for c in report["comparisons"].values()]
    lines.append("| identical | " + " | ".join(f"{t} of {len(report['kinds'])}" for t in totals) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--spec", default='{"method": "recycling"}')
    parser.add_argument("--questions", help="a Spec-Bench question.jsonl (default: the shipped sample)")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true")
    parser.add_argument("--tag", default=None)
    args = parser.parse_args()
    spec = json.loads(args.spec)
    if spec.get("method") == "recycling":
        ensure_model_prior(args.model, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        (base,), _ = serve_and_ask(args, None, 1, Path(tmp) / "none.log")
        (first, second), counters = serve_and_ask(args, spec, 2, Path(tmp) / "spec.log")
    head = run_header("greedy_identity_server.py", args.model)
    report = {**head, "dtype": args.dtype, "spec": spec, "kinds": list(base),
              "comparisons": {f"{spec['method']}, first time": compare(base, first),
                              f"{spec['method']}, second time": compare(base, second)},
              "answers": {"none": base, "first": first, "second": second}, "counters": counters,
              "header": (f"{head['date']}; {head['machine']}; vLLM {head['vllm']}; `vllm-recycling serve "
                         f"{args.model} --dtype {args.dtype} --enforce-eager`, without speculation and with "
                         f"`{json.dumps(spec)}`; the OpenAI client; up to {MAX_TOKENS} tokens. Identical: the "
                         "same text, finish reason and, where asked for, every logprob the server returned. The "
                         f"speculating server drafted {counters['draft_tokens']:.0f} tokens in "
                         f"{counters['drafts']:.0f} steps and accepted {counters['accepted']:.0f} of them. "
                         f"Command: `{head['command']}`.")}
    tag = args.tag or f"{args.model}_{args.dtype}"
    write_results(f"greedy_identity_server_{tag}", report, markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
