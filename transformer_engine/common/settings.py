"""Every ``NVTE_*`` environment variable the project reads, declared once.

Each variable has a name, a type, a default and a one-line description; ``docs/envvars.rst``
lists exactly these (``tests/common/test_envvars.py`` keeps the two equal). Values are read
at call time, never cached, so changing a variable between two calls takes effect on the second
(``os.environ``, which ``monkeypatch.setenv`` and :func:`environment` change too). Malformed values raise
``ValueError`` naming the variable. Caches of decisions key on :func:`snapshot_reader`'s tuple of the raw
values, read at each call like every other read here: a changed variable is a different key.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

__all__ = ["EnvVar", "VARIABLES", "get", "declared_names", "environment", "snapshot_reader"]


def _raw_reader(names: Tuple[str, ...]) -> Callable[[], tuple]:
    """A function returning the current raw values of ``names`` (None where unset), read from ``os.environ``.
    On POSIX CPython ``os.environ`` keeps its values in a dict by encoded name: reading that dict directly
    is one lookup per name where ``os.environ.get`` decodes and re-encodes each value, and attention reads a
    dozen variables per call. Elsewhere, ``os.environ.get``."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        keys = tuple(encode(name) for name in names)
        get = data.get
        if len(keys) == 1:
            key = keys[0]
            return lambda: (get(key),)
        return lambda: tuple(map(get, keys))
    return lambda: tuple(map(os.environ.get, names))


