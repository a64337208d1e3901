"""Attention kernels for Hopper (sm_90), warp-specialized, written in Gluon: the forward and the
backward's dK/dV and dQ passes.

The Triton kernels (forward.py, backward.py) run their two warpgroups in lockstep: a CTA barrier every
block keeps softmax from overlapping the other warpgroup's matrix products, which leaves the tensor cores
idle for much of the forward. Here a program owns 128 rows as two
consumer warpgroups of 64 rows each plus one loader warp:

- forward and dQ: 128 query rows. The loader warp brings the row tiles once (Q; Q and dO for dQ) and
  K/V blocks through a ring of NUM_STAGES shared-memory buffers with TMA (tensor descriptors over one
  sequence and head: rows past the sequence load as zeros);
- dK/dV: 128 keys. The loader brings K and V once and, per query block of each query head of the GQA
  group, Q and dO with TMA and the block's LSE and delta rows with cp.async (the consumers read them
  from shared memory instead of waiting on global loads in their loop, which keeps the consumers within
  240 registers without spills);
- each consumer walks the same blocks on its own and releases a buffer by arriving on its "empty"
  barrier (count 2: both consumers), never through a CTA barrier.

Launch arguments, grid (plan.block_grid) and results are those of attn_fwd_kernel / attn_bwd_dkdv_kernel
/ attn_bwd_dq_kernel (log2-domain scores, natural-log LSE, +inf for rows that see no key, zeros for padded
rows) for the calls plan.py routes here: fp16/bf16, d_qk = d_v = BLOCK_DQK = BLOCK_DV (forward and dQ also
d_qk = BLOCK_DQK + BLOCK_DQK2 with d_v = BLOCK_DV: a Q/K head dim split in two chunks, the second in
descriptors and buffers of its own, each score block the first chunk's product plus the second's), no bias, ALiBi,
dropout or sink softmax, the head dim contiguous and 16-byte aligned strides. Each row's (or key's) arithmetic is the
Triton kernels', in the same block order, but the products are blocked differently, so results are close
to, not bitwise equal to, the Triton kernels': the plan picks one kernel per configuration, the same in
both frontends, so a configuration's results are reproducible bit for bit.

A paged KV cache (the forward, PAGE_SIZE > 0; attn_fwd_kernel's PAGE_TABLE convention): K and V are the pools'
rows and the loader warp finds each key block's rows in the sequence's page table, with one TMA load per block
where a page holds whole blocks and one per page where pages divide a block (plan.gluon_page_reason says which
sizes). Only the loader changes: the consumers, their tiles, block order and barriers are the contiguous forward's,
and the ring's buffers receive the same values (rows past the sequence as zeros, through a descriptor over the
sequence's rows in its last page), so a paged call gives the bits of the same call on the pages gathered into rows.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# The TMA and cp.async loads and aggregates are spelled differently across Triton releases.
from .triton_compat import aggregate, cp_async_load, settle_cache_keys, tma_async_load

# The visibility rule and the block bounds are the Triton kernels' own (@triton.jit functions: called from a
# @gluon.jit one they are generated as Gluon, and hold only scalar arithmetic and elementwise operators).
from .masking import chunk_bounds, key_block_bounds, query_block_bounds, segment_block, visible

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup: one wgmma M tile per warp quad
# Registers per thread of the worker partitions (setmaxnreg): the second consumer and the loader warp
# (allocated as a warpgroup). Launched with maxnreg=168 (12 warps fill the 64K register file), the
# first consumer gets what is left: 3 * 168 - 232 - 24 = 248.
CONSUMER_REGISTERS = gl.constexpr(232)
LOADER_REGISTERS = gl.constexpr(24)


@aggregate
class _Schedule:
    """Compile-time choices the partitions share (an aggregate: warp_specialize turns plain constexpr
    arguments into runtime values)."""

    NUM_STAGES: gl.constexpr
    BLOCK_N: gl.constexpr
    HAS_LEFT: gl.constexpr
    HAS_RIGHT: gl.constexpr
    ROW_TILES: gl.constexpr  # tiles the loader brings once per consumer: 1 (Q), 2 (Q and dO); 0 for dK/dV
    WITH_DK: gl.constexpr  # dK/dV: which gradients the pass computes (attn_bwd_dkdv_kernel's flags)
    WITH_DV: gl.constexpr
    SPLIT: gl.constexpr  # forward and dQ: the Q/K head dim is two chunks (q2/k2 buffers: _second_chunk)
    KV_CHUNK: gl.constexpr  # forward: keys per chunk of the canonical sum (0: one chunk)
    SPLIT_KV: gl.constexpr  # forward: this program computes one key chunk and stores its state
    ROW_MAX: gl.constexpr  # forward: also write each row's max logit (return_max_logit)
    PAGE_SIZE: gl.constexpr  # forward: keys per page of a paged KV cache the loader reads (0: rows in place)

    @gluon.constexpr_function
    def __init__(self, NUM_STAGES, BLOCK_N, HAS_LEFT, HAS_RIGHT, ROW_TILES, WITH_DK=True, WITH_DV=True,
                 SPLIT=False, KV_CHUNK=0, SPLIT_KV=False, ROW_MAX=False, PAGE_SIZE=0):
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.HAS_LEFT = gl.constexpr(HAS_LEFT)
        self.HAS_RIGHT = gl.constexpr(HAS_RIGHT)
        self.ROW_TILES = gl.constexpr(ROW_TILES)
        self.WITH_DK = gl.constexpr(WITH_DK)
        self.WITH_DV = gl.constexpr(WITH_DV)
        self.SPLIT = gl.constexpr(SPLIT)
        self.KV_CHUNK = gl.constexpr(KV_CHUNK)
        self.SPLIT_KV = gl.constexpr(SPLIT_KV)
        self.ROW_MAX = gl.constexpr(ROW_MAX)
        self.PAGE_SIZE = gl.constexpr(PAGE_SIZE)


@gluon.jit
def _loader(bufs, bars, bounds, coords, sched, pages):
    """One warp: the row tiles once (both consumers' halves: Q, or Q and dO), then K and V block by block
    through the ring; with sched.PAGE_SIZE > 0 (the forward on a paged KV cache) each block's rows through the
    sequence's page table (``pages``: _paged_kv_block), else ``pages`` is None."""
    NUM_STAGES: gl.constexpr = sched.NUM_STAGES
    BLOCK_N: gl.constexpr = sched.BLOCK_N
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q2_desc, k2_desc, q2_smem, k2_smem = bufs
    q_bar, k_ready, v_ready, kv_empty, turn = bars
    lo, hi, full_lo, full_hi = bounds
    start_m = coords[0]
    if sched.SPLIT:
        mbarrier.expect(q_bar, 2 * (q_desc.block_type.nbytes + q2_desc.block_type.nbytes
                                    + (sched.ROW_TILES == 2) * do_desc.block_type.nbytes))
    else:
        mbarrier.expect(q_bar, 2 * sched.ROW_TILES * q_desc.block_type.nbytes)
    for wg in gl.static_range(2):
        tma_async_load(q_desc, [start_m + wg * WG_ROWS, 0], q_bar, q_smem.index(wg))
        if sched.SPLIT:
            tma_async_load(q2_desc, [start_m + wg * WG_ROWS, 0], q_bar, q2_smem.index(wg))
        if sched.ROW_TILES == 2:
            tma_async_load(do_desc, [start_m + wg * WG_ROWS, 0], q_bar, do_smem.index(wg))
    it = 0
    for start_n in range(lo, hi, BLOCK_N):
        stage = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        # A fresh barrier counts as having completed phase 1: the first pass does not wait.
        mbarrier.wait(kv_empty.index(stage), phase ^ 1)
        if sched.PAGE_SIZE > 0:
            _paged_kv_block(bufs, bars, pages, start_n, stage, sched)
        else:
            if sched.SPLIT:
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes + k2_desc.block_type.nbytes)
                tma_async_load(k_desc, [start_n, 0], k_ready.index(stage), k_smem.index(stage))
                tma_async_load(k2_desc, [start_n, 0], k_ready.index(stage), k2_smem.index(stage))
            else:
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                tma_async_load(k_desc, [start_n, 0], k_ready.index(stage), k_smem.index(stage))
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_async_load(v_desc, [start_n, 0], v_ready.index(stage), v_smem.index(stage))
        it += 1


