"""What the plugin's logger says during a call, for tests that check a decision is said once."""

from __future__ import annotations

import logging
from typing import Any, Callable


def warnings_of(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``run()``'s result and the messages the plugin's logger warned with meanwhile."""
    from vllm_recycling import LOGGER_NAME

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    try:
        result = run()
    finally:
        logger.removeHandler(handler)
    return result, warnings
