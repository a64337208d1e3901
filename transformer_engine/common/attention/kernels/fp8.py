"""FP8 attention: forward, backward preprocess, dK/dV pass and dQ pass on FP8 operands.

Kernel variants beside forward.py / backward.py, built from the same masking.py helpers: the programs'
set-up (query_block_program, key_block_program), the visibility rule, the block bounds, the sequence
sources and the backward preprocess's block (row_delta, with dO's descale factor); the bf16/fp16/fp32
specializations compile to the code they always did. Launched from the launch description
(launch_description.fp8_forward_launches / fp8_backward_launches). One program per (query block, sequence * query
head) for the forward and dQ, per (key block, sequence * kv head) for dK/dV, which sums over the GQA group's
query heads in order and each head's query blocks in ascending order. No atomics except the amax maxima
(a max of non-negative floats is exact in any order).

What is quantized where (docs/fp8_attention.rst):

- Q, K, V arrive in E4M3 with descale factors (``1 / scale``), one per tensor or one per sequence and kv head
  (as flash-attn 3's ``q/k/v_descale`` [batch, kv heads]), read by each program from a device array DESCALE
  (q, k, v, dO; its batch and kv-head strides 0 for per-tensor scales) so that a delayed-scaling step needs
  no host sync, and folded into
  ``qk_scale`` (``softmax_scale * q_descale * k_descale * log2(e)``) and the output's factor.
- S = Q K^T accumulates in fp32 (tl.dot on FP8 operands: Hopper's FP8 wgmma on sm_90).
- P = exp2(S - m) in [0, 1] (m: the running row max of the online softmax) is quantized to E4M3 as
  ``P * P_SCALE`` with the fixed power-of-two P_SCALE = 256: P = 1 lands on 256 (below E4M3's 448) and the
  scaling is exact, so the only error is E4M3's rounding (relative 2^-4) and the flush of P < 2^-17.
  The row sum l uses the fp32 P, so the normaliser is the exact softmax's.
- O = acc * (v_descale / P_SCALE) / l, written in O's dtype; the amax of the stored O and the amax of the
  softmax output (max_i 1 / l_i, its largest probability) are recorded.
- Backward: dO in E5M2 (Format.HYBRID) or E4M3 (Format.E4M3) with its descale; P recomputed from the saved
  log-sum-exp and quantized as in the forward for dV = P^T dO (an FP8 product); dP = dO V^T is an FP8
  product; dS = P * (dP - delta) stays in fp32 and enters dK = dS^T Q and dQ = dS K in the gradients' dtype
  (Q and K upcast exactly: every E4M3 value is a bf16/fp16 value), not FP8: dS has no scale known before
  the pass (current scaling would need a second pass), and an FP8 dS would lose the gradients' small
  entries. The amax of dS is recorded (TransformerEngine's dP amax).

EXACT_CAST: Triton 3.6's interpreter casts fp32 to FP8 wrongly when rounding carries into the exponent
(1.98 -> 1.0); with EXACT_CAST the value is first rounded to the FP8 grid in fp32 (round to nearest even,
saturating, _round_fp8) so the cast is exact. The GPU's conversion (cvt.rn.satfinite) computes the same
value, so launches on a GPU pass EXACT_CAST=False and cast directly after the same clamp.
"""

import triton
import triton.language as tl

from transformer_engine.common.attention.kernels.masking import (
    key_block_bounds,
    key_block_program,
    load_block,
    mask_scores,
    query_block_bounds,
    query_block_program,
    row_delta,
    segment_bounds,
    sequence_extent,
    sequence_source,
)
from transformer_engine.common.attention.kernels.triton_compat import settle_cache_keys

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _round_fp8(x, E5M2: tl.constexpr):
    """``x`` (fp32) rounded to nearest even on the E4M3 (E5M2) grid, saturated to +-448 (+-57344): normals by
    rounding the float's mantissa to 3 (2) bits, subnormals (below 2^-6, 2^-14) by adding a power of two whose
    float spacing is the subnormal step."""
    if E5M2:
        DROP: tl.constexpr = 21
        MIN_NORMAL: tl.constexpr = 6.103515625e-05  # 2^-14
        MAGIC: tl.constexpr = 128.0  # 2^7: float32 spacing 2^-16, E5M2's subnormal step
        MAX: tl.constexpr = 57344.0
    else:
        DROP: tl.constexpr = 20
        MIN_NORMAL: tl.constexpr = 0.015625  # 2^-6
        MAGIC: tl.constexpr = 16384.0  # 2^14: float32 spacing 2^-9, E4M3's subnormal step
        MAX: tl.constexpr = 448.0
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    lsb = (bits >> DROP) & 1
    normal = (((bits + ((1 << (DROP - 1)) - 1) + lsb) >> DROP) << DROP).to(tl.float32, bitcast=True)
    sub = (a + MAGIC) - MAGIC
    r = tl.minimum(tl.where(a < MIN_NORMAL, sub, normal), MAX)
    return tl.where(x < 0, -r, r)


