"""Shared benchmark plumbing: timing, peak memory, bitwise repeatability, run metadata, tables.

torch and triton are imported where used, so the metadata and table helpers also serve
processes without them (the JAX subprocess, merging results).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def bench_ms(fn, grad_to_none=None, warmup=25, rep=100):
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def counted_ms(fn, iters: int, warmup: int, sync) -> float:
    """ms per call of ``fn`` over ``iters`` calls after ``warmup`` (``sync`` waits for the device): a count of
    calls, not a time budget, where each call changes state (a KV-cache step, a collective every rank runs)."""
    import time

    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / iters


def peak_memory_gb(fn):
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def grads_repeat_bitwise(run, repeats=3):
    """run() -> tuple of grads; True when every repeat is bitwise equal to the first."""
    import torch

    first = [g.clone() for g in run()]
    for _ in range(repeats - 1):
        again = run()
        if not all(torch.equal(a, b) for a, b in zip(first, again)):
            return False
    return True


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except Exception:
        return None


def run_metadata(command: str, device: str, dtype: str = "bfloat16", dry_run: bool = False) -> dict:
    """Date, commit (GIT_COMMIT where the tree has no git), command, device and package versions."""
    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True,
                                             stderr=subprocess.DEVNULL).strip()
            dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                                            text=True, stderr=subprocess.DEVNULL).strip()
            commit += "+dirty" if dirty else ""
        except Exception:
            commit = "unknown (no git here; set GIT_COMMIT)"
    versions = {"python": platform.python_version()}
    for name in ("torch", "triton", "jax", "jaxlib", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend",
                 "nvidia-cudnn-cu13", "numpy"):
        v = _dist_version(name)
        if v:
            versions[name] = v
    try:
        import torch
        if torch.cuda.is_available():
            versions["cuda"] = torch.version.cuda
            versions["cudnn (torch)"] = torch.backends.cudnn.version()
    except Exception:
        pass
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "command": command,
        "device": device,
        "dtype": dtype,
        "dry_run": dry_run,
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


def cp_scaling_parser(description: str, names: str, choices) -> argparse.ArgumentParser:
    """The context-parallel scaling benchmarks' arguments (bench_cp_scaling.py, bench_cp_scaling_jax.py):
    shapes, the exchange kinds under ``--<names>`` (default: all of ``choices``), timing and outputs."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument(f"--{names}", nargs="+", default=list(choices), choices=sorted(choices))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="", help="JSON of the rows and the run's metadata")
    parser.add_argument("--trace", default="", help="folder for profiler traces of one CP step each")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, once each: the harness")
    return parser
