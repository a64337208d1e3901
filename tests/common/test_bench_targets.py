"""The attention benchmark's target evaluation (benchmarks/attention/targets.py) and its grid
(cases.py) on synthetic rows: met, missed, missing or failed peers, overall status. Pure Python."""

from __future__ import annotations

import importlib.util
import json
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
        assert t.text, t.id
    assert len({t.id for t in targets.TARGETS}) == len(targets.TARGETS)
    with pytest.raises(ValueError, match="`peer` must"):
        Target("x", "te_fused_det", None, 1.0, "fwd_tflops")
    with pytest.raises(ValueError, match="`metric` must"):
        Target("x", "te_fused_det", "fa4", 1.0, "tflops")
    with pytest.raises(ValueError, match="`threshold` must"):
        Target("x", "te_fused_det", "fa4", None, "fwd_tflops")


# The current targets: (subject, peer, metric) -> (threshold, direction), every grid case in scope.
CURRENT = {
    ("te_fused_det", "torch_cudnn", "fwd_bwd_tflops"): (1.0, "ge"),
    ("te_dpa_det", "torch_cudnn", "fwd_bwd_tflops"): (1.0, "ge"),
    ("te_fused_det", "fa4_det", "fwd_bwd_tflops"): (0.95, "ge"),
    ("jax_te_det", "te_fused_det", "fwd_bwd_tflops"): (0.97, "ge"),
    ("jax_te_det_kt", "te_fused_det_kt", "fwd_bwd_tflops"): (0.97, "ge"),
    ("jax_te_det", "jax_cudnn", "fwd_bwd_tflops"): (1.0, "ge"),
    ("te_fused_det", "te_fused", "fwd_bwd_tflops"): (0.97, "ge"),
    ("jax_te_det", "jax_te", "fwd_bwd_tflops"): (0.97, "ge"),
    ("te_fused_det", "te_fused", "peak_gb"): (1.02, "le"),
    ("jax_te_det", "jax_te", "peak_gb"): (1.02, "le"),
}


def _ratio_targets():
    return {(t.subject, t.peer, t.metric): t for t in targets.TARGETS if t.peer is not None}


def test_current_targets_and_thresholds():
    ratio = _ratio_targets()
    assert set(ratio) == set(CURRENT), "superseded targets (0.9x fa4, 1.3x jax cuDNN det, 3x xla, ...) are gone"
    for key, (threshold, direction) in CURRENT.items():
        t = ratio[key]
        assert (t.threshold, t.direction, t.groups) == (threshold, direction, None), t.id
    subjects = ("te_dpa_det", "te_fused_det", "jax_te_det")
    checks = {(t.metric, t.subject, t.groups) for t in targets.TARGETS if t.peer is None}
    assert checks == {("runs_bitwise", s, ("long",)) for s in subjects} | {("bitwise", s, None) for s in subjects}


@pytest.mark.parametrize("key", sorted(CURRENT))
def test_current_target_met_at_the_threshold_missed_just_past_it(key):
    """Each current target on synthetic rows: at the threshold met, 1% past it missed, a skipped or
    failed peer n/a (e.g. flash-attn-4 or torch's cuDNN refusing d_qk 192 / d_v 128)."""
    t = _ratio_targets()[key]
    subject, peer, metric = key
    threshold, direction = CURRENT[key]
    worse = threshold * (1.01 if direction == "le" else 0.99)
    peer_row = row("c", peer, **{metric: 100.0})
    met = evaluate_cell(t, row("c", subject, **{metric: 100.0 * threshold}), peer_row)
    assert met["status"] == "met" and met["ratio"] == pytest.approx(threshold)
    assert evaluate_cell(t, row("c", subject, **{metric: 100.0 * worse}), peer_row)["status"] == "missed"
    for status in ("skipped", "error"):
        cell = evaluate_cell(t, row("c", subject, **{metric: 100.0}), row("c", peer, status, reason="d_v != d_qk"))
        assert cell["status"] == "n/a" and "d_v != d_qk" in cell["reason"]


