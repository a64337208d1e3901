"""Device time per kernel of the same deterministic fwd+bwd from PyTorch (fused_attn_func) and from JAX
(fused_attn under jit), in one process: torch's profiler (CUPTI) records every CUDA kernel of the process, the
ones XLA launches included, so both frameworks' kernels are timed the same way.

    python dev/tuning/jax_torch_profile.py [--shape 4,16,4096,128] [--causal] [--reps 10]

Prints a table per framework (kernel, calls and device microseconds per step, sorted by time) and both totals;
the JAX table also shows what XLA runs around the custom calls (copies, fusions, memsets).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

import torch  # noqa: E402

from causal_breakdown import per_kernel_us, print_kernels  # noqa: E402  (this folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,16,4096,128", help="b,h,s,d")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    b, h, s, d = (int(x) for x in args.shape.split(","))
    scale = d ** -0.5

    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def torch_step():
        out = fused_attn_func(*leaves, "bshd", "causal" if args.causal else "no_mask", None, scale,
                              deterministic=True)
        return torch.autograd.grad(out, leaves, do)

    import jax
    import jax.numpy as jnp
    from transformer_engine.jax.attention import AttnBiasType, AttnMaskType, QKVLayout, fused_attn

    mask = AttnMaskType.CAUSAL_MASK if args.causal else AttnMaskType.NO_MASK
    jq, jk, jv, jdo = (jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16) for t in (q, k, v, do))

    def attn(q_, k_, v_):
        return fused_attn((q_, k_, v_), None, None, None, attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=mask,
                          qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=scale, dropout_probability=0.0,
                          is_training=True)

    def fwd_bwd(q_, k_, v_, do_):
        _, vjp = jax.vjp(attn, q_, k_, v_)
        return vjp(do_)

    compiled = jax.jit(fwd_bwd).lower(jq, jk, jv, jdo).compile()

    def jax_step():
        return jax.block_until_ready(compiled(jq, jk, jv, jdo))

    print(f"shape (b, h, s, d) = ({b}, {h}, {s}, {d}) bf16, {'causal' if args.causal else 'no mask'}, "
          f"deterministic, {args.reps} steps\n")
    t_torch = print_kernels("PyTorch fused_attn_func", per_kernel_us(torch_step, args.reps))
    t_jax = print_kernels("JAX fused_attn (jit)", per_kernel_us(jax_step, args.reps))
    print(f"JAX / PyTorch kernel time: {t_jax / t_torch:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
