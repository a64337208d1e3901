"""Host time of one PyTorch attention call, layer by layer (microseconds of Python per call).

Times DotProductAttention, fused_attention, FusedAttnFunc and the launch layer on tiny tensors, forward
alone (no_grad) and forward+backward. ``--stub`` replaces the kernel launches with nothing, so on the CPU
(with TRITON_INTERPRET=1) it measures our Python only; on a GPU without it the launches are Triton's real
ones (async: the call returns once they are queued, and the tiny shape keeps the queue short).

    TRITON_INTERPRET=1 python dev/tuning/host_time.py --stub
    python dev/tuning/host_time.py            # on a GPU
    python dev/tuning/host_time.py --profile  # and where a step's host time goes, function by function
    python dev/tuning/host_time.py --trace host_trace.json  # and a profiler trace of the threads
    python dev/tuning/host_time.py --launch   # and the forward's launch alone, four ways (a GPU only)
    python dev/tuning/host_time.py --no-signature-cache  # every call decided afresh (the path before the caches)
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from transformer_engine.common import settings
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import fused_attn, kernel_runner, launch_cache, ops, signature_cache, testing


def per_call_us(fn, calls: int, rounds: int = 9) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return min(samples)  # the least-disturbed round: other processes only add time


class _Identity(torch.autograd.Function):
    """A Python autograd node that launches nothing: what autograd's own handling of one costs."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def autograd_overhead(q, calls: int) -> None:
    """Host microseconds of fwd+bwd through a do-nothing Python autograd node against a torch op, on q's
    device (on CUDA autograd runs backward nodes on its device thread: the handoff and the GIL)."""
    x = q.detach().requires_grad_()
    g = torch.ones_like(x)
    print(f"autograd alone ({x.device.type}), microseconds per fwd+bwd:")
    print(f"  Python node (does nothing)  {per_call_us(lambda: _Identity.apply(x).backward(g), calls):8.1f}")
    print(f"  torch op (x * 1)            {per_call_us(lambda: (x * 1).backward(g), calls):8.1f}")


