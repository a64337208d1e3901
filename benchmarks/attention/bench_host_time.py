"""Host time per attention call, ours against the peers, side by side (microseconds of host time per call).

PyTorch: DotProductAttention against torch SDPA (``scaled_dot_product_attention``), eager, and with
``--compile`` both under ``torch.compile``. JAX: ``fused_attn`` against ``jax.nn.dot_product_attention``,
each jitted: the dispatch time per call. Forward (PyTorch under ``no_grad``) and forward+backward, on one
tiny shape, so that the device finishes each call's kernels long before the host has issued the next: the
time per call is then the host's. Each number is the least-disturbed of ``--rounds`` rounds of ``--calls``
back-to-back calls (the device is waited for only after a round). ``ours/peer`` at or below 1 is the target.
The command and the date are printed with the results.

    python benchmarks/attention/bench_host_time.py                      # GPU
    python benchmarks/attention/bench_host_time.py --compile            # and under torch.compile
    python benchmarks/attention/bench_host_time.py --calls 5 --rounds 1 # CPU smoke run (the unfused path)

On a CPU our PyTorch module runs unfused (or under Triton's interpreter with TRITON_INTERPRET=1) and the
"host time" includes the computation: only the harness is checked there (tests/pytorch/test_bench_host_time.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

# Both frameworks share the GPU: JAX allocates as it goes instead of taking most of the memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import run_metadata  # noqa: E402


def per_call_us(fn, calls: int, rounds: int, sync) -> float:
    """Microseconds per call: the least-disturbed of ``rounds`` rounds of ``calls`` calls (other processes
    only add time), the device waited for after each round, outside the timed calls."""
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        sync()
    return best


def _torch_rows(args, b, s, h, d) -> list:
    import torch

    from transformer_engine.pytorch import DotProductAttention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    mask = "causal" if args.causal else "no_mask"
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask)
    d_flat = torch.ones(b, s, h * d, device=device, dtype=dtype)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    d_sdpa = torch.ones(b, h, s, d, device=device, dtype=dtype)

    def ours(m):
        return lambda: m(q, k, v)

    def sdpa(fn):
        return lambda: fn(qt, kt, vt, is_causal=args.causal)

    variants = [("eager", module, torch.nn.functional.scaled_dot_product_attention)]
    if args.compile:
        variants.append(("torch.compile", torch.compile(module, fullgraph=True),
                         torch.compile(torch.nn.functional.scaled_dot_product_attention, fullgraph=True)))
    rows = []
    for mode, m, peer in variants:
        fwd_ours, fwd_peer = ours(m), sdpa(peer)

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    fn()
            return run

        def step(fn, grad):
            def run():
                fn().backward(grad)
            return run

        for name, a, p in (("forward", no_grad(fwd_ours), no_grad(fwd_peer)),
                           ("fwd+bwd", step(fwd_ours, d_flat), step(fwd_peer, d_sdpa))):
            rows.append(dict(framework=f"pytorch ({mode})", pass_=name,
                             ours_name="DotProductAttention", ours=per_call_us(a, args.calls, args.rounds, sync),
                             peer_name="torch SDPA", peer=per_call_us(p, args.calls, args.rounds, sync)))
    for t in (q, k, v, qt, kt, vt):
        t.grad = None
    rows.append(dict(note=f"pytorch on {device}: our backend {module.last_backend}"))
    return rows


def _jax_rows(args, b, s, h, d) -> list:
    try:
        import jax
        import jax.numpy as jnp

        from transformer_engine.jax.attention import AttnBiasType, AttnMaskType, QKVLayout, fused_attn
    except ImportError as err:
        return [dict(note=f"jax rows skipped: {err}")]
    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), dtype) for key in keys)
    mask = AttnMaskType.CAUSAL_MASK if args.causal else AttnMaskType.NO_MASK
    scale = d ** -0.5

    def ours(q, k, v):
        return fused_attn((q, k, v), None, None, None, attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=mask,
                          qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=scale, dropout_probability=0.0,
                          is_training=True)

    def peer(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=args.causal)

    def fwd_bwd(attn):
        def run(q, k, v, do):
            _, vjp = jax.vjp(attn, q, k, v)
            return vjp(do)
        return run

    last = []

    def timed(fn, *arrays):
        def call():
            last[:] = [fn(*arrays)]
        return call

    def sync():
        if last:
            jax.block_until_ready(last[0])

    rows = []
    for name, a, p, arrays in (("forward", jax.jit(ours), jax.jit(peer), (q, k, v)),
                               ("fwd+bwd", jax.jit(fwd_bwd(ours)), jax.jit(fwd_bwd(peer)), (q, k, v, do))):
        rows.append(dict(framework="jax (jit)", pass_=name, ours_name="fused_attn",
                         ours=per_call_us(timed(a, *arrays), args.calls, args.rounds, sync),
                         peer_name="jax.nn.dot_product_attention",
                         peer=per_call_us(timed(p, *arrays), args.calls, args.rounds, sync)))
    rows.append(dict(note=f"jax on {jax.devices()[0].platform}"))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shape", default="1,128,2,64", help="b,s,h,d (tiny: the device must not be the limit)")
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--compile", action="store_true", help="also both PyTorch callables under torch.compile")
    ap.add_argument("--frameworks", default="pytorch,jax")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    b, s, h, d = (int(x) for x in args.shape.split(","))
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    frameworks = args.frameworks.split(",")
    rows = []
    if "pytorch" in frameworks:
        rows += _torch_rows(args, b, s, h, d)
    if "jax" in frameworks:
        rows += _jax_rows(args, b, s, h, d)
    device = "cuda" if any("cuda" in r.get("note", "") or "gpu" in r.get("note", "") for r in rows) else "cpu"
    meta = run_metadata(command, device)
    print(f"host time per attention call (microseconds), b,s,h,d = {b},{s},{h},{d}, "
          f"{'causal' if args.causal else 'no mask'}, min of {args.rounds} rounds of {args.calls} calls")
    print(f"date: {meta['date']}  commit: {meta['commit']}")
    print(f"command: {command}")
    print(f"{'framework':22s} {'pass':8s} {'ours':>28s} {'peer':>40s} {'ours/peer':>10s}")
    for r in rows:
        if "note" in r:
            print(f"  ({r['note']})")
            continue
        r["ratio"] = r["ours"] / r["peer"]
        print(f"{r['framework']:22s} {r['pass_']:8s} {r['ours_name'] + ' ' + format(r['ours'], '9.1f'):>28s} "
              f"{r['peer_name'] + ' ' + format(r['peer'], '9.1f'):>40s} {r['ratio']:10.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
