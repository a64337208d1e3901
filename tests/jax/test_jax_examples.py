"""The JAX scripts in examples/ run (on CPU here) and print their verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_flax_example_runs():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "flax_model.py"), "--steps", "2", "--seq-len", "16"],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "two runs bitwise equal: True" in proc.stdout, proc.stdout


def test_te_jax_encoder_example_runs_fp8():
    """The encoder built from transformer_engine.jax.flax's layers, its GEMMs in FP8 (DelayedScaling)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "te_jax_encoder.py"), "--steps", "3", "--fp8",
                           "delayed"], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fp8 delayed" in proc.stdout and "two runs bitwise equal: True" in proc.stdout, proc.stdout


def test_every_jax_example_is_tested():
    assert {p.name for p in (REPO / "examples").glob("*.py") if p.name.startswith(("flax", "jax", "te_jax"))} == {
        "flax_model.py", "te_jax_encoder.py"}
