"""GPU smoke check of the JAX fused attention launch, before the full suites (run on the H200):

    python tests/jax/gpu_smoke.py

Prints, and exits non-zero on the first failure: whether the FFI extension imports and the
fused backend is selected; fused vs unfused forward and gradients on a few configs; repeated
deterministic backward runs bitwise equal; time per fwd+bwd of fused vs unfused.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from transformer_engine.jax import attention as te_attention  # noqa: E402
import te_jax_testing as te_testing  # noqa: E402
from transformer_engine.jax.attention import (  # noqa: E402
    AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout, SequenceDescriptor)
from transformer_engine.jax.primitives import gpu  # noqa: E402


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def grads_fn(backend, mask, layout, desc, scale, m=1):
    def run(q, k, v, dout):
        f = lambda q, k, v: te_testing.fused_attn_with_backend(  # noqa: E731
            backend, (q, k, v), None, desc, None, AttnBiasType.NO_BIAS, mask, layout, scale, 0.0, True,
            max_segments_per_seq=m)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    return jax.jit(run)


def main() -> int:
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    if jax.devices()[0].platform != "gpu":
        fail("no GPU: run this on the GPU machine")
    reason = gpu.unavailable_reason()
    print(f"FFI extension: {'ok' if reason is None else reason}")
    if reason:
        fail("the fused backend cannot run; build with NVTE_FRAMEWORK=jax (or all) and a CUDA toolkit")
    key = jax.random.PRNGKey(0)
    cases = [
        ("bshd causal gqa bf16", AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 2, 1024, 16, 4, 128, jnp.bfloat16, 1),
        ("bshd padding_causal fp16", AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 2, 512, 8, 8, 64,
         jnp.float16, 1),
        ("thd padding_causal_bottom_right bf16", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, QKVLayout.THD_THD_THD,
         2, 768, 8, 2, 64, jnp.bfloat16, 3),
        ("bshd no_mask d=256 bf16", AttnMaskType.NO_MASK, QKVLayout.BSHD_BSHD_BSHD, 1, 640, 4, 4, 256, jnp.bfloat16, 1),
    ]
    for name, mask, layout, b, s, hq, hk, d, dtype, m in cases:
        ks = jax.random.split(jax.random.fold_in(key, s), 4)
        q = jax.random.normal(ks[0], (b, s, hq, d), jnp.float32).astype(dtype)
        k = jax.random.normal(ks[1], (b, s, hk, d), jnp.float32).astype(dtype)
        v = jax.random.normal(ks[2], (b, s, hk, d), jnp.float32).astype(dtype)
        dout = jax.random.normal(ks[3], (b, s, hq, d), jnp.float32).astype(dtype)
        desc = None
        if mask.is_padding():
            lens = jnp.array([[s // 3, s // 4, s // 5], [s // 2, 0, s // 3]])[:, :m] if m > 1 else jnp.array([s, s - 61])
            desc = SequenceDescriptor.from_seqlens(lens[:b])
        fused = grads_fn("fused", mask, layout, desc, d**-0.5, m)
        unfused = grads_fn("unfused", mask, layout, desc, d**-0.5, m)
        a = fused(q, k, v, dout)
        r = unfused(q, k, v, dout)
        errs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(a, r)]
        scale = [float(jnp.max(jnp.abs(y.astype(jnp.float32)))) for y in r]
        print(f"{name}: max |fused - unfused| out/dq/dk/dv = "
              + ", ".join(f"{e:.3g} (of {sc:.3g})" for e, sc in zip(errs, scale)))
        if not all(np.isfinite(errs)) or any(e > 0.05 * max(sc, 1.0) for e, sc in zip(errs, scale)):
            fail(f"{name}: fused and unfused disagree")
        again = [fused(q, k, v, dout) for _ in range(5)]
        for run in again:
            for x, y in zip(a, run):
                if not np.array_equal(np.asarray(x), np.asarray(y)):
                    fail(f"{name}: repeated deterministic runs differ")
        for label, fn in (("fused", fused), ("unfused", unfused)):
            jax.block_until_ready(fn(q, k, v, dout))
            start = time.perf_counter()
            for _ in range(10):
                res = fn(q, k, v, dout)
            jax.block_until_ready(res)
            print(f"    {label}: {1e3 * (time.perf_counter() - start) / 10:.2f} ms per fwd+bwd")
    selection = te_attention.select_attention_backend(te_attention._parse_call(te_attention._FusedAttnArgs(
        (q, k, v), None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD,
        AttnSoftmaxType.VANILLA_SOFTMAX, 0.125, 0.0, True, 1, None)).config)
    print(f"fused_attn selects: {selection.name}")
    if selection.name != "FusedAttention":
        fail(f"fused_attn selected {selection.name}; rejected: {selection.rejected}")
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
