"""The JAX determinism check command: runs, reports equality, and fails when determinism is not met.

On CPU it runs the unfused backend at tiny sizes; on a GPU (qa/L3_determinism) it trains the
default model and expects the fused backend.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("flax", reason="Flax is not installed")
pytest.importorskip("optax", reason="optax is not installed")

from transformer_engine.jax import attention_math, determinism_check  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from determinism_check_cli import REPORT_LINES, TINY, run_command  # noqa: E402

ON_GPU = jax.devices()[0].platform == "gpu"


def test_command_reports_bitwise_equal_runs(tmp_path):
    proc, report = run_command(determinism_check.__name__, ["--steps", "3"] if ON_GPU else TINY, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["framework"] == "jax"
    assert report["deterministic_requested"] is True
    assert report["bitwise_identical"] is True
    assert report["losses_equal"] and report["grads_equal"] and report["params_equal"]
    assert "--xla_gpu_deterministic_ops=true" in report["xla_flags"]
    assert report["backends"] == (["FusedAttention"] if ON_GPU else ["UnfusedDotProductAttention"])
    assert report["reference_backends"] == ["UnfusedDotProductAttention"]
    assert report["device"].startswith("gpu" if ON_GPU else "cpu")
    dev = report["max_deviation"]
    if ON_GPU:
        assert dev["loss"] < 0.05, dev  # bf16: the two backends agree to bf16 rounding
    else:
        assert dev == {"loss": 0.0, "grad_first_step": 0.0, "grad_last_step": 0.0, "param": 0.0}
    for line in REPORT_LINES:
        assert line in proc.stdout, proc.stdout
    assert "step 2/" in proc.stderr  # the progress display
    if not ON_GPU:  # it says what it checked, and the fallback's reason once, in one wording
        assert "not the fused Triton kernels" in proc.stdout and "--fused-interpreter" in proc.stdout
        said = proc.stdout + proc.stderr
        assert said.count("using UnfusedDotProductAttention") == 1, said
        assert "Deterministic attention requested; no fused backend supports this call" in said


@pytest.mark.skipif(ON_GPU, reason="the CPU surface of the check (on a GPU the kernels run natively)")
def test_fused_interpreter_flag_runs_the_fused_kernels_on_cpu(tmp_path):
    """--fused-interpreter: the fused primitives lower to the Triton kernels under the interpreter (a child with
    TRITON_INTERPRET=1 and NVTE_JAX_TRITON_INTERPRET=1), every call selects them, and the runs are bitwise equal."""
    pytest.importorskip("torch", reason="Triton's interpreter reads torch CPU tensors")
    proc, report = run_command(determinism_check.__name__, [*TINY, "--fused-interpreter", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["backends"] == ["FusedAttention"], report["backends"]
    assert report["bitwise_identical"] is True
    assert "(Triton interpreter)" in proc.stdout
    assert "fused Triton kernels ran under Triton's interpreter" in proc.stdout


@pytest.mark.parametrize("args, words", [
    (["--dtype", "bfloat16"], "bfloat16 dots"),
    (["--device", "gpu"], "runs on CPU"),
])
def test_fused_interpreter_refuses_what_the_interpreter_cannot_check(monkeypatch, capsys, args, words):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # in this process, not a child
    assert determinism_check.main([*TINY, "--fused-interpreter", *args]) == 2
    assert words in capsys.readouterr().err


def test_fused_interpreter_flag_in_help(capsys):
    with pytest.raises(SystemExit):
        determinism_check.main(["--help"])
    assert "--fused-interpreter" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys):
    assert determinism_check.main(["--steps", "0", "--device", "cpu"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert determinism_check.main(["--hidden-size", "30", "--num-heads", "4", "--device", "cpu"]) == 2
    assert "hidden_size" in capsys.readouterr().err
    assert determinism_check.main(["--device", "tpu"]) == 2
    with pytest.raises(SystemExit) as info:
        determinism_check.main(["--dtype", "float64"])
    assert info.value.code == 2


@pytest.mark.parametrize("flag", ["--fused-interp", "--fused"])
def test_abbreviated_fused_interpreter_flag_is_refused(monkeypatch, capsys, flag):
    """Issue 69: a prefix of --fused-interpreter was accepted and the run went unfused."""
    started = []
    monkeypatch.setattr(determinism_check, "_rerun_interpreted", lambda argv: started.append(argv) or 0)
    with pytest.raises(SystemExit) as info:
        determinism_check.main([flag, "--device", "cpu"])
    assert info.value.code == 2 and started == []
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_fused_interpreter_flag_starts_the_interpreted_child_from_the_parsed_value(monkeypatch):
    started = []
    monkeypatch.setattr(determinism_check, "_interpreting", lambda: False)
    monkeypatch.setattr(determinism_check, "_rerun_interpreted", lambda argv: started.append(argv) or 0)
    assert determinism_check.main(["--steps", "1", "--fused-interpreter"]) == 0
    assert started == [["--steps", "1", "--fused-interpreter"]]


def test_malformed_determinism_variable_is_refused_by_name(monkeypatch, capsys):
    """Issue 69: NVTE_ALLOW_NONDETERMINISTIC_ALGO=2 was replaced by 0 for the runs; the check passed, saying "=0"."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "2")
    assert determinism_check.main(TINY + ["--device", "cpu", "--quiet", "--no-reference", "--no-xla-flag"]) == 2
    captured = capsys.readouterr()
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO must be 0 or 1, got '2'" in captured.err
    assert "Determinism check" not in captured.out  # refused before anything ran
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "2"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        determinism_check.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 10 on a GPU, 5 on CPU, 3 with --fused-interpreter" in text
    assert "sets both TRITON_INTERPRET=1 and NVTE_JAX_TRITON_INTERPRET=1" in text


