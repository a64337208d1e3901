"""Batch-invariant mode against the default mode and cuBLAS (GPU only).

- ``gemm``: ``x W^T`` (Linear's forward GEMM) in bf16 at N = K = 4096 (and the MLP's N = 14336) for M from 1 to 8192: the
  batch-invariant kernel (``transformer_engine.common.batch_invariant``, tiles fixed per (N, K, dtype)) next
  to ``torch.nn.functional.linear`` (cuBLAS, which picks its algorithm by M): medians in ms, TFLOP/s, ``ours / cublas``
  throughput ratio (the target is >= 0.85 at M >= 2048), and whether a row computed alone has the bits it has
  inside the M-row product.
- ``sweep`` (``--sweep``): other fixed tile sets at M = 4096, to choose the plan's tiles from measurements.
- ``model``: a stack of ``TransformerLayer`` (bf16, fwd + bwd) in the default mode and inside
  ``batch_invariant()``: step medians and the overhead (the target is within 15%).

Printed and written to --out as JSON. Not a test: run it on the GPU machine.

    python benchmarks/batch_invariant.py --out batch_invariant.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402  (benchmarks/timing.py)


def _launch(a, b, tiles):
    """The batch-invariant GEMM with explicit tiles (the sweep); the plan's tiles otherwise."""
    import torch
    import triton

    from transformer_engine.common.batch_invariant.kernels import bi_gemm_kernel

    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    bi_gemm_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                         c.stride(1), **tiles)
    return c


def bench_gemm(ms, shapes, warmup, iters):
    import torch

    from transformer_engine.pytorch.batch_invariance import bi_linear

    rows = []
    for n, k in shapes:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5  # Linear's weight: x W^T
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                ours = median_ms(lambda: bi_linear(a, w), warmup, iters)
                cublas = median_ms(lambda: torch.nn.functional.linear(a, w), warmup, iters)
                full = bi_linear(a, w)
                alone = bi_linear(a[m // 2:m // 2 + 1].contiguous(), w)
            flops = 2.0 * m * n * k
            row = dict(m=m, n=n, k=k, ours_ms=ours, cublas_ms=cublas, ours_tflops=flops / ours / 1e9,
                       cublas_tflops=flops / cublas / 1e9, ratio=cublas / ours,
                       row_alone_bitwise=bool(torch.equal(full[m // 2:m // 2 + 1], alone)))
            rows.append(row)
            print(f"gemm M={m:5d} N={n:5d} K={k}: ours {ours:.3f} ms ({row['ours_tflops']:.0f} TFLOP/s), "
                  f"cuBLAS {cublas:.3f} ms ({row['cublas_tflops']:.0f}), ours/cuBLAS {row['ratio']:.2f}, "
                  f"row alone bitwise {row['row_alone_bitwise']}", flush=True)
    return rows


SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=5),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
]


def bench_sweep(m, n, k, warmup, iters):
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()  # Linear's W^T
    cublas = median_ms(lambda: torch.matmul(a, b), warmup, iters)
    rows = []
    for tiles in SWEEP:
        try:
            ms = median_ms(lambda: _launch(a, b, tiles), warmup, iters)
        except Exception as exc:  # out of shared memory or registers: record and go on
            rows.append(dict(tiles=tiles, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            print(f"sweep {tiles}: {type(exc).__name__}", flush=True)
            continue
        rows.append(dict(tiles=tiles, ms=ms, ratio=cublas / ms))
        print(f"sweep M={m} N={n} K={k} {tiles}: {ms:.3f} ms, ours/cuBLAS {cublas / ms:.2f}", flush=True)
    return dict(m=m, n=n, k=k, cublas_ms=cublas, configs=rows)


def bench_model(layers, hidden, heads, ffn, seq, batch, warmup, iters):
    import torch

    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                            self_attn_mask_type="causal", params_dtype=torch.bfloat16, device="cuda")
        for _ in range(layers)])
    x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        model(x).backward(dy)

    default = median_ms(step, warmup, iters)
    with te.batch_invariant():
        invariant = median_ms(step, warmup, iters)
    out = dict(layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq=seq, batch=batch, default_ms=default,
               batch_invariant_ms=invariant, overhead=invariant / default - 1.0)
    print(f"model {layers}x TransformerLayer(h={hidden}, ffn={ffn}, s={seq}, b={batch}) fwd+bwd: default "
          f"{default:.2f} ms, batch-invariant {invariant:.2f} ms, overhead {100 * out['overhead']:+.1f}%", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time other fixed tile sets at M = 4096")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/batch_invariant.py needs a CUDA GPU")
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    results["gemm"] = bench_gemm([1, 16, 128, 2048, 4096, 8192], [(4096, 4096), (14336, 4096)], args.warmup,
                                 args.iters)
    if args.sweep:
        results["sweep"] = [bench_sweep(4096, 4096, 4096, args.warmup, args.iters),
                            bench_sweep(4096, 14336, 4096, args.warmup, args.iters)]
    results["model"] = bench_model(4, 2048, 16, 8192, 2048, 2, args.warmup, args.iters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
