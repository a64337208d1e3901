"""What is added to, or dropped from, the attention scores: bias, ALiBi and dropout.

All helpers take query/key index tensors already broadcast to the tile (so the same code
serves [BLOCK_M, BLOCK_N] and transposed [BLOCK_N, BLOCK_M] tiles), with indices relative to
the start of the sequence: bias and dropout depend on (sequence, head, i, j) only, never on
where a sequence sits in a batch or a packed tensor.
"""

import triton
import triton.language as tl
from triton.language.random import philox, uint_to_uniform_float

LOG2E_S = tl.constexpr(1.4426950408889634)


@triton.jit
def head_score_mods(BIAS, ALIBI_SLOPES, batch, head, stride_zb, stride_zh, stride_alibi_b,
                    HAS_ALIBI: tl.constexpr):
    """(bias base pointer, ALiBi slope) for one (sequence, query head)."""
    bias_base = BIAS + batch.to(tl.int64) * stride_zb + head.to(tl.int64) * stride_zh
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(ALIBI_SLOPES + batch * stride_alibi_b + head).to(tl.float32)
    return bias_base, alibi_slope


@triton.jit
def load_rng_state(RNG_STATE, DROPOUT: tl.constexpr):
    """(seed, offset) of the dropout RNG; zeros when there is no dropout."""
    seed = 0
    rng_offset = 0
    if DROPOUT:
        seed = tl.load(RNG_STATE)
        rng_offset = tl.load(RNG_STATE + 1)
    return seed, rng_offset


@triton.jit
def bias_log2(bias_base, q_idx, k_idx, len_q, len_k, stride_bm, stride_bn, alibi_slope, diag,
              HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """post_scale_bias (+ ALiBi ``-slope * |j - (i + diag)|``) in log2 units for one tile."""
    extra = (q_idx * 0 + k_idx * 0).to(tl.float32)
    if HAS_BIAS:
        extra += tl.load(bias_base + q_idx * stride_bm + k_idx * stride_bn, mask=(q_idx < len_q) & (k_idx < len_k),
                         other=0.0).to(tl.float32)
    if HAS_ALIBI:
        dist = tl.abs(k_idx - (q_idx + diag)).to(tl.float32)
        extra = extra - alibi_slope * dist
    return extra * LOG2E_S


@triton.jit
def dropout_keep(seed, rng_offset, seq_head, q_idx, k_idx, dropout_p):
    """Boolean tile: element (seq_head, i, j) survives dropout.

    Philox counters are (j, i, sequence * heads + head, offset): a pure function of the element
    and the (seed, offset) pair, so forward and backward, and every layout, see the same mask.
    """
    zero = q_idx * 0 + k_idx * 0  # broadcasts both index tensors to the tile
    c0 = (k_idx + zero).to(tl.uint32)
    c1 = (q_idx + zero).to(tl.uint32)
    c2 = (zero + seq_head).to(tl.uint32)
    c3 = (zero + rng_offset).to(tl.uint32)
    r0, _, _, _ = philox(seed, c0, c1, c2, c3)
    return uint_to_uniform_float(r0) >= dropout_p
