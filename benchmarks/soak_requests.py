"""The soak's requests (``soak.py``): the seeded plan of kinds and bodies, each request sent
from one of the concurrent clients, and the checks of its answer that need no other server.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field

MODEL = "tiny-random"
VOCAB = 1024  # vllm_recycling.tools.models.TINY_VOCAB_SIZE
MAX_MODEL_LEN = 1024
REQUEST_TIMEOUT_S = 300
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
STOP_STRINGS = ("e", "the", ".", "in", " a")

# The request kinds and their share of the mix (bad input comes on top, see build_plan).
KINDS = {
    "completion": 0.17,    # greedy, token-id prompt
    "chat": 0.15,          # greedy, chat
    "stop": 0.07,          # greedy, stop strings (completion or chat, as the kinds below)
    "one token": 0.05,     # greedy, max_tokens 1
    "long prompt": 0.06,   # greedy, 900-1000 prompt tokens, max_tokens up to the context's end
    "sampled": 0.24,       # temperature 1, seeded, top-p / top-k, n 1-3
    "sampled long": 0.03,  # temperature 1, seeded, 900-1000 prompt tokens
    "disconnect": 0.13,    # a stream the client closes after 1-3 chunks
    "abort": 0.10,         # non-streaming, the client gives up after 0.1-0.5 s
}
GREEDY_KINDS = ("completion", "chat", "stop", "one token", "long prompt")


def _bad_inputs() -> list[tuple[str, str, dict | bytes, int]]:
    """(name, path, body (bytes: sent as they are), the status vLLM answers) per bad input."""
    def completion(**body):
        return {"model": MODEL, "prompt": [7, 8], "max_tokens": 4, **body}

    def chat(**body):
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **body}

    full = [7] * MAX_MODEL_LEN
    c, cc = "/v1/completions", "/v1/chat/completions"
    return [
        ("token id >= vocab", c, completion(prompt=[5000]), 400),
        ("negative token id", c, completion(prompt=[7, -1]), 400),
        ("empty prompt", c, completion(prompt=""), 400),
        ("empty token list", c, completion(prompt=[]), 400),
        ("max_tokens > context", c, completion(max_tokens=5000), 400),
        ("prompt > context", c, completion(prompt=[*full, 7], max_tokens=1), 400),
        ("prompt fills context", c, completion(prompt=full, max_tokens=1), 400),
        ("chat max_tokens > context", cc, chat(max_tokens=5000), 400),
        ("chat no messages", cc, chat(messages=[]), 400),
        ("malformed JSON", c, b'{"model": "tiny-random", "prompt": [5,', 400),
        ("chat malformed JSON", cc, b'{"model": "tiny-random", "messages": [', 400),
        ("unknown model", c, completion(model="no-such-model"), 404),
        ("chat unknown model", cc, chat(model="no-such-model"), 404),
        ("logprobs > 20", c, completion(logprobs=50), 400),
        ("negative temperature", c, completion(temperature=-1), 400),
    ]


BAD_INPUTS = _bad_inputs()
EXPECTED_STATUS = {name: status for name, _, _, status in BAD_INPUTS}


@dataclass
class Request:
    """One request of the plan; ``body`` is sent as JSON (bytes: as they are)."""

    index: int
    kind: str
    path: str
    body: dict | bytes
    stream: bool = False
    action: str = "complete"  # "complete" | "disconnect" (after `chunks`) | "abort" (after `timeout` s)
    chunks: int = 0
    timeout: float = REQUEST_TIMEOUT_S
    expect_status: int = 200

    @property
    def greedy(self) -> bool:
        return self.kind in GREEDY_KINDS


def _corpus_sentences() -> list[str]:
    from importlib.resources import files

    text = (files("vllm_recycling.configs") / "tiny_corpus.txt").read_text(encoding="utf-8")
    return [s.strip() + "." for s in re.split(r"\.\s+", text) if len(s.strip()) > 20]


def build_plan(n: int, seed: int) -> list[Request]:
    """``n`` requests drawn with ``seed``: 5% bad input (each case at least once, evenly
    spread), the rest drawn from KINDS by weight."""
    rng = random.Random(seed)
    sentences = _corpus_sentences()
    n_bad = min(n, max(len(BAD_INPUTS), round(0.05 * n)))
    bad_at = {round((i + 0.5) * n / n_bad): BAD_INPUTS[i % len(BAD_INPUTS)] for i in range(n_bad)}
    kinds, weights = zip(*KINDS.items(), strict=True)
    plan = []
    for index in range(n):
        if index in bad_at:
            name, path, body, status = bad_at[index]
            plan.append(Request(index, f"bad: {name}", path, body, expect_status=status))
        else:
            plan.append(_draw(index, rng.choices(kinds, weights)[0], rng, sentences))
    return plan


def _token_prompt(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))]


def _messages(rng: random.Random, sentences: list[str]) -> list[dict]:
    start = rng.randrange(len(sentences))
    messages = [{"role": "user", "content": " ".join(sentences[start:start + rng.randint(1, 4)])}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    return messages


def _draw(index: int, kind: str, rng: random.Random, sentences: list[str]) -> Request:
    chat = kind == "chat" or (kind not in ("completion", "long prompt", "sampled long") and rng.random() < 0.45)
    stream = rng.random() < 0.5
    if kind in GREEDY_KINDS:
        body = {"temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True,
                "return_token_ids": True}
        if kind == "long prompt":
            prompt = _token_prompt(rng, 900, 1000)
            room = MAX_MODEL_LEN - len(prompt)
            body["max_tokens"] = room if rng.random() < 0.3 else rng.randint(1, min(24, room))
        else:
            prompt = _token_prompt(rng, 4, 128)
            body["max_tokens"] = 1 if kind == "one token" else rng.randint(8, 48)
        if kind == "stop":
            body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
        if kind == "completion" and rng.random() < 0.25:
            body.update(repetition_penalty=1.3, frequency_penalty=0.4)
    elif kind in ("sampled", "sampled long"):
        body = {"temperature": 1.0, "top_p": rng.choice((0.8, 0.95, 1.0)), "top_k": rng.choice((-1, 4, 50)),
                "n": rng.choice((1, 1, 2, 3)) if kind == "sampled" else 1, "max_tokens": rng.randint(4, 32),
                "seed": rng.randrange(2**31)}
        if kind == "sampled":
            prompt = _token_prompt(rng, 4, 48)
        else:
            prompt = _token_prompt(rng, 900, 1000)
            body["max_tokens"] = rng.randint(1, MAX_MODEL_LEN - len(prompt))
        if rng.random() < 0.3:
            body["presence_penalty"] = 0.5
    else:  # disconnect / abort: long answers the client stops waiting for
        prompt = _token_prompt(rng, 4, 128)
        body = {"temperature": rng.choice((0, 1.0)), "ignore_eos": True,
                "max_tokens": rng.randint(600, MAX_MODEL_LEN - 128 - 64)}
        stream = kind == "disconnect"
    ids = "return_tokens_as_token_ids" in body  # greedy: token ids and top-2 logprobs, compared
    if chat:
        body["messages"] = _messages(rng, sentences)
        if ids:
            body.update(logprobs=True, top_logprobs=2)
        elif rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
    else:
        body["prompt"] = prompt
        if ids:
            body["logprobs"] = 2
        elif rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 1 / 3:
        body["cache_salt"] = rng.choice(TENANTS)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    request = Request(index, kind, "/v1/chat/completions" if chat else "/v1/completions",
                      {"model": MODEL, **body}, stream=stream)
    if kind == "disconnect":
        request.action, request.chunks = "disconnect", rng.randint(1, 3)
    elif kind == "abort":
        request.action, request.timeout = "abort", round(rng.uniform(0.1, 0.5), 2)
    return request


# -- sending requests ----------------------------------------------------------------------------

@dataclass
class Outcome:
    """What became of one request. ``outcome``: ok | rejected (the expected 4xx) | disconnected
    | aborted (the client gave up) | failed (``error`` says why)."""

    index: int
    kind: str
    outcome: str = "failed"
    status: int | None = None
    error: str | None = None
    choices: list[dict] = field(default_factory=list)  # {"ids", "top", "finish"} per choice
    tokens: int = 0
    seconds: float = 0.0


def _token_id(token: str) -> int:
    return int(token.rsplit(":", 1)[1])


def _merge_choice(acc: dict, choice: dict, chat: bool, ids: bool) -> None:
    """Adds one response choice (or one stream chunk of it) to ``acc``; ``ids``: the request
    asked for token ids (``return_token_ids``, ``return_tokens_as_token_ids``)."""
    if choice.get("finish_reason"):
        acc["finish"] = choice["finish_reason"]
    if not ids:
        return
    acc["ids"].extend(choice.get("token_ids") or [])
    logprobs = choice.get("logprobs") or {}
    if chat:
        acc["top"].extend([[(_token_id(t["token"]), t["logprob"]) for t in entry["top_logprobs"]]
                           for entry in logprobs.get("content") or []])
    else:
        acc["top"].extend([sorted(((_token_id(t), lp) for t, lp in entry.items()), key=lambda x: -x[1])
                           for entry in logprobs.get("top_logprobs") or [] if entry is not None])


def _check_answer(request: Request, out: Outcome) -> str | None:
    """Why the answer to a completed request is wrong, or None."""
    body = request.body
    n = body.get("n", 1)
    if len(out.choices) != n:
        return f"{len(out.choices)} choices for n={n}"
    for c in out.choices:
        if c["finish"] not in ("length", "stop"):
            return f"finish_reason {c['finish']!r}"
        if "return_token_ids" in body:
            if not c["ids"] or len(c["ids"]) > body["max_tokens"]:
                return f"{len(c['ids'])} token ids for max_tokens={body['max_tokens']}"
            if not all(0 <= t < VOCAB for t in c["ids"]):
                return "a token id outside the vocabulary"
            if len(c["top"]) != len(c["ids"]):
                return f"{len(c['top'])} logprobs for {len(c['ids'])} tokens"
            if "stop" not in body and (len(c["ids"]) != body["max_tokens"] or c["finish"] != "length"):
                return (f"{len(c['ids'])} tokens ({c['finish']}) for max_tokens={body['max_tokens']} "
                        "and ignore_eos")
    if out.tokens > body["max_tokens"] * n:
        return f"usage: {out.tokens} completion tokens for max_tokens={body['max_tokens']}, n={n}"
    return None


async def send(client, request: Request) -> Outcome:
    """Sends one request and reads its answer as the request's ``action`` says."""
    import httpx

    out = Outcome(request.index, request.kind)
    chat = request.path.endswith("chat/completions")
    ids = isinstance(request.body, dict) and "return_token_ids" in request.body
    choices: dict[int, dict] = {}
    if isinstance(request.body, bytes):
        kwargs = {"content": request.body, "headers": {"content-type": "application/json"}}
    else:
        kwargs = {"json": request.body}
    start = time.perf_counter()
    try:
        async with client.stream("POST", request.path, timeout=httpx.Timeout(request.timeout), **kwargs) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                if r.status_code == request.expect_status:
                    out.outcome = "rejected"
                else:
                    out.error = f"status {r.status_code}: {r.text[:300]}"
                return out
            if request.expect_status != 200:
                out.error = f"status 200, expected {request.expect_status}"
                return out
            if not request.stream:
                data = json.loads(await r.aread())
                for choice in data["choices"]:
                    acc = choices.setdefault(choice["index"], {"ids": [], "top": [], "finish": None})
                    _merge_choice(acc, choice, chat, ids)
                out.tokens = data["usage"]["completion_tokens"]
            else:
                chunks, done = 0, False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    data = json.loads(line[len("data: "):])
                    if "error" in data:
                        out.error = f"error event in the stream: {json.dumps(data['error'])[:300]}"
                        return out
                    for choice in data["choices"]:
                        acc = choices.setdefault(choice["index"], {"ids": [], "top": [], "finish": None})
                        _merge_choice(acc, choice, chat, ids)
                    if data.get("usage"):
                        out.tokens = data["usage"]["completion_tokens"]
                    chunks += 1
                    if request.action == "disconnect" and chunks >= request.chunks:
                        out.outcome = "disconnected"
                        return out  # leaving the block closes the connection mid-stream
                if not done:
                    out.error = "the stream ended without [DONE]"
                    return out
    except httpx.TimeoutException as e:
        if request.action == "abort":
            out.outcome = "aborted"
        else:
            out.error = f"client timeout ({type(e).__name__})"
        return out
    except Exception as e:  # noqa: BLE001 - a broken answer (or connection) is a failed request
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        out.seconds = round(time.perf_counter() - start, 3)
    out.choices = [choices[i] for i in sorted(choices)]
    out.error = _check_answer(request, out)
    out.outcome = "ok" if out.error is None else "failed"
    return out


