"""Attention forward: one program per (query block, batch * query head), online softmax; split-KV's combine.

Scores live in the log2 domain (``qk_scale = softmax_scale * log2(e)``) so the inner loop uses
exp2. The saved log-sum-exp is in natural-log units, ``+inf`` for rows that see no key (so the
backward's ``exp(s - lse)`` is 0 there and no NaN appears).

Sink softmax (HAS_SINK: off-by-one and learnable): ``SINK[h]`` (fp32, natural-log units, added as it
is: not scaled by the softmax scale) is one more logit in every row of head ``h`` with no value
vector. It joins the running max and sum after the key loop, so the saved log-sum-exp includes it
and the output is ``sum_j p_j v_j`` with ``p`` normalised including it; a row that sees no key
outputs zeros and saves the sink's own logit. The backward kernels need no change: their
probabilities come from that log-sum-exp, and ``delta = rowsum(dO * O)`` is still
``sum_j p_j dp_j`` because the sink has no value.

The canonical sum over keys (KV_CHUNK > 0, ``ForwardPlan.kv_chunk``): a row's keys are taken in chunks of
KV_CHUNK keys aligned at key 0, each chunk's (max, sum, weighted values) computed from scratch by the online
softmax, and the chunks folded in order by ``fold_chunk``. A decode step that splits its keys over programs
(SPLIT_KV: one program per chunk, then ``attn_fwd_combine_kernel`` folds the stored states with the same
``fold_chunk``) thus computes the training forward's bits. A row whose visible keys lie in one chunk gets
the bits of KV_CHUNK = 0 (a chunk folded into the empty state is itself), which is what the launches use
where the keys fit one chunk.

A paged KV cache (PAGE_SIZE > 0, forward only): K and V are the cache's rows and row ``batch`` of PAGE_TABLE lists
the sequence's pages; each key block's rows are ``table[n // PAGE_SIZE] * PAGE_SIZE + n % PAGE_SIZE``, loaded with
the masks the contiguous loads have (a masked block reads no table entry past the sequence). Only the addresses
change: the same values reach the same arithmetic, so a paged call gives the bits of the call on gathered rows.

Every ``tl.dot`` asks for ``input_precision="ieee"``: fp32 operands get true fp32 products (no TF32), and
for fp16/bf16 operands it changes no instruction; it is the one value every Triton target accepts.
"""

import triton
import triton.language as tl

from transformer_engine.common.attention.kernels.triton_compat import settle_cache_keys

