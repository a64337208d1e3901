"""The TransformerEngine test-table driver (te_configs, te_case, run_te_tables) on the CPU.

The full tables run on the GPU (qa/L1_pytorch_te_tables); here a few cases, shrunk, run under
Triton's interpreter, and the runner shows that a case whose process dies is recorded as crashed
while the cases after it still run.
"""

from __future__ import annotations

import json
import os

import pytest

import te_configs
import te_case
import run_te_tables
from dpa_helpers import requires_fused


def test_cases_follow_the_tables_parametrization():
    cases = list(te_configs.cases())
    names = {c.name for c in cases}
    assert len(names) == len(cases)
    assert {c.table for c in cases} == set(te_configs._TESTS)
    # Packed qkv layouts only for self attention without GQA; pad_between_seqs only for thd.
    for c in cases:
        if "3" in c.qkv_layout:
            assert not c.row.is_cross and c.row.num_heads == c.row.heads_kv, c.name
        assert not c.pad_between_seqs or c.qkv_layout.startswith("t"), c.name
    assert "base/base_3_1/float16/bshd_bs2hd" in names  # s_q = 1 at d = 256 (cross attention: kv-packed)
    assert "layout/layout_0_0/bfloat16/sbh3d" in names
    assert all(c.row.return_max_logit for c in cases if c.table == "max_logit")


@requires_fused
@pytest.mark.parametrize("name", [
    "base/base_3_1/bfloat16/bshd_bs2hd",
    "bias_shapes/bias_1_2/bfloat16/sb3hd",
    "layout/layout_0_0/bfloat16/sbh3d",
    "alibi_slopes/alibi_2_1/bfloat16/bshd_bs2hd",
    "swa/swa_3_3/bfloat16/sbhd_sbhd_sbhd",
])
def test_shrunk_cases_pass_against_the_reference(name):
    case = {c.name: c for c in te_configs.cases()}[name]
    result = te_case.run_case(case, "cpu" if not te_case.torch.cuda.is_available() else "cuda", scale_down=True)
    assert result["status"] == "pass", result


def test_reference_catches_a_wrong_answer(monkeypatch):
    """The judge fails a case whose output is off (a check that could not fail would prove nothing)."""
    case = {c.name: c for c in te_configs.cases()}["base/base_1_0/float16/sb3hd"]
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    real = te_case._attend

    def off_by_a_bit(inputs):
        result, backend, module = real(inputs)
        result["out"] = result["out"] * 1.01
        return result, backend, module

    monkeypatch.setattr(te_case, "_attend", off_by_a_bit)
    result = te_case.run_case(case, "cpu", scale_down=True)
    assert result["status"] == "fail" and result["detail"].startswith("out"), result


def test_runner_isolates_a_case_that_kills_its_process(tmp_path, monkeypatch):
    names = ["base/base_1_0/float16/sb3hd", "base/base_1_1/float16/bshd_bs2hd", "mla/mla_1_0/float16/sbhd_sbhd_sbhd"]
    monkeypatch.setenv("TE_TABLES_DIE_ON", names[1])
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")  # the runner's plumbing, not the kernels
    rc = run_te_tables.main(["--out", str(tmp_path), "--cases", ",".join(names), "--workers", "1", "--scale-down"])
    results = {r["case"]: r for r in map(json.loads, open(tmp_path / "results.jsonl"))}
    assert rc == 1
    assert results[names[1]]["status"] == "crashed"
    assert results[names[0]]["status"] == "pass" and results[names[2]]["status"] == "pass", results
    summary = open(tmp_path / "summary.md").read()
    assert "| **all** | **2** | **0** | **0** | **0** | **1** |" in summary
    assert os.path.exists(tmp_path / "worker0.log")