@dataclass
class Load:
    """What ``run_load`` returns: the outcomes in plan order, the wall time and the RSS samples
    ``(seconds, requests done, {process: KiB})``."""

    outcomes: list[Outcome]
    seconds: float
    samples: list[tuple[float, int, dict[str, int]]]


async def run_load(url: str, requests: list[Request], concurrency: int, rss=None, rss_interval: float = 2.0,
                   progress=None) -> Load:
    """Sends ``requests`` in order from ``concurrency`` clients; ``rss()`` (the server's RSS by
    process) is sampled every ``rss_interval`` s and once at the end."""
    import httpx

    # A connection per request: vLLM's server closes one idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE),
    # and a request sent on it as it closes fails with a ReadError (seen about once in 1,000
    # requests on a loaded machine, with or without speculation).
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    outcomes: dict[int, Outcome] = {}
    queue = list(reversed(requests))
    samples: list[tuple[float, int, dict[str, int]]] = []
    start = time.perf_counter()

    def sample() -> None:
        samples.append((round(time.perf_counter() - start, 1), len(outcomes), rss()))

    async def sampler() -> None:
        while True:
            sample()
            await asyncio.sleep(rss_interval)

    async def worker(client) -> None:
        while queue:
            request = queue.pop()
            outcomes[request.index] = await send(client, request)
            if progress:
                progress(outcomes[request.index])

    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        task = asyncio.create_task(sampler()) if rss else None
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        if task:
            task.cancel()
            sample()
    return Load([outcomes[r.index] for r in requests], seconds, samples)