from transformer_engine.common.attention.kernels.masking import (
    chunk_bounds,
    key_block_bounds,
    length_specialized,
    load_block,
    load_tile,
    mask_scores,
    query_block_program,
    segment_bounds,
    sequence_source,
)
from transformer_engine.common.attention.kernels.scores import (
    bias_log2,
    dropout_keep,
    head_score_mods,
    load_rng_state,
)

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _page_rows(pages, offs_n, len_k, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache rows (int64) of keys ``offs_n`` of one sequence whose pages ``pages`` lists: key n is row
    n % PAGE_SIZE of page pages[n // PAGE_SIZE]. A masked block reads no table entry past the sequence's keys
    (those rows get page 0 and their K/V loads are masked off as before)."""
    if MASKED:
        page = tl.load(pages + offs_n // PAGE_SIZE, mask=offs_n < len_k, other=0)
    else:
        page = tl.load(pages + offs_n // PAGE_SIZE)
    return page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, q2, k_src, k_src2, v_src, stride_ks, stride_vs, pages,
               offs_m, offs_n_base, offs_dqk, offs_dqk2, offs_dv, lo, hi, full_lo, full_hi,
               len_q, len_k, diag, window_left, window_right, qk_scale,
               bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head, dropout_p,
               HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, SINGLE_LOOP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Key blocks [lo, hi); MASKED applies the element mask, to every block or, with SINGLE_LOOP, to
    those outside [full_lo, full_hi) only (a runtime branch). With BLOCK_DQK2 > 0 the Q/K head dim is two
    chunks (q, k_src: [0, BLOCK_DQK); q2, k_src2: the next BLOCK_DQK2 columns); otherwise q2, k_src2 and
    offs_dqk2 are unused. PAGE_SIZE > 0: the sources are head-dim column pointers and each block's rows come
    from the sequence's page table ``pages`` (_page_rows); the same values reach the same arithmetic."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        if PAGE_SIZE > 0:
            rows = _page_rows(pages, offs_n, len_k, PAGE_SIZE, MASKED)
            k = load_tile(k_src + rows[None, :] * stride_ks, offs_dqk[:, None], offs_n[None, :], len_k, HEAD_DIM_QK,
                          BLOCK_DQK, MASKED)
        else:
            k = load_block(k_src, start_n, stride_ks, offs_dqk, offs_n_base, len_k, HEAD_DIM_QK, BLOCK_DQK, MASKED,
                           True)
        if BLOCK_DQK2 > 0:  # the second chunk's product accumulates onto the first's: a fixed order
            if PAGE_SIZE > 0:
                k2 = load_tile(k_src2 + rows[None, :] * stride_ks, offs_dqk2[:, None], offs_n[None, :], len_k,
                               HEAD_DIM_QK, BLOCK_DQK + BLOCK_DQK2, MASKED)
            else:
                k2 = load_block(k_src2, start_n, stride_ks, offs_dqk2, offs_n_base, len_k, HEAD_DIM_QK,
                                BLOCK_DQK + BLOCK_DQK2, MASKED, True)
            qk = tl.dot(q2, k2, tl.dot(q, k, input_precision="ieee"), input_precision="ieee")
        else:
            qk = tl.dot(q, k, input_precision="ieee")
        if HAS_BIAS or HAS_ALIBI:
            # One explicit FMA: `qk * qk_scale + bias` has two products the compiler may contract either way,
            # and its choice can differ between kernel variants (top-left and bottom-right diagonals), which
            # would break the bitwise equality of training and KV-cache rows.
            qk = tl.fma(qk, qk_scale, bias_log2(bias_base, offs_m[:, None], offs_n[None, :], len_q, len_k, stride_zm,
                                                stride_zn, alibi_slope, diag, HAS_BIAS, HAS_ALIBI))
            scale = 1.0
        else:
            # The scale is applied inside exp2's argument (one FMA per score) and to the row max, which
            # equals the max of the scaled scores since the scale is positive.
            scale = qk_scale
        if MASKED:
            qk = mask_scores(qk, float("-inf"), offs_m[:, None], offs_n[None, :], start_n, full_lo, full_hi, len_q,
                             len_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT, SINGLE_LOOP)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
        if MASKED or HAS_BIAS:  # a -inf bias can hide whole rows too
            # A row with nothing visible so far keeps m = -inf; subtract 0 instead (exp2(-inf) = 0).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(qk * scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # the normaliser counts every probability; only the weighted sum drops some
            p = tl.where(dropout_keep(seed, rng_offset, seq_head, offs_m[:, None], offs_n[None, :], dropout_p),
                         p, 0.0)
        if PAGE_SIZE > 0:
            v = load_tile(v_src + rows[:, None] * stride_vs, offs_dv[None, :], offs_n[:, None], len_k, HEAD_DIM_V,
                          BLOCK_DV, MASKED)
        else:
            v = load_block(v_src, start_n, stride_vs, offs_dv, offs_n_base, len_k, HEAD_DIM_V, BLOCK_DV, MASKED,
                           False)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_range(acc, l_i, m_i, q, q2, k_src, k_src2, v_src, stride_ks, stride_vs, pages,
               offs_m, offs_n, offs_dqk, offs_dqk2, offs_dv, lo, full_lo, full_hi, hi,
               len_q, len_k, diag, window_left, window_right, qk_scale,
               bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head, dropout_p,
               HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
               SINGLE_LOOP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The online softmax over key blocks [lo, hi) (key_block_bounds' split: [full_lo, full_hi) unmasked)."""
    if SINGLE_LOOP:  # one pipelined loop over [lo, hi), masking blocks outside [full_lo, full_hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q2, k_src, k_src2, v_src, stride_ks, stride_vs, pages,
                                   offs_m, offs_n, offs_dqk, offs_dqk2, offs_dv, lo, hi, full_lo, full_hi,
                                   len_q, len_k, diag, window_left, window_right, qk_scale,
                                   bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head, dropout_p,
                                   HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                                   True, True, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, DROPOUT, PAGE_SIZE)
    else:  # masked head, unmasked middle (no per-element mask: the fast path), masked tail
        for SEGMENT in tl.static_range(3):
            seg_lo, seg_hi = segment_bounds(SEGMENT, lo, full_lo, full_hi, hi)
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q2, k_src, k_src2, v_src, stride_ks, stride_vs, pages,
                                       offs_m, offs_n, offs_dqk, offs_dqk2, offs_dv, seg_lo, seg_hi, full_lo, full_hi,
                                       len_q, len_k, diag, window_left, window_right, qk_scale,
                                       bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head,
                                       dropout_p, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                                       SEGMENT != 1, False, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, DROPOUT,
                                       PAGE_SIZE)
    return acc, l_i, m_i