@gluon.jit
def _page_load(desc, tail, table, last_page, start_n, bar, dst, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA loads of keys [start_n, start_n + BLOCK_N) of one sequence into ``dst`` (a ring buffer), through its page
    table ``table``: key n is row n % PAGE_SIZE of page table[n // PAGE_SIZE]. ``desc`` covers the pool's rows,
    ``tail`` only the sequence's rows in its last page (``last_page``), so that rows past the sequence load as
    zeros, as the contiguous descriptor (over the sequence's rows) gives them, whatever the pool holds there. A
    block spanning several pages (PAGE_SIZE < BLOCK_N) takes a load per page into row slices of ``dst``; a page
    past the last one is loaded wholly out of ``tail``'s bounds (zeros, its bytes counted as ever), so no table
    entry past the sequence's pages is read."""
    if PAGE_SIZE >= BLOCK_N:  # the block lies in one page (key blocks are aligned at key 0)
        page = start_n // PAGE_SIZE
        if page < last_page:
            tma_async_load(desc, [gl.load(table + page) * PAGE_SIZE + start_n % PAGE_SIZE, 0], bar, dst)
        else:
            tma_async_load(tail, [start_n - last_page * PAGE_SIZE, 0], bar, dst)
    else:
        for j in gl.static_range(BLOCK_N // PAGE_SIZE):
            page = start_n // PAGE_SIZE + j
            rows = dst.slice(j * PAGE_SIZE, PAGE_SIZE)
            if page < last_page:
                tma_async_load(desc, [gl.load(table + page) * PAGE_SIZE, 0], bar, rows)
            else:
                tma_async_load(tail, [(page - last_page) * PAGE_SIZE, 0], bar, rows)


@gluon.jit
def _paged_kv_block(bufs, bars, pages, start_n, stage, sched):
    """The loader's K (and K's second chunk) and V loads of the key block at ``start_n`` from a paged KV cache
    (_page_load), into ring buffer ``stage``: each ready barrier expects the whole block's bytes, as in the
    contiguous loads, so the consumers wait and compute as they do there."""
    BLOCK_N: gl.constexpr = sched.BLOCK_N
    PAGE_SIZE: gl.constexpr = sched.PAGE_SIZE
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q2_desc, k2_desc, q2_smem, k2_smem = bufs
    q_bar, k_ready, v_ready, kv_empty, turn = bars
    table, last_page, k_tail, v_tail, k2_tail = pages
    LOADS: gl.constexpr = BLOCK_N // k_desc.block_type.shape[0]  # TMA loads per block and tensor
    if sched.SPLIT:
        mbarrier.expect(k_ready.index(stage), LOADS * (k_desc.block_type.nbytes + k2_desc.block_type.nbytes))
        _page_load(k_desc, k_tail, table, last_page, start_n, k_ready.index(stage), k_smem.index(stage), PAGE_SIZE,
                   BLOCK_N)
        _page_load(k2_desc, k2_tail, table, last_page, start_n, k_ready.index(stage), k2_smem.index(stage),
                   PAGE_SIZE, BLOCK_N)
    else:
        mbarrier.expect(k_ready.index(stage), LOADS * k_desc.block_type.nbytes)
        _page_load(k_desc, k_tail, table, last_page, start_n, k_ready.index(stage), k_smem.index(stage), PAGE_SIZE,
                   BLOCK_N)
    mbarrier.expect(v_ready.index(stage), LOADS * v_desc.block_type.nbytes)
    _page_load(v_desc, v_tail, table, last_page, start_n, v_ready.index(stage), v_smem.index(stage), PAGE_SIZE,
               BLOCK_N)


@gluon.jit
def _issue_scores(q, k_smem, k_ready, s_zero, it, NUM_STAGES: gl.constexpr, q2, k2_smem, SPLIT: gl.constexpr):
    """Issue Q K^T for the it-th key block once it has landed (async: the caller waits); with SPLIT the
    second chunk's product accumulates onto the first's."""
    stage = it % NUM_STAGES
    mbarrier.wait(k_ready.index(stage), (it // NUM_STAGES) & 1)
    qk = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if SPLIT:
        qk = warpgroup_mma(q2, k2_smem.index(stage).permute((1, 0)), qk, is_async=True)
    return qk


@gluon.jit
def _softmax_step(qk, m_i, l_i, start_n, offs_m, offs_n_base, full_lo, full_hi, coords, qk_scale,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Mask a block outside [full_lo, full_hi), update the running max and sum: (p, alpha, m, l)."""
    start_m, len_q, len_k, diag, window_left, window_right = coords
    if (start_n < full_lo) | (start_n >= full_hi):
        offs_n = start_n + offs_n_base
        keep = visible(gl.expand_dims(offs_m, 1), gl.expand_dims(offs_n, 0), len_q, len_k, diag, window_left,
                       window_right, HAS_LEFT, HAS_RIGHT)
        qk = gl.where(keep, qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    # A row with nothing visible so far keeps m = -inf; subtract 0 instead (exp2(-inf) = 0).
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _key_blocks(q, q2, bufs, bars, acc, l_i, m_i, lo, hi, it, full_lo, full_hi, coords, offs_m, offs_n_base, qk_scale,
                sched, s_zero, p_layout: gl.constexpr, row_o: gl.constexpr):
    """The online softmax over the key blocks [lo, hi), the it-th block of the loader's ring first:
    (acc, l, m, it after the last block)."""
    NUM_STAGES: gl.constexpr = sched.NUM_STAGES
    BLOCK_N: gl.constexpr = sched.BLOCK_N
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q2_desc, k2_desc, q2_smem, k2_smem = bufs
    q_bar, k_ready, v_ready, kv_empty, turn = bars
    dtype: gl.constexpr = q_desc.dtype
    it = gl.to_tensor(it)  # a loop-carried count, also where the caller passes the literal 0
    for start_n in range(lo, hi, BLOCK_N):
        stage = it % NUM_STAGES
        qk = _issue_scores(q, k_smem, k_ready, s_zero, it, NUM_STAGES, q2, k2_smem, sched.SPLIT)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, start_n, offs_m, offs_n_base, full_lo, full_hi, coords,
                                           qk_scale, sched.HAS_LEFT, sched.HAS_RIGHT)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_ready.index(stage), (it // NUM_STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(stage), count=1)
        it += 1
    return acc, l_i, m_i, it


@gluon.jit
def _fold_chunk(acc, l_i, m_i, acc_c, l_c, m_c, row_o: gl.constexpr):
    """forward.fold_chunk's arithmetic, operation for operation (the canonical sum's combination step: the
    chunked Triton forward and the split-KV combine fold with it, so the bits agree)."""
    m_new = gl.maximum(m_i, m_c)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    beta = gl.exp2(m_c - m_use)
    l_i = gl.fma(l_i, alpha, l_c * beta)
    alpha_o, _ = gl.broadcast(gl.expand_dims(gl.convert_layout(alpha, row_o), 1), acc)
    beta_o, _ = gl.broadcast(gl.expand_dims(gl.convert_layout(beta, row_o), 1), acc_c)
    acc = gl.fma(acc, alpha_o, acc_c * beta_o)
    return acc, l_i, m_new


@gluon.jit
def _consume(bufs, bars, bounds, coords, out_args, sched, WG: gl.constexpr):
    """One warpgroup's 64 query rows: online softmax over the loader's K/V blocks, then O and LSE (SPLIT_KV:
    the rows' unnormalised state over this program's key chunk, for the combine)."""
    BLOCK_N: gl.constexpr = sched.BLOCK_N
    KV_CHUNK: gl.constexpr = sched.KV_CHUNK
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q2_desc, k2_desc, q2_smem, k2_smem = bufs
    q_bar, k_ready, v_ready, kv_empty, turn = bars
    lo, hi, full_lo, full_hi = bounds
    start_m, len_q, len_k, diag, window_left, window_right = coords
    o_base, stride_os, stride_od, lse_base, row_max_base, rows_out, qk_scale, part_o, part_m, part_l = out_args
    HEAD_DIM: gl.constexpr = v_desc.block_type.shape[1]  # of O
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    first_row = start_m + WG * WG_ROWS
    offs_m = first_row + gl.arange(0, WG_ROWS, layout=row_s)
    offs_n_base = gl.arange(0, BLOCK_N, layout=col_s)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([WG_ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    q = q_smem.index(WG)
    q2 = q2_smem.index(WG)
    if (KV_CHUNK == 0) or sched.SPLIT_KV:  # one chunk: [lo, hi) is the chunk (SPLIT_KV: the kernel's bounds)
        acc, l_i, m_i, it = _key_blocks(q, q2, bufs, bars, acc, l_i, m_i, lo, hi, 0, full_lo, full_hi, coords, offs_m,
                                        offs_n_base, qk_scale, sched, s_zero, p_layout, row_o)
    else:
        # The canonical sum (forward.py): each chunk of KV_CHUNK keys (aligned at key 0) from scratch, folded in
        # order. The loader walks [lo, hi) block by block as ever: chunks only regroup the consumers' sums.
        it = 0
        for c_lo in range((lo // KV_CHUNK) * KV_CHUNK, hi, KV_CHUNK):
            m_c = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
            l_c = gl.full([WG_ROWS], 0.0, gl.float32, layout=row_s)
            acc_c = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            acc_c, l_c, m_c, it = _key_blocks(q, q2, bufs, bars, acc_c, l_c, m_c, gl.maximum(lo, c_lo),
                                              gl.minimum(hi, c_lo + KV_CHUNK), it, full_lo, full_hi, coords, offs_m,
                                              offs_n_base, qk_scale, sched, s_zero, p_layout, row_o)
            acc, l_i, m_i = _fold_chunk(acc, l_i, m_i, acc_c, l_c, m_c, row_o)

    offs_mo = first_row + gl.arange(0, WG_ROWS, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    if sched.SPLIT_KV:  # forward.attn_fwd_kernel's split state: unnormalised, rows past the sequence unwritten
        keep = offs_m < rows_out
        gl.store(part_m + offs_m, m_i, mask=keep)
        gl.store(part_l + offs_m, l_i, mask=keep)
        ptrs = part_o + gl.expand_dims(offs_mo, 1) * HEAD_DIM + gl.expand_dims(offs_d, 0)
        gl.store(ptrs, acc, mask=gl.expand_dims(offs_mo < rows_out, 1))
    else:
        # l_i is a sum of exp2 terms: 0 when the row saw no key, NaN when a score was NaN or inf (then the
        # output and lse are NaN, as in the math reference, rather than hidden as an empty row).
        seen = l_i != 0.0
        l_safe = gl.where(seen, l_i, 1.0)
        row_ok = (offs_m < len_q) & seen
        lse = gl.where(row_ok, (m_i + gl.log2(l_safe)) * LN2, float("inf"))
        gl.store(lse_base + offs_m, lse, mask=offs_m < rows_out)
        if sched.ROW_MAX:  # each row's max logit (natural units; -inf where nothing is visible), laid out as lse
            row_max = gl.where((offs_m < len_q) & (m_i != float("-inf")), m_i * LN2, float("-inf"))
            gl.store(row_max_base + offs_m, row_max, mask=offs_m < rows_out)
        scale_o = gl.convert_layout(gl.where(row_ok, 1.0 / l_safe, 0.0), row_o)
        out = acc * gl.expand_dims(scale_o, 1)
        ptrs = o_base + gl.expand_dims(offs_mo, 1) * stride_os + gl.expand_dims(offs_d, 0) * stride_od
        gl.store(ptrs, out.to(dtype), mask=gl.expand_dims(offs_mo < rows_out, 1))


@gluon.jit
def _fwd_consumer0(bufs, bars, bounds, coords, out_args, sched):
    _consume(bufs, bars, bounds, coords, out_args, sched, 0)


@gluon.jit
def _fwd_consumer1(bufs, bars, bounds, coords, out_args, sched):
    _consume(bufs, bars, bounds, coords, out_args, sched, 1)


@gluon.jit
def _load_worker(bufs, bars, bounds, coords, out_args, sched):
    _loader(bufs, bars, bounds, coords, sched, None)


@gluon.jit
def _paged_load_worker(bufs, bars, bounds, coords, out_args, sched, pages):
    _loader(bufs, bars, bounds, coords, sched, pages)


@gluon.jit
def _grid_program(HEAD_GROUP: gl.constexpr):
    """masking.grid_program: (block, sequence * head) of this program in the plan.block_grid launch."""
    block = gl.program_id(0)
    seq_head = gl.program_id(1)
    if HEAD_GROUP > 1:
        num_blocks = gl.num_programs(0)
        pid = seq_head * num_blocks + block
        first = (pid // (HEAD_GROUP * num_blocks)) * HEAD_GROUP
        size = gl.minimum(gl.num_programs(1) - first, HEAD_GROUP)
        rank = pid - first * num_blocks
        block = rank // size
        seq_head = first + rank % size
    return block, seq_head


@gluon.jit
def _extents(SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, batch, seqlen_q, seqlen_k, IS_THD: gl.constexpr,
             HAS_SEQLENS: gl.constexpr):
    """masking.sequence_extent for both sides: (start_q, len_q, start_k, len_k)."""
    start_q = 0
    start_k = 0
    len_q = seqlen_q
    len_k = seqlen_k
    if IS_THD:
        start_q = gl.load(SEQ_START_Q + batch).to(gl.int64)
        start_k = gl.load(SEQ_START_K + batch).to(gl.int64)
    if HAS_SEQLENS:
        len_q = gl.load(SEQ_LEN_Q + batch)
        len_k = gl.load(SEQ_LEN_K + batch)
    return start_q, len_q, start_k, len_k


@gluon.jit
def _program(SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
             BLOCK_M: gl.constexpr, IS_THD: gl.constexpr, HAS_SEQLENS: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
             HEAD_GROUP: gl.constexpr, SEGMENTS: gl.constexpr):
    """masking.grid_program + masking.query_block_program: (start_m, batch, head, head_kv, start_q, len_q,
    start_k, len_k, rows_out, diag) of this program, query blocks last-first (SEGMENTS > 1: the
    segment-row grid)."""
    block, seq_head = _grid_program(HEAD_GROUP)
    if SEGMENTS > 1:
        row = seq_head // num_heads_q
        batch, start_m = segment_block(SEQ_LEN_Q, row, block, SEGMENTS, BLOCK_M, True)
        if batch < 0:
            batch = row * SEGMENTS
            start_m = seqlen_q
    else:
        start_m = (gl.num_programs(0) - 1 - block) * BLOCK_M
        batch = seq_head // num_heads_q
    head = seq_head % num_heads_q
    head_kv = head // gqa_group
    start_q, len_q, start_k, len_k = _extents(SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, batch, seqlen_q,
                                              seqlen_k, IS_THD, HAS_SEQLENS)
    rows_out = seqlen_q
    if IS_THD:
        rows_out = len_q
    diag = 0
    if BOTTOM_RIGHT:
        diag = len_k - len_q
    return start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag


@gluon.jit
def _rows_desc(base, rows, stride_s, HEAD_DIM: gl.constexpr, BLOCK_ROWS: gl.constexpr, layout: gl.constexpr):
    """Tensor descriptor over one sequence and head's [rows, HEAD_DIM] (the head dim contiguous)."""
    return tma.make_tensor_descriptor(base, shape=[gl.maximum(rows, 1), HEAD_DIM], strides=[stride_s, 1],
                                      block_shape=[BLOCK_ROWS, HEAD_DIM], layout=layout)


@gluon.jit
def _row_tiles(X, batch, head, start, rows, stride_b, stride_s, stride_h, HEAD_DIM: gl.constexpr):
    """A descriptor over one sequence and head's rows of X, and shared memory for both consumers'
    64-row tiles of it."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM], X.dtype.element_ty)
    desc = _rows_desc(X + batch.to(gl.int64) * stride_b + start * stride_s + head.to(gl.int64) * stride_h,
                      rows, stride_s, HEAD_DIM, WG_ROWS, layout)
    return desc, gl.allocate_shared_memory(X.dtype.element_ty, [2, WG_ROWS, HEAD_DIM], layout)


@gluon.jit
def _kv_ring(K, V, batch, head_kv, start_k, len_k, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
             HEAD_DIM_K: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """(k_desc, v_desc, k_smem, v_smem): descriptors over one sequence and kv head's K rows (their first
    HEAD_DIM_K columns) and V rows, and the ring's NUM_STAGES buffers of BLOCK_N rows each."""
    dtype: gl.constexpr = K.dtype.element_ty
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_K], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_V], dtype)
    k_desc = _rows_desc(K + batch.to(gl.int64) * stride_kb + start_k * stride_ks + head_kv.to(gl.int64) * stride_kh,
                        len_k, stride_ks, HEAD_DIM_K, BLOCK_N, k_layout)
    v_desc = _rows_desc(V + batch.to(gl.int64) * stride_vb + start_k * stride_vs + head_kv.to(gl.int64) * stride_vh,
                        len_k, stride_vs, HEAD_DIM_V, BLOCK_N, v_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_K], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_V], v_layout)
    return k_desc, v_desc, k_smem, v_smem


