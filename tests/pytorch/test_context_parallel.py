"""Context parallelism: outputs and gradients bitwise equal to the single-process whole-sequence call.

Multi-process checks run tests/pytorch/distributed/cp_attention.py through torchrun (gloo on the CPU, NCCL
with a GPU per rank); the per-rank steps also run in one process (every rank's step on one device, the
exchanges as tensor copies). Unfused suites force the unfused backend; fused suites need the Triton
interpreter (or GPUs).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from case_grid import WIDE
from torch.utils._python_dispatch import TorchDispatchMode

from dpa_helpers import INTERPRET, ON_GPU, requires_fused
from transformer_engine.common.attention import QKVFormat
from transformer_engine.common.attention.context_parallel import LoadBalance
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention.context_parallel import (
    SeqSplit, _split_of, assemble, check_context_parallel_args, local_tokens,
)
from te_torch_testing import run_ranks_in_one_process

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "distributed", "cp_attention.py")


def _rank_tokens(starts_lengths, cp, rank):
    """Megatron's get_batch_on_this_cp_rank, written out: chunks rank and 2cp-1-rank of each sequence."""
    out = []
    for start, length in starts_lengths:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_matches_megatron_layout(cp):
    padded = (16 * cp, 8 * cp, 24 * cp)
    starts = (0, padded[0], padded[0] + padded[1])
    thd = SeqSplit(QKVFormat.THD, cp, 0, starts=starts, padded=padded, lengths=padded)
    bshd = SeqSplit(QKVFormat.BSHD, cp, 0, seqlen=8 * cp)
    for r in range(cp):
        assert thd.with_rank(r).token_index().tolist() == _rank_tokens(zip(starts, padded), cp, r)
        assert bshd.with_rank(r).token_index().tolist() == _rank_tokens([(0, 8 * cp)], cp, r)
    x = torch.randn(sum(padded), 3)
    parts = [x[thd.with_rank(r).token_index()] for r in range(cp)]
    assert torch.equal(assemble(parts, 0, thd), x)


