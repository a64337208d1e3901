"""transformer_engine.common.settings parses NVTE_* variables at call time, and the package logger
follows NVTE_DEBUG x NVTE_DEBUG_LEVEL."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_engine.common import log, settings

ROOT = Path(__file__).resolve().parents[2]

REQUIRED = (
    "NVTE_FRAMEWORK",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
    "NVTE_FUSED_ATTN_BACKEND",
    "NVTE_DEBUG",
    "NVTE_DEBUG_LEVEL",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in settings.VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_required_variables_are_declared():
    assert set(REQUIRED) <= set(settings.declared_names())


@pytest.mark.parametrize("name", sorted(settings.VARIABLES))
def test_declaration_is_complete(name):
    var = settings.VARIABLES[name]
    assert var.name == name
    assert var.type in ("bool", "int", "str")
    assert var.description.strip(), f"{name} has no description"
    assert var.get() == var.default  # unset -> default


@pytest.mark.parametrize("name", sorted(settings.VARIABLES))
def test_empty_value_means_default(monkeypatch, name):
    monkeypatch.setenv(name, "")
    assert settings.get(name) == settings.VARIABLES[name].default


def test_defaults():
    assert settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") is True
    assert settings.get("NVTE_FUSED_ATTN") is True
    assert settings.get("NVTE_UNFUSED_ATTN") is True
    assert settings.get("NVTE_DEBUG") is False
    assert settings.get("NVTE_DEBUG_LEVEL") == 0
    assert settings.get("NVTE_FUSED_ATTN_BACKEND") == ""


@pytest.mark.parametrize("raw, expected", [("0", False), ("1", True), (" 1 ", True)])
def test_bool_values(monkeypatch, raw, expected):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raw)
    assert settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") is expected


@pytest.mark.parametrize("raw", ["yes", "true", "2", "-1", "on"])
def test_malformed_bool_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raw)
    with pytest.raises(ValueError, match=r"NVTE_ALLOW_NONDETERMINISTIC_ALGO must be 0 or 1") as info:
        settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    assert repr(raw) in str(info.value)


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    assert settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") is True
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    assert settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") is False
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "yes")
    with pytest.raises(ValueError, match="NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    assert settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") is True


@pytest.mark.parametrize("raw", ["3", "-1", "debug", "1.5"])
def test_malformed_debug_level(monkeypatch, raw):
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", raw)
    with pytest.raises(ValueError, match="NVTE_DEBUG_LEVEL"):
        settings.get("NVTE_DEBUG_LEVEL")


@pytest.mark.parametrize("raw, expected", [("fused", "fused"), ("UNFUSED", "unfused"), (" flash ", "flash")])
def test_backend_choice(monkeypatch, raw, expected):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", raw)
    assert settings.get("NVTE_FUSED_ATTN_BACKEND") == expected


def test_malformed_backend_choice_lists_the_choices(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "cudnn")
    with pytest.raises(ValueError, match=r"NVTE_FUSED_ATTN_BACKEND must be one of .*fused.*'cudnn'"):
        settings.get("NVTE_FUSED_ATTN_BACKEND")


@pytest.mark.parametrize("name, raw, choices", [
    ("NVTE_FUSED_ATTN_BACKEND", "cudnn", "fused, flash, unfused"),
    ("NVTE_FUSED_ATTN_PLAN_ARCH", "sm70", "sm80, sm89, sm90, sm100, sm120, gfx90a, gfx942, gfx950"),
])
def test_malformed_choice_error_lists_no_empty_choice(monkeypatch, name, raw, choices):
    """Issue 69: the error read "must be one of , fused, flash, unfused" (the empty choice, unset, listed as a
    name). The empty choice is said as "(or unset)"."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError) as info:
        settings.get(name)
    assert str(info.value) == f"{name} must be one of {choices} (or unset), got {raw!r}"


def test_undeclared_name_is_rejected():
    with pytest.raises(KeyError, match="NVTE_NOT_A_VARIABLE is not a declared"):
        settings.get("NVTE_NOT_A_VARIABLE")


@pytest.mark.parametrize(
    "debug, level, expected",
    [
        (None, None, logging.WARNING),
        ("0", None, logging.WARNING),
        ("0", "2", logging.WARNING),  # NVTE_DEBUG_LEVEL alone changes nothing
        ("1", None, logging.WARNING),
        ("1", "0", logging.WARNING),
        ("1", "1", logging.INFO),
        ("1", "2", logging.DEBUG),
    ],
)
def test_logger_level_follows_debug_and_level(monkeypatch, debug, level, expected):
    if debug is not None:
        monkeypatch.setenv("NVTE_DEBUG", debug)
    if level is not None:
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", level)
    logger = log.get_logger()
    assert logger.name == "transformer_engine"
    assert logger.level == expected


def test_logger_level_is_read_at_each_use(monkeypatch):
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    assert log.get_logger().level == logging.DEBUG
    monkeypatch.setenv("NVTE_DEBUG", "0")
    assert log.get_logger().level == logging.WARNING
    assert log.get_logger() is logging.getLogger("transformer_engine")  # one package logger
    assert log.get_logger().handlers == []  # NVTE_DEBUG off: no handler of the package's own