@gluon.jit
def _second_chunk(Q, K, batch, head, head_kv, start_q, len_q, start_k, len_k, stride_qb, stride_qs, stride_qh,
                  stride_kb, stride_ks, stride_kh, q_desc, k_desc, q_smem, k_smem, BLOCK_DQK: gl.constexpr,
                  BLOCK_DQK2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """(q2_desc, k2_desc, q2_smem, k2_smem): where BLOCK_DQK2 > 0, descriptors and buffers of the Q/K head
    dim's second chunk (columns [BLOCK_DQK, BLOCK_DQK + BLOCK_DQK2)); otherwise the first chunk's, unread."""
    if BLOCK_DQK2 > 0:
        q2_desc, q2_smem = _row_tiles(Q + BLOCK_DQK, batch, head, start_q, len_q, stride_qb, stride_qs, stride_qh,
                                      BLOCK_DQK2)
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_DQK2], K.dtype.element_ty)
        k2_desc = _rows_desc(K + BLOCK_DQK + batch.to(gl.int64) * stride_kb + start_k * stride_ks
                             + head_kv.to(gl.int64) * stride_kh, len_k, stride_ks, BLOCK_DQK2, BLOCK_N, layout)
        k2_smem = gl.allocate_shared_memory(K.dtype.element_ty, [NUM_STAGES, BLOCK_N, BLOCK_DQK2], layout)
        return q2_desc, k2_desc, q2_smem, k2_smem
    else:
        return q_desc, k_desc, q_smem, k_smem


