"""Hopper-only kernels (the warp-specialized Gluon ones) and sm_90 specialisation rules compile as planned,
on the CPU; every target's Triton launches are in test_kernel_compile_archs.py.

Triton's wheel carries ptxas, so compilation needs no GPU: this catches kernel compile errors
and over-sized tile plans in CI, before any device time is spent.
"""

import collections
import dataclasses
import re

import pytest

triton = pytest.importorskip("triton")

from transformer_engine.common.attention import AttnConfig, AttnMaskType, AttnSoftmaxType  # noqa: E402
from transformer_engine.common.attention.kernels.aot import compile_kernel  # noqa: E402
from transformer_engine.common.attention.kernels.resources import (  # noqa: E402
    compile_args, compile_launch, contiguous_call, cuobjdump, planned_launches, resources, target,
)
from transformer_engine.common.attention.launch_description import forward_launches  # noqa: E402
from transformer_engine.common.attention.plan import forward_plan  # noqa: E402

H100_SMEM_BYTES = 232448  # opt-in shared memory per block on sm_90
SM90 = target("sm90")


def _sm90_launches(cfg, **kwargs):
    """{kernel name: launch} of a training step of ``cfg`` on contiguous tensors
    (common.attention.launch_description)."""
    return {x.name: x for x in planned_launches(contiguous_call(cfg, **kwargs))}


def _compile(launch, dtype="bfloat16"):
    # Specialised as Triton's JIT specialises the launch on contiguous tensors: pipelining then stages
    # whole tiles in shared memory, which is what must fit.
    kernel = compile_launch(launch, dtype)
    assert kernel.shared <= H100_SMEM_BYTES, f"{launch.name}: {kernel.shared} bytes of smem"
    return kernel


# The Triton kernels of every planned launch, for sm_90 and the other targets: test_kernel_compile_archs.py.

# Stack bytes the Gluon dK/dV consumers may keep, by Triton release: (d=128, d=256, d=256 over packed sequences
# with GQA), the most each release's compiler gave over the masks below (3.6: the budget the kernels were tuned
# to on the GPU; the others measured by compiling). A spill costs speed, not correctness: each release keeps its
# own, and a release not listed here fails until it is measured.
GLUON_DKDV_STACK = {"3.6": (96, 0, 96), "3.7": (56, 8, 72), "3.8": (56, 0, 72), "3.9": (56, 0, 0)}


def _gluon_dkdv_stack(head_dim: int, thd: bool) -> int:
    from transformer_engine.common.attention.kernels.triton_compat import triton_version

    release = "%d.%d" % triton_version()
    assert release in GLUON_DKDV_STACK, f"triton {release}: measure the Gluon dK/dV stack and add it to GLUON_DKDV_STACK"
    d128, d256, d256_thd = GLUON_DKDV_STACK[release]
    return d128 if head_dim == 128 else d256_thd if thd else d256


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("mask,thd,gqa", [(AttnMaskType.NO_MASK, False, 1), (AttnMaskType.CAUSAL_MASK, False, 1),
                                          (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, True, 4)])
def test_sm90_warp_specialized_plans_compile_without_spills(mask, thd, gqa, head_dim):
    """The Gluon forward, dQ and dK/dV kernels (kernels/hopper_ws.py) with their planned tiles: 12 warps
    (two consumer warpgroups and a loader warp), no register spills in the forward and dQ; at d=128 dK/dV's
    consumers run at the register file's limit: up to 88 B of stack with Triton 3.6 (a few loads per query
    block, the most with packed sequences and GQA) where a version without the loader's LSE/delta rows spilled
    112-160 B. At d=256 dK and dV are two passes of one accumulator each: stack only with packed sequences and
    GQA (80 B with 3.6). Other releases: GLUON_DKDV_STACK. Shared memory that fits."""
    cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8 // gqa, head_dim_qk=head_dim, head_dim_v=head_dim,
                     max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=mask,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    launches = planned_launches(contiguous_call(cfg, seqlen=4096, thd=thd))
    dkdv_stack = _gluon_dkdv_stack(head_dim, thd)
    expected = {"attn_fwd_ws_kernel": 0, "attn_bwd_dq_ws_kernel": 0, "attn_bwd_dkdv_ws_kernel": dkdv_stack}
    ws = [x for x in launches if x.name in expected]
    assert sorted(x.name for x in ws) == sorted(list(expected) + ["attn_bwd_dkdv_ws_kernel"] * (head_dim == 256))
    for x in ws:
        kernel = _compile(x)
        res = resources(kernel)
        assert kernel.num_warps == 12 and res["stack"] <= expected[x.name], (x.name, kernel.num_warps, res)


