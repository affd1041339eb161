"""The C kernels under AddressSanitizer and UBSan: tests/kernels/asan_harness.c calls every
exported rc_* function over the layouts, dtypes and shapes vLLM can pick, each buffer a malloc of
exactly the bytes the kernel may touch, so a byte read or written past one fails this test (the
in-process tests only see an overflow that happens to crash).

What the probes prove: one build per exported kernel (-DRC_ASAN_PROBE=PROBE_<kernel>) runs that
kernel's cases with one buffer it writes to its last byte allocated a few bytes short (top-k's
argmax, the draft's tokens, the context match's lengths, the move's scratch, the copy's cache),
and must be reported from inside that kernel: ASan is active in every kernel's cases and those
buffers are exact. It does not prove every other buffer exact: that rests on the harness's
sizes, which are native.py's (each written out where the buffer is allocated).

Skips where no C compiler or no ASan runtime is found, except under CI (the environment variable
CI set, as CI services set it): there it fails, saying how to install the runtime, so a suite
cannot pass without this test having run. The builds take a few seconds, the runs a few more."""

from __future__ import annotations

import os
import re
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


# gcc's ASan runtime; `gcc -print-file-name=libasan.so` prints a full path once it is installed
INSTALL_ASAN = ("install gcc's AddressSanitizer runtime (Debian 12: `apt-get install libasan8`, gcc 12's; "
                "`gcc -print-file-name=libasan.so` then prints a full path)")
PROBES = {"PROBE_TOPK": "rc_topk_update", "PROBE_DRAFT": "rc_draft", "PROBE_CONTEXT": "rc_context_match",
          "PROBE_MOVE": "rc_move_slots", "PROBE_COPY": "rc_copy_positions"}  # asan_harness.h


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str):
    """Skip on a developer's machine; fail under CI, where a skip would let the suite pass
    without the kernels ever having run under ASan."""
    if in_ci():
        pytest.fail(f"{reason}; CI must run the ASan test: {INSTALL_ASAN}", pytrace=False)
    pytest.skip(f"{reason} ({INSTALL_ASAN})")


def asan_problem(cc: str, where: Path) -> str | None:
    """None when ``cc`` builds and runs an empty program under AddressSanitizer in ``where``,
    else why not."""
    (where / "empty.c").write_text("int main(void) { return 0; }\n")
    built = subprocess.run([cc, "-fsanitize=address", "-o", str(where / "empty"), str(where / "empty.c")],
                           capture_output=True, text=True, timeout=60)
    if built.returncode != 0:
        return f"{cc} cannot build with -fsanitize=address (no ASan runtime): {built.stderr.strip()[-300:]}"
    ran = subprocess.run([str(where / "empty")], capture_output=True, text=True, timeout=60, env=_env())
    if ran.returncode != 0:
        return f"an ASan program does not run here: {(ran.stdout + ran.stderr).strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> str:
    """The C compiler native.py builds with, once it has shown it can build and run a program
    under AddressSanitizer; else the test skips (fails under CI) with the reason."""
    try:
        cc = native._compiler()
    except RuntimeError as e:
        unavailable(str(e))
    problem = asan_problem(cc, tmp_path_factory.mktemp("asan_check"))
    if problem:
        unavailable(problem)
    return cc


def _build_all(cc: str, builds: dict[str, list[str]], objects: list[str] = ()) -> None:
    """Each name -> a program or object built from those arguments, all at once."""
    running = {name: subprocess.Popen([cc, *FLAGS, *args, *objects], stderr=subprocess.PIPE, text=True)
               for name, args in builds.items()}
    for name, build in running.items():
        _, stderr = build.communicate(timeout=300)
        assert build.returncode == 0, f"{name}: {stderr[-3000:]}"


@pytest.fixture(scope="module")
def harness(compiler, tmp_path_factory) -> dict[str, Path]:
    """The harness as it is ("plain") and one build per probe (PROBES' names): the kernels
    compiled once, the harness once per build."""
    where = tmp_path_factory.mktemp("asan_harness")
    objects = {f"{p.stem}.o": ["-c", "-o", str(where / f"{p.stem}.o"), str(p)] for p in native.SOURCES}
    _build_all(compiler, objects)
    defines = {"plain": []} | {probe: [f"-DRC_ASAN_PROBE={probe}"] for probe in PROBES}
    _build_all(compiler, {name: [*extra, "-o", str(where / name), *map(str, HARNESS)]
                                 for name, extra in defines.items()},
               [*(str(where / o) for o in objects), "-lm"])
    return {name: where / name for name in defines}


def _run(exe: Path) -> tuple[int, str]:
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=_env())
    return ran.returncode, ran.stdout + ran.stderr


def test_every_kernel_stays_inside_its_buffers(harness):
    rc, output = _run(harness["plain"])
    assert "ERROR: AddressSanitizer" not in output, output[-6000:]
    assert "runtime error" not in output, output[-6000:]  # UBSan
    assert rc == 0 and " 0 mismatches" in output, output[-6000:]
    calls = re.search(r"asan harness: (\d+) topk_update, (\d+) draft, (\d+) context_match, (\d+) move_slots, "
                      r"(\d+) copy_positions calls", output)
    assert calls and all(int(n) > 0 for n in calls.groups()), output[-2000:]  # every kernel ran


@pytest.mark.parametrize("probe", list(PROBES))
def test_a_buffer_a_few_bytes_short_is_reported(harness, probe):
    """-DRC_ASAN_PROBE=<probe>: that kernel's cases, one of its buffers 4 bytes short (see the
    module's docstring), reported from inside the kernel."""
    rc, output = _run(harness[probe])
    assert rc != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in output, output[-6000:]
    assert f"in {PROBES[probe]} " in output, output[-6000:]  # from inside the kernel


def test_a_missing_runtime_fails_under_ci_and_skips_elsewhere(monkeypatch, tmp_path):
    fake = tmp_path / "cc"  # a compiler whose link finds no ASan runtime
    fake.write_text("#!/bin/sh\necho '/usr/bin/ld: cannot find libasan.so.8: No such file or directory' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    problem = asan_problem(str(fake), tmp_path)
    assert problem and "no ASan runtime" in problem and "cannot find libasan.so.8" in problem
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install libasan8"):
        unavailable(problem)
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="apt-get install libasan8"):
        unavailable(problem)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        unavailable(problem)