@gluon.jit
def _page_descs(base, page_rows, tail_row, tail_rows, stride_s, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                PAGE_SIZE: gl.constexpr, layout: gl.constexpr):
    """(pool, tail): descriptors over a paged cache's rows of one kv head (``base``: row 0, ``page_rows`` rows) and
    over one sequence's rows in its last page (``tail_rows`` rows from row ``tail_row``), in loads of a key block
    or, where pages are smaller, of a page (``layout``: the ring's, whose buffers the loads fill)."""
    LOAD_ROWS: gl.constexpr = BLOCK_N if PAGE_SIZE >= BLOCK_N else PAGE_SIZE
    pool = tma.make_tensor_descriptor(base, shape=[page_rows, HEAD_DIM], strides=[stride_s, 1],
                                      block_shape=[LOAD_ROWS, HEAD_DIM], layout=layout)
    tail = _rows_desc(base + tail_row * stride_s, tail_rows, stride_s, HEAD_DIM, LOAD_ROWS, layout)
    return pool, tail


@gluon.jit
def _paged_kv_ring(K, V, PAGE_TABLE, batch, head_kv, len_k, stride_pt, stride_ks, stride_kh, stride_vs, stride_vh,
                   page_rows, HEAD_DIM_K: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """_kv_ring's (k_desc, v_desc, k_smem, v_smem) for K and V read from a paged KV cache (K, V: the pools' rows,
    ``page_rows`` of them, page p's row r at p * PAGE_SIZE + r), and the loader's ``pages``: (this sequence's
    row of the page table, its last page's index, K's and V's tail descriptors, K's again for the second Q/K
    chunk's). The ring's buffers are the contiguous kernel's, in the same order: the consumers read the same
    shared memory."""
    gl.static_assert((PAGE_SIZE % BLOCK_N == 0) or (BLOCK_N % PAGE_SIZE == 0 and PAGE_SIZE % 8 == 0))
    dtype: gl.constexpr = K.dtype.element_ty
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_K], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_V], dtype)
    table = PAGE_TABLE + batch.to(gl.int64) * stride_pt
    # The last page holding keys of the sequence; an empty sequence loads no block and reads no entry.
    last_page = gl.maximum(len_k - 1, 0) // PAGE_SIZE
    tail_row = gl.load(table + last_page, mask=len_k > 0, other=0).to(gl.int64) * PAGE_SIZE
    tail_rows = len_k - last_page * PAGE_SIZE
    k_desc, k_tail = _page_descs(K + head_kv.to(gl.int64) * stride_kh, page_rows, tail_row, tail_rows, stride_ks,
                                 HEAD_DIM_K, BLOCK_N, PAGE_SIZE, k_layout)
    v_desc, v_tail = _page_descs(V + head_kv.to(gl.int64) * stride_vh, page_rows, tail_row, tail_rows, stride_vs,
                                 HEAD_DIM_V, BLOCK_N, PAGE_SIZE, v_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_K], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM_V], v_layout)
    return k_desc, v_desc, k_smem, v_smem, (table, last_page, k_tail, v_tail, k_tail), (tail_row, tail_rows)