@triton.jit
def fold_chunk(acc, l_i, m_i, acc_c, l_c, m_c):
    """The running state (acc, l, m) with one more key chunk's state folded in: the canonical sum's
    combination step, shared by the chunked forward and the split-KV combine so that both give the same
    bits. Explicit FMAs: with two products in a sum the compiler's contraction could differ per kernel.
    A chunk with nothing visible (m_c = -inf, l_c = 0, acc_c = 0) changes nothing, and a chunk folded
    into the empty state is returned as it is."""
    m_new = tl.maximum(m_i, m_c)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    beta = tl.math.exp2(m_c - m_use)
    l_i = tl.fma(l_i, alpha, l_c * beta)
    acc = tl.fma(acc, alpha[:, None], acc_c * beta[:, None])
    return acc, l_i, m_new


@triton.jit
def _finish_rows(acc, l_i, m_i, offs_m, offs_dv, len_q, rows_out, batch, head, start_q, dropout_p,
                 SINK, O, LSE, ROW_MAX, stride_ob, stride_os, stride_oh, stride_od, stride_lb, stride_lh,
                 HEAD_DIM_V: tl.constexpr, HAS_SINK: tl.constexpr, HAS_ROW_MAX: tl.constexpr, DROPOUT: tl.constexpr):
    """From a row block's final state over every key: the sink joins, then O, the log-sum-exp and the row max."""
    m_keys = m_i  # the row's max over its visible keys' scores (log2 units), before the sink joins
    if HAS_SINK:  # the sink's logit joins the row max and sum (module docstring)
        sink = tl.load(SINK + head).to(tl.float32) * LOG2E
        m_sink = tl.maximum(m_i, sink)
        m_use = tl.where(m_sink == float("-inf"), 0.0, m_sink)  # no key and a -inf sink: l stays 0
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.math.exp2(sink - m_use)
        acc = acc * alpha[:, None]
        m_i = m_sink

    # l_i is a sum of exp2 terms: 0 when the row saw no key, NaN when a score was NaN or inf (then the
    # output and lse are NaN, as in the math reference, rather than hidden as an empty row).
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    row_ok = offs_m < len_q
    inv_keep = 1.0
    if DROPOUT:
        inv_keep = 1.0 / (1.0 - dropout_p)
    out = tl.where(row_ok[:, None] & seen[:, None], acc * (inv_keep / l_safe)[:, None], 0.0)
    lse = tl.where(row_ok & seen, (m_i + tl.math.log2(l_safe)) * LN2, float("inf"))

    o_base = O + batch.to(tl.int64) * stride_ob + start_q * stride_os + head.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < rows_out) & (offs_dv[None, :] < HEAD_DIM_V))
    lse_base = LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
    tl.store(lse_base + offs_m, lse, mask=offs_m < rows_out)
    if HAS_ROW_MAX:  # each row's max logit (natural units; -inf where nothing is visible), laid out as lse
        row_max = tl.where(row_ok & (m_keys != float("-inf")), m_keys * LN2, float("-inf"))
        row_max_base = ROW_MAX + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
        tl.store(row_max_base + offs_m, row_max, mask=offs_m < rows_out)


@triton.jit
def _partial_rows(offs_m, chunk, batch, head, num_heads_q, seqlen_q, split_rows):
    """Row indices of a row block's state in the split-KV workspace, laid out [chunk, sequence, head, row]."""
    return (batch * num_heads_q + head).to(tl.int64) * seqlen_q + offs_m + chunk * split_rows