def test_current_targets_over_the_grid():
    """Every target on every grid case: all met on rows where ours lead; fa4_det erring on the d192 cases
    leaves that target incomplete, not missed; the long runs_bitwise checks cover both long cases."""
    grid = [c.to_dict() for c in cases.GRID]
    speed = {"te_fused_det": 500.0, "te_fused": 510.0, "te_dpa_det": 520.0, "te_dpa": 600.0, "fa4_det": 500.0,
             "torch_cudnn": 480.0, "jax_te_det": 495.0, "jax_te": 500.0, "jax_cudnn": 470.0,
             "te_fused_det_kt": 520.0, "jax_te_det_kt": 505.0}
    memory = {"te_fused_det": 1.0, "te_fused": 1.0, "jax_te_det": 2.0, "jax_te": 1.99}
    rows = []
    for c in cases.GRID:
        for impl, tflops in speed.items():
            if impl == "fa4_det" and c.group == "d192":
                rows.append(row(c.name, impl, "error", reason="RuntimeError: head dim (192, 128) unsupported"))
                continue
            rows.append(row(c.name, impl, fwd_bwd_tflops=tflops, peak_gb=memory.get(impl), bitwise=True))
    res = {r["id"]: r for r in evaluate(rows, grid)}
    fa4 = res["fused_det>=0.95xfa4_det"]
    assert fa4["status"] == "incomplete" and fa4["n/a"] == 2 and fa4["missed"] == 0
    assert all(r["status"] == "met" for i, r in res.items() if i != fa4["id"]), {i: r["status"] for i, r in res.items()}
    assert res["jax_det>=0.97xtorch_fused_det"]["worst_ratio"] == 0.99
    assert res["jax_kt>=0.97xtorch_kt"]["worst_ratio"] == pytest.approx(505 / 520, abs=1e-2)
    assert res["jax_det_mem<=jax"]["worst_ratio"] == pytest.approx(2.0 / 1.99, abs=1e-3)
    assert set(res["long_runs_det:te_fused_det"]["cells"]) == {"1x8x65536x128-causal", "1x8x131072x128-causal"}
    assert len(res["bitwise:jax_te_det"]["cells"]) == len(cases.GRID)
    slow = [r for r in rows if not (r["case"] == "2x16x4096x192v128-causal" and r["impl"] == "te_fused_det")]
    slow.append(row("2x16x4096x192v128-causal", "te_fused_det", fwd_bwd_tflops=470.0, bitwise=True))
    res = {r["id"]: r for r in evaluate(slow, grid)}
    assert res["fused_det>=torch_cudnn"]["status"] == "missed"
    assert res["fused_det>=torch_cudnn"]["cells"]["2x16x4096x192v128-causal"]["ratio"] == pytest.approx(470 / 480,
                                                                                                         abs=1e-3)
    assert res["jax_det>=0.97xtorch_fused_det"]["status"] == "met"  # 495 / 470: JAX ahead of PyTorch is fine


def test_grid_is_the_issue_grid():
    dense = {(c.b, c.hq, c.hkv, c.s, c.d, c.d_v, c.causal) for c in cases.GRID if c.layout == "bshd"}
    for b, h, s, d in ((4, 16, 4096, 128), (1, 16, 16384, 128), (8, 32, 2048, 64)):
        assert {(b, h, h, s, d, d, False), (b, h, h, s, d, d, True)} <= dense
    assert {(2, 32, 8, 8192, 128, 128, True), (1, 8, 8, 65536, 128, 128, True), (1, 8, 8, 131072, 128, 128, True),
            (2, 16, 16, 4096, 256, 256, True), (2, 16, 16, 4096, 192, 128, True),
            (2, 16, 16, 4096, 192, 128, False)} <= dense
    assert {c.d for c in cases.GRID} == {64, 128, 192, 256}
    (thd,) = [c for c in cases.GRID if c.layout == "thd"]
    assert len(thd.seqlens) == 16 and min(thd.seqlens) == 512 and max(thd.seqlens) == 4096
    assert thd.seqlens == cases.thd_lengths() and (thd.hq, thd.d, thd.causal) == (16, 128, True)
    assert {c.group for c in cases.GRID} == set(cases.GROUPS) == {c.group for c in cases.DRY_GRID}
    assert any(c.d_v != c.d for c in cases.DRY_GRID)  # the dry run passes a separate v head dim through
    for grid in (cases.GRID, cases.DRY_GRID):
        assert len({c.name for c in grid}) == len(grid)