def launch_overhead(q, k, v, call, calls: int) -> None:
    """Host microseconds of the forward's kernel launches: prepared once per call signature (the kernel
    runner's path), through launch_cache.launch (a key built over every argument per launch), as Triton JIT
    calls with the arguments bound once, and through each compiled kernel's launcher directly (the floor:
    only the tensors' addresses and the grid change between calls)."""
    captured = {}
    real_run = kernel_runner._run

    def capture(prepared, buffers):
        captured.update(prepared=prepared, buffers=buffers)
        real_run(prepared, buffers)

    kernel_runner._run = capture
    try:
        kernel_runner.forward(q.detach(), k.detach(), v.detach(), call)
    finally:
        kernel_runner._run = real_run
    prepared, buffers = captured["prepared"], captured["buffers"]
    print(f"launch alone ({', '.join(p.kernel.__name__ for p in prepared)}), microseconds per call:")
    print(f"  kernel_runner._run (prepared) {per_call_us(lambda: kernel_runner._run(prepared, buffers), calls):8.1f}")
    bound = [(p.kernel, p.grid, dict(zip(p.names, p.args(buffers))), p.options) for p in prepared]

    def cached_calls():
        for kernel, grid, kwargs, options in bound:
            launch_cache.launch(kernel, grid, kwargs, options)

    print(f"  launch_cache.launch           {per_call_us(cached_calls, calls):8.1f}")

    def jit_calls():
        for kernel, grid, kwargs, options in bound:
            kernel[grid](**kwargs, **options)

    print(f"  Triton JIT call               {per_call_us(jit_calls, calls):8.1f}")
    parts = {
        "its arguments' binding": lambda: [p.args(buffers) for p in prepared],
        "its device and stream": launch_cache._device_and_stream,
        "its hooks check": launch_cache._hooks,
    }
    for name, fn in parts.items():
        print(f"    {name:26s} {per_call_us(fn, calls):8.1f}")
    print(f"    (launch hooks active: {launch_cache._hooks()[0] is not None})")
    direct = [(p.compiled, p.grid, p.args(buffers)) for p in prepared
              if p.compiled is not None and p.compiled is not launch_cache._VIA_LAUNCH]
    if len(direct) == len(prepared):
        stream = torch.cuda.current_stream().cuda_stream

        def direct_calls():
            for compiled, grid, values in direct:
                compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None,
                             None, None, *values)

        print(f"  compiled kernel directly      {per_call_us(direct_calls, calls):8.1f}")
    else:
        print("  compiled kernel directly: not prepared with compiled kernels (JIT-only launches)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stub", action="store_true", help="launch no kernels (our Python only)")
    ap.add_argument("--op-dispatch", action="store_true",
                    help="eager calls through the custom ops too (their dispatch's cost)")
    ap.add_argument("--profile", action="store_true",
                    help="then cProfile forward+backward steps of DotProductAttention: the functions by own time")
    ap.add_argument("--trace", default=None,
                    help="then a torch.profiler trace of 5 such steps (Chrome JSON, every thread) and its op table")
    ap.add_argument("--launch", action="store_true",
                    help="then the forward kernel's launch alone: ours, Triton's JIT call, its compiled kernel directly")
    ap.add_argument("--no-signature-cache", action="store_true",
                    help="keep no decisions per call signature (DotProductAttention's, the kernel runner's)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    for cache in signature_cache.caches():
        cache.enabled = not args.no_signature_cache
    stub = testing.no_launches() if args.stub else contextlib.nullcontext()
    with stub:
        _measure(args)


def _measure(args) -> None:
    if args.op_dispatch:
        ops._eager = lambda *tensors: False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    b, h, s, d = 1, 2, 128, args.head_dim
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.0)
    call = testing.fused_call("bshd", "causal", (-1, 0), d ** -0.5)

    def fused(q_, k_, v_):
        return fused_attn.fused_attention(q_, k_, v_, call)

    layers = {
        "DotProductAttention": lambda: module(q, k, v),
        "fused_attention": lambda: fused(q, k, v),
        "kernel_runner.forward": lambda: kernel_runner.forward(q, k, v, call),
        "torch SDPA (reference)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
    }
    out = fused(q, k, v)
    d_out = torch.ones_like(out)
    o_flat = module(q, k, v)
    d_flat = torch.ones_like(o_flat)
    with settings.environment(NVTE_ALLOW_NONDETERMINISTIC_ALGO="0", NVTE_FUSED_ATTN_BACKEND="fused"):
        print(f"device {device}, stub={args.stub}, op_dispatch={args.op_dispatch}, signature caches "
              f"{'off' if args.no_signature_cache else 'on'}, (b, s, h, d) = {(b, s, h, d)}; microseconds per call")
        with torch.no_grad():
            for name, fn in layers.items():
                print(f"  forward  {name:22s} {per_call_us(fn, args.calls):8.1f}")
        _, lse = kernel_runner.forward(q.detach(), k.detach(), v.detach(), call)
        steps = {
            "DotProductAttention": lambda: module(q, k, v).backward(d_flat),
            "fused_attention": lambda: fused(q, k, v).backward(d_out),
            "kernel_runner.backward": lambda: kernel_runner.backward(q.detach(), k.detach(), v.detach(), out.detach(),
                                                                     d_out, lse, call),
        }
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).backward(d_out.transpose(1, 2))
        steps["torch SDPA (reference)"] = sdpa
        for name, fn in steps.items():
            for t in (q, k, v):
                t.grad = None
            print(f"  fwd+bwd  {name:22s} {per_call_us(fn, args.calls // 2):8.1f}"
                  + ("  (backward launches only)" if name.startswith("kernel_runner") else ""))
        print("  signature caches: " + ", ".join(f"{c.name} {c.hits} hits, {c.misses} misses"
                                              for c in signature_cache.caches()))
        if args.launch and device == "cuda":
            launch_overhead(q, k, v, call, args.calls)
        if args.launch:
            autograd_overhead(q, args.calls)
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                steps["DotProductAttention"]()
            profiler.disable()
            print(f"cProfile of {args.calls} DotProductAttention fwd+bwd steps (own time first):")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(45)
            pstats.Stats(profiler).sort_stats("cumtime").print_stats(30)
        if args.trace:
            # Which thread spends the step where: autograd runs a CUDA backward on its device thread.
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=activities, with_stack=False) as prof:
                for _ in range(5):
                    steps["DotProductAttention"]()
            prof.export_chrome_trace(args.trace)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
