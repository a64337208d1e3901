"""Where the context-parallel step's extra time goes, and whether the packed-mode (thd) kernels cost more than
the padded-mode ones on the same work: device time per kernel name for

- ``single``: the deterministic fused call, bshd, fwd+bwd (what the CP step is compared with);
- ``thd``: the same problem as one packed sequence (cu_seqlens [0, s]): the packed-mode kernels;
- ``cp1`` (and ``cp2``, ... from ``--cps``): every rank's CP step in one process (run_ranks_in_one_process).

    python dev/tuning/cp_step_profile.py [--seqlen 32768 --heads 16 --kv-heads 4 --head-dim 128 --cps 1 2]

Prints one markdown table per configuration (kernel, calls and device microseconds per step, sorted by time)
and a summary line each (device time, wall time per step from do_bench).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "attention"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # te_torch_testing

from causal_breakdown import print_kernels  # noqa: E402
from kernel_time import per_kernel_us  # noqa: E402
from common import bench_ms  # noqa: E402
from te_torch_testing import run_ranks_in_one_process  # noqa: E402
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--cps", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    s, d = args.seqlen, args.head_dim
    causal = not args.no_causal
    scale = d ** -0.5
    q, k, v, d_out = (torch.randn(1, s, hh, d, device="cuda", dtype=torch.bfloat16)
                      for hh in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    packed = [t[0].clone().requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")

    def single():
        out = fused_attn_func(*leaves, "bshd", "causal" if causal else "no_mask", None, scale, deterministic=True)
        return torch.autograd.grad(out, leaves, d_out)

    def thd():
        out = fused_attn_func(*packed, "thd", "padding_causal" if causal else "padding", None, scale,
                              deterministic=True, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
        return torch.autograd.grad(out, packed, d_out[0])

    configs = [("single", single), ("thd", thd)]
    for cp in args.cps:
        configs.append((f"cp{cp}", lambda cp=cp: run_ranks_in_one_process(q, k, v, d_out, "bshd", cp, causal, scale)))
    print(f"shape (1, {args.heads} q / {args.kv_heads} kv heads, {s}, {d}) bf16, {'causal' if causal else 'no mask'}, "
          f"{args.reps} steps profiled\n")
    summary = []
    for name, fn in configs:
        total = print_kernels(name, per_kernel_us(fn, args.reps))
        summary.append(f"| {name} | {total:.3f} | {bench_ms(fn):.3f} |")
    print("| config | device ms per step | do_bench ms |")
    print("|---|---|---|")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