@pytest.mark.parametrize("mask,thd,gqa", [(AttnMaskType.NO_MASK, False, 1), (AttnMaskType.CAUSAL_MASK, False, 1),
                                          (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, True, 4)])
def test_sm90_warp_specialized_split_plans_compile_without_spills(mask, thd, gqa):
    """d_qk 192 / d_v 128: the Gluon forward and dQ with the Q/K head dim as 128 + 64 (the second chunk in
    buffers of its own), 12 warps, no stack, shared memory that fits; dK/dV is the Triton kernel's."""
    cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8 // gqa, head_dim_qk=192, head_dim_v=128,
                     max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=mask,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    launches = planned_launches(contiguous_call(cfg, seqlen=4096, thd=thd))
    names = [x.name for x in launches]
    assert "attn_fwd_ws_kernel" in names and "attn_bwd_dq_ws_kernel" in names and "attn_bwd_dkdv_kernel" in names
    for x in launches:
        if x.name in ("attn_fwd_ws_kernel", "attn_bwd_dq_ws_kernel"):
            assert (x.args["BLOCK_DQK"], x.args["BLOCK_DQK2"], x.args["BLOCK_DV"]) == (128, 64, 128)
            kernel = _compile(x)
            res = resources(kernel)
            assert kernel.num_warps == 12 and res["stack"] == 0, (x.name, kernel.num_warps, res)


# Stack bytes of the Gluon forward's chunked sum at d=128 by Triton release: (bshd causal, packed sequences with GQA).
# Its consumers hold two fp32 accumulators at the register file's limit; 3.6 is what the GPU runs. A spill costs
# speed, not correctness (bench_kv_chunk.py measures the chunked sum against one chunk).
GLUON_FWD_CHUNKED_STACK = {"3.6": (0, 64), "3.7": (0, 32), "3.8": (0, 0), "3.9": (240, 72)}


def _gluon_chunked_stack(thd: bool) -> int:
    from transformer_engine.common.attention.kernels.triton_compat import triton_version

    release = "%d.%d" % triton_version()
    assert release in GLUON_FWD_CHUNKED_STACK, f"triton {release}: measure and add it to GLUON_FWD_CHUNKED_STACK"
    return GLUON_FWD_CHUNKED_STACK[release][int(thd)]


@pytest.mark.parametrize("mask,thd,gqa,seqlen_q", [(AttnMaskType.CAUSAL_MASK, False, 1, 8192),
                                                   (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, True, 4, 8192),
                                                   (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, False, 4, 1)])
def test_sm90_gluon_forward_chunked_and_split_compile_without_spills(mask, thd, gqa, seqlen_q):
    """Keys over two chunks at d=128: the Gluon forward's chunked sum in one program (a second fp32 accumulator
    per consumer warpgroup: GLUON_FWD_CHUNKED_STACK) and, for one query, its split form (one program per chunk,
    one accumulator: no stack) with the combine. Beyond d=128 the plan keeps one chunk (two accumulators spill
    hundreds of bytes there)."""
    cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8 // gqa, head_dim_qk=128, head_dim_v=128,
                     max_seqlen_q=seqlen_q, max_seqlen_kv=8192, dtype="bfloat16", attn_mask_type=mask,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    call = contiguous_call(cfg, batch=1, seqlen=seqlen_q, seqlen_kv=8192, thd=thd)
    plan = dataclasses.replace(forward_plan(call.plan_key), kv_chunk=4096)  # the kernel's chunked form, planned or not
    launches = forward_launches(call, plan)
    expected = ["attn_fwd_ws_kernel"] + ["attn_fwd_combine_kernel"] * (seqlen_q == 1)
    assert [x.name for x in launches] == expected
    assert launches[0].args["KV_CHUNK"] == 4096 and launches[0].args["SPLIT_KV"] == (seqlen_q == 1)
    for x in launches:
        kernel = _compile(x)
        stack = _gluon_chunked_stack(thd) if x.name == "attn_fwd_ws_kernel" and seqlen_q > 1 else 0
        assert resources(kernel)["stack"] <= stack, (x.name, resources(kernel))
    for head_dim in (256, 192):
        wide = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=head_dim, head_dim_v=128 * (
            head_dim == 192) or head_dim, max_seqlen_q=1, max_seqlen_kv=8192, dtype="bfloat16",
            attn_mask_type=AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, deterministic=True, device_type="cuda",
            compute_capability=(9, 0))
        (x,) = forward_launches(contiguous_call(wide, batch=1, seqlen=1, seqlen_kv=8192))
        assert x.name == "attn_fwd_ws_kernel" and x.args["KV_CHUNK"] == 0


