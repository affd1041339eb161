"""A new user's first start: ``make serve`` on a fresh clone with an empty cache, to the README's
chat request answered, then the initial matrix computed beside serving and taken in.

    python benchmarks/first_start.py --runs 3      # about 6 minutes a run on 2 cores

Each run clones this checkout's HEAD into a temporary folder and runs ``make serve PORT=...``
there with ``VLLM_RECYCLING_CACHE`` an empty temporary folder, so it sets up its own virtual
environment (from pip's cache on this machine: the packages are not downloaded again) and
converts the model. It times, from the command's start: the server's /health, the README's chat
request answered (``temperature=0, max_tokens=64``, "What is speculative decoding?"), the initial
matrix's file in the cache, and the server's log line that it was taken in. Meanwhile one
client sends that request again and again; each answer's tokens/s and steps/s (steps = tokens -
accepted tokens, from /metrics) are kept for "during" (before the file exists) and "after" (once
taken in), so the cost of the computation on the requests served meanwhile reads apart from the
matrix's effect on acceptance. Writes ``benchmarks/results/first_start.{json,md}``.

    python benchmarks/first_start.py --warm --runs 3

times ``vllm-recycling warm smollm2`` (this checkout's environment, the model already prepared)
with an empty cache of initial matrices, and writes ``benchmarks/results/warm.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import RESULTS, run_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is speculative decoding?"
MAX_TOKENS = 64


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.M)
    return sum(float(v) for v in pattern.findall(text))


def ask(url: str, model: str = "smollm2") -> dict:
    """The README's chat request; its tokens, seconds and accepted tokens."""
    accepted = metric(url, "vllm:spec_decode_num_accepted_tokens_total")
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
                       "messages": [{"role": "user", "content": QUESTION}]}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    seconds = time.monotonic() - started
    tokens = answer["usage"]["completion_tokens"]
    accepted = metric(url, "vllm:spec_decode_num_accepted_tokens_total") - accepted
    return {"tokens": tokens, "seconds": seconds, "accepted": accepted,
            "text": answer["choices"][0]["message"]["content"]}


