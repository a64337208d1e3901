"""Context parallelism: every rank passes its part of the sequence (TransformerEngine's load-balanced split,
built here independently of the library); the gathered outputs and gradients must equal the
single-process whole-sequence call bitwise in deterministic mode, run after run, and be close to an fp64
reference. Bad inputs must raise clear errors.

Run: torchrun --nproc_per_node=N tests/pytorch/distributed/cp_attention.py SUITE...   (NCCL on GPUs, gloo on
CPU; the fused kernels need TRITON_INTERPRET=1 there). Suites: see SUITES. Exit status 0 when every check
passed; rank 0 prints one PASS/FAIL line per case.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from transformer_engine.pytorch import DotProductAttention  # noqa: E402


@dataclass(frozen=True)
class Case:
    fmt: str
    mask: str
    comm: str
    h: int = 2
    hk: int = 1
    d: int = 16
    s: int = 64  # bshd/sbhd global length
    b: int = 1
    lengths: Tuple[int, ...] = ()  # thd: real lengths
    padded: Tuple[int, ...] = ()  # thd: padded lengths (divisible by 2 * cp)
    dtype: str = "float32"
    reference: bool = True  # also compare with an fp64 reference (small shapes: it materialises s x s scores)
    stripe: Optional[int] = None  # the Striped order of such stripes (cp_stripe_size; thd: over the packed row)

    def __str__(self) -> str:
        if self.fmt == "thd":
            shape = f"lens={list(self.lengths)} padded={list(self.padded)}"
        else:
            shape = f"b={self.b} s={self.s}"
        order = f" striped={self.stripe}" if self.stripe is not None else ""
        return (f"{self.comm} {self.fmt} {self.mask} h={self.h} h_kv={self.hk} d={self.d} {shape} "
                f"{self.dtype}{order}")


# Suites: name -> cases. "unfused" runs without the interpreter; "fused" needs it (or a GPU).
SUITES = {
    "unfused2": [
        Case("bshd", "causal", "p2p", h=4, hk=2, b=2),
        Case("sbhd", "no_mask", "all_gather", h=2, hk=2),
        Case("thd", "padding_causal", "p2p", h=2, hk=1, lengths=(28, 13), padded=(32, 16)),
        Case("thd", "padding", "all_gather", h=2, hk=2, lengths=(32, 16), padded=(32, 16)),
        Case("bshd", "causal", "a2a", h=4, hk=2, b=2),
        Case("thd", "padding_causal", "a2a", h=2, hk=2, lengths=(29, 16), padded=(32, 16)),
        Case("bshd", "no_mask", "p2p", h=2, hk=1, reference=False),  # the GPU suites' bitwise-only check
        Case("thd", "padding_causal", "p2p", h=2, hk=1, lengths=(28, 13), padded=(32, 16), stripe=3),
    ],
    "unfused4": [
        Case("bshd", "causal", "p2p", h=4, hk=1, b=2, s=96),
        Case("sbhd", "causal", "all_gather", h=2, hk=2, s=64),
        Case("thd", "padding_causal", "p2p", h=2, hk=1, lengths=(45, 16), padded=(48, 16)),
        Case("bshd", "no_mask", "a2a", h=4, hk=4, s=64),
        Case("bshd", "causal", "a2a+p2p", h=4, hk=2, s=64),
        Case("bshd", "causal", "a2a+p2p", h=4, hk=2, s=64, stripe=2),
    ],
    # Fused kernels under the interpreter (16-row tiles): chunk lengths on them and (cp=4, s=64: 8-token
    # chunks) off them; the one-process tests of test_context_parallel.py cover sbhd and more shapes.
    "fused2": [
        Case("bshd", "causal", "p2p", h=2, hk=1, s=64, dtype="float16"),
        Case("thd", "padding_causal", "all_gather", h=2, hk=1, lengths=(60, 29), padded=(64, 32)),
        Case("bshd", "causal", "a2a", h=2, hk=2, s=64, dtype="float16"),
    ],
    "fused4": [
        Case("bshd", "causal", "p2p", h=2, hk=1, s=64),
        Case("bshd", "causal", "a2a+p2p", h=2, hk=2, s=64, dtype="float16"),
    ],
}
# GPUs only (NCCL, one rank per GPU; 2, 4 or 8 ranks): training shapes in bf16, every cp_comm_type and format,
# causal and not, GQA, up to 128k tokens per sequence; bitwise against the one-GPU call and over a repeat (the
# fp64 reference would need s x s scores). a2a splits the KV heads over the ranks: 8 of them.
_GPU = dict(h=16, d=128, dtype="bfloat16", reference=False)
SUITES["gpu"] = [
    Case("bshd", "causal", "p2p", hk=4, s=32768, **_GPU),
    Case("sbhd", "no_mask", "p2p", hk=4, s=16384, b=2, **_GPU),
    Case("bshd", "causal", "all_gather", hk=4, s=32768, **_GPU),
    Case("bshd", "causal", "a2a", hk=8, s=32768, **_GPU),
    Case("bshd", "causal", "a2a+p2p", hk=8, s=32768, **_GPU),
    Case("thd", "padding_causal", "p2p", hk=4, lengths=(30001, 2000, 523), padded=(30016, 2000, 528), **_GPU),
    Case("thd", "padding", "all_gather", hk=4, lengths=(16000, 9), padded=(16000, 16), **_GPU),
]
# The Striped order (set_context_parallel_group(..., cp_stripe_size=)): stripes dealt round-robin, thd over the
# packed row; stripes off the 16-row tiles (calls with lead rows) and, for a2a+p2p, a2a groups of two.
SUITES["striped2"] = [
    Case("bshd", "causal", "p2p", h=2, hk=1, s=64, dtype="float16", stripe=4),
    Case("thd", "padding_causal", "all_gather", h=2, hk=1, lengths=(37, 20, 7), padded=(40, 32, 8), stripe=4),
    Case("sbhd", "no_mask", "a2a", h=2, hk=2, s=48, stripe=8),
]
SUITES["striped4"] = [
    Case("bshd", "causal", "all_gather", h=2, hk=1, s=64, stripe=2),
    Case("thd", "padding_causal", "p2p", h=2, hk=1, lengths=(37, 20, 7), padded=(40, 32, 8), stripe=2),
    Case("bshd", "causal", "a2a+p2p", h=2, hk=2, s=64, dtype="float16", stripe=4),
]
SUITES["gpu"] += [
    Case("bshd", "causal", "p2p", hk=4, s=32768, stripe=128, **_GPU),
    Case("thd", "padding_causal", "all_gather", hk=4, lengths=(30001, 2000, 500), padded=(30720, 2048, 512),
         stripe=64, **_GPU),
]
SUITES["gpu128k"] = [Case("bshd", "causal", "p2p", hk=4, s=131072, **_GPU)]
ERROR_SUITE = "errors"


def rank_tokens(case: Case, cp: int, rank: int) -> torch.Tensor:
    """Global token positions of a rank's tokens: chunks rank and 2cp-1-rank of every sequence (Megatron's
    get_batch_on_this_cp_rank), or (``case.stripe``) the stripes t with t % cp == rank of the sequence (thd: of
    the packed row), as JAX's reorder_causal_load_balancing(ReorderStrategy.Striped)."""
    if case.stripe is not None:
        total = case.s if case.fmt != "thd" else sum(case.padded)
        return torch.tensor([t for t in range(total) if (t // case.stripe) % cp == rank], dtype=torch.int64)
    seqs = [(0, case.s)] if case.fmt != "thd" else []
    start = 0
    for p in case.padded:
        seqs.append((start, p))
        start += p
    out = []
    for start, length in seqs:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return torch.tensor(out, dtype=torch.int64)


def _cu(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def inputs(case: Case, device):
    g = torch.Generator().manual_seed(20240601)
    dtype = getattr(torch, case.dtype)
    if case.fmt == "thd":
        lead = (sum(case.padded),)
    else:
        lead = (case.b, case.s) if case.fmt == "bshd" else (case.s, case.b)
    q = torch.randn(*lead, case.h, case.d, generator=g)
    k = torch.randn(*lead, case.hk, case.d, generator=g)
    v = torch.randn(*lead, case.hk, case.d, generator=g)
    d_out = torch.randn(*lead, case.h * case.d, generator=g)
    if case.fmt == "thd":  # padding tokens hold garbage; their output and gradients must be zero
        real = torch.zeros(lead[0], dtype=torch.bool)
        start = 0
        for n, p in zip(case.lengths, case.padded):
            real[start:start + n] = True
            start += p
        d_out = torch.where(real[:, None], d_out, torch.zeros_like(d_out))
    return [t.to(device, dtype) for t in (q, k, v, d_out)]


def seq_kwargs(case: Case, device) -> dict:
    if case.fmt != "thd":
        return {}
    cu, cup = _cu(case.lengths).to(device), _cu(case.padded).to(device)
    return dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup)


def run(module, q, k, v, d_out, kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, d_out)
    return [out.detach()] + [g.detach() for g in grads]


def seq_dim(fmt: str) -> int:
    return 1 if fmt == "bshd" else 0


def gather_global(x: torch.Tensor, case: Case, cp: int, group) -> torch.Tensor:
    """The global tensor from every rank's tokens (all_gather, then placed by rank_tokens)."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    sd = seq_dim(case.fmt)
    index = torch.cat([rank_tokens(case, cp, r) for r in range(cp)]).to(x.device)
    shape = list(x.shape)
    shape[sd] = index.numel()
    out = x.new_zeros(shape)
    return out.index_copy(sd, index, torch.cat(parts, dim=sd))


def reference64(case: Case, q, k, v, d_out, kwargs):
    module = DotProductAttention(case.h, case.d, num_gqa_groups=case.hk, qkv_format=case.fmt, attn_mask_type=case.mask)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, d_out))
    from transformer_engine.pytorch.attention.unfused import unfused_attention

    leaves = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    out = unfused_attention(*leaves, case.fmt, case.mask, None, module.softmax_scale, **kwargs)
    out = out.reshape(*out.shape[:-2], -1)
    grads = torch.autograd.grad(out, leaves, do64)
    return [out] + list(grads)


def groups_for(case: Case, world: int):
    """(cp_group argument, cp size); a2a+p2p: a2a groups of consecutive rank pairs, p2p groups across them
    (TransformerEngine's test layout), so the rank's place in the split is its world rank."""
    if case.comm != "a2a+p2p":
        return dist.group.WORLD, world
    rank = dist.get_rank()
    a2a = p2p = None
    for i in range(world // 2):
        g = dist.new_group([2 * i, 2 * i + 1])
        if rank // 2 == i:
            a2a = g
    for j in range(2):
        g = dist.new_group(list(range(j, world, 2)))
        if rank % 2 == j:
            p2p = g
    return [a2a, p2p], world


def check_case(case: Case, device, world: int) -> Tuple[bool, str]:
    rank = dist.get_rank()
    q, k, v, d_out = inputs(case, device)
    kwargs = seq_kwargs(case, device)
    group, cp = groups_for(case, world)
    sd = seq_dim(case.fmt)
    idx = rank_tokens(case, cp, rank).to(device)
    local = [t.index_select(sd, idx) for t in (q, k, v, d_out)]
    if case.comm == "all_gather" or case.stripe is not None:  # TransformerEngine's method, after construction
        module = DotProductAttention(case.h, case.d, num_gqa_groups=case.hk, qkv_format=case.fmt,
                                     attn_mask_type=case.mask)
        module.set_context_parallel_group(group, None, None, case.comm, cp_stripe_size=case.stripe)
    else:
        module = DotProductAttention(case.h, case.d, num_gqa_groups=case.hk, qkv_format=case.fmt,
                                     attn_mask_type=case.mask, cp_group=group, cp_comm_type=case.comm)
    first = run(module, *local, kwargs)
    second = run(module, *local, kwargs)
    repeat_ok = all(torch.equal(a, b) for a, b in zip(first, second))
    gathered = [gather_global(t, case, cp, dist.group.WORLD) for t in first]
    names = ("out", "dq", "dk", "dv")
    detail = [f"backend={module.last_backend}", f"repeat={'eq' if repeat_ok else 'DIFF'}"]
    ok = repeat_ok
    if rank == 0:
        single = DotProductAttention(case.h, case.d, num_gqa_groups=case.hk, qkv_format=case.fmt,
                                     attn_mask_type=case.mask)
        want = run(single, q, k, v, d_out, kwargs)
        ref = reference64(case, q, k, v, d_out, kwargs) if case.reference else [None] * len(names)
        tol = 2e-2 if case.dtype == "float16" else 1e-4
        for name, got, w, r in zip(names, gathered, want, ref):
            eq = torch.equal(got, w)
            ok = ok and eq
            if r is None:
                detail.append(f"{name}={'eq' if eq else 'DIFF'}")
                continue
            err = (got.double() - r).abs().max().item()
            ok = ok and err <= tol
            detail.append(f"{name}={'eq' if eq else 'DIFF'}(err64={err:.1e})")
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item()), " ".join(detail)


def expect_error(kind, pattern: str, fn) -> Tuple[bool, str]:
    try:
        fn()
    except kind as e:
        return pattern in str(e), f"{kind.__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return False, f"wrong error {type(e).__name__}: {e}"
    return False, "no error"


def error_cases(device, world: int) -> List[Tuple[str, bool, str]]:
    results = []
    x = torch.randn(1, 7, 2, 16, device=device)  # odd local length: not two equal chunks
    m = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal", cp_group=dist.group.WORLD)
    results.append(("odd local sequence",) + expect_error(ValueError, "`query_layer` must hold two equal chunks",
                                                          lambda: m(x, x, x)))
    y = torch.randn(1, 8, 3, 16, device=device)
    m = DotProductAttention(3, 16, qkv_format="bshd", attn_mask_type="causal", cp_group=dist.group.WORLD,
                            cp_comm_type="a2a")
    results.append(("a2a heads",) + expect_error(ValueError, "`num_attention_heads`", lambda: m(y, y, y)))
    results.append(("comm type",) + expect_error(
        ValueError, "`cp_comm_type` must be one of",
        lambda: DotProductAttention(2, 16, cp_group=dist.group.WORLD, cp_comm_type="ring")))
    results.append(("a2a+p2p group",) + expect_error(
        ValueError, "`cp_group` must be a list of two process groups",
        lambda: DotProductAttention(2, 16, cp_group=dist.group.WORLD, cp_comm_type="a2a+p2p")))
    t = torch.randn(12 // world, 2, 16, device=device)
    cu = torch.tensor([0, 12], dtype=torch.int32, device=device)
    m = DotProductAttention(2, 16, qkv_format="thd", attn_mask_type="padding_causal", cp_group=dist.group.WORLD)
    need = 2 * world
    padded = torch.tensor([0, 12 if 12 % need else 10], dtype=torch.int32, device=device)
    results.append(("thd padded lengths",) + expect_error(
        ValueError, "`cu_seqlens_q_padded` must give every sequence a length divisible",
        lambda: m(t, t, t, cu_seqlens_q=padded, cu_seqlens_kv=padded, cu_seqlens_q_padded=padded,
                  cu_seqlens_kv_padded=padded)))
    z = torch.randn(1, 8, 2, 16, device=device)
    m = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal", cp_group=dist.group.WORLD,
                            window_size=(4, 0))
    results.append(("sliding window",) + expect_error(NotImplementedError, "sliding windows", lambda: m(z, z, z)))
    m = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal")
    m.set_context_parallel_group(dist.group.WORLD, None, None, "p2p", cp_stripe_size=3)
    results.append(("striped local length",) + expect_error(
        ValueError, "`query_layer` must hold whole stripes of cp_stripe_size=3 tokens", lambda: m(z, z, z)))
    results.append(("stripe size",) + expect_error(
        ValueError, "`cp_stripe_size` must be None (the dual-chunk order) or a positive int (the Striped order), got 0",
        lambda: m.set_context_parallel_group(dist.group.WORLD, None, None, "p2p", cp_stripe_size=0)))
    m = DotProductAttention(2, 16, qkv_format="thd", attn_mask_type="padding_causal")
    m.set_context_parallel_group(dist.group.WORLD, None, None, "p2p", cp_stripe_size=5)
    results.append(("striped thd total",) + expect_error(
        ValueError, "must give a packed total divisible by cp_size * cp_stripe_size",
        lambda: m(t, t, t, cu_seqlens_q=cu, cu_seqlens_kv=cu)))
    # A CP group of one rank is the plain single-device call.
    own = None
    for r in range(world):
        g = dist.new_group([r])
        if r == dist.get_rank():
            own = g
    w = torch.randn(1, 32, 2, 16, device=device)
    plain = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal")
    single = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal", cp_group=own)
    same = torch.equal(plain(w, w, w), single(w, w, w))
    results.append(("cp=1 group is the plain call", same, "equal" if same else "DIFF"))
    return results


def main(argv) -> int:
    suites = argv[1:] or ["unfused2"]
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    failures = 0
    for suite in suites:
        if suite == ERROR_SUITE:
            for name, ok, msg in error_cases(device, world):
                failures += not ok
                if rank == 0:
                    print(f"{'PASS' if ok else 'FAIL'} cp={world} error {name}: {msg}", flush=True)
            continue
        for case in SUITES[suite]:
            try:
                ok, detail = check_case(case, device, world)
            except Exception as e:  # noqa: BLE001  (reported, the other cases still run)
                ok, detail = False, f"{type(e).__name__}: {e}"
                import traceback

                traceback.print_exc()
            failures += not ok
            if rank == 0:
                print(f"{'PASS' if ok else 'FAIL'} cp={world} {case} {detail}", flush=True)
    dist.barrier()  # every rank is done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
