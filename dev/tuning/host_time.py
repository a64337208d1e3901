"""Host time of one PyTorch attention call, layer by layer (microseconds of Python per call).

Times DotProductAttention, fused_attention, FusedAttnFunc and the launch layer on tiny tensors, forward
alone (no_grad) and forward+backward. ``--stub`` replaces the kernel launches with nothing, and on the CPU the
torch ops that are one kernel on a GPU (an ``index_copy_`` into the KV cache, ``index_select``, a zero fill) do
their work on one row (:func:`device_work_as_launches`), so on the CPU (with TRITON_INTERPRET=1) it measures our
Python and the ops' dispatch only; on a GPU without it the launches are Triton's real
ones (async: the call returns once they are queued, and the tiny shape keeps the queue short).

    TRITON_INTERPRET=1 python dev/tuning/host_time.py --stub
    python dev/tuning/host_time.py            # on a GPU
    python dev/tuning/host_time.py --profile  # and where a step's host time goes, function by function
    python dev/tuning/host_time.py --trace host_trace.json  # and a profiler trace of the threads
    python dev/tuning/host_time.py --launch   # and the forward's launch alone, four ways (a GPU only)
    python dev/tuning/host_time.py --no-signature-cache  # every call decided afresh (the path before the caches)
    TRITON_INTERPRET=1 python dev/tuning/host_time.py --stub --decode  # a KV-cache decode step, layer by layer
    python dev/tuning/host_time.py --decode --profile  # on a GPU, and where a decode step's host time goes

``--decode`` times bench_decode.py's ``ours`` step (``pre_step`` then DotProductAttention with
``inference_params``, no_grad; 32 query heads, 8 kv heads, thd, padding_causal) on non-paged and paged caches
for batch 1 and 16 at contexts 1k and 32k (each step grows the context by one token, as decoding does), next to
the training forward of the same queries and keys (a thd call with every argument given, as a step's own call
is), then the layers inside the step (inclusive microseconds per step: time in a function and what it calls;
the timers add about a microsecond per call), and the host reads of tensor values per step (``.item()``,
``.tolist()``, ``bool()``, ...: a device-to-host copy, so a sync, on a GPU). On a GPU without ``--stub`` a
step's time is the larger of its host time and its kernels' (the steps are queued back to back).
"""
# throwaway: times and stubs the product's private layers (kernel_runner._run, launch_cache internals);
# not kept working against refactors.

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import sys
import time
from pathlib import Path

import torch

from transformer_engine.common import settings
from transformer_engine.common.attention import launch_description
from transformer_engine.pytorch import DotProductAttention, InferenceParams
from transformer_engine.pytorch.attention import (backends, fused_attn, inference, kernel_runner, launch_cache, ops,
                                                  signature_cache)
from transformer_engine.pytorch.attention.call import fused_call

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import te_torch_testing as testing  # noqa: E402  (no_launches)


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


@contextlib.contextmanager
def device_work_as_launches():
    """While open, the CPU tensor ops that on a GPU are one kernel each (the cache append's ``index_copy_``, a
    page table's ``index_select``, a zero-filled output's fill) do their work on one row only: the op's dispatch
    (argument parsing, the dispatcher, the output's allocation) stays, as a launch's host cost would, and the work
    on every row, which on a GPU is device time, goes. Without this, ``--stub`` on the CPU counts a 256-row
    ``index_copy_`` into a 1 GB cache (page faults included) as host time. Values are garbage, as with the
    launches stubbed."""
    real_index_copy_, real_index_select, real_zeros = torch.Tensor.index_copy_, torch.index_select, torch.zeros

    # The same stand-in work at every size (one row, even where there is one), so that what it costs does not
    # grow with the batch: the decode measurements compare batch sizes.
    def index_copy_(self, dim, index, source):
        return real_index_copy_(self, dim, index[:1], source.narrow(dim, 0, min(1, source.shape[dim])))

    def index_select(input, dim, index, *, out=None):
        if out is None:
            shape = list(input.shape)
            shape[dim] = index.shape[0]
            out = input.new_empty(shape)
        real_index_select(input, dim, index[:1], out=out.narrow(dim, 0, min(1, index.shape[0])))
        return out

    def zeros(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        if t.numel():
            t.view(-1)[:1].zero_()
        return t

    torch.Tensor.index_copy_, torch.Tensor.index_select, torch.index_select = index_copy_, index_select, index_select
    torch.zeros = zeros
    try:
        yield
    finally:
        torch.index_select, torch.zeros = real_index_select, real_zeros
        del torch.Tensor.index_copy_, torch.Tensor.index_select  # back to TensorBase's methods


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
    ap.add_argument("--decode", action="store_true",
                    help="a KV-cache decode step instead (bench_decode.py's `ours`), layer by layer")
    ap.add_argument("--page-size", type=int, default=16, help="--decode: the paged cache's page size")
    ap.add_argument("--batches", default="1,16", help="--decode: batch sizes, comma-separated")
    ap.add_argument("--contexts", default="1024,32768", help="--decode: cached tokens per sequence, comma-separated")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    for cache in signature_cache.caches():
        cache.enabled = not args.no_signature_cache
    stub = contextlib.ExitStack()
    if args.stub:
        stub.enter_context(testing.no_launches())
        if not torch.cuda.is_available():
            stub.enter_context(device_work_as_launches())
    with stub:
        if args.decode:
            _measure_decode(args)
        else:
            _measure(args)


def _measure(args) -> None:
    if args.op_dispatch:
        ops._eager = lambda *tensors: False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    b, h, s, d = 1, 2, 128, args.head_dim
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.0)
    call = fused_call("bshd", "causal", (-1, 0), d ** -0.5)

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