def up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def one_run(port: int, after_s: float, limit_s: float, model: str = "smollm2", dtype: str = "float32") -> dict:
    work = Path(tempfile.mkdtemp(prefix="first-start-"))
    clone, cache = work / "clone", work / "cache"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {**os.environ, "VLLM_RECYCLING_CACHE": str(cache)}
    env.pop("VIRTUAL_ENV", None)
    log_path = work / "serve.log"
    url = f"http://127.0.0.1:{port}"
    times: dict[str, float] = {}
    answers: dict[str, list[dict]] = {"during": [], "after": []}
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["make", "serve", f"PORT={port}", f"MODEL={model}", f"DTYPE={dtype}"], cwd=clone,
                                env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while not up(url):
            if proc.poll() is not None or time.monotonic() - start > limit_s:
                raise RuntimeError(f"no server: {log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(1)
        times["health_s"] = time.monotonic() - start
        first = ask(url, model)
        times["answered_s"] = time.monotonic() - start
        print(f"answered after {times['answered_s']:.0f} s: {first['text'][:60]!r}", flush=True)
        while time.monotonic() - start < limit_s:
            text = log_path.read_text(errors="replace")
            if "first_rows_s" not in times and "initial matrix taken in" in text:
                times["first_rows_s"] = time.monotonic() - start  # its first rows: the common tokens
            if "prior_cached_s" not in times and re.search(r"initial matrix of \S+ computed in [\d.]+ s", text):
                times["prior_cached_s"] = time.monotonic() - start
            if "taken_in_s" not in times and re.search(r"taken in up to token (\d+) of \1 ", text):
                times["taken_in_s"] = time.monotonic() - start
            if "taken_in_s" in times and time.monotonic() - start > times["taken_in_s"] + after_s:
                break
            result = ask(url, model)
            phase = "after" if "taken_in_s" in times else "during" if "prior_cached_s" not in times else None
            if phase:
                answers[phase].append(result)
        lines = [line.replace(str(work), "<run dir>")  # no machine paths in results
                 for line in log_path.read_text(errors="replace").splitlines() if "initial matrix" in line]
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=30)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for phase, rows in answers.items():
        tokens = sum(r["tokens"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        steps = sum(r["tokens"] - r["accepted"] for r in rows)
        summary[phase] = {"requests": len(rows), "tokens_per_s": tokens / seconds if seconds else None,
                          "steps_per_s": steps / seconds if seconds else None,
                          "tokens_per_step": tokens / steps if steps else None}
    return {**{k: round(v, 1) for k, v in times.items()}, "phases": summary, "first_answer": first["text"],
            "log": lines}


def warm_runs(runs: int, name: str = "smollm2", dtype: str = "float32", tag: str = "") -> int:
    """Seconds of ``vllm-recycling warm NAME``, each with an empty cache of initial matrices, and
    the peak resident memory of the computation's process (the child's engine and pass)."""
    import resource

    script = Path(sys.executable).with_name("vllm-recycling")
    model = subprocess.run([str(script), "-q", "model", name], check=True, capture_output=True,
                           text=True).stdout.strip()
    seconds, computed = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as cache:
            (Path(cache) / "models").mkdir()
            (Path(cache) / "models" / name).symlink_to(model)
            started = time.monotonic()
            out = subprocess.run([str(script), "warm", name, "--dtype", dtype], check=True, capture_output=True,
                                 text=True, env={**os.environ, "VLLM_RECYCLING_CACHE": cache})
            seconds.append(round(time.monotonic() - started, 1))
            found = re.findall(r"computed in ([0-9.]+) s", out.stderr)
            computed.append(float(found[-1]) if found else None)
        print(f"warm: {seconds[-1]} s (engine and computation {computed[-1]} s)", flush=True)
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child's peak
    header = run_header("first_start.py", name)
    text = "\n".join([
        f"# `vllm-recycling warm {name} --dtype {dtype}` with an empty cache", "",
        f"{header['date']}; {header['machine']}; LD_PRELOAD {header['ld_preload']}. Command: "
        f"`{header['command']}`.", "",
        "Wall seconds of the command (its start-up, the child's engine, the batched pass over the "
        "vocabulary, the file written), each run with an empty cache of initial matrices; the last "
        "column: what the child reports for its engine and the pass.", "",
        "| run | seconds | engine + pass |", "|---|---|---|",
        *[f"| {i} | {s} | {c} |" for i, (s, c) in enumerate(zip(seconds, computed), 1)],
        "", f"Median {statistics.median(seconds):.1f} s, at most {max(seconds):.1f} s. Peak resident "
        f"memory of the computation's process: {peak_mib:,.0f} MiB.",
    ]) + "\n"
    print(text)
    (RESULTS / f"warm{tag}.md").write_text(text)
    (RESULTS / f"warm{tag}.json").write_text(json.dumps({"header": header, "seconds": seconds,
                                                        "engine_and_pass_s": computed, "peak_rss_mib": peak_mib},
                                                       indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--after-s", type=float, default=30.0, help="requests after the matrix is taken in")
    parser.add_argument("--limit-s", type=float, default=900.0, help="give a run up after this long")
    parser.add_argument("--warm", action="store_true", help="time `vllm-recycling warm MODEL` instead")
    parser.add_argument("--model", default="smollm2", help="a name known to `vllm-recycling model`")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tag", default="", help="results: first_start<tag>, warm<tag>")
    args = parser.parse_args(argv)
    if args.warm:
        return warm_runs(args.runs, args.model, args.dtype, args.tag)
    runs = []
    for i in range(args.runs):
        run = one_run(args.port, args.after_s, args.limit_s, args.model, args.dtype)
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "log"}), flush=True)
    header = run_header("first_start.py", args.model)

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    lines = [
        f"# First start: `make serve MODEL={args.model} DTYPE={args.dtype}` on a fresh clone, empty cache", "",
        f"{header['date']}; {header['machine']}. Command: `{header['command']}`.", "",
        "Seconds from `make serve`'s start (set-up included: a new virtual environment from pip's "
        "cache on this machine, the model's download and conversion). Answered: the README's chat "
        f"request (temperature 0, max_tokens {MAX_TOKENS}). First rows: the server took in the "
        "initial matrix's first rows (the common tokens); cached: the background computation "
        "finished its file; taken in: the server took its last rows. During / after: one client "
        "sending the same request again and again before the file existed and after it was "
        "taken in (tokens/s; steps/s, which the matrix does not change, shows the computation's "
        "cost on the requests served meanwhile).", "",
        "| run | /health s | answered s | first rows s | cached s | taken in s | during: requests, tok/s, "
        "steps/s, tok/step | after: requests, tok/s, steps/s, tok/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        cells = []
        for phase in ("during", "after"):
            p = r["phases"][phase]
            cells.append(f"{p['requests']}, {fmt(p['tokens_per_s'])}, {fmt(p['steps_per_s'])}, "
                         f"{fmt(p['tokens_per_step'], '.2f')}")
        lines.append(f"| {i} | {r['health_s']} | {r['answered_s']} | {r.get('first_rows_s', '-')} | "
                     f"{r.get('prior_cached_s', '-')} | {r.get('taken_in_s', '-')} | {cells[0]} | {cells[1]} |")
    answered = [r["answered_s"] for r in runs]
    cached = [r["prior_cached_s"] for r in runs if "prior_cached_s" in r]
    lines += ["", f"Answered: median {statistics.median(answered):.0f} s, at most {max(answered):.0f} s. "
              + (f"Cached: median {statistics.median(cached):.0f} s, at most {max(cached):.0f} s." if cached else ""),
              "", "The server's lines about the initial matrix (last run):", "", "```", *runs[-1]["log"], "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"first_start{args.tag}.md").write_text(text)
    (RESULTS / f"first_start{args.tag}.json").write_text(json.dumps({"header": header, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
