"""The determinism check's framework-free half: comparison, verdict and exit statuses, report,
JSON keys and shared options, on hand-made runs (no torch, no jax)."""

from __future__ import annotations

import io
import json
import math
import os

import numpy as np
import pytest

from transformer_engine.common import determinism_report as report
from transformer_engine.common.attention.backends import NoBackendError
from transformer_engine.common.determinism_report import RunResult

UNFUSED = "UnfusedDotProductAttention"

# The JSON keys both checks write, in order (the JAX check adds "xla_flags" and "framework").
JSON_KEYS = ["device", "dtype", "deterministic_requested", "steps", "backends", "reference_backends",
             "losses_equal", "grads_equal", "params_equal", "first_mismatch", "max_deviation", "tolerance", "time_per_step_ms",
             "model", "exit_status", "message", "bitwise_identical"]


def _run(label="run", steps=2, offset=0.0, grad_offset=0.0, param_offset=0.0, backends=(UNFUSED,)):
    """A run of ``steps`` steps over two tensors (one empty); offsets perturb losses, step-2 grads, params."""
    run = RunResult(label)
    for step in range(steps):
        loss = 5.0 - 0.1 * step + offset
        grads = {"w": np.full((2, 3), 0.5 * (step + 1) + (grad_offset if step == 1 else 0.0), np.float32),
                 "empty": np.zeros((0,), np.float32)}
        run.losses.append(loss)
        run.loss_bits.append(report.digest(np.float32(loss)))
        run.grad_digests.append({n: report.digest(g) for n, g in grads.items()})
        if step == 0:
            run.first_grads = grads
        if step == steps - 1:
            run.last_grads = grads
        run.step_seconds.append(0.5 if step == 0 else 0.01)
    run.params = {"w": np.full((2, 3), 1.0 + param_offset, np.float32), "empty": np.zeros((0,), np.float32)}
    run.param_digests = {n: report.digest(p) for n, p in run.params.items()}
    run.add_backends(backends)
    return run


def _args(*argv, **defaults):
    args = report.build_parser("prog", "desc", device_help="d", nondeterministic_help="n",
                               expect_backends=("fused", "unfused", "flash")).parse_args(list(argv))
    report.apply_defaults(args, defaults or report.CPU_DEFAULTS)
    return args


def _result(run2=None, reference=None, argv=(), deterministic=True, **kwargs):
    run1 = _run("run 1")
    run2 = run2 if run2 is not None else _run("run 2")
    return report.check_result(_args(*argv), run1, run2, reference, device="cpu", qkv_format="bshd",
                               deterministic=deterministic, **kwargs)


# -- records and comparison ------------------------------------------------------------------------


def test_digest_is_equal_exactly_for_equal_bytes():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert report.digest(a) == report.digest(a.copy())
    assert report.digest(a.T) == report.digest(np.ascontiguousarray(a.T))  # C order, whatever the strides
    assert report.digest(a) != report.digest(np.nextafter(a, np.inf, dtype=np.float32))
    assert report.digest(np.float32(-0.0)) != report.digest(np.float32(0.0))  # bits, not values


def test_time_per_step_is_the_median_without_the_first_step():
    run = RunResult("r", step_seconds=[9.0, 0.003, 0.001, 0.002])
    assert run.time_per_step_ms == pytest.approx(2.0)
    assert RunResult("r", step_seconds=[9.0, 0.001, 0.002, 0.003, 0.004]).time_per_step_ms == pytest.approx(2.5)
    assert RunResult("r", step_seconds=[0.004]).time_per_step_ms == pytest.approx(4.0)
    assert math.isnan(RunResult("r").time_per_step_ms)


def test_add_backends_keeps_first_seen_order_once():
    run = RunResult("r")
    run.add_backends(["B", "A"])
    run.add_backends(["A", "C", "B"])
    assert run.backends == ["B", "A", "C"]


