"""Zero the token rows of a packed ``[t, h, d]`` tensor that lie outside every sequence.

For backends that leave those rows unwritten (flash-attn-4's varlen output and gradients). The
rows to clear are the gaps between sequences: before the first, between the end of one
(``start + used``) and the start of the next, and after the last. Work is proportional to the
gap rows only, with no host sync and no per-token mask over the whole tensor.
"""

import triton
import triton.language as tl

from transformer_engine.common.attention.kernels.triton_compat import settle_cache_keys

# Stated like every other launch's (Triton's default changes after 3.9), though this kernel only stores
# zeros: no floating-point arithmetic for contraction to change.
FILL_LAUNCH_OPTIONS = dict(enable_fp_fusion=True)


@triton.jit
def zero_outside_sequences_kernel(
    X, STARTS, USED, num_seqs, total_rows, stride_t, stride_h, stride_d,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (gap g, chunk c): gap g < num_seqs ends where sequence g starts and begins where
    sequence g - 1 ends (row 0 for g = 0); gap num_seqs runs from the last sequence's end to
    ``total_rows``. Chunks of BLOCK_T rows are spread over the programs of axis 1."""
    gap = tl.program_id(0)
    prev = tl.maximum(gap - 1, 0)
    begin = tl.load(STARTS + prev).to(tl.int64) + tl.load(USED + prev).to(tl.int64)
    begin = tl.where(gap > 0, begin, 0)
    end = tl.load(STARTS + tl.minimum(gap, num_seqs - 1)).to(tl.int64)
    end = tl.where(gap < num_seqs, end, total_rows)
    end = tl.minimum(end, total_rows)
    offs_t = tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    cols = offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    col_ok = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    zeros = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_D], dtype=X.dtype.element_ty)
    for row in range(begin + tl.program_id(1) * BLOCK_T, end, tl.num_programs(1) * BLOCK_T):
        rows = row + offs_t
        ptrs = X + rows[:, None, None] * stride_t + cols[None, :, :]
        tl.store(ptrs, zeros, mask=(rows[:, None, None] < end) & col_ok[None, :, :])


def zero_outside_sequences(x, starts, used):
    """In place: rows of ``x`` [t, h, d] outside every ``[starts[n], starts[n] + used[n])`` set to zero
    (sequences in order, not overlapping; ``starts`` has at least ``len(used)`` entries), on the tensors'
    device (CPU: Triton's interpreter). Any framework's tensors Triton launches on (``shape``, ``stride()``,
    ``device.type``). Returns ``x``."""
    t, h, d = x.shape
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    block_t = max(1, min(16, 8192 // (block_h * block_d)))
    # Gap programs on axis 0; axis 1 splits a long gap (usually only the tail after the last sequence).
    chunks = 2 if x.device.type == "cpu" else 16
    zero_outside_sequences_kernel[(used.shape[0] + 1, chunks)](
        x, starts, used, used.shape[0], t, *x.stride(),
        NUM_HEADS=h, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_T=block_t, **FILL_LAUNCH_OPTIONS,
    )
    return x


# Every kernel's cache key computed callees first: the same key in every process, whatever it compiles first.
settle_cache_keys(globals())
