"""``vllm-recycling serve``: vLLM's OpenAI-compatible server, with the plugin, running.

The tests run the command as a subprocess (its own process group, always killed) on tiny-random
with ``{"method": "recycling"}`` (the protocol does not depend on the model; ``make serve`` serves
SmolLM2 the same way), talk to it through the ``openai`` client, and read the spec-decode
counters from ``/metrics``. How the command translates its arguments: tests/test_serve_args.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_recycling import cli  # noqa: E402
from vllm_recycling.tools.models import TINY_VOCAB_SIZE as TINY_VOCAB  # noqa: E402

SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]
RECYCLING = json.dumps({"method": "recycling"})
MODEL = "tiny-random"
IGNORE_EOS = {"ignore_eos": True}  # a random model may end at once; the tests want full answers
START_TIMEOUT_S = 180
MAX_TOKENS = 32


def command() -> list[str]:
    """The installed ``vllm-recycling`` script beside this Python, else the module."""
    script = Path(sys.executable).with_name("vllm-recycling")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vllm_recycling.cli"]


def server_env() -> dict[str, str]:
    return {**os.environ, **SERVER_ENV}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the API server and its engine core), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def held_prior(tiny_model, tmp_path_factory):
    """A cache of the server's own (the models of the suite's cache, no initial matrix) and the
    lock of its initial matrix held, so that the server's background computation of it waits
    until ``test_server_survives_a_failed_computation_and_takes_a_matrix_in_later`` kills it."""
    from vllm_recycling.prior import prior_path
    from vllm_recycling.files import FileLock
    from vllm_recycling.warm import lock_path

    cache = tmp_path_factory.mktemp("cache")
    (cache / "models").mkdir()
    (cache / "models" / MODEL).symlink_to(Path(tiny_model).resolve())
    old = os.environ.get("VLLM_RECYCLING_CACHE")
    os.environ["VLLM_RECYCLING_CACHE"] = str(cache)
    try:
        path = prior_path(str(cache / "models" / MODEL), None, TINY_VOCAB, 8)
    finally:
        os.environ.pop("VLLM_RECYCLING_CACHE") if old is None else os.environ.update(VLLM_RECYCLING_CACHE=old)
    lock = FileLock(lock_path(path)).__enter__()
    yield cache, path, lock
    lock.__exit__()


@pytest.fixture(scope="module")
def server(tiny_model, held_prior, tmp_path_factory):
    """``vllm-recycling serve tiny-random ...`` on a free port, its initial matrix held back
    (``held_prior``), with the test's worker methods (``worker_hooks``) behind vLLM's
    development endpoint; yields (base URL, timings)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    argv = [*command(), "serve", MODEL, *SERVER_ARGS, "--host", "127.0.0.1", "--port", str(port),
            "--speculative-config", RECYCLING, "--worker-extension-cls", "worker_hooks.StepCostHooks"]
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**server_env(), "VLLM_RECYCLING_CACHE": str(held_prior[0]), "PYTHONPATH": path,
           "VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc, for worker_hooks
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with status {proc.returncode} before /health answered; "
                            f"{' '.join(argv)}\n--- last lines of its log ---\n{tail(log_path)}")
            if time.monotonic() - start > START_TIMEOUT_S:
                pytest.fail(f"no /health from the server after {START_TIMEOUT_S} s\n"
                            f"--- last lines of its log ---\n{tail(log_path)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        yield url, {"start_s": round(time.monotonic() - start, 1), "log": log_path}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server):
    import openai

    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def metric_total(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (all label sets) in Prometheus text format."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)")
    values = [float(m.group(1)) for line in text.splitlines() if (m := pattern.match(line))]
    assert values, f"{name} not in /metrics"
    return sum(values)


@pytest.mark.slow
def test_server_models(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    print(f"\nserver up in {server[1]['start_s']} s")


@pytest.mark.slow
def test_server_completions_stream_equals_non_stream(client):
    request = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=MAX_TOKENS, temperature=0,
                   extra_body=IGNORE_EOS)
    start = time.monotonic()
    full = client.completions.create(**request)
    text = full.choices[0].text
    assert text.strip() and full.usage.completion_tokens == MAX_TOKENS
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**request, stream=True)
                       if chunk.choices)
    assert streamed == text
    print(f"\ncompletions: {time.monotonic() - start:.1f} s for both, {text!r}")


