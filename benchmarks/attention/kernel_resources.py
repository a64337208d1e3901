"""Registers, spills and shared memory of the planned kernels, compiled on the CPU for any target.

Triton's wheel carries ptxas and cuobjdump (NVIDIA) and the LLVM AMDGPU backend (AMD), so a kernel
compiles for sm_90 or gfx942 without a GPU. Spilled registers (local-memory stack on NVIDIA, scratch on
AMD) in an attention inner loop cost time on the GPU; this report is the cheap first check of a kernel
or tile change before device time is spent on it.

    python benchmarks/attention/kernel_resources.py                 # planned sm90 tiles, d=64/128/256
    python benchmarks/attention/kernel_resources.py --target gfx942 # the CDNA3 plan
    python benchmarks/attention/kernel_resources.py --dims 128 --kernel dkdv --tiles 64,128,8,3 32,128,8,3
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import triton  # noqa: E402

from transformer_engine.common.attention import AttnConfig, AttnMaskType  # noqa: E402
from transformer_engine.common.attention.kernels.aot import Pointer, compile_kernel  # noqa: E402
from transformer_engine.common.attention.kernels.backward import (  # noqa: E402
    attn_bwd_dbias_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_dsink_kernel, attn_bwd_preprocess_kernel,
)
from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel  # noqa: E402
from transformer_engine.common.attention.plan import ARCHS, Tiles, backward_plan, forward_plan  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
# Triton's target of each planned architecture, by plan name (plan.ARCHS).
TARGETS = {name: GPUTarget(*tables.triton_target) for name, tables in ARCHS.items()}
KERNELS = {"fwd": attn_fwd_kernel, "dkdv": attn_bwd_dkdv_kernel, "dq": attn_bwd_dq_kernel}
ALL_KERNELS = dict(KERNELS, preprocess=attn_bwd_preprocess_kernel, dbias=attn_bwd_dbias_kernel,
                   dsink=attn_bwd_dsink_kernel)
# What each architecture looks like to AttnConfig (the frontends' device facts).
DEVICE_FACTS = {name: (dict(vendor="amd", compute_capability=None, gfx_arch=name) if t.vendor == "amd"
                       else dict(compute_capability=(int(name[2:-1]), int(name[-1]))))
                for name, t in ARCHS.items()}
_FP32_BUFFERS = ("LSE", "DELTA", "DQ_ACC", "ALIBI_SLOPES", "SINK", "DSINK")
_INT_BUFFERS = {"RNG_STATE": "int64", "SEQ_START_Q": "int32", "SEQ_START_K": "int32", "SEQ_LEN_Q": "int32",
                "SEQ_LEN_K": "int32"}
_QK_TENSORS = ("q", "k", "dq", "dk")  # tensors with head dim d_qk; the others (v, o, do, dv) have d_v


def launch_args(fn, constexprs, dqk, dv, heads=16, seqlen=4096, bias=False, dtype="bfloat16"):
    """The arguments a launch of ``fn`` passes for contiguous [b, s, h, d] tensors of ``dtype`` (a bhss
    bias with ``bias``), by name, so that compile_kernel specialises them as Triton's JIT does."""
    args = {}
    for name in fn.arg_names:
        if name in constexprs:
            args[name] = constexprs[name]
        elif name.isupper() or name in _INT_BUFFERS:
            args[name] = Pointer("float32" if name in _FP32_BUFFERS else _INT_BUFFERS.get(name, dtype))
        elif name.startswith("stride_z") or name.startswith("stride_dz"):
            axis = name[-1]
            args[name] = {"b": heads * seqlen * seqlen, "h": seqlen * seqlen, "m": seqlen, "n": 1}[axis] if bias else 0
        elif name in ("stride_lb", "stride_lh"):
            args[name] = heads * seqlen if name == "stride_lb" else seqlen
        elif name.startswith("stride_"):
            tensor, axis = name[len("stride_"):-1], name[-1]
            d = dqk if tensor in _QK_TENSORS else dv
            args[name] = {"b": seqlen * heads * d, "s": heads * d, "h": d, "d": 1}.get(axis, 0)
        elif "scale" in name or name == "dropout_p":
            args[name] = 0.0 if name == "dropout_p" else 0.125
        elif name.startswith(("seqlen", "max_seqlen")):
            args[name] = seqlen
        elif name.startswith(("num_heads", "bias_heads")):
            args[name] = heads
        else:  # batch sizes, the GQA group, window sizes
            args[name] = 1 if name in ("gqa_group",) else (4 if "batch" in name else 0)
    return args