@length_specialized
def attn_fwd_kernel(
    Q, K, V, O, LSE, ROW_MAX, PART_O, PART_ML, BIAS, ALIBI_SLOPES, RNG_STATE, PAGE_TABLE,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh,
    stride_zb, stride_zh, stride_zm, stride_zn, stride_alibi_b, stride_pt,
    num_heads_q, gqa_group, seqlen_q, seqlen_k,
    qk_scale, window_left, window_right, dropout_p, SINK, split_rows,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr,
    HAS_ROW_MAX: tl.constexpr, HEAD_GROUP: tl.constexpr, SINGLE_LOOP: tl.constexpr, SEGMENTS: tl.constexpr,
    KV_CHUNK: tl.constexpr, SPLIT_KV: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    # A split Q/K head dim (BLOCK_DQK2 > 0) fills its first chunk: the loops load it without a head-dim mask.
    tl.static_assert(BLOCK_DQK + BLOCK_DQK2 >= HEAD_DIM_QK)
    tl.static_assert((BLOCK_DQK2 == 0) | (BLOCK_DQK < HEAD_DIM_QK))
    tl.static_assert(BLOCK_DV >= HEAD_DIM_V)
    start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = query_block_program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
        BLOCK_M, IS_THD, HAS_SEQLENS, BOTTOM_RIGHT, HEAD_GROUP, SEGMENTS)
    if start_m >= rows_out:
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = Q + batch.to(tl.int64) * stride_qb + start_q * stride_qs + head.to(tl.int64) * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                mask=(offs_m[:, None] < len_q) & (offs_dqk[None, :] < HEAD_DIM_QK), other=0.0)
    offs_dqk2, q2 = offs_dqk, q
    if BLOCK_DQK2 > 0:
        offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        q2 = tl.load(q_base + offs_m[:, None] * stride_qs + offs_dqk2[None, :] * stride_qd,
                     mask=(offs_m[:, None] < len_q) & (offs_dqk2[None, :] < HEAD_DIM_QK), other=0.0)
    if PAGE_SIZE > 0:
        # A paged KV cache: K and V are the cache's rows (page p's row r at p * PAGE_SIZE + r), this sequence's
        # pages listed in row `batch` of PAGE_TABLE; the sources are head-dim columns, each block's rows come
        # from the table (_fwd_inner).
        pages = PAGE_TABLE + batch.to(tl.int64) * stride_pt
        k_base = K + head_kv.to(tl.int64) * stride_kh
        v_base = V + head_kv.to(tl.int64) * stride_vh
        k_src = k_base + offs_dqk[:, None] * stride_kd
        k_src2 = k_base + offs_dqk2[:, None] * stride_kd
        v_src = v_base + offs_dv[None, :] * stride_vd
    else:
        pages = PAGE_TABLE  # never read
        k_base = K + batch.to(tl.int64) * stride_kb + start_k * stride_ks + head_kv.to(tl.int64) * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + start_k * stride_vs + head_kv.to(tl.int64) * stride_vh
        k_src = sequence_source(k_base, stride_ks, len_k, offs_dqk, offs_n, stride_kd, HEAD_DIM_QK, BLOCK_DQK,
                                BLOCK_N, True)
        # The second Q/K chunk (BLOCK_DQK2 > 0: head-dim columns [BLOCK_DQK, BLOCK_DQK + BLOCK_DQK2)); without a
        # split the names stand for the first chunk and are never read.
        k_src2 = k_src
        if BLOCK_DQK2 > 0:
            k_src2 = sequence_source(k_base, stride_ks, len_k, offs_dqk2, offs_n, stride_kd, HEAD_DIM_QK, BLOCK_DQK2,
                                     BLOCK_N, True)
        v_src = sequence_source(v_base, stride_vs, len_k, offs_dv, offs_n, stride_vd, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
                                False)

    bias_base, alibi_slope = head_score_mods(BIAS, ALIBI_SLOPES, batch, head, stride_zb, stride_zh, stride_alibi_b,
                                             HAS_ALIBI)
    seed, rng_offset = load_rng_state(RNG_STATE, DROPOUT)
    seq_head = batch * num_heads_q + head

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_block_bounds(start_m, len_q, len_k, diag, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if KV_CHUNK == 0:
        acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q2, k_src, k_src2, v_src, stride_ks, stride_vs, pages,
                                   offs_m, offs_n, offs_dqk, offs_dqk2, offs_dv, lo, full_lo, full_hi, hi,
                                   len_q, len_k, diag, window_left, window_right, qk_scale,
                                   bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head, dropout_p,
                                   HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                                   SINGLE_LOOP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, DROPOUT, PAGE_SIZE)
    else:
        # The canonical sum over keys in chunks of KV_CHUNK (module docstring): each chunk's state from scratch,
        # folded in chunk order. SPLIT_KV: this program computes chunk program_id(2) alone and stores its state.
        if SPLIT_KV:  # the chunk's state is this program's whole state (a chunk folded into nothing is itself)
            c_lo = tl.program_id(2) * KV_CHUNK
            lo_c, full_lo_c, full_hi_c, hi_c = chunk_bounds(c_lo, KV_CHUNK, lo, full_lo, full_hi, hi)
            acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q2, k_src, k_src2, v_src, stride_ks, stride_vs, pages,
                                       offs_m, offs_n, offs_dqk, offs_dqk2, offs_dv, lo_c, full_lo_c, full_hi_c,
                                       hi_c, len_q, len_k, diag, window_left, window_right, qk_scale,
                                       bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head,
                                       dropout_p, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_N,
                                       SINGLE_LOOP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, DROPOUT, PAGE_SIZE)
        else:
            for c_lo in range((lo // KV_CHUNK) * KV_CHUNK, hi, KV_CHUNK):
                lo_c, full_lo_c, full_hi_c, hi_c = chunk_bounds(c_lo, KV_CHUNK, lo, full_lo, full_hi, hi)
                m_c = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_c = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc_c = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
                acc_c, l_c, m_c = _key_range(acc_c, l_c, m_c, q, q2, k_src, k_src2, v_src, stride_ks, stride_vs,
                                             pages, offs_m, offs_n, offs_dqk, offs_dqk2, offs_dv, lo_c, full_lo_c,
                                             full_hi_c, hi_c, len_q, len_k, diag, window_left, window_right, qk_scale,
                                             bias_base, stride_zm, stride_zn, alibi_slope, seed, rng_offset, seq_head,
                                             dropout_p, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                                             BLOCK_N, SINGLE_LOOP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, DROPOUT,
                                             PAGE_SIZE)
                acc, l_i, m_i = fold_chunk(acc, l_i, m_i, acc_c, l_c, m_c)

    if SPLIT_KV:  # this chunk's state, unnormalised, for attn_fwd_combine_kernel
        rows = _partial_rows(offs_m, tl.program_id(2), batch, head, num_heads_q, seqlen_q, split_rows)
        keep = offs_m < rows_out
        tl.store(PART_O + rows[:, None] * HEAD_DIM_V + offs_dv[None, :], acc,
                 mask=keep[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
        tl.store(PART_ML + rows, m_i, mask=keep)
        tl.store(PART_ML + tl.num_programs(2) * split_rows + rows, l_i, mask=keep)
    else:
        _finish_rows(acc, l_i, m_i, offs_m, offs_dv, len_q, rows_out, batch, head, start_q, dropout_p,
                     SINK, O, LSE, ROW_MAX, stride_ob, stride_os, stride_oh, stride_od, stride_lb, stride_lh,
                     HEAD_DIM_V, HAS_SINK, HAS_ROW_MAX, DROPOUT)


@triton.jit
def attn_fwd_combine_kernel(
    PART_O, PART_ML, O, LSE, ROW_MAX, SINK,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_ob, stride_os, stride_oh, stride_od, stride_lb, stride_lh,
    num_heads_q, gqa_group, seqlen_q, seqlen_k, dropout_p, split_rows, num_chunks,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_ROW_MAX: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Split-KV's second launch: one program per (row block, sequence * head) folds the chunks' states in
    chunk order (fold_chunk, as the chunked forward does in one program) and writes O, LSE and the row max."""
    start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = query_block_program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
        BLOCK_M, IS_THD, HAS_SEQLENS, BOTTOM_RIGHT, 1, 1)
    if start_m >= rows_out:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    keep = offs_m < rows_out
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for chunk in range(0, num_chunks):
        rows = _partial_rows(offs_m, chunk, batch, head, num_heads_q, seqlen_q, split_rows)
        m_c = tl.load(PART_ML + rows, mask=keep, other=float("-inf"))
        l_c = tl.load(PART_ML + num_chunks * split_rows + rows, mask=keep, other=0.0)
        acc_c = tl.load(PART_O + rows[:, None] * HEAD_DIM_V + offs_dv[None, :],
                        mask=keep[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        acc, l_i, m_i = fold_chunk(acc, l_i, m_i, acc_c, l_c, m_c)
    _finish_rows(acc, l_i, m_i, offs_m, offs_dv, len_q, rows_out, batch, head, start_q, dropout_p,
                 SINK, O, LSE, ROW_MAX, stride_ob, stride_os, stride_oh, stride_od, stride_lb, stride_lh,
                 HEAD_DIM_V, HAS_SINK, HAS_ROW_MAX, DROPOUT)


# Every kernel's cache key computed callees first: the same key in every process, whatever it compiles first.
settle_cache_keys(globals())
