"""What the PyTorch and JAX determinism-check tests share: tiny sizes, the command run in a child
process, and the report lines every run prints. Framework-free; imported by
tests/pytorch/test_determinism_check.py and tests/jax/test_jax_determinism_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TINY = ["--steps", "2", "--seq-len", "16", "--layers", "1", "--hidden-size", "32", "--num-heads", "4",
        "--gqa-groups", "2"]

REPORT_LINES = ("attention backend", "losses bitwise equal", "gradients bitwise equal", "parameters bitwise equal",
                "max |grad - unfused| step 1", "time per step", "RESULT: PASS")


def run_command(module: str, args, tmp_path):
    """``python -m <module> <args> --json <tmp_path>/report.json`` from a clean attention environment:
    the finished process and the JSON report (None if none was written)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    for name in ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN"):
        env.pop(name, None)
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(report)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    return proc, (json.loads(report.read_text()) if report.exists() else None)
