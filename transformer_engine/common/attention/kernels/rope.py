"""Rotary position embedding: one elementwise pass per direction over a ``[.., h, d]`` tensor.

``rope_kernel`` rotates the first ``ROT_DIM`` channels of every head of a token by that token's
angles and copies the other channels. The angles enter as two fp32 tables, ``cos`` and ``sin`` of
shape ``[s2, ROT_DIM]`` (the caller computes them once from ``freqs``); the kernel finds each token's
row: its index in its sequence, moved by context parallelism's load-balanced split and by the
sequence's start position, as the PyTorch frontend's ``attention/rope.py`` describes. Packed (thd)
tokens find their sequence by a binary search of ``cu_seqlens`` (no host sync); rows after the last
sequence are copied unchanged.

Forward, channel ``c`` with partner ``p`` (``c ^ 1`` interleaved, ``c +- ROT_DIM/2`` otherwise):
``out[c] = x[c] cos[c] -+ x[p] sin[c]``. Backward (the transpose, a rotation by the negated angle):
``dx[c] = dy[c] cos[c] +- dy[p] sin[p]``. Both in fp32, two products and one sum, each rounded
(launched without FMA contraction), then rounded once to the output dtype: the same operations in the
same order as the framework's unfused path, so the same bits. Each output element is written by one
program from its own inputs: deterministic, no atomics.

A token whose angle row falls outside the table (a ``start_positions`` or ``cu_seqlens`` value the
host could not check without a sync) gets NaN rather than a read out of bounds.
"""

import triton
import triton.language as tl

from transformer_engine.common.attention.kernels.triton_compat import settle_cache_keys

__all__ = ["rope_kernel", "rope", "ROPE_LAUNCH_OPTIONS"]

# No FMA contraction: ``a * b + c * d`` stays two rounded products and a rounded sum, the unfused path's
# arithmetic, so fused and unfused agree bitwise. Stated on every launch so a change of Triton's default
# (on through Triton 3.9) cannot change the bits.
ROPE_LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