@triton.jit
def to_fp8(x, DTYPE: tl.constexpr, EXACT_CAST: tl.constexpr):
    """fp32 ``x`` in the FP8 dtype DTYPE (float8e4nv or float8e5), rounded to nearest even and saturated."""
    E5M2: tl.constexpr = DTYPE == tl.float8e5
    if EXACT_CAST:
        y = _round_fp8(x, E5M2)
    else:
        if E5M2:
            y = tl.minimum(tl.maximum(x, -57344.0), 57344.0)
        else:
            y = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return y.to(DTYPE)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_n_base, offs_dqk, offs_dv,
               lo, hi, len_q, len_k, diag, window_left, window_right, qk_scale,
               HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, P_SCALE: tl.constexpr, EXACT_CAST: tl.constexpr):
    """Key blocks [lo, hi) of the online softmax, every block masked when MASKED (forward._fwd_inner's split)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        k = load_block(k_src, start_n, stride_ks, offs_dqk, offs_n_base, len_k, HEAD_DIM_QK, BLOCK_DQK, MASKED, True)
        qk = tl.dot(q, k)  # FP8 x FP8 -> fp32
        if MASKED:
            qk = mask_scores(qk, float("-inf"), offs_m[:, None], offs_n[None, :], start_n, 0, 0, len_q, len_k, diag,
                             window_left, window_right, HAS_LEFT, HAS_RIGHT, False)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED:  # a row with nothing visible so far keeps m = -inf; subtract 0 instead (exp2(-inf) = 0)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_block(v_src, start_n, stride_vs, offs_dv, offs_n_base, len_k, HEAD_DIM_V, BLOCK_DV, MASKED, False)
        acc = acc * alpha[:, None] + tl.dot(to_fp8(p * P_SCALE, v.dtype, EXACT_CAST), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fp8_fwd_kernel(
    Q, K, V, O, LSE, AMAX, DESCALE,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_db, stride_dh,
    num_heads_q, gqa_group, seqlen_q, seqlen_k,
    sm_scale, window_left, window_right,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    P_SCALE: tl.constexpr, EXACT_CAST: tl.constexpr,
):
    """O and the log-sum-exp of one query block of one head (module docstring). DESCALE (fp32 [..., 4]): the
    descale factors of Q, K, V and dO, read on the device (no host sync, graph-capturable), at
    ``batch * stride_db + kv_head * stride_dh`` (strides 0: one per tensor; else per sequence and kv head).
    AMAX (fp32 [3]): max |O| as stored and the softmax's largest probability, raised by atomic max (AMAX[2]:
    the backward's)."""
    tl.static_assert(BLOCK_DQK >= HEAD_DIM_QK)
    tl.static_assert(BLOCK_DV >= HEAD_DIM_V)
    start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = query_block_program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
        BLOCK_M, IS_THD, HAS_SEQLENS, BOTTOM_RIGHT, 1, 1)
    if start_m >= rows_out:
        return
    DESCALE += batch.to(tl.int64) * stride_db + head_kv.to(tl.int64) * stride_dh
    qk_scale = sm_scale * LOG2E * tl.load(DESCALE) * tl.load(DESCALE + 1)
    o_scale = tl.load(DESCALE + 2) / P_SCALE
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + batch.to(tl.int64) * stride_qb + start_q * stride_qs + head.to(tl.int64) * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                mask=(offs_m[:, None] < len_q) & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)
    k_base = K + batch.to(tl.int64) * stride_kb + start_k * stride_ks + head_kv.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + start_k * stride_vs + head_kv.to(tl.int64) * stride_vh
    k_src = sequence_source(k_base, stride_ks, len_k, offs_dqk, offs_n, stride_kd, HEAD_DIM_QK, BLOCK_DQK, BLOCK_N,
                            True)
    v_src = sequence_source(v_base, stride_vs, len_k, offs_dv, offs_n, stride_vd, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
                            False)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_bounds(start_m, len_q, len_k, diag, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for SEGMENT in tl.static_range(3):  # masked head, unmasked middle, masked tail: ascending key blocks
        seg_lo, seg_hi = segment_bounds(SEGMENT, lo, full_lo, full_hi, hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_n, offs_dqk,
                                   offs_dv, seg_lo, seg_hi, len_q, len_k, diag, window_left, window_right, qk_scale,
                                   HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N, SEGMENT != 1,
                                   HAS_LEFT, HAS_RIGHT, P_SCALE, EXACT_CAST)
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    row_ok = offs_m < len_q
    out = tl.where(row_ok[:, None] & seen[:, None], acc * (o_scale / l_safe)[:, None], 0.0)
    lse = tl.where(row_ok & seen, (m_i + tl.math.log2(l_safe)) * LN2, float("inf"))
    out = out.to(O.dtype.element_ty)
    o_base = O + batch.to(tl.int64) * stride_ob + start_q * stride_os + head.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od, out,
             mask=(offs_m[:, None] < rows_out) & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m, lse,
             mask=offs_m < rows_out)
    tl.atomic_max(AMAX, tl.max(tl.max(tl.abs(out.to(tl.float32)), 1), 0))
    tl.atomic_max(AMAX + 1, tl.max(tl.where(row_ok & seen, 1.0 / l_safe, 0.0), 0))


