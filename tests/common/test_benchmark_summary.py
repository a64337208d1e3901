"""docs/benchmarks.rst's tables (benchmarks/results/summary.rst) are generated from the committed
results JSON and kept equal to it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "attention"))

import user_tables  # noqa: E402


def test_summary_tables_match_the_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "attention.json").read_text())
    committed = (ROOT / "benchmarks" / "results" / "summary.rst").read_text()
    assert committed == user_tables.tables(results), (
        "benchmarks/results/summary.rst is stale: python benchmarks/attention/user_tables.py "
        "benchmarks/results/attention.json > benchmarks/results/summary.rst")


def test_a_case_without_a_result_shows_a_dash():
    results = {"cases": ["4x16x4096x128-causal"],
               "rows": [{"case": "4x16x4096x128-causal", "impl": "te_dpa_det", "status": "ok", "fwd_bwd_tflops": 500.4,
                         "peak_gb": 0.3},
                        {"case": "4x16x4096x128-causal", "impl": "fa4_det", "status": "error"}]}
    text = user_tables.tables(results)
    assert '"b4 h16 s4096 d128 causal", "500", "-"' in text, text
