"""Attention backward: preprocess, dK/dV pass, dQ pass.

Deterministic by construction: every program owns its output tile and sums in a fixed order
(dK/dV: over the query heads of the GQA group, then query blocks in ascending order; dQ: over key
blocks in ascending order). No atomics.

Sink softmax changes nothing in the dK/dV and dQ passes (forward.py's docstring); the learnable
sink's gradient is attn_bwd_dsink_kernel's, one partial sum per sequence without atomics.

The products ask for ``input_precision="ieee"``, as the forward's (forward.py's docstring).
"""

import triton
import triton.language as tl

from transformer_engine.common.attention.kernels.triton_compat import settle_cache_keys

from transformer_engine.common.attention.kernels.masking import (
    SEQLEN_ARGS,
    key_block_bounds,
    key_block_program,
    length_specialized,
    load_block,
    mask_scores,
    query_block_bounds,
    query_block_program,
    row_delta,
    segment_block,
    segment_bounds,
    sequence_extent,
    sequence_source,
    visible,
)
from transformer_engine.common.attention.kernels.scores import (
    bias_log2,
    dropout_keep,
    head_score_mods,
    load_rng_state,
)

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=SEQLEN_ARGS[:1])
def attn_bwd_preprocess_kernel(
    O, DO, DELTA,
    SEQ_START_Q, SEQ_LEN_Q,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh,
    num_heads_q, seqlen_q,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr, SEGMENTS: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO[i, d] * O[i, d] (fp32). Grid: (query block, sequence * head), or with
    SEGMENTS > 1 the segment-row grid (masking.segment_block)."""
    if SEGMENTS > 1:
        pid_bh = tl.program_id(1)
        batch, start_m = segment_block(SEQ_LEN_Q, pid_bh // num_heads_q, tl.program_id(0), SEGMENTS, BLOCK_M, False)
        if batch < 0:
            return
    else:
        start_m = tl.program_id(0) * BLOCK_M
        pid_bh = tl.program_id(1)
        batch = pid_bh // num_heads_q
    head = pid_bh % num_heads_q
    start_q, len_q = sequence_extent(SEQ_START_Q, SEQ_LEN_Q, batch, seqlen_q, IS_THD, HAS_SEQLENS)
    if start_m >= len_q:
        return
    row_delta(O, DO, DELTA, batch, head, start_m, start_q, len_q, stride_ob, stride_os, stride_oh, stride_od,
              stride_dob, stride_dos, stride_doh, stride_dod, stride_lb, stride_lh, 1.0, HEAD_DIM_V, BLOCK_DV, BLOCK_M,
              False)


@triton.jit
def _dkdv_inner(dk, dk2, dv, k, k2, v, q_src, q_src2, do_src, lse_ptrs, delta_ptrs,
                stride_qs, stride_dos,
                offs_n, offs_m_base, offs_dqk, offs_dqk2, offs_dv, lo, hi, full_lo, full_hi,
                len_q, len_k, diag, window_left, window_right, qk_scale,
                bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head, dropout_p,
                HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, SINGLE_LOOP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                WITH_DK: tl.constexpr, WITH_DV: tl.constexpr):
    """Query blocks [lo, hi); masking as in forward._fwd_inner (SINGLE_LOOP: outside [full_lo, full_hi) only).
    WITH_DK / WITH_DV: which of dk and dv to accumulate (the other comes back as it came). With BLOCK_DQK2 > 0,
    dk2, k2 and q_src2 are the second Q/K head-dim chunk's (forward._fwd_inner); otherwise unused, and dk2
    comes back as it came."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m_base
        q_t = load_block(q_src, start_m, stride_qs, offs_dqk, offs_m_base, len_q, HEAD_DIM_QK, BLOCK_DQK, MASKED,
                         True)  # [BLOCK_DQK, BLOCK_M]
        # Rows past the sequence (or with nothing visible) carry lse = +inf: their p is 0.
        lse = tl.load(lse_ptrs + offs_m, mask=offs_m < len_q, other=float("inf"))
        if BLOCK_DQK2 > 0:
            q_t2 = load_block(q_src2, start_m, stride_qs, offs_dqk2, offs_m_base, len_q, HEAD_DIM_QK,
                              BLOCK_DQK + BLOCK_DQK2, MASKED, True)  # [BLOCK_DQK2, BLOCK_M]
            qk_t = tl.dot(k2, q_t2, tl.dot(k, q_t, input_precision="ieee"), input_precision="ieee")
        else:
            qk_t = tl.dot(k, q_t, input_precision="ieee")  # [BLOCK_N, BLOCK_M]
        if HAS_BIAS or HAS_ALIBI:  # the forward's scores: one explicit FMA (forward._fwd_inner)
            qk_t = tl.fma(qk_t, qk_scale, bias_log2(bias_base, offs_m[None, :], offs_n[:, None], len_q, len_k,
                                                    stride_zm, stride_zn, alibi_slope, diag, HAS_BIAS, HAS_ALIBI))
        else:
            qk_t = qk_t * qk_scale
        p_t = tl.math.exp2(qk_t - lse[None, :] * LOG2E)
        if MASKED:
            p_t = mask_scores(p_t, 0.0, offs_m[None, :], offs_n[:, None], start_m, full_lo, full_hi, len_q, len_k,
                              diag, window_left, window_right, HAS_LEFT, HAS_RIGHT, SINGLE_LOOP)
        do = load_block(do_src, start_m, stride_dos, offs_dv, offs_m_base, len_q, HEAD_DIM_V, BLOCK_DV, MASKED,
                        False)  # [BLOCK_M, BLOCK_DV]
        # With both gradients the statements keep the order of the single pass (its verified instruction schedule).
        if WITH_DK:
            delta = tl.load(delta_ptrs + offs_m, mask=offs_m < len_q, other=0.0)
            dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")  # [BLOCK_N, BLOCK_M]
        if DROPOUT:
            kept = dropout_keep(seed, rng_offset, seq_head, offs_m[None, :], offs_n[:, None], dropout_p)
            inv_keep = 1.0 / (1.0 - dropout_p)
            if WITH_DV:
                dv += tl.dot((tl.where(kept, p_t, 0.0) * inv_keep).to(do.dtype), do, input_precision="ieee")
            if WITH_DK:
                dp_t = tl.where(kept, dp_t, 0.0) * inv_keep
        elif WITH_DV:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision="ieee")
        if WITH_DK:
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision="ieee")
            if BLOCK_DQK2 > 0:
                dk2 += tl.dot(ds_t.to(q_t2.dtype), tl.trans(q_t2), input_precision="ieee")
    return dk, dk2, dv


