"""Tensor-parallel heads (Megatron layout): each rank runs DotProductAttention on its slice of the
query and key/value heads (tp_size/tp_group); gathered outputs and gradients must equal the
single-process run bitwise in deterministic mode.

Run: torchrun --nproc_per_node=2 tests/pytorch/distributed/tp_attention.py   (NCCL on GPUs, gloo on CPU)
Exit status 0 when every check passed; rank 0 prints one line per check.
"""

from __future__ import annotations

import os
import sys

# NVLink multicast stays off on the shared GPU hosts (device README).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from transformer_engine.pytorch import DotProductAttention  # noqa: E402

CASES = [  # (qkv_format, mask, heads, kv heads)
    ("bshd", "causal", 8, 8),
    ("bshd", "no_mask", 8, 2),
    ("sbhd", "causal", 4, 2),
]


def _inputs(fmt, h, hk, device, dtype):
    g = torch.Generator().manual_seed(1234)
    b, s, d = 2, 64, 32
    shape = (b, s) if fmt == "bshd" else (s, b)
    q = torch.randn(*shape, h, d, generator=g).to(device, dtype)
    k = torch.randn(*shape, hk, d, generator=g).to(device, dtype)
    v = torch.randn(*shape, hk, d, generator=g).to(device, dtype)
    d_out = torch.randn(*shape, h * d, generator=g).to(device, dtype)
    return q, k, v, d_out


def _run(dpa, q, k, v, d_out):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = dpa(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out.detach(), grads


def main() -> int:
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if on_gpu else torch.float16
    group = dist.new_group(list(range(world)))
    failures = 0
    for fmt, mask, h, hk in CASES:
        q, k, v, d_out = _inputs(fmt, h, hk, device, dtype)
        d = q.shape[-1]
        full = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type=mask)
        out_ref, grads_ref = _run(full, q, k, v, d_out)
        # This rank's heads: a contiguous slice of query heads and the kv heads they use.
        hl, hkl = h // world, hk // world
        qs, ks = slice(rank * hl, (rank + 1) * hl), slice(rank * hkl, (rank + 1) * hkl)
        d_out_local = d_out.unflatten(-1, (h, d))[..., qs, :].flatten(-2)
        local = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type=mask,
                                    tp_size=world, tp_group=group)
        out, grads = _run(local, q[..., qs, :].contiguous(), k[..., ks, :].contiguous(), v[..., ks, :].contiguous(),
                          d_out_local.contiguous())
        checks = {
            "out": (out.unflatten(-1, (hl, d)), out_ref.unflatten(-1, (h, d))[..., qs, :]),
            "dq": (grads[0], grads_ref[0][..., qs, :]),
            "dk": (grads[1], grads_ref[1][..., ks, :]),
            "dv": (grads[2], grads_ref[2][..., ks, :]),
        }
        ok = {name: torch.equal(a, b) for name, (a, b) in checks.items()}
        flags = torch.tensor([int(all(ok.values()))], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        passed = bool(flags.item())
        failures += not passed
        if rank == 0:
            print(f"{'PASS' if passed else 'FAIL'} tp={world} {fmt} {mask} h={h} h_kv={hk} backend={local.last_backend} "
                  + " ".join(f"{n}={'eq' if e else 'DIFF'}" for n, e in ok.items()), flush=True)
    dist.barrier()  # every rank is done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
