"""vLLM releases' own Python, for the tests that hold the adapters to each release's source.

``release_python(version)`` downloads vLLM's wheel from the package registry once (no
dependencies: ~340 MB, ~10 s here), keeps only its ``vllm/**.py`` under
``.vllm-releases/<version>/`` in the checkout (ignored by git, ~60 MB) and returns that folder.
Put first on ``PYTHONPATH``, it imports on this environment's CPU torch (its compiled kernels
are absent, so no engine runs there): ``run_with(version, code)`` runs a snippet that way, in a
process of its own. ``run034(code)`` runs one in the vLLM 0.34 CPU engine's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".vllm-releases"


def release_python(version: str) -> Path:
    """The folder holding vLLM ``version``'s Python package (``<folder>/vllm``)."""
    folder = CACHE / version
    done = folder / ".complete"
    if done.is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, f"vllm=={version}"],
            check=True, capture_output=True, text=True,
        )
        (wheel,) = Path(tmp).glob(f"vllm-{version}-*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(folder, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    done.write_text(version)
    return folder


def run_with(version: str, code: str, timeout: float = 300) -> dict:
    """Run ``code`` (which sets a JSON-able ``result``) in this environment's Python with
    release ``version``'s ``vllm`` in place of the installed one (the plugin as installed,
    editable from this checkout); returns ``result``."""
    return run_python(code, sys.executable, {"PYTHONPATH": str(release_python(version))}, timeout)


# The vLLM 0.34 CPU engine (Model Runner V2; ``make venv034`` installs it from the shared tools
# beside the checkout), with the plugin installed editable from this checkout. Every run sets
# TRITON_INTERPRET=1: Triton's interpreter runs vLLM's and the plugin's kernels on the CPU.
VENV034 = ROOT / ".venv034"


TOOLS034 = ROOT.parent / "shared" / "tools" / "vllm034-cpu" / "install.sh"
INSTALL_PID = ROOT / ".venv034.pid"  # `make test` installs the engine beside the suite (Makefile)
INSTALL_LOG = ROOT / ".venv034.log"


def _running(pid: int) -> bool:
    """Whether process ``pid`` is there and not a zombie (an ended child its shell has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return not Path("/proc").is_dir()
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def engine034_missing(wait_s: float = 1200.0) -> str | None:
    """Why the 0.34 engine cannot run here (a skip reason), None when it can. While ``make
    test`` installs it beside the suite (``INSTALL_PID`` names a process still running), waits
    for that install to end, at most ``wait_s``. Raises ``RuntimeError`` where the tools that
    build it are beside the checkout and it is not installed: its install failed."""
    deadline = time.monotonic() + wait_s
    try:
        pid = int(INSTALL_PID.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pid = None
    while pid is not None and _running(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM 0.34 CPU engine's install (pid {pid}) is still running after "
                               f"{wait_s:.0f} s: see {INSTALL_LOG}")
        time.sleep(2.0)
    if (VENV034 / ".installed").is_file():
        return None
    if TOOLS034.is_file():
        log = INSTALL_LOG.read_text(errors="replace")[-3000:] if INSTALL_LOG.is_file() else "(no log)"
        raise RuntimeError(f"the vLLM 0.34 CPU engine is not installed though {TOOLS034} is there: "
                           f"`make venv034` failed?\n{log}")
    return "the vLLM 0.34 CPU engine is not installed and its tools are not beside the checkout: make venv034"


def run034(code: str, timeout: float = 600, env: dict | None = None) -> dict:
    """Run ``code`` (which sets a JSON-able ``result``) in the vLLM 0.34 CPU engine's Python."""
    extra = {"TRITON_INTERPRET": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
             "OMP_NUM_THREADS": "1", **(env or {})}
    return run_python(code, str(VENV034 / "bin" / "python"), extra, timeout)


def run_python(code: str, python: str, env: dict, timeout: float) -> dict:
    env = {**os.environ, **env}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        script = (f"{code}\nimport json\nif __name__ == '__main__':\n"
                  f"    json.dump(main() if 'main' in globals() else result, open({out.name!r}, 'w'))\n")
        done = subprocess.run([python, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=tempfile.gettempdir())
        if done.returncode != 0:
            raise AssertionError(f"{python}: exit {done.returncode}\n{done.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())