def _striped_tokens(total, cp, rank, stripe):
    """JAX's reorder_causal_load_balancing(ReorderStrategy.Striped), written out: stripes t with t % cp == rank."""
    return [t for t in range(total) if (t // stripe) % cp == rank]


@pytest.mark.parametrize("cp,stripe", [(1, 4), (2, 1), (2, 4), (4, 2), (4, 3)])
def test_striped_split_deals_stripes_round_robin(cp, stripe):
    """cp_stripe_size: bshd stripes of the sequence, thd of the packed row (padding included); ``assemble``
    puts every rank's tokens back in global order; an a2a group's tokens are the p2p group's split with stripes
    a2a size times longer (what "a2a+p2p" relies on)."""
    s = 6 * cp * stripe
    padded, lengths = (2 * cp * stripe, 4 * cp * stripe), (2 * cp * stripe - 1, 3 * cp * stripe)
    striped = dict(balance=LoadBalance.STRIPED, rounds=6)
    bshd = SeqSplit(QKVFormat.BSHD, cp, 0, seqlen=s, **striped)
    thd = SeqSplit(QKVFormat.THD, cp, 0, starts=(0, padded[0]), padded=padded, lengths=lengths, **striped)
    for split in (bshd, thd):
        for r in range(cp):
            assert split.with_rank(r).token_index().tolist() == _striped_tokens(s, cp, r, stripe)
        x = torch.randn(s, 3)
        parts = [local_tokens(x, 0, split.with_rank(r)) for r in range(cp)]
        assert torch.equal(assemble(parts, 0, split), x)
    if cp == 4:  # a2a groups of 2 ranks: p2p rank p holds the tokens of ranks 2p and 2p + 1
        coarse = SeqSplit(QKVFormat.BSHD, 2, 0, seqlen=s, **striped)
        for p in range(2):
            group = sorted(t for r in (2 * p, 2 * p + 1) for t in bshd.with_rank(r).token_index().tolist())
            assert coarse.with_rank(p).token_index().tolist() == group == _striped_tokens(s, 2, p, 2 * stripe)


class _Seqs:
    def __init__(self, cu, cu_padded):
        self.cu_seqlens_q = self.cu_seqlens_kv = cu
        self.cu_seqlens_q_padded = self.cu_seqlens_kv_padded = cu_padded


def test_striped_order_is_refused_by_name_when_malformed():
    for bad in (0, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match=r"`cp_stripe_size` must be None \(the dual-chunk order\) or a positive "
                                             rf"int \(the Striped order\), got {bad!r}"):
            check_context_parallel_args(None, None, None, "p2p", bad)
    x = torch.zeros(1, 12, 2, 16)
    with pytest.raises(ValueError, match="`query_layer` must hold whole stripes of cp_stripe_size=5 tokens"):
        _split_of(QKVFormat.BSHD, x, x, 2, 0, None, 5)
    split = _split_of(QKVFormat.BSHD, x, x, 2, 1, None, 3)
    assert (split.balance, split.rounds, split.slots, split.chunk_len()) == (LoadBalance.STRIPED, 4, (1, 3, 5, 7), 3)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    t = torch.zeros(12, 2, 16)
    with pytest.raises(ValueError, match="`cu_seqlens_q` must give a packed total divisible by cp_size \\* "
                                         "cp_stripe_size = 10 \\(the Striped order of the packed row\\), got 24"):
        _split_of(QKVFormat.THD, t, t, 2, 0, _Seqs(cu, None), 5)
    split = _split_of(QKVFormat.THD, t, t, 2, 0, _Seqs(cu, None), 3)  # 10 and 14 tokens: no 2 * cp multiple needed
    assert split.packed and split.rounds == 4 and split.token_index().tolist() == _striped_tokens(24, 2, 0, 3)
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    assert not _split_of(QKVFormat.THD, t, t, 2, 0, _Seqs(cu, None), None).packed  # the default: dual chunks


class _IndexOps(TorchDispatchMode):
    """Records the aten ops that select tokens through an index tensor."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "index" in str(func):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fmt, dim", [(QKVFormat.BSHD, 1), (QKVFormat.SBHD, 0)])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_padded_formats_move_whole_chunks(cp, fmt, dim):
    """Padded formats gather and split by chunks: no index tensor, so nothing is copied from the host to the
    device (a pageable copy there would wait for the stream at every CP call)."""
    split = SeqSplit(fmt, cp, 0, seqlen=8 * cp)
    x = torch.randn((2, 8 * cp, 3) if dim == 1 else (8 * cp, 2, 3))
    with _IndexOps() as mode:
        parts = [local_tokens(x, dim, split.with_rank(r)) for r in range(cp)]
        whole = assemble(parts, dim, split)
    assert mode.ops == []
    assert torch.equal(whole, x)
    for r in range(cp):
        assert torch.equal(parts[r], x.index_select(dim, split.with_rank(r).token_index()))


def test_bad_cp_comm_type_is_refused_at_construction():
    with pytest.raises(ValueError,
                       match="`cp_comm_type` must be one of 'p2p', 'all_gather', 'a2a', 'a2a\\+p2p', got 'ring'"):
        DotProductAttention(2, 16, cp_comm_type="ring")
    with pytest.raises(ValueError, match="`cp_group` must be given with `cp_global_ranks`"):
        check_context_parallel_args(None, [0, 1], None, "p2p")


def test_no_group_is_the_plain_call():
    """cp_group=None (and cp size 1) take the single-device path: same bits as a module without CP."""
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    plain = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal")
    off = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal", cp_group=None, cp_comm_type="a2a")
    assert off._context_parallel is None
    assert torch.equal(plain(q, k, v), off(q, k, v))


# One process, every rank: the fused per-rank steps against the single call (fused_attn_func), bitwise.
ONE_PROCESS = [  # (fmt, causal, cp, s or (lengths, padded), batch, dtype)
    ("sbhd", False, 2, 64, 1, torch.float16),
    ("bshd", True, 2, 40, 1, torch.float16),  # 10-token chunks: not a multiple of the 16-row tiles
    ("thd", False, 2, ((40, 29), (48, 32)), 1, torch.float32),
    ("bshd", True, 1, 64, 2, torch.float16),  # one rank: every token in order
    ("bshd", False, 2, 64, 2, torch.float32),
    ("sbhd", True, 2, 64, 2, torch.float16),
    ("thd", True, 2, ((64, 29), (64, 32)), 1, torch.float16),
]


@requires_fused
@pytest.mark.parametrize("fmt,causal,cp,size,batch,dtype", ONE_PROCESS, ids=lambda x: str(x))
def test_one_process_ranks_match_single_call_bitwise(fmt, causal, cp, size, batch, dtype):
    from fused_helpers import DEVICE
    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

    g = torch.Generator().manual_seed(7)
    h, hk, d = 2, 1, 16
    kwargs, extra = {}, {}
    if fmt == "thd":
        lengths, padded = size
        cu = torch.tensor([0, lengths[0], lengths[0] + lengths[1]], dtype=torch.int32, device=DEVICE)
        cup = torch.tensor([0, padded[0], padded[0] + padded[1]], dtype=torch.int32, device=DEVICE)
        lead = (sum(padded),)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup)
        extra = dict(cu_seqlens=cu, cu_seqlens_padded=cup)
        mask = "padding_causal" if causal else "padding"
    else:
        lead = (batch, size) if fmt == "bshd" else (size, batch)
        mask = "causal" if causal else "no_mask"
    q, k, v, d_out = (torch.randn(*lead, hh, d, generator=g).to(DEVICE, dtype) for hh in (h, hk, hk, h))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused_attn_func(*leaves, fmt, mask, None, d ** -0.5, deterministic=True, **kwargs)
    want = (out,) + torch.autograd.grad(out, leaves, d_out)
    got = run_ranks_in_one_process(q, k, v, d_out, fmt, cp, causal, d ** -0.5, **extra)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max().item()}"


# The Striped order (cp_stripe_size) in one process: (fmt, causal, cp, s or (lengths, padded), stripe, dtype);
# stripes off the interpreter's 16-row tiles (calls with lead rows), thd over the packed row with padding.
ONE_PROCESS_STRIPED = [
    ("bshd", True, 2, 48, 4, torch.float16),
    ("bshd", True, 4, 48, 3, torch.float32),
    ("sbhd", False, 2, 64, 8, torch.float32),
    ("thd", True, 2, ((29, 30, 10), (32, 40, 16)), 4, torch.float32),
    ("thd", True, 4, ((29, 30, 10), (32, 40, 16)), 11, torch.float16),
    ("thd", False, 2, ((29, 30, 10), (32, 40, 16)), 11, torch.float32),
]


@requires_fused
@pytest.mark.parametrize("fmt,causal,cp,size,stripe,dtype", ONE_PROCESS_STRIPED, ids=lambda x: str(x))
def test_one_process_striped_ranks_match_single_call_bitwise(fmt, causal, cp, size, stripe, dtype):
    """Every rank's steps with the ranks holding the Striped order's stripes: out, dq, dk, dv bitwise the single
    call's (cp = 1). Repeats: the multi-process striped suites."""
    from fused_helpers import DEVICE
    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

    g = torch.Generator().manual_seed(5)
    h, hk, d = 2, 1, 16
    kwargs, extra = {}, {}
    if fmt == "thd":
        lengths, padded = size
        cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device=DEVICE)
        cup = torch.tensor([0] + [sum(padded[:i + 1]) for i in range(len(padded))], dtype=torch.int32, device=DEVICE)
        lead = (sum(padded),)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup)
        extra = dict(cu_seqlens=cu, cu_seqlens_padded=cup)
        mask = "padding_causal" if causal else "padding"
    else:
        lead = (1, size) if fmt == "bshd" else (size, 1)
        mask = "causal" if causal else "no_mask"
    q, k, v, d_out = (torch.randn(*lead, hh, d, generator=g).to(DEVICE, dtype) for hh in (h, hk, hk, h))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused_attn_func(*leaves, fmt, mask, None, d ** -0.5, deterministic=True, **kwargs)
    want = (out,) + torch.autograd.grad(out, leaves, d_out)
    got = run_ranks_in_one_process(q, k, v, d_out, fmt, cp, causal, d ** -0.5, stripe=stripe, **extra)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max().item()}"