def test_logger_propagates_to_the_application(monkeypatch):
    """An application routes the package's records: they reach a handler on the root logger."""
    monkeypatch.delenv("NVTE_DEBUG", raising=False)
    root = logging.getLogger()
    collect = _Collect()
    root.addHandler(collect)
    try:
        logger = log.get_logger()
        assert logger.propagate and logger.handlers == []
        logger.warning("routed warning")
        monkeypatch.setenv("NVTE_DEBUG", "1")
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", "1")
        log.get_logger().info("routed info")
    finally:
        root.removeHandler(collect)
    assert collect.messages == ["routed warning", "routed info"]


def test_application_level_is_kept_with_or_without_nvte_debug(monkeypatch):
    monkeypatch.delenv("NVTE_DEBUG", raising=False)
    logger = log.get_logger()
    try:
        logger.setLevel(logging.ERROR)
        assert log.get_logger().level == logging.ERROR
        monkeypatch.setenv("NVTE_DEBUG", "1")
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
        assert log.get_logger().level == logging.ERROR  # the application's level wins over NVTE_DEBUG
        monkeypatch.delenv("NVTE_DEBUG")
        assert log.get_logger().level == logging.ERROR
    finally:
        logger.setLevel(logging.NOTSET)  # NOTSET hands the level back to NVTE_DEBUG
        assert log.get_logger().level == logging.WARNING


@pytest.mark.parametrize("debug", [None, "1"])
@pytest.mark.parametrize("app_level", [logging.DEBUG, logging.INFO, logging.ERROR])
def test_application_level_survives_repeated_log_calls(monkeypatch, debug, app_level):
    """A level the application sets before the package logs is kept at every later call: the first
    call used to record it as the package's own, and the second reset it to WARNING."""
    monkeypatch.delenv("NVTE_DEBUG", raising=False)
    log.get_logger()  # the package has logged before the application configures logging
    if debug is not None:
        monkeypatch.setenv("NVTE_DEBUG", debug)
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", "1")
    logger = logging.getLogger("transformer_engine")
    collect = _Collect()
    logger.addHandler(collect)
    try:
        logger.setLevel(app_level)
        for n in range(3):
            assert log.get_logger().level == app_level, f"call {n}"
            log.get_logger().info(f"info {n}")
    finally:
        logger.removeHandler(collect)
        logger.setLevel(logging.NOTSET)
    expected = [f"info {n}" for n in range(3)] if app_level <= logging.INFO else []
    assert collect.messages == expected
    monkeypatch.delenv("NVTE_DEBUG", raising=False)
    assert log.get_logger().level == logging.WARNING  # unset again: the package configures it


_UNCONFIGURED_CHILD = (
    "import logging, sys\n"
    "from transformer_engine.common import log\n"
    "if sys.argv[1] == 'configured':\n"
    "    logging.basicConfig(stream=sys.stdout, format='APP %(name)s %(message)s')\n"
    "log.get_logger().info('selected something')\n"
)


@pytest.mark.parametrize("configured", ["configured", "unconfigured"])
def test_nvte_debug_prints_with_or_without_application_logging(configured):
    """NVTE_DEBUG=1 still prints INFO when nothing is configured (stderr), and exactly once through
    the application's handler when logging is configured (no duplicate from the package)."""
    env = dict(os.environ, NVTE_DEBUG="1", NVTE_DEBUG_LEVEL="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _UNCONFIGURED_CHILD, configured], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if configured == "configured":
        assert proc.stdout.splitlines() == ["APP transformer_engine selected something"], proc.stdout
        assert "selected something" not in proc.stderr, proc.stderr
    else:
        assert proc.stderr.splitlines() == ["[INFO | transformer_engine]: selected something"], proc.stderr


def test_malformed_debug_fails_when_logging(monkeypatch):
    monkeypatch.setenv("NVTE_DEBUG", "yes")
    with pytest.raises(ValueError, match="NVTE_DEBUG must be 0 or 1"):
        log.get_logger()


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_warn_once():
    key = "test_settings:warn_once"
    log._warned_once.discard(key)
    collect = _Collect()
    logger = log.get_logger()
    logger.addHandler(collect)
    try:
        log.warn_once(key, "first warning")
        log.warn_once(key, "first warning")
    finally:
        logger.removeHandler(collect)
        log._warned_once.discard(key)
    assert collect.messages == ["first warning"]


def test_environment_sets_and_restores(monkeypatch):
    monkeypatch.setenv("TE_TEST_A", "old")
    monkeypatch.delenv("TE_TEST_B", raising=False)
    with pytest.raises(RuntimeError):
        with settings.environment(TE_TEST_A=None, TE_TEST_B="new"):
            assert "TE_TEST_A" not in os.environ and os.environ["TE_TEST_B"] == "new"
            raise RuntimeError
    assert os.environ["TE_TEST_A"] == "old" and "TE_TEST_B" not in os.environ
