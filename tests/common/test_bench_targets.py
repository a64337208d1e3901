"""The attention benchmark's target evaluation (benchmarks/attention/targets.py) and its grid
(cases.py) on synthetic rows: met, missed, missing or failed peers, overall status. Pure Python."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "attention"


def _load(name):
    """A benchmark module by path, under a private name (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


cases = _load("cases")
targets = _load("targets")
Target, evaluate, evaluate_cell, markdown = targets.Target, targets.evaluate, targets.evaluate_cell, targets.markdown

SPEED = Target("t", "te_fused_det", "fa4_det", 0.9, "fwd_bwd_tflops", text="fused det >= 0.9x fa4 det")
MEMORY = Target("m", "te_fused_det", "te_fused", 1.2, "peak_gb", direction="le")
RUNS = Target("r", "te_fused_det", None, None, "runs_bitwise", groups=("long",))


def row(case, impl, status="ok", **values):
    r = {"case": case, "impl": impl, "status": status}
    r.update(values)
    return r


def case_list(*names_groups):
    return [{"name": n, "group": g} for n, g in names_groups]


def test_met_when_the_ratio_reaches_the_threshold():
    cell = evaluate_cell(SPEED, row("c", "te_fused_det", fwd_bwd_tflops=540.0),
                         row("c", "fa4_det", fwd_bwd_tflops=600.0))
    assert cell["status"] == "met" and cell["ratio"] == 0.9
    assert (cell["subject_value"], cell["peer_value"]) == (540.0, 600.0)


def test_missed_below_the_threshold():
    cell = evaluate_cell(SPEED, row("c", "te_fused_det", fwd_bwd_tflops=400.0),
                         row("c", "fa4_det", fwd_bwd_tflops=582.0))
    assert cell["status"] == "missed"
    assert cell["ratio"] == pytest.approx(400 / 582, abs=1e-3)


def test_missing_peer_is_not_applicable_with_the_reason():
    subject = row("c", "te_fused_det", fwd_bwd_tflops=400.0)
    absent = evaluate_cell(SPEED, subject, None)
    assert absent["status"] == "n/a" and absent["ratio"] is None
    assert absent["reason"] == "fa4_det: not measured"
    skipped = evaluate_cell(SPEED, subject, row("c", "fa4_det", "skipped", reason="flash_attn.cute not importable"))
    assert skipped["status"] == "n/a" and "flash_attn.cute not importable" in skipped["reason"]
    failed = evaluate_cell(SPEED, subject, row("c", "fa4_det", "error", reason="OOM: OutOfMemoryError"))
    assert failed["status"] == "n/a" and "OOM" in failed["reason"]


def test_failed_subject_is_missed_skipped_subject_is_not_applicable():
    peer = row("c", "fa4_det", fwd_bwd_tflops=500.0)
    failed = evaluate_cell(SPEED, row("c", "te_fused_det", "error", reason="RuntimeError: boom"), peer)
    assert failed["status"] == "missed" and "boom" in failed["reason"]
    skipped = evaluate_cell(SPEED, row("c", "te_fused_det", "skipped", reason="time budget"), peer)
    assert skipped["status"] == "n/a"
    assert evaluate_cell(SPEED, None, peer)["status"] == "n/a"


def test_metric_missing_or_zero_is_not_applicable():
    cell = evaluate_cell(MEMORY, row("c", "te_fused_det", peak_gb=0.3), row("c", "te_fused", peak_gb=None))
    assert cell["status"] == "n/a"
    cell = evaluate_cell(SPEED, row("c", "te_fused_det", fwd_bwd_tflops=1.0), row("c", "fa4_det", fwd_bwd_tflops=0))
    assert cell["status"] == "n/a"


def test_lower_is_better_for_memory():
    nondet = row("c", "te_fused", peak_gb=1.0)
    assert evaluate_cell(MEMORY, row("c", "te_fused_det", peak_gb=1.2), nondet)["status"] == "met"
    cell = evaluate_cell(MEMORY, row("c", "te_fused_det", peak_gb=5.3), nondet)
    assert cell["status"] == "missed" and cell["ratio"] == 5.3


def test_runs_bitwise_needs_a_run_with_equal_gradients():
    assert evaluate_cell(RUNS, row("l", "te_fused_det", bitwise=True), None)["status"] == "met"
    differ = evaluate_cell(RUNS, row("l", "te_fused_det", bitwise=False), None)
    assert differ["status"] == "missed" and "differ" in differ["reason"]
    assert evaluate_cell(RUNS, row("l", "te_fused_det", "error", reason="OOM"), None)["status"] == "missed"
    assert evaluate_cell(RUNS, row("l", "te_fused_det", "skipped", reason="x"), None)["status"] == "n/a"
    assert evaluate_cell(RUNS, None, None)["status"] == "n/a"


def test_overall_status_and_worst_ratio_over_cases():
    cs = case_list(("a", "std"), ("b", "std"), ("c", "std"))
    rows = [row("a", "te_fused_det", fwd_bwd_tflops=500.0), row("a", "fa4_det", fwd_bwd_tflops=500.0),
            row("b", "te_fused_det", fwd_bwd_tflops=450.0), row("b", "fa4_det", fwd_bwd_tflops=500.0),
            row("c", "te_fused_det", fwd_bwd_tflops=400.0)]
    (res,) = evaluate(rows, cs, [SPEED])
    assert res["status"] == "incomplete"  # c's peer is missing
    assert (res["met"], res["missed"], res["n/a"]) == (2, 0, 1)
    assert res["worst_ratio"] == 0.9
    rows.append(row("c", "fa4_det", fwd_bwd_tflops=500.0))
    (res,) = evaluate(rows, cs, [SPEED])
    assert res["status"] == "missed" and res["worst_ratio"] == 0.8
    assert evaluate(rows[:4], case_list(("a", "std"), ("b", "std")), [SPEED])[0]["status"] == "met"
    assert evaluate([], cs, [SPEED])[0]["status"] == "not measured"


def test_later_rows_replace_earlier_ones_and_groups_limit_the_cases():
    cs = case_list(("a", "std"), ("l", "long"))
    rows = [row("l", "te_fused_det", "skipped", reason="time budget"), row("l", "te_fused_det", bitwise=True)]
    (res,) = evaluate(rows, cs, [RUNS])
    assert list(res["cells"]) == ["l"] and res["status"] == "met"


def test_markdown_marks_each_cell_and_lists_reasons():
    cs = case_list(("a", "std"), ("b", "std"))
    rows = [row("a", "te_fused_det", fwd_bwd_tflops=600.0), row("a", "fa4_det", fwd_bwd_tflops=500.0),
            row("b", "te_fused_det", fwd_bwd_tflops=300.0), row("b", "fa4_det", fwd_bwd_tflops=500.0),
            row("a", "fa4", "skipped", reason="not installed")]
    text = "\n".join(markdown(evaluate(rows, cs, [SPEED, Target("f", "te_fused_det", "fa4", 0.85, "fwd_tflops")]), cs))
    assert "1.20 met" in text and "0.60 MISSED" in text and "**missed**" in text
    assert "fa4: skipped: not installed (a)" in text


def test_targets_name_known_implementations_and_groups():
    known = set(cases.ALL_IMPLS) | set(cases.OPTIONAL_IMPLS)
    for t in targets.TARGETS:
        assert t.subject in known and (t.peer is None or t.peer in known), t.id
        assert t.groups is None or set(t.groups) <= set(cases.GROUPS), t.id
    assert len({t.id for t in targets.TARGETS}) == len(targets.TARGETS)
    with pytest.raises(ValueError):
        Target("x", "te_fused_det", None, 1.0, "fwd_tflops")


def test_grid_is_the_issue_grid():
    dense = {(c.b, c.hq, c.hkv, c.s, c.d, c.causal) for c in cases.GRID if c.layout == "bshd"}
    for b, h, s, d in ((4, 16, 4096, 128), (1, 16, 16384, 128), (8, 32, 2048, 64)):
        assert {(b, h, h, s, d, False), (b, h, h, s, d, True)} <= dense
    assert {(2, 32, 8, 8192, 128, True), (1, 8, 8, 131072, 128, True), (2, 16, 16, 4096, 256, True)} <= dense
    (thd,) = [c for c in cases.GRID if c.layout == "thd"]
    assert len(thd.seqlens) == 16 and min(thd.seqlens) == 512 and max(thd.seqlens) == 4096
    assert thd.seqlens == cases.thd_lengths() and (thd.hq, thd.d, thd.causal) == (16, 128, True)
    assert {c.group for c in cases.GRID} == set(cases.GROUPS) == {c.group for c in cases.DRY_GRID}
    assert len({c.name for c in cases.GRID}) == len(cases.GRID)


def test_flop_counting():
    (c,) = cases.select_cases(cases.GRID, ["4x16x4096x128-none"])
    assert c.flops("fwd") == 4.0 * 4 * 16 * 4096 * 4096 * 128
    assert c.flops("fwd_bwd") == 3.5 * c.flops("fwd")
    (causal,) = cases.select_cases(cases.GRID, ["4x16x4096x128-causal"])
    assert causal.flops("fwd") == c.flops("fwd") / 2
    (thd,) = cases.select_cases(cases.GRID, ["thd"])
    assert thd.flops("fwd") == sum(4.0 * 16 * n * n * 128 for n in thd.seqlens) / 2
    (gqa,) = cases.select_cases(cases.GRID, ["gqa"])
    assert gqa.flops("fwd") == 4.0 * 2 * 32 * 8192 * 8192 * 128 / 2  # query heads count
    with pytest.raises(ValueError):
        cases.select_cases(cases.GRID, ["nope"])
    assert cases.Case.from_dict(thd.to_dict()) == thd
