"""GroupedLinear forward + backward against torch's grouped GEMM called directly and a loop of our Linear (GPU only).

For 8 and 64 experts at a Mixtral-like shape (hidden 4096 -> ffn 14336, the first expert GEMM) and a DeepSeek-like
one (hidden 7168 -> ffn 2048), bf16, 16384 routed rows split unevenly over the experts (seeded, some experts
possibly empty), one step is: forward, then backward with input and weight gradients. Three implementations:

- ``ours``: ``transformer_engine.pytorch.GroupedLinear`` (its grouped-GEMM path: ``torch._grouped_mm``);
- ``torch``: ``torch._grouped_mm`` called directly on a stacked [E, N, K] weight (fprop, dgrad, wgrad: three calls);
- ``loop``: one ``transformer_engine.pytorch.Linear`` per expert on its rows, outputs concatenated.

Reported per case: step medians in ms, TFLOP/s, ``vs_torch`` = torch time / ours (the target is >= 0.9),
``vs_loop`` = loop time / ours (the target is >= 2), whether ours took the grouped-GEMM path, and whether two of
our steps gave the same bits (output, input and weight gradients). Printed and written to --out as JSON.

    python benchmarks/grouped_linear.py --out grouped_linear.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = {"mixtral": (4096, 14336), "deepseek": (7168, 2048)}
EXPERTS = (8, 64)
ROWS = 16384


sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402  (benchmarks/timing.py)


def _splits(experts: int, rows: int, seed: int):
    """Uneven token counts summing to ``rows``: a multinomial draw over skewed expert weights."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=g) ** 2 + 0.05
    counts = torch.multinomial(weights, rows, replacement=True, generator=g).bincount(minlength=experts)
    return [int(c) for c in counts]


def bench_case(name: str, experts: int, warmup: int, iters: int, dev: str = "cuda") -> dict:
    import torch

    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import grouped_gemm

    k, n = SHAPES[name]
    dt = torch.bfloat16
    splits = _splits(experts, ROWS, seed=experts)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(ROWS, k, device=dev, dtype=dt, generator=g).requires_grad_()
    dy = torch.randn(ROWS, n, device=dev, dtype=dt, generator=g)
    flops = 3 * 2 * ROWS * n * k
    out = {"shape": name, "experts": experts, "rows": ROWS, "in_features": k, "out_features": n,
           "min_split": min(splits), "max_split": max(splits)}

    torch.manual_seed(0)
    ours = te.GroupedLinear(experts, k, n, bias=False, params_dtype=dt, device=dev)
    out["ours_grouped_path"] = grouped_gemm.grouped_mm_supported(x.detach(), [ours.weight0])

    def step_ours():
        x.grad = None
        for p in ours.parameters():
            p.grad = None
        ours(x, splits).backward(dy)

    def snapshot():
        return [ours(x, splits).detach(), x.grad.clone()] + [p.grad.clone() for p in ours.parameters()]

    step_ours()
    first = snapshot()
    step_ours()
    second = snapshot()
    out["ours_bitwise_run_to_run"] = all(torch.equal(a, b) for a, b in zip(first, second))
    del first, second
    t_ours = median_ms(step_ours, warmup, iters)

    w = torch.stack([p.detach() for p in ours.parameters()]).requires_grad_(False)
    offs = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
    xd = x.detach()

    def step_torch():
        torch._grouped_mm(xd, w.transpose(1, 2), offs=offs)
        torch._grouped_mm(dy, w, offs=offs)
        torch._grouped_mm(dy.t(), xd, offs=offs)

    t_torch = median_ms(step_torch, warmup, iters)
    del w

    linears = [te.Linear(k, n, bias=False, params_dtype=dt, device=dev) for _ in range(experts)]

    def step_loop():
        x.grad = None
        for lin in linears:
            lin.weight.grad = None
        torch.cat([lin(xi) for lin, xi in zip(linears, x.split(splits))]).backward(dy)

    t_loop = median_ms(step_loop, warmup, max(3, iters // 2))
    del linears, ours
    torch.cuda.empty_cache()
    for label, t in (("ours", t_ours), ("torch", t_torch), ("loop", t_loop)):
        out[f"{label}_ms"] = round(t, 4)
        out[f"{label}_tflops"] = round(flops / t / 1e9, 1)
    out["vs_torch"] = round(t_torch / t_ours, 3)
    out["vs_loop"] = round(t_loop / t_ours, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/grouped_linear.py needs a CUDA GPU")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "has_grouped_mm": hasattr(torch, "_grouped_mm"), "cases": []}
    for name in SHAPES:
        for experts in EXPERTS:
            case = bench_case(name, experts, args.warmup, args.iters)
            print(json.dumps(case))
            results["cases"].append(case)
    results["targets"] = {"vs_torch_min": min(c["vs_torch"] for c in results["cases"]),
                          "vs_loop_min": min(c["vs_loop"] for c in results["cases"]),
                          "all_bitwise": all(c["ours_bitwise_run_to_run"] for c in results["cases"])}
    print(json.dumps(results["targets"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