def compile_sm90(fn, constexprs, tiles, dqk, dv, **kwargs):
    """Compile one kernel variant for sm_90 as a launch of contiguous tensors would (no GPU needed)."""
    return compile_kernel(fn, launch_args(fn, constexprs, dqk, dv, **kwargs),
                          tiles.launch_options, SM90)


def resources(kernel) -> dict:
    """Registers per thread and spill bytes (NVIDIA: stack, from cuobjdump; AMD: private scratch per
    work-item, from the AMDGPU backend), shared memory (LDS) from Triton."""
    if kernel.binary_format == "hsaco":
        hip = dict(kernel.hip_resources)
        return {"regs": hip.get("vgpr_count", -1), "stack": hip.get("private_segment_fixed_size", -1),
                "smem": kernel.shared}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.cubin)
    try:
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"regs": int(found.get("REG", -1)), "stack": int(found.get("STACK", -1)), "smem": kernel.shared}


def compile_report(job) -> dict:
    """Compile one launch described by plain data (so that a process pool can take it): ``job`` is
    (target name, kernel name, constexprs, launch options, d_qk, d_v, dtype, bias). Returns resources(),
    or {"error": ...} when it does not compile."""
    target, kernel, constexprs, options, dqk, dv, dtype, bias = job
    fn = ALL_KERNELS[kernel]
    try:
        compiled = compile_kernel(fn, launch_args(fn, constexprs, dqk, dv, bias=bias, dtype=dtype), options,
                                  TARGETS[target])
        return resources(compiled)
    except Exception as err:  # reported, and failed on, by the caller
        return {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}


def report(name, dims, causal, tiles, target="sm90"):
    dqk = dv = dims
    flags = dict(HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=dqk, BLOCK_DV=dv, IS_THD=False, HAS_SEQLENS=False,
                 HAS_LEFT=False, HAS_RIGHT=causal, BOTTOM_RIGHT=False, DOT_PRECISION="ieee", HAS_BIAS=False,
                 HAS_ALIBI=False, DROPOUT=False, TMA=tiles.tma, **tiles.loop_constexprs)
    if name == "fwd":
        flags.update(HAS_SINK=False)
    if name == "dkdv":
        flags.update(ATOMIC_DQ=False, gqa_group=1)
    r = compile_report((target, name, flags, tiles.launch_options, dqk, dv, "bfloat16", False))
    if "error" in r:  # an over-sized tile fails to compile: say so and go on
        return f"fails: {r['error'].splitlines()[0][:100]}"
    return f"regs {r['regs']:3d}  stack {r['stack']:5d} B  smem {r['smem']:6d} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="sm90", choices=sorted(TARGETS), help="architecture whose plan to compile")
    ap.add_argument("--dims", default="64,128,256", help="head dims (d_qk = d_v)")
    ap.add_argument("--kernel", choices=sorted(KERNELS), action="append", help="default: all")
    ap.add_argument("--tiles", nargs="*", help="block_m,block_n,warps,stages (default: the planned tiles)")
    args = ap.parse_args()
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            cfg = AttnConfig(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=d, head_dim_v=d,
                             max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16",
                             attn_mask_type=AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK,
                             deterministic=True, device_type="cuda", **DEVICE_FACTS[args.target])
            planned = {"fwd": forward_plan(cfg).tiles, "dkdv": backward_plan(cfg).dkdv, "dq": backward_plan(cfg).dq}
            for name in args.kernel or ("fwd", "dkdv", "dq"):
                candidates = [Tiles(*map(int, t.split(","))) for t in args.tiles] if args.tiles else [planned[name]]
                for tiles in candidates:
                    mark = "*" if tiles == planned[name] else " "
                    print(f"d={d:3d} {'causal' if causal else 'none  '} {name:4s} {mark}{tiles}: "
                          f"{report(name, d, causal, tiles, args.target)}", flush=True)


if __name__ == "__main__":
    main()
