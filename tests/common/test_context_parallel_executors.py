"""The context-parallel executors run the common plan's calls (``RankPlan.calls``), counted with the
launches stubbed (no kernel runs; fast): PyTorch's per-rank steps (bshd/sbhd), JAX's per-rank steps
(BSHD: the calls, the unmasked ones of a pass as one launch; THD: one pseudo-sequence per segment and
call) over cp 2/4/8, causal and no mask, the dual-chunk, contiguous and Striped orders, and both
comm types (the ring and the all-gather only move the operands: the same calls). THD: the query and
key tokens each rank's calls keep fall as 1 / cp in both frameworks. Last, both frameworks side by side
on one sequence (cp 2/4/8, causal and no mask, BSHD in DualChunkSwap and THD from Striped input, ring
and all-gather): their work lists are equal, and are the plan's calls.
"""

from __future__ import annotations

import dataclasses

import pytest

from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.common.attention import context_parallel as cpp

CPS = (2, 4, 8)
COMMS = ("p2p", "all_gather")


def _torch():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from transformer_engine.pytorch.attention import context_parallel as tcp
    return torch, tcp


def _jax():
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    from transformer_engine.jax import context_parallel as jcp
    from transformer_engine.jax.enums import CPStrategy
    from transformer_engine.jax.primitives.attention import FusedAttnStatic
    return jax, jcp, CPStrategy, FusedAttnStatic


def _expected(plan, merge=False):
    """(pass, mask, own-side rows, other-side rows) of each launch of the plan (merged: the rank's rows)."""
    out = []
    for group in plan.launches(merge_unmasked=merge):
        c = group[0]
        rows = sum(x.chunk.end - x.chunk.start for x in group) if len(group) > 1 else c.length
        out.append((c.pass_, c.mask, rows, c.span[1] - c.span[0]))
    return out


# -- PyTorch ---------------------------------------------------------------------------------------------

