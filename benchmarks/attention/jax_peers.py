"""JAX subjects and peers of the attention benchmark, run in a subprocess per XLA-flag setting.

``bench_attention.py`` starts this script twice: once plain (``jax_te``, ``jax_cudnn``,
``jax_xla``) and once with ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` (``jax_te_det``,
``jax_cudnn_det``), because XLA reads its flags once per process. It can also be run alone::

    XLA_FLAGS=--xla_gpu_deterministic_ops=true python benchmarks/attention/jax_peers.py \
        --impls jax_te_det,jax_cudnn_det --cases std --json-out /tmp/jax_det.json

Measured per (case, impl): forward and forward+backward time (jit-compiled, medians over
back-to-back batches of calls), XLA's static memory need of the fwd+bwd executable (temp +
outputs, from ``compiled.memory_analysis()``: JAX cannot reset a peak counter per call), and
whether three fwd+bwd runs give bitwise equal gradients. Rows are written to ``--json-out``
after each measurement, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from cases import DRY_GRID, GRID, JAX_IMPLS, Case, select_cases  # noqa: E402

DET_FLAG = "--xla_gpu_deterministic_ops=true"

# impl -> (label, role, deterministic: needs the XLA flag in this process)
JAX_SPECS = {
    "jax_te_det": ("TE JAX fused_attn, det (XLA det flag)", "subject", True),
    "jax_te": ("TE JAX fused_attn", "subject", False),
    "jax_cudnn_det": ("jax.nn.dot_product_attention cudnn, XLA det flag", "peer", True),
    "jax_cudnn": ("jax.nn.dot_product_attention cudnn", "peer", False),
    "jax_xla": ("jax.nn.dot_product_attention xla", "peer", False),
}


def xla_deterministic() -> bool:
    flags = os.environ.get("XLA_FLAGS", "").split()
    value = False
    for f in flags:
        key, sep, raw = f.lstrip("-").partition("=")
        if key == "xla_gpu_deterministic_ops":
            value = raw.lower() in ("true", "1") if sep else True
    return value


class Skip(Exception):
    pass


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _inputs(jax, jnp, case: Case, dtype, seed=0):
    """q, k, v, do: [b, s, h, d] for bshd; for thd both packed [1, t, h, d] and padded [n, s_max, h, d].
    v and do have the head dim ``case.d_v``."""
    key = jax.random.PRNGKey(seed)
    kq, kk, kv, kd = jax.random.split(key, 4)
    lead = (1, case.tokens) if case.layout == "thd" else (case.b, case.s)

    def rnd(k, h, d):
        return jax.random.normal(k, (*lead, h, d), jnp.float32).astype(dtype)
    arrays = (rnd(kq, case.hq, case.d), rnd(kk, case.hkv, case.d), rnd(kv, case.hkv, case.d_v),
              rnd(kd, case.hq, case.d_v))
    if case.layout != "thd":
        return {"dense": arrays}
    # padded copy: sequence i at rows [i, :len_i]
    import numpy as np
    n, s = len(case.seqlens), case.s
    starts = np.concatenate([[0], np.cumsum(case.seqlens)[:-1]])
    idx = np.zeros((n, s), np.int32)
    valid = np.zeros((n, s), bool)
    for i, (st, ln) in enumerate(zip(starts, case.seqlens)):
        idx[i, :ln] = np.arange(st, st + ln)
        valid[i, :ln] = True
    idx, valid = jnp.asarray(idx), jnp.asarray(valid)

    def pad(x):
        return jnp.where(valid[:, :, None, None], x[0][idx], jnp.zeros((), x.dtype))
    return {"packed": arrays, "padded": tuple(pad(x) for x in arrays),
            "lens": jnp.asarray(case.seqlens, jnp.int32), "starts": jnp.asarray(starts, jnp.int32)}


def make_attention(impl: str, case: Case, data: dict, dry_run: bool):
    """(attention function of (q, k, v), its 4 array args (q, k, v, do), backend name) or raise Skip."""
    import jax

    scale = case.d ** -0.5
    thd = case.layout == "thd"
    on_gpu = jax.devices()[0].platform == "gpu"
    if impl.startswith("jax_te"):
        from transformer_engine.jax.attention import (AttnBiasType, AttnMaskType, QKVLayout, SequenceDescriptor,
                                                      fused_attn, fused_attn_unavailable_reasons)
        layout = QKVLayout.THD_THD_THD if thd else QKVLayout.BSHD_BSHD_BSHD
        if thd:
            mask = AttnMaskType.PADDING_CAUSAL_MASK if case.causal else AttnMaskType.PADDING_MASK
        else:
            mask = AttnMaskType.CAUSAL_MASK if case.causal else AttnMaskType.NO_MASK
        args = data["packed"] if thd else data["dense"]
        reasons = fused_attn_unavailable_reasons(True, args[0].dtype, args[1].dtype, layout, AttnBiasType.NO_BIAS,
                                                 mask, "vanilla", 0.0, case.hq, case.hkv, args[0].shape[1],
                                                 args[1].shape[1], case.d, case.d_v)
        if reasons and not dry_run:
            raise Skip("JAX fused kernels unavailable here: " + "; ".join(reasons))
        desc, segments = None, 1
        if thd:
            desc = SequenceDescriptor.from_seqlens_and_offsets(data["lens"][None, :], data["starts"][None, :])
            segments = len(case.seqlens)

        def attn(q, k, v):
            return fused_attn((q, k, v), None, desc, None, attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=mask,
                              qkv_layout=layout, scaling_factor=scale, dropout_probability=0.0, is_training=True,
                              max_segments_per_seq=segments)
        return attn, args, None
    implementation = "cudnn" if impl.startswith("jax_cudnn") else "xla"
    if implementation == "cudnn" and not on_gpu:
        raise Skip("jax.nn.dot_product_attention(implementation='cudnn') needs a CUDA GPU")
    args = data["padded"] if thd else data["dense"]
    if case.d_v != case.d:
        return _cudnn_mla(case, args, implementation)
    lens = data["lens"] if thd else None

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=case.causal, query_seq_lengths=lens,
                                            key_value_seq_lengths=lens, implementation=implementation)
    return attn, args, implementation + (" (thd padded to s_max with seq lengths)" if thd else "")


def _cudnn_mla(case: Case, args, implementation: str):
    """d_v != d_qk: jax.nn.dot_product_attention refuses a value head dim unlike the key's, but the
    cuDNN function it calls takes it (cuDNN's MLA shapes); the XLA path has no such entry point."""
    if implementation != "cudnn" or case.layout == "thd":
        raise Skip(f"jax.nn.dot_product_attention needs v's head dim equal to q/k's, got {case.d_v} != {case.d}")
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError as err:
        raise Skip(f"no cuDNN entry point for d_v != d_qk in this JAX ({err})")
    mask = MaskType.CAUSAL if case.causal else MaskType.NO_MASK

    def attn(q, k, v):
        return dot_product_attention(q, k, v, scale=case.d ** -0.5, mask_type=mask, qkv_layout="BTNH")
    return attn, args, "cudnn (jax._src.cudnn dot_product_attention: d_v != d_qk)"


def time_call(jax, fn, args, rep_s: float, dry_run: bool) -> float:
    """Median seconds per call: batches of back-to-back calls (async dispatch keeps the GPU busy)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    est = max(time.perf_counter() - t0, 1e-6)
    inner = 1 if dry_run else max(1, min(50, int(0.02 / est)))
    outer = 1 if dry_run else max(3, min(25, int(rep_s / (inner * est))))
    samples = []
    for _ in range(outer):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def bits(jax, np, tree):
    return [np.asarray(x).view(np.uint8).copy() for x in jax.tree_util.tree_leaves(tree)]


def measure(impl: str, case: Case, data: dict, args) -> dict:
    import jax
    import numpy as np

    label, role, det = JAX_SPECS[impl]
    row = {"case": case.name, "group": case.group, "impl": impl, "label": label, "role": role,
           "framework": "jax", "deterministic": det, "status": "ok", "notes": []}
    started = time.perf_counter()
    try:
        if det != xla_deterministic():
            raise RuntimeError(f"{impl} must run in a process {'with' if det else 'without'} {DET_FLAG}")
        attn, arrays, backend = make_attention(impl, case, data, args.dry_run)
        q, k, v, do = arrays

        def fwd_bwd(q, k, v, do):
            out, vjp = jax.vjp(attn, q, k, v)
            return vjp(do)

        names = []
        recording = contextlib.nullcontext(names)
        if backend is None:  # ours: record which backend fused_attn selects while tracing
            from transformer_engine.common.log import selected_backends as recording_backend_selections
            recording = recording_backend_selections()
        with recording as names:
            fwd_c = jax.jit(attn).lower(q, k, v).compile()
            bwd_c = jax.jit(fwd_bwd).lower(q, k, v, do).compile()
        if backend is None:
            backend = names[-1] if names else "?"
            if not args.dry_run and backend != "FusedAttention":
                raise Skip(f"JAX fused_attn selected {backend}, not the fused kernels")
        row["backend"] = backend
        mem = bwd_c.memory_analysis()
        if mem is not None:
            need = mem.temp_size_in_bytes + mem.output_size_in_bytes
            row["peak_gb"] = _sig(need / 1e9, 3)
            stats = jax.devices()[0].memory_stats() or {}
            limit = stats.get("bytes_limit")
            if limit and need > 0.95 * (limit - stats.get("bytes_in_use", 0)):
                raise RuntimeError(f"would OOM: XLA needs {need / 1e9:.1f} GB, {limit / 1e9:.1f} GB on the device")
        t_fwd = time_call(jax, fwd_c, (q, k, v), args.rep_ms / 1e3, args.dry_run)
        t_all = time_call(jax, bwd_c, (q, k, v, do), args.rep_ms / 1e3, args.dry_run)
        row.update(fwd_ms=_sig(t_fwd * 1e3), fwd_bwd_ms=_sig(t_all * 1e3),
                   fwd_tflops=_sig(case.flops("fwd") / t_fwd / 1e12),
                   fwd_bwd_tflops=_sig(case.flops("fwd_bwd") / t_all / 1e12))
        first = bits(jax, np, bwd_c(q, k, v, do))
        same = True
        for _ in range(args.repeats - 1):
            again = bits(jax, np, bwd_c(q, k, v, do))
            same = same and all(np.array_equal(a, b) for a, b in zip(first, again))
        row["bitwise"] = bool(same)
    except Skip as why:
        row.update(status="skipped", reason=str(why))
    except Exception as err:  # a peer that cannot run this case is reported, not fatal
        msg = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
        if "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower():
            msg = "OOM: " + msg
        row.update(status="error", reason=msg)
        traceback.print_exc(limit=2)
    row["time_s"] = round(time.perf_counter() - started, 1)
    if not row["notes"]:
        row.pop("notes")
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=",".join(JAX_IMPLS))
    ap.add_argument("--cases", default="", help="case names or groups (comma list); default: all")
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default), float16, float32 (dry-run default)")
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    grid = DRY_GRID if args.dry_run else GRID
    cases = select_cases(grid, [c for c in args.cases.split(",") if c]) if args.cases else list(grid)
    impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in impls if i not in JAX_SPECS]
    if unknown:
        ap.error(f"unknown JAX impls {unknown}; known: {list(JAX_SPECS)}")
    dtype = jnp.dtype(args.dtype or ("float32" if args.dry_run else "bfloat16"))
    print(f"[jax] {jax.__version__} on {jax.devices()[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          flush=True)
    rows = []
    for case in cases:
        data = _inputs(jax, jnp, case, dtype)
        for impl in impls:
            row = measure(impl, case, data, args)
            rows.append(row)
            print(f"[jax] {case.name} {impl}: " + json.dumps({k: v for k, v in row.items() if k not in
                                                              ("case", "impl", "label", "group")}), flush=True)
            with open(args.json_out + ".tmp", "w") as f:
                json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
            os.replace(args.json_out + ".tmp", args.json_out)
        del data
    return 0


if __name__ == "__main__":
    sys.exit(main())