# Multi-process suites (tests/pytorch/distributed/cp_attention.py): (suite, processes, backend).
SUITES = [("unfused2 errors", 2, "unfused"), ("unfused4 errors", 4, "unfused"), ("fused2", 2, "fused"),
          ("fused4", 4, "fused"), ("striped2", 2, "fused"), ("striped4", 4, "fused")]


def _launch(suites: str, nproc: int, backend: str):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(os.path.join(HERE, "..", "..")), env.get("PYTHONPATH", "")])
    if backend == "unfused":
        env["NVTE_FUSED_ATTN"] = "0"
        env["NVTE_FLASH_ATTN"] = "0"
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT,
           *suites.split()]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("suite,nproc,backend", SUITES, ids=[s[0].replace(" ", "+") for s in SUITES])
def test_context_parallel_matches_single_process_bitwise(suite, nproc, backend):
    if ON_GPU and torch.cuda.device_count() < nproc:
        pytest.skip(f"{torch.cuda.device_count()} GPU(s) visible: NCCL needs a GPU per rank ({nproc} ranks)")
    if backend == "fused" and not (ON_GPU or INTERPRET):
        pytest.skip("fused kernels need a GPU, or TRITON_INTERPRET=1 (CPU interpreter)")
    proc = _launch(suite, nproc, backend)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    passed = proc.returncode == 0 and lines and all(line.startswith("PASS") for line in lines)
    assert passed, "\n".join(lines) + "\n" + proc.stderr[-3000:]
    if backend == "fused":
        assert all("backend=FusedAttention" in line for line in lines), lines


