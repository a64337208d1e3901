"""JAX test setup, done before JAX starts its backend:

- 8 CPU host devices for the sharding tests;
- LLVM -O0 for XLA's CPU code generation: compiling dominates these small tests, and -O0 halves
  it (numerics are IEEE either way; the CPU path's bitwise properties come from its fixed-order
  sums, not from the optimizer). Set ``--xla_backend_optimization_level`` yourself to override.
"""

import os
import sys

_FLAGS = {
    "xla_force_host_platform_device_count": "8",
    "xla_backend_optimization_level": "0",
}
_existing = os.environ.get("XLA_FLAGS", "")
_added = [f"--{name}={value}" for name, value in _FLAGS.items() if name not in _existing]
os.environ["XLA_FLAGS"] = " ".join([_existing, *_added]).strip()

# Helpers (te_jax_testing.py) import from this directory.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

jax = pytest.importorskip("jax", reason="JAX is not installed")


@pytest.fixture(autouse=True)
def _clean_attention_env(monkeypatch):
    """Each test starts from the default settings: no NVTE_* switch or XLA determinism flag leaks in."""
    for name in (
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
        "NVTE_FUSED_ATTN",
        "NVTE_FLASH_ATTN",
        "NVTE_UNFUSED_ATTN",
        "NVTE_FUSED_ATTN_BACKEND",
        "NVTE_DEBUG",
        "NVTE_DEBUG_LEVEL",
    ):
        monkeypatch.delenv(name, raising=False)
    flags = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "deterministic_ops" not in f
    )
    monkeypatch.setenv("XLA_FLAGS", flags)
    yield