def test_first_difference_names_loss_then_gradient_then_parameter():
    base = _run()
    assert report.first_difference(base, _run()) is None
    assert report.first_difference(base, _run(offset=1e-3)) == "loss at step 1 (5.0 vs 5.001)"
    assert report.first_difference(base, _run(grad_offset=1e-3)) == "gradient of w at step 2"
    assert report.first_difference(base, _run(param_offset=1e-3)) == "parameter w after step 2"


def test_max_abs_diff_in_float64_and_skips_empty_tensors():
    x = {"a": np.array([1.0, 2.0], np.float32), "e": np.zeros((0,), np.float32)}
    y = {"a": np.array([1.0, 2.0 + 2.0 ** -20], np.float64), "e": np.zeros((0,), np.float32)}
    assert report.max_abs_diff(x, y) == 2.0 ** -20
    assert report.max_abs_diff({"e": x["e"]}, {"e": y["e"]}) == 0.0


def test_deviation_from_reference():
    dev = report.deviation_from(_run(), _run(offset=0.25, grad_offset=0.5, param_offset=-1.0))
    assert dev == {"loss": pytest.approx(0.25), "grad_first_step": 0.0, "grad_last_step": 0.5, "param": 1.0}


# -- verdict and exit statuses ---------------------------------------------------------------------


def test_equal_runs_pass():
    result = _result()
    assert result.bitwise_identical and result.exit_status == report.EXIT_PASS == 0
    assert result.message == "RESULT: PASS: the two runs are bitwise identical"


def test_differing_runs_fail_with_exit_1_when_determinism_was_requested():
    result = _result(run2=_run(grad_offset=1e-6))
    assert (result.losses_equal, result.grads_equal, result.params_equal) == (True, False, True)
    assert result.exit_status == report.EXIT_NOT_DETERMINISTIC == 1
    assert result.message == ("RESULT: FAIL: determinism was requested but the runs differ "
                              "(first: gradient of w at step 2)")


def test_differing_runs_allowed_when_determinism_was_not_requested():
    result = _result(run2=_run(offset=1.0), deterministic=False)
    assert result.exit_status == 0
    assert result.message == "RESULT: the runs differ (allowed: determinism was not requested)"


def test_unexpected_backend_exits_3_unless_already_failing():
    result = _result(argv=["--expect-backend", "fused"])
    assert result.exit_status == report.EXIT_UNEXPECTED_BACKEND == 3
    assert result.message.splitlines()[-1] == (
        f"RESULT: FAIL: expected every attention call on FusedAttention, got {UNFUSED}")
    assert _result(argv=["--expect-backend", "unfused"]).exit_status == 0
    # A determinism failure keeps its own status.
    assert _result(run2=_run(offset=1.0), argv=["--expect-backend", "fused"]).exit_status == 1


def test_backends_are_the_sorted_union_of_both_runs():
    result = _result(run2=_run(backends=("FusedAttention", UNFUSED)))
    assert result.backends == ["FusedAttention", UNFUSED]
    assert result.reference_backends == []


# -- JSON and report -------------------------------------------------------------------------------


def test_json_keys_and_order():
    result = _result(reference=_run("ref"))
    data = result.to_json()
    assert list(data) == JSON_KEYS
    assert data["model"] == dict(layers=2, hidden_size=64, num_heads=4, gqa_groups=2, seq_len=64, batch_size=2,
                                 qkv_format="bshd", window=-1, num_tensors=2)
    assert list(data["time_per_step_ms"]) == ["run 1", "run 2", "unfused"]
    assert list(data["max_deviation"]) == ["loss", "grad_first_step", "grad_last_step", "param"]
    json.dumps(data)  # plain Python values only


def test_json_frontend_keys_go_after_model_and_framework_last():
    data = _result(extra={"xla_flags": "--x"}, framework="jax").to_json()
    at = JSON_KEYS.index("model") + 1
    assert list(data) == JSON_KEYS[:at] + ["xla_flags"] + JSON_KEYS[at:] + ["framework"]
    assert data["xla_flags"] == "--x" and data["framework"] == "jax"