def snapshot_reader(names: Tuple[str, ...]) -> Callable[[], tuple]:
    """A function that returns the raw values of ``names`` now, as one tuple (None where unset): what a
    cache of decisions made from these variables keys on. Not parsed: a malformed value is reported by
    :func:`get` when the decision reads it."""
    return _raw_reader(tuple(names))


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: how to parse it and what it means."""

    name: str
    type: str  # "bool" (0/1), "int", or "str"
    default: Any
    description: str
    choices: Optional[Tuple[str, ...]] = None
    min_value: Optional[int] = None
    max_value: Optional[int] = None

    def parse(self, raw: str) -> Any:
        text = raw.strip()
        if self.type == "bool":
            if text not in ("0", "1"):
                raise ValueError(f"{self.name} must be 0 or 1, got {raw!r}")
            return text == "1"
        if self.type == "int":
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{self.name} must be an integer, got {raw!r}") from None
            if (self.min_value is not None and value < self.min_value) or (
                self.max_value is not None and value > self.max_value
            ):
                raise ValueError(
                    f"{self.name} must be in [{self.min_value}, {self.max_value}], got {value}"
                )
            return value
        if self.choices is not None and text.lower() not in self.choices:
            # The empty choice (unset: the default) is said in words, not listed as an empty name.
            named = ", ".join(c for c in self.choices if c)
            unset = " (or unset)" if "" in self.choices else ""
            raise ValueError(f"{self.name} must be one of {named}{unset}, got {raw!r}")
        return text.lower() if self.choices is not None else text

    def get(self) -> Any:
        raw = _reader(self.name)()[0]
        if raw is None:
            return self.default
        parsed = _parsed.get((self.name, raw), _UNPARSED)
        if parsed is _UNPARSED:  # parsed once per distinct raw value; a malformed one raises every time
            text = os.fsdecode(raw) if isinstance(raw, bytes) else raw
            parsed = self.default if text.strip() == "" else self.parse(text)
            if len(_parsed) < 4096:
                _parsed[(self.name, raw)] = parsed
        return parsed

    @property
    def type_doc(self) -> str:
        """The type as the env-var docs page spells it."""
        if self.type == "bool":
            return "bool (0 or 1)"
        if self.type == "int":
            return f"int ({self.min_value} to {self.max_value})" if self.max_value is not None else "int"
        if self.choices is not None:
            return "str (one of " + ", ".join(c for c in self.choices if c) + ")"
        return "str"

    @property
    def default_doc(self) -> str:
        if self.type == "bool":
            return "1" if self.default else "0"
        if self.default in ("", None):
            return "(unset)"
        return str(self.default)


_DECLARED = (
    EnvVar(
        "NVTE_FRAMEWORK", "str", "",
        "Build time: frameworks to build for (pytorch, jax, all, none, or a comma list); unset detects what is installed.",
    ),
    EnvVar(
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "bool", True,
        "0 makes attention backward passes bitwise deterministic (fused kernels stay selected).",
    ),
    EnvVar(
        "NVTE_BATCH_INVARIANT", "bool", False,
        "1 runs the modules' GEMMs and norms on batch-invariant kernels: a row's outputs and input gradients get "
        "the same bits in any batch.",
    ),
    EnvVar("NVTE_FUSED_ATTN", "bool", True, "0 disables the Triton fused attention backend."),
    EnvVar("NVTE_FLASH_ATTN", "bool", True, "0 disables the flash-attn-4 backend (PyTorch)."),
    EnvVar("NVTE_UNFUSED_ATTN", "bool", True, "0 disables the unfused (framework math) attention backend."),
    EnvVar(
        "NVTE_FUSED_ATTN_BACKEND", "str", "",
        "Forces one attention backend by name; a forced backend that cannot run a call raises with its reasons.",
        choices=("", "fused", "flash", "unfused"),
    ),
    EnvVar(
        "NVTE_FP8_DPA_BWD", "bool", True,
        "0 runs FP8 attention's (fp8_dpa) backward on the bf16/fp16 kernels from the dequantized FP8 operands; "
        "1 runs it in FP8 (dO in E5M2 under Format.HYBRID, E4M3 under Format.E4M3).",
    ),
    EnvVar(
        "NVTE_FP8_DPA_SCALING", "str", "",
        "FP8 attention's scales where a DotProductAttention's fp8_dpa_scaling attribute is unset: per_tensor "
        "(unset: TransformerEngine's) or per_sequence (Float8CurrentScaling only: one current scale per sequence "
        "and kv head, so a sequence's bits do not depend on its batch or packing).",
        choices=("", "per_tensor", "per_sequence"),
    ),
    EnvVar(
        "NVTE_FUSED_ATTN_WS", "bool", True,
        "0 keeps fused attention on its Triton kernels where the plan would pick the warp-specialized Gluon "
        "forward, dK/dV and dQ kernels (Hopper, fp16/bf16, no bias or dropout: d=128 and 256; the forward and dQ "
        "at d_qk 192 / d_v 128).",
    ),
    EnvVar(
        "NVTE_FUSED_ATTN_GLUON_PAGED", "bool", False,
        "1 lets the warp-specialized Gluon forward read a paged KV cache through its page table (TMA loads per "
        "page or per key block) where the page size fits its key blocks; 0 (the default until its GPU tests have "
        "run) leaves those configs to gather their pages into rows before the forward, which gives the same bits.",
    ),
    EnvVar(
        "NVTE_FUSED_ATTN_CACHED_LAUNCH", "bool", True,
        "0 launches every fused attention kernel through Triton's JIT call, which binds and specializes its "
        "arguments on each call, instead of through the compiled kernel cached by that specialization (PyTorch).",
    ),
    EnvVar(
        "NVTE_FUSED_ATTN_PLAN_ARCH", "str", "",
        "Plans fused attention with another GPU architecture's tile tables (e.g. sm80, gfx942) on this GPU, to "
        "test them: Triton kernels only, and only an architecture with at most this GPU's shared memory; unset: "
        "the GPU's own plan.",
        choices=("", "sm80", "sm89", "sm90", "sm100", "sm120", "gfx90a", "gfx942", "gfx950"),
    ),
    EnvVar(
        "NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK", "bool", False,
        "1 plans the Q/K head-dim split (e.g. 48 as 32 + 16, as Hopper's plan takes 192 as 128 + 64) under "
        "Triton's interpreter (CPU) wherever the head dim allows, so that CPU tests run the split kernels; GPU "
        "plans ignore it.",
    ),
    EnvVar(
        "NVTE_JAX_TRITON_INTERPRET", "bool", False,
        "1 lowers JAX's fused attention on CPU to the Triton kernels under Triton's interpreter (with TRITON_INTERPRET=1 "
        "set before their first import, and torch installed; slow) instead of jnp math; read when a call is lowered.",
    ),
    EnvVar("NVTE_DEBUG", "bool", False,
           "1 enables debug logging of attention backend selection and fused attention plans."),
    EnvVar(
        "NVTE_DEBUG_LEVEL", "int", 0,
        "Verbosity when NVTE_DEBUG=1: 0 warnings, 1 info (selected backend, fused attention plan), 2 debug (every "
        "rejected backend).",
        min_value=0, max_value=2,
    ),
)

VARIABLES = {var.name: var for var in _DECLARED}

_UNPARSED = object()
_parsed: Dict[Tuple[str, Any], Any] = {}  # (name, raw value) -> its parsed value
_readers: Dict[str, Callable[[], tuple]] = {}


def _reader(name: str) -> Callable[[], tuple]:
    reader = _readers.get(name)
    if reader is None:
        reader = _readers[name] = _raw_reader((name,))
    return reader


def declared_names() -> Tuple[str, ...]:
    return tuple(VARIABLES)


def get(name: str) -> Any:
    """Current value of a declared variable (read now, parsed, or its default)."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared NVTE_* variable (see transformer_engine.common.settings)") from None
    return var.get()


def _set_environment(values: Mapping[str, Optional[str]]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def environment(**values: Optional[str]) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the duration of the block; since every
    variable is read at call time, calls inside the block see the new values."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(saved)
