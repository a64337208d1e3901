"""Where one timed fwd+bwd step goes on the GPU, as bench_core's timing sees it: per step, the kernels' device
time, the idle time before the first kernel (host work after do_bench's cache flush) and between kernels.

    python dev/tuning/step_timeline.py --out dev/results/step_timeline

Each step repeats do_bench's pattern (flush the L2 by zeroing a 256 MB buffer, then run the step) under the
profiler; the flush kernel marks where a step may start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# cases, common and bench_core are the user benchmark's modules (benchmarks/attention/).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "attention"))

from bench_core import PEERS
from cases import attn_flops
from causal_breakdown import kernel_us
from common import bench_ms, run_metadata, write_results
from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.common.attention.plan import Tiles, backward_plan
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call

SHAPES = [(4, 16, 4096, 128, True), (4, 16, 4096, 128, False)]


def kernel_trace(step, flush, reps):
    """[(name, start_us, end_us)] of every GPU kernel over ``reps`` flush-then-step rounds."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda k: k[1])


def split_steps(kernels, flush_marker, flush_min_us=20.0):
    """Per round: (end of the flush kernel, the step's kernels). The flush is the long fill (a step may
    launch short fills of its own)."""
    steps, current = [], None
    for name, start, end in kernels:
        if flush_marker in name and end - start >= flush_min_us:
            current = (end, [])
            steps.append(current)
        elif current is not None:
            current[1].append((name, start, end))
    return [s for s in steps if s[1]]


def measure(name, b, h, s, d, causal, reps):
    make = PEERS[name]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    fn = make(q, k, v, causal)
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def step():
        q.grad = k.grad = v.grad = None
        fn().backward(do)

    for _ in range(5):
        cache.zero_()
        step()
    torch.cuda.synchronize()
    rounds = split_steps(kernel_trace(step, cache.zero_, reps), "FillFunctor")
    bench_us = bench_ms(lambda: fn().backward(do), grad_to_none=[q, k, v]) * 1e3  # bench_core's number
    lead, span, busy = [], [], []
    per_kernel = {}  # name -> ([durations], [idle time before it])
    for flush_end, kernels in rounds:
        lead.append(kernels[0][1] - flush_end)
        span.append(kernels[-1][2] - flush_end)
        busy.append(sum(end - start for _, start, end in kernels))
        previous_end = flush_end
        for kname, start, end in kernels:
            times, gaps = per_kernel.setdefault(kname.split("(")[0][:48], ([], []))
            times.append(end - start)
            gaps.append(start - previous_end)
            previous_end = end
    med_span = statistics.median(span)
    return dict(
        backend=name, shape=f"{b},{h},{s},{d}", mask="causal" if causal else "none",
        do_bench_us=round(bench_us, 1), step_us=round(med_span, 1), kernels_us=round(statistics.median(busy), 1),
        lead_gap_us=round(statistics.median(lead), 1),
        inner_gaps_us=round(statistics.median(sp - bu - le for sp, bu, le in zip(span, busy, lead)), 1),
        tflops_step=round(attn_flops(b, h, s, s, d, causal, "fwd_bwd") / med_span / 1e6, 1),
        tflops_kernels=round(attn_flops(b, h, s, s, d, causal, "fwd_bwd") / statistics.median(busy) / 1e6, 1),
        kernels="; ".join(f"{k} {statistics.median(t):.1f} (idle before {statistics.median(g):.1f})"
                          for k, (t, g) in per_kernel.items()),
        rounds=len(rounds),
    )


def preprocess_us(tiles, b, h, s, d, reps):
    """Device time of the backward's preprocess kernel (delta = rowsum(O * dO)) under other tiles
    ("64x4": 64 rows, 4 warps), as bytes moved per second too."""
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fmt, mask = QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK
    call = fused_call(fmt, mask, None, d ** -0.5)
    o, lse = kernel_runner.forward(q, k, v, call)
    rows = []
    for spec in tiles.split(","):
        block_m, warps = (int(x) for x in spec.split("x"))
        plan = dataclasses.replace(backward_plan(kernel_runner.plan_key(q, k, v, call)),
                                   preprocess=Tiles(block_m, 0, warps, 1))
        us = kernel_us(lambda: kernel_runner.backward(q, k, v, o, do, lse, call, plan),
                       reps)["attn_bwd_preprocess_kernel"]
        rows.append(dict(backend=f"preprocess {spec}", shape=f"{b},{h},{s},{d}", mask="causal",
                         kernels_us=round(us, 1), kernels=f"{2 * o.numel() * 2 / us / 1e6:.2f} TB/s"))
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="dev/results/step_timeline")
    ap.add_argument("--peers", default="ours_det,torch_cudnn")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--preprocess", default="", help='preprocess tiles to time, e.g. "64x4,128x8"')
    args = ap.parse_args()
    rows = preprocess_us(args.preprocess, 4, 16, 4096, 128, args.reps) if args.preprocess else []
    for b, h, s, d, causal in SHAPES:
        for name in args.peers.split(","):
            rows.append(measure(name, b, h, s, d, causal, args.reps))
            print(rows[-1], flush=True)
    write_results(args.out, run_metadata("python dev/tuning/step_timeline.py " + " ".join(sys.argv[1:]),
                                         torch.cuda.get_device_name()),
                  rows, ["shape", "mask", "backend", "do_bench_us", "step_us", "kernels_us", "lead_gap_us", "inner_gaps_us",
                         "tflops_step", "tflops_kernels", "rounds", "kernels"])


if __name__ == "__main__":
    main()