# -- decode steps ------------------------------------------------------------------------------------------------

HEADS, KV_HEADS = 32, 8  # bench_decode.py's


class _LayerTimes:
    """While open, the inclusive time and calls of each named layer (a function or method, replaced by a timing
    wrapper), summed over the calls made meanwhile."""

    def __init__(self, layers):
        self.layers = layers  # (label, owner, attribute name, predicate on the call's kwargs or None)
        self.time = collections.Counter()
        self.calls = collections.Counter()

    def __enter__(self):
        self._saved = []
        for label, owner, name, when in self.layers:
            real = owner.__dict__[name]
            self._saved.append((owner, name, real))
            setattr(owner, name, self._wrap(label, real, when))
        return self

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)

    def _wrap(self, label, real, when):
        fn = real.__func__ if isinstance(real, staticmethod) else real
        time_, calls = self.time, self.calls

        def timed(*args, **kwargs):
            if when is not None and not when(kwargs):
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                time_[label] += time.perf_counter() - t0
                calls[label] += 1

        return staticmethod(timed) if isinstance(real, staticmethod) else timed


def _decode_layers():
    """The layers of a decode step, outermost first (labels indented by nesting)."""
    step_call = lambda kwargs: kwargs.get("inference_params") is None  # noqa: E731  (the step's own thd call)
    return [
        ("pre_step", InferenceParams, "pre_step", None),
        ("cache append", InferenceParams, "_append", None),
        ("cache append (decode)", InferenceParams, "_append_decode", None),
        ("step call (decode)", InferenceParams, "_decode_call", None),
        ("step call (non-paged)", InferenceParams, "_kernel_call", None),
        ("step call (paged)", InferenceParams, "_paged_call", None),
        ("DotProductAttention.forward (the step's thd call)", DotProductAttention, "forward", step_call),
        ("  selection (config, backends)", DotProductAttention, "_select", None),
        ("  fused_attention", backends.FusedAttentionBackend, "run", None),
        ("    value checks (cu_seqlens)", fused_attn, "check_sequence_values", None),
        ("    value checks (page table)", fused_attn, "_check_page_values", None),
        ("    kernel_runner.forward", kernel_runner, "forward", None),
        ("      sequences", kernel_runner, "sequences", None),
        ("      describe", kernel_runner, "describe", None),
        ("      launch building (plan included)", launch_description, "forward_launches", None),
        ("        planning", launch_description, "forward_plan", None),
        ("      prepare", kernel_runner, "_prepare", None),
    ]


