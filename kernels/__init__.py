"""Triton kernels, each beside its PyTorch reference.

Every operation has one dispatcher (``draft_tree``, ``topk_update``) that picks the Triton kernel,
the C kernel or the PyTorch reference; callers never choose. Triton runs when the tensors are on
CUDA and triton imports, or when ``TRITON_INTERPRET=1`` is set (CPU tensors then go through
Triton's interpreter, which is how the kernel tests run without a GPU); other CPU tensors take
the C kernels of ``native`` where a C compiler built them; everything else takes the reference.

triton is imported lazily, on the first dispatch that wants it, so this package imports (and
``TRITON_INTERPRET`` can still be set) without it. The interpreter has to be selected before
triton is first imported: ``triton.language`` builds its own functions in one mode at import
time. ``triton_mode`` therefore reports the mode triton was actually imported in, and a process
whose environment asks for the interpreter after triton was imported compiled falls back to the
reference for CPU tensors instead of failing.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch

_TRUE = {"1", "true", "on", "yes", "y"}
_triton_state: dict[str, Any] = {}


def interpreter_requested() -> bool:
    """``TRITON_INTERPRET`` is set to a true value (read the way triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_mode() -> str | None:
    """How Triton kernels would run in this process now: ``"interpreted"``, ``"compiled"``, or
    None when triton does not import or its import mode disagrees with ``TRITON_INTERPRET``.

    Imports triton (once) if it is not imported yet.
    """
    if "module" not in _triton_state:
        try:
            import triton  # noqa: F401
            import triton.language as tl

            _triton_state["module"] = triton
            # tl.max is a @triton.jit function built when triton.language was imported.
            _triton_state["built"] = (
                "interpreted" if type(tl.max).__name__ == "InterpretedFunction" else "compiled"
            )
        except Exception as e:  # ImportError, or a broken install / driver
            _triton_state["module"] = None
            _triton_state["error"] = f"{type(e).__name__}: {e}"
    if _triton_state["module"] is None:
        return None
    built = _triton_state["built"]
    wanted = "interpreted" if interpreter_requested() else "compiled"
    if built != wanted:
        if not _triton_state.get("warned"):
            _triton_state["warned"] = True
            warnings.warn(
                f"TRITON_INTERPRET asks for {wanted} Triton kernels but triton was imported "
                f"{built}; set TRITON_INTERPRET before triton is first imported. Using the PyTorch "
                "references.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return built


def triton_usable(*tensors: torch.Tensor) -> bool:
    """Whether the dispatchers run Triton on these tensors (all on one device type):
    CUDA tensors with a working triton, or CPU tensors with ``TRITON_INTERPRET=1``."""
    kinds = {t.device.type for t in tensors}
    if kinds == {"cuda"}:
        return triton_mode() is not None
    if kinds == {"cpu"}:
        return interpreter_requested() and triton_mode() == "interpreted"
    return False


def jit(fn: Callable, helpers: dict[str, Callable] | None = None) -> Any:
    """``triton.jit(fn)``, made once per mode (compiled / interpreted) and cached.

    Kernels are plain module-level functions (string annotations, ``tl`` a module global that
    this fills in) so that defining them imports nothing. helpers: {global name: plain function}
    of the @jit functions the kernel calls; each is jitted and bound to its name in the kernel's
    module.
    """
    mode = triton_mode()
    if mode is None:
        raise RuntimeError(f"Triton kernels unavailable: {_triton_state.get('error', 'mode mismatch')}")
    cache = _triton_state.setdefault("jit", {})
    key = (fn.__module__, fn.__qualname__, mode)
    if key not in cache:
        fn.__globals__["tl"] = language()
        for name, helper in (helpers or {}).items():
            fn.__globals__[name] = jit(helper)
        cache[key] = _triton_state["module"].jit(fn)
    return cache[key]


def language():
    """``triton.language`` (imports triton)."""
    import triton.language as tl

    return tl


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
