"""Core benchmark: our fused attention (deterministic and not) next to torch SDPA peers.

Run on the GPU machine: ``python benchmarks/attention/bench_core.py --out benchmarks/results/core``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cases import attn_flops
from common import bench_ms, grads_repeat_bitwise, peak_memory_gb, run_metadata, write_results
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

GRID = [
    (4, 16, 4096, 128, False), (4, 16, 4096, 128, True),
    (1, 16, 16384, 128, False), (1, 16, 16384, 128, True),
    (8, 32, 2048, 64, False), (8, 32, 2048, 64, True),
    (2, 16, 4096, 256, True),
]


def ours(deterministic):
    def make(q, k, v, causal):
        mask = "causal" if causal else "no_mask"
        return lambda: fused_attn_func(q, k, v, "bshd", mask, (-1, -1), q.shape[-1] ** -0.5,
                                       deterministic=deterministic)
    return make


def dpa(max_logit):
    """DotProductAttention in deterministic mode on the fused kernels, with or without return_max_logit (QK-clip):
    the pair's ratio is the max logit's cost (target: within 3%)."""
    def make(q, k, v, causal):
        os.environ.update(NVTE_ALLOW_NONDETERMINISTIC_ALGO="0", NVTE_FLASH_ATTN="0")
        module = DotProductAttention(q.shape[2], q.shape[-1], qkv_format="bshd",
                                     attn_mask_type="causal" if causal else "no_mask",
                                     return_max_logit=max_logit).cuda()
        if max_logit:
            return lambda: module(q, k, v)[0]
        return lambda: module(q, k, v)
    return make


def sdpa(backend, deterministic=False):
    def make(q, k, v, causal):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        def f():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        return f
    make.torch_deterministic = deterministic  # the flag must hold through the backward too
    return make


PEERS = {
    "ours_det": ours(True),
    "ours_nondet": ours(False),
    "torch_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    "torch_flash_det": sdpa(SDPBackend.FLASH_ATTENTION, True),
    "torch_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    "dpa_det": dpa(False),
    "dpa_det_max_logit": dpa(True),
}


def measure(name, make, b, h, s, d, causal):
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    fn = make(q, k, v, causal)
    torch.use_deterministic_algorithms(getattr(make, "torch_deterministic", False))
    try:
        with torch.no_grad():
            t_fwd = bench_ms(fn)
        def step():
            fn().backward(do)
        t_all = bench_ms(step, grad_to_none=[q, k, v])
        mem = peak_memory_gb(step)
        def grads():
            q.grad = k.grad = v.grad = None
            step()
            return (q.grad, k.grad, v.grad)
        det = grads_repeat_bitwise(grads)
    except Exception as err:  # a peer that cannot run this shape is reported, not fatal
        return {"backend": name, "error": f"{type(err).__name__}: {str(err)[:80]}"}
    finally:
        torch.use_deterministic_algorithms(False)
    return {
        "backend": name,
        "fwd_tflops": round(attn_flops(b, h, s, s, d, causal, "fwd") / t_fwd / 1e9, 1),
        "fwd_bwd_tflops": round(attn_flops(b, h, s, s, d, causal, "fwd_bwd") / t_all / 1e9, 1),
        "peak_gb": round(mem, 2),
        "bitwise": det,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/core")
    ap.add_argument("--peers", default=",".join(PEERS))
    args = ap.parse_args()
    rows = []
    for (b, h, s, d, causal) in GRID:
        for name in args.peers.split(","):
            r = measure(name, PEERS[name], b, h, s, d, causal)
            r.update(shape=f"{b},{h},{s},{d}", mask="causal" if causal else "none")
            print(r, flush=True)
            rows.append(r)
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_results(args.out, run_metadata("python benchmarks/attention/bench_core.py " + " ".join(sys.argv[1:]), device),
                  rows, ["shape", "mask", "backend", "fwd_tflops", "fwd_bwd_tflops", "peak_gb", "bitwise", "error"])


if __name__ == "__main__":
    main()