@triton.jit
def attn_fp8_bwd_preprocess_kernel(
    O, DO, DELTA, DESCALE, SEQ_START_Q, SEQ_LEN_Q,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_db, stride_dh, num_heads_q, gqa_group, seqlen_q,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
):
    """delta[b, h, i] = sum_d (dO_fp8[i, d] * do_descale) * O[i, d] in fp32 (do_descale: DESCALE[3]): the bf16
    preprocess's block (masking.row_delta) with dO's descale factor."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_heads_q
    head = pid_bh % num_heads_q
    start_q, len_q = sequence_extent(SEQ_START_Q, SEQ_LEN_Q, batch, seqlen_q, IS_THD, HAS_SEQLENS)
    if start_m >= len_q:
        return
    do_descale = tl.load(DESCALE + batch.to(tl.int64) * stride_db + (head // gqa_group).to(tl.int64) * stride_dh + 3)
    row_delta(O, DO, DELTA, batch, head, start_m, start_q, len_q, stride_ob, stride_os, stride_oh, stride_od,
              stride_dob, stride_dos, stride_doh, stride_dod, stride_lb, stride_lh, do_descale, HEAD_DIM_V, BLOCK_DV,
              BLOCK_M, True)


@triton.jit
def _dkdv_inner(dk, dv, ds_max, k, v, q_src, do_src, lse_ptrs, delta_ptrs, stride_qs, stride_dos,
                offs_n, offs_m_base, offs_dqk, offs_dv, lo, hi, len_q, len_k, diag, window_left, window_right,
                qk_scale, dp_scale, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, P_SCALE: tl.constexpr, EXACT_CAST: tl.constexpr,
                GRAD_DTYPE: tl.constexpr):
    """Query blocks [lo, hi) of one head, ascending (backward._dkdv_inner's order)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m_base
        q_t = load_block(q_src, start_m, stride_qs, offs_dqk, offs_m_base, len_q, HEAD_DIM_QK, BLOCK_DQK, MASKED,
                         True)  # [BLOCK_DQK, BLOCK_M] E4M3
        lse = tl.load(lse_ptrs + offs_m, mask=offs_m < len_q, other=float("inf"))
        p_t = tl.math.exp2(tl.dot(k, q_t) * qk_scale - lse[None, :] * LOG2E)  # [BLOCK_N, BLOCK_M]
        if MASKED:
            p_t = mask_scores(p_t, 0.0, offs_m[None, :], offs_n[:, None], start_m, 0, 0, len_q, len_k, diag,
                              window_left, window_right, HAS_LEFT, HAS_RIGHT, False)
        do = load_block(do_src, start_m, stride_dos, offs_dv, offs_m_base, len_q, HEAD_DIM_V, BLOCK_DV, MASKED,
                        False)  # [BLOCK_M, BLOCK_DV] E5M2 or E4M3
        delta = tl.load(delta_ptrs + offs_m, mask=offs_m < len_q, other=0.0)
        dv += tl.dot(to_fp8(p_t * P_SCALE, tl.float8e4nv, EXACT_CAST), do)
        dp_t = tl.dot(v, tl.trans(do)) * dp_scale  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        ds_max = tl.maximum(ds_max, tl.max(tl.abs(ds_t), 1))
        dk += tl.dot(ds_t.to(GRAD_DTYPE), tl.trans(q_t).to(GRAD_DTYPE))
    return dk, dv, ds_max


@triton.jit
def attn_fp8_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, AMAX, DESCALE,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh, stride_db, stride_dh,
    num_heads_kv, gqa_group: tl.constexpr, seqlen_q, seqlen_k,
    sm_scale, window_left, window_right,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    P_SCALE: tl.constexpr, EXACT_CAST: tl.constexpr,
):
    """dK, dV of one key block of one kv head: summed over the GQA group's query heads in order, each over its
    query blocks in ascending order. AMAX[2] is raised to max |dS|."""
    start_n, batch, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = key_block_program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_kv, seqlen_q, seqlen_k, BLOCK_N, IS_THD,
        HAS_SEQLENS, BOTTOM_RIGHT, 1)
    if start_n >= rows_out:
        return
    DESCALE += batch.to(tl.int64) * stride_db + head_kv.to(tl.int64) * stride_dh
    q_descale = tl.load(DESCALE)
    do_descale = tl.load(DESCALE + 3)
    qk_scale = sm_scale * LOG2E * q_descale * tl.load(DESCALE + 1)
    dp_scale = tl.load(DESCALE + 2) * do_descale
    dk_scale = sm_scale * q_descale
    dv_scale = do_descale / P_SCALE
    GRAD_DTYPE: tl.constexpr = DK.dtype.element_ty
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n[:, None] < len_k
    k = tl.load(K + batch.to(tl.int64) * stride_kb + start_k * stride_ks + head_kv.to(tl.int64) * stride_kh
                + offs_n[:, None] * stride_ks + offs_dqk[None, :] * stride_kd,
                mask=key_ok & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)
    v = tl.load(V + batch.to(tl.int64) * stride_vb + start_k * stride_vs + head_kv.to(tl.int64) * stride_vh
                + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                mask=key_ok & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    ds_max = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo, full_lo, full_hi, hi = query_block_bounds(start_n, len_q, len_k, diag, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for g in range(0, gqa_group):
        head = head_kv * gqa_group + g
        q_base = Q + batch.to(tl.int64) * stride_qb + start_q * stride_qs + head.to(tl.int64) * stride_qh
        q_src = sequence_source(q_base, stride_qs, len_q, offs_dqk, offs_m, stride_qd, HEAD_DIM_QK, BLOCK_DQK,
                                BLOCK_M, True)
        do_src = sequence_source(DO + batch.to(tl.int64) * stride_dob + start_q * stride_dos
                                 + head.to(tl.int64) * stride_doh, stride_dos, len_q, offs_dv, offs_m, stride_dod,
                                 HEAD_DIM_V, BLOCK_DV, BLOCK_M, False)
        lse_ptrs = LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
        delta_ptrs = DELTA + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
        for SEGMENT in tl.static_range(3):
            seg_lo, seg_hi = segment_bounds(SEGMENT, lo, full_lo, full_hi, hi)
            dk, dv, ds_max = _dkdv_inner(dk, dv, ds_max, k, v, q_src, do_src, lse_ptrs, delta_ptrs, stride_qs,
                                         stride_dos, offs_n, offs_m, offs_dqk, offs_dv, seg_lo, seg_hi, len_q, len_k,
                                         diag, window_left, window_right, qk_scale, dp_scale, HEAD_DIM_QK,
                                         HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, SEGMENT != 1, HAS_LEFT,
                                         HAS_RIGHT, P_SCALE, EXACT_CAST, GRAD_DTYPE)
    dk = tl.where(key_ok, dk * dk_scale, 0.0)
    dv = tl.where(key_ok, dv * dv_scale, 0.0)
    out_rows = offs_n[:, None] < rows_out
    tl.store(DK + batch.to(tl.int64) * stride_dkb + start_k * stride_dks + head_kv.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dks + offs_dqk[None, :] * stride_dkd, dk.to(GRAD_DTYPE),
             mask=out_rows & (offs_dqk[None, :] < HEAD_DIM_QK))
    tl.store(DV + batch.to(tl.int64) * stride_dvb + start_k * stride_dvs + head_kv.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=out_rows & (offs_dv[None, :] < HEAD_DIM_V))
    tl.atomic_max(AMAX + 2, tl.max(ds_max, 0))


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, offs_m, offs_n_base, offs_dqk, offs_dv,
              lo, hi, len_q, len_k, diag, window_left, window_right, qk_scale, dp_scale,
              HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              GRAD_DTYPE: tl.constexpr):
    """Key blocks [lo, hi), ascending (backward._dq_inner's order)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        k_t = load_block(k_src, start_n, stride_ks, offs_dqk, offs_n_base, len_k, HEAD_DIM_QK, BLOCK_DQK, MASKED,
                         True)  # [BLOCK_DQK, BLOCK_N]
        v_t = load_block(v_src, start_n, stride_vs, offs_dv, offs_n_base, len_k, HEAD_DIM_V, BLOCK_DV, MASKED,
                         True)  # [BLOCK_DV, BLOCK_N]
        p = tl.math.exp2(tl.dot(q, k_t) * qk_scale - lse2[:, None])
        if MASKED:
            p = mask_scores(p, 0.0, offs_m[:, None], offs_n[None, :], start_n, 0, 0, len_q, len_k, diag,
                            window_left, window_right, HAS_LEFT, HAS_RIGHT, False)
        dp = tl.dot(do, v_t) * dp_scale
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(GRAD_DTYPE), tl.trans(k_t).to(GRAD_DTYPE))
    return dq


@triton.jit
def attn_fp8_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, DESCALE,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh, stride_db, stride_dh,
    num_heads_q, gqa_group, seqlen_q, seqlen_k,
    sm_scale, window_left, window_right,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
):
    """dQ of one query block of one head, over key blocks in ascending order (a separate pass: no atomics)."""
    start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = query_block_program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
        BLOCK_M, IS_THD, HAS_SEQLENS, BOTTOM_RIGHT, 1, 1)
    if start_m >= rows_out:
        return
    GRAD_DTYPE: tl.constexpr = DQ.dtype.element_ty
    DESCALE += batch.to(tl.int64) * stride_db + head_kv.to(tl.int64) * stride_dh
    k_descale = tl.load(DESCALE + 1)
    qk_scale = sm_scale * LOG2E * tl.load(DESCALE) * k_descale
    dp_scale = tl.load(DESCALE + 2) * tl.load(DESCALE + 3)
    dq_scale = sm_scale * k_descale
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    q = tl.load(Q + batch.to(tl.int64) * stride_qb + start_q * stride_qs + head.to(tl.int64) * stride_qh
                + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)
    do = tl.load(DO + batch.to(tl.int64) * stride_dob + start_q * stride_dos + head.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    lse = tl.load(LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m, mask=row_ok,
                  other=float("inf"))
    delta = tl.load(DELTA + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m, mask=row_ok,
                    other=0.0)
    k_base = K + batch.to(tl.int64) * stride_kb + start_k * stride_ks + head_kv.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + start_k * stride_vs + head_kv.to(tl.int64) * stride_vh
    k_src = sequence_source(k_base, stride_ks, len_k, offs_dqk, offs_n, stride_kd, HEAD_DIM_QK, BLOCK_DQK, BLOCK_N,
                            True)
    v_src = sequence_source(v_base, stride_vs, len_k, offs_dv, offs_n, stride_vd, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
                            True)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_bounds(start_m, len_q, len_k, diag, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    lse2 = lse * LOG2E
    for SEGMENT in tl.static_range(3):
        seg_lo, seg_hi = segment_bounds(SEGMENT, lo, full_lo, full_hi, hi)
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, offs_m, offs_n, offs_dqk, offs_dv,
                       seg_lo, seg_hi, len_q, len_k, diag, window_left, window_right, qk_scale, dp_scale,
                       HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_N, SEGMENT != 1, HAS_LEFT, HAS_RIGHT,
                       GRAD_DTYPE)
    dq = tl.where(row_ok[:, None], dq * dq_scale, 0.0)
    tl.store(DQ + batch.to(tl.int64) * stride_dqb + start_q * stride_dqs + head.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqs + offs_dqk[None, :] * stride_dqd, dq.to(GRAD_DTYPE),
             mask=(offs_m[:, None] < rows_out) & (offs_dqk[None, :] < HEAD_DIM_QK))


settle_cache_keys(globals())