def _decode_setup(b, s, paged, page_size, steps, device, dtype, head_dim):
    """bench_decode.py's decode step on a cache holding ``s`` tokens per sequence (registered by a pre_step
    whose tokens are never written: the host work does not read them), room for ``steps`` more; paged: pages
    handed out in a shuffled order. Returns (step, training forward of the same sizes, params, step_dict)."""
    max_len = s + steps + 8
    if paged:
        max_len = -(-max_len // page_size) * page_size
        params = InferenceParams(b, max_len, KV_HEADS, head_dim, dtype, device=device, is_paged=True,
                                 page_size=page_size)
        random.Random(5).shuffle(params.cache_manager.free_pages)
    else:
        params = InferenceParams(b, max_len, KV_HEADS, head_dim, dtype, device=device)
    params.allocate_memory(1)
    dpa = DotProductAttention(HEADS, head_dim, num_gqa_groups=KV_HEADS, qkv_format="thd",
                              attn_mask_type="padding_causal", layer_number=1).to(device).eval()
    params.pre_step(collections.OrderedDict((i, s) for i in range(b)))
    q = torch.randn(b, HEADS, head_dim, device=device, dtype=dtype)
    k, v = torch.randn(2, b, KV_HEADS, head_dim, device=device, dtype=dtype)
    step_dict = collections.OrderedDict((i, 1) for i in range(b))

    def step():
        params.pre_step(step_dict)
        with torch.no_grad():
            return dpa(q, k, v, inference_params=params)

    # The training forward's thd call of the same sizes (every argument given: a signature-cache hit).
    keys = torch.randn(b * (s + 1), KV_HEADS, head_dim, device=device, dtype=dtype)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device)
    cu_kv = cu_q * (s + 1)

    def training():
        with torch.no_grad():
            return dpa(q, keys, keys, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=1, max_seqlen_kv=s + 1)

    return step, training, params, step_dict


def _measure_decode(args) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # CPU tensor ops stand in for launches: one thread, so none waits for OpenMP's workers
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    calls, rounds = max(1, args.calls // 4), 5
    per_timing = 1 + rounds * calls
    profile_steps = calls * 4 if args.profile else 0
    print(f"device {device}, stub={args.stub}, decode steps: {HEADS} q heads, {KV_HEADS} kv heads, d={args.head_dim}, "
          f"{str(dtype).replace('torch.', '')}, thd padding_causal; page size {args.page_size}; microseconds per step "
          f"(the least-disturbed of {rounds} rounds of {calls})")
    with settings.environment(NVTE_ALLOW_NONDETERMINISTIC_ALGO="0", NVTE_FUSED_ATTN_BACKEND="fused"):
        cases = [(paged, b, s) for paged in (False, True) for b in map(int, args.batches.split(","))
                 for s in map(int, args.contexts.split(","))]
        for paged, b, s in cases:
            room = (4 + rounds) * per_timing + profile_steps + 2  # every timed step adds a token
            step, training, params, step_dict = _decode_setup(b, s, paged, args.page_size, room, device, dtype,
                                                              args.head_dim)
            step()  # the first step: decisions made, kernels compiled
            t_train = per_call_us(training, calls, rounds)
            t_pre = per_call_us(lambda: params.pre_step(step_dict), calls, rounds)
            t_step = per_call_us(step, calls, rounds)
            layer_us, layer_calls = {}, {}
            for _ in range(rounds):  # each layer's least-disturbed round
                with _LayerTimes(_decode_layers()) as layers:
                    for _ in range(calls):
                        step()
                for label, n in layers.calls.items():
                    layer_us[label] = min(layer_us.get(label, float("inf")), layers.time[label] / calls * 1e6)
                    layer_calls[label] = n / calls
            name = f"{'paged' if paged else 'non-paged'} b={b} s={s}"
            print(f"{name}: step {t_step:8.1f}  (training forward {t_train:6.1f}, ratio {t_step / t_train:4.1f}; "
                  f"pre_step alone {t_pre:6.1f})")
            for label, *_ in _decode_layers():
                if label in layer_us:
                    print(f"    {label:52s} {layer_us[label]:8.1f}  ({layer_calls[label]:g} calls)")
            with testing.counted_host_reads() as reads:  # apart: every tensor op is slower while counting
                for _ in range(calls):
                    step()
            print(f"    host reads of tensor values per step: "
                  f"{', '.join(f'{k} {n / calls:g}' for k, n in sorted(reads.items())) or 'none'}")
            if args.profile:
                import cProfile
                import pstats

                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(profile_steps):
                    step()
                profiler.disable()
                print(f"cProfile of {profile_steps} decode steps ({name}), own time first:")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
                pstats.Stats(profiler).sort_stats("cumtime").print_stats(30)
            del step, training, params
        print("  signature caches: " + ", ".join(f"{c.name} {c.hits} hits, {c.misses} misses"
                                              for c in signature_cache.caches()))


if __name__ == "__main__":
    main()
