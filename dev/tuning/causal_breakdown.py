"""Where the deterministic backward's time goes at d=128: device time of each
kernel, no mask and causal, over shapes with equal total work (b * s^2 constant) but 16 to 128 query
blocks per dK/dV program, so the cost of a program's prologue and epilogue shows as the slope of time
against the number of programs.

    python dev/tuning/causal_breakdown.py --out dev/results/causal_breakdown
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# cases, common, kernel_time and bench_core are the user benchmark's modules (benchmarks/attention/).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "attention"))

from cases import attn_flops
from kernel_time import per_kernel_us
from common import run_metadata, write_results
from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.common.attention.plan import backward_plan
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call

SHAPES = [(1, 16, 8192, 128), (4, 16, 4096, 128), (16, 16, 2048, 128), (64, 16, 1024, 128)]
KERNELS = ("attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")


def print_kernels(title, kernels):
    """A markdown table of per_kernel_us's result, longest first; returns the total device ms."""
    total = sum(us for _, us in kernels.values()) / 1e3
    print(f"### {title}: {total:.3f} ms of kernels per call\n")
    print("| kernel | calls | us |")
    print("|---|---|---|")
    for name, (calls, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {calls:.0f} | {us:.1f} |")
    print()
    return total


def kernel_us(fn, reps):
    """Mean device time per call of each of KERNELS (microseconds), from the profiler's trace."""
    times = {name: 0.0 for name in KERNELS}
    for key, (_, us) in per_kernel_us(fn, reps).items():
        for name in KERNELS:
            if key.startswith(name):
                times[name] += us
    return times


def measure(b, h, s, d, causal, reps):
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fmt = QKVFormat.BSHD
    mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
    call = fused_call(fmt, mask, None, d ** -0.5)
    cfg = kernel_runner.plan_key(q, k, v, call)
    o, lse = kernel_runner.forward(q, k, v, call)
    times = kernel_us(lambda: kernel_runner.forward(q, k, v, call), reps)
    times.update({name: t for name, t in kernel_us(
        lambda: kernel_runner.backward(q, k, v, o, do, lse, call), reps).items()
        if name != "attn_fwd_kernel"})
    dkdv_programs = b * h * -(-s // backward_plan(cfg).dkdv.block_n)
    bwd_us = sum(times[n] for n in KERNELS[1:])
    bwd = attn_flops(b, h, s, s, d, causal, "bwd")
    row = dict(shape=f"{b},{h},{s},{d}", mask="causal" if causal else "none", dkdv_programs=dkdv_programs,
               fwd_us=round(times["attn_fwd_kernel"], 1), preprocess_us=round(times["attn_bwd_preprocess_kernel"], 1),
               dkdv_us=round(times["attn_bwd_dkdv_kernel"], 1), dq_us=round(times["attn_bwd_dq_kernel"], 1),
               bwd_tflops=round(bwd / bwd_us / 1e6, 1),
               # Executed products: dK/dV recomputes S and dP and forms dV, dK (4 of the counted 5); dQ
               # recomputes S and dP again and forms dQ (3).
               dkdv_tflops=round(bwd * 4 / 5 / times["attn_bwd_dkdv_kernel"] / 1e6, 1),
               dq_tflops=round(bwd * 3 / 5 / times["attn_bwd_dq_kernel"] / 1e6, 1))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="dev/results/causal_breakdown")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for causal in (False, True):
        for b, h, s, d in SHAPES:
            rows.append(measure(b, h, s, d, causal, args.reps))
            print(rows[-1], flush=True)
    write_results(args.out, run_metadata("python dev/tuning/causal_breakdown.py " + " ".join(sys.argv[1:]),
                                         torch.cuda.get_device_name()),
                  rows, ["shape", "mask", "dkdv_programs", "fwd_us", "preprocess_us", "dkdv_us", "dq_us",
                         "bwd_tflops", "dkdv_tflops", "dq_tflops"])


if __name__ == "__main__":
    main()
