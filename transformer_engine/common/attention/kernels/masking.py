"""Which keys a query sees, and which key (query) blocks a query (key) block must visit.

Query row ``i`` sees key ``j`` when ``j < len_k`` and ``-left <= j - (i + diag) <= right``, with
``diag = len_k - len_q`` for bottom-right aligned masks and 0 otherwise; an unbounded side
(``HAS_LEFT``/``HAS_RIGHT`` false) drops that inequality. Loop bounds split the visited blocks
into a masked head, an unmasked middle (no per-element mask: the fast path) and a masked tail.
Every bound depends only on positions inside one sequence, never on the batch or on where the
sequence sits in a packed tensor: that is what makes results batch- and packing-invariant. The Gluon
kernels (hopper_ws.py) call visible and the block bounds too (tests/common/test_block_bounds.py checks
the bounds against the element-wise rule).
"""

import triton
import triton.language as tl

# Triton specializes an int argument equal to 1 as a constant and one divisible by 16 with an
# alignment hint. The block-loop kernels keep both for the sequence lengths (the hint drops mask
# selects from the block loops), except for a length of 1, where a launch
# takes the kernel's `length_generic` twin, the same source with the lengths runtime values: the
# s_q = 1 constant variant of the d=256 dQ kernel made an illegal memory access on sm_90, and the
# generic code is what every length not divisible by 16 runs. Numerics are the same either way. The
# preprocess and sink-gradient kernels, where the hint buys nothing, keep seqlen_q generic always.
SEQLEN_ARGS = ("seqlen_q", "seqlen_k")


def length_specialized(fn):
    """``triton.jit(fn)``, carrying ``length_generic``: the same kernel with ``SEQLEN_ARGS`` not
    specialized (the launch description takes it when a sequence length is 1)."""
    kernel = triton.jit(fn)
    kernel.length_generic = triton.jit(fn, do_not_specialize=SEQLEN_ARGS)
    return kernel


