"""Decode benchmark: one new token per sequence against a KV cache, ours (bitwise the training forward's rows)
next to torch SDPA's decode, flash-attn's ``flash_attn_with_kvcache`` and flash-attn-4's varlen forward
(``flash4``, ``flash4_paged``) where installed.

Run on the GPU machine: ``python benchmarks/attention/bench_decode.py --out benchmarks/results/decode``;
``--smoke`` runs a tiny grid on any device (the script's own check, not a measurement).

Per case (batch ``b``, context ``s`` cached tokens per sequence, 32 query heads, 8 kv heads, d 128 (``--dim``), bf16):
microseconds per decode step (mean of 100 after 20), tokens/s (``b`` per step) and the achieved bandwidth of
reading the cached keys and values (``2 * b * s * h_kv * d`` elements per step, the step's dominant traffic). ``ours`` is a whole
``DotProductAttention`` step with ``inference_params`` (the host work of ``pre_step`` and the cache append
included, as a serving loop runs it). ``bitwise`` (ours): sequence 0's output row is the same bits at batch 1
and at batch ``b``. ``ours_one_program``: the same step with split-KV off (where the plan sums keys in chunks, a
small grid splits them over programs: the same bits). ``--page-size P`` adds ``ours_paged``: the same step on a
paged cache (pages of P tokens handed out in a shuffled order), which the fused forward reads through the page
table in place (no gather); its ``bitwise``: sequence 0's row equals the non-paged cache's row at batch 1.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict

import torch

from common import counted_ms, run_metadata, write_results
from transformer_engine.common.attention import launch_description
from transformer_engine.pytorch import DotProductAttention, InferenceParams

HEADS, KV_HEADS, DIM = 32, 8, 128
WARMUP, REPS = 20, 100  # decode steps: ours appends one token per step, so a step count, not a time budget
GRID = [(b, s) for s in (1024, 8192, 32768, 131072) for b in (1, 16, 64, 256) if b * s <= 2 ** 22]
SMOKE_GRID = [(1, 40), (3, 70)]


def bench_ms(fn):
    """Mean ms per call over REPS calls after WARMUP, every backend timed alike."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    return counted_ms(fn, REPS, WARMUP, sync)


