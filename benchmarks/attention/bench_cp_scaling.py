"""Context parallelism across GPUs: fwd+bwd of DotProductAttention with ``cp_group`` over every rank (one
process per GPU, NCCL), against one GPU holding the whole sequence (the same total tokens), in deterministic
mode, with the CP results checked bitwise against the one-GPU call.

    torchrun --standalone --nproc_per_node=N benchmarks/attention/bench_cp_scaling.py \\
        [--seqlens 32768 131072] [--comms p2p all_gather a2a a2a+p2p] [--out FILE] [--trace DIR]

Per row: the one-GPU step (rank 0 alone, the others wait), the CP step (the slowest rank's time: every rank
runs the same number of steps between barriers), speedup = one GPU / CP, per-GPU efficiency = speedup / N,
and whether the gathered CP outputs and gradients equal the one-GPU call's bitwise. ``--trace DIR`` writes one
profiler trace per rank and comm type (chrome://tracing, Perfetto): the exchanges beside the attention kernels
show what overlaps. ``--dry-run`` (CPU: gloo, TRITON_INTERPRET=1) runs tiny shapes once each to check the
harness.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the shared GPU hosts
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmark's own modules

from cases import attn_flops  # noqa: E402
from common import counted_ms, cp_scaling_parser, run_metadata  # noqa: E402
from transformer_engine.common.attention import QKVFormat  # noqa: E402
from transformer_engine.pytorch import DotProductAttention  # noqa: E402
from transformer_engine.pytorch.attention.context_parallel import SeqSplit, assemble, local_tokens  # noqa: E402

COMMS = ("p2p", "all_gather", "a2a", "a2a+p2p")


def groups(comm: str, world: int):
    """``cp_group`` for ``comm``: every rank; for a2a+p2p, a2a over consecutive rank pairs and p2p across
    them, so a rank's place in the load-balanced split is its world rank."""
    if comm != "a2a+p2p":
        return dist.group.WORLD
    rank = dist.get_rank()
    a2a = p2p = None
    for i in range(world // 2):  # every rank creates every group, in the same order
        g = dist.new_group([2 * i, 2 * i + 1])
        if rank // 2 == i:
            a2a = g
    for j in range(2):
        g = dist.new_group(list(range(j, world, 2)))
        if rank % 2 == j:
            p2p = g
    return [a2a, p2p]


def step(module, q, k, v, d_out):
    """One fwd+bwd: (out, dq, dk, dv)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = module(*leaves)
    return (out.detach(),) + torch.autograd.grad(out, leaves, d_out)


def slowest_ms(fn, iters: int, warmup: int, sync, device) -> float:
    """:func:`counted_ms` on every rank from a common start (the same counts everywhere: collectives inside
    ``fn`` stay matched), the slowest rank's time."""
    for _ in range(warmup):
        fn()
    sync()
    dist.barrier()
    ms = torch.tensor([counted_ms(fn, iters, 0, sync)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms.item())


def main(argv=None) -> int:
    args = cp_scaling_parser(__doc__.splitlines()[0], "comms", COMMS).parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.dry_run
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if on_gpu else torch.float16
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if args.dry_run:
        args.seqlens, args.heads, args.kv_heads, args.head_dim, args.iters = [64], 4, 4, 16, 1
    warmup = 0 if args.dry_run else 3
    causal = not args.no_causal
    mask = "causal" if causal else "no_mask"
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    rows = []
    if rank == 0:
        print("| s | cp | comm | one GPU ms | CP ms | speedup | per-GPU efficiency | bitwise vs one GPU | backend |")
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for s in args.seqlens:
        g = torch.Generator().manual_seed(s)
        q, k, v, d_out = (torch.randn(1, s, heads, d, generator=g).to(device, dtype)
                          for heads in (h, hk, hk, h))
        d_out = d_out.reshape(1, s, h * d)
        single = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd", attn_mask_type=mask)
        want, one_gpu = None, torch.zeros(1, dtype=torch.float64, device=device)
        if rank == 0:  # one GPU, the whole sequence; the other ranks wait
            want = step(single, q, k, v, d_out)
            one_gpu[0] = counted_ms(lambda: step(single, q, k, v, d_out), args.iters, warmup, sync)
        dist.broadcast(one_gpu, 0)
        one_ms = float(one_gpu.item())
        split = SeqSplit(QKVFormat.BSHD, world, rank, seqlen=s)
        local = [local_tokens(t, 1, split) for t in (q, k, v, d_out)]
        for comm in args.comms:
            if comm == "a2a+p2p" and (world < 4 or world % 2):
                continue
            a2a_size = world if comm == "a2a" else 2  # the ranks the heads are split over
            if comm.startswith("a2a") and (h % a2a_size or hk % a2a_size):
                continue
            module = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd", attn_mask_type=mask,
                                         cp_group=groups(comm, world), cp_comm_type=comm)
            got = step(module, *local)
            gathered = []
            for t in got:  # every rank's tokens, in rank order, then in global order
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t.contiguous())
                gathered.append(assemble(parts, 1, split))
            bitwise = torch.tensor([1], device=device)
            if rank == 0:
                bitwise[0] = int(all(torch.equal(a, b) for a, b in zip(gathered, want)))
            dist.broadcast(bitwise, 0)
            cp_ms = slowest_ms(lambda: step(module, *local), args.iters, warmup, sync, device)
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                with torch.profiler.profile() as prof:
                    step(module, *local)
                    sync()
                prof.export_chrome_trace(os.path.join(args.trace, f"cp{world}_{comm}_s{s}_rank{rank}.json"))
            row = dict(s=s, cp=world, comm=comm, heads=h, kv_heads=hk, head_dim=d, causal=causal,
                       one_gpu_ms=one_ms, cp_ms=cp_ms, speedup=one_ms / cp_ms, efficiency=one_ms / cp_ms / world,
                       one_gpu_tflops=attn_flops(1, h, s, s, d, causal, "fwd_bwd") / one_ms * 1e-9,
                       cp_tflops_per_gpu=attn_flops(1, h, s, s, d, causal, "fwd_bwd") / cp_ms / world * 1e-9,
                       bitwise=bool(bitwise.item()), backend=module.last_backend)
            rows.append(row)
            if rank == 0:
                print(f"| {s} | {world} | {comm} | {one_ms:.2f} | {cp_ms:.2f} | {row['speedup']:.2f} | "
                      f"{row['efficiency']:.2f} | {row['bitwise']} | {row['backend']} |", flush=True)
    if rank == 0 and args.out:
        name = torch.cuda.get_device_name() if on_gpu else "cpu"
        with open(args.out, "w") as f:
            json.dump(dict(meta=run_metadata(" ".join(sys.argv), name, str(dtype)[6:], args.dry_run), rows=rows),
                      f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
