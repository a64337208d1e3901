"""Shared benchmark plumbing: FLOP counting, timing, peak memory, bitwise repeatability."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone

import torch
import triton


def attn_flops(b, h, sq, sk, d, causal, mode):
    """FlashAttention counting: forward 4*b*h*sq*sk*d (halved when causal); backward 2.5x."""
    f = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


def bench_ms(fn, grad_to_none=None, warmup=25, rep=100):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def peak_memory_gb(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def grads_repeat_bitwise(run, repeats=3):
    """run() -> tuple of grads; True when every repeat is bitwise equal to the first."""
    first = [g.clone() for g in run()]
    for _ in range(repeats - 1):
        again = run()
        if not all(torch.equal(a, b) for a, b in zip(first, again)):
            return False
    return True


def run_metadata(command):
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        commit = os.environ.get("GIT_COMMIT", "unknown")
    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        import jax
        versions["jax"] = jax.__version__
    except Exception:
        pass
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "command": command,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions,
    }


def write_results(path_stem, meta, rows, columns):
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    with open(path_stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# {os.path.basename(path_stem)}", "",
             f"date {meta['date']}, commit {meta['commit']}, device {meta['device']}, "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
             f"command: `{meta['command']}`", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    with open(path_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
