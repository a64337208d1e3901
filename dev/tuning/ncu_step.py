"""One deterministic fwd+bwd of a d=128 shape (no mask or --causal), twice, for Nsight Compute to profile the second step's
forward, dK/dV and dQ kernels (the first step compiles). Run under ncu on the GPU machine:

    ncu --clock-control none --kernel-name regex:"attn_(fwd|bwd_dkdv|bwd_dq)(_ws)?_kernel" --launch-skip 3 \
        --launch-count 3 --section SpeedOfLight --section WarpStateStats python dev/tuning/ncu_step.py [--causal]
"""

from __future__ import annotations

import argparse

import torch

from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,16,4096,128", help="b,h,s,d")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    call = fused_call(QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK if args.causal else AttnMaskType.NO_MASK,
                      None, d ** -0.5)
    for _ in range(2):
        o, lse = kernel_runner.forward(q, k, v, call)
        kernel_runner.backward(q, k, v, o, do, lse, call)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