def test_report_table():
    run1 = _run("run 1")
    run1.step_seconds = [1.0, 0.0198]
    ref = _run("ref", offset=1e-4)
    ref.step_seconds = [1.0, 0.0192]
    result = report.check_result(_args("--steps", "2"), run1, _run("run 2", grad_offset=1.0), ref, device="cpu",
                                 qkv_format="bshd", deterministic=True)
    assert report.format_report(result) == (
        "\n"
        "-------------------------------------------------------------------\n"
        f"  attention backend            {UNFUSED}\n"
        f"  reference backend            {UNFUSED}\n"
        "  losses bitwise equal         yes (2 steps)\n"
        "  gradients bitwise equal      NO (every step, 2 tensors)\n"
        "  parameters bitwise equal     yes (2 tensors)\n"
        "  first difference             gradient of w at step 2\n"
        "  max |loss - unfused|         1.000e-04\n"
        "  max |grad - unfused| step 1  0 (tolerance 5.000e-05)\n"
        "  max |grad - unfused| step 2  0\n"
        "  max |param - unfused|        0\n"
        "  time per step                run 1 19.8 ms, run 2 10.0 ms, unfused 19.2 ms\n"
        "-------------------------------------------------------------------\n"
        "RESULT: FAIL: determinism was requested but the runs differ (first: gradient of w at step 2)\n"
    )


def test_report_without_reference_and_nan_deviation():
    text = report.format_report(_result())
    assert "reference backend         (skipped)" in text and "unfused|" not in text
    result = _result(reference=_run("ref"))
    result.max_deviation["param"] = float("nan")
    assert "max |param - unfused|        -\n" in report.format_report(result)


def test_header():
    args = _args("--window", "8", "--no-reference")
    text = report.header("Determinism check", args, head_dim=16, qkv_format="sbhd", device="cpu (x)",
                         deterministic=True, how=["A=0", "B"])
    assert text == (
        "Determinism check: 5 steps x 2 runs\n"
        "  model: 2 layers, hidden 64, 4 heads / 2 kv heads (d=16), causal window 8, sbhd\n"
        "  data: batch 2 x seq 64, float32 on cpu (x), seed 1234\n"
        "  determinism: requested (A=0, B)\n"
    )
    text = report.header("T", _args(), head_dim=16, qkv_format="bshd", device="cpu", deterministic=False, how=[])
    assert text.startswith("T: 5 steps x 2 runs + unfused reference\n") and "  determinism: not requested\n" in text


def test_progress_lines():
    stream = io.StringIO()
    progress = report.Progress(stream, enabled=True)
    progress.step("run 1", 1, 2, 5.0, 0.0123)
    progress.step("run 1", 2, 2, 4.5, 0.0123)
    assert stream.getvalue().splitlines() == [
        "run 1                  [##########..........] step 1/2  loss 5.000000      12.3 ms/step",
        "run 1                  [####################] step 2/2  loss 4.500000      12.3 ms/step",
    ]
    quiet = io.StringIO()
    report.Progress(quiet, enabled=False).step("run 1", 1, 2, 5.0, 0.01)
    assert quiet.getvalue() == ""


def test_progress_redraws_in_place_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    progress = report.Progress(stream, enabled=True)
    progress.step("r", 1, 2, 1.0, 0.001)
    progress.step("r", 2, 2, 1.0, 0.001)
    assert stream.getvalue().count("\r") == 2 and stream.getvalue().count("\n") == 1


# -- options and the command -----------------------------------------------------------------------