@gluon.jit
def _paged_second_chunk(Q, K, batch, head, head_kv, start_q, len_q, stride_qb, stride_qs, stride_qh, stride_ks,
                        stride_kh, page_rows, q_desc, k_desc, q_smem, k_smem, pages, tail, BLOCK_DQK: gl.constexpr,
                        BLOCK_DQK2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                        PAGE_SIZE: gl.constexpr):
    """_second_chunk's (q2_desc, k2_desc, q2_smem, k2_smem) where K is a paged cache's rows (_paged_kv_ring), and
    ``pages`` with K's second chunk's tail descriptor."""
    if BLOCK_DQK2 > 0:
        q2_desc, q2_smem = _row_tiles(Q + BLOCK_DQK, batch, head, start_q, len_q, stride_qb, stride_qs, stride_qh,
                                      BLOCK_DQK2)
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_DQK2], K.dtype.element_ty)
        tail_row, tail_rows = tail
        k2_desc, k2_tail = _page_descs(K + BLOCK_DQK + head_kv.to(gl.int64) * stride_kh, page_rows, tail_row,
                                       tail_rows, stride_ks, BLOCK_DQK2, BLOCK_N, PAGE_SIZE, layout)
        k2_smem = gl.allocate_shared_memory(K.dtype.element_ty, [NUM_STAGES, BLOCK_N, BLOCK_DQK2], layout)
        table, last_page, k_tail, v_tail, _ = pages
        return q2_desc, k2_desc, q2_smem, k2_smem, (table, last_page, k_tail, v_tail, k2_tail)
    else:
        return q_desc, k_desc, q_smem, k_smem, pages


