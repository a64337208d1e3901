"""What the canonical sum over key chunks costs the training forward (ForwardPlan.kv_chunk, kernels/forward.py).

Keys beyond one chunk are summed chunk by chunk, each from scratch, and folded in order: the price of split-KV
decode with the training forward's bits. The Triton forward does it everywhere it serves (d=64, calls with a
bias, fp32); Hopper's Gluon forward at d=128 (its consumers fold with a second accumulator). Per case, the forward's time with the planned chunk against the same launch summing all keys at
once (a plan with ``kv_chunk=0``: the kernel before chunking), as a ratio; and with the planned chunk, whether
the one-program and the split forms give the same bits (``bitwise``). Where the plan caps the chunked sum's
registers (ForwardPlan.kv_chunk_registers), the same ratio without the cap and whether both give the same bits.

    python benchmarks/attention/bench_kv_chunk.py --out benchmarks/results/kv_chunk
    python benchmarks/attention/bench_kv_chunk.py --smoke   # a tiny grid, any device (TRITON_INTERPRET=1 on CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from common import bench_ms, counted_ms, run_metadata, write_results
from transformer_engine.common.attention.plan import forward_plan
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call

# (batch, seqlen, heads, head dim, mask, bias): 32k tokens; d=64 plain and d=128 with a bias (Triton forward), d=128
# plain (Hopper: the Gluon forward)
GRID = [(2, 16384, 16, 64, "causal", False), (2, 16384, 16, 64, "no_mask", False), (1, 32768, 16, 64, "causal", False),
        (2, 16384, 16, 128, "causal", True), (2, 16384, 16, 128, "causal", False), (1, 32768, 16, 128, "no_mask", False)]
SMOKE_GRID = [(1, 200, 2, 16, "causal", False), (1, 150, 2, 16, "no_mask", True)]


def timed_ms(fn):
    """Median ms on a GPU; a couple of counted calls elsewhere (the smoke run checks the script, not speed)."""
    return bench_ms(fn) if torch.cuda.is_available() else counted_ms(fn, 2, 1, lambda: None)


def case(b, s, h, d, mask, bias, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g) for _ in range(3))
    extra = {"bias": torch.randn(1, h, s, s, device=device, dtype=dtype, generator=g)} if bias else {}
    call = fused_call("bshd", mask, None, d ** -0.5, **extra)
    plan = forward_plan(kernel_runner.plan_key(q, k, v, call))
    one_chunk = dataclasses.replace(plan, kv_chunk=0)
    chunked_ms = timed_ms(lambda: kernel_runner.forward(q, k, v, call, plan, split_kv=False))
    one_ms = timed_ms(lambda: kernel_runner.forward(q, k, v, call, one_chunk))
    split_out = kernel_runner.forward(q, k, v, call, plan, split_kv=True)[0]
    whole_out = kernel_runner.forward(q, k, v, call, plan, split_kv=False)[0]
    capped = {}
    if plan.kv_chunk_registers is not None:  # the same chunked launch without the plan's register cap
        uncapped = dataclasses.replace(plan, kv_chunk_registers=None)
        uncapped_ms = timed_ms(lambda: kernel_runner.forward(q, k, v, call, uncapped, split_kv=False))
        uncapped_out = kernel_runner.forward(q, k, v, call, uncapped, split_kv=False)[0]
        capped = dict(kv_chunk_registers=plan.kv_chunk_registers, uncapped_ratio=round(one_ms / uncapped_ms, 3),
                      cap_bitwise=bool(torch.equal(uncapped_out, whole_out)))
    flops = 4 * b * h * s * s * d * (0.5 if mask == "causal" else 1.0)
    kernel = "gluon" if plan.warp_specialized is not None else "triton"  # contiguous tensors: TMA-eligible
    return dict(batch=b, seqlen=s, heads=h, dim=d, mask=mask, bias=bias, kernel=kernel, kv_chunk=plan.kv_chunk,
                chunked_tflops=round(flops / chunked_ms / 1e9, 1), one_chunk_tflops=round(flops / one_ms / 1e9, 1),
                ratio=round(one_ms / chunked_ms, 3), bitwise=bool(torch.equal(split_out, whole_out)), **capped)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kv_chunk")
    ap.add_argument("--smoke", action="store_true", help="a tiny grid, any device: the script's own check")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    rows = []
    for shape in (SMOKE_GRID if args.smoke else GRID):
        try:
            row = case(*shape, dtype, device)
        except Exception as err:  # a case that cannot run here is reported, not fatal
            row = dict(zip(("batch", "seqlen", "heads", "dim", "mask", "bias"), shape),
                       error=f"{type(err).__name__}: {str(err)[:80]}")
        print(row, flush=True)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    write_results(args.out, run_metadata("python benchmarks/attention/bench_kv_chunk.py " + " ".join(sys.argv[1:]),
                                         name, str(dtype).replace("torch.", ""), dry_run=args.smoke),
                  rows, ["batch", "seqlen", "heads", "dim", "mask", "bias", "kernel", "kv_chunk", "chunked_tflops",
                         "one_chunk_tflops", "ratio", "bitwise", "kv_chunk_registers", "uncapped_ratio", "cap_bitwise",
                         "error"])


if __name__ == "__main__":
    main()
