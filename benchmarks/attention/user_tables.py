"""The user-facing benchmark tables (docs/benchmarks.rst) from a results JSON.

    python benchmarks/attention/user_tables.py benchmarks/results/attention.json > benchmarks/results/summary.rst

One table per question a user asks: how fast deterministic attention is against what they use today
(PyTorch; JAX), and how much memory it takes. Cells are fwd+bwd TFLOP/s (or peak GB) of one run;
"-" where an implementation did not run the case (the full table, benchmarks/results/attention.md,
says why). tests/common/test_benchmark_summary.py keeps the committed file equal to this output.
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Sequence, Tuple

QUESTIONS: Sequence[Tuple[str, str, str, Sequence[str]]] = (
    ("PyTorch: deterministic training attention, fwd+bwd TFLOP/s (higher is better)", "fwd_bwd_tflops", "{:.0f}",
     ("te_dpa_det", "te_fused_det", "fa4_det", "cudnn_fe_det", "torch_flash_det", "te_dpa", "torch_flash")),
    ("JAX: deterministic training attention, fwd+bwd TFLOP/s (higher is better)", "fwd_bwd_tflops", "{:.0f}",
     ("jax_te_det", "jax_cudnn_det", "jax_xla", "jax_te", "jax_cudnn")),
    ("Memory: peak GB above the inputs during one deterministic fwd+bwd (lower is better)", "peak_gb", "{:.2f}",
     ("te_dpa_det", "cudnn_fe_det", "torch_flash_det", "jax_te_det", "jax_cudnn_det")),
)

SHORT = {
    "te_dpa_det": "ours (DotProductAttention), det", "te_dpa": "ours, non-det",
    "te_fused_det": "ours, Triton kernels forced, det",
    "fa4_det": "flash-attn-4, det", "cudnn_fe_det": "cuDNN SDPA, det",
    "torch_flash_det": "torch SDPA under use_deterministic_algorithms", "torch_flash": "torch SDPA flash, non-det",
    "jax_te_det": "ours (fused_attn), det", "jax_te": "ours, non-det",
    "jax_cudnn_det": "jax cuDNN, XLA det flag", "jax_cudnn": "jax cuDNN, non-det", "jax_xla": "jax XLA (unfused)",
}


def _case_label(case: str) -> str:
    """'4x16x4096x128-causal' -> 'b4 h16 s4096 d128 causal', '...x192v128-none' -> '... d192 v128 none';
    'thd16x16x128-causal' stays readable too."""
    shape, _, mask = case.partition("-")
    if shape.startswith("thd"):
        return f"packed (thd) {shape[3:]} {mask}"
    b, h, s, d = shape.split("x")
    return f"b{b} h{h} s{s} d{d.replace('v', ' v')} {mask}"


def tables(results: Dict) -> str:
    cases: List[str] = [c if isinstance(c, str) else c["name"] for c in results["cases"]]
    rows = {(r["case"], r["impl"]): r for r in results["rows"]}
    out = []
    for title, key, fmt, impls in QUESTIONS:
        out += [f".. csv-table:: {title}", "   :header-rows: 1", "   :stub-columns: 1", ""]
        out.append("   " + ", ".join(['"case"'] + [f'"{SHORT[i]}"' for i in impls]))
        for case in cases:
            cells = []
            for impl in impls:
                row = rows.get((case, impl))
                value = row.get(key) if row and row.get("status") == "ok" else None
                cells.append(fmt.format(value) if isinstance(value, (int, float)) else "-")
            out.append("   " + ", ".join([f'"{_case_label(case)}"'] + [f'"{c}"' for c in cells]))
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    with open(argv[0]) as f:
        sys.stdout.write(tables(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
