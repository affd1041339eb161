"""Where the kernel tests run: Triton's interpreter on CPU tensors, or compiled on CUDA.

triton builds ``triton.language`` in one mode (compiled or interpreted) when it is first
imported, so the interpreter has to be chosen before that. At import time this conftest (loaded
while pytest collects, before any test runs) therefore:

- on a machine with CUDA: leaves triton alone; the kernel tests run compiled on the GPU
  (``device`` "cuda", marked ``gpu``) and the CPU / interpreter variants skip;
- otherwise: sets ``TRITON_INTERPRET=1``, imports triton in interpreter mode, and puts the
  variable back as it was. The variable is set again only inside the kernel tests (fixture
  ``interpreter``), so the rest of the suite (other test files in this pytest process, e.g.
  the reference decoder on a real model) keeps the PyTorch references for CPU tensors instead
  of crawling through the interpreter.

If triton was already imported compiled (by something else, before this file), the
interpreter tests skip with that reason rather than give wrong results.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()


def _prepare_interpreter() -> str | None:
    """None when the interpreter is ready, else why the CPU kernel tests must skip."""
    if CUDA:
        return "CUDA is available: this process runs the Triton kernels compiled (the 'cuda' tests)"
    already = "triton" in sys.modules
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
    except Exception as e:  # not installed or broken
        return f"triton does not import: {type(e).__name__}: {e}"
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    if type(tl.max).__name__ != "InterpretedFunction":
        return (
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1, "
            "so its interpreter is off in this process; run `TRITON_INTERPRET=1 pytest tests/kernels`"
            + (" (triton was already in sys.modules)" if already else "")
        )
    return None


INTERPRETER_SKIP = _prepare_interpreter()


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter on for this test (CPU tensors dispatch to the kernels)."""
    if INTERPRETER_SKIP:
        pytest.skip(INTERPRETER_SKIP)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The device the kernel runs on: CPU through the interpreter, or CUDA compiled."""
    if request.param == "cuda":
        if not CUDA:
            pytest.skip("needs CUDA")
    else:
        request.getfixturevalue("interpreter")
    return torch.device(request.param)


@pytest.fixture
def reversed_programs(interpreter, monkeypatch):
    """The interpreter runs a grid's programs one by one in id order, so a kernel whose
    duplicate rows all wrote would still look "last wins". This runs them in reverse order
    (every grid axis), which exposes that, and changes which split of a row arrives last."""
    from triton.runtime import interpreter as triton_interpreter

    builder = getattr(triton_interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "set_grid_idx"):
        pytest.skip("this triton's interpreter has no InterpreterBuilder.set_grid_idx to patch")
    original = builder.set_grid_idx

    def set_grid_idx(self, x, y, z):
        nx, ny, nz = self.grid_dim
        original(self, nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
