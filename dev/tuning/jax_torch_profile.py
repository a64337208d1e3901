"""Device time per kernel of the same deterministic fwd+bwd from PyTorch (fused_attn_func) and from JAX
(fused_attn under jit), in one process: torch's profiler (CUPTI) records every CUDA kernel of the process, the
ones XLA launches included, so both frameworks' kernels are timed the same way.

    python dev/tuning/jax_torch_profile.py [--shape 4,16,4096,128] [--causal] [--reps 10] [--order torch,jax]

Prints a table per framework (kernel, calls and device microseconds per step, sorted by time) and both totals;
the JAX table also shows what XLA runs around the custom calls (copies, fusions, memsets). ``--order`` profiles
the steps in that order (repeats allowed, e.g. ``torch,jax,jax,torch``: does the order explain a difference?);
``torch_on_jax`` is the PyTorch step on the JAX arrays' own memory (DLPack): does buffer placement?
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

import torch  # noqa: E402

from causal_breakdown import print_kernels  # noqa: E402  (this folder; it puts benchmarks/attention on the path)
from kernel_time import per_kernel_us  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,16,4096,128", help="b,h,s,d")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--order", default="torch,jax", help="steps to profile, in order: torch, jax, torch_on_jax")
    args = parser.parse_args(argv)
    b, h, s, d = (int(x) for x in args.shape.split(","))
    scale = d ** -0.5

    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def torch_step(inputs=leaves, d_out=do):
        out = fused_attn_func(*inputs, "bshd", "causal" if args.causal else "no_mask", None, scale,
                              deterministic=True)
        return torch.autograd.grad(out, inputs, d_out)

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

    # The PyTorch step reading the JAX arrays' memory (DLPack shares it; the gradients are PyTorch's).
    shared = [torch.from_dlpack(a).requires_grad_() for a in (jq, jk, jv)]
    shared_do = torch.from_dlpack(jdo)
    steps = {"torch": ("PyTorch fused_attn_func", torch_step),
             "jax": ("JAX fused_attn (jit)", jax_step),
             "torch_on_jax": ("PyTorch fused_attn_func on the JAX arrays (DLPack)",
                              lambda: torch_step(shared, shared_do))}

    print(f"shape (b, h, s, d) = ({b}, {h}, {s}, {d}) bf16, {'causal' if args.causal else 'no mask'}, "
          f"deterministic, {args.reps} steps, order {args.order}\n")
    totals = {}
    for n, name in enumerate(args.order.split(",")):
        title, step = steps[name]
        totals.setdefault(name, []).append(print_kernels(f"{n + 1}. {title}", per_kernel_us(step, args.reps)))
    print("| step | ms of kernels per call, in profile order |\n|---|---|")
    for name, times in totals.items():
        print(f"| {name} | {' / '.join(f'{t:.3f}' for t in times)} |")
    if "torch" in totals and "jax" in totals:
        t_torch, t_jax = (sum(totals[k]) / len(totals[k]) for k in ("torch", "jax"))
        print(f"\nJAX / PyTorch kernel time: {t_jax / t_torch:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
