"""The CPU image built and serving: ``docker build --target cpu`` (or podman), the container
started with ``--speculative-config '{"method": "recycling"}'`` on a model prepared on the host
and mounted, the README's chat request and a streaming one answered, and the greedy answer
compared with a server on the host.

    python benchmarks/image.py                                   # docker, python:3.11-slim
    python benchmarks/image.py --engine podman --engine-flags "--runtime runc" \\
        --base localhost/debian-bookworm-python \\
        --build-flags "-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"

Extra flags for the engine (``--engine-flags``: before the subcommand, e.g. podman's runtime),
for ``build`` (``--build-flags``: mounts, ``--build-arg``s) and for ``run`` (``--run-flags``)
are what a machine needs and the project does not commit (docs/deployment.md, "Building
without Docker Hub"). The container runs with the host's network (``--network host``), 4 GiB of /dev/shm, the
model's directory mounted read-only at /model and a fresh cache volume at /cache. Writes
``benchmarks/results/image_<tag>.{json,md}``: the build's time, the image's size, the
container's time to its first answer, and whether its greedy answers equal the host server's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import Server, free_port  # noqa: E402
from spec_bench import RESULTS, run_header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "vllm-recycling:cpu"
SPEC = {"method": "recycling"}
# vLLM's engine process shares its inputs with the worker through /dev/shm (160 MiB here); an
# engine's default of 64 MiB refuses to start ("Insufficient space in /dev/shm").
SHM = "4g"
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
# The README's request, and a second one streamed.
MESSAGES = [{"role": "user", "content": "What is speculative decoding?"}]
STREAMED = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def engine_cmd(args) -> list[str]:
    return [args.engine, *shlex.split(args.engine_flags)]


def build(args) -> float:
    """Build the image from a clean copy of the checkout's HEAD; seconds taken."""
    with tempfile.TemporaryDirectory(prefix="image-build-") as tmp:
        subprocess.run(["git", "clone", "-q", str(ROOT), tmp], check=True)
        cmd = [*engine_cmd(args), "build", "--target", "cpu", "-t", IMAGE,
               "--build-arg", f"CPU_BASE={args.base}", *shlex.split(args.build_flags), tmp]
        print("$", " ".join(cmd), flush=True)
        started = time.monotonic()
        subprocess.run(cmd, check=True)
        seconds = time.monotonic() - started
        print(f"built in {seconds:.0f} s", flush=True)
        return seconds


def image_size(args) -> int:
    out = subprocess.run([*engine_cmd(args), "image", "inspect", "--format", "{{.Size}}", IMAGE],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip())


def chat(url: str, model: str, messages, stream: bool = False) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=64)
        return reply.choices[0].message.content
    parts = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=64,
                                           stream=True)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import urllib.request

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the container exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"no /health from the container after {timeout} s")


def run_container(args, model_dir: Path, log_path: Path) -> dict:
    """Start the container, wait for it, ask both requests; its answers and times."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = f"vllm-recycling-bench-{port}"
    with tempfile.TemporaryDirectory(prefix="image-cache-") as cache:
        cmd = [*engine_cmd(args), "run", "--rm", "--name", name, "--network", "host", "--shm-size", SHM,
               "-v", f"{model_dir}:/model:ro", "-v", f"{cache}:/cache", *shlex.split(args.run_flags), IMAGE,
               "/model", "--served-model-name", args.model, *SERVER_ARGS, "--port", str(port),
               "--speculative-config", json.dumps(SPEC)]
        print("$", " ".join(cmd), flush=True)
        started = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_healthy(url, proc, args.timeout)
            healthy = time.monotonic() - started
            answer = chat(url, args.model, MESSAGES)
            answered = time.monotonic() - started
            streamed = chat(url, args.model, STREAMED, stream=True)
        finally:
            subprocess.run([*engine_cmd(args), "stop", "-t", "10", name], capture_output=True)
            proc.wait(timeout=60)
    return {"healthy_s": round(healthy, 1), "first_answer_s": round(answered, 1), "answer": answer,
            "streamed": streamed}


def run_host(args, log_path: Path) -> dict:
    """The same requests to a server on the host (``vllm-recycling serve``)."""
    with Server(args.model, SERVER_ARGS, SPEC, log_path, {}) as server:
        return {"answer": chat(server.url, args.model, MESSAGES),
                "streamed": chat(server.url, args.model, STREAMED, stream=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="docker" if shutil.which("docker") else "podman")
    parser.add_argument("--engine-flags", default="", help="flags before the engine's subcommand")
    parser.add_argument("--base", default="python:3.11-slim", help="the CPU image's base (build arg CPU_BASE)")
    parser.add_argument("--build-flags", default="", help="more flags for the build")
    parser.add_argument("--run-flags", default="", help="more flags for the container")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--skip-build", action="store_true", help="use the image built before")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    from vllm_recycling.tools.models import prepare_model

    model_dir = prepare_model(args.model)
    build_s = None if args.skip_build else build(args)
    size = image_size(args)
    logs = Path(tempfile.mkdtemp(prefix="image-logs-"))
    container = run_container(args, model_dir, logs / "container.log")
    host = run_host(args, logs / "host.log")
    report = {**run_header("image.py", args.model), "engine": args.engine, "base": args.base,
              "build_s": None if build_s is None else round(build_s, 1), "image_bytes": size,
              "container": container, "host": host,
              "same_answers": container["answer"] == host["answer"] and container["streamed"] == host["streamed"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"image_{args.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"image_{args.tag}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"logs: {logs}")


def markdown(r: dict) -> str:
    c = r["container"]
    return "\n".join([
        "# The CPU image, built and serving", "",
        f"{r['date']}; {r['machine']}; {r['engine']}, base `{r['base']}`; vLLM {r['vllm']}; model {r['model']} "
        f"(prepared on the host, mounted); server `{' '.join(SERVER_ARGS)}` with "
        f"`--speculative-config '{json.dumps(SPEC)}'`. Command: `{r['command']}`.", "",
        "| build | image size | container to /health | container to its first answer | greedy answers equal the host server's |",
        "|---|---|---|---|---|",
        f"| {'-' if r['build_s'] is None else f'{r_s(r)} s'} | {r['image_bytes'] / 2**30:.2f} GiB | "
        f"{c['healthy_s']} s | {c['first_answer_s']} s | {'yes' if r['same_answers'] else 'NO'} |", "",
        f"The README's request, answered in the container: {c['answer']!r}", "",
        f"Streamed: {c['streamed']!r}", ""])


def r_s(r: dict) -> str:
    return f"{r['build_s']:.0f}"


if __name__ == "__main__":
    main()