@pytest.mark.slow
def test_server_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Write a Python function that returns the factorial of n."}]
    request = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=IGNORE_EOS)
    start = time.monotonic()
    full = client.chat.completions.create(**request)
    text = full.choices[0].message.content
    assert text and text.strip()
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices)
    assert streamed == text
    print(f"\nchat: {time.monotonic() - start:.1f} s for both, {text!r}")


@pytest.mark.slow
def test_server_spec_decode_metrics(client, server):
    # after the requests above (pytest runs a module's tests in file order); make sure of one
    # with drafts: the step cost pinned cheap, so that this machine's load cannot make the budget
    # send nothing to the random model
    collective_rpc(server[0], "recycling_pin_step_cost", "0.001")
    try:
        client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body=IGNORE_EOS)
    finally:
        collective_rpc(server[0], "recycling_unpin_step_cost")
    with urllib.request.urlopen(f"{server[0]}/metrics", timeout=30) as response:
        text = response.read().decode()
    drafts = metric_total(text, "vllm:spec_decode_num_drafts_total")
    accepted = metric_total(text, "vllm:spec_decode_num_accepted_tokens_total")
    print(f"\nspec decode over the server's requests: {drafts:.0f} drafts, {accepted:.0f} accepted tokens, "
          f"MAT {1 + accepted / drafts:.2f}")
    assert drafts > 0 and accepted > 0
    # the plugin's own histogram: one observation per request per step, accepted depth summed
    assert metric_total(text, "vllm_recycling:accepted_depth_count") == drafts
    assert metric_total(text, "vllm_recycling:accepted_depth_sum") == accepted


@pytest.mark.slow
def test_vllm_bench_serve_measures_the_server(server, tmp_path):
    """``vllm-recycling bench serve`` (vLLM's own harness, which the `vllm` script of vllm-cpu
    cannot start) against a recycling server: its spec_bench dataset over the shipped sample's
    coding prompts (a summarization prompt is longer than this server's 1024 tokens), its report
    with vLLM's acceptance length, its saved result. The step cost is pinned cheap for the run:
    vLLM reports no acceptance length where nothing was drafted, and on this random model the
    learnt cost of a loaded machine can make the budget send nothing."""
    pytest.importorskip("pandas")  # vLLM's spec_bench dataset reads the JSONL with it
    from vllm_recycling.tools.prompts import shipped_sample

    url, _ = server
    result = tmp_path / "result.json"
    collective_rpc(url, "recycling_pin_step_cost", "0.001")
    try:
        done = subprocess.run(
            [*command(), "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
             "--base-url", url, "--model", MODEL, "--tokenizer", str(tiny_model_dir()), "--dataset-name",
             "spec_bench", "--dataset-path", str(shipped_sample()), "--spec-bench-category", "coding",
             "--spec-bench-output-len", "16", "--num-prompts", "4", "--max-concurrency", "2",
             "--temperature", "0", "--disable-tqdm",
             "--save-result", "--result-dir", str(tmp_path), "--result-filename", result.name],
            capture_output=True, text=True, timeout=600, env=server_env())
    finally:
        collective_rpc(url, "recycling_unpin_step_cost")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Acceptance length" in done.stdout and "Output token throughput" in done.stdout
    saved = json.loads(result.read_text())
    assert saved["completed"] == 4
    assert saved["spec_decode_acceptance_length"] >= 1.0


def tiny_model_dir() -> Path:
    from vllm_recycling.tools.models import prepare_model

    return prepare_model(MODEL)


