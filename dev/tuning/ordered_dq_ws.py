"""The one-pass backward with ordered dQ, warp-specialized in Gluon (sm_90): the next form of ordered_dq.py.

ordered_dq.py measured the Triton one pass slower than the product's two passes even without the order
(NOTES.md 26): one program holding dK, dV and its dQ part costs more than the recompute saves. This form
starts from the product's warp-specialized dK/dV kernel (kernels/hopper_ws.py: a loader warp, two consumer
warpgroups of 64 keys, dK and dV in registers) and adds to each consumer's loop the block's dQ part over its
64 keys, dS K, in column chunks of DQ_CHUNK (so that at most [64, DQ_CHUNK] fp32 more is live), added to an
fp32 accumulator. ADD: ``gl.atomic_add`` per element (ATOM, SASS ATOMG), inline-PTX ``red.global.add.f32`` per
element (RED, REDG), or (TMA) the chunk staged in shared memory and added by one TMA reduce-add
(``cp.reduce.async.bulk.tensor``, SASS UTMAREDG): Triton 3.6's Gluon has no call for it, but its op builder
has the op (``tma_reduce_add`` below), as flash-attn-3/4 add their dQ. Element atomics measured 0.31-0.49 of the
product's two passes (NOTES.md 28); TMA is the form left to measure.

ORDER (as ordered_dq.py): UNORDERED adds as they come (not deterministic: the upper bound); HIGHEST_FIRST
gives the adds to one query block a fixed order, the visiting key blocks highest first and within a program
the first consumer's keys before the second's: a consumer waits until the query block's semaphore counts
the adds before its own, adds, then increments it (release). Programs run highest key block first, so every
wait is on a program that started earlier (no deadlock at any residency). ROTATED (no mask): each program
walks the query blocks from its own diagonal round, and the adds to a block follow arrival (the diagonal's key
block first), so in the ideal nobody waits; the waits are cyclic within a head, so a head's key blocks must be
resident together (true when programs start in grid order and a head has fewer key blocks than the GPU slots).

Scope: bshd contiguous, h_q = h_kv, s_q = s_kv divisible by 128, d = 128, bf16/fp16, no mask or top-left
causal, no bias, dropout, window or sink.

    python dev/tuning/ordered_dq_ws.py --compile   # the CPU: sm_90 registers, spills, shared memory
    python dev/tuning/ordered_dq_ws.py --simulate  # the CPU: the turns' schedule (deadlocks, order, waiting)
    python dev/tuning/ordered_dq_ws.py             # the GPU: errors, bitwise repeats, times against the product
    python dev/tuning/ordered_dq_ws.py --orders unordered   # the GPU, without the semaphores (cannot hang)
"""
# throwaway: an experiment on the product's private Gluon helpers (hopper_ws._row_tiles, ...); not kept working.

import argparse
import os
import sys

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.language.core import _aggregate as aggregate
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from transformer_engine.common.attention.kernels.hopper_ws import (
    DKDV_CONSUMER_REGISTERS,
    LOADER_REGISTERS,
    LOADER_THREADS,
    LOG2E,
    WG_ROWS,
    _dkdv_barriers,
    _row_tiles,
    _rows_desc,
)
from transformer_engine.common.attention.kernels.masking import query_block_bounds, visible

