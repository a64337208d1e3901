"""Kernel time of the same deterministic attention launched from PyTorch and from JAX, in one process.

``bench_attention.py`` runs this script as a subprocess (with ``XLA_FLAGS=--xla_gpu_deterministic_ops=true``)
for the ``te_fused_det_kt`` and ``jax_te_det_kt`` rows; it also runs alone::

    XLA_FLAGS=--xla_gpu_deterministic_ops=true python benchmarks/attention/kernel_time.py --cases std \
        --json-out /tmp/kt.json

Per case: the PyTorch subject ``te_fused_det`` (DotProductAttention with the fused kernels forced) and the JAX
subject ``jax_te_det`` (fused_attn under jit), both as the main benchmark builds them. torch's profiler (CUPTI)
records every CUDA kernel of the process, the ones XLA launches included, so both frameworks are timed by the
same clock: the device time of all kernels of a call (forward; forward+backward), summed, per call. Host work
and the gaps between kernels do not count: this is the comparison of what each framework makes the GPU do.
The two frameworks alternate over ``--rounds`` rounds (which one goes first alternates too) and each row
takes its median round, so clock and temperature drift during the run fall on both alike.
"""

from __future__ import annotations

import argparse
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

from cases import DRY_GRID, GRID, KERNEL_TIME_IMPLS, Case, select_cases  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and PyTorch share the GPU

LABELS = {
    "te_fused_det_kt": "TE Triton fused (forced), det: kernel time from PyTorch",
    "jax_te_det_kt": "TE JAX fused_attn, det: kernel time from JAX",
}


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def per_kernel_us(fn, reps: int) -> dict:
    """{kernel name: [launches per call, device us per call]} of every CUDA kernel ``fn`` runs (those XLA
    launches too: the profiler's CUPTI sees the whole process), over ``reps`` calls after a warm-up call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            calls, us = out.get(event.key[:80], (0.0, 0.0))
            out[event.key[:80]] = [calls + event.count / reps, us + event.device_time_total / reps]
    return out


def kernel_ms(fn, reps: int) -> float:
    """Device milliseconds per call of all CUDA kernels ``fn`` launches (per_kernel_us, summed)."""
    return sum(us for _, us in per_kernel_us(fn, reps).values()) / 1e3


def _torch_calls(case: Case):
    """(forward, forward+backward) callables of the PyTorch subject, and its context manager."""
    import torch
    from peers import TORCH_PEERS, make_inputs

    inp = make_inputs(case, torch.device("cuda"), torch.bfloat16)
    runner = TORCH_PEERS["te_fused_det"].factory(case, inp)
    if isinstance(runner, str):
        raise RuntimeError(f"te_fused_det cannot run: {runner}")
    leaves = list(runner.leaves)

    def fwd():
        with torch.no_grad():
            runner.fwd()

    def fwd_bwd():
        for t in leaves:  # a fresh gradient each call: no accumulation kernel
            t.grad = None
        runner.fwd().backward(runner.grad_out)
    return fwd, fwd_bwd, runner


def _jax_calls(case: Case):
    """(forward, forward+backward) callables of the JAX subject (compiled, each waits for its result)."""
    import jax
    import jax.numpy as jnp
    from jax_peers import _inputs, make_attention, xla_deterministic

    if not xla_deterministic():
        raise RuntimeError("jax_te_det_kt needs XLA_FLAGS=--xla_gpu_deterministic_ops=true in this process")
    attn, (q, k, v, do), _ = make_attention("jax_te_det", case, _inputs(jax, jnp, case, jnp.bfloat16), False)

    def grads(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)
    fwd_c = jax.jit(attn).lower(q, k, v).compile()
    bwd_c = jax.jit(grads).lower(q, k, v, do).compile()
    return (lambda: jax.block_until_ready(fwd_c(q, k, v))), (lambda: jax.block_until_ready(bwd_c(q, k, v, do)))


def measure_case(case: Case, rounds: int, reps: int) -> list:
    """The two rows of ``case``: each framework's median kernel ms per call over alternating rounds."""
    import torch

    rows = {impl: {"case": case.name, "group": case.group, "impl": impl, "label": LABELS[impl], "role": "subject",
                   "framework": "torch" if impl.startswith("te_") else "jax", "deterministic": True,
                   "status": "ok", "backend": "FusedAttention", "timing": "kernel device time (profiler)"}
            for impl in KERNEL_TIME_IMPLS}
    started = time.perf_counter()
    try:
        t_fwd, t_all, runner = _torch_calls(case)
        j_fwd, j_all = _jax_calls(case)
        calls = {"te_fused_det_kt": (t_fwd, t_all), "jax_te_det_kt": (j_fwd, j_all)}
        samples = {impl: ([], []) for impl in calls}
        with runner.context():
            for r in range(rounds):
                order = list(calls) if r % 2 == 0 else list(reversed(list(calls)))
                for impl in order:
                    fwd, fwd_bwd = calls[impl]
                    samples[impl][0].append(kernel_ms(fwd, reps))
                    samples[impl][1].append(kernel_ms(fwd_bwd, reps))
            for impl, (fwd_ms, all_ms) in samples.items():
                f, a = statistics.median(fwd_ms), statistics.median(all_ms)
                rows[impl].update(fwd_ms=_sig(f), fwd_bwd_ms=_sig(a), fwd_tflops=_sig(case.flops("fwd") / f / 1e9),
                                  fwd_bwd_tflops=_sig(case.flops("fwd_bwd") / a / 1e9),
                                  notes=[f"{rounds} alternating rounds of {reps} calls; fwd+bwd ms per round "
                                         + " ".join(f"{x:.3f}" for x in all_ms)])
            if runner.backend is not None:
                rows["te_fused_det_kt"]["backend"] = runner.backend() or "?"
    except Exception as err:  # recorded in both rows, not fatal
        msg = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
        if "out of memory" in str(err).lower() or "RESOURCE_EXHAUSTED" in str(err):
            msg = "OOM: " + msg
        for row in rows.values():
            row.update(status="error", reason=msg)
        traceback.print_exc(limit=3)
    finally:
        torch.cuda.empty_cache()
    for row in rows.values():
        row["time_s"] = round(time.perf_counter() - started, 1)
    return list(rows.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="case names or groups (comma list); default: all")
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per case (median taken)")
    ap.add_argument("--reps", type=int, default=5, help="calls per profiled round")
    ap.add_argument("--dry-run", action="store_true", help="DRY_GRID's case names (rows need a CUDA GPU)")
    args = ap.parse_args(argv)
    import torch

    grid = DRY_GRID if args.dry_run else GRID
    cases = select_cases(grid, [c for c in args.cases.split(",") if c]) if args.cases else list(grid)
    rows = []
    for case in cases:
        if torch.cuda.is_available() and not args.dry_run:
            new = measure_case(case, args.rounds, args.reps)
        else:
            new = [{"case": case.name, "group": case.group, "impl": impl, "label": LABELS[impl], "role": "subject",
                    "framework": "torch" if impl.startswith("te_") else "jax", "status": "skipped",
                    "reason": "kernel time needs a CUDA GPU (the profiler's device clock)"}
                   for impl in KERNEL_TIME_IMPLS]
        for row in new:
            print(f"[kernel time] {case.name} {row['impl']}: "
                  + json.dumps({k: v for k, v in row.items() if k not in ("case", "impl", "label", "group")}),
                  flush=True)
        rows.extend(new)
        with open(args.json_out + ".tmp", "w") as f:
            json.dump({"rows": rows}, f, indent=1)
        os.replace(args.json_out + ".tmp", args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
