"""Registers, spills and shared memory of the planned Hopper kernels, compiled on the CPU.

Triton's wheel carries ptxas and cuobjdump, so a kernel compiles for sm_90 without a GPU. Spilled
registers (local-memory stack) in an attention inner loop cost time on the GPU; this report is the
cheap first check of a kernel or tile change before device time is spent on it.

    python benchmarks/attention/kernel_resources.py                 # planned tiles, d=64/128/256
    python benchmarks/attention/kernel_resources.py --dims 128 --kernel dkdv --tiles 64,128,8,3 32,128,8,3
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from transformer_engine.common.attention import AttnConfig, AttnMaskType  # noqa: E402
from transformer_engine.common.attention.kernels.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel  # noqa: E402
from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel  # noqa: E402
from transformer_engine.common.attention.plan import Tiles, backward_plan, forward_plan  # noqa: E402

PTR = "*bf16"
_SEQ = ("BIAS", "ALIBI_SLOPES", "RNG_STATE", "SEQ_START_Q", "SEQ_START_K", "SEQ_LEN_Q", "SEQ_LEN_K")
KERNELS = {  # name: (kernel, its tensor arguments)
    "fwd": (attn_fwd_kernel, ("Q", "K", "V", "O", "LSE") + _SEQ),
    "dkdv": (attn_bwd_dkdv_kernel, ("Q", "K", "V", "DO", "DK", "DV", "DQ_ACC", "LSE", "DELTA") + _SEQ),
    "dq": (attn_bwd_dq_kernel, ("Q", "K", "V", "DO", "DQ", "LSE", "DELTA") + _SEQ),
}


def pointer_types(names, overrides=()):
    """Triton signature types of the tensor arguments (bf16 data, fp32 statistics, int32 lengths)."""
    kinds = {n: PTR for n in names}
    for n in ("LSE", "DELTA", "DQ_ACC", "ALIBI_SLOPES"):
        if n in kinds:
            kinds[n] = "*fp32"
    if "RNG_STATE" in kinds:
        kinds["RNG_STATE"] = "*i64"
    for n in ("SEQ_START_Q", "SEQ_START_K", "SEQ_LEN_Q", "SEQ_LEN_K"):
        if n in kinds:
            kinds[n] = "*i32"
    kinds.update(dict(overrides))
    return kinds


def compile_sm90(fn, pointers, constexprs, tiles, specialize=False):
    """Compile one kernel variant for sm_90 (no GPU needed); returns Triton's compiled kernel.

    ``specialize`` applies what Triton's launcher infers for contiguous bf16 tensors of the benchmark
    shapes: the head-dim strides equal 1 (compile-time constants) and every pointer and other integer
    argument is a multiple of 16. Without it (the compile test) nothing is assumed."""
    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            if specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif "scale" in name or name == "dropout_p":
            signature[name] = "fp32"
        elif specialize and name.startswith("stride_") and name.endswith("d"):
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if specialize and name not in ("window_left", "window_right"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})


def resources(kernel) -> dict:
    """Registers per thread and stack (spill) bytes from cuobjdump, shared memory from Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"regs": int(found.get("REG", -1)), "stack": int(found.get("STACK", -1)), "smem": kernel.metadata.shared}


def report(name, dims, causal, tiles):
    fn, tensors = KERNELS[name]
    dqk = dv = dims
    flags = dict(HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=dqk, BLOCK_DV=dv, IS_THD=False, HAS_SEQLENS=False,
                 HAS_LEFT=False, HAS_RIGHT=causal, BOTTOM_RIGHT=False, DOT_PRECISION="tf32", HAS_BIAS=False,
                 HAS_ALIBI=False, DROPOUT=False, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
    if name == "dkdv":
        flags.update(ATOMIC_DQ=False, gqa_group=1)
    try:
        r = resources(compile_sm90(fn, pointer_types(tensors), flags, tiles, specialize=True))
        return f"regs {r['regs']:3d}  stack {r['stack']:5d} B  smem {r['smem']:6d} B"
    except Exception as err:  # an over-sized tile fails to compile: say so and go on
        return f"fails: {type(err).__name__}: {str(err).splitlines()[0][:100]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128,256", help="head dims (d_qk = d_v)")
    ap.add_argument("--kernel", choices=sorted(KERNELS), action="append", help="default: all")
    ap.add_argument("--tiles", nargs="*", help="block_m,block_n,warps,stages (default: the planned tiles)")
    args = ap.parse_args()
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            cfg = AttnConfig(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=d, head_dim_v=d,
                             max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16",
                             attn_mask_type=AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK,
                             deterministic=True, device_type="cuda", compute_capability=(9, 0))
            planned = {"fwd": forward_plan(cfg).tiles, "dkdv": backward_plan(cfg).dkdv, "dq": backward_plan(cfg).dq}
            for name in args.kernel or ("fwd", "dkdv", "dq"):
                candidates = [Tiles(*map(int, t.split(","))) for t in args.tiles] if args.tiles else [planned[name]]
                for tiles in candidates:
                    mark = "*" if tiles == planned[name] else " "
                    print(f"d={d:3d} {'causal' if causal else 'none  '} {name:4s} {mark}{tiles}: "
                          f"{report(name, d, causal, tiles)}", flush=True)


if __name__ == "__main__":
    main()
