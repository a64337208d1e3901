"""CUDA-event timing shared by the module benchmarks (fp8_linear.py, grouped_linear.py, batch_invariant.py)."""

from __future__ import annotations

import statistics


def median_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each bracketed by CUDA events and synchronized,
    after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