UNORDERED, HIGHEST_FIRST, ROTATED = 0, 1, 2  # ORDER (the kernel compares with the literals)
ORDER_NAMES = {UNORDERED: "unordered", HIGHEST_FIRST: "highest-first", ROTATED: "rotated"}
ATOM, RED, TMA = 0, 1, 2  # ADD: how a dQ chunk is added (the kernel compares with the literals)
ADD_NAMES = {ATOM: "atom", RED: "red", TMA: "tma"}


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[desc at coord] += src (shared memory, the descriptor's block) by a TMA reduce-add; complete
    before src is reused or the result is read with ``tma.store_wait``. (Gluon's op builder has the op; 3.6's
    Gluon language does not call it.)"""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@aggregate
class _OnePass:
    """Compile-time choices of the partitions (hopper_ws._Schedule's fields that the dK/dV loader reads, and
    this kernel's own): warp_specialize passes plain constexpr arguments as runtime values."""

    NUM_STAGES: gl.constexpr
    BLOCK_N: gl.constexpr  # the ring's blocks: query blocks of BLOCK_M here (the loader's name)
    HAS_LEFT: gl.constexpr
    HAS_RIGHT: gl.constexpr  # causal
    WITH_DK: gl.constexpr  # the loader brings V (always here)
    DQ_CHUNK: gl.constexpr
    ORDER: gl.constexpr
    ADD: gl.constexpr  # ATOM, RED or TMA (how a dQ chunk is added)

    @gluon.constexpr_function
    def __init__(self, NUM_STAGES, BLOCK_N, CAUSAL, DQ_CHUNK, ORDER, ADD):
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.HAS_LEFT = gl.constexpr(False)
        self.HAS_RIGHT = gl.constexpr(CAUSAL)
        self.WITH_DK = gl.constexpr(True)
        self.DQ_CHUNK = gl.constexpr(DQ_CHUNK)
        self.ORDER = gl.constexpr(ORDER)
        self.ADD = gl.constexpr(ADD)


@gluon.jit
def _block_start(it, lo, start_n, num_blocks, BLOCK_M: gl.constexpr, ORDER: gl.constexpr):
    """The query block of step ``it``: ascending from ``lo``; rotated, from the key block's diagonal round."""
    if ORDER == 2:
        return ((start_n // BLOCK_M + it) % num_blocks) * BLOCK_M
    return lo + it * BLOCK_M


@gluon.jit
def _loader(bufs, bars, bounds, coords, out_args, sched):
    """hopper_ws._dkdv_loader for one query head, its query blocks in the consumers' order (_block_start)."""
    NUM_STAGES: gl.constexpr = sched.NUM_STAGES
    BLOCK_M: gl.constexpr = sched.BLOCK_N
    k_desc, v_desc, q_rows, do_rows, stat_rows, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = bufs
    kv_bar, q_ready, do_ready, stat_ready, qdo_empty = bars
    lo, hi, full_lo, full_hi = bounds
    start_n, len_q = coords[0], coords[1]
    q_head, stride_qh, stride_qs = q_rows
    do_head, stride_doh, stride_dos, gqa_group = do_rows
    lse_head, delta_head, stride_lh = stat_rows
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    row_layout: gl.constexpr = q_smem.type.layout
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // LOADER_THREADS], [LOADER_THREADS], [1], [0])
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for wg in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [start_n + wg * WG_ROWS, 0], kv_bar, k_smem.index(wg))
        tma.async_copy_global_to_shared(v_desc, [start_n + wg * WG_ROWS, 0], kv_bar, v_smem.index(wg))
    offs = gl.arange(0, BLOCK_M, layout=stat_layout)
    q_desc = _rows_desc(q_head, len_q, stride_qs, HEAD_DIM, BLOCK_M, row_layout)
    do_desc = _rows_desc(do_head, len_q, stride_dos, HEAD_DIM, BLOCK_M, row_layout)
    num_blocks = (hi - lo) // BLOCK_M
    for it in range(num_blocks):
        start_m = _block_start(it, lo, start_n, num_blocks, BLOCK_M, sched.ORDER)
        stage = it % NUM_STAGES
        mbarrier.wait(qdo_empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_ready.index(stage), q_smem.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [start_m, 0], do_ready.index(stage), do_smem.index(stage))
        rows = start_m + offs
        async_copy.async_copy_global_to_shared(lse_smem.index(stage), lse_head + rows, mask=rows < len_q)
        async_copy.async_copy_global_to_shared(delta_smem.index(stage), delta_head + rows, mask=rows < len_q)
        async_copy.mbarrier_arrive(stat_ready.index(stage), increment_count=False)


@gluon.jit
def _add_dq_part(ds_t, k, dq_rows, stride_dqs, dq_desc, dq_stage, start_m, len_q, sm_scale, BLOCK_M: gl.constexpr,
                 HEAD_DIM: gl.constexpr, DQ_CHUNK: gl.constexpr, ADD: gl.constexpr, dtype: gl.constexpr):
    """dQ[start_m:start_m + BLOCK_M] += sm_scale * dS K over this warpgroup's 64 keys (ds_t: [keys, queries])."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, DQ_CHUNK, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    ds = gl.convert_layout(gl.permute(ds_t.to(dtype), (1, 0)), op_layout)  # [queries, keys]
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    offs_c = gl.arange(0, DQ_CHUNK, layout=gl.SliceLayout(0, acc_layout))
    row_ok = gl.expand_dims(offs_m < len_q, 1)
    zero = gl.zeros([BLOCK_M, DQ_CHUNK], gl.float32, layout=acc_layout)
    for c in gl.static_range(HEAD_DIM // DQ_CHUNK):
        part = warpgroup_mma(ds, k.slice(c * DQ_CHUNK, DQ_CHUNK, dim=1), zero, use_acc=False)
        if ADD == 2:  # stage the chunk, one TMA reduce-add (rows past the sequence: the descriptor clips them)
            tma.store_wait(0)  # the previous chunk's reduce has read the stage
            dq_stage.store(part * sm_scale)
            fence_async_shared()
            gl.thread_barrier()  # every thread's part is in the stage before the reduce is issued
            tma_reduce_add(dq_desc, [start_m, c * DQ_CHUNK], dq_stage)
        else:
            ptrs = dq_rows + gl.expand_dims(offs_m, 1) * stride_dqs + gl.expand_dims(c * DQ_CHUNK + offs_c, 0)
            if ADD == 1:  # fire-and-forget reductions: no old value to wait for (rows all inside: s % 128 == 0)
                gl.inline_asm_elementwise("red.global.gpu.relaxed.add.f32 [$1], $2; mov.u32 $0, 0;", "=r,l,f",
                                          [ptrs.to(gl.int64), part * sm_scale], dtype=gl.int32, is_pure=False,
                                          pack=1)
            else:
                gl.atomic_add(ptrs, part * sm_scale, mask=row_ok, sem="relaxed")
    if ADD == 2:
        tma.store_wait(0)  # this block's reduces are done reading before the semaphore passes the turn on


@gluon.jit
def _consume(bufs, bars, bounds, coords, out_args, sched, WG: gl.constexpr):
    """The product's dK/dV consumer (hopper_ws._dkdv_consume without windows or GQA) plus the dQ part."""
    NUM_STAGES: gl.constexpr = sched.NUM_STAGES
    BLOCK_M: gl.constexpr = sched.BLOCK_N  # the ring's blocks are query blocks here
    k_desc, v_desc, q_rows, do_rows, stat_rows, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = bufs
    kv_bar, q_ready, do_ready, stat_ready, qdo_empty = bars
    lo, hi, full_lo, full_hi = bounds
    start_n, len_q, len_k, diag, window_left, window_right = coords
    dk_base, dv_base, stride_dks, rows_out, qk_scale, sm_scale, dq_rows, sem_row, key_block, dq_desc, dq_smem = out_args
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
    num_blocks = (hi - lo) // BLOCK_M
    for it in range(num_blocks):
        start_m = _block_start(it, lo, start_n, num_blocks, BLOCK_M, sched.ORDER)
        stage = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        q = q_smem.index(stage)
        do = do_smem.index(stage)
        mbarrier.wait(q_ready.index(stage), phase)
        qk_t = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp_t = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(stat_ready.index(stage), phase)
        lse2 = lse_smem.index(stage).load(col_s) * LOG2E
        qk_t = warpgroup_mma_wait(num_outstanding=1, deps=(qk_t, ))
        p_t = gl.exp2(qk_t * qk_scale - gl.expand_dims(lse2, 0))
        if (start_m < full_lo) | (start_m >= full_hi):
            offs_n = first_key + gl.arange(0, WG_ROWS, layout=row_s)
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_s)
            keep = visible(gl.expand_dims(offs_m, 0), gl.expand_dims(offs_n, 1), len_q, len_k, diag, window_left,
                           window_right, sched.HAS_LEFT, sched.HAS_RIGHT)
            p_t = gl.where(keep, p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do, dv, is_async=True)
        delta = delta_smem.index(stage).load(col_s)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, ))
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), op_layout), q, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(qdo_empty.index(stage), count=1)  # Q and dO are read: K is what dQ needs
        # The adds before this one at the query block: 2 per visiting key block above this one, then the
        # first consumer's.
        block_m = start_m // BLOCK_M
        if sched.ORDER != 0:
            num_keys = len_k // (2 * WG_ROWS)
            if sched.ORDER == 1:  # highest first: the visiting key blocks above this one
                top = num_keys - 1
                if sched.HAS_RIGHT:
                    top = gl.minimum(top, (start_m + BLOCK_M - 1) // (2 * WG_ROWS))
                turn = 2 * (top - key_block) + WG
            else:  # rotated: by arrival, the key block of this query block's diagonal first
                turn = 2 * ((start_m // (2 * WG_ROWS) - key_block + num_keys) % num_keys) + WG
            while gl.atomic_add(sem_row + block_m, 0, sem="acquire") < turn:
                pass
        _add_dq_part(ds_t, k, dq_rows, stride_dks, dq_desc, dq_smem.index(WG), start_m, len_q, sm_scale, BLOCK_M,
                     HEAD_DIM, sched.DQ_CHUNK, sched.ADD, dtype)
        if sched.ORDER != 0:
            gl.thread_barrier()  # the warpgroup's adds are issued before its increment releases them
            gl.atomic_add(sem_row + block_m, 1, sem="release")

    offs_na = first_key + gl.arange(0, WG_ROWS, layout=row_a)
    offs_d = gl.arange(0, HEAD_DIM, layout=col_a)
    key_ok = gl.expand_dims(offs_na < len_k, 1)
    out_rows = gl.expand_dims(offs_na < rows_out, 1)
    dk = gl.where(key_ok, dk * sm_scale, 0.0)
    dv = gl.where(key_ok, dv, 0.0)
    gl.store(dk_base + gl.expand_dims(offs_na, 1) * stride_dks + gl.expand_dims(offs_d, 0), dk.to(dtype),
             mask=out_rows)
    gl.store(dv_base + gl.expand_dims(offs_na, 1) * stride_dks + gl.expand_dims(offs_d, 0), dv.to(dtype),
             mask=out_rows)


@gluon.jit
def _consumer0(bufs, bars, bounds, coords, out_args, sched):
    _consume(bufs, bars, bounds, coords, out_args, sched, 0)


@gluon.jit
def _consumer1(bufs, bars, bounds, coords, out_args, sched):
    _consume(bufs, bars, bounds, coords, out_args, sched, 1)


@gluon.jit
def attn_bwd_one_pass_ws_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, DQ_ACC, SEM, seqlen, num_heads, qk_scale, sm_scale,
                                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                                ORDER: gl.constexpr, DQ_CHUNK: gl.constexpr, ADD: gl.constexpr = 0,
                                NUM_STAGES: gl.constexpr = 2):
    """One program per (key block of 128, batch * head), highest key block first; [b, s, h, d] tensors,
    LSE and DELTA [b, h, s] fp32, DQ_ACC [b, s, h, d] fp32 zeroed, SEM [b * h, s // BLOCK_M] int32 zeroed."""
    gl.static_assert(BLOCK_M % LOADER_THREADS == 0)
    BLOCK_N: gl.constexpr = 2 * WG_ROWS
    key_block = seqlen // BLOCK_N - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    batch = bh // num_heads
    head = bh % num_heads
    start_n = key_block * BLOCK_N
    row = num_heads * HEAD_DIM  # the stride of a sequence position
    window_right = -1
    if CAUSAL:
        window_right = 0
    lo, full_lo, full_hi, hi = query_block_bounds(start_n, seqlen, seqlen, 0, -1, window_right, BLOCK_M, BLOCK_N,
                                                  False, CAUSAL)
    dtype: gl.constexpr = Q.dtype.element_ty
    k_desc, k_smem = _row_tiles(K, batch, head, 0, seqlen, seqlen * row, row, HEAD_DIM, HEAD_DIM)
    v_desc, v_smem = _row_tiles(V, batch, head, 0, seqlen, seqlen * row, row, HEAD_DIM, HEAD_DIM)
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    head_off = batch.to(gl.int64) * seqlen * row + head.to(gl.int64) * HEAD_DIM
    q_rows = (Q + head_off, HEAD_DIM, row)
    do_rows = (DO + head_off, HEAD_DIM, row, 1)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], row_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stat_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stat_layout)
    bars = _dkdv_barriers(NUM_STAGES)
    stat_off = bh.to(gl.int64) * seqlen
    stat_rows = (LSE + stat_off, DELTA + stat_off, seqlen)
    bufs = (k_desc, v_desc, q_rows, do_rows, stat_rows, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem)
    bounds = (lo, hi, full_lo, full_hi)
    coords = (start_n, seqlen, seqlen, 0, -1, window_right)
    # TMA adds: a descriptor over the head's fp32 dQ rows, a [BLOCK_M, DQ_CHUNK] stage per consumer (1 row when
    # unused, so the other modes keep their shared memory)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_CHUNK], gl.float32)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC + head_off, shape=[seqlen, HEAD_DIM], strides=[row, 1],
                                         block_shape=[BLOCK_M, DQ_CHUNK], layout=dq_layout)
    STAGE_ROWS: gl.constexpr = BLOCK_M if ADD == 2 else 1
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, STAGE_ROWS, DQ_CHUNK], dq_layout)
    out_args = (DK + head_off, DV + head_off, row, seqlen, qk_scale, sm_scale, DQ_ACC + head_off,
                SEM + bh.to(gl.int64) * (seqlen // BLOCK_M), key_block, dq_desc, dq_smem)
    gl.static_assert(not (CAUSAL and ORDER == 2))  # rotated: no mask only
    sched = _OnePass(NUM_STAGES, BLOCK_M, CAUSAL, DQ_CHUNK, ORDER, ADD)
    args = (bufs, bars, bounds, coords, out_args, sched)
    gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args)], [4, 1],
                       [DKDV_CONSUMER_REGISTERS, LOADER_REGISTERS])