def collective_rpc(url: str, method: str, *args: str) -> None:
    body = json.dumps({"method": method, "args": list(args)}).encode()
    request = urllib.request.Request(f"{url}/collective_rpc", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def drafted(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return metric_total(response.read().decode(), "vllm:spec_decode_num_draft_tokens_total")


@pytest.mark.slow
def test_server_seeded_requests_give_the_tokens_of_no_speculation(client, server, tiny_base):
    """The eight settings of the seeded suite (``engines.SEEDED_SETTINGS``: min-p and logit bias
    included, which vLLM refuses with other speculative methods) sent at once through the
    OpenAI API to the recycling server (budget "auto", its step cost pinned cheap so that it
    sends drafts on this random model): the tokens of the in-process engine without
    speculation."""
    from concurrent.futures import ThreadPoolExecutor

    from engines import SEEDED_PROMPTS, SEEDED_SETTINGS, SEEDED_TOKENS

    def complete(i: int) -> list[int]:
        setting = dict(SEEDED_SETTINGS[i])
        extra = {**IGNORE_EOS, "return_token_ids": True}
        for key in ("top_k", "min_p", "repetition_penalty"):
            if key in setting:
                extra[key] = setting.pop(key)
        if "logit_bias" in setting:
            setting["logit_bias"] = {str(t): b for t, b in setting["logit_bias"].items()}
        answer = client.completions.create(
            model=MODEL, prompt=SEEDED_PROMPTS[i]["prompt_token_ids"], max_tokens=SEEDED_TOKENS,
            seed=100 + i, extra_body=extra, **setting,
        )
        return list(answer.choices[0].token_ids)

    url = server[0]
    collective_rpc(url, "recycling_pin_step_cost", "0.001")
    try:
        before = drafted(url)
        with ThreadPoolExecutor(len(SEEDED_SETTINGS)) as pool:
            got = list(pool.map(complete, range(len(SEEDED_SETTINGS))))
        sent = drafted(url) - before
    finally:
        collective_rpc(url, "recycling_unpin_step_cost")
    assert got == tiny_base["seeded"][: len(SEEDED_SETTINGS)]
    assert sent > 0  # verified with drafts, not decoded plainly
    print(f"\nseeded over HTTP: {sent:.0f} draft tokens sent")


def prior_children(path: Path) -> list[int]:
    """The pids of the processes computing the initial matrix ``path`` (``python -m
    vllm_recycling.warm ... --out path``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm_recycling.warm" in argv and str(path).encode() in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_server_survives_a_failed_computation_and_takes_a_matrix_in_later(client, server, held_prior):
    """The server answered before its initial matrix existed (every test above ran then). Its
    background computation is killed (as the kernel's OOM killer would): the server says so and
    goes on serving, greedy answers unchanged. A matrix written later (``vllm-recycling warm``
    run by hand) is still taken in while serving, and the greedy answers stay the same."""
    import torch

    from vllm_recycling.prior import save_prior

    log = server[1]["log"]
    assert "serving now with empty matrix rows" in log.read_text(errors="replace")
    prompts = ["def fibonacci(n):", "1, 2, 3, 4, 5,", "The quick brown fox"]

    def answers() -> list[str]:
        return [client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=IGNORE_EOS).choices[0].text for p in prompts]

    before = answers()
    _, path, lock = held_prior
    children = prior_children(path)  # waiting for the lock ``held_prior`` holds
    assert len(children) == 1, children
    os.kill(children[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while "failed (killed by SIGKILL" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.2)
    assert "serving goes on with matrix rows learnt from traffic only" in log.read_text(errors="replace")
    assert answers() == before
    assert "initial matrix taken in" not in log.read_text(errors="replace")
    vocab, k = TINY_VOCAB, 8
    table = torch.stack([(torch.arange(vocab) * 7 + d) % vocab for d in range(1, k + 1)], 1).int()
    save_prior(path, table, torch.full((vocab, k), 0.1, dtype=torch.float16), MODEL, 0.0)
    lock.__exit__()
    deadline = time.monotonic() + 60
    while "initial matrix taken in" not in log.read_text(errors="replace"):  # looked for between steps
        assert time.monotonic() < deadline, tail(log)
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
        time.sleep(0.5)
    assert answers() == before


def test_serve_bad_speculative_config_exits_before_loading(tiny_model):
    """A refused speculative_config ends the command with the plugin's message, quickly: before
    vLLM binds the port (held here by another socket, which vLLM's bind would fail on)."""
    spec = json.dumps({"method": "recycling", "topk": 0})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [*command(), "serve", MODEL, *SERVER_ARGS, "--host", "127.0.0.1", "--port", str(port),
                "--speculative-config", spec]
        start = time.monotonic()
        result = subprocess.run(argv, capture_output=True, text=True, env=server_env(), timeout=180,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        seconds = time.monotonic() - start
    assert result.returncode == cli.EXIT_USAGE, result.stderr[-4000:]
    assert 'vllm-recycling: error: speculative_config["topk"] = 0 is not valid' in result.stderr
    assert "Traceback" not in result.stderr
    output = result.stdout + result.stderr
    assert "Initializing a V1 LLM engine" not in output  # refused before an engine or a model load
    assert "Starting to load model" not in output
    print(f"\nbad speculative_config refused in {seconds:.1f} s")
