"""The forward with part of its exponentials on the FMA units (kernels/exp2.py, Tiles.exp2_poly), on the GPU.

For each case and each EXP2_POLY (one element in n by the polynomial; 0 = all on MUFU, the plan today) applied
to the planned forward kernel (Triton at d=64, Gluon at d=128, 256 and 192/128): the output and LSE errors
against an fp32 reference (max and mean), rows that see no key (+inf LSE, zero output) and NaN rows as the
plain kernel gives them, a bitwise repeat, and the gradients' errors of the planned backward run from that
forward's output and LSE; on the timed cases the forward's TFLOP/s in one run.

    EXP2_DIMS=64,128 python dev/tuning/exp2_split.py --out /tmp/exp2_split
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "attention"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import attn_flops  # noqa: E402
from common import bench_ms, run_metadata  # noqa: E402
from ws_kernels import MASKS, reference, reference_grads  # noqa: E402
from transformer_engine.common.attention import QKVFormat  # noqa: E402
from transformer_engine.common.attention.plan import forward_plan  # noqa: E402
from transformer_engine.pytorch.attention import launch  # noqa: E402


def with_poly(plan, n):
    """The planned forward with EXP2_POLY = n in whichever kernel it launches."""
    if plan.warp_specialized is not None:
        return dataclasses.replace(plan, warp_specialized=dataclasses.replace(plan.warp_specialized, exp2_poly=n))
    return dataclasses.replace(plan, tiles=dataclasses.replace(plan.tiles, exp2_poly=n))


def run_case(b, h, hk, sq, sk, d, d_v, mask_name, window, dtype, polys, timed):
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d_v, device="cuda", dtype=dtype)
    mask = MASKS[mask_name]
    scale = 1.0 / math.sqrt(d)
    seqs = launch.sequences(QKVFormat.BSHD, q, k, None, None, None, None, sq, sk)
    base = forward_plan(launch.plan_config(q, k, v, QKVFormat.BSHD, mask, window))
    kernel = "gluon" if base.warp_specialized is not None else "triton"
    row = dict(shape=f"{b},{h},{hk},{sq},{sk},{d}" + (f"v{d_v}" if d_v != d else ""), mask=mask_name,
               window=list(window), dtype=str(dtype)[6:], kernel=kernel)
    small = b * h * sq * sk <= 4 * 4 * 1024 * 1024
    ref_o, ref_lse = (None, None) if timed else reference(q, k, v, mask, window, scale)
    d_out = torch.randn(b, sq, h, d_v, device="cuda", dtype=dtype)
    ref_g = reference_grads(q, k, v, d_out, mask, window, scale) if small and not timed else None
    q_nan = q.clone()
    q_nan[0, sq // 2, 0, 0] = float("nan")  # one query row's scores are NaN
    plain = nan_plain = None
    for n in polys:
        plan = with_poly(base, n)

        def fwd(qq=q):
            return launch.forward(qq, k, v, QKVFormat.BSHD, seqs, scale, mask, window, plan=plan)

        out, lse = fwd()
        again = fwd()
        r = dict(bitwise_repeat=bool(torch.equal(out, again[0]) and torch.equal(lse, again[1])))
        if plain is None:
            plain = (out, lse)
        else:
            r["out_vs_plain_max"] = (out.float() - plain[0].float()).abs().max().item()
        if not timed:
            fin = torch.isfinite(ref_lse)
            r.update(err_out=(out.float() - ref_o).abs().max().item(),
                     mean_err_out=(out.float() - ref_o).abs().mean().item(),
                     err_lse=(lse - ref_lse)[fin].abs().max().item() if fin.any() else 0.0,
                     inf_rows_match=bool(torch.equal(torch.isinf(lse), ~fin)),
                     empty_rows_zero=bool((out.float().permute(0, 2, 1, 3)[~fin] == 0).all()) if (~fin).any()
                     else True)
            o_nan, l_nan = fwd(q_nan)
            pattern = (torch.isnan(o_nan), torch.isnan(l_nan))
            nan_plain = pattern if nan_plain is None else nan_plain
            r.update(nan_same_as_plain=all(torch.equal(x, y) for x, y in zip(pattern, nan_plain)),
                     nan_rows=int(pattern[1].sum().item()))
            if ref_g is not None:
                grads = launch.backward(q, k, v, out, d_out, lse, QKVFormat.BSHD, seqs, scale, mask, window)[:3]
                r.update({f"err_{name}": (g.float() - rg).abs().max().item()
                          for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_g)})
        else:
            ms = bench_ms(fwd)
            r.update(ms=ms, tflops=attn_flops(b, h, sq, sk, d, mask_name != "none", "fwd", d_v) / ms * 1e-9)
        row[f"poly{n}"] = r
    if timed:
        for n in polys:
            row[f"poly{n}"]["speedup"] = row[f"poly{polys[0]}"]["ms"] / row[f"poly{n}"]["ms"]
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    bf16, fp16 = torch.bfloat16, torch.float16
    dims = [x for x in os.environ.get("EXP2_DIMS", "64,128,256,192v128").split(",") if x]
    rows = []
    for dim in dims:
        d, d_v = (int(x) for x in dim.split("v")) if "v" in dim else (int(dim), int(dim))
        checks = [(2, 4, 4, 1000, 1000, "causal", (-1, 0), bf16, (0, 2)),
                  (1, 4, 4, 300, 97, "causal_br", (-1, 0), bf16, (0, 2)),  # rows that see no key
                  (1, 4, 4, 777, 777, "none", (200, 50), bf16, (0, 2)),
                  (2, 4, 2, 97, 300, "none", (-1, -1), fp16, (0, 2, 4))]
        for b, h, hk, sq, sk, m, w, dt, polys in checks:
            rows.append(run_case(b, h, hk, sq, sk, d, d_v, m, w, dt, polys, False))
        b, h, s = {64: (8, 32, 2048), 128: (4, 16, 4096)}.get(d, (2, 16, 4096))
        for m, w in (("causal", (-1, 0)), ("none", (-1, -1))):
            rows.append(run_case(b, h, h, s, s, d, d_v, m, w, bf16, (0, 2, 4, 8), True))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(dict(meta=run_metadata("dev/tuning/exp2_split.py", torch.cuda.get_device_name()), rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