def test_parts_cover_every_group_and_implementation():
    torch_groups = set(cases.PARTS["torch-std"][0]) | set(cases.PARTS["torch-ext"][0])
    assert torch_groups == set(cases.GROUPS) == set(cases.PARTS["jax"][0])
    assert not set(cases.PARTS["torch-std"][0]) & set(cases.PARTS["torch-ext"][0])
    assert set(cases.PARTS["all"][1]) == set(cases.ALL_IMPLS)
    assert set(cases.PARTS["kernel-time"][1]) == set(cases.KERNEL_TIME_IMPLS)  # one subprocess measures both


def test_case_names_of_earlier_results_are_unchanged():
    """Names are the keys merged results join on: the cases of earlier runs keep theirs."""
    names = {c.name for c in cases.GRID}
    assert {"4x16x4096x128-none", "4x16x4096x128-causal", "1x16x16384x128-none", "1x16x16384x128-causal",
            "8x32x2048x64-none", "8x32x2048x64-causal", "2x32q8kvx8192x128-causal", "thd16x16x128-causal",
            "1x8x131072x128-causal", "2x16x4096x256-causal"} <= names


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
    # a separate v head dim: QK^T costs 2*s^2*d_qk, PV 2*s^2*d_v
    (mla,) = cases.select_cases(cases.GRID, ["2x16x4096x192v128-none"])
    assert mla.flops("fwd") == 2.0 * 2 * 16 * 4096 * 4096 * (192 + 128)
    assert cases.attn_flops(2, 16, 4096, 4096, 128, True, "bwd") == cases.attn_flops(2, 16, 4096, 4096, 128, True,
                                                                                      "bwd", d_v=128)
    with pytest.raises(ValueError):
        cases.select_cases(cases.GRID, ["nope"])


def test_case_dicts_round_trip_and_old_rows_load():
    for c in cases.GRID + cases.DRY_GRID:
        assert cases.Case.from_dict(c.to_dict()) == c
    (mla,) = cases.select_cases(cases.GRID, ["2x16x4096x192v128-causal"])
    assert (mla.d, mla.d_v, mla.shape) == (192, 128, "2,16,4096,192/128")
    old = {k: v for k, v in cases.GRID[0].to_dict().items() if k != "d_v"}  # written before d_v existed
    assert cases.Case.from_dict(old) == cases.GRID[0] and cases.GRID[0].d_v == 128
    committed = json.loads((_BENCH.parent / "results" / "attention.json").read_text())
    by_name = {c.name: c for c in cases.GRID}
    for d in committed["cases"]:
        assert cases.Case.from_dict(d) == by_name[d["name"]]
    with pytest.raises(ValueError, match="`d_v` must"):
        cases.Case("x", "std", 1, 1, 1, 64, 64, False, d_v=0)


def test_user_table_labels_read_a_separate_v_head_dim():
    user_tables = _load("user_tables")
    labels = {user_tables._case_label(c.name) for c in cases.GRID}
    assert {"b2 h16 s4096 d192 v128 causal", "b2 h16 s4096 d192 v128 none", "b4 h16 s4096 d128 none"} <= labels
