"""The package's one cache folder, where the prepared models (``tools.models``), the initial
matrices (``prior``) and the compiled C kernels (``kernels.native``) are kept.

This module imports neither torch nor vLLM, nor any other module of the package: the kernels
find the folder without knowing what else is kept there.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "VLLM_RECYCLING_CACHE"  # the cache folder, where it is not the user's default


def cache_root() -> Path:
    """The cache root: ``$VLLM_RECYCLING_CACHE``, else ``$XDG_CACHE_HOME/vllm-recycling``,
    else ``~/.cache/vllm-recycling``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "vllm-recycling"
    return Path.home() / ".cache" / "vllm-recycling"
