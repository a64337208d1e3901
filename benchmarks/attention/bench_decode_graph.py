"""Host time of a whole model's decode step, eager and captured once in a CUDA graph, by layer count.

Per case (``layers`` DotProductAttention layers on one InferenceParams, batch ``b``, ``context`` cached tokens per
sequence, non-paged or paged cache; 32 query heads, 8 kv heads, d 128, bf16): a decode step is ``pre_step`` then
every layer's call with the step's new token per sequence. ``eager`` calls the layers each step; ``graph`` captured
them once (after eager steps of that batch size) and replays the capture, ``pre_step`` rewriting the step's
metadata in place. Columns: ``host_us``, microseconds of host time per step (the steps timed back to back without
waiting for the device: Python, launches, ``pre_step``'s copy); ``host_us_per_token`` (/ b); ``step_us``, wall
time per step with the device waited for at the end (the larger of host and device time); ``bitwise``: every
layer's output of the ``graph`` steps equals the ``eager`` steps' of a second cache filled alike.

    python benchmarks/attention/bench_decode_graph.py --out benchmarks/results/decode_graph   # on the GPU
    TRITON_INTERPRET=1 python benchmarks/attention/bench_decode_graph.py --smoke  # any device: the script's check

Without CUDA (``--smoke`` on the CPU) there is nothing to capture: ``graph`` rows are the eager steps again.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict

import torch

from common import run_metadata, write_results
from transformer_engine.pytorch import DotProductAttention, InferenceParams

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 64
WARMUP, CHECK, REPS = 5, 4, 100  # eager steps before capture, steps compared bitwise, timed steps


def _filled(layers, b, s, paged, dtype, device):
    """(params, modules): ``layers`` layers' caches holding ``s`` seeded random tokens for each of ``b``
    sequences (one prefill step through every layer): the same values for every call."""
    max_len = s + WARMUP + CHECK + 2 * REPS + 8
    max_len = -(-max_len // PAGE) * PAGE
    params = InferenceParams(b, max_len, KV_HEADS, DIM, dtype, device=device, is_paged=paged,
                             page_size=PAGE if paged else None)
    modules = []
    for layer in range(1, layers + 1):
        params.allocate_memory(layer)
        modules.append(DotProductAttention(HEADS, DIM, num_gqa_groups=KV_HEADS, qkv_format="thd",
                                           attn_mask_type="padding_causal", layer_number=layer).to(device).eval())
    params.pre_step(OrderedDict((i, s) for i in range(b)))
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(b * s, heads, DIM, device=device, dtype=dtype, generator=g)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    with torch.no_grad():
        for module in modules:
            module(q, k, v, inference_params=params)
    return params, modules


def case(layers, b, s, paged, dtype, device):
    """One case's rows (eager, graph)."""
    g = torch.Generator(device=device).manual_seed(11)
    q = torch.randn(b, HEADS, DIM, device=device, dtype=dtype, generator=g)
    k, v = torch.randn(2, b, KV_HEADS, DIM, device=device, dtype=dtype, generator=g)
    step_dict = OrderedDict((i, 1) for i in range(b))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(params, modules):
        with torch.no_grad():
            return [module(q, k, v, inference_params=params) for module in modules]

    eager_params, eager_modules = _filled(layers, b, s, paged, dtype, device)
    graph_params, graph_modules = _filled(layers, b, s, paged, dtype, device)

    def eager_step():
        eager_params.pre_step(step_dict)
        return run(eager_params, eager_modules)

    for _ in range(WARMUP):  # both caches the same steps: kernels compiled, decode plans kept
        eager_step()
        graph_params.pre_step(step_dict)
        run(graph_params, graph_modules)
    graph, outs = None, None
    if device.type == "cuda":
        graph_params.pre_step(step_dict)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run(graph_params, graph_modules)

    def graph_step(first=False):
        if graph is None:
            graph_params.pre_step(step_dict)
            return run(graph_params, graph_modules)
        if not first:  # the captured step's pre_step came before the capture
            graph_params.pre_step(step_dict)
        graph.replay()
        return outs

    bitwise = True
    for n in range(CHECK):
        want = eager_step()
        got = graph_step(first=n == 0)
        bitwise &= all(torch.equal(a, w) for a, w in zip(got, want))

    rows = []
    for name, step in (("eager", eager_step), ("graph", graph_step)):
        sync()
        start = time.perf_counter()
        for _ in range(REPS):
            step()
        host = (time.perf_counter() - start) / REPS
        sync()
        wall = (time.perf_counter() - start) / REPS
        rows.append(dict(layers=layers, batch=b, context=s, cache="paged" if paged else "contiguous", mode=name,
                         captured=graph is not None if name == "graph" else False, host_us=round(host * 1e6, 1),
                         host_us_per_token=round(host * 1e6 / b, 2), step_us=round(wall * 1e6, 1), bitwise=bitwise))
        print(rows[-1], flush=True)
    return rows


def main():
    global HEADS, KV_HEADS, DIM, PAGE, WARMUP, CHECK, REPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/decode_graph")
    ap.add_argument("--layers", default="1,8,32", help="layer counts, comma-separated")
    ap.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--smoke", action="store_true", help="a tiny grid on any device: the script's own check")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    layer_counts = [int(x) for x in args.layers.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    context = args.context
    if args.smoke:
        HEADS, KV_HEADS, DIM, PAGE = 4, 2, 16, 8
        WARMUP, CHECK, REPS = 1, 2, 2
        layer_counts, batches, context = [2], [3], 20
    rows = []
    for layers in layer_counts:
        for b in batches:
            for paged in (False, True):
                try:
                    rows += case(layers, b, context, paged, dtype, device)
                except Exception as err:  # a failing case is a row, the others still run
                    rows.append(dict(layers=layers, batch=b, context=context, cache="paged" if paged else "contiguous",
                                     error=f"{type(err).__name__}: {str(err)[:100]}"))
                    print(rows[-1], flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    write_results(args.out, run_metadata("python benchmarks/attention/bench_decode_graph.py " + " ".join(sys.argv[1:]),
                                         name, str(dtype).replace("torch.", ""), dry_run=args.smoke),
                  rows, ["layers", "batch", "context", "cache", "mode", "captured", "host_us", "host_us_per_token",
                         "step_us", "bitwise", "error"])


if __name__ == "__main__":
    main()