@gluon.jit
def _barriers(NUM_STAGES: gl.constexpr):
    """(q_bar, k_ready, v_ready, kv_empty, turn), initialised: the row tiles' barrier, the ring's
    ready / empty barriers (empty counts both consumers) and two turn barriers that no consumer waits on
    (left from a measured ping-pong schedule: they keep the compiled kernels as planned and measured)."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    return q_bar, k_ready, v_ready, kv_empty, turn


@gluon.jit
def attn_fwd_ws_kernel(
    Q, K, V, O, LSE, ROW_MAX, PART_O, PART_ML, BIAS, ALIBI_SLOPES, RNG_STATE, PAGE_TABLE,
    SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh,
    stride_zb, stride_zh, stride_zm, stride_zn, stride_alibi_b, stride_pt,
    num_heads_q, gqa_group, seqlen_q, seqlen_k, page_rows,
    qk_scale, window_left, window_right, dropout_p, split_rows,
    HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    BLOCK_DQK: gl.constexpr, BLOCK_DQK2: gl.constexpr, BLOCK_DV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    IS_THD: gl.constexpr, HAS_SEQLENS: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_ALIBI: gl.constexpr, DROPOUT: gl.constexpr,
    HEAD_GROUP: gl.constexpr, SINGLE_LOOP: gl.constexpr, SEGMENTS: gl.constexpr,
    HAS_ROW_MAX: gl.constexpr, KV_CHUNK: gl.constexpr, SPLIT_KV: gl.constexpr, PAGE_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr = 2,
):
    # The head dims fill their tiles: d_qk one chunk or two (BLOCK_DQK + BLOCK_DQK2), d_v one.
    gl.static_assert(HEAD_DIM_QK == BLOCK_DQK + BLOCK_DQK2)
    gl.static_assert(HEAD_DIM_V == BLOCK_DV)
    gl.static_assert(BLOCK_M == 2 * WG_ROWS)
    gl.static_assert(not (HAS_BIAS or HAS_ALIBI or DROPOUT))

    start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = _program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
        BLOCK_M, IS_THD, HAS_SEQLENS, BOTTOM_RIGHT, HEAD_GROUP, SEGMENTS)
    if start_m >= rows_out:
        return
    lo, full_lo, full_hi, hi = key_block_bounds(start_m, len_q, len_k, diag, window_left, window_right, BLOCK_M,
                                                BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # SPLIT_KV: this program's key chunk (grid axis 2) alone, for the loader and the consumers; its state goes to
    # row (sequence * head * seqlen_q + row) of chunk program_id(2) in the workspace (forward._partial_rows).
    chunk = gl.program_id(2)
    if SPLIT_KV:
        lo, full_lo, full_hi, hi = chunk_bounds(chunk * KV_CHUNK, KV_CHUNK, lo, full_lo, full_hi, hi)
    part_row = (batch * num_heads_q + head).to(gl.int64) * seqlen_q + chunk * split_rows
    part_o = PART_O + part_row * HEAD_DIM_V
    part_m = PART_ML + part_row
    part_l = PART_ML + gl.num_programs(2) * split_rows + part_row

    q_desc, q_smem = _row_tiles(Q, batch, head, start_q, len_q, stride_qb, stride_qs, stride_qh, BLOCK_DQK)
    if PAGE_SIZE > 0:
        # A paged KV cache: only the loader's addresses differ (module docstring); descriptors and buffers are made
        # in the contiguous kernel's order.
        k_desc, v_desc, k_smem, v_smem, pages, tail = _paged_kv_ring(
            K, V, PAGE_TABLE, batch, head_kv, len_k, stride_pt, stride_ks, stride_kh, stride_vs, stride_vh, page_rows,
            BLOCK_DQK, BLOCK_DV, BLOCK_N, NUM_STAGES, PAGE_SIZE)
        q2_desc, k2_desc, q2_smem, k2_smem, pages = _paged_second_chunk(
            Q, K, batch, head, head_kv, start_q, len_q, stride_qb, stride_qs, stride_qh, stride_ks, stride_kh,
            page_rows, q_desc, k_desc, q_smem, k_smem, pages, tail, BLOCK_DQK, BLOCK_DQK2, BLOCK_N, NUM_STAGES,
            PAGE_SIZE)
    else:
        k_desc, v_desc, k_smem, v_smem = _kv_ring(K, V, batch, head_kv, start_k, len_k, stride_kb, stride_ks,
                                                  stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_DQK, BLOCK_DV,
                                                  BLOCK_N, NUM_STAGES)
        q2_desc, k2_desc, q2_smem, k2_smem = _second_chunk(
            Q, K, batch, head, head_kv, start_q, len_q, start_k, len_k, stride_qb, stride_qs, stride_qh, stride_kb,
            stride_ks, stride_kh, q_desc, k_desc, q_smem, k_smem, BLOCK_DQK, BLOCK_DQK2, BLOCK_N, NUM_STAGES)
    bars = _barriers(NUM_STAGES)

    o_base = O + batch.to(gl.int64) * stride_ob + start_q * stride_os + head.to(gl.int64) * stride_oh
    lse_base = LSE + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
    row_max_base = ROW_MAX + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
    bufs = (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, q2_desc, k2_desc, q2_smem, k2_smem)
    bounds = (lo, hi, full_lo, full_hi)
    coords = (start_m, len_q, len_k, diag, window_left, window_right)
    out_args = (o_base, stride_os, stride_od, lse_base, row_max_base, rows_out, qk_scale, part_o, part_m, part_l)
    sched = _Schedule(NUM_STAGES, BLOCK_N, HAS_LEFT, HAS_RIGHT, 1, SPLIT=BLOCK_DQK2 > 0, KV_CHUNK=KV_CHUNK,
                      SPLIT_KV=SPLIT_KV, ROW_MAX=HAS_ROW_MAX, PAGE_SIZE=PAGE_SIZE)
    args = (bufs, bars, bounds, coords, out_args, sched)
    if PAGE_SIZE > 0:  # the consumers' arguments as without pages: only the loader reads the page table
        gl.warp_specialize([(_fwd_consumer0, args), (_fwd_consumer1, args),
                            (_paged_load_worker, (bufs, bars, bounds, coords, out_args, sched, pages))], [4, 1],
                           [CONSUMER_REGISTERS, LOADER_REGISTERS])
    else:
        gl.warp_specialize([(_fwd_consumer0, args), (_fwd_consumer1, args), (_load_worker, args)], [4, 1],
                           [CONSUMER_REGISTERS, LOADER_REGISTERS])


@gluon.jit
def _dq_consume(bufs, bars, bounds, coords, out_args, sched, WG: gl.constexpr):
    """One warpgroup's 64 query rows of dQ: P and dS recomputed per key block, dQ summed over the key
    blocks in ascending order (the deterministic order of attn_bwd_dq_kernel)."""
    NUM_STAGES: gl.constexpr = sched.NUM_STAGES
    BLOCK_N: gl.constexpr = sched.BLOCK_N
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q2_desc, k2_desc, q2_smem, k2_smem = bufs
    q_bar, k_ready, v_ready, kv_empty, turn = bars
    lo, hi, full_lo, full_hi = bounds
    start_m, len_q, len_k, diag, window_left, window_right = coords
    dq_base, stride_dqs, stride_dqd, lse_base, delta_base, rows_out, qk_scale, sm_scale = out_args
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]  # dQ's first chunk
    HEAD_DIM2: gl.constexpr = q2_desc.block_type.shape[1]  # its second (with sched.SPLIT)
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_q: gl.constexpr = gl.SliceLayout(1, dq_layout)
    col_q: gl.constexpr = gl.SliceLayout(0, dq_layout)

    first_row = start_m + WG * WG_ROWS
    offs_m = first_row + gl.arange(0, WG_ROWS, layout=row_s)
    offs_n_base = gl.arange(0, BLOCK_N, layout=col_s)
    row_ok = offs_m < len_q
    lse2 = gl.load(lse_base + offs_m, mask=row_ok, other=float("inf")) * LOG2E
    delta = gl.load(delta_base + offs_m, mask=row_ok, other=0.0)
    dq = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=dq_layout)
    if sched.SPLIT:
        dq2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM2, 16])
        ds2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq2_layout, k_width=2)
        dq2 = gl.zeros([WG_ROWS, HEAD_DIM2], gl.float32, layout=dq2_layout)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    q = q_smem.index(WG)
    q2 = q2_smem.index(WG)
    do = do_smem.index(WG)
    it = 0
    for start_n in range(lo, hi, BLOCK_N):
        stage = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        k = k_smem.index(stage)
        mbarrier.wait(k_ready.index(stage), phase)
        qk = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if sched.SPLIT:  # the second chunk's product accumulates onto the first's
            qk = warpgroup_mma(q2, k2_smem.index(stage).permute((1, 0)), qk, is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp = warpgroup_mma(do, v_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))
        p = gl.exp2(qk * qk_scale - gl.expand_dims(lse2, 1))
        if (start_n < full_lo) | (start_n >= full_hi):
            offs_n = start_n + offs_n_base
            keep = visible(gl.expand_dims(offs_m, 1), gl.expand_dims(offs_n, 0), len_q, len_k, diag, window_left,
                           window_right, sched.HAS_LEFT, sched.HAS_RIGHT)
            p = gl.where(keep, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
        ds = p * (dp - gl.expand_dims(delta, 1))
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_layout), k, dq, is_async=True)
        if sched.SPLIT:
            dq2 = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds2_layout), k2_smem.index(stage), dq2,
                                is_async=True)
            dq, dq2 = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dq2))
        else:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        mbarrier.arrive(kv_empty.index(stage), count=1)
        it += 1

    offs_mq = first_row + gl.arange(0, WG_ROWS, layout=row_q)
    offs_d = gl.arange(0, HEAD_DIM, layout=col_q)
    dq = gl.where(gl.expand_dims(offs_mq < len_q, 1), dq * sm_scale, 0.0)
    ptrs = dq_base + gl.expand_dims(offs_mq, 1) * stride_dqs + gl.expand_dims(offs_d, 0) * stride_dqd
    gl.store(ptrs, dq.to(dtype), mask=gl.expand_dims(offs_mq < rows_out, 1))
    if sched.SPLIT:  # columns [HEAD_DIM, HEAD_DIM + HEAD_DIM2)
        offs_mq2 = first_row + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, dq2_layout))
        offs_d2 = HEAD_DIM + gl.arange(0, HEAD_DIM2, layout=gl.SliceLayout(0, dq2_layout))
        dq2 = gl.where(gl.expand_dims(offs_mq2 < len_q, 1), dq2 * sm_scale, 0.0)
        ptrs2 = dq_base + gl.expand_dims(offs_mq2, 1) * stride_dqs + gl.expand_dims(offs_d2, 0) * stride_dqd
        gl.store(ptrs2, dq2.to(dtype), mask=gl.expand_dims(offs_mq2 < rows_out, 1))


@gluon.jit
def _dq_consumer0(bufs, bars, bounds, coords, out_args, sched):
    _dq_consume(bufs, bars, bounds, coords, out_args, sched, 0)


@gluon.jit
def _dq_consumer1(bufs, bars, bounds, coords, out_args, sched):
    _dq_consume(bufs, bars, bounds, coords, out_args, sched, 1)


@gluon.jit
def attn_bwd_dq_ws_kernel(
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
    HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    BLOCK_DQK: gl.constexpr, BLOCK_DQK2: gl.constexpr, BLOCK_DV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    IS_THD: gl.constexpr, HAS_SEQLENS: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_ALIBI: gl.constexpr, DROPOUT: gl.constexpr,
    HEAD_GROUP: gl.constexpr, SINGLE_LOOP: gl.constexpr, SEGMENTS: gl.constexpr,
    NUM_STAGES: gl.constexpr = 2,
):
    """One program per (query block, batch * query head), as attn_bwd_dq_kernel."""
    gl.static_assert(HEAD_DIM_QK == BLOCK_DQK + BLOCK_DQK2)  # as attn_fwd_ws_kernel's
    gl.static_assert(HEAD_DIM_V == BLOCK_DV)
    gl.static_assert(BLOCK_M == 2 * WG_ROWS)
    gl.static_assert(not (HAS_BIAS or HAS_ALIBI or DROPOUT))
    start_m, batch, head, head_kv, start_q, len_q, start_k, len_k, rows_out, diag = _program(
        SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, num_heads_q, gqa_group, seqlen_q, seqlen_k,
        BLOCK_M, IS_THD, HAS_SEQLENS, BOTTOM_RIGHT, HEAD_GROUP, SEGMENTS)
    if start_m >= rows_out:
        return
    lo, full_lo, full_hi, hi = key_block_bounds(start_m, len_q, len_k, diag, window_left, window_right, BLOCK_M,
                                                BLOCK_N, HAS_LEFT, HAS_RIGHT)

    q_desc, q_smem = _row_tiles(Q, batch, head, start_q, len_q, stride_qb, stride_qs, stride_qh, BLOCK_DQK)
    do_desc, do_smem = _row_tiles(DO, batch, head, start_q, len_q, stride_dob, stride_dos, stride_doh, BLOCK_DV)
    k_desc, v_desc, k_smem, v_smem = _kv_ring(K, V, batch, head_kv, start_k, len_k, stride_kb, stride_ks, stride_kh,
                                              stride_vb, stride_vs, stride_vh, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                                              NUM_STAGES)
    q2_desc, k2_desc, q2_smem, k2_smem = _second_chunk(
        Q, K, batch, head, head_kv, start_q, len_q, start_k, len_k, stride_qb, stride_qs, stride_qh, stride_kb,
        stride_ks, stride_kh, q_desc, k_desc, q_smem, k_smem, BLOCK_DQK, BLOCK_DQK2, BLOCK_N, NUM_STAGES)
    bars = _barriers(NUM_STAGES)

    dq_base = DQ + batch.to(gl.int64) * stride_dqb + start_q * stride_dqs + head.to(gl.int64) * stride_dqh
    lse_off = batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
    bufs = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q2_desc, k2_desc, q2_smem, k2_smem)
    bounds = (lo, hi, full_lo, full_hi)
    coords = (start_m, len_q, len_k, diag, window_left, window_right)
    out_args = (dq_base, stride_dqs, stride_dqd, LSE + lse_off, DELTA + lse_off, rows_out, qk_scale, sm_scale)
    sched = _Schedule(NUM_STAGES, BLOCK_N, HAS_LEFT, HAS_RIGHT, 2, SPLIT=BLOCK_DQK2 > 0)
    args = (bufs, bars, bounds, coords, out_args, sched)
    gl.warp_specialize([(_dq_consumer0, args), (_dq_consumer1, args), (_load_worker, args)], [4, 1],
                       [CONSUMER_REGISTERS, LOADER_REGISTERS])


# dK/dV: both consumers hold 64 keys of dK and dV (128 fp32 registers) plus a block's S^T, dP^T and their
# bf16 copies; 240 each (3 * 168 - 240 - 24) is the most the register file gives two consumers.
DKDV_CONSUMER_REGISTERS = gl.constexpr(240)
LOADER_THREADS = gl.constexpr(32)


@gluon.jit
def _dkdv_barriers(NUM_STAGES: gl.constexpr):
    """(kv_bar, q_ready, do_ready, stat_ready, qdo_empty), initialised: K/V's barrier, the ring's ready
    barriers (stat_ready counts the loader's 32 cp.async threads) and its empty barriers (both consumers)."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    stat_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(stat_ready.index(i), count=LOADER_THREADS)
        mbarrier.init(qdo_empty.index(i), count=2)
    fence_async_shared()
    return kv_bar, q_ready, do_ready, stat_ready, qdo_empty


@gluon.jit
def _dkdv_loader(bufs, bars, bounds, coords, out_args, sched):
    """One warp: K and V once (both consumers' halves), then per query block of each query head of the
    GQA group in order: Q and dO with TMA (a descriptor per head), the block's LSE and delta rows with
    cp.async (any alignment; rows past the sequence read as 0, which the consumers' row mask covers)."""
    NUM_STAGES: gl.constexpr = sched.NUM_STAGES
    BLOCK_M: gl.constexpr = sched.BLOCK_N  # the ring's blocks are query blocks here
    k_desc, v_desc, q_rows, do_rows, stat_rows, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = bufs
    kv_bar, q_ready, do_ready, stat_ready, qdo_empty = bars
    lo, hi, full_lo, full_hi = bounds
    start_n, len_q = coords[0], coords[1]
    q_head0, stride_qh, stride_qs, do_head0, stride_doh, stride_dos, gqa_group = q_rows + do_rows
    lse_head0, delta_head0, stride_lh = stat_rows
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    row_layout: gl.constexpr = q_smem.type.layout
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // LOADER_THREADS], [LOADER_THREADS], [1], [0])
    if sched.WITH_DK:  # V is read for dP = V dO^T only
        mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    else:
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    for wg in gl.static_range(2):
        tma_async_load(k_desc, [start_n + wg * WG_ROWS, 0], kv_bar, k_smem.index(wg))
        if sched.WITH_DK:
            tma_async_load(v_desc, [start_n + wg * WG_ROWS, 0], kv_bar, v_smem.index(wg))
    offs = gl.arange(0, BLOCK_M, layout=stat_layout)
    it = 0
    for g in range(gqa_group):
        q_desc = _rows_desc(q_head0 + g * stride_qh, len_q, stride_qs, HEAD_DIM, BLOCK_M, row_layout)
        do_desc = _rows_desc(do_head0 + g * stride_doh, len_q, stride_dos, HEAD_DIM, BLOCK_M, row_layout)
        lse_head = lse_head0 + g * stride_lh
        delta_head = delta_head0 + g * stride_lh
        for start_m in range(lo, hi, BLOCK_M):
            stage = it % NUM_STAGES
            mbarrier.wait(qdo_empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
            tma_async_load(q_desc, [start_m, 0], q_ready.index(stage), q_smem.index(stage))
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
            tma_async_load(do_desc, [start_m, 0], do_ready.index(stage), do_smem.index(stage))
            rows = start_m + offs
            cp_async_load(lse_smem.index(stage), lse_head + rows, mask=rows < len_q)
            cp_async_load(delta_smem.index(stage), delta_head + rows, mask=rows < len_q)
            # Each thread's arrival fires when its copies land (.noinc: the barrier counts 32 of them).
            async_copy.mbarrier_arrive(stat_ready.index(stage), increment_count=False)
            it += 1


@gluon.jit
def _dkdv_consume(bufs, bars, bounds, coords, out_args, sched, WG: gl.constexpr):
    """One warpgroup's 64 keys of dK and dV, summed over the query blocks in ascending order, query head
    by query head of the GQA group (the deterministic order of attn_bwd_dkdv_kernel)."""
    NUM_STAGES: gl.constexpr = sched.NUM_STAGES
    BLOCK_M: gl.constexpr = sched.BLOCK_N  # the ring's blocks are query blocks here
    k_desc, v_desc, q_rows, do_rows, stat_rows, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = bufs
    gqa_group = do_rows[-1]
    kv_bar, q_ready, do_ready, stat_ready, qdo_empty = bars
    lo, hi, full_lo, full_hi = bounds
    start_n, len_q, len_k, diag, window_left, window_right = coords
    dk_base, dv_base, stride_dks, stride_dvs, stride_dkd, stride_dvd, rows_out, qk_scale, sm_scale = out_args
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_a: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_a: gl.constexpr = gl.SliceLayout(0, acc_layout)

    first_key = start_n + WG * WG_ROWS
    dk = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([WG_ROWS, BLOCK_M], gl.float32, layout=s_layout)

    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    it = 0
    for g in range(gqa_group):
        for start_m in range(lo, hi, BLOCK_M):
            stage = it % NUM_STAGES
            phase = (it // NUM_STAGES) & 1
            q = q_smem.index(stage)
            do = do_smem.index(stage)
            mbarrier.wait(q_ready.index(stage), phase)
            qk_t = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(stage), phase)
            if sched.WITH_DK:
                dp_t = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(stat_ready.index(stage), phase)
            lse2 = lse_smem.index(stage).load(col_s) * LOG2E
            if sched.WITH_DK:
                qk_t = warpgroup_mma_wait(num_outstanding=1, deps=(qk_t, ))
            else:
                qk_t = warpgroup_mma_wait(num_outstanding=0, deps=(qk_t, ))
            p_t = gl.exp2(qk_t * qk_scale - gl.expand_dims(lse2, 0))
            if (start_m < full_lo) | (start_m >= full_hi):
                offs_n = first_key + gl.arange(0, WG_ROWS, layout=row_s)
                offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_s)
                keep = visible(gl.expand_dims(offs_m, 0), gl.expand_dims(offs_n, 1), len_q, len_k, diag, window_left,
                               window_right, sched.HAS_LEFT, sched.HAS_RIGHT)
                p_t = gl.where(keep, p_t, 0.0)
            if sched.WITH_DV:
                dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do, dv, is_async=True)
            if sched.WITH_DK:
                delta = delta_smem.index(stage).load(col_s)
                if sched.WITH_DV:
                    dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, ))
                else:
                    dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, ))
                ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
                dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), op_layout), q, dk, is_async=True)
            if sched.WITH_DK and sched.WITH_DV:
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            elif sched.WITH_DK:
                dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
            else:
                dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv, ))
            mbarrier.arrive(qdo_empty.index(stage), count=1)
            it += 1

    offs_na = first_key + gl.arange(0, WG_ROWS, layout=row_a)
    offs_d = gl.arange(0, HEAD_DIM, layout=col_a)
    key_ok = gl.expand_dims(offs_na < len_k, 1)
    out_rows = gl.expand_dims(offs_na < rows_out, 1)
    if sched.WITH_DK:
        dk = gl.where(key_ok, dk * sm_scale, 0.0)
    if sched.WITH_DV:
        dv = gl.where(key_ok, dv, 0.0)
    if sched.WITH_DK:
        gl.store(dk_base + gl.expand_dims(offs_na, 1) * stride_dks + gl.expand_dims(offs_d, 0) * stride_dkd,
                 dk.to(dtype), mask=out_rows)
    if sched.WITH_DV:
        gl.store(dv_base + gl.expand_dims(offs_na, 1) * stride_dvs + gl.expand_dims(offs_d, 0) * stride_dvd,
                 dv.to(dtype), mask=out_rows)


