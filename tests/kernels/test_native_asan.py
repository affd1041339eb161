"""The C kernels under AddressSanitizer and UBSan: tests/kernels/asan_harness.c calls every
exported rc_* function over the layouts, dtypes and shapes vLLM can pick, each buffer a malloc of
exactly the bytes the kernel may touch, so a byte read or written past one fails this test (the
in-process tests only see an overflow that happens to crash). A second build allocates one
buffer a few bytes short and must be reported: proof that the harness's buffers are exact.

Skips only where no C compiler or no ASan runtime is found. Each build and run takes a few
seconds."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vllm_recycling.kernels import native

HARNESS = [Path(__file__).with_name(name) for name in ("asan_harness.c", "asan_kv.c")]  # + asan_harness.h
# native.py's flags that change what the kernels compute or accept; -O3, -shared and -fPIC
# give way to a debuggable, instrumented executable
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-march=native"]
FLAGS = SANITIZE + [f for f in native.FLAGS if f.startswith(("-std=", "-ffp-contract="))]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # ASan's runtime must come first (the Makefile's preloads would not)
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    return env


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> str:
    """The C compiler native.py builds with, once it has shown it can build and run a program
    under AddressSanitizer; else the test skips with the reason."""
    try:
        cc = native._compiler()
    except RuntimeError as e:
        pytest.skip(str(e))
    where = tmp_path_factory.mktemp("asan_check")
    (where / "empty.c").write_text("int main(void) { return 0; }\n")
    built = subprocess.run([cc, "-fsanitize=address", "-o", str(where / "empty"), str(where / "empty.c")],
                           capture_output=True, text=True, timeout=60)
    if built.returncode != 0:
        pytest.skip(f"{cc} cannot build with -fsanitize=address (no ASan runtime): {built.stderr.strip()[-300:]}")
    ran = subprocess.run([str(where / "empty")], capture_output=True, text=True, timeout=60, env=_env())
    if ran.returncode != 0:
        pytest.skip(f"an ASan program does not run here: {(ran.stdout + ran.stderr).strip()[-300:]}")
    return cc


@pytest.fixture(scope="module")
def harness(compiler, tmp_path_factory) -> dict[str, Path]:
    """The harness built as it is ("plain") and with -DRC_ASAN_PROBE ("probe"), both at once."""
    where = tmp_path_factory.mktemp("asan_harness")
    defines = {"plain": [], "probe": ["-DRC_ASAN_PROBE"]}
    builds = {
        name: subprocess.Popen([compiler, *FLAGS, *extra, "-o", str(where / name), *map(str, HARNESS),
                                *map(str, native.SOURCES), "-lm"], stderr=subprocess.PIPE, text=True)
        for name, extra in defines.items()
    }
    for name, build in builds.items():
        _, stderr = build.communicate(timeout=300)
        assert build.returncode == 0, f"{name}: {stderr[-3000:]}"
    return {name: where / name for name in builds}


def _run(exe: Path) -> tuple[int, str]:
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=_env())
    return ran.returncode, ran.stdout + ran.stderr


def test_every_kernel_stays_inside_its_buffers(harness):
    rc, output = _run(harness["plain"])
    assert "ERROR: AddressSanitizer" not in output, output[-6000:]
    assert "runtime error" not in output, output[-6000:]  # UBSan
    assert rc == 0 and " 0 mismatches" in output, output[-6000:]


def test_a_buffer_a_few_bytes_short_is_reported(harness):
    """-DRC_ASAN_PROBE: rc_copy_positions's cache 4 bytes short; its first copy, block 0 whole
    into the last block, writes the cache's last bytes."""
    rc, output = _run(harness["probe"])
    assert rc != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in output, output[-6000:]
    assert "in rc_copy_positions " in output, output[-6000:]  # from inside the kernel