# In-process runs use the (fast) unfused backend, skip the reference run and leave XLA_FLAGS alone.
IN_PROCESS = TINY + ["--device", "cpu", "--quiet", "--no-reference", "--no-xla-flag"]


@pytest.fixture
def unfused_only(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")


@pytest.fixture
def nondeterministic_attention(monkeypatch, unfused_only):
    """Unfused attention plus an offset that differs on every trace: what a racy kernel looks like
    to the check (each run traces anew)."""
    real = attention_math.unfused_attention
    traces = []

    def noisy(q, *args, **kwargs):
        traces.append(1)
        out = real(q, *args, **kwargs)
        return out + jnp.asarray(1e-4 * len(traces), out.dtype)

    monkeypatch.setattr(attention_math, "unfused_attention", noisy)


def test_nondeterminism_fails_with_exit_1(nondeterministic_attention, capsys):
    assert determinism_check.main(IN_PROCESS) == 1
    out = capsys.readouterr().out
    assert "RESULT: FAIL" in out and "loss at step 1" in out
    assert "losses bitwise equal" in out and "NO" in out


def test_nondeterminism_allowed_when_not_requested(nondeterministic_attention, capsys):
    assert determinism_check.main(IN_PROCESS + ["--nondeterministic"]) == 0
    out = capsys.readouterr().out
    assert "determinism: not requested" in out and "allowed" in out


def test_environment_restored_and_expect_backend(unfused_only, capsys):
    assert determinism_check.main(IN_PROCESS + ["--expect-backend", "fused"]) == 3
    out = capsys.readouterr().out
    assert "expected every attention call on FusedAttention" in out
    # The unfused-on-CPU note says that the interpreted kernels need both variables and that the flag sets them.
    assert "--fused-interpreter sets both variables the interpreted kernels need, TRITON_INTERPRET=1" in out
    assert "NVTE_JAX_TRITON_INTERPRET=1, in a child process" in out
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ
    assert os.environ["NVTE_FUSED_ATTN_BACKEND"] == "unfused"


def test_check_requests_determinism_through_the_environment(unfused_only, monkeypatch):
    """The runs see NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, so every attention trace is deterministic."""
    from transformer_engine.jax import attention

    seen = []
    original = attention.select_attention_backend

    def spy(config):
        seen.append(config.deterministic)
        return original(config)

    monkeypatch.setattr(attention, "select_attention_backend", spy)
    assert determinism_check.main(IN_PROCESS) == 0
    assert seen and all(seen)
    seen.clear()
    assert determinism_check.main(IN_PROCESS + ["--nondeterministic"]) == 0
    assert seen and not any(seen)
