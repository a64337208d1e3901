"""Deterministic attention at d=256 on the H200: our fused kernels against flash-attn-4's deterministic mode,
no mask and causal at several lengths, with the backend DotProductAttention picks (policy.order_backends puts
flash-attn-4 first in deterministic mode where FlashAttention.MEASURED_FASTER_DETERMINISTIC lists the head dims).
The benchmark's own measure (bench_attention.measure_torch): fwd+bwd TFLOP/s, peak memory, bitwise repeats.

    . dev/device/install_flash_attn4.sh; python dev/tuning/dpa_d256.py --out /tmp/dpa_d256.json
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "attention"))

from bench_attention import measure_torch  # noqa: E402
from cases import _dense  # noqa: E402
from common import run_metadata  # noqa: E402
from peers import make_inputs  # noqa: E402

IMPLS = ("te_fused_det", "fa4_det", "te_dpa_det", "te_fused", "fa4", "torch_cudnn")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cases = [_dense("d256", b, 16, s, 256, causal) for b, s in ((2, 4096), (8, 1024), (1, 16384))
             for causal in (False, True)]
    rows = []
    for case in cases:
        inp = make_inputs(case, torch.device("cuda"), torch.bfloat16)
        for impl in IMPLS:
            row = measure_torch(impl, case, inp, args, True)
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("case", "impl", "status", "fwd_bwd_tflops", "fwd_tflops",
                                                       "bitwise", "backend", "peak_gb", "reason")}), flush=True)
        del inp
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=run_metadata("dev/tuning/dpa_d256.py", torch.cuda.get_device_name()), rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
