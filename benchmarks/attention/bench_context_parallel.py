"""Context parallelism's per-rank steps ("p2p"/"all_gather"), every rank in one process, next to the single
deterministic call on the whole sequence.

``cp=1`` runs the CP step on one rank holding both halves (the module itself takes the plain call at cp = 1):
its time over the plain call's is the step's own overhead (the backward's two fused calls per chunk, each
keeping half of its gradients). ``cp=N`` runs all N ranks' steps one after another on one GPU: the sum of
the ranks' work, so the per-rank compute is that time / N (exchanges not included: they are tensor copies
here). Each row also checks the result bitwise against the single call.

Run on the GPU machine: ``python benchmarks/attention/bench_context_parallel.py [--seqlens 8192 32768]``;
``--dry-run`` (CPU, TRITON_INTERPRET=1) runs tiny shapes once to check the harness.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# Every rank's steps in one process: a test helper (tests/te_torch_testing.py), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from te_torch_testing import run_ranks_in_one_process  # noqa: E402
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func  # noqa: E402


def _run_and_time(fn, dry_run: bool):
    """(fn's result, its time in ms): the median of triton's do_bench on the GPU, one call's wall time
    in a dry run."""
    start = time.perf_counter()
    result = fn()
    if dry_run:
        return result, (time.perf_counter() - start) * 1e3
    from common import bench_ms

    return result, bench_ms(fn)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float16 if args.dry_run else torch.bfloat16
    if args.dry_run:
        args.seqlens, args.cps, args.heads, args.kv_heads, args.head_dim = [64], [1], 2, 1, 16
    causal = not args.no_causal
    mask = "causal" if causal else "no_mask"
    print("| s | cp | single fwd+bwd ms | CP steps (all ranks) ms | ratio | bitwise |")
    print("|---|---|---|---|---|---|")
    for s in args.seqlens:
        d = args.head_dim
        q, k, v, d_out = (torch.randn(1, s, hh, d, device=device, dtype=dtype)
                          for hh in (args.heads, args.kv_heads, args.kv_heads, args.heads))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def single():
            out = fused_attn_func(*leaves, "bshd", mask, None, d ** -0.5, deterministic=True)
            return (out,) + torch.autograd.grad(out, leaves, d_out)

        want, single_ms = _run_and_time(single, args.dry_run)
        for cp in args.cps:
            if s % (2 * cp):
                continue

            def steps():
                return run_ranks_in_one_process(q, k, v, d_out, "bshd", cp, causal, d ** -0.5)

            got, steps_ms = _run_and_time(steps, args.dry_run)
            bitwise = all(torch.equal(a, b) for a, b in zip(got, want))
            print(f"| {s} | {cp} | {single_ms:.2f} | {steps_ms:.2f} | {steps_ms / single_ms:.2f} | {bitwise} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