def _filled(b, s, dtype, device, layer=1, page_size=0):
    """InferenceParams holding ``s`` random tokens for each of ``b`` sequences (one prefill step), its module;
    ``page_size`` > 0: a paged cache whose pages are handed out in a shuffled order."""
    max_len = s + WARMUP + REPS + 8
    if page_size:
        max_len = -(-max_len // page_size) * page_size
        params = InferenceParams(b, max_len, KV_HEADS, DIM, dtype, device=device, is_paged=True, page_size=page_size)
        manager = params.cache_manager
        shuffled = torch.randperm(manager.total_num_pages, generator=torch.Generator().manual_seed(5))
        manager.free_pages = shuffled.tolist()
    else:
        params = InferenceParams(b, max_len, KV_HEADS, DIM, dtype, device=device)
    params.allocate_memory(layer)
    dpa = DotProductAttention(HEADS, DIM, num_gqa_groups=KV_HEADS, qkv_format="thd", attn_mask_type="padding_causal",
                              layer_number=layer).to(device).eval()
    chunk = max(1, 2 ** 20 // s)  # sequences per prefill call: at most ~1M tokens of queries at once

    def tokens(i, heads):  # sequence i's tokens: the same whatever the batch
        g = torch.Generator(device=device).manual_seed(1000 * i + heads)
        return torch.randn(s, heads, DIM, device=device, dtype=dtype, generator=g)

    for first in range(0, b, chunk):
        ids = list(range(first, min(b, first + chunk)))
        params.pre_step(OrderedDict((i, s) for i in ids))
        q, k, v = (torch.cat([tokens(i, heads) for i in ids]) for heads in (HEADS, KV_HEADS, KV_HEADS + 1))
        with torch.no_grad():
            dpa(q, k, v[:, :KV_HEADS], inference_params=params)
    return params, dpa


def ours(b, s, dtype, device, page_size=0):
    """The decode step of the b sequences of a filled cache (``page_size`` > 0: paged): (ms per step, bitwise,
    against the non-paged cache at batch 1). The cache starts ``WARMUP + REPS // 2`` tokens short of ``s`` so
    that the timed steps' contexts average ``s``."""
    s = max(1, s - WARMUP - REPS // 2)
    params, dpa = _filled(b, s, dtype, device, page_size=page_size)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(b, HEADS, DIM, device=device, dtype=dtype, generator=g)
    k, v = torch.randn(2, b, KV_HEADS, DIM, device=device, dtype=dtype, generator=g)
    step_dict = OrderedDict((i, 1) for i in range(b))

    def step():
        params.pre_step(step_dict)
        with torch.no_grad():
            return dpa(q, k, v, inference_params=params)

    # Invariance, on the first decode step: sequence 0's row alone equals its row in the batch.
    batched = step()
    params1, dpa1 = _filled(1, s, dtype, device)
    params1.pre_step(OrderedDict([(0, 1)]))
    with torch.no_grad():
        alone = dpa1(q[:1], k[:1], v[:1], inference_params=params1)
    del params1
    t_step = bench_ms(step)
    return t_step, bool(torch.equal(alone[0], batched[0]))


def sdpa(b, s, dtype, device, backend):
    from torch.nn.attention import sdpa_kernel

    g = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(b, HEADS, 1, DIM, device=device, dtype=dtype, generator=g)
    k, v = torch.randn(2, b, KV_HEADS, s + 1, DIM, device=device, dtype=dtype, generator=g)

    def step():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return bench_ms(step)


def flash_kvcache(b, s, dtype, device):
    from flash_attn import flash_attn_with_kvcache  # flash-attn 2/3's decode entry point

    g = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(b, 1, HEADS, DIM, device=device, dtype=dtype, generator=g)
    k_cache, v_cache = torch.randn(2, b, s + 256, KV_HEADS, DIM, device=device, dtype=dtype, generator=g)
    k, v = torch.randn(2, b, 1, KV_HEADS, DIM, device=device, dtype=dtype, generator=g)
    lens = torch.full((b,), s, dtype=torch.int32, device=device)
    return bench_ms(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True))


def flash4_decode(b, s, dtype, device, page_size=0):
    """flash-attn-4's varlen forward as a decode step (one query row per sequence, ``seqused_k`` lengths), with
    its split heuristic (``num_splits=0``: its fastest setting for decode; the bits then depend on the grid);
    ``page_size`` > 0: the cache as pages read through ``page_table``."""
    from flash_attn.cute import flash_attn_varlen_func

    g = torch.Generator(device=device).manual_seed(4)
    q = torch.randn(b, HEADS, DIM, device=device, dtype=dtype, generator=g)
    cu_q = torch.arange(b + 1, device=device, dtype=torch.int32)
    lens = torch.full((b,), s + 1, dtype=torch.int32, device=device)
    options = dict(cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=lens, causal=True, num_splits=0)
    if page_size:
        pages = -(-(s + 1) // page_size)
        k, v = torch.randn(2, b * pages, page_size, KV_HEADS, DIM, device=device, dtype=dtype, generator=g)
        options["page_table"] = torch.randperm(b * pages, device=device, generator=g).to(torch.int32).view(b, pages)
    else:
        k, v = torch.randn(2, b, s + 1, KV_HEADS, DIM, device=device, dtype=dtype, generator=g)
    return bench_ms(lambda: flash_attn_varlen_func(q, k, v, **options))


def main():
    global DIM
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/decode")
    ap.add_argument("--smoke", action="store_true", help="a tiny grid, any device: the script's own check")
    ap.add_argument("--dim", type=int, default=128, help="head dim (64: the Triton forward, whose keys are summed "
                    "in chunks, on every GPU: split-KV decode)")
    ap.add_argument("--grid", default=None, help="cases as b:s,b:s (default: the full grid)")
    ap.add_argument("--no-peers", action="store_true", help="ours only")
    ap.add_argument("--page-size", type=int, default=0, help="also ours_paged: a paged cache of pages of this many "
                    "tokens, read through the page table")
    args = ap.parse_args()
    DIM = args.dim
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = SMOKE_GRID if args.smoke else GRID
    if args.grid:
        grid = [tuple(int(x) for x in case.split(":")) for case in args.grid.split(",")]
    if args.smoke:
        global WARMUP, REPS
        WARMUP, REPS = 1, 2
    from torch.nn.attention import SDPBackend

    peers = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_efficient": SDPBackend.EFFICIENT_ATTENTION,
             "torch_cudnn": SDPBackend.CUDNN_ATTENTION, "torch_math": SDPBackend.MATH}
    rows = []
    for b, s in grid:
        bytes_kv = 2 * b * s * KV_HEADS * DIM * torch.finfo(dtype).bits // 8

        def row(name, ms, **extra):
            r = dict(batch=b, context=s, backend=name, us=round(ms * 1e3, 1), tokens_per_s=round(b / ms * 1e3),
                     gb_per_s=round(bytes_kv / ms / 1e6, 1), **extra)
            print(r, flush=True)
            rows.append(r)

        # ours_one_program: split-KV off (one program per row block over every key: the same bits, fewer programs)
        for name, split_programs in (("ours", launch_description.SPLIT_KV_PROGRAMS), ("ours_one_program", 0)):
            saved, launch_description.SPLIT_KV_PROGRAMS = launch_description.SPLIT_KV_PROGRAMS, split_programs
            try:
                t_step, bitwise = ours(b, s, dtype, device)
                row(name, t_step, bitwise=bitwise)
            except Exception as err:
                rows.append(dict(batch=b, context=s, backend=name, error=f"{type(err).__name__}: {str(err)[:80]}"))
            finally:
                launch_description.SPLIT_KV_PROGRAMS = saved
        if args.page_size:
            try:
                t_step, bitwise = ours(b, s, dtype, device, page_size=args.page_size)
                row("ours_paged", t_step, bitwise=bitwise, page_size=args.page_size)
            except Exception as err:
                rows.append(dict(batch=b, context=s, backend="ours_paged",
                                 error=f"{type(err).__name__}: {str(err)[:80]}"))
        if args.no_peers:
            continue
        for name, backend in peers.items():
            if device.type == "cpu" and name != "torch_math":
                continue
            try:
                row(name, sdpa(b, s, dtype, device, backend))
            except Exception as err:
                rows.append(dict(batch=b, context=s, backend=name, error=f"{type(err).__name__}: {str(err)[:80]}"))
        if device.type == "cuda":
            try:
                row("flash_attn_kvcache", flash_kvcache(b, s, dtype, device))
            except ImportError:
                pass
            except Exception as err:
                rows.append(dict(batch=b, context=s, backend="flash_attn_kvcache",
                                 error=f"{type(err).__name__}: {str(err)[:80]}"))
            for name, page_size in (("flash4", 0), ("flash4_paged", args.page_size)):
                if name == "flash4_paged" and not page_size:
                    continue
                try:
                    row(name, flash4_decode(b, s, dtype, device, page_size))
                except ImportError:
                    break
                except Exception as err:
                    rows.append(dict(batch=b, context=s, backend=name, error=f"{type(err).__name__}: {str(err)[:80]}"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    write_results(args.out, run_metadata("python benchmarks/attention/bench_decode.py " + " ".join(sys.argv[1:]),
                                         name, str(dtype).replace("torch.", ""), dry_run=args.smoke),
                  rows, ["batch", "context", "backend", "us", "tokens_per_s", "gb_per_s", "bitwise", "error"])


if __name__ == "__main__":
    main()