def test_parser_places_frontend_options_and_limits_expect_backend():
    parser = report.build_parser("prog", "desc", device_help="d", nondeterministic_help="n",
                                 expect_backends=("fused", "unfused"),
                                 shape_options=[("--shape-x", dict(type=int))],
                                 determinism_options=[("--det-x", dict(action="store_true"))])
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags == ["--steps", "--seq-len", "--batch-size", "--hidden-size", "--num-heads", "--gqa-groups",
                     "--layers", "--shape-x", "--window", "--dtype", "--device", "--seed", "--lr",
                     "--nondeterministic", "--det-x", "--no-reference", "--expect-backend", "--json", "--quiet"]
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--expect-backend", "flash"])
    assert info.value.code == report.EXIT_BAD_ARGUMENTS


def test_abbreviated_options_are_refused_not_taken_for_the_full_flag(capsys):
    """Issue 69: `--fused-interp` was taken by argparse as `--fused-interpreter` while the frontend looked for the
    full string: the run went unfused and told the user to add the flag they had added. Prefixes are refused."""
    parser = report.build_parser("prog", "desc", device_help="d", nondeterministic_help="n",
                                 expect_backends=("fused",),
                                 determinism_options=[("--fused-interpreter", dict(action="store_true"))])
    for argv in (["--fused-interp"], ["--fused"], ["--step", "3"], ["--no-ref"]):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(argv)
        assert info.value.code == report.EXIT_BAD_ARGUMENTS
        assert f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err
    assert parser.parse_args(["--fused-interpreter"]).fused_interpreter is True


def test_help_states_every_default_by_where_it_applies():
    parser = report.build_parser("prog", "desc", device_help="d", nondeterministic_help="n", expect_backends=("fused",),
                                 defaults={"on a GPU": report.GPU_DEFAULTS, "on CPU": report.CPU_DEFAULTS,
                                           "with --fused-interpreter": dict(report.CPU_DEFAULTS, steps=3)})
    text = " ".join(parser.format_help().split())  # help lines are wrapped: compare with single spaces
    assert "training steps per run; default: 10 on a GPU, 5 on CPU, 3 with --fused-interpreter" in text
    assert "tokens per sequence; default: 1024 on a GPU, 64 on CPU and with --fused-interpreter" in text
    assert "equal to --num-heads for MHA; default: 2" in text
    assert "auto: bfloat16 on a GPU, float32 on CPU and with --fused-interpreter (default: auto)" in text
    assert "(default: 1234)" in text and "(default: -1)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_apply_defaults_fills_unset_options_and_checks_sizes():
    args = _args("--steps", "7", "--dtype", "auto", **report.GPU_DEFAULTS)
    assert (args.steps, args.seq_len, args.dtype) == (7, 1024, "bfloat16")
    args = _args("--dtype", "float16")
    assert args.dtype == "float16"
    with pytest.raises(ValueError, match="`--seq-len` must be >= 1, got 0"):
        _args("--seq-len", "0")


@pytest.mark.parametrize("error", [ValueError("`--steps` must be >= 1, got 0"), NoBackendError("no backend")])
def test_main_reports_errors_with_exit_2(error, capsys):
    def run_check(args):
        raise error

    parser = report.build_parser("p", "d", device_help="d", nondeterministic_help="n", expect_backends=("fused",))
    assert report.main(parser, run_check, []) == 2
    assert capsys.readouterr().err == f"determinism_check: error: {error}\n"


def test_main_acts_on_the_parsed_options_through_rerun(capsys):
    """The frontend's decision to rerun in a child is made on the options as parsed, once."""
    parser = report.build_parser("p", "d", device_help="d", nondeterministic_help="n", expect_backends=("fused",),
                                 determinism_options=[("--fused-interpreter", dict(action="store_true"))])
    seen = []

    def run_check(args):
        raise AssertionError("the check ran here although the rerun hook ran it elsewhere")

    def rerun(args):
        seen.append(args)
        return 7 if args.fused_interpreter else None

    assert report.main(parser, run_check, ["--fused-interpreter", "--steps", "2"], rerun=rerun) == 7
    assert seen[0].fused_interpreter is True and seen[0].steps == 2
    result = _result()
    assert report.main(parser, lambda args: result, [], rerun=rerun) == 0
    assert seen[1].fused_interpreter is False
    capsys.readouterr()


