"""The warp-specialized Gluon kernels (kernels/hopper_ws.py) against the Triton ones, on the GPU.

For each case: the forward's output and LSE error against an fp32 reference (computed in query chunks)
for the Triton forward and each warp-specialized forward schedule, and the gradients' errors with the
Triton dK/dV and dQ passes and with warp-specialized tiles of either (against an fp32 autograd reference
on the small cases, against the Triton kernels on the large ones), with a bitwise repeat; then, on the
timed cases, the forward time and the backward time (preprocess + dK/dV + dQ) of each, in one run, with
ratios (NOTES.md entries 14-15).

    python dev/tuning/ws_kernels.py --out /tmp/ws_kernels      # also writes /tmp/ws_kernels.json
    WS_CHECK_ONLY=1 python dev/tuning/ws_kernels.py            # errors only
    WS_DIMS=256 python dev/tuning/ws_kernels.py                # d=256 (dK and dV as two passes there)
    WS_DIMS=192v128 python dev/tuning/ws_kernels.py            # d_qk 192 (128 + 64) with d_v 128: forward, dQ
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

# cases and common are the user benchmark's modules (benchmarks/attention/).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "attention"))

from cases import attn_flops  # noqa: E402
from common import bench_ms, run_metadata  # noqa: E402
from transformer_engine.common.attention import AttnMaskType, QKVFormat  # noqa: E402
from transformer_engine.common.attention.plan import backward_plan, forward_plan  # noqa: E402
from transformer_engine.pytorch.attention import kernel_runner  # noqa: E402
from transformer_engine.pytorch.attention.call import fused_call  # noqa: E402

MASKS = {"none": AttnMaskType.NO_MASK, "causal": AttnMaskType.CAUSAL_MASK,
         "causal_br": AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, "padding_causal": AttnMaskType.PADDING_CAUSAL_MASK}




def reference(q, k, v, mask, window, scale):
    """fp32 attention over [b, s, h, d] in query chunks: (out, lse [b, h, s_q]); rows that see nothing
    give out 0 and lse +inf."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kf = k.float().repeat_interleave(hq // hk, dim=2).permute(0, 2, 3, 1)
    vf = v.float().repeat_interleave(hq // hk, dim=2).permute(0, 2, 1, 3)
    diag = 0 if mask.is_top_left_causal() else sk - sq  # TransformerEngine's window alignment
    left, right = window
    if mask.is_causal():
        right = 0
    outs, lses = [], []
    for i0 in range(0, sq, 1024):
        qf = q[:, i0:i0 + 1024].float().permute(0, 2, 1, 3)
        s = qf @ kf * scale
        i = torch.arange(i0, i0 + qf.shape[2], device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        keep = torch.ones_like(s[0, 0], dtype=torch.bool)
        if right >= 0:
            keep &= j - (i + diag) <= right
        if left >= 0:
            keep &= j - (i + diag) >= -left
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append((p @ vf).permute(0, 2, 1, 3))
        lses.append(torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf"))))
    return torch.cat(outs, 1), torch.cat(lses, 2)


def reference_grads(q, k, v, d_out, mask, window, scale):
    """(dQ, dK, dV) of the fp32 reference (autograd; small shapes only)."""
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    out, _ = reference(qf, kf, vf, mask, window, scale)
    out.backward(d_out.float())
    return qf.grad, kf.grad, vf.grad


def run_case(b, h, hk, sq, sk, d, mask_name, window, dtype, variants, bwd_variants, timed, check_only, d_v=None):
    torch.manual_seed(0)
    d_v = d if d_v is None else d_v
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d_v, device="cuda", dtype=dtype)
    mask = MASKS[mask_name]
    scale = 1.0 / math.sqrt(d)
    call = fused_call(QKVFormat.BSHD, mask, window, scale)
    cfg = kernel_runner.plan_key(q, k, v, call)
    base = forward_plan(cfg)
    plans = {"triton": dataclasses.replace(base, warp_specialized=None)}
    if base.warp_specialized is not None:
        for name, fields in variants.items():
            plans[name] = dataclasses.replace(base, warp_specialized=dataclasses.replace(base.warp_specialized,
                                                                                         **fields))
    ref_o, ref_lse = reference(q, k, v, mask, window, scale)
    row = dict(shape=f"{b},{h},{hk},{sq},{sk},{d}" + (f"v{d_v}" if d_v != d else ""), mask=mask_name,
               window=list(window), dtype=str(dtype)[6:])
    for name, plan in plans.items():
        out, lse = kernel_runner.forward(q, k, v, call, plan=plan)
        torch.cuda.synchronize()
        err_o = (out.float() - ref_o).abs().max().item()
        fin = torch.isfinite(ref_lse)
        err_l = (lse - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
        same_inf = bool(torch.equal(torch.isinf(lse), ~fin))
        row[name] = dict(err_out=err_o, err_lse=err_l, inf_rows_match=same_inf)
        if timed and not check_only:
            ms = bench_ms(lambda: kernel_runner.forward(q, k, v, call, plan=plan))
            flops = attn_flops(b, h, sq, sk, d, mask_name != "none", "fwd", d_v)
            row[name].update(ms=ms, tflops=flops / ms * 1e-9)
    if timed and not check_only and "triton" in row and "ms" in row["triton"]:
        for name in plans:
            row[name]["speedup_vs_triton"] = row["triton"]["ms"] / row[name]["ms"]

    # Backward: the Triton dK/dV and dQ passes against warp-specialized tiles of either.
    out, lse = kernel_runner.forward(q, k, v, call, plan=plans["triton"])
    d_out = torch.randn_like(out)
    bbase = backward_plan(cfg)
    bplans = {"bwd_triton": dataclasses.replace(bbase, dq_warp_specialized=None, dkdv_warp_specialized=None,
                                                dv_warp_specialized=None)}
    if bbase.dq_warp_specialized is not None:
        for name, (dkdv_fields, dq_fields) in bwd_variants.items():
            if dkdv_fields is not None and bbase.dkdv_warp_specialized is None:
                continue  # no Gluon dK/dV kernel for this config (the Q/K split)
            bplans[name] = dataclasses.replace(
                bbase,
                dkdv_warp_specialized=None if dkdv_fields is None else dataclasses.replace(
                    bbase.dkdv_warp_specialized, **dkdv_fields),
                # The dV pass of a two-pass plan (d=256) goes with the dK pass: both Gluon or both Triton.
                dv_warp_specialized=None if dkdv_fields is None else bbase.dv_warp_specialized,
                dq_warp_specialized=None if dq_fields is None else dataclasses.replace(
                    bbase.dq_warp_specialized, **dq_fields))
    small = b * h * sq * sk <= 4 * 4 * 1024 * 1024
    refs = reference_grads(q, k, v, d_out, mask, window, scale) if small else None

    def bwd(plan):
        return kernel_runner.backward(q, k, v, out, d_out, lse, call, plan)[:3]

    for name, plan in bplans.items():
        grads = bwd(plan)
        torch.cuda.synchronize()
        if refs is None:
            refs = [g.float() for g in grads]  # the Triton kernels (first) stand in for the reference
        again = bwd(plan)
        row[name] = dict(err_dq=(grads[0].float() - refs[0]).abs().max().item(),
                         err_dk=(grads[1].float() - refs[1]).abs().max().item(),
                         err_dv=(grads[2].float() - refs[2]).abs().max().item(),
                         bitwise_repeat=all(torch.equal(a, b) for a, b in zip(grads, again)))
        if timed and not check_only:
            ms = bench_ms(lambda: bwd(plan))
            row[name].update(ms=ms, tflops=attn_flops(b, h, sq, sk, d, mask_name != "none", "bwd", d_v) / ms * 1e-9)
    if timed and not check_only:
        for name in bplans:
            row[name]["speedup_vs_triton"] = row["bwd_triton"]["ms"] / row[name]["ms"]
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    check_only = bool(os.environ.get("WS_CHECK_ONLY"))
    # Forward tile fields, and (dK/dV tile fields, dQ tile fields) with None keeping that pass on Triton; the
    # planned tiles first. Ping-pong, overlap and 3 stages lost in the forward (NOTES.md entry 14); the Gluon
    # kernels at d=64 (no plan entry) are in dev/results/ws_kernels.json, session 8 run 2 (entry 15).
    variants = {"ws": {}}
    bwd_variants = {"bwd_ws": ({}, {}), "dq_ws": (None, {}), "bwd_ws_dkdv_2stage": (dict(num_stages=2), {})}
    bf16 = torch.bfloat16
    checks = [  # (b, h, hk, s_q, s_kv, d, mask, window, dtype)
        (2, 4, 4, 1000, 1000, 128, "causal", (-1, 0), bf16),
        (2, 4, 4, 97, 300, 128, "none", (-1, -1), torch.float16),
        (2, 4, 2, 97, 300, 128, "none", (-1, -1), torch.float16),
        (1, 4, 4, 300, 97, 128, "causal_br", (-1, 0), bf16),
        (1, 4, 1, 300, 97, 128, "causal_br", (-1, 0), bf16),
        (1, 4, 4, 1000, 513, 128, "none", (100, 20), bf16),
        (1, 4, 4, 777, 777, 128, "none", (200, 50), bf16),
        (1, 2, 2, 64, 64, 128, "causal", (-1, 0), bf16),
    ]
    timed_cases = [
        (4, 16, 16, 4096, 4096, 128, "causal", (-1, 0), bf16),
        (4, 16, 16, 4096, 4096, 128, "none", (-1, -1), bf16),
        (1, 16, 16, 16384, 16384, 128, "causal", (-1, 0), bf16),
    ]
    if os.environ.get("WS_DIMS") == "256":
        checks = [(b, h, hk, sq, sk, 256, m, w, dt) for b, h, hk, sq, sk, _, m, w, dt in checks]
        timed_cases = [(2, 16, 16, 4096, 4096, 256, "causal", (-1, 0), bf16),
                       (2, 16, 16, 4096, 4096, 256, "none", (-1, -1), bf16)]
    d_v = None
    if os.environ.get("WS_DIMS") == "192v128":  # the Q/K split: the Gluon forward and dQ (dK/dV on Triton)
        d_v = 128
        checks = [(b, h, hk, sq, sk, 192, m, w, dt) for b, h, hk, sq, sk, _, m, w, dt in checks]
        timed_cases = [(2, 16, 16, 4096, 4096, 192, "causal", (-1, 0), bf16),
                       (2, 16, 16, 4096, 4096, 192, "none", (-1, -1), bf16)]
        variants = {"ws": {}, "ws_n64_s3": dict(block_n=64, num_stages=3), "ws_n64_s2": dict(block_n=64, num_stages=2)}
        bwd_variants = {"dq_ws": (None, {}), "dq_ws_2stage": (None, dict(num_stages=2)),
                        "dq_ws_n32": (None, dict(block_n=32, num_stages=3))}
    rows = [run_case(*c, variants, bwd_variants, False, check_only, d_v) for c in checks]
    rows += [run_case(*c, variants, bwd_variants, True, check_only, d_v) for c in timed_cases]
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(dict(meta=run_metadata(" ".join(sys.argv), torch.cuda.get_device_name()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