@triton.jit
def _bf16_round_to_nearest_even(y):
    """fp32 to bf16 rounded to nearest even by integer arithmetic on the bits (NaN to the canonical NaN, as
    the frameworks round). For Triton's interpreter, whose fp32-to-bf16 cast truncates; compiled kernels
    convert with the hardware's round-to-nearest-even and never take this."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(y != y, 0x7FC0, bits)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def rope_kernel(
    X, OUT, COS, SIN, CU_SEQLENS, START_POSITIONS,
    seq_len, batch, table_rows, cp_size, cp_rank, search_steps,
    stride_xs, stride_xb, stride_xh, stride_xd, stride_os, stride_ob, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, IS_THD: tl.constexpr,
    BATCH_MAJOR: tl.constexpr, HAS_START: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    ROUND_BF16_BY_BITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``i``: one token (all heads). sbhd/bshd: token (s, b) of ``seq_len * batch``
    (``BATCH_MAJOR``: ``i = b * seq_len + s``, else ``s * batch + b``; the order only changes which
    programs run side by side); thd: row ``i`` of the packed tensor, ``batch`` sequences."""
    pid = tl.program_id(0).to(tl.int64)
    if IS_THD:
        row_s = pid
        row_b = pid * 0
        # Sequence n of token pid: the last n < batch with cu_seqlens[n] // cp_size <= pid (this rank's
        # boundaries are the global padded ones divided by cp_size).
        lo = pid * 0
        hi = lo + batch - 1
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            below = tl.load(CU_SEQLENS + mid).to(tl.int64) // cp_size <= pid
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid - 1)
        seq = lo
        start = tl.load(CU_SEQLENS + seq).to(tl.int64) // cp_size
        end = tl.load(CU_SEQLENS + seq + 1).to(tl.int64) // cp_size
        last = tl.load(CU_SEQLENS + batch).to(tl.int64) // cp_size
        local = pid - start
        length = end - start
    else:
        if BATCH_MAJOR:
            seq = pid // seq_len
            local = pid % seq_len
        else:
            seq = pid % batch
            local = pid // batch
        row_s = local
        row_b = seq
        length = seq_len + pid * 0
    # Context parallelism: this rank holds chunks cp_rank and 2 cp_size - 1 - cp_rank of 2 cp_size.
    half = length // 2
    pos = tl.where(local < half, local + cp_rank * half, local + length * cp_size - (cp_rank + 1) * half - half)
    pos = tl.where(cp_size == 1, local, pos)
    if HAS_START:
        pos += tl.load(START_POSITIONS + seq).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    # The token's conditions as vectors over the channels: Triton 3.9's interpreter refuses a mask made by
    # combining a vector with a scalar condition.
    pos_d = pos + tl.zeros([BLOCK_D], dtype=tl.int64)
    in_table = (pos_d >= 0) & (pos_d < table_rows)
    if IS_THD:
        inside = pid + tl.zeros([BLOCK_D], dtype=tl.int64) < last
    else:
        inside = offs_d >= 0
    rotated = offs_d < ROT_DIM
    if INTERLEAVED:
        partner = offs_d ^ 1
        first = offs_d % 2 == 0
    else:
        first = offs_d < ROT_DIM // 2
        partner = tl.where(first, offs_d + ROT_DIM // 2, offs_d - ROT_DIM // 2)
    angle_ok = rotated & in_table
    table = COS + pos * ROT_DIM
    cos = tl.load(table + offs_d, mask=angle_ok, other=float("nan"))
    sin_table = SIN + pos * ROT_DIM
    if BACKWARD:
        sin = tl.load(sin_table + partner, mask=angle_ok, other=float("nan"))
    else:
        sin = tl.load(sin_table + offs_d, mask=angle_ok, other=float("nan"))
    # Forward subtracts the partner's product on the first channel of each pair, the transpose on the second.
    if BACKWARD:
        subtract = ~first
    else:
        subtract = first
    keep = ~(rotated & inside)  # channels past ROT_DIM and rows after the last sequence: copied

    x_row = X + row_s * stride_xs + row_b * stride_xb
    o_row = OUT + row_s * stride_os + row_b * stride_ob
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        ok = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
        x_ptrs = x_row + offs_h[:, None] * stride_xh
        x = tl.load(x_ptrs + offs_d[None, :] * stride_xd, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(x_ptrs + partner[None, :] * stride_xd, mask=ok & rotated[None, :], other=0.0).to(tl.float32)
        a = x * cos[None, :]
        b = xp * sin[None, :]
        y = tl.where(subtract[None, :], a - b, a + b)
        y = tl.where(keep[None, :], x, y)
        o_ptrs = o_row + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od
        if ROUND_BF16_BY_BITS:
            tl.store(o_ptrs, _bf16_round_to_nearest_even(y), mask=ok)
        else:
            tl.store(o_ptrs, y.to(OUT.dtype.element_ty), mask=ok)


def rope(x, out, cos, sin, tensor_format, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0,
         interleaved=False, backward=False):
    """Writes into ``out`` (``x``'s shape and dtype) ``x`` rotated (``backward``: by the transposed rotation)
    by the angles whose cos and sin are ``cos`` and ``sin`` (contiguous fp32 ``[s2, d2]``); ``tensor_format``
    "sbhd", "bshd" or "thd" (with ``cu_seqlens``, ``[b + 1]`` integers, global padded boundaries with context
    parallelism); ``start_positions`` ``[b]`` integers or None. Every tensor on one device (CPU: Triton's
    interpreter); any framework's tensors that Triton launches on (``shape``, ``stride()``). Arguments are
    expected checked (the frontend does). Returns ``out``."""
    heads, head_dim = x.shape[-2], x.shape[-1]
    rot_dim = cos.shape[-1]
    thd = tensor_format == "thd"
    if thd:
        seq_len, batch = x.shape[0], cu_seqlens.shape[0] - 1
        (sx, _, _), (so, _, _) = x.stride(), out.stride()
        xs, os_ = (sx, 0, *x.stride()[1:]), (so, 0, *out.stride()[1:])
        programs = x.shape[0]
    else:
        s_dim, b_dim = (0, 1) if tensor_format == "sbhd" else (1, 0)
        seq_len, batch = x.shape[s_dim], x.shape[b_dim]
        xs = (x.stride(s_dim), x.stride(b_dim), x.stride(2), x.stride(3))
        os_ = (out.stride(s_dim), out.stride(b_dim), out.stride(2), out.stride(3))
        programs = seq_len * batch
    if programs == 0 or heads == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // block_d))
    num_warps = max(1, min(8, block_h * block_d // 256))
    search_steps = max(0, batch - 1).bit_length() if thd else 0
    placeholder = cos  # never read: the pointer arguments that the flags switch off
    rope_kernel[(programs,)](
        x, out, cos, sin, cu_seqlens if thd else placeholder,
        placeholder if start_positions is None else start_positions,
        seq_len, batch, cos.shape[0], cp_size, cp_rank, search_steps, *xs, *os_,
        NUM_HEADS=heads, HEAD_DIM=head_dim, ROT_DIM=rot_dim, IS_THD=thd, BATCH_MAJOR=tensor_format == "bshd",
        HAS_START=start_positions is not None, INTERLEAVED=bool(interleaved), BACKWARD=bool(backward),
        ROUND_BF16_BY_BITS=x.device.type == "cpu" and str(out.dtype).endswith("bfloat16"),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps, **ROPE_LAUNCH_OPTIONS,
    )
    return out


# Every kernel's cache key computed callees first: the same key in every process, whatever it compiles first.
settle_cache_keys(globals())