@length_specialized
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, BIAS, ALIBI_SLOPES, RNG_STATE,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh,
    stride_zb, stride_zh, stride_zm, stride_zn, stride_alibi_b,
    num_heads_kv, gqa_group: tl.constexpr, seqlen_q, seqlen_k,
    sm_scale, qk_scale, window_left, window_right, dropout_p,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_GROUP: tl.constexpr, SINGLE_LOOP: tl.constexpr, SEGMENTS: tl.constexpr,
    WITH_DK: tl.constexpr, WITH_DV: tl.constexpr,
):
    """One program per (key block, batch * kv head): dK, dV for that tile, summed over the
    query heads of the GQA group in order, each over its query blocks in order. With SEGMENTS > 1 the
    grid is the segment-row grid (masking.segment_block). WITH_DK / WITH_DV: which of the two it computes
    and writes (a plan may run them as two passes: plan.BackwardPlan.dv)."""
    tl.static_assert(WITH_DK | WITH_DV)
    # A split Q/K head dim (BLOCK_DQK2 > 0) fills its first chunk: the loops load it without a head-dim mask.
    tl.static_assert(BLOCK_DQK + BLOCK_DQK2 >= HEAD_DIM_QK)
    tl.static_assert((BLOCK_DQK2 == 0) | (BLOCK_DQK < HEAD_DIM_QK))
    start_n, batch, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = key_block_program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_kv, seqlen_q, seqlen_k, BLOCK_N, IS_THD,
        HAS_SEQLENS, BOTTOM_RIGHT, HEAD_GROUP, SEGMENTS)  # grid: plan.block_grid
    if start_n >= rows_out:
        return

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n[:, None] < len_k
    k_base = K + batch.to(tl.int64) * stride_kb + start_k * stride_ks + head_kv.to(tl.int64) * stride_kh
    k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_dqk[None, :] * stride_kd,
                mask=key_ok & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)
    v = k  # read only for dK (dP = V dO^T)
    if WITH_DK:
        v = tl.load(V + batch.to(tl.int64) * stride_vb + start_k * stride_vs + head_kv.to(tl.int64) * stride_vh
                    + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                    mask=key_ok & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # The second Q/K chunk (BLOCK_DQK2 > 0, forward.py); without a split these names stand for the first
    # chunk's and are never read or changed.
    offs_dqk2, k2, dk2 = offs_dqk, k, dk
    if BLOCK_DQK2 > 0:
        offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        k2 = tl.load(k_base + offs_n[:, None] * stride_ks + offs_dqk2[None, :] * stride_kd,
                     mask=key_ok & (offs_dqk2[None, :] < HEAD_DIM_QK), other=0.0)
        dk2 = tl.zeros([BLOCK_N, BLOCK_DQK2], dtype=tl.float32)

    lo, full_lo, full_hi, hi = query_block_bounds(start_n, len_q, len_k, diag, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    seed, rng_offset = load_rng_state(RNG_STATE, DROPOUT)
    # gqa_group is a compile-time constant so that, without GQA, this one-trip loop folds away: a
    # runtime loop around the three query-block loops kept their state live across it and spilled
    # registers (cuobjdump -res-usage, d=128: 2.5 KB of stack with the loop, 0.9 KB without).
    for g in range(0, gqa_group):
        head = head_kv * gqa_group + g
        bias_base, alibi_slope = head_score_mods(BIAS, ALIBI_SLOPES, batch, head, stride_zb, stride_zh,
                                                 stride_alibi_b, HAS_ALIBI)
        seq_head = batch * (num_heads_kv * gqa_group) + head
        q_base = Q + batch.to(tl.int64) * stride_qb + start_q * stride_qs + head.to(tl.int64) * stride_qh
        q_src = sequence_source(q_base, stride_qs, len_q, offs_dqk, offs_m, stride_qd, HEAD_DIM_QK, BLOCK_DQK,
                                BLOCK_M, True)
        q_src2 = q_src
        if BLOCK_DQK2 > 0:
            q_src2 = sequence_source(q_base, stride_qs, len_q, offs_dqk2, offs_m, stride_qd, HEAD_DIM_QK, BLOCK_DQK2,
                                     BLOCK_M, True)
        do_src = sequence_source(DO + batch.to(tl.int64) * stride_dob + start_q * stride_dos
                                 + head.to(tl.int64) * stride_doh, stride_dos, len_q, offs_dv, offs_m, stride_dod,
                                 HEAD_DIM_V, BLOCK_DV, BLOCK_M, False)
        lse_ptrs = LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
        delta_ptrs = DELTA + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
        if SINGLE_LOOP:
            dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, v, q_src, q_src2, do_src, lse_ptrs, delta_ptrs,
                                      stride_qs, stride_dos, offs_n, offs_m, offs_dqk, offs_dqk2, offs_dv, lo, hi,
                                      full_lo, full_hi, len_q, len_k, diag, window_left, window_right, qk_scale,
                                      bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head,
                                      dropout_p, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_M,
                                      True, True, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, DROPOUT,
                                      WITH_DK, WITH_DV)
        else:
            for SEGMENT in tl.static_range(3):
                seg_lo, seg_hi = segment_bounds(SEGMENT, lo, full_lo, full_hi, hi)
                dk, dk2, dv = _dkdv_inner(dk, dk2, dv, k, k2, v, q_src, q_src2, do_src, lse_ptrs, delta_ptrs,
                                          stride_qs, stride_dos, offs_n, offs_m, offs_dqk, offs_dqk2, offs_dv, seg_lo,
                                          seg_hi, full_lo, full_hi, len_q, len_k, diag, window_left, window_right,
                                          qk_scale, bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset,
                                          seq_head, dropout_p, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2,
                                          BLOCK_DV, BLOCK_M, SEGMENT != 1, False, HAS_LEFT, HAS_RIGHT, HAS_BIAS,
                                          HAS_ALIBI, DROPOUT, WITH_DK, WITH_DV)

    if WITH_DK:
        dk = tl.where(key_ok, dk * sm_scale, 0.0)
    if WITH_DV:
        dv = tl.where(key_ok, dv, 0.0)
    out_rows = offs_n[:, None] < rows_out
    if WITH_DK:
        dk_base = DK + batch.to(tl.int64) * stride_dkb + start_k * stride_dks + head_kv.to(tl.int64) * stride_dkh
        tl.store(dk_base + offs_n[:, None] * stride_dks + offs_dqk[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
                 mask=out_rows & (offs_dqk[None, :] < HEAD_DIM_QK))
        if BLOCK_DQK2 > 0:
            dk2 = tl.where(key_ok, dk2 * sm_scale, 0.0)
            tl.store(dk_base + offs_n[:, None] * stride_dks + offs_dqk2[None, :] * stride_dkd,
                     dk2.to(DK.dtype.element_ty), mask=out_rows & (offs_dqk2[None, :] < HEAD_DIM_QK))
    if WITH_DV:
        tl.store(DV + batch.to(tl.int64) * stride_dvb + start_k * stride_dvs + head_kv.to(tl.int64) * stride_dvh
                 + offs_n[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
                 mask=out_rows & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dq_inner(dq, dq2, q, q2, do, lse2, delta, k_src, k_src2, v_src, stride_ks, stride_vs,
              offs_m, offs_n_base, offs_dqk, offs_dqk2, offs_dv, lo, hi, full_lo, full_hi,
              len_q, len_k, diag, window_left, window_right, qk_scale,
              bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head, dropout_p,
              HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, SINGLE_LOOP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """Key blocks [lo, hi); masking as in forward._fwd_inner. With BLOCK_DQK2 > 0, dq2, q2 and k_src2 are
    the second Q/K head-dim chunk's; otherwise unused, and dq2 comes back as it came."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        k_t = load_block(k_src, start_n, stride_ks, offs_dqk, offs_n_base, len_k, HEAD_DIM_QK, BLOCK_DQK, MASKED,
                         True)  # [BLOCK_DQK, BLOCK_N]
        v_t = load_block(v_src, start_n, stride_vs, offs_dv, offs_n_base, len_k, HEAD_DIM_V, BLOCK_DV, MASKED,
                         True)  # [BLOCK_DV, BLOCK_N]
        if BLOCK_DQK2 > 0:
            k_t2 = load_block(k_src2, start_n, stride_ks, offs_dqk2, offs_n_base, len_k, HEAD_DIM_QK,
                              BLOCK_DQK + BLOCK_DQK2, MASKED, True)  # [BLOCK_DQK2, BLOCK_N]
            qk = tl.dot(q2, k_t2, tl.dot(q, k_t, input_precision="ieee"), input_precision="ieee")
        else:
            qk = tl.dot(q, k_t, input_precision="ieee")
        if HAS_BIAS or HAS_ALIBI:  # the forward's scores: one explicit FMA (forward._fwd_inner)
            qk = tl.fma(qk, qk_scale, bias_log2(bias_base, offs_m[:, None], offs_n[None, :], len_q, len_k, stride_zm,
                                                stride_zn, alibi_slope, diag, HAS_BIAS, HAS_ALIBI))
        else:
            qk = qk * qk_scale
        p = tl.math.exp2(qk - lse2[:, None])
        if MASKED:
            p = mask_scores(p, 0.0, offs_m[:, None], offs_n[None, :], start_n, full_lo, full_hi, len_q, len_k, diag,
                            window_left, window_right, HAS_LEFT, HAS_RIGHT, SINGLE_LOOP)
        dp = tl.dot(do, v_t, input_precision="ieee")
        if DROPOUT:
            kept = dropout_keep(seed, rng_offset, seq_head, offs_m[:, None], offs_n[None, :], dropout_p)
            dp = tl.where(kept, dp, 0.0) * (1.0 / (1.0 - dropout_p))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision="ieee")
        if BLOCK_DQK2 > 0:
            dq2 += tl.dot(ds.to(k_t2.dtype), tl.trans(k_t2), input_precision="ieee")
    return dq, dq2


@length_specialized
def attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, BIAS, ALIBI_SLOPES, RNG_STATE,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    stride_zb, stride_zh, stride_zm, stride_zn, stride_alibi_b,
    num_heads_q, gqa_group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, window_left, window_right, dropout_p,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_GROUP: tl.constexpr, SINGLE_LOOP: tl.constexpr, SEGMENTS: tl.constexpr,
):
    """One program per (query block, batch * query head): dQ summed over key blocks in order."""
    tl.static_assert(BLOCK_DQK + BLOCK_DQK2 >= HEAD_DIM_QK)
    tl.static_assert((BLOCK_DQK2 == 0) | (BLOCK_DQK < HEAD_DIM_QK))  # as attn_bwd_dkdv_kernel's
    start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = query_block_program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
        BLOCK_M, IS_THD, HAS_SEQLENS, BOTTOM_RIGHT, HEAD_GROUP, SEGMENTS)
    if start_m >= rows_out:
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    q_base = Q + batch.to(tl.int64) * stride_qb + start_q * stride_qs + head.to(tl.int64) * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)
    do = tl.load(DO + batch.to(tl.int64) * stride_dob + start_q * stride_dos + head.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    lse_off = batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m
    lse2 = tl.load(LSE + lse_off, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    k_base = K + batch.to(tl.int64) * stride_kb + start_k * stride_ks + head_kv.to(tl.int64) * stride_kh
    k_src = sequence_source(k_base, stride_ks, len_k, offs_dqk, offs_n, stride_kd, HEAD_DIM_QK, BLOCK_DQK, BLOCK_N,
                            True)
    v_src = sequence_source(V + batch.to(tl.int64) * stride_vb + start_k * stride_vs + head_kv.to(tl.int64) * stride_vh,
                            stride_vs, len_k, offs_dv, offs_n, stride_vd, HEAD_DIM_V, BLOCK_DV, BLOCK_N, True)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    # The second Q/K chunk (BLOCK_DQK2 > 0, forward.py); without a split these names stand for the first
    # chunk's and are never read or changed.
    offs_dqk2, q2, k_src2, dq2 = offs_dqk, q, k_src, dq
    if BLOCK_DQK2 > 0:
        offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        q2 = tl.load(q_base + offs_m[:, None] * stride_qs + offs_dqk2[None, :] * stride_qd,
                     mask=row_ok[:, None] & (offs_dqk2[None, :] < HEAD_DIM_QK), other=0.0)
        k_src2 = sequence_source(k_base, stride_ks, len_k, offs_dqk2, offs_n, stride_kd, HEAD_DIM_QK, BLOCK_DQK2,
                                 BLOCK_N, True)
        dq2 = tl.zeros([BLOCK_M, BLOCK_DQK2], dtype=tl.float32)
    bias_base, alibi_slope = head_score_mods(BIAS, ALIBI_SLOPES, batch, head, stride_zb, stride_zh, stride_alibi_b,
                                             HAS_ALIBI)
    seed, rng_offset = load_rng_state(RNG_STATE, DROPOUT)
    seq_head = batch * num_heads_q + head

    lo, full_lo, full_hi, hi = key_block_bounds(start_m, len_q, len_k, diag, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if SINGLE_LOOP:
        dq, dq2 = _dq_inner(dq, dq2, q, q2, do, lse2, delta, k_src, k_src2, v_src, stride_ks, stride_vs, offs_m, offs_n,
                            offs_dqk, offs_dqk2, offs_dv, lo, hi, full_lo, full_hi, len_q, len_k, diag, window_left,
                            window_right, qk_scale, bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset,
                            seq_head, dropout_p, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                            True, True, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, DROPOUT)
    else:
        for SEGMENT in tl.static_range(3):
            seg_lo, seg_hi = segment_bounds(SEGMENT, lo, full_lo, full_hi, hi)
            dq, dq2 = _dq_inner(dq, dq2, q, q2, do, lse2, delta, k_src, k_src2, v_src, stride_ks, stride_vs, offs_m,
                                offs_n, offs_dqk, offs_dqk2, offs_dv, seg_lo, seg_hi, full_lo, full_hi, len_q, len_k,
                                diag, window_left, window_right, qk_scale, bias_base, stride_zm, stride_zn,
                                alibi_slope, seed, rng_offset, seq_head, dropout_p, HEAD_DIM_QK, HEAD_DIM_V,
                                BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N, SEGMENT != 1, False, HAS_LEFT, HAS_RIGHT,
                                HAS_BIAS, HAS_ALIBI, DROPOUT)
    dq = tl.where(row_ok[:, None], dq * sm_scale, 0.0)
    dq_base = DQ + batch.to(tl.int64) * stride_dqb + start_q * stride_dqs + head.to(tl.int64) * stride_dqh
    tl.store(dq_base + offs_m[:, None] * stride_dqs + offs_dqk[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < rows_out) & (offs_dqk[None, :] < HEAD_DIM_QK))
    if BLOCK_DQK2 > 0:
        dq2 = tl.where(row_ok[:, None], dq2 * sm_scale, 0.0)
        tl.store(dq_base + offs_m[:, None] * stride_dqs + offs_dqk2[None, :] * stride_dqd, dq2.to(DQ.dtype.element_ty),
                 mask=(offs_m[:, None] < rows_out) & (offs_dqk2[None, :] < HEAD_DIM_QK))


@triton.jit
def _dbias_rows(acc, Q, K, V, DO, LSE, DELTA, BIAS, SEQ_LEN_Q, SEQ_LEN_K,
                stride_qb, stride_qs, stride_qh, stride_qd,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                stride_dob, stride_dos, stride_doh, stride_dod,
                stride_lb, stride_lh, stride_zb, stride_zh, stride_zm, stride_zn,
                offs_m, offs_n, offs_dqk, offs_dv, b_lo, b_hi, h_lo, h_hi, num_heads_q, gqa_group,
                seqlen_q, seqlen_k, qk_scale, window_left, window_right, dropout_p, seed, rng_offset,
                HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_SEQLENS: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                DROPOUT: tl.constexpr):
    """``acc`` plus dS of query rows ``offs_m`` and keys ``offs_n``, summed over batches [b_lo, b_hi) and
    query heads [h_lo, h_hi) in ascending order."""
    for batch_i in range(b_lo, b_hi):
        batch = tl.cast(batch_i, tl.int64)
        len_q = seqlen_q
        len_k = seqlen_k
        if HAS_SEQLENS:
            len_q = tl.load(SEQ_LEN_Q + batch)
            len_k = tl.load(SEQ_LEN_K + batch)
        diag = 0
        if BOTTOM_RIGHT:
            diag = len_k - len_q
        row_ok = offs_m < len_q
        col_ok = offs_n < len_k
        for head_i in range(h_lo, h_hi):
            head = tl.cast(head_i, tl.int64)
            head_kv = head // gqa_group
            q = tl.load(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                        + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                        mask=row_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)
            k_t = tl.load(K + batch.to(tl.int64) * stride_kb + head_kv.to(tl.int64) * stride_kh
                          + offs_n[None, :] * stride_ks + offs_dqk[:, None] * stride_kd,
                          mask=col_ok[None, :] & (offs_dqk[:, None] < HEAD_DIM_QK), other=0.0)
            v_t = tl.load(V + batch.to(tl.int64) * stride_vb + head_kv.to(tl.int64) * stride_vh
                          + offs_n[None, :] * stride_vs + offs_dv[:, None] * stride_vd,
                          mask=col_ok[None, :] & (offs_dv[:, None] < HEAD_DIM_V), other=0.0)
            do = tl.load(DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
                         + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
                         mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
            lse_off = batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m
            lse2 = tl.load(LSE + lse_off, mask=row_ok, other=float("inf")) * LOG2E
            delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
            bias_base = BIAS + batch.to(tl.int64) * stride_zb + head.to(tl.int64) * stride_zh
            qk = tl.fma(tl.dot(q, k_t, input_precision="ieee"), qk_scale,
                        bias_log2(bias_base, offs_m[:, None], offs_n[None, :], len_q, len_k, stride_zm, stride_zn,
                                  0.0, diag, True, False))
            keep = visible(offs_m[:, None], offs_n[None, :], len_q, len_k, diag, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT)
            p = tl.where(keep, tl.math.exp2(qk - lse2[:, None]), 0.0)
            dp = tl.dot(do, v_t, input_precision="ieee")
            if DROPOUT:
                kept = dropout_keep(seed, rng_offset, batch * num_heads_q + head, offs_m[:, None], offs_n[None, :],
                                    dropout_p)
                dp = tl.where(kept, dp, 0.0) * (1.0 / (1.0 - dropout_p))
            acc += p * (dp - delta[:, None])
    return acc


@length_specialized
def attn_bwd_dbias_kernel(
    Q, K, V, DO, LSE, DELTA, BIAS, DBIAS, RNG_STATE,
    SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh,
    stride_zb, stride_zh, stride_zm, stride_zn,
    stride_dzb, stride_dzh, stride_dzm, stride_dzn,
    batch_size, num_heads_q, gqa_group, bias_batch, bias_heads, seqlen_q, seqlen_k,
    qk_scale, window_left, window_right, dropout_p,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    DROPOUT: tl.constexpr, SUM_ROWS: tl.constexpr,
):
    """One program per dBias tile: dS summed over the broadcast batch and head dimensions of
    the bias, in ascending order, in registers (no atomics, no s^2 scratch).

    dBias = dS because the bias is added after the softmax scale. Recomputes S and dP per
    (batch, head) pair it sums over. SUM_ROWS (a [.., .., 1, s_kv] bias, broadcast over the query
    rows): one program per key tile walks every query block in ascending order, then sums the
    rows of its fp32 tile (a fixed tree), so dBias has one row.
    """
    pid_m = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    pid_z = tl.program_id(2)
    zb = pid_z // bias_heads
    zh = pid_z % bias_heads
    # A broadcast bias dimension (size 1) sums over the whole batch / all heads.
    b_lo = tl.where(bias_batch == 1, 0, zb)
    b_hi = tl.where(bias_batch == 1, batch_size, zb + 1)
    h_lo = tl.where(bias_heads == 1, 0, zh)
    h_hi = tl.where(bias_heads == 1, num_heads_q, zh + 1)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    seed, rng_offset = load_rng_state(RNG_STATE, DROPOUT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SUM_ROWS:
        for start_m in range(0, seqlen_q, BLOCK_M):
            acc = _dbias_rows(acc, Q, K, V, DO, LSE, DELTA, BIAS, SEQ_LEN_Q, SEQ_LEN_K,
                              stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
                              stride_vb, stride_vs, stride_vh, stride_vd, stride_dob, stride_dos, stride_doh,
                              stride_dod, stride_lb, stride_lh, stride_zb, stride_zh, stride_zm, stride_zn,
                              start_m + tl.arange(0, BLOCK_M), offs_n, offs_dqk, offs_dv, b_lo, b_hi, h_lo, h_hi,
                              num_heads_q, gqa_group, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                              dropout_p, seed, rng_offset, HEAD_DIM_QK, HEAD_DIM_V, HAS_SEQLENS, HAS_LEFT,
                              HAS_RIGHT, BOTTOM_RIGHT, DROPOUT)
        row = tl.sum(acc, axis=0)
        tl.store(DBIAS + zb.to(tl.int64) * stride_dzb + zh.to(tl.int64) * stride_dzh + offs_n * stride_dzn,
                 row.to(DBIAS.dtype.element_ty), mask=offs_n < seqlen_k)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = _dbias_rows(acc, Q, K, V, DO, LSE, DELTA, BIAS, SEQ_LEN_Q, SEQ_LEN_K,
                          stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
                          stride_vb, stride_vs, stride_vh, stride_vd, stride_dob, stride_dos, stride_doh, stride_dod,
                          stride_lb, stride_lh, stride_zb, stride_zh, stride_zm, stride_zn,
                          offs_m, offs_n, offs_dqk, offs_dv, b_lo, b_hi, h_lo, h_hi, num_heads_q, gqa_group,
                          seqlen_q, seqlen_k, qk_scale, window_left, window_right, dropout_p, seed, rng_offset,
                          HEAD_DIM_QK, HEAD_DIM_V, HAS_SEQLENS, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, DROPOUT)
        tl.store(DBIAS + zb.to(tl.int64) * stride_dzb + zh.to(tl.int64) * stride_dzh
                 + offs_m[:, None] * stride_dzm + offs_n[None, :] * stride_dzn, acc.to(DBIAS.dtype.element_ty),
                 mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))



@triton.jit(do_not_specialize=SEQLEN_ARGS[:1])
def attn_bwd_dsink_kernel(
    LSE, DELTA, SINK, DSINK, SEQ_LEN_Q,
    stride_lb, stride_lh, stride_dsb,
    seqlen_q,
    BLOCK_M: tl.constexpr, HAS_SEQLENS: tl.constexpr,
):
    """One program per (sequence, query head): that sequence's part of the learnable sink's gradient,
    ``DSINK[seq, h] = -sum_i exp(SINK[h] - lse_i) * delta_i`` over its rows ``i < len_q``.

    With ``lse`` including the sink, ``exp(sink - lse_i)`` is row i's sink probability, and
    ``d out_i / d sink = -p_sink_i * out_i``, so the row's share of the gradient is
    ``-p_sink_i * (dO_i . O_i) = -p_sink_i * delta_i`` (dropout included: ``out`` is linear in the
    probabilities). Rows go in ascending blocks of BLOCK_M, one fp32 lane per row of a block, and the
    lanes are summed at the end: a fixed order that depends on the sequence alone, never on the batch
    around it or on packing. The frontends sum the per-sequence parts in a fixed order.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    len_q = seqlen_q
    if HAS_SEQLENS:
        len_q = tl.load(SEQ_LEN_Q + seq)
    sink = tl.load(SINK + head).to(tl.float32)
    base = seq.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
    offs = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, len_q, BLOCK_M):
        rows = start + offs
        ok = rows < len_q
        lse = tl.load(LSE + base + rows, mask=ok, other=float("inf"))
        delta = tl.load(DELTA + base + rows, mask=ok, other=0.0)
        acc += tl.where(ok, tl.math.exp2((sink - lse) * LOG2E) * delta, 0.0)
    tl.store(DSINK + seq.to(tl.int64) * stride_dsb + head, -tl.sum(acc, axis=0))


# Every kernel's cache key computed callees first: the same key in every process, whatever it compiles first.
settle_cache_keys(globals())
