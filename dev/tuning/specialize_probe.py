"""Forward speed of the Triton kernels with sequence lengths specialized or not (the kernels' default,
do_not_specialize=SEQLEN_ARGS). ``python dev/tuning/specialize_probe.py spec|nospec [d] [mask]``."""
import sys

import torch

from transformer_engine.common.attention.kernels import backward, forward
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

mode, d = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
mask = sys.argv[3] if len(sys.argv) > 3 else "no_mask"
if mode == "spec":
    for mod in (forward, backward):
        for fn in vars(mod).values():
            for p in getattr(fn, "params", ()):
                p.do_not_specialize = False
b, s, h = (8, 2048, 32) if d == 64 else (2, 4096, 16)
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
flops = 4 * b * h * s * s * d * (0.5 if "causal" in mask else 1.0)


def step(bwd):
    out = fused_attn_func(q, k, v, "bshd", mask, None, d ** -0.5, deterministic=True)
    if bwd:
        out.backward(torch.ones_like(out))


for bwd in (False, True):
    for _ in range(3):
        step(bwd)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20):
        step(bwd)
    t1.record()
    torch.cuda.synchronize()
    ms = t0.elapsed_time(t1) / 20
    print(f"{mode} d={d} {mask} {'fwd+bwd' if bwd else 'fwd'}: {ms:.3f} ms, {flops * (3.5 if bwd else 1) / ms / 1e9:.1f} TFLOP/s")
