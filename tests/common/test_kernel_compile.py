"""Hopper-only kernels (the warp-specialized Gluon ones) and sm_90 specialisation rules compile as planned,
on the CPU; every target's Triton launches are in test_kernel_compile_archs.py.

Triton's wheel carries ptxas, so compilation needs no GPU: this catches kernel compile errors
and over-sized tile plans in CI, before any device time is spent.
"""

import os
import sys

import pytest

triton = pytest.importorskip("triton")

from transformer_engine.common.attention import AttnConfig, AttnMaskType, AttnSoftmaxType  # noqa: E402
from transformer_engine.common.attention.kernels.backward import (  # noqa: E402
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_dsink_kernel,
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


# The Triton kernels of every planned launch, for sm_90 and the other targets: test_kernel_compile_archs.py.


@pytest.mark.parametrize("mask,thd,gqa", [(AttnMaskType.NO_MASK, False, 1), (AttnMaskType.CAUSAL_MASK, False, 1),
                                          (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, True, 4)])
def test_sm90_warp_specialized_plans_compile_without_spills(mask, thd, gqa):
    """The Gluon forward, dQ and dK/dV kernels (kernels/hopper_ws.py) with their planned tiles: 12 warps
    (two consumer warpgroups and a loader warp), no register spills in the forward and dQ; dK/dV's consumers
    run at the register file's limit: 8-80 B of stack (a few loads per query block, the most with packed
    sequences and GQA) where a version without the loader's LSE/delta rows spilled 112-160 B; shared memory that fits."""
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
    if kind == "fwd":
        flags.update(HAS_SINK=False)
    hashes = set()
    for seqlen_q, seqlen_k in ((1, 2048), (16, 2048), (17, 1), (4096, 2047)):
        args = launch_args(fn, flags, 256, 256, heads=16, seqlen=4096)
        args.update(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        hashes.add(compile_kernel(fn, args, tiles.launch_options, SM90).hash)
    assert len(hashes) == 1


def test_compile_kernel_says_what_each_target_gives():
    """compile_kernel builds a cubin for CUDA targets and a hsaco for HIP ones; a HIP kernel has no cubin
    to hand the (CUDA-only) JAX launcher, and a target of another backend is refused with what is supported."""
    from triton.backends.compiler import GPUTarget

    from transformer_engine.common.attention.kernels.aot import Pointer
    from transformer_engine.common.attention.kernels.fill import zero_outside_sequences_kernel

    args = dict(X=Pointer("bfloat16"), STARTS=Pointer("int32"), USED=Pointer("int32"), num_seqs=5, total_rows=1000,
                stride_t=8 * 64, stride_h=64, stride_d=1, NUM_HEADS=8, HEAD_DIM=64, BLOCK_H=8, BLOCK_D=64, BLOCK_T=16)
    options = dict(num_warps=4, num_stages=1)
    amd = compile_kernel(zero_outside_sequences_kernel, args, options, GPUTarget("hip", "gfx942", 64))
    assert (amd.binary_format, amd.arch, amd.binary[:4]) == ("hsaco", "gfx942", b"\x7fELF")
    assert dict(amd.hip_resources)["private_segment_fixed_size"] == 0
    with pytest.raises(ValueError, match="compiled for gfx942 \\(a hsaco\\)"):
        amd.cubin
    nvidia = compile_kernel(zero_outside_sequences_kernel, args, options, SM90)
    assert (nvidia.binary_format, nvidia.arch, nvidia.cubin[:4]) == ("cubin", "sm_90", b"\x7fELF")
    with pytest.raises(NotImplementedError, match="`target` must be a Triton GPUTarget of backend 'cuda'"):
        compile_kernel(zero_outside_sequences_kernel, args, options, GPUTarget("xpu", "pvc", 16))


@pytest.mark.parametrize("head_dims,causal,thd", [((128, 128), True, False), ((64, 64), False, True),
                                                  ((256, 256), True, True)])
def test_sm90_sink_softmax_plans_compile(head_dims, causal, thd):
    """Sink softmax (learnable; off-by-one is the same kernel with zero logits): the Triton forward with
    HAS_SINK at the tiles planned for it (never the Gluon kernels), and the sink-gradient reduction."""
    dqk, dv = head_dims
    mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
    cfg = AttnConfig(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=dqk, head_dim_v=dv,
                     max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=mask,
                     softmax_type=AttnSoftmaxType.LEARNABLE_SOFTMAX, deterministic=True, device_type="cuda",
                     compute_capability=(9, 0))
    fwd, bwd = forward_plan(cfg), backward_plan(cfg)
    assert fwd.warp_specialized is None and bwd.dq_warp_specialized is None and bwd.dkdv_warp_specialized is None
    flags = dict(HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=fwd.block_dqk, BLOCK_DV=fwd.block_dv, IS_THD=thd,
                 HAS_SEQLENS=thd, HAS_LEFT=False, HAS_RIGHT=causal, BOTTOM_RIGHT=False,
                 DOT_PRECISION=fwd.dot_precision, HAS_BIAS=False, HAS_ALIBI=False, DROPOUT=False)
    _compile(attn_fwd_kernel, dict(flags, HAS_SINK=True, TMA=fwd.tiles.tma, **fwd.tiles.loop_constexprs), fwd.tiles,
             dqk, dv)
    _compile(attn_bwd_dsink_kernel, dict(BLOCK_M=bwd.dsink.block_m, HAS_SEQLENS=thd), bwd.dsink, dqk, dv)
