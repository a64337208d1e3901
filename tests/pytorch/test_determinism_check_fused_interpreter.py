"""The determinism check's CPU surface: ``--fused-interpreter`` runs the fused Triton kernels on CPU
(in a child with TRITON_INTERPRET=1), and a plain CPU run says that it checked unfused attention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpa_helpers import ON_GPU
from transformer_engine.pytorch import determinism_check

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from determinism_check_cli import REPO, TINY  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU surface of the check (on a GPU the kernels run natively)")


def _run(args, tmp_path, **env_changes):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_FUSED_ATTN_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(env_changes)
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", determinism_check.__name__, *args, "--quiet", "--json", str(report)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_fused_interpreter_flag_runs_the_fused_kernels_on_cpu(tmp_path):
    proc, report = _run([*TINY, "--fused-interpreter"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["backends"] == ["FusedAttention"], report["backends"]
    assert report["bitwise_identical"] is True
    assert "(Triton interpreter)" in proc.stdout
    assert "fused Triton kernels ran under Triton's interpreter" in proc.stdout


def test_plain_cpu_run_says_it_checked_unfused_attention(tmp_path):
    proc, report = _run(TINY, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["backends"] == ["UnfusedDotProductAttention"]
    assert "not the fused Triton kernels" in proc.stdout and "--fused-interpreter" in proc.stdout


@pytest.mark.parametrize("args, words", [
    (["--dtype", "bfloat16"], "bfloat16 dots"),
    (["--device", "cuda"], "runs on CPU"),
])
def test_fused_interpreter_refuses_what_the_interpreter_cannot_check(tmp_path, args, words):
    proc, _ = _run([*TINY, "--fused-interpreter", *args], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr, proc.stderr


def test_fused_interpreter_flag_in_help(capsys):
    with pytest.raises(SystemExit):
        determinism_check.main(["--help"])
    assert "--fused-interpreter" in capsys.readouterr().out
