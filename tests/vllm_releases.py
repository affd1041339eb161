"""vLLM releases' own Python, for the tests that hold the adapters to each release's source.

``release_python(version)`` downloads vLLM's wheel from the package registry once (no
dependencies: ~340 MB, ~10 s here), keeps only its ``vllm/**.py`` under
``.vllm-releases/<version>/`` in the checkout (ignored by git, ~60 MB) and returns that folder.
Put first on ``PYTHONPATH``, it imports on this environment's CPU torch (its compiled kernels
are absent, so no engine runs there): ``run_with(version, code)`` runs a snippet that way, in a
process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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
    env = {**os.environ, "PYTHONPATH": str(release_python(version))}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        script = f"{code}\nimport json\njson.dump(result, open({out.name!r}, 'w'))\n"
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=tempfile.gettempdir())
        if done.returncode != 0:
            raise AssertionError(f"vLLM {version}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())