def _local_memory_in_inner_loops(sass: str) -> int:
    """Local-memory loads and stores (spills) inside the innermost loops of a SASS listing: a loop is a branch back
    to a lower address; an innermost one contains no other."""
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, op in code
             if (m := re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", op)) and int(m.group(1), 16) < a]
    inner = [(lo, hi) for lo, hi in loops if not any(lo < lo2 and hi2 <= hi for lo2, hi2 in loops)]
    assert inner, "no loop found in the SASS"
    return sum(1 for a, op in code if re.search(r"\b(LDL|STL)\b", op) and any(lo <= a <= hi for lo, hi in inner))


@pytest.mark.parametrize("mask", [AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK])
def test_sm90_chunked_forward_register_cap_keeps_the_arithmetic_and_unspilled_key_loops(mask):
    """d=64 over two chunks (kv_chunk_registers): the one-program chunked sum's launch carries the plan's register
    cap, which it needs (uncapped it takes more), and it changes nothing the kernel computes: the PTX is the
    uncapped one's but for the ``.maxnreg`` directive, and what ptxas spills stays out of the key loops. The
    unchunked and split launches keep the compiler's own count."""
    cfg = AttnConfig.of(batch_size=2, num_heads_q=16, num_heads_kv=16, head_dim_qk=64, head_dim_v=64,
                     max_seqlen_q=8192, max_seqlen_kv=8192, dtype="bfloat16", attn_mask_type=mask,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    call = contiguous_call(cfg, batch=2, seqlen=8192)
    plan = forward_plan(call.plan_key)
    cap = plan.kv_chunk_registers
    (capped,) = forward_launches(call, plan, split=False)
    assert cap is not None and capped.args["KV_CHUNK"] == plan.kv_chunk and capped.options["maxnreg"] == cap
    uncapped = dataclasses.replace(capped, options={k: v for k, v in capped.options.items() if k != "maxnreg"})
    assert _ptx(capped).replace(f".maxnreg {cap}\n", "", 1) == _ptx(uncapped)
    kernel = _compile(capped)
    assert resources(kernel)["regs"] <= cap < resources(_compile(uncapped))["regs"]
    assert _local_memory_in_inner_loops(cuobjdump(kernel, "-sass")) == 0
    split = forward_launches(call, plan, split=True)
    (one_chunk,) = forward_launches(contiguous_call(cfg, batch=2, seqlen=1024), plan)
    assert all("maxnreg" not in x.options for x in split + (one_chunk,))


# The Gluon forward reading a paged KV cache (PAGE_SIZE > 0): stack bytes beyond the same contiguous launch's, by
# Triton release and case (dims-layout-form-page size; absent: none). Only the loader warp changes, and it runs in
# 24 registers: where a block takes eight page loads some releases keep 8 bytes of it on the stack.
GLUON_PAGED_EXTRA_STACK = {"3.6": {"d128-thd-chunked-P16": 8}, "3.7": {}, "3.8": {"d192x128-thd-one-P16": 8},
                           "3.9": {"d128-bshd-chunked-P16": 8}}
# (head dims, packed sequences with GQA, form, page size): the key block (128; 64 at d=256) in whole pages of 128
# or 64 keys and in pages of 16; the sum in one chunk, in chunks of 4096 keys in one program, and split over
# programs (one query) with the combine. Eight of the combinations (each compile takes CI seconds): every head-dim
# bucket, layout, form and kind of page load, and every case with a recorded stack.
GLUON_PAGED_CASES = [
    ((128, 128), False, "one", 128), ((128, 128), False, "chunked", 16), ((128, 128), True, "chunked", 16),
    ((128, 128), True, "split", 128), ((256, 256), False, "one", 64), ((256, 256), True, "one", 16),
    ((192, 128), False, "one", 128), ((192, 128), True, "one", 16),
]


def _gluon_paged_case_id(case) -> str:
    (dqk, dv), thd, form, page_size = case
    return f"d{dqk}{'' if dqk == dv else f'x{dv}'}-{'thd' if thd else 'bshd'}-{form}-P{page_size}"


def _gluon_forward(case, page_size):
    """The Gluon forward launch of ``case`` on a paged cache with pages of ``page_size`` keys (0: contiguous rows)."""
    (dqk, dv), thd, form, _ = case
    gqa = 4 if thd else 1
    seqlen_q, seqlen_kv = {"one": (4096, 4096), "chunked": (8192, 8192), "split": (1, 8192)}[form]
    mask = AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK if thd else AttnMaskType.CAUSAL_MASK
    cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8 // gqa, head_dim_qk=dqk, head_dim_v=dv,
                     max_seqlen_q=seqlen_q, max_seqlen_kv=seqlen_kv, dtype="bfloat16", attn_mask_type=mask,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    call = contiguous_call(cfg, batch=1, seqlen=seqlen_q, seqlen_kv=seqlen_kv, thd=thd, page_size=page_size)
    plan = forward_plan(call.plan_key)
    if form != "one":  # the kernel's chunked forms, planned or not
        plan = dataclasses.replace(plan, kv_chunk=4096)
    launch = forward_launches(call, plan)[0]
    assert launch.name == "attn_fwd_ws_kernel" and launch.args["PAGE_SIZE"] == page_size
    assert launch.args["SPLIT_KV"] == (form == "split") and bool(launch.args["KV_CHUNK"]) == (form != "one")
    return launch


def _ptx(launch) -> str:
    """The PTX of a launch compiled for sm_90, as compile_launch compiles it (Triton's cache returns it)."""
    from transformer_engine.common.attention.kernels import triton_compat

    source, options, _ = triton_compat.jit_specialize(launch.kernel, compile_args(launch, "bfloat16"),
                                                      dict(launch.options), SM90)
    return triton.compile(source, target=SM90, options=options.__dict__).asm["ptx"]


_FLOAT_OP = re.compile(r"^(wgmma|ex2|lg2|rcp)|^\S*\.(f32|bf16|f16|bf16x2|f16x2)\b")


def _arithmetic_by_block(ptx: str) -> collections.Counter:
    """The floating-point and MMA instructions of a PTX, basic block by basic block (registers unnamed), as a
    multiset of blocks: what computes the bits, whatever order the compiler lays the blocks out in."""
    blocks, current = collections.Counter(), []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if line.endswith(":") or line.startswith(("bra", "@", "ret")):
            blocks[tuple(current)] += bool(current)
            current = []
        elif _FLOAT_OP.match(line):
            current.append(re.sub(r"%[a-z]+\d+", "%", line))
    blocks[tuple(current)] += bool(current)
    return +blocks


@pytest.mark.parametrize("case", GLUON_PAGED_CASES, ids=_gluon_paged_case_id)
def test_sm90_gluon_paged_forward_compiles_with_the_contiguous_consumers(case, monkeypatch):
    """The Gluon forward reading a paged KV cache through its page table (one TMA load per block or per page)
    compiles for sm_90 with 12 warps, the contiguous launch's shared memory (its ring and barriers; the loader's
    extra arguments, passed to the warp partition through shared memory, take a few bytes more) and stack
    (GLUON_PAGED_EXTRA_STACK: the loader's few bytes where recorded), and the contiguous consumers' arithmetic: the
    same floating-point and MMA instructions in every basic block, so only the loads differ."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_GLUON_PAGED", "1")
    from transformer_engine.common.attention.kernels.triton_compat import triton_version

    release = "%d.%d" % triton_version()
    assert release in GLUON_PAGED_EXTRA_STACK, f"triton {release}: measure and add it to GLUON_PAGED_EXTRA_STACK"
    paged, contiguous = _gluon_forward(case, case[3]), _gluon_forward(case, 0)
    got, want = _compile(paged), _compile(contiguous)
    extra = GLUON_PAGED_EXTRA_STACK[release].get(_gluon_paged_case_id(case), 0)
    assert got.num_warps == 12 and want.shared < got.shared <= want.shared + 64, (got.shared, want.shared)
    assert resources(got)["stack"] == resources(want)["stack"] + extra, (resources(got), resources(want), extra)
    arithmetic = _arithmetic_by_block(_ptx(paged))
    assert arithmetic == _arithmetic_by_block(_ptx(contiguous)) and sum(arithmetic.values()) > 10
    assert sum(line.count("cp.async.bulk.tensor") for line in _ptx(paged).splitlines()) > \
        sum(line.count("cp.async.bulk.tensor") for line in _ptx(contiguous).splitlines())


@pytest.mark.parametrize("dtype,heads,head_dim", [("bfloat16", 16, 128), ("float16", 3, 40), ("float32", 64, 256)])
def test_sm90_zero_outside_sequences_compiles(dtype, heads, head_dim):
    """The flash-attn-4 backend's gap-row clearing (kernels/fill.py) at the block sizes
    launch.zero_outside_sequences picks."""
    from transformer_engine.common.attention.kernels.aot import Pointer
    from transformer_engine.common.attention.kernels.fill import FILL_LAUNCH_OPTIONS, zero_outside_sequences_kernel

    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    args = dict(X=Pointer(dtype), STARTS=Pointer("int32"), USED=Pointer("int32"), num_seqs=5, total_rows=1000,
                stride_t=heads * head_dim, stride_h=head_dim, stride_d=1, NUM_HEADS=heads, HEAD_DIM=head_dim,
                BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_T=max(1, min(16, 8192 // (block_h * block_d))))
    kernel = compile_kernel(zero_outside_sequences_kernel, args, dict(num_warps=4, num_stages=1, **FILL_LAUNCH_OPTIONS),
                            SM90)
    assert kernel.cubin


@pytest.mark.parametrize("name", ["attn_bwd_dq_kernel", "attn_fwd_kernel", "attn_bwd_dkdv_kernel"])
def test_sm90_kernels_compile_the_same_for_every_sequence_length(name, monkeypatch):
    """Regression: with s_q = 1 Triton specialised seqlen_q as a constant, and that variant of the d=256
    dQ kernel made an illegal memory access on the H200. A length of 1 launches the kernel's
    length-generic twin (kernels/masking.py), which compiles to one kernel for s_q = 1, a multiple of 16
    and any other length; the launched kernel keeps the 16-divisibility hint on the lengths (its speed).
    The Triton kernels (Hopper plans the Gluon ones at d=256 where they serve)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_WS", "0")
    cfg = AttnConfig.of(batch_size=1, num_heads_q=16, num_heads_kv=16, head_dim_qk=256, head_dim_v=256,
                     max_seqlen_q=1, max_seqlen_kv=2048, dtype="bfloat16", attn_mask_type=AttnMaskType.NO_MASK,
                     deterministic=True, device_type="cuda", compute_capability=(9, 0))
    launch = _sm90_launches(cfg, seqlen=4096)[name]

    def compiled(kernel, seqlen_q, seqlen_k):
        args = dict(compile_args(launch, "bfloat16"), seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        return compile_kernel(kernel, args, launch.options, SM90).hash

    lengths = ((1, 2048), (16, 2048), (17, 1), (4096, 2047))
    assert len({compiled(launch.kernel.length_generic, sq, sk) for sq, sk in lengths}) == 1
    assert compiled(launch.kernel, 4096, 2048) != compiled(launch.kernel, 4095, 2047)


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
    cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=dqk, head_dim_v=dv,
                     max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=mask,
                     softmax_type=AttnSoftmaxType.LEARNABLE_SOFTMAX, deterministic=True, device_type="cuda",
                     compute_capability=(9, 0))
    planned = _sm90_launches(cfg, seqlen=4096, thd=thd)
    assert list(planned) == ["attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dsink_kernel",
                             "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]  # never the Gluon kernels
    assert planned["attn_fwd_kernel"].args["HAS_SINK"] is True
    _compile(planned["attn_fwd_kernel"])
    _compile(planned["attn_bwd_dsink_kernel"])


def test_sm90_gluon_forward_with_the_row_max_compiles_without_spills():
    """The Gluon forward writing each row's max logit (HAS_ROW_MAX: return_max_logit), one chunk and chunked."""
    from transformer_engine.common.attention.launch_description import Slot

    for seqlen in (4096, 8192):
        cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=128, head_dim_v=128,
                         max_seqlen_q=seqlen, max_seqlen_kv=seqlen, dtype="bfloat16",
                         attn_mask_type=AttnMaskType.CAUSAL_MASK, deterministic=True, device_type="cuda",
                         compute_capability=(9, 0))
        call = contiguous_call(cfg, batch=1, seqlen=seqlen)
        plan = dataclasses.replace(forward_plan(call.plan_key), kv_chunk=4096)
        (x,) = forward_launches(call, plan, split=False)
        assert x.name == "attn_fwd_ws_kernel"
        x = dataclasses.replace(x, args=dict(x.args, HAS_ROW_MAX=True, ROW_MAX=Slot("row_max")))
        kernel = _compile(x)
        assert resources(kernel)["stack"] <= (_gluon_chunked_stack(False) if seqlen > 4096 else 0), resources(kernel)


def _rope_ptx(options, dtype="bfloat16", thd=True):
    from transformer_engine.common.attention.kernels import triton_compat
    from transformer_engine.common.attention.kernels.aot import Pointer
    from transformer_engine.common.attention.kernels.rope import rope_kernel

    args = dict(X=Pointer(dtype), OUT=Pointer(dtype), COS=Pointer("float32"), SIN=Pointer("float32"),
                CU_SEQLENS=Pointer("int32"), START_POSITIONS=Pointer("int64"), seq_len=4096, batch=7,
                table_rows=8192, cp_size=2, cp_rank=1, search_steps=3, stride_xs=32 * 128, stride_xb=0,
                stride_xh=128, stride_xd=1, stride_os=32 * 128, stride_ob=0, stride_oh=128, stride_od=1,
                NUM_HEADS=32, HEAD_DIM=128, ROT_DIM=64, IS_THD=thd, BATCH_MAJOR=False, HAS_START=True,
                INTERLEAVED=False, BACKWARD=True, ROUND_BF16_BY_BITS=False, BLOCK_H=32, BLOCK_D=128)
    source, opts, _ = triton_compat.jit_specialize(rope_kernel, args, dict(options, num_warps=8), SM90)
    return triton.compile(source, target=SM90, options=opts.__dict__).asm["ptx"]


def test_sm90_rope_kernel_compiles_without_fp_contraction():
    """The RoPE kernel as kernels/rope.py launches it: no fused multiply-add in its fp32 arithmetic (its bits
    are then the unfused path's), while the same kernel with contraction on has them, so the stated option is
    what decides it, not Triton's default."""
    from transformer_engine.common.attention.kernels.rope import ROPE_LAUNCH_OPTIONS

    assert ROPE_LAUNCH_OPTIONS == dict(enable_fp_fusion=False)
    fma = re.compile(r"^\s*fma\.rn\.f32", re.MULTILINE)
    pinned = _rope_ptx(ROPE_LAUNCH_OPTIONS)
    # .rn on a multiply or add forbids ptxas from contracting it into an FMA as well.
    assert not fma.search(pinned) and "mul.rn.f32" in pinned and "add.rn.f32" in pinned
    assert fma.search(_rope_ptx(dict(enable_fp_fusion=True)))
    assert "cvt.rn.bf16" in pinned  # the hardware's round-to-nearest-even, not the interpreter's bit rounding
