"""Variants of the d=256 dQ launch at short query lengths: which fault, which are right.

    python dev/device/fault_probe2.py VARIANT SQ   (prints OK with the max error, or FAULT)
"""
import dataclasses
import sys

import torch
import triton

from transformer_engine.common.attention.kernels import backward as bwd_mod
from transformer_engine.common.attention.plan import Tiles, backward_plan
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call


def main(variant, sq):
    b, skv, h, d = 8, 2048, 16, 256
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, skv, h, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, skv, h, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    call = fused_call("bshd", "no_mask", (-1, -1), d ** -0.5)
    out, lse = kernel_runner.forward(q, k, v, call)
    torch.cuda.synchronize()
    plan = backward_plan(kernel_runner.plan_key(q, k, v, call))
    if variant == "stages1":
        plan = dataclasses.replace(plan, dq=dataclasses.replace(plan.dq, num_stages=1))
    elif variant == "n32":
        plan = dataclasses.replace(plan, dq=dataclasses.replace(plan.dq, block_n=32))
    elif variant == "warps4":
        plan = dataclasses.replace(plan, dq=dataclasses.replace(plan.dq, num_warps=4))
    elif variant == "nospec":
        # The launch description takes the kernel from its module at each call.
        bwd_mod.attn_bwd_dq_kernel = triton.jit(bwd_mod.attn_bwd_dq_kernel.fn, do_not_specialize=["seqlen_q"])
    elif variant == "single":
        plan = dataclasses.replace(plan, dq=dataclasses.replace(plan.dq, single_loop=True))
    print("dq tiles", plan.dq, flush=True)
    try:
        dq, dk, dv, _, _ = kernel_runner.backward(q, k, v, out, do, lse, call, plan)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(variant, sq, "FAULT", str(e).splitlines()[0][:120], flush=True)
        sys.exit(1)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2))
    ref.backward(do.float().transpose(1, 2))
    err = (dq.float() - qr.grad).abs().max().item() / qr.grad.abs().max().item()
    print(variant, sq, "OK rel err dq", f"{err:.2e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
