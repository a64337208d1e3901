"""Context parallelism of JAX ``fused_attn`` across devices: fwd+bwd under ``jit`` with the sequence sharded
over a ``cp`` mesh axis of every device, against one device holding the whole sequence (the same total tokens),
deterministic, with the CP results checked bitwise against the one-device call.

    python benchmarks/attention/bench_cp_scaling_jax.py [--seqlens 32768 131072] [--strategies all_gather ring]
        [--out FILE] [--trace DIR]

Per row: the one-device step, the CP step, speedup = one device / CP, per-device efficiency = speedup / N, and
whether the outputs and gradients (back in token order) equal the one-device call's bitwise. Causal rows use
DualChunkSwap load balancing. ``--trace DIR`` writes a JAX profiler trace of one CP step per strategy (the
collectives beside the attention kernels). ``--dry-run`` (CPU: 8 host devices, the fused primitives' jnp
lowering) runs tiny shapes once each to check the harness.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
if "--dry-run" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmark's own modules

from cases import attn_flops  # noqa: E402
from common import cp_scaling_parser, run_metadata  # noqa: E402
from transformer_engine.jax.attention import (  # noqa: E402
    AttnBiasType,
    AttnMaskType,
    CPStrategy,
    QKVLayout,
    ReorderStrategy,
    fused_attn,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)

# The dry run forces the fused primitives (their jnp lowering on CPU) through a test helper, not the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "jax"))
from te_jax_testing import fused_attn_with_backend  # noqa: E402

STRATEGIES = {"all_gather": CPStrategy.ALL_GATHER, "ring": CPStrategy.RING}
LB = ReorderStrategy.DualChunkSwap


def step_fn(mask, strategy, load_balanced, axis, scale, dry_run=False):
    """jit of ``(q, k, v, dout) -> (out, dq, dk, dv)`` through fused_attn (bshd). The dry run names the fused
    backend (on CPU the public call picks the unfused one; the fused primitives lower to jnp there)."""
    attend = functools.partial(fused_attn_with_backend, "fused") if dry_run else fused_attn

    def loss(q, k, v, dout):
        out = attend((q, k, v), None, None, None, AttnBiasType.NO_BIAS, mask, QKVLayout.BSHD_BSHD_BSHD,
                     scaling_factor=scale, dropout_probability=0.0, is_training=True,
                     context_parallel_strategy=strategy, context_parallel_causal_load_balanced=load_balanced,
                     context_parallel_axis=axis)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    def fn(q, k, v, dout):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, dout)
        return (out, *grads)

    return jax.jit(fn)


def timed(fn, args, iters: int, warmup: int) -> float:
    """ms per call of ``fn(*args)`` (results ready) over ``iters`` calls after ``warmup``."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / iters


def bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def main(argv=None) -> int:
    args = cp_scaling_parser(__doc__.splitlines()[0], "strategies", STRATEGIES).parse_args(argv)
    dtype = jnp.float16 if args.dry_run else jnp.bfloat16
    if args.dry_run:
        args.seqlens, args.heads, args.kv_heads, args.head_dim, args.iters = [64], 2, 1, 16, 1
    warmup = 0 if args.dry_run else 3
    causal = not args.no_causal
    mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
    devices = jax.devices()
    cp = len(devices)
    mesh = Mesh(np.array(devices), ("cp",))
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    rows = []
    print("| s | cp | strategy | one device ms | CP ms | speedup | per-device efficiency | bitwise vs one device |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for s in args.seqlens:
        rng = np.random.default_rng(s)
        inputs = [jnp.asarray(rng.standard_normal((1, s, heads, d)), dtype) for heads in (h, hk, hk, h)]
        single = step_fn(mask, CPStrategy.DEFAULT, False, "", scale, args.dry_run)
        on_one = [jax.device_put(x, devices[0]) for x in inputs]
        want = [np.asarray(x) for x in single(*on_one)]
        one_ms = timed(single, on_one, args.iters, warmup)
        for name in args.strategies:
            fn = step_fn(mask, STRATEGIES[name], causal, "cp", scale, args.dry_run)
            placed = [reorder_causal_load_balancing(x, LB, cp, 1) if causal else x for x in inputs]
            with jax.set_mesh(mesh):
                placed = [jax.device_put(x, NamedSharding(mesh, P(None, "cp"))) for x in placed]
                got = fn(*placed)
                cp_ms = timed(fn, placed, args.iters, warmup)
                if args.trace:
                    with jax.profiler.trace(os.path.join(args.trace, f"cp{cp}_{name}_s{s}")):
                        jax.block_until_ready(fn(*placed))
            if causal:
                got = [inverse_reorder_causal_load_balancing(x, LB, cp, 1) for x in got]
            bitwise = all(np.array_equal(bits(a), bits(b)) for a, b in zip(got, want))
            row = dict(s=s, cp=cp, strategy=name, heads=h, kv_heads=hk, head_dim=d, causal=causal,
                       one_device_ms=one_ms, cp_ms=cp_ms, speedup=one_ms / cp_ms, efficiency=one_ms / cp_ms / cp,
                       one_device_tflops=attn_flops(1, h, s, s, d, causal, "fwd_bwd") / one_ms * 1e-9,
                       cp_tflops_per_device=attn_flops(1, h, s, s, d, causal, "fwd_bwd") / cp_ms / cp * 1e-9,
                       bitwise=bitwise)
            rows.append(row)
            print(f"| {s} | {cp} | {name} | {one_ms:.2f} | {cp_ms:.2f} | {row['speedup']:.2f} | "
                  f"{row['efficiency']:.2f} | {bitwise} |", flush=True)
    if args.out:
        meta = run_metadata(" ".join(sys.argv), devices[0].device_kind, str(jnp.dtype(dtype)), args.dry_run)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