def _turn(order, causal, m, j, wg, num_keys):
    """The kernel's turn of (key block j, consumer wg) at query block m (64 rows), as _consume computes it."""
    if order == HIGHEST_FIRST:
        top = min(num_keys - 1, (m * 64 + 63) // 128) if causal else num_keys - 1
        return 2 * (top - j) + wg
    return 2 * ((m * 64 // 128 - j + num_keys) % num_keys) + wg


def _visits(order, causal, j, num_q):
    """The query blocks (of 64) key block j's consumers walk, in order (_block_start)."""
    lo = 2 * j if causal else 0
    n = num_q - lo
    return [((2 * j + it) % n) if order == ROTATED else lo + it for it in range(n)]


def simulate(order, causal, num_keys, resident, stages=2):
    """Programs (highest key block first, at most ``resident`` at once) of two consumers sharing a ring of
    ``stages`` buffers step by step: returns (finished, steps, waiting share of consumer-steps). Checks that each
    query block's adds follow the turns 0, 1, 2, ... exactly."""
    num_q = 2 * num_keys
    sem = [0] * num_q
    order_seen = [[] for _ in range(num_q)]
    pending = list(range(num_keys - 1, -1, -1))
    live = {}  # j -> [position, phase ('compute' / 'wait'), arrived] per consumer
    steps = waiting = busy = 0
    while pending or live:
        while pending and len(live) < resident:
            live[pending.pop(0)] = [[0, "compute", 0], [0, "compute", 0]]
        progressed = False
        moves = []
        for j, wgs in live.items():
            visits = _visits(order, causal, j, num_q)
            for wg, st in enumerate(wgs):
                if st[0] >= len(visits):
                    continue
                busy += 1
                if st[1] == "compute":  # the ring: the block is loaded once both consumers freed its buffer
                    if wgs[1 - wg][2] >= st[0] - stages + 1:
                        moves.append((j, wg, "compute", None))
                    else:
                        waiting += 1
                else:
                    m = visits[st[0]]
                    if order == UNORDERED or sem[m] == _turn(order, causal, m, j, wg, num_keys):
                        moves.append((j, wg, "add", m))
                    else:
                        waiting += 1
        for j, wg, kind, m in moves:
            st = live[j][wg]
            if kind == "compute":
                st[1], st[2] = "wait", st[0] + 1
            else:
                sem[m] += 1
                order_seen[m].append(_turn(order, causal, m, j, wg, num_keys))
                st[0], st[1] = st[0] + 1, "compute"
            progressed = True
        for j in [j for j, wgs in live.items() if all(st[0] >= len(_visits(order, causal, j, num_q)) for st in wgs)]:
            del live[j]
        steps += 1
        if not progressed and not (pending and len(live) < resident):
            return False, steps, waiting / max(busy, 1)
    if order != UNORDERED:
        for m, seen in enumerate(order_seen):
            assert seen == list(range(len(seen))), (order, causal, m, seen)
    return True, steps, waiting / max(busy, 1)


def check_schedules() -> int:
    """The turns on the CPU: every order finishes at full residency, highest-first at any residency, rotated
    deadlocks when a head's key blocks are not resident together; each block's adds in turn order."""
    failures = 0
    for num_keys in (1, 2, 5, 8):
        for order, causal in ((HIGHEST_FIRST, False), (HIGHEST_FIRST, True), (ROTATED, False), (UNORDERED, True)):
            for resident in sorted({num_keys, max(1, num_keys // 2), 1}):
                done, steps, wait = simulate(order, causal, num_keys, resident)
                want = resident == num_keys or order != ROTATED or num_keys == 1
                failures += done != want
                print(f"keys={num_keys} {ORDER_NAMES[order]} causal={causal} resident={resident}: "
                      f"{'finished' if done else 'deadlock'} in {steps} steps, waiting {wait:.0%}"
                      f"{'' if done == want else '  UNEXPECTED'}")
    return failures


def compile_sm90() -> None:
    """Each variant compiled for sm_90 here (no GPU needed): registers, stack (spills), shared memory."""
    from transformer_engine.common.attention.kernels.aot import Pointer, compile_kernel
    from transformer_engine.common.attention.kernels.resources import resources, target

    ptr = {name: Pointer(dt) for name, dt in (("Q", "bfloat16"), ("K", "bfloat16"), ("V", "bfloat16"),
                                              ("DO", "bfloat16"), ("DK", "bfloat16"), ("DV", "bfloat16"),
                                              ("LSE", "float32"), ("DELTA", "float32"), ("DQ_ACC", "float32"),
                                              ("SEM", "int32"))}
    for chunk, add in ((64, TMA), (128, TMA), (32, ATOM), (64, ATOM), (128, ATOM), (64, RED), (128, RED)):
        for causal in (False, True):
            for order in (UNORDERED, HIGHEST_FIRST) + (() if causal else (ROTATED,)):
                args = dict(ptr, seqlen=4096, num_heads=16, qk_scale=0.1, sm_scale=0.1, HEAD_DIM=128, BLOCK_M=64,
                            CAUSAL=causal, ORDER=order, DQ_CHUNK=chunk, ADD=add, NUM_STAGES=2)
                try:
                    kernel = compile_kernel(attn_bwd_one_pass_ws_kernel, args, dict(num_warps=4, maxnreg=168),
                                            target("sm90"))
                    report = resources(kernel)
                except Exception as err:
                    report = {"error": f"{type(err).__name__}: {str(err)[-700:]}"}
                print(f"chunk={chunk} add={ADD_NAMES[add]} causal={causal} order={ORDER_NAMES[order]}: {report}",
                      flush=True)


def one_pass_backward(q, k, v, out, d_out, lse, causal, order=HIGHEST_FIRST, dq_chunk=64, add=TMA, parts=None):
    """(dq, dk, dv) over [b, s, h, d] contiguous tensors on the GPU; ``lse`` [b, h, s] (the product's)."""
    from ordered_dq import _delta_kernel

    b, s, h, d = q.shape
    assert s % 128 == 0 and d == 128 and k.shape == q.shape and v.shape == q.shape, "the prototype's scope"
    scale = d ** -0.5
    delta = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    _delta_kernel[(s // 64, b * h)](out, d_out, delta, s, h, HEAD_DIM=d, BLOCK_M=64)
    acc = torch.zeros((b, s, h, d), dtype=torch.float32, device=q.device)
    sem = torch.zeros((b * h, s // 64), dtype=torch.int32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, d_out, dk, dv, lse, delta, acc, sem, s, h, scale * 1.4426950408889634, scale)
    meta = dict(HEAD_DIM=d, BLOCK_M=64, CAUSAL=causal, ORDER=order, DQ_CHUNK=dq_chunk, ADD=add, num_warps=4,
                maxnreg=168)
    grid = (s // 128, b * h)
    attn_bwd_one_pass_ws_kernel[grid](*args, **meta)
    if parts is not None:
        parts.update(kernel=attn_bwd_one_pass_ws_kernel, acc=acc, sem=sem, grid=grid, args=args, meta=meta)
    return acc.to(q.dtype), dk, dv


def run_gpu(out_path, orders=(UNORDERED, HIGHEST_FIRST)):
    """ordered_dq.compare_on_gpu at d=128 (checks, then times at 8x32x2048 and 4x16x4096): each order with
    TMA reduce-adds at DQ_CHUNK 64 and 128, and element atomics (the measured best of the element adds) at 64;
    rotated without a mask only."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ordered_dq import compare_on_gpu

    def variants_of(d, causal):
        return {f"{ORDER_NAMES[order]} chunk {chunk} {ADD_NAMES[add]}":
                (lambda *a, parts=None, o=order, c=chunk, m=add: one_pass_backward(*a, o, c, m, parts=parts))
                for order in orders for chunk, add in ((64, TMA), (128, TMA), (64, ATOM))}

    masks = (False,) if ROTATED in orders else (False, True)
    compare_on_gpu("python dev/tuning/ordered_dq_ws.py", [128], [(8, 32, 2048, 128), (4, 16, 4096, 128)], masks,
                   variants_of, out_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="compile the variants for sm_90 here (no GPU needed)")
    ap.add_argument("--simulate", action="store_true", help="the turns' schedule on the CPU (no GPU needed)")
    ap.add_argument("--out", default=None, help="JSON of the GPU rows")
    ap.add_argument("--orders", default="unordered,highest-first",  # or rotated (no mask; alone)
                    help="the orders to run (a run of the unordered pass alone cannot hang on a semaphore)")
    args = ap.parse_args()
    if args.compile:
        return compile_sm90()
    if args.simulate:
        sys.exit(1 if check_schedules() else 0)
    by_name = {name: order for order, name in ORDER_NAMES.items()}
    run_gpu(args.out, tuple(by_name[name] for name in args.orders.split(",")))


if __name__ == "__main__":
    main()
