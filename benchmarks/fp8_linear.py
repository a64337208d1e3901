"""FP8 Linear forward+backward against our bf16 Linear and against the same FP8 GEMMs called directly (GPU only).

For each recipe (delayed, current, block) at M = N = K = --size (8192 by default):

- ``bf16``: ``transformer_engine.pytorch.Linear`` in bf16, forward + backward (3 GEMMs);
- ``fp8``: the same module inside ``autocast(recipe=...)``: quantize + amax of input, weight and gradient,
  the 3 FP8 GEMMs, the delayed-scaling updates;
- ``gemms``: the 3 FP8 GEMMs alone, on operands quantized beforehand, through the calls our modules make
  (``transformer_engine.pytorch.quantization.scaled_gemm``: ``torch._scaled_mm`` for per-tensor scales,
  torch's block-scaled GEMM for block scales where it runs, ``block_scaled_gemm`` in the JSON, else the
  dequantized float32 GEMM).

Printed and written to --out as JSON: medians in ms, TFLOP/s (6 M N K per step), ``fp8 / bf16`` speedup and
``gemms / fp8`` (1.0 = no quantization overhead), plus whether two FP8 steps gave bitwise equal outputs and
gradients. Not a test: run it on the GPU machine.

    python benchmarks/fp8_linear.py --out fp8_linear.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402  (benchmarks/timing.py)


def _recipe(name: str):
    from transformer_engine.common import recipe

    return {"delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling(),
            "block": recipe.Float8BlockScaling()}[name]


def bench(size: int, names, warmup: int, iters: int) -> dict:
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import block_scaled_gemm_available, scaled_gemm

    m = n = k = size
    flops = 6.0 * m * n * k
    torch.manual_seed(0)
    lin = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step(recipe=None):
        x.grad = None
        lin.weight.grad = None
        if recipe is None:
            y = lin(x)
        else:
            with te.autocast(enabled=True, recipe=recipe):
                y = lin(x)
        y.backward(dy)
        return y

    results = {"size": size, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "recipes": {}}
    bf16_ms = median_ms(step, warmup, iters)
    results["bf16_ms"] = bf16_ms
    results["bf16_tflops"] = flops / bf16_ms / 1e9
    print(f"bf16 Linear fwd+bwd: {bf16_ms:.3f} ms, {flops / bf16_ms / 1e9:.0f} TFLOP/s")
    for name in names:
        ok, reason = (te.check_fp8_block_scaling_support() if name == "block" else te.check_fp8_support())
        if not ok:
            results["recipes"][name] = {"skipped": reason}
            print(f"{name}: skipped ({reason})")
            continue
        recipe = _recipe(name)
        fp8_ms = median_ms(lambda: step(recipe), warmup, iters)
        # bitwise: two more steps from the same state give the same bits (delayed scales settle after the
        # warm-up steps: the inputs do not change, so neither do the amaxes)
        y1 = step(recipe).detach().clone()
        g1 = (x.grad.clone(), lin.weight.grad.clone())
        y2 = step(recipe).detach().clone()
        g2 = (x.grad.clone(), lin.weight.grad.clone())
        bitwise = bool(torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2)))
        # the same three GEMMs on operands quantized beforehand, through the same calls
        with te.autocast(enabled=True, recipe=recipe):
            plan = lin._fp8_plan(x.device)
        with torch.no_grad():
            qx, qx_col = plan.quantize_input(x.detach())
            qw = plan.quantize_weight(lin.weight.detach())
            qdy, qdy_col = plan.quantize_grad(dy)
        qw_t = qw.t()
        a_w = qdy_col if qdy_col is not None else qdy.t()
        b_w = qx_col if qx_col is not None else qx.t()

        def gemms():
            scaled_gemm(qx, qw, torch.bfloat16, plan.mm("fprop"))
            scaled_gemm(qdy, qw_t, torch.bfloat16, plan.mm("dgrad"))
            scaled_gemm(a_w, b_w, torch.bfloat16, plan.mm("wgrad"))

        gemm_ms = median_ms(gemms, warmup, iters)
        entry = {"fp8_ms": fp8_ms, "gemms_ms": gemm_ms, "fp8_tflops": flops / fp8_ms / 1e9,
                 "gemms_tflops": flops / gemm_ms / 1e9, "speedup_vs_bf16": bf16_ms / fp8_ms,
                 "fraction_of_direct_gemms": gemm_ms / fp8_ms, "bitwise_repeat": bitwise,
                 "block_scaled_gemm": block_scaled_gemm_available(x.device) if name == "block" else None}
        results["recipes"][name] = entry
        print(f"{name}: fp8 Linear {fp8_ms:.3f} ms ({entry['fp8_tflops']:.0f} TFLOP/s), GEMMs alone {gemm_ms:.3f} ms; "
              f"x{entry['speedup_vs_bf16']:.2f} vs bf16, {entry['fraction_of_direct_gemms']:.2f} of the direct GEMMs' "
              f"speed; bitwise repeat: {bitwise}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--recipes", default="delayed,current,block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_linear.py needs a CUDA GPU")
    results = bench(args.size, [r for r in args.recipes.split(",") if r], args.warmup, args.iters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
