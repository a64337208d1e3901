"""benchmarks/attention/bench_attention.py --dry-run on the CPU: rows measured or skipped with a
reason (never fatal), Markdown and JSON written, targets evaluated; --merge and --skip-done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "attention" / "bench_attention.py"


def run(*args, timeout=300):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# The dry run drives the Triton interpreter (TRITON_INTERPRET=1), which takes CPU tensors only; on a
# GPU machine the real benchmark runs instead (benchmarks/README.md).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU check of the harness")


@cpu_only
def test_dry_run_writes_rows_reasons_and_targets(tmp_path):
    stem = str(tmp_path / "a")
    run("--dry-run", "--cases", "1x2x64x32-causal", "--impls",
        "te_fused_det,fa4_det,cudnn_fe_det,torch_cudnn,torch_flash", "--out", stem, "--no-plot")
    doc = json.loads(Path(stem + ".json").read_text())
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rows["te_fused_det"]["status"] == "ok" and rows["te_fused_det"]["bitwise"] is True
    assert rows["te_fused_det"]["backend"] == "FusedAttention"
    for impl in ("fa4_det", "cudnn_fe_det", "torch_cudnn"):
        assert rows[impl]["status"] == "skipped" and rows[impl]["reason"], impl
    assert doc["meta"]["dry_run"] and doc["meta"]["versions"]["torch"]
    by_id = {t["id"]: t for t in doc["targets"]}
    assert by_id["bitwise:te_fused_det"]["status"] == "met"
    assert by_id["fused_det>=0.95xfa4_det"]["status"] == "not measured"
    text = Path(stem + ".md").read_text()
    assert "## Targets" in text and "Dry run" in text and "flash-attn-4 runs on NVIDIA" in text

    # a second call skips what the first measured and the merge keeps both
    stem2 = str(tmp_path / "b")
    out = run("--dry-run", "--cases", "1x2x64x32-causal", "--impls", "te_fused_det,fa4_det,torch_flash_det", "--out",
              stem2, "--skip-done", stem + ".json", "--no-plot")
    assert "already measured" in out
    impls2 = [r["impl"] for r in json.loads(Path(stem2 + ".json").read_text())["rows"]]
    assert impls2 == ["fa4_det", "torch_flash_det"]  # a skipped peer is tried again
    merged = str(tmp_path / "m")
    run("--merge", stem + ".json", stem2 + ".json", "--out", merged, "--no-plot")
    doc = json.loads(Path(merged + ".json").read_text())
    assert {r["impl"] for r in doc["rows"]} == {"te_fused_det", "fa4_det", "cudnn_fe_det", "torch_cudnn", "torch_flash",
                                                "torch_flash_det"}
    assert [m["part"] for m in doc["parts"]] == ["custom", "custom", "merge"]


@cpu_only
def test_dry_run_separate_v_head_dim(tmp_path):
    """d_qk != d_v (the d192 group): our kernels run it; a peer that cannot is an error row with torch's reason."""
    stem = str(tmp_path / "v")
    run("--dry-run", "--cases", "d192", "--impls", "te_fused_det,torch_flash", "--out", stem, "--no-plot")
    doc = json.loads(Path(stem + ".json").read_text())
    (case,) = doc["cases"]
    assert (case["d"], case["d_v"], case["shape"]) == (48, 32, "1,2,64,48/32")
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rows["te_fused_det"]["status"] == "ok" and rows["te_fused_det"]["bitwise"] is True
    prefix = "RuntimeError: torch SDPA has no kernel for this call: "
    assert rows["torch_flash"]["status"] == "error" and rows["torch_flash"]["reason"].startswith(prefix)
    assert len(rows["torch_flash"]["reason"]) > len(prefix) + 10  # torch's reason, not a bare refusal


@cpu_only
def test_dry_run_kernel_time_part_needs_a_gpu(tmp_path):
    """The kernel-time pair (PyTorch and JAX launching the same kernels, timed by the profiler in one
    subprocess): on the CPU both rows are skipped with the reason, and their target is not measured."""
    stem = str(tmp_path / "kt")
    out = run("--dry-run", "--part", "kernel-time", "--cases", "1x2x64x32-causal", "--out", stem, "--no-plot")
    assert "kernel_time.py" in out
    doc = json.loads(Path(stem + ".json").read_text())
    rows = {r["impl"]: r for r in doc["rows"]}
    assert set(rows) == {"te_fused_det_kt", "jax_te_det_kt"}
    for r in rows.values():
        assert r["status"] == "skipped" and "CUDA GPU" in r["reason"], r
    by_id = {t["id"]: t for t in doc["targets"]}
    assert by_id["jax_kt>=0.97xtorch_kt"]["status"] == "not measured"


@cpu_only
def test_row_a_dead_process_left_is_an_error_and_the_rest_runs(tmp_path):
    """A peer that faults poisons its process; the run that follows with the same --out finds the
    row it died in (<out>.pending), records it as an error, and measures the others."""
    stem = str(tmp_path / "p")
    Path(stem + ".pending").write_text(json.dumps({"case": "1x2x64x32-causal", "impl": "torch_flash"}))
    out = run("--dry-run", "--cases", "1x2x64x32-causal", "--impls", "te_fused_det,torch_flash", "--out", stem,
              "--no-plot")
    assert "process died during this row" in out
    rows = {r["impl"]: r for r in json.loads(Path(stem + ".json").read_text())["rows"]}
    assert rows["torch_flash"]["status"] == "error" and "process died" in rows["torch_flash"]["reason"]
    assert rows["torch_flash"]["label"] != "torch_flash"  # labelled like every other torch row
    assert rows["te_fused_det"]["status"] == "ok"
    assert not Path(stem + ".pending").exists()  # removed once recorded, and after every finished row
