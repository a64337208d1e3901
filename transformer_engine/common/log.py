"""The package logger, configured from NVTE_DEBUG x NVTE_DEBUG_LEVEL at each use."""

from __future__ import annotations

import logging

from transformer_engine.common import settings

_LOGGER_NAME = "transformer_engine"
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
_warned_once: set = set()


def get_logger() -> logging.Logger:
    """The ``transformer_engine`` logger, its level set from the environment now."""
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(levelname)s | %(name)s]: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    level = _LEVELS[settings.get("NVTE_DEBUG_LEVEL")] if settings.get("NVTE_DEBUG") else logging.WARNING
    if logger.level != level:  # setLevel clears every logger's cache: not on each attention call
        logger.setLevel(level)
    return logger


def warn_once(key: str, message: str) -> None:
    """Log ``message`` at WARNING the first time ``key`` is seen in this process."""
    if key in _warned_once:
        return
    _warned_once.add(key)
    get_logger().warning(message)
