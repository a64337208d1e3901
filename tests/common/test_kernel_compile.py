"""Every planned Hopper kernel variant compiles for sm_90 and fits in shared memory, on the CPU.

Triton's wheel carries ptxas, so compilation needs no GPU: this catches kernel compile errors
and over-sized tile plans in CI, before any device time is spent.
"""

import os
import sys

import pytest

triton = pytest.importorskip("triton")

from transformer_engine.common.attention import AttnConfig, AttnMaskType  # noqa: E402
from transformer_engine.common.attention.kernels.backward import (  # noqa: E402
    attn_bwd_dbias_kernel,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_preprocess_kernel,
)
from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel  # noqa: E402
from transformer_engine.common.attention.kernels.hopper_ws import (  # noqa: E402
    attn_bwd_dkdv_ws_kernel,
    attn_bwd_dq_ws_kernel,
    attn_fwd_ws_kernel,
)
from transformer_engine.common.attention.plan import backward_plan, forward_plan  # noqa: E402

H100_SMEM_BYTES = 232448  # opt-in shared memory per block on sm_90
# The compile helpers live with the resource report (benchmarks/attention/kernel_resources.py).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "attention"))
from kernel_resources import SM90, compile_sm90, launch_args, resources  # noqa: E402

from transformer_engine.common.attention.kernels.aot import compile_kernel  # noqa: E402


def _compile(fn, constexprs, tiles, dqk, dv, bias=False):
    # Specialised as Triton's JIT specialises a launch on contiguous tensors: pipelining then stages
    # whole tiles in shared memory, which is what must fit.
    kernel = compile_sm90(fn, constexprs, tiles, dqk, dv, bias=bias)
    assert kernel.shared <= H100_SMEM_BYTES, f"{fn.__name__}: {kernel.shared} bytes of smem"
    return kernel


_PLAIN = [(dims, causal, False, 1) for dims in [(64, 64), (128, 128), (192, 128), (256, 256)] for causal in (False, True)]
# Bias, ALiBi and dropout variants (plus the dBias kernel) at the two largest tiles, with GQA groups
# (the dK/dV kernel unrolls over the group).
_MODS = [((128, 128), True, True, 4), ((256, 256), False, True, 2)]