@pytest.mark.parametrize("name, raw, words", [
    ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "2", "NVTE_ALLOW_NONDETERMINISTIC_ALGO must be 0 or 1, got '2'"),
    ("NVTE_FUSED_ATTN_BACKEND", "cudnn", "NVTE_FUSED_ATTN_BACKEND must be one of"),
    ("NVTE_DEBUG_LEVEL", "9", "NVTE_DEBUG_LEVEL must be in [0, 2], got 9"),
])
def test_main_refuses_a_malformed_variable_by_name_before_anything_runs(monkeypatch, capsys, name, raw, words):
    """Issue 69: NVTE_ALLOW_NONDETERMINISTIC_ALGO=2 was overwritten with 0 for the runs, and the check passed
    saying "=0". A malformed NVTE_* variable is refused (exit 2) with its name, as the library refuses it."""
    monkeypatch.setenv(name, raw)
    called = []
    parser = report.build_parser("p", "d", device_help="d", nondeterministic_help="n", expect_backends=("fused",))
    status = report.main(parser, lambda args: called.append("run") or _result(),
                         [], rerun=lambda args: called.append("rerun"))
    assert status == report.EXIT_BAD_ARGUMENTS and called == []
    err = capsys.readouterr().err
    assert err.startswith("determinism_check: error: ") and words in err, err
    assert os.environ[name] == raw


def test_main_prints_report_and_json(tmp_path, capsys):
    parser = report.build_parser("p", "d", device_help="d", nondeterministic_help="n", expect_backends=("fused",))
    result = _result(run2=_run(offset=1.0))
    path = tmp_path / "r.json"
    assert report.main(parser, lambda args: result, ["--json", str(path)]) == 1
    assert capsys.readouterr().out == report.format_report(result)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result.to_json()))
    assert report.main(parser, lambda args: result, ["--json", "-"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(report.format_report(result))
    assert json.loads(out[len(report.format_report(result)):])["exit_status"] == 1


def test_deviation_beyond_tolerance_fails_even_when_bitwise_identical():
    # Reproducibly wrong is not a pass (bf16 under Triton's interpreter was 1.8e+11 off and passed).
    far = _run("ref")
    far.first_grads = {"w": far.first_grads["w"] + 1.0, "empty": far.first_grads["empty"]}
    result = _result(reference=far)
    assert result.bitwise_identical
    assert result.exit_status == report.EXIT_DEVIATES
    assert "above the tolerance" in result.message
    near = _run("ref")
    near.first_grads = {"w": near.first_grads["w"] + 1e-6, "empty": near.first_grads["empty"]}
    assert _result(reference=near).exit_status == report.EXIT_PASS


def test_tolerance_scales_with_the_frameworks_own_error():
    ref = _run("ref")
    fp32 = _run("ref fp32")
    fp32.first_grads = {"w": fp32.first_grads["w"] + 0.01, "empty": fp32.first_grads["empty"]}
    tol = report.deviation_tolerance("bfloat16", ref, fp32)
    assert tol["own_error"] == np.float32(0.01).item() or abs(tol["own_error"] - 0.01) < 1e-6
    assert tol["grad_first_step"] == max(report.OWN_ERROR_FACTOR * tol["own_error"], 0.05 * 0.5)
    # Without an fp32 run there is no own error to measure: the floor alone.
    assert report.deviation_tolerance("float32", ref, None)["grad_first_step"] == 1e-4 * 0.5
    nan = _run("ref")
    result = _result(reference=nan)
    result.max_deviation["grad_first_step"] = float("nan")
    assert report.verdict(result)[0] == report.EXIT_DEVIATES