@pytest.mark.skipif(ON_GPU, reason="the dry run is the CPU check of the benchmark's harness")
def test_benchmark_dry_run_is_bitwise():
    root = os.path.abspath(os.path.join(HERE, "..", ".."))
    bench = os.path.join(root, "benchmarks", "attention", "bench_context_parallel.py")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "benchmarks", "attention")]))
    proc = subprocess.run([sys.executable, bench, "--dry-run"], env=env, capture_output=True, text=True, timeout=300)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 64 |")]
    assert proc.returncode == 0 and len(rows) == 1 and all(r.rstrip().endswith("True |") for r in rows), \
        proc.stdout + proc.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="the dry run is the CPU check of the benchmark's harness")
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=WIDE)])  # the 4-rank kernels: fused4 above
def test_cp_scaling_benchmark_dry_run_is_bitwise(nproc, tmp_path):
    """benchmarks/attention/bench_cp_scaling.py over gloo: every comm type the rank count allows runs the fused
    kernels and gathers the one-GPU call's bits; its JSON and per-rank traces are written."""
    root = os.path.abspath(os.path.join(HERE, "..", ".."))
    bench = os.path.join(root, "benchmarks", "attention", "bench_cp_scaling.py")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    out, trace = tmp_path / "rows.json", tmp_path / "trace"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           bench, "--dry-run", "--out", str(out), "--trace", str(trace)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    comms = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if nproc >= 4 else [])
    assert [r["comm"] for r in rows] == comms and all(r["cp"] == nproc for r in rows)
    assert all(r["bitwise"] and r["backend"] == "FusedAttention" for r in rows), rows
    assert len(list(trace.iterdir())) == nproc * len(comms)


@requires_fused
# bshd: the preprocess (rowsum(dO * O)) once per rank, in its first call; thd: in each call.
@pytest.mark.parametrize("fmt,causal,preprocesses", [("bshd", True, 2), ("thd", False, 8)])
def test_backward_calls_run_one_gradient_pass_each(fmt, causal, preprocesses):
    """Each fused backward call of the per-rank steps runs the dQ pass or the dK/dV pass, not both (the
    partial backwards: about the single-device backward's work over the ranks, not twice it)."""
    from fused_helpers import DEVICE
    from te_torch_testing import recorded_launches

    g = torch.Generator().manual_seed(3)
    extra, lead = {}, (1, 32)
    if fmt == "thd":
        cu = torch.tensor([0, 24, 56], dtype=torch.int32, device=DEVICE)
        extra, lead = dict(cu_seqlens=cu, cu_seqlens_padded=cu), (56,)
    q, k, v, d_out = (torch.randn(*lead, 2, 16, generator=g).to(DEVICE, torch.float32) for _ in range(4))
    with recorded_launches() as recorded:
        run_ranks_in_one_process(q, k, v, d_out, fmt, 2, causal, 0.25, **extra)
    passes, pre = [], []
    for described in recorded:
        names = [x.name for x in described]
        grads = tuple(n for n in names if n.startswith(("attn_bwd_dq", "attn_bwd_dkdv")))
        if grads:
            passes.append(grads)
            pre.extend(n for n in names if n == "attn_bwd_preprocess_kernel")
    # Two ranks, two chunks each, one dQ-only and one dK/dV-only call per chunk.
    assert sorted(passes) == sorted([("attn_bwd_dq_kernel",), ("attn_bwd_dkdv_kernel",)] * 4), passes
    assert len(pre) == preprocesses