@triton.jit
def visible(q_idx, k_idx, len_q, len_k, diag, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Boolean tile: query ``q_idx`` sees key ``k_idx`` (index tensors broadcast to the tile shape,
    so the same rule serves [BLOCK_M, BLOCK_N] and transposed [BLOCK_N, BLOCK_M] tiles)."""
    keep = (k_idx < len_k) & (q_idx < len_q)
    rel = k_idx - (q_idx + diag)
    if HAS_RIGHT:
        keep = keep & (rel <= window_right)
    if HAS_LEFT:
        keep = keep & (rel >= -window_left)
    return keep


@triton.jit
def mask_scores(scores, fill, q_idx, k_idx, start, full_lo, full_hi, len_q, len_k, diag, window_left, window_right,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SINGLE_LOOP: tl.constexpr):
    """``scores`` with ``fill`` where the query does not see the key, for a block of a masked loop;
    with SINGLE_LOOP (one loop over every visited block) only when the block at ``start`` lies outside
    [full_lo, full_hi), a runtime branch."""
    if SINGLE_LOOP:
        if (start < full_lo) | (start >= full_hi):
            scores = tl.where(visible(q_idx, k_idx, len_q, len_k, diag, window_left, window_right, HAS_LEFT,
                                      HAS_RIGHT), scores, fill)
    else:
        scores = tl.where(visible(q_idx, k_idx, len_q, len_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT),
                          scores, fill)
    return scores


@triton.jit
def sequence_extent(SEQ_START, SEQ_LEN, batch, max_len, IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr):
    """(first token, length) of sequence ``batch``: packed offsets for thd, lengths for padded."""
    start = 0
    length = max_len
    if IS_THD:
        start = tl.load(SEQ_START + batch).to(tl.int64)
    if HAS_SEQLENS:
        length = tl.load(SEQ_LEN + batch)
    return start, length


@triton.jit
def segment_bounds(SEGMENT: tl.constexpr, lo, full_lo, full_hi, hi):
    """Bounds of segment 0 (masked head), 1 (unmasked middle) or 2 (masked tail) of a block range
    split by key_block_bounds / query_block_bounds. Kernels visit them in this order."""
    start = full_hi
    end = hi
    if SEGMENT == 0:
        start = lo
        end = full_lo
    if SEGMENT == 1:
        start = full_lo
        end = full_hi
    return start, end


@triton.jit
def grid_program(HEAD_GROUP: tl.constexpr):
    """(block, sequence * head) this program works on in the plan.block_grid launch.

    HEAD_GROUP = 1 is the grid itself: every block of one head, then the next head. HEAD_GROUP = g
    walks g heads at a time with their blocks interleaved (block 0 of each, then block 1, ...), so the
    heaviest causal blocks of a group start first while programs resident together still share a
    few heads' K/V in L2. The mapping is a bijection of the grid: it changes no result.
    """
    block = tl.program_id(0)
    seq_head = tl.program_id(1)
    if HEAD_GROUP > 1:
        num_blocks = tl.num_programs(0)
        pid = seq_head * num_blocks + block
        first = (pid // (HEAD_GROUP * num_blocks)) * HEAD_GROUP
        size = tl.minimum(tl.num_programs(1) - first, HEAD_GROUP)  # the last group may be short
        rank = pid - first * num_blocks
        block = rank // size
        seq_head = first + rank % size
    return block, seq_head


@triton.jit
def load_tile(ptrs, d_idx, s_idx, seq_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """Load a K/V/Q/dO tile whose head-dim index ``d_idx`` and sequence index ``s_idx`` broadcast to
    its shape, masking only what can be out of range: the sequence end when MASKED, the head dim
    when it ends before the tile's columns do (``BLOCK_D``: one past the tile's last head-dim column,
    its width unless it is the second chunk of a split head dim). An unmasked load keeps predicates
    off the pipelined copies (Triton does not fold ``arange(0, 128) < 128``)."""
    if MASKED:
        if HEAD_DIM >= BLOCK_D:
            tile = tl.load(ptrs, mask=s_idx < seq_len, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(d_idx < HEAD_DIM) & (s_idx < seq_len), other=0.0)
    else:
        if HEAD_DIM >= BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=d_idx < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def sequence_source(base, stride_s, seq_len, offs_d, offs_s, stride_d, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, D_FIRST: tl.constexpr):
    """Where a block loop reads one sequence's K/V/Q/dO rows from: a tile of pointers at block 0,
    [BLOCK_D, BLOCK_S] when D_FIRST else [BLOCK_S, BLOCK_D]."""
    if D_FIRST:
        src = base + offs_s[None, :] * stride_s + offs_d[:, None] * stride_d
    else:
        src = base + offs_s[:, None] * stride_s + offs_d[None, :] * stride_d
    return src


@triton.jit
def load_block(src, start, stride_s, offs_d, offs_s, seq_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, D_FIRST: tl.constexpr):
    """Rows [start, start + BLOCK_S) of a sequence_source, zeros outside the sequence and head dim
    (``BLOCK_D`` as load_tile's)."""
    if D_FIRST:
        tile = load_tile(src + start * stride_s, offs_d[:, None], (start + offs_s)[None, :], seq_len, HEAD_DIM,
                         BLOCK_D, MASKED)
    else:
        tile = load_tile(src + start * stride_s, offs_d[None, :], (start + offs_s)[:, None], seq_len, HEAD_DIM,
                         BLOCK_D, MASKED)
    return tile


@triton.jit
def segment_block(SEQ_LEN, row, rank, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr, LAST_FIRST: tl.constexpr):
    """(sequence, first row) of block ``rank`` among the blocks of the SEGMENTS sequences of grid row ``row``
    (sequences ``row * SEGMENTS + j``, lengths from SEQ_LEN), the sequences' blocks in order, each one's
    last-first when LAST_FIRST; sequence -1 when ``rank`` is past them all.

    The segment-row grid (launches: JAX's packed rows, several sequences in a row of known length but
    unknown longest sequence) has ``cdiv(row length, BLOCK) + SEGMENTS - 1`` programs per row and head, a
    bound on the row's blocks, where the (block, sequence) grid would need SEGMENTS times the row length.
    It maps each program to the same tile as that grid would: the results are the same bits.
    """
    seq = row * 0 - 1
    start = row * 0
    for j in tl.static_range(SEGMENTS):
        n = tl.cdiv(tl.load(SEQ_LEN + row * SEGMENTS + j), BLOCK)
        if (seq < 0) & (rank < n):
            seq = row * SEGMENTS + j
            if LAST_FIRST:
                start = (n - 1 - rank) * BLOCK
            else:
                start = rank * BLOCK
        rank -= n
    return seq, start


@triton.jit
def query_block_program(SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
                        BLOCK_M: tl.constexpr, IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
                        BOTTOM_RIGHT: tl.constexpr, HEAD_GROUP: tl.constexpr, SEGMENTS: tl.constexpr = 1):
    """Where a program of the (query block, batch * query head) grid (plan.block_grid) works; with
    SEGMENTS > 1, of the segment-row grid (segment_block: (block of the row, row * query head)).

    Returns (start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag).
    Query blocks run last-first: under causal masks the last carry the most work, so long programs
    start early and short ones fill the tail (the order changes no result). Padded formats write
    every row up to seqlen_q (zeros past len_q); packed ones only their own (``rows_out``). A program
    with no block returns ``start_m >= rows_out``.
    """
    block, pid_bh = grid_program(HEAD_GROUP)
    if SEGMENTS > 1:
        row = pid_bh // num_heads_q
        batch, start_m = segment_block(SEQ_LEN_Q, row, block, SEGMENTS, BLOCK_M, True)
        if batch < 0:  # past the row's blocks: any sequence of the row, and a start past every length
            batch = row * SEGMENTS
            start_m = seqlen_q
    else:
        start_m = (tl.num_programs(0) - 1 - block) * BLOCK_M
        batch = pid_bh // num_heads_q
    head = pid_bh % num_heads_q
    head_kv = head // gqa_group
    start_q, len_q = sequence_extent(SEQ_START_Q, SEQ_LEN_Q, batch, seqlen_q, IS_THD, HAS_SEQLENS)
    start_k, len_k = sequence_extent(SEQ_START_K, SEQ_LEN_K, batch, seqlen_k, IS_THD, HAS_SEQLENS)
    rows_out = seqlen_q
    if IS_THD:
        rows_out = len_q
    diag = 0
    if BOTTOM_RIGHT:
        diag = len_k - len_q
    return start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag


@triton.jit
def key_block_program(SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_kv, seqlen_q, seqlen_k,
                      BLOCK_N: tl.constexpr, IS_THD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
                      BOTTOM_RIGHT: tl.constexpr, HEAD_GROUP: tl.constexpr, SEGMENTS: tl.constexpr = 1):
    """Where a program of the (key block, batch * kv head) grid (plan.block_grid) works, as
    :func:`query_block_program` for the dK/dV passes (the bf16 and the FP8 kernels'); with SEGMENTS > 1, of
    the segment-row grid.

    Returns (start_n, batch, head_kv, start_q, len_q, start_k, len_k, rows_out, diag). Key blocks run
    first-first: under causal masks they see the most queries. A program with no block returns
    ``start_n >= rows_out``.
    """
    block, pid_bh = grid_program(HEAD_GROUP)
    if SEGMENTS > 1:
        row = pid_bh // num_heads_kv
        batch, start_n = segment_block(SEQ_LEN_K, row, block, SEGMENTS, BLOCK_N, False)
        if batch < 0:  # past the row's blocks: exits
            batch = row * SEGMENTS
            start_n = seqlen_k
    else:
        start_n = block * BLOCK_N
        batch = pid_bh // num_heads_kv
    head_kv = pid_bh % num_heads_kv
    start_q, len_q = sequence_extent(SEQ_START_Q, SEQ_LEN_Q, batch, seqlen_q, IS_THD, HAS_SEQLENS)
    start_k, len_k = sequence_extent(SEQ_START_K, SEQ_LEN_K, batch, seqlen_k, IS_THD, HAS_SEQLENS)
    rows_out = len_k if IS_THD else seqlen_k
    diag = 0
    if BOTTOM_RIGHT:
        diag = len_k - len_q
    return start_n, batch, head_kv, start_q, len_q, start_k, len_k, rows_out, diag


@triton.jit
def row_delta(O, DO, DELTA, batch, head, start_m, start_q, len_q,
              stride_ob, stride_os, stride_oh, stride_od, stride_dob, stride_dos, stride_doh, stride_dod,
              stride_lb, stride_lh, do_scale,
              HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, SCALED: tl.constexpr):
    """The backward preprocess of query rows [start_m, start_m + BLOCK_M) of a sequence at ``start_q`` with
    ``len_q`` rows (the caller returns first where start_m >= len_q): delta[b, h, i] = sum_d (dO[i, d] *
    do_scale) * O[i, d] in fp32 (SCALED: dO in FP8 with its descale factor; else dO as it is, ``do_scale``
    unread)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM_V)
    o = tl.load(O + batch.to(tl.int64) * stride_ob + start_q * stride_os + head.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + batch.to(tl.int64) * stride_dob + start_q * stride_dos + head.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    if SCALED:
        delta = tl.sum(o.to(tl.float32) * (do.to(tl.float32) * do_scale), axis=1)
    else:
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m, delta,
             mask=offs_m < len_q)


@triton.jit
def key_block_bounds(start_m, len_q, len_k, diag, window_left, window_right,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """For query rows [start_m, start_m + BLOCK_M): (lo, full_lo, full_hi, hi).

    Key blocks in [lo, full_lo) and [full_hi, hi) need the element mask; [full_lo, full_hi) is
    visible to every row of the block. lo (when below hi) and full_lo, full_hi (when they differ) are
    multiples of BLOCK_N. A block entirely past the sequence end (start_m >= len_q) visits none: hi = lo.

    The Triton and the Gluon kernels (hopper_ws.py) both call this. Its clamps are branches, not
    tl.where: Gluon compiles them as written (as its own copy had them) and Triton canonicalizes them
    into selects, so both families' sm_90 PTX and SASS are what they were with two copies.
    """
    lo = 0
    hi = len_k
    full_lo = 0
    full_hi = (len_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(start_m + diag - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(start_m + BLOCK_M - 1 + diag - window_left, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + diag + window_right, 0), len_k)
        full_hi = tl.minimum(full_hi, (tl.maximum(start_m + diag + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    lo = tl.minimum(lo, hi)
    full_lo = tl.maximum(full_lo, lo)
    if full_hi <= full_lo:  # no block visible to every row: mask all of [lo, hi)
        full_lo = lo
        full_hi = lo
    if start_m >= len_q:
        hi = lo
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(full_hi, hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_block_bounds(start_n, len_q, len_k, diag, window_left, window_right,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """For key columns [start_n, start_n + BLOCK_N): (lo, full_lo, full_hi, hi) over query rows.

    Same split as key_block_bounds, transposed: query blocks in [full_lo, full_hi) see every key
    of the block (keys past len_k excluded by the caller's load masks and a zeroed tile). A block
    entirely past the sequence end (start_n >= len_k) visits none: hi = lo.
    """
    lo = 0
    hi = len_q
    full_lo = 0
    full_hi = (len_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        # i + diag + right >= j  ->  i >= j - diag - right
        lo = tl.maximum(start_n - diag - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(start_n + BLOCK_N - 1 - diag - window_right, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        # j >= i + diag - left  ->  i <= j - diag + left
        hi = tl.minimum(tl.maximum(start_n + BLOCK_N - diag + window_left, 0), len_q)
        full_hi = tl.minimum(full_hi, (tl.maximum(start_n - diag + window_left + 1, 0) // BLOCK_M) * BLOCK_M)
    if start_n + BLOCK_N > len_k:  # a key block running past the sequence end masks every query block
        full_hi = 0
    lo = tl.minimum(lo, hi)
    full_lo = tl.maximum(full_lo, lo)
    if full_hi <= full_lo:
        full_lo = lo
        full_hi = lo
    if start_n >= len_k:
        hi = lo
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(full_hi, hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def chunk_bounds(c_lo, KV_CHUNK: tl.constexpr, lo, full_lo, full_hi, hi):
    """key_block_bounds' (lo, full_lo, full_hi, hi) within the chunk [c_lo, c_lo + KV_CHUNK): empty (lo = hi)
    where the chunk holds none of [lo, hi)."""
    lo_c = tl.maximum(lo, c_lo)
    hi_c = tl.maximum(tl.minimum(hi, c_lo + KV_CHUNK), lo_c)
    full_lo_c = tl.minimum(tl.maximum(full_lo, lo_c), hi_c)
    full_hi_c = tl.minimum(tl.maximum(full_hi, full_lo_c), hi_c)
    return lo_c, full_lo_c, full_hi_c, hi_c
