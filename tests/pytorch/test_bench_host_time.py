"""benchmarks/attention/bench_host_time.py runs and prints each row's host time per call and its ratio to the
peer's (CPU: the harness only; the numbers are the GPU's to read)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "attention" / "bench_host_time.py"


def test_the_host_time_benchmark_prints_ratios(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # our module runs unfused on a CPU: the harness is what is tested
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--calls", "2", "--rounds", "1", "--json-out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert re.search(r"^date: \d{4}-\d\d-\d\d", text, re.M) and "command: " in text
    for framework in ("pytorch (eager)", "jax (jit)"):
        for name in ("forward", "fwd+bwd"):
            line = [ln for ln in text.splitlines() if ln.startswith(framework) and f" {name} " in ln]
            assert len(line) == 1, text
            assert re.search(r"\d+\.\d\d$", line[0]), line[0]  # the ratio ends the row
    rows = [r for r in json.loads(out.read_text())["rows"] if "ratio" in r]
    assert len(rows) == 4 and all(r["ratio"] > 0 for r in rows)