ORDERS = [(cpp.LoadBalance.DUAL_CHUNK, 1), (cpp.LoadBalance.STRIPED, 1), (cpp.LoadBalance.STRIPED, 3)]


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("order", ORDERS, ids=["dual_chunk", "striped-1", "striped-3"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("cp", CPS)
def test_pytorch_steps_launch_the_plans_calls(cp, causal, order, comm, monkeypatch):
    """bshd: each launch is one of the plan's calls, in its order, for the dual-chunk order and the Striped
    one (``SeqSplit`` carries the balance and rounds; striped-3: three stripes per rank)."""
    torch, tcp = _torch()
    balance, rounds = order
    launched = []

    def forward(q, k, v, call, out=None, lse=None):
        launched.append((cpp.Pass.FORWARD, call.params.attn_mask_type, q.shape[1], k.shape[1]))
        return q.new_zeros(q.shape), q.new_zeros((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)

    def backward(q, k, v, out, d_out, lse, call, grads, dq=None, dk=None, dv=None, delta=None, preprocess=True):
        pass_ = cpp.Pass.DQ if grads.name == "DQ" else cpp.Pass.DKDV
        own, other = (q, k) if pass_ == cpp.Pass.DQ else (k, q)
        launched.append((pass_, call.params.attn_mask_type, own.shape[1], other.shape[1]))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None

    monkeypatch.setattr(tcp.kernel_runner, "forward", forward)
    monkeypatch.setattr(tcp.kernel_runner, "backward", backward)
    align, length = 16, 12  # chunks off the tiles: calls with lead rows
    s = cpp.num_chunks(cp, balance, rounds) * length
    spec = tcp.FusedSpec(0.25, causal, True, align)
    for rank in range(cp):
        split = tcp.SeqSplit(QKVFormat.BSHD, cp, rank, seqlen=s, balance=balance, rounds=rounds)
        plan = cpp.rank_plan(comm, cp, rank, s, causal, balance, align, rounds=rounds)
        assert tcp.rank_plan(split, spec, comm).calls == plan.calls
        assert split.token_index().tolist() == [c * length + i for c in cpp.rank_chunks(cp, rank, balance, rounds)
                                                for i in range(length)]
        launched.clear()
        local = lambda h: torch.zeros(1, s // cp, h, 8)  # noqa: E731
        glob = lambda h: torch.zeros(1, s, h, 8)  # noqa: E731
        tcp.fused_forward_step(local(2), glob(1), glob(1), split, spec)
        tcp.fused_backward_step(glob(2), glob(1), glob(1), glob(2), glob(2), torch.zeros(1, 2, s), split, spec)
        expected = [c for c in _expected(plan) if c[0] == cpp.Pass.FORWARD]
        expected += [c for c in _expected(plan) if c[0] != cpp.Pass.FORWARD]
        assert launched == expected, rank


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
def test_pytorch_thd_tokens_per_rank_fall_as_one_over_cp(causal, monkeypatch):
    """Each rank's thd calls keep 1 / cp of the query rows (forward, dQ) and of the key rows (dK/dV)."""
    torch, tcp = _torch()
    kept = {}

    def count(pass_, cu):
        lengths = cu[1:] - cu[:-1]
        kept[pass_] = kept.get(pass_, 0) + int(lengths.sum())

    def forward(q, k, v, call, out=None, lse=None):
        count(cpp.Pass.FORWARD, call.cu_seqlens_q)
        n = len(call.cu_seqlens_q) - 1
        return q.new_zeros(q.shape), q.new_zeros((n, q.shape[1], call.params.max_seqlen_q), dtype=torch.float32)

    def backward(q, k, v, out, d_out, lse, call, grads, dq=None, dk=None, dv=None, delta=None, preprocess=True):
        if grads.name == "DQ":
            count(cpp.Pass.DQ, call.cu_seqlens_q)
        else:
            count(cpp.Pass.DKDV, call.cu_seqlens_kv)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None

    monkeypatch.setattr(tcp.kernel_runner, "forward", forward)
    monkeypatch.setattr(tcp.kernel_runner, "backward", backward)
    lengths = (48, 96, 16, 80)  # unpadded: every token real
    total = sum(lengths)
    for cp in CPS:
        starts = tuple(sum(lengths[:i]) for i in range(len(lengths)))
        spec = tcp.FusedSpec(0.25, causal, True, 1)
        for rank in range(cp):
            kept.clear()
            split = tcp.SeqSplit(QKVFormat.THD, cp, rank, starts=starts, padded=lengths, lengths=lengths)
            tcp.fused_forward_step(torch.zeros(total // cp, 2, 8), torch.zeros(total, 1, 8), torch.zeros(total, 1, 8),
                                   split, spec)
            g = torch.zeros(total, 2, 8)
            tcp.fused_backward_step(g, torch.zeros(total, 1, 8), torch.zeros(total, 1, 8), g, g,
                                    torch.zeros(2, total), split, spec)
            assert kept == {p: total // cp for p in cpp.Pass}, (cp, rank, kept)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("cp,stripe,align", [(2, 5, 1), (4, 2, 1), (8, 1, 1), (2, 5, 4), (4, 5, 8)])
def test_pytorch_thd_striped_launches_cut_the_plans_calls_and_cover_each_pass_once(cp, stripe, align, causal,
                                                                                    monkeypatch):
    """thd in the Striped order (over the packed row): a rank's calls of a pass are one launch, in the plan's
    order, with one pseudo-sequence per call and sequence its stripe's real rows meet: those rows from the tile
    boundary before them (counted from the sequence's start; the forward's lead rows zero), copied to the
    launch's own buffer, against the call's span cut to the sequence. Rows are told apart by their values
    (each token holds its global position + 1). With ``align`` 1 the ranks' own rows are every real token
    exactly once per pass."""
    torch, tcp = _torch()
    seen = []

    def spans(cu, off):
        return [(int(o), int(n)) for o, n in zip(off.tolist(), (cu[1:] - cu[:-1]).tolist())]

    def rows(x, cu, off):  # the tokens a pseudo-sequence's rows hold (position + 1; 0: a zero row)
        return [[int(x[o + j, 0, 0]) for j in range(n)] for o, n in spans(cu, off)]

    def forward(q, k, v, call, out=None, lse=None):
        seen.append((cpp.Pass.FORWARD, call.params.attn_mask_type,
                     rows(q, call.cu_seqlens_q, call.cu_seqlens_q_padded),
                     spans(call.cu_seqlens_kv, call.cu_seqlens_kv_padded)))
        n = len(call.cu_seqlens_q) - 1
        return q.new_zeros(q.shape), q.new_zeros((n, q.shape[1], call.params.max_seqlen_q), dtype=torch.float32)

    def backward(q, k, v, out, d_out, lse, call, grads, dq=None, dk=None, dv=None, delta=None, preprocess=True):
        if grads.name == "DQ":
            assert torch.equal(out, q) and torch.equal(d_out, q)  # the query rows' outputs and gradients, copied
            seen.append((cpp.Pass.DQ, call.params.attn_mask_type, rows(q, call.cu_seqlens_q, call.cu_seqlens_q_padded),
                         spans(call.cu_seqlens_kv, call.cu_seqlens_kv_padded)))
        else:
            assert torch.equal(v, k)
            seen.append((cpp.Pass.DKDV, call.params.attn_mask_type,
                         rows(k, call.cu_seqlens_kv, call.cu_seqlens_kv_padded),
                         spans(call.cu_seqlens_q, call.cu_seqlens_q_padded)))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None

    monkeypatch.setattr(tcp.kernel_runner, "forward", forward)
    monkeypatch.setattr(tcp.kernel_runner, "backward", backward)
    lengths, padded = (13, 30, 0, 5, 20), (16, 30, 0, 8, 26)  # padding, and a sequence of none
    starts = tuple(sum(padded[:i]) for i in range(len(padded)))
    total = sum(padded)
    real = [st + i for st, n in zip(starts, lengths) for i in range(n)]
    spec = tcp.FusedSpec(0.25, causal, True, align)
    glob = torch.arange(1, total + 1, dtype=torch.float32)[:, None, None].expand(total, 1, 8).contiguous()
    covered = {p: [] for p in cpp.Pass}
    for rank in range(cp):
        rounds = total // (cp * stripe)
        split = tcp.SeqSplit(QKVFormat.THD, cp, rank, starts=starts, padded=padded, lengths=lengths,
                             balance=cpp.LoadBalance.STRIPED, rounds=rounds)
        assert split.token_index().tolist() == [t for t in range(total) if (t // stripe) % cp == rank]
        plan = cpp.rank_plan("p2p", cp, rank, total, causal, cpp.LoadBalance.STRIPED, rounds=rounds)
        assert tcp.rank_plan(split, spec).calls == plan.calls
        seen.clear()
        q_local = glob.index_select(0, split.token_index())
        tcp.fused_forward_step(q_local, glob, glob, split, spec)
        tcp.fused_backward_step(glob, glob, glob, glob, glob, torch.zeros(1, total), split, spec)
        expected = []
        for pass_ in (cpp.Pass.FORWARD, cpp.Pass.DKDV, cpp.Pass.DQ):
            own, other = [], []
            for call in (c for c in plan.calls if c.pass_ == pass_):
                for st, n in zip(starts, lengths):
                    a, b = max(call.chunk.start, st), min(call.chunk.end, st + n)
                    if a >= b:
                        continue
                    lo = st + (a - st) // align * align
                    lead = [0] * (a - lo) if pass_ == cpp.Pass.FORWARD else list(range(lo + 1, a + 1))
                    own.append(lead + list(range(a + 1, b + 1)))
                    covered[pass_] += list(range(a, b))
                    o = max(call.span[0], st) if pass_ != cpp.Pass.DKDV else min(max(call.span[0], st), lo)
                    other.append((o, min(call.span[1], st + n) - o))
            if own:
                mask = next(c for c in plan.calls if c.pass_ == pass_).padded_mask()
                expected.append((pass_, mask, own, other))
        assert seen == expected, rank
    for pass_ in cpp.Pass:  # over the ranks every real token is kept once per pass
        assert sorted(covered[pass_]) == real, pass_


# -- JAX -------------------------------------------------------------------------------------------------

def _jax_plan(cp, causal, comm, load_balanced, fmt, align, stripe=None):
    jax, jcp, CPStrategy, FusedAttnStatic = _jax()
    from transformer_engine.common.attention import enums

    mask = {(True, False): enums.AttnMaskType.CAUSAL_MASK, (False, False): enums.AttnMaskType.NO_MASK,
            (True, True): enums.AttnMaskType.PADDING_CAUSAL_MASK, (False, True): enums.AttnMaskType.PADDING_MASK}
    thd = fmt == QKVFormat.THD
    static = FusedAttnStatic(attn_mask_type=mask[causal, thd], attn_bias_type=enums.AttnBiasType.NO_BIAS,
                             qkv_format=fmt, window_size=(-1, 0) if causal else (-1, -1), scaling_factor=0.25,
                             dropout_probability=0.0, is_training=True, deterministic=True)
    strategy = CPStrategy.RING if comm == "p2p" else CPStrategy.ALL_GATHER
    return jcp.make_plan(static, jcp.ContextParallel("cp", cp, strategy, load_balanced, stripe), align)


def _record_jax(jcp, monkeypatch, seen):
    import jax.numpy as jnp

    def fwd(q, k, v, bias, seq, seeds, static, *rest):
        seen.append((cpp.Pass.FORWARD, static, seq, q.shape[1], k.shape[1]))
        b, s, h = q.shape[:3]
        aux = (b, seq.q_seqlens.shape[1], h, s)
        return (jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype), jnp.zeros(aux, jnp.float32)) + (
            (jnp.full(aux, -jnp.inf, jnp.float32),) if static.return_max_logit else ())

    def bwd(q, k, v, bias, out, dout, lse, seq, seeds, static, *rest):
        pass_ = cpp.Pass.DQ if static.backward_grads.name == "DQ" else cpp.Pass.DKDV
        own, other = (q, k) if pass_ == cpp.Pass.DQ else (k, q)
        seen.append((pass_, static, seq, own.shape[1], other.shape[1]))
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), None, None

    monkeypatch.setattr(jcp, "fused_attn_fwd", fwd)
    monkeypatch.setattr(jcp, "fused_attn_bwd", bwd)


# BSHD input orders: (load balanced, stripe_size, rounds of cp stripes).
BSHD_ORDERS = {"dual_chunk": (True, None, 1), "contiguous": (False, None, 1), "striped-1": (True, 4, 1),
               "striped-3": (True, 4, 3)}


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("order", list(BSHD_ORDERS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("cp", CPS)
def test_jax_bshd_steps_launch_the_plans_calls(cp, causal, order, comm, monkeypatch):
    """BSHD: each launch is one of the plan's calls (the unmasked ones of a pass as one launch), in the
    plan's order per pass, for DualChunkSwap, contiguous and Striped input (``stripe_size``: the plan runs the
    STRIPED order, one call per own stripe and pass)."""
    jax, jcp, _, _ = _jax()
    import jax.numpy as jnp

    seen = []
    _record_jax(jcp, monkeypatch, seen)
    load_balanced, stripe, rounds = BSHD_ORDERS[order]
    length = 4
    plan = _jax_plan(cp, causal, comm, load_balanced, QKVFormat.BSHD, 1, stripe)
    n_local = cpp.num_chunks(cp, plan.cp.balance, rounds) * length // cp
    s = n_local * cp
    if stripe is not None:  # the input's order: rank r's stripes r, r + cp, ...
        assert (plan.cp.balance, plan.cp.rounds(s)) == (cpp.LoadBalance.STRIPED, rounds)
        assert [r.start for r in plan.rank_plan(1, s).ranges] == [(1 + i * cp) * stripe for i in range(rounds)]
    z = lambda n, h: jnp.zeros((1, n, h, 8), jnp.float32)  # noqa: E731
    lse = jnp.zeros((1, 1, 2, n_local), jnp.float32)
    lse_all = jnp.zeros((1, 1, 2, s), jnp.float32)
    for rank in range(cp):
        seen.clear()
        jcp.rank_forward(plan, rank, z(n_local, 2), z(s, 1), z(s, 1))
        jcp.rank_backward(plan, rank, (z(n_local, 2), z(n_local, 1), z(n_local, 1), z(n_local, 2), lse,
                                       z(n_local, 2)), (z(s, 2), z(s, 1), z(s, 1), z(s, 2), lse_all, z(s, 2)))
        # JAX's causal calls take the gathered keys (queries) whole, the span as sequence lengths: compare
        # pass, mask (unpadded) and own rows, in the plan's order per pass.
        unpadded = {v: k for k, v in cpp._PADDED_MASK.items()}
        got = [(p, unpadded.get(AttnMaskType(st.attn_mask_type), AttnMaskType(st.attn_mask_type)), own)
               for p, st, _, own, _ in seen]
        expected = [(p, m, own) for p, m, own, _ in _expected(plan.rank_plan(rank, s), merge=True)]
        for pass_ in cpp.Pass:
            assert [g for g in got if g[0] == pass_] == [e for e in expected if e[0] == pass_], (rank, pass_)


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("order", ["striped", "striped-2", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("cp", CPS)
def test_jax_thd_steps_launch_the_plans_calls_and_tokens_fall_as_one_over_cp(cp, causal, order, comm, monkeypatch):
    """THD: each step is one of the plan's calls (its mask in padded form) with one pseudo-sequence per
    segment; the real tokens each rank keeps are 1 / cp of the row's. Striped input runs the dual-chunk plan
    (stripes of 1), or its own STRIPED order with two stripes per rank ("striped-2")."""
    jax, jcp, _, _ = _jax()
    import jax.numpy as jnp
    import numpy as np
    from transformer_engine.jax.attention_math import SeqInfo

    seen = []
    _record_jax(jcp, monkeypatch, seen)
    s = 128
    lens = np.array([[40, 24, 0, 64], [7, 57, 30, 34]], np.int32)  # every token real
    offsets = np.concatenate([np.zeros((2, 1), np.int32), np.cumsum(lens, axis=1)], axis=1).astype(np.int32)
    seq = SeqInfo(*(jnp.asarray(x) for x in (lens, lens, offsets, offsets)))
    plan = _jax_plan(cp, causal, comm, order != "contiguous", QKVFormat.THD, 1,
                     s // (2 * cp) if order == "striped-2" else None)
    plans = jcp.thd_rank_plans(plan, s)
    assert jcp.thd_balance(plan.cp, s) == {"striped": (cpp.LoadBalance.DUAL_CHUNK, 1), "contiguous": (
        cpp.LoadBalance.CONTIGUOUS, 1), "striped-2": (cpp.LoadBalance.STRIPED, 2)}[order]
    assert all(p.ranges[0].end - p.ranges[0].start == s // cpp.num_chunks(cp, *jcp.thd_balance(plan.cp, s))
               for p in plans)
    z = lambda h: jnp.zeros((2, s, h, 8), jnp.float32)  # noqa: E731
    for rank in range(cp):
        seen.clear()
        jcp.thd_rank_forward(plan, plans, rank, z(2), z(1), z(1), seq)
        jcp.thd_rank_backward(plan, plans, rank, (z(2), z(1), z(1), z(2), jnp.zeros((2, 2, s)), z(2)), seq)
        calls = plans[rank].calls
        order_ = [c for c in calls if c.pass_ == cpp.Pass.FORWARD] + [c for c in calls if c.pass_ != cpp.Pass.FORWARD]
        assert [(p, st.attn_mask_type) for p, st, *_ in seen] == [(c.pass_, c.padded_mask()) for c in order_]
        kept = {}
        for (p, _, pseudo, _, _), call in zip(seen, order_):
            own = pseudo.kv_seqlens if p == cpp.Pass.DKDV else pseudo.q_seqlens
            kept[p] = kept.get(p, 0) + int(np.sum(np.asarray(own)))  # align 1: no lead rows
        assert kept == {p: 2 * s // cp for p in cpp.Pass}, (rank, kept)


# -- both frameworks: one work list ----------------------------------------------------------------------

def _unpadded(mask):
    back = {v: k for k, v in cpp._PADDED_MASK.items()}
    mask = AttnMaskType(mask)
    return back.get(mask, mask)


def _record_torch(tcp, monkeypatch, seen):
    """PyTorch's launches as (pass, mask unpadded, own-side tokens, other-side tokens)."""
    torch = pytest.importorskip("torch")

    def tokens(x, cu, thd):
        return int((cu[1:] - cu[:-1]).sum()) if thd else x.shape[1]

    def forward(q, k, v, call, out=None, lse=None):
        thd = call.params.qkv_format == QKVFormat.THD
        seen.append((cpp.Pass.FORWARD, _unpadded(call.params.attn_mask_type), tokens(q, call.cu_seqlens_q, thd),
                     tokens(k, call.cu_seqlens_kv, thd)))
        if thd:
            n = len(call.cu_seqlens_q) - 1
            return q.new_zeros(q.shape), q.new_zeros((n, q.shape[1], call.params.max_seqlen_q), dtype=torch.float32)
        return q.new_zeros(q.shape), q.new_zeros((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)

    def backward(q, k, v, out, d_out, lse, call, grads, dq=None, dk=None, dv=None, delta=None, preprocess=True):
        thd = call.params.qkv_format == QKVFormat.THD
        nq, nk = tokens(q, call.cu_seqlens_q, thd), tokens(k, call.cu_seqlens_kv, thd)
        pass_ = cpp.Pass.DQ if grads.name == "DQ" else cpp.Pass.DKDV
        seen.append((pass_, _unpadded(call.params.attn_mask_type)) + ((nq, nk) if pass_ == cpp.Pass.DQ else (nk, nq)))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None

    monkeypatch.setattr(tcp.kernel_runner, "forward", forward)
    monkeypatch.setattr(tcp.kernel_runner, "backward", backward)


def _jax_work(seen, plan, merged):
    """JAX's launches as PyTorch's form: (pass, mask unpadded, own, other) from each call's sequence lengths
    (batch 1), a launch of merged unmasked calls (BSHD: ``merged``) split back into the plan's calls."""
    import numpy as np

    groups = {p: [g for g in plan.launches(merge_unmasked=merged) if g[0].pass_ == p] for p in cpp.Pass}
    out = {p: [] for p in cpp.Pass}
    for pass_, static, seq, _, _ in seen:
        nq, nk = int(np.sum(np.asarray(seq.q_seqlens))), int(np.sum(np.asarray(seq.kv_seqlens)))
        own, other = (nk, nq) if pass_ == cpp.Pass.DKDV else (nq, nk)
        n = len(groups[pass_][len(out[pass_])])  # an extra launch fails here (IndexError)
        out[pass_].append([(pass_, _unpadded(static.attn_mask_type), own // n, other)] * n)
    return {p: [x for launch in out[p] for x in launch] for p in cpp.Pass}


def _by_pass(work):
    return {p: [w for w in work if w[0] == p] for p in cpp.Pass}


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("fmt,order", [(QKVFormat.BSHD, "dual_chunk_swap"), (QKVFormat.THD, "striped")],
                         ids=["bshd-DualChunkSwap", "thd-Striped"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("cp", CPS)
def test_pytorch_and_jax_run_one_work_list_from_the_plan(cp, causal, fmt, order, comm, monkeypatch):
    """Both executors, stubbed, on one sequence of ``s`` real tokens: every rank's launches, as (pass, mask,
    own-side tokens, other-side tokens) per plan call, are the common plan's ``calls`` in both frameworks,
    so PyTorch's and JAX's work lists are equal. The plan is the dual-chunk one: BSHD's DualChunkSwap input
    in both; THD's per-sequence DualChunkSwap in PyTorch and the packed row's plan of JAX's Striped input
    order. THD: each rank's computed (kept) tokens per pass are s / cp in both, counted."""
    torch, tcp = _torch()
    jax, jcp, _, _ = _jax()
    import jax.numpy as jnp
    from transformer_engine.jax.attention_math import SeqInfo

    thd = fmt == QKVFormat.THD
    s = 2 * cp * 8
    torch_seen, jax_seen = [], []
    _record_torch(tcp, monkeypatch, torch_seen)
    _record_jax(jcp, monkeypatch, jax_seen)
    spec = tcp.FusedSpec(0.25, causal, True, 1)
    jplan = _jax_plan(cp, causal, comm, True, fmt, 1)
    if thd:
        assert jcp.thd_balance(jplan.cp, s) == (cpp.LoadBalance.DUAL_CHUNK, 1)  # Striped input, dual-chunk plan
        seq = SeqInfo(*(jnp.asarray(x, jnp.int32) for x in ([[s]], [[s]], [[0, s]], [[0, s]])))
        jplans = jcp.thd_rank_plans(jplan, s)
    zt = lambda *shape: torch.zeros(*shape)  # noqa: E731
    zj = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    n = s // cp
    for rank in range(cp):
        plan = cpp.rank_plan(comm, cp, rank, s, causal, cpp.LoadBalance.DUAL_CHUNK)
        expected = [(c.pass_, c.mask, c.length, c.span[1] - c.span[0]) for c in plan.calls]
        torch_seen.clear()
        jax_seen.clear()
        if thd:
            split = tcp.SeqSplit(QKVFormat.THD, cp, rank, starts=(0,), padded=(s,), lengths=(s,))
            assert jplans[rank] == plan
            tcp.fused_forward_step(zt(n, 2, 8), zt(s, 1, 8), zt(s, 1, 8), split, spec)
            tcp.fused_backward_step(zt(s, 2, 8), zt(s, 1, 8), zt(s, 1, 8), zt(s, 2, 8), zt(s, 2, 8), zt(2, s), split,
                                    spec)
            jcp.thd_rank_forward(jplan, jplans, rank, zj(1, s, 2, 8), zj(1, s, 1, 8), zj(1, s, 1, 8), seq)
            jcp.thd_rank_backward(jplan, jplans, rank, (zj(1, s, 2, 8), zj(1, s, 1, 8), zj(1, s, 1, 8), zj(1, s, 2, 8),
                                                        zj(1, 2, s), zj(1, s, 2, 8)), seq)
        else:
            split = tcp.SeqSplit(QKVFormat.BSHD, cp, rank, seqlen=s)
            assert jplan.rank_plan(rank, s) == plan
            tcp.fused_forward_step(zt(1, n, 2, 8), zt(1, s, 1, 8), zt(1, s, 1, 8), split, spec)
            tcp.fused_backward_step(zt(1, s, 2, 8), zt(1, s, 1, 8), zt(1, s, 1, 8), zt(1, s, 2, 8), zt(1, s, 2, 8),
                                    zt(1, 2, s), split, spec)
            jcp.rank_forward(jplan, rank, zj(1, n, 2, 8), zj(1, s, 1, 8), zj(1, s, 1, 8))
            local = (zj(1, n, 2, 8), zj(1, n, 1, 8), zj(1, n, 1, 8), zj(1, n, 2, 8), zj(1, 1, 2, n), zj(1, n, 2, 8))
            gathered = (zj(1, s, 2, 8), zj(1, s, 1, 8), zj(1, s, 1, 8), zj(1, s, 2, 8), zj(1, 1, 2, s), zj(1, s, 2, 8))
            jcp.rank_backward(jplan, rank, local, gathered)
        torch_work = _by_pass(torch_seen)
        jax_work = _by_pass([w for ws in _jax_work(jax_seen, plan, merged=not thd).values() for w in ws])
        assert torch_work == jax_work == _by_pass(expected), (rank, torch_seen, jax_seen)
        if thd:  # the chunk tokens each rank computes: 1 / cp of the sequence's, per pass, in both
            for work in (torch_work, jax_work):
                assert {p: sum(w[2] for w in work[p]) for p in cpp.Pass} == {p: s // cp for p in cpp.Pass}, rank


@pytest.mark.parametrize("cp", (2, 4))
def test_jax_bshd_launches_take_mask_and_span_from_the_plan_call(cp, monkeypatch):
    """JAX BSHD chooses no mask or range itself: with the plan's causal calls altered (forward and dQ calls
    top-left instead of bottom-right, their key span one shorter; dK/dV query spans one later), its launches
    follow the altered calls."""
    jax, jcp, _, _ = _jax()
    import jax.numpy as jnp
    import numpy as np

    calls_of = cpp.RankPlan.calls.fget

    def altered(plan):
        out = []
        for c in calls_of(plan):
            if c.pass_ == cpp.Pass.DKDV:
                out.append(dataclasses.replace(c, span=(c.span[0] + 1, c.span[1])))
            else:
                out.append(dataclasses.replace(c, mask=AttnMaskType.CAUSAL_MASK, span=(c.span[0], c.span[1] - 1)))
        return tuple(out)

    monkeypatch.setattr(cpp.RankPlan, "calls", property(altered))
    seen = []
    _record_jax(jcp, monkeypatch, seen)
    plan = _jax_plan(cp, True, "all_gather", True, QKVFormat.BSHD, 1)
    n = 8
    s = n * cp
    z = lambda m, h: jnp.zeros((1, m, h, 8), jnp.float32)  # noqa: E731
    for rank in range(cp):
        seen.clear()
        jcp.rank_forward(plan, rank, z(n, 2), z(s, 1), z(s, 1))
        jcp.rank_backward(plan, rank, (z(n, 2), z(n, 1), z(n, 1), z(n, 2), jnp.zeros((1, 1, 2, n)), z(n, 2)),
                          (z(s, 2), z(s, 1), z(s, 1), z(s, 2), jnp.zeros((1, 1, 2, s)), z(s, 2)))
        calls = altered(plan.rank_plan(rank, s))
        expected = [c for c in calls if c.pass_ == cpp.Pass.FORWARD] + [
            c for p in (cpp.Pass.DKDV, cpp.Pass.DQ) for c in calls if c.pass_ == p]
        assert [p for p, *_ in seen] == [c.pass_ for c in expected], rank
        for (pass_, static, seq, _, _), call in zip(seen, expected):
            assert AttnMaskType(static.attn_mask_type) == call.padded_mask(), (rank, pass_)
            if pass_ == cpp.Pass.DKDV:  # the span's queries as one sequence from its start
                assert (int(np.asarray(seq.q_offsets)[0, 0]), int(np.asarray(seq.q_seqlens)[0, 0])) == (
                    call.span[0], call.span[1] - call.span[0]), rank
            else:  # keys [0, span end)
                assert int(np.asarray(seq.kv_seqlens)[0, 0]) == call.span[1], (rank, pass_)


def test_jax_thd_sliding_window_splits_by_the_plan_tokens_fall_as_one_over_cp(monkeypatch):
    """JAX THD with a causal sliding window runs the plan's calls like the windowless masks (it ran the whole
    gathered rows on every rank before): each call carries the window, and the real tokens each rank's calls
    keep per pass are 1 / cp of the rows' (cp 1, 2, 4; with cp = 1 the whole rows)."""
    jax, jcp, _, _ = _jax()
    import jax.numpy as jnp
    import numpy as np
    from transformer_engine.common.attention import enums
    from transformer_engine.jax.attention_math import SeqInfo

    seen = []
    _record_jax(jcp, monkeypatch, seen)
    s, window = 64, (5, 0)
    lens = np.array([[13, 30, 0, 21], [5, 20, 32, 7]], np.int32)  # every token real
    offsets = np.concatenate([np.zeros((2, 1), np.int32), np.cumsum(lens, axis=1)], axis=1).astype(np.int32)
    seq = SeqInfo(*(jnp.asarray(x) for x in (lens, lens, offsets, offsets)))
    z = lambda h: jnp.zeros((2, s, h, 8), jnp.float32)  # noqa: E731
    per_rank = {}
    for cp in (1, 2, 4):
        plan = _jax_plan(cp, True, "all_gather", True, QKVFormat.THD, 1)
        plan = dataclasses.replace(plan, static=dataclasses.replace(plan.static, window_size=window))
        assert jcp._thd_splits(plan.static)
        plans = jcp.thd_rank_plans(plan, s)
        for rank in range(cp):
            seen.clear()
            jcp.thd_rank_forward(plan, plans, rank, z(2), z(1), z(1), seq)
            jcp.thd_rank_backward(plan, plans, rank, (z(2), z(1), z(1), z(2), jnp.zeros((2, 2, s)), z(2)), seq)
            assert {tuple(st.window_size) for _, st, *_ in seen} == {window}, (cp, rank)
            assert {st.attn_mask_type for _, st, *_ in seen} == {enums.AttnMaskType.PADDING_CAUSAL_MASK,
                                                                  enums.AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK}
            kept = {}
            for p, _, pseudo, _, _ in seen:
                own = pseudo.kv_seqlens if p == cpp.Pass.DKDV else pseudo.q_seqlens
                kept[p] = kept.get(p, 0) + int(np.sum(np.asarray(own)))  # align 1: no lead rows
            per_rank[cp, rank] = kept
    for (cp, rank), kept in per_rank.items():
        assert kept == {p: 2 * s // cp for p in cpp.Pass}, (cp, rank, kept)  # 128, 64, 32 tokens per pass


def test_common_plan_refuses_a_window_it_cannot_split_by_rows():
    with pytest.raises(NotImplementedError, match="`window` must be -1"):
        cpp.rank_plan("p2p", 2, 0, 16, False, cpp.LoadBalance.DUAL_CHUNK, window=4)
    calls = cpp.rank_plan("p2p", 2, 0, 16, True, cpp.LoadBalance.DUAL_CHUNK, window=4).calls
    assert {c.window for c in calls} == {(4, 0)}
    assert {c.window for c in cpp.rank_plan("p2p", 2, 0, 16, False, cpp.LoadBalance.DUAL_CHUNK).calls} == {(-1, -1)}


@pytest.mark.parametrize("cp", (2, 4))
def test_jax_thd_pseudo_sequences_take_the_plan_calls_span(cp, monkeypatch):
    """JAX THD cuts each call's span (not a range of its own) to the segment: with the plan's spans one token
    shorter at the end, every call's other-side tokens follow (one segment over the whole row)."""
    jax, jcp, _, _ = _jax()
    import jax.numpy as jnp
    import numpy as np
    from transformer_engine.jax.attention_math import SeqInfo

    calls_of = cpp.RankPlan.calls.fget

    def altered(plan):
        return tuple(dataclasses.replace(c, span=(c.span[0], c.span[1] - 1)) for c in calls_of(plan))

    monkeypatch.setattr(cpp.RankPlan, "calls", property(altered))
    seen = []
    _record_jax(jcp, monkeypatch, seen)
    s = 2 * cp * 4
    seq = SeqInfo(*(jnp.asarray(x, jnp.int32) for x in ([[s]], [[s]], [[0, s]], [[0, s]])))
    plan = _jax_plan(cp, True, "p2p", True, QKVFormat.THD, 1)
    plans = jcp.thd_rank_plans(plan, s)
    z = lambda h: jnp.zeros((1, s, h, 8), jnp.float32)  # noqa: E731
    for rank in range(cp):
        seen.clear()
        jcp.thd_rank_forward(plan, plans, rank, z(2), z(1), z(1), seq)
        jcp.thd_rank_backward(plan, plans, rank, (z(2), z(1), z(1), z(2), jnp.zeros((1, 2, s)), z(2)), seq)
        calls = plans[rank].calls
        order = [c for c in calls if c.pass_ == cpp.Pass.FORWARD] + [c for c in calls if c.pass_ != cpp.Pass.FORWARD]
        for (p, _, pseudo, _, _), call in zip(seen, order):
            other = pseudo.q_seqlens if p == cpp.Pass.DKDV else pseudo.kv_seqlens
            assert int(np.asarray(other)[0, 0]) == call.span[1] - call.span[0], (rank, p)
