"""The determinism check command: runs, reports equality, and fails when determinism is not met.

On the CPU it runs the unfused backend (or the fused one under TRITON_INTERPRET=1) at tiny sizes;
on a GPU (qa/L3_determinism) it trains the default model and expects the fused backend.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from dpa_helpers import INTERPRET, ON_GPU
from transformer_engine.pytorch import determinism_check
from transformer_engine.pytorch.attention.backends import UnfusedAttentionBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from determinism_check_cli import REPORT_LINES, TINY, run_command  # noqa: E402


def test_command_reports_bitwise_equal_runs(tmp_path):
    args = ["--steps", "3"] if ON_GPU else TINY
    proc, report = run_command(determinism_check.__name__, args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["deterministic_requested"] is True
    assert report["bitwise_identical"] is True
    assert report["losses_equal"] and report["grads_equal"] and report["params_equal"]
    if ON_GPU:  # a fused backend (ours, or flash-attn-4 where installed) stays selected in deterministic training
        assert report["backends"] and "UnfusedDotProductAttention" not in report["backends"], report["backends"]
    else:
        assert report["backends"] == ["FusedAttention" if INTERPRET else "UnfusedDotProductAttention"]
    assert report["reference_backends"] == ["UnfusedDotProductAttention"]
    assert report["device"].startswith("cuda" if ON_GPU else "cpu")
    dev = report["max_deviation"]
    if report["backends"] == ["UnfusedDotProductAttention"]:
        assert dev == {"loss": 0.0, "grad_first_step": 0.0, "grad_last_step": 0.0, "param": 0.0}
    elif not ON_GPU:
        # fp32 under the interpreter: fused and unfused differ by rounding only.
        assert dev["loss"] < 1e-4 and dev["grad_first_step"] < 1e-5, dev
    else:
        assert dev["loss"] < 0.05, dev  # bf16: the losses of the two backends agree to bf16 rounding
    out = proc.stdout
    for line in REPORT_LINES:
        assert line in out, out
    assert "step 2/2" in proc.stderr or ON_GPU  # the progress display


def test_bad_arguments_exit_2(capsys):
    assert determinism_check.main(["--steps", "0", "--device", "cpu"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert determinism_check.main(["--hidden-size", "30", "--num-heads", "4", "--device", "cpu"]) == 2
    assert "hidden_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        determinism_check.main(["--dtype", "float64"])
    assert info.value.code == 2


@pytest.mark.parametrize("flag", ["--fused-interp", "--fused"])
def test_abbreviated_fused_interpreter_flag_is_refused(monkeypatch, capsys, flag):
    """Issue 69: a prefix of --fused-interpreter was accepted, the run went unfused, passed, then failed with
    "expected ... FusedAttention" (exit 3) and asked for the flag that had been given."""
    started = []
    monkeypatch.setattr(determinism_check, "_rerun_interpreted", lambda argv: started.append(argv) or 0)
    with pytest.raises(SystemExit) as info:
        determinism_check.main([flag, "--device", "cpu"])
    assert info.value.code == 2 and started == []
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_fused_interpreter_flag_starts_the_interpreted_child_from_the_parsed_value(monkeypatch):
    started = []
    monkeypatch.setattr(determinism_check, "triton_interpreting", lambda: False)
    monkeypatch.setattr(determinism_check, "_rerun_interpreted", lambda argv: started.append(argv) or 0)
    assert determinism_check.main(["--steps", "1", "--fused-interpreter"]) == 0
    assert started == [["--steps", "1", "--fused-interpreter"]]


def test_malformed_determinism_variable_is_refused_by_name(monkeypatch, capsys):
    """Issue 69: NVTE_ALLOW_NONDETERMINISTIC_ALGO=2 was replaced by 0 for the runs; the check passed, saying "=0"."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "2")
    assert determinism_check.main(TINY + ["--device", "cpu", "--quiet", "--no-reference"]) == 2
    captured = capsys.readouterr()
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO must be 0 or 1, got '2'" in captured.err
    assert "Determinism check" not in captured.out  # refused before anything ran
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "2"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        determinism_check.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 10 on a GPU, 5 on CPU, 3 with --fused-interpreter" in text
    assert "default: 1024 on a GPU, 64 on CPU, 32 with --fused-interpreter" in text
    assert "--dtype float32, the default, or float16" in text


# In-process runs force the (fast) unfused backend and skip the reference run.
IN_PROCESS = TINY + ["--device", "cpu", "--quiet", "--no-reference"]


@pytest.fixture
def unfused_only(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)


@pytest.fixture
def nondeterministic_attention(monkeypatch, unfused_only):
    """Unfused attention plus noise that differs on every call: what a racy kernel looks like."""
    real = UnfusedAttentionBackend.run
    calls = []

    def noisy(q, *args, **kwargs):
        calls.append(1)
        out = real(q, *args, **kwargs)
        return out + 1e-4 * len(calls) * torch.ones_like(out)

    monkeypatch.setattr(UnfusedAttentionBackend, "run", staticmethod(noisy))


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
    assert determinism_check.main(IN_PROCESS + ["--expect-backend", "flash"]) == 3
    assert "expected every attention call on FlashAttention" in capsys.readouterr().out
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ
    assert os.environ["NVTE_FUSED_ATTN_BACKEND"] == "unfused"


def test_check_requests_determinism_through_the_environment(unfused_only, monkeypatch):
    """The check's runs see NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, so each attention call is deterministic."""
    from transformer_engine.pytorch.attention import backends as attn_backends

    seen = []
    original = attn_backends.select

    def spy(config, *args, **kwargs):
        seen.append(config.deterministic)
        return original(config, *args, **kwargs)

    monkeypatch.setattr(attn_backends, "select", spy)
    assert determinism_check.main(IN_PROCESS) == 0
    assert seen and all(seen)
    seen.clear()
    assert determinism_check.main(IN_PROCESS + ["--nondeterministic"]) == 0
    assert seen and not any(seen)
    seen.clear()
    assert determinism_check.main(IN_PROCESS + ["--nondeterministic", "--torch-deterministic"]) == 0
    assert seen and all(seen)  # the torch flag alone requests determinism
    assert not torch.are_deterministic_algorithms_enabled()  # and is restored afterwards


def test_cpu_runs_use_one_torch_thread_and_restore_it(unfused_only, monkeypatch):
    """On CPU the runs train with one intra-op thread (torch's CPU kernels may round differently per thread split),
    and the caller's thread count comes back afterwards."""
    seen = []
    real = UnfusedAttentionBackend.run

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(UnfusedAttentionBackend, "run", staticmethod(spy))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert determinism_check.main(IN_PROCESS) == 0
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
