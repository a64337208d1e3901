"""The package logger, ``transformer_engine``: a library logger that applications route.

It has no handler of its own and propagates, so ``logging.basicConfig(...)``, a handler on the
root logger or on ``"transformer_engine"`` receives its records like any other library's.
Its level follows NVTE_DEBUG x NVTE_DEBUG_LEVEL, read at each use: WARNING without NVTE_DEBUG,
INFO or DEBUG with it, unless the application has set a level on the ``transformer_engine`` logger
itself: that level is kept, with or without NVTE_DEBUG, until the application sets another (or
``logging.NOTSET``, which hands the level back to NVTE_DEBUG). As Python's logging conventions ask of a
library, the package configures its logger only where the application has not.

With NVTE_DEBUG=1 and no logging configured anywhere, Python would print nothing below WARNING
(its last-resort handler's level). For that case only, the logger carries a stand-in handler
while NVTE_DEBUG=1 that writes to stderr, and only when no other handler would receive the record
(none on this logger or an ancestor): once the application configures logging it is silent.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from transformer_engine.common import settings

__all__ = ["get_logger", "warn_once", "selected_backends"]

_LOGGER_NAME = "transformer_engine"
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
_FORMAT = "[%(levelname)s | %(name)s]: %(message)s"
_warned_once: set = set()
# The level this module last gave the logger: a different level found there was set by the application.
_applied_level = [logging.NOTSET]


class _DebugFallbackHandler(logging.Handler):
    """stderr for NVTE_DEBUG's records when the application has configured no logging at all."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and not isinstance(h, _SelectionRecorder) for h in logger.handlers):
                return  # routed by the application
            if not logger.propagate:
                break
            logger = logger.parent
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # pragma: no cover - as logging.Handler does
            self.handleError(record)


_FALLBACK = _DebugFallbackHandler()


def get_logger() -> logging.Logger:
    """The ``transformer_engine`` logger, its level set from the environment now unless the application
    has set one (see the module docstring)."""
    logger = logging.getLogger(_LOGGER_NAME)
    debug = settings.get("NVTE_DEBUG")
    level = _LEVELS[settings.get("NVTE_DEBUG_LEVEL")] if debug else logging.WARNING
    if debug and _FALLBACK not in logger.handlers:
        logger.addHandler(_FALLBACK)
    elif not debug and _FALLBACK in logger.handlers:
        logger.removeHandler(_FALLBACK)
    if logger.level not in (logging.NOTSET, _applied_level[0]):
        return logger  # the application's level: never overwritten, and never taken for ours
    if logger.level != level:  # setLevel clears every logger's cache: not on each attention call
        logger.setLevel(level)
    _applied_level[0] = level
    return logger


def warn_once(key: str, message: str) -> None:
    """Log ``message`` at WARNING the first time ``key`` is seen in this process."""
    if key in _warned_once:
        return
    _warned_once.add(key)
    get_logger().warning(message)


# The record attention selection logs (common/attention/backends.py select_backend): its first argument is the
# backend's name.
SELECTED = "Selected backend = %s"


class _SelectionRecorder(logging.Handler):
    def __init__(self, names: list) -> None:
        super().__init__(logging.INFO)
        self.names = names

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith(SELECTED) and record.args:
            self.names.append(record.args[0])


@contextlib.contextmanager
def selected_backends():
    """While open, the name of each attention backend selection picks, in order, read from its
    ``"Selected backend = ..."`` INFO record (PyTorch selects per call, JAX per trace: a cached jit trace
    selects nothing). The logger takes INFO meanwhile, so handlers the application attached at INFO see
    those records too."""
    names: list = []
    logger = logging.getLogger(_LOGGER_NAME)
    handler = _SelectionRecorder(names)
    level = logger.level
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)  # kept by get_logger while open (an application-set level)
    try:
        yield names
    finally:
        logger.removeHandler(handler)
        if logger.level != level:
            logger.setLevel(level)
