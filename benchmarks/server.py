"""A vLLM OpenAI-compatible server for the benchmarks: ``vllm-recycling serve MODEL ...`` started
as a subprocess on a free port of 127.0.0.1, waited for on ``/health``, read through
``/metrics`` and stopped with every process it spawned. serve_bench.py and soak.py drive their
load against it; what they measure stays in them.

    with Server("smollm2", ["--dtype", "float32"], spec, log_path, env={}) as server:
        ...  # server.url answers /v1/...

The server runs in a process group of its own (API server, engine core, worker), so stopping it
ends the whole group, and the group's resident memory can be read (``group_rss_kib``).
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
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 300
# /metrics counters -> the names the benchmarks report them under.
COUNTERS = {"vllm:generation_tokens_total": "tokens",
            "vllm:spec_decode_num_accepted_tokens_total": "accepted",
            "vllm:spec_decode_num_drafts_total": "drafts",
            "vllm:spec_decode_num_draft_tokens_total": "draft_tokens"}


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_rss_kib(pgid: int) -> dict[str, int]:
    """VmRSS (KiB) of each live process in process group ``pgid``, keyed "name pid"."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[2]) != pgid:
                continue
            status = (entry / "status").read_text()
        except (OSError, ValueError):
            continue  # gone meanwhile
        name = re.search(r"^Name:\s*(.*)$", status, re.MULTILINE).group(1)
        rss = re.search(r"^VmRSS:\s*(\d+)", status, re.MULTILINE)
        if rss:
            out[f"{name} {entry.name}"] = int(rss.group(1))
    return out


class Server:
    """``vllm-recycling serve MODEL ...`` in its own process group. ``start`` launches it,
    ``wait_ready`` waits for ``/health``; ``stop`` ends the group. As a context manager it does
    all three, and stops the group if it never became ready."""

    def __init__(self, model: str, args: list[str], spec: dict | None, log_path: Path,
                 env: dict[str, str]):
        """``model``: what ``vllm-recycling serve`` is given (a name of
        vllm_recycling.tools.models, already prepared, or a path); ``args``: more ``vllm serve``
        arguments (the host and port are added); ``spec``: the ``--speculative-config``, None for
        none; ``log_path``: the server's stdout and stderr; ``env``: variables set for the server
        on top of this process's environment."""
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The console script next to this interpreter, else the module it runs.
        script = Path(sys.executable).with_name("vllm-recycling")
        cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "vllm_recycling.cli"]
        self.argv = [*cmd, "serve", model, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        if spec is not None:
            self.argv += ["--speculative-config", json.dumps(spec)]
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds from start to the first healthy /health
        self._started = 0.0

    def start(self) -> Server:
        # A new session, so that stop reaches the engine core and worker the API server spawns.
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                         start_new_session=True)
        self._started = time.monotonic()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Returns once ``/health`` answers 200; raises RuntimeError, with the end of the log, if
        the server exits first or ``timeout`` seconds pass."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before "
                                   f"/health answered: {' '.join(self.argv)}\n{self.tail()}")
            if time.monotonic() - self._started > timeout:
                raise RuntimeError(f"no /health after {timeout} s: {' '.join(self.argv)}\n{self.tail()}")
            if self.health() == 200:
                self.start_s = round(time.monotonic() - self._started, 1)
                return
            time.sleep(1)

    def health(self) -> int | None:
        """The HTTP status of ``/health``, None if nothing answered."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_kib(self) -> dict[str, int]:
        """VmRSS (KiB) of each process of the server's group ({} once it has stopped)."""
        return group_rss_kib(self.proc.pid) if self.alive() else {}

    def metrics(self) -> dict[str, float]:
        """Totals of the generation and spec-decode COUNTERS of ``/metrics`` (summed over their
        labels); raises OSError if ``/metrics`` does not answer."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        totals = dict.fromkeys(COUNTERS.values(), 0.0)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in COUNTERS:
                totals[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
        return totals

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL to what is left of it."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.monotonic() + 10  # the engine core may outlive the API server a moment
        while group_rss_kib(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Server:
        self.start()
        try:
            self.wait_ready()
        except BaseException:  # `with` calls no __exit__ when __enter__ raises
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