@gluon.jit
def _dkdv_consumer0(bufs, bars, bounds, coords, out_args, sched):
    _dkdv_consume(bufs, bars, bounds, coords, out_args, sched, 0)


@gluon.jit
def _dkdv_consumer1(bufs, bars, bounds, coords, out_args, sched):
    _dkdv_consume(bufs, bars, bounds, coords, out_args, sched, 1)


@gluon.jit
def attn_bwd_dkdv_ws_kernel(
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
    num_heads_kv, gqa_group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, window_left, window_right, dropout_p,
    HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    IS_THD: gl.constexpr, HAS_SEQLENS: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_ALIBI: gl.constexpr, DROPOUT: gl.constexpr,
    HEAD_GROUP: gl.constexpr, SINGLE_LOOP: gl.constexpr, SEGMENTS: gl.constexpr,
    WITH_DK: gl.constexpr, WITH_DV: gl.constexpr,
    NUM_STAGES: gl.constexpr = 2,
):
    """One program per (key block of 128, batch * kv head), as attn_bwd_dkdv_kernel:
    BLOCK_N = 128 keys as two consumers of 64, query blocks of BLOCK_M through the loader's ring.
    WITH_DK / WITH_DV as attn_bwd_dkdv_kernel's: a pass of one gradient keeps one accumulator per consumer."""
    gl.static_assert(WITH_DK or WITH_DV)
    gl.static_assert(HEAD_DIM_QK == HEAD_DIM_V)
    gl.static_assert(HEAD_DIM_QK == BLOCK_DQK)
    gl.static_assert(BLOCK_DV == BLOCK_DQK)
    gl.static_assert(BLOCK_N == 2 * WG_ROWS)
    gl.static_assert(BLOCK_M % LOADER_THREADS == 0)
    gl.static_assert(not (HAS_BIAS or HAS_ALIBI or DROPOUT))
    block, seq_head = _grid_program(HEAD_GROUP)
    if SEGMENTS > 1:
        row = seq_head // num_heads_kv
        batch, start_n = segment_block(SEQ_LEN_K, row, block, SEGMENTS, BLOCK_N, False)
        if batch < 0:  # past the row's blocks: exits below
            batch = row * SEGMENTS
            start_n = seqlen_k
    else:
        start_n = block * BLOCK_N  # first blocks first: under causal masks they see the most queries
        batch = seq_head // num_heads_kv
    head = seq_head % num_heads_kv
    start_q, len_q, start_k, len_k = _extents(SEQ_START_Q, SEQ_START_K, SEQ_LEN_Q, SEQ_LEN_K, batch, seqlen_q,
                                              seqlen_k, IS_THD, HAS_SEQLENS)
    rows_out = seqlen_k
    if IS_THD:
        rows_out = len_k
    if start_n >= rows_out:
        return
    diag = 0
    if BOTTOM_RIGHT:
        diag = len_k - len_q
    lo, full_lo, full_hi, hi = query_block_bounds(start_n, len_q, len_k, diag, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    dtype: gl.constexpr = Q.dtype.element_ty
    k_desc, k_smem = _row_tiles(K, batch, head, start_k, len_k, stride_kb, stride_ks, stride_kh, HEAD_DIM_QK)
    v_desc, v_smem = k_desc, k_smem  # never read without dK: no shared memory for V
    if WITH_DK:
        v_desc, v_smem = _row_tiles(V, batch, head, start_k, len_k, stride_vb, stride_vs, stride_vh, HEAD_DIM_V)
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_DQK], dtype)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    head0 = head * gqa_group  # the group's first query head
    q_rows = (Q + batch.to(gl.int64) * stride_qb + start_q * stride_qs + head0.to(gl.int64) * stride_qh, stride_qh,
              stride_qs)
    do_rows = (DO + batch.to(gl.int64) * stride_dob + start_q * stride_dos + head0.to(gl.int64) * stride_doh,
               stride_doh, stride_dos, gqa_group)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_DQK], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_DV], row_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stat_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stat_layout)
    bars = _dkdv_barriers(NUM_STAGES)

    dk_base = DK + batch.to(gl.int64) * stride_dkb + start_k * stride_dks + head.to(gl.int64) * stride_dkh
    dv_base = DV + batch.to(gl.int64) * stride_dvb + start_k * stride_dvs + head.to(gl.int64) * stride_dvh
    lse_off = batch.to(gl.int64) * stride_lb + head0.to(gl.int64) * stride_lh
    stat_rows = (LSE + lse_off, DELTA + lse_off, stride_lh)  # the group's first query head's LSE and delta
    bufs = (k_desc, v_desc, q_rows, do_rows, stat_rows, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem)
    bounds = (lo, hi, full_lo, full_hi)
    coords = (start_n, len_q, len_k, diag, window_left, window_right)
    out_args = (dk_base, dv_base, stride_dks, stride_dvs, stride_dkd, stride_dvd, rows_out, qk_scale, sm_scale)
    sched = _Schedule(NUM_STAGES, BLOCK_M, HAS_LEFT, HAS_RIGHT, 0, WITH_DK, WITH_DV)
    args = (bufs, bars, bounds, coords, out_args, sched)
    gl.warp_specialize([(_dkdv_consumer0, args), (_dkdv_consumer1, args), (_dkdv_loader, args)], [4, 1],
                       [DKDV_CONSUMER_REGISTERS, LOADER_REGISTERS])


# Every kernel's cache key computed callees first: the same key in every process, whatever it compiles first.
settle_cache_keys(globals())
