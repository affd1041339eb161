"""Triton's interpreter, as the tests run vLLM's and the plugin's Triton kernels on the CPU."""

from __future__ import annotations


def skip_discarded_overflow_checks(worker=None) -> None:
    """Stop Triton's interpreter computing an integer overflow check for every integer add, sub
    and mul of every kernel, in this process (``worker``: for ``llm.collective_rpc``). The
    interpreter computes each check (a cast to int64, the operation again, two comparisons) and
    then drops it: its ``device_assert`` does nothing unless the options' ``debug`` is set,
    which the interpreter never sets (triton 3.x, ``runtime/interpreter.py``
    ``InterpreterOptions``, and ``language/semantic.py`` ``device_assert``); a GPU build without
    debug does not emit them either. Nothing the kernels compute or check changes, and each
    interpreted step takes about a fifth less time."""
    del worker
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