@pytest.mark.parametrize("head_dims,causal,mods,gqa", _PLAIN + _MODS)
def test_sm90_plans_compile(head_dims, causal, mods, gqa):
    dqk, dv = head_dims
    mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
    cfg = AttnConfig(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=dqk, head_dim_v=dv,
                     max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=mask,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    fwd, bwd = forward_plan(cfg), backward_plan(cfg)
    flags = dict(HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=fwd.block_dqk, BLOCK_DV=fwd.block_dv,
                 IS_THD=False, HAS_SEQLENS=False, HAS_LEFT=False, HAS_RIGHT=causal, BOTTOM_RIGHT=False,
                 DOT_PRECISION=fwd.dot_precision, HAS_BIAS=mods, HAS_ALIBI=mods, DROPOUT=mods)
    _compile(attn_fwd_kernel, dict(flags, TMA=fwd.tiles.tma, **fwd.tiles.loop_constexprs), fwd.tiles, dqk, dv,
             bias=mods)
    _compile(attn_bwd_dkdv_kernel,
             dict(flags, ATOMIC_DQ=False, gqa_group=gqa, TMA=bwd.dkdv.tma, **bwd.dkdv.loop_constexprs),
             bwd.dkdv, dqk, dv, bias=mods)
    _compile(attn_bwd_dq_kernel, dict(flags, TMA=bwd.dq.tma, **bwd.dq.loop_constexprs), bwd.dq, dqk, dv, bias=mods)
    _compile(attn_bwd_preprocess_kernel,
             dict(HEAD_DIM_V=dv, BLOCK_DV=bwd.block_dv, BLOCK_M=bwd.preprocess.block_m, IS_THD=False,
                  HAS_SEQLENS=False), bwd.preprocess, dqk, dv)
    if mods:
        dbias_flags = {k: v for k, v in flags.items() if k not in ("IS_THD", "HAS_BIAS", "HAS_ALIBI")}
        _compile(attn_bwd_dbias_kernel, dict(dbias_flags, BLOCK_M=bwd.dbias.block_m, BLOCK_N=bwd.dbias.block_n),
                 bwd.dbias, dqk, dv, bias=True)


@pytest.mark.parametrize("mask,thd,gqa", [(AttnMaskType.NO_MASK, False, 1), (AttnMaskType.CAUSAL_MASK, False, 1),
                                          (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, True, 4)])
def test_sm90_warp_specialized_plans_compile_without_spills(mask, thd, gqa):
    """The Gluon forward, dQ and dK/dV kernels (kernels/hopper_ws.py) with their planned tiles: 12 warps
    (two consumer warpgroups and a loader warp), no register spills in the forward and dQ; dK/dV's consumers
    run at the register file's limit: 8-80 B of stack (a few loads per query block, the most with packed
    sequences and GQA) where its first version spilled 112-160 B (NOTES.md entry 15); shared memory that fits."""
    cfg = AttnConfig(batch_size=1, num_heads_q=8, num_heads_kv=8 // gqa, head_dim_qk=128, head_dim_v=128,
                     max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=mask,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    fwd, bwd = forward_plan(cfg), backward_plan(cfg)
    assert fwd.warp_specialized is not None and bwd.dq_warp_specialized is not None
    assert bwd.dkdv_warp_specialized is not None
    flags = dict(HEAD_DIM_QK=128, HEAD_DIM_V=128, BLOCK_DQK=128, BLOCK_DV=128, IS_THD=thd, HAS_SEQLENS=thd,
                 HAS_LEFT=False, HAS_RIGHT=mask.is_causal, BOTTOM_RIGHT=mask == AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK,
                 DOT_PRECISION=fwd.dot_precision, HAS_BIAS=False, HAS_ALIBI=False, DROPOUT=False, TMA=False)
    for fn, tiles, stack in ((attn_fwd_ws_kernel, fwd.warp_specialized, 0),
                             (attn_bwd_dq_ws_kernel, bwd.dq_warp_specialized, 0),
                             (attn_bwd_dkdv_ws_kernel, bwd.dkdv_warp_specialized, 96)):
        extra = dict(ATOMIC_DQ=False, gqa_group=gqa) if fn is attn_bwd_dkdv_ws_kernel else {}
        kernel = _compile(fn, dict(flags, **extra, **tiles.ws_constexprs), tiles, 128, 128)
        res = resources(kernel)
        assert kernel.num_warps == 12 and res["stack"] <= stack, (fn.__name__, kernel.num_warps, res)


@pytest.mark.parametrize("dtype,heads,head_dim", [("bfloat16", 16, 128), ("float16", 3, 40), ("float32", 64, 256)])
def test_sm90_zero_outside_sequences_compiles(dtype, heads, head_dim):
    """The flash-attn-4 backend's gap-row clearing (kernels/fill.py) at the block sizes
    launch.zero_outside_sequences picks."""
    from kernel_resources import SM90

    from transformer_engine.common.attention.kernels.aot import Pointer, compile_kernel
    from transformer_engine.common.attention.kernels.fill import zero_outside_sequences_kernel

    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    args = dict(X=Pointer(dtype), STARTS=Pointer("int32"), USED=Pointer("int32"), num_seqs=5, total_rows=1000,
                stride_t=heads * head_dim, stride_h=head_dim, stride_d=1, NUM_HEADS=heads, HEAD_DIM=head_dim,
                BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_T=max(1, min(16, 8192 // (block_h * block_d))))
    kernel = compile_kernel(zero_outside_sequences_kernel, args, dict(num_warps=4, num_stages=1), SM90)
    assert kernel.cubin


@pytest.mark.parametrize("fn,kind", [(attn_bwd_dq_kernel, "dq"), (attn_fwd_kernel, "fwd"), (attn_bwd_dkdv_kernel, "dkdv")])
def test_sm90_kernels_compile_the_same_for_every_sequence_length(fn, kind):
    """Regression: with s_q = 1 Triton specialised seqlen_q as a constant, and that variant of the d=256
    dQ kernel made an illegal memory access on the H200. Sequence lengths are no longer specialised:
    s_q = 1, a multiple of 16 and any other length give the one compiled kernel."""
    cfg = AttnConfig(batch_size=1, num_heads_q=16, num_heads_kv=16, head_dim_qk=256, head_dim_v=256,
                     max_seqlen_q=1, max_seqlen_kv=2048, dtype="bfloat16", attn_mask_type=AttnMaskType.NO_MASK,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    fwd, bwd = forward_plan(cfg), backward_plan(cfg)
    tiles = {"fwd": fwd.tiles, "dq": bwd.dq, "dkdv": bwd.dkdv}[kind]
    flags = dict(HEAD_DIM_QK=256, HEAD_DIM_V=256, BLOCK_DQK=256, BLOCK_DV=256, IS_THD=False, HAS_SEQLENS=False,
                 HAS_LEFT=False, HAS_RIGHT=False, BOTTOM_RIGHT=True, DOT_PRECISION=fwd.dot_precision,
                 HAS_BIAS=False, HAS_ALIBI=False, DROPOUT=False, TMA=False, **tiles.loop_constexprs)
    if kind == "dkdv":
        flags.update(ATOMIC_DQ=False, gqa_group=1)
    hashes = set()
    for seqlen_q, seqlen_k in ((1, 2048), (16, 2048), (17, 1), (4096, 2047)):
        args = launch_args(fn, flags, 256, 256, heads=16, seqlen=4096)
        args.update(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        hashes.add(compile_kernel(fn, args, tiles.launch_options, SM90).hash)
    assert len(hashes) == 1
