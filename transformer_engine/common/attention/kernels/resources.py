"""Registers, spills and shared memory of the planned launches, compiled on the CPU for any target.

Triton's wheel carries ptxas and cuobjdump (NVIDIA) and the LLVM AMDGPU backend (AMD), so a kernel
compiles for sm_90 or gfx942 without a GPU. Spilled registers (local-memory stack on NVIDIA, scratch on
AMD) in an attention inner loop cost time on the GPU; this report is the cheap first check of a kernel
or tile change before device time is spent on it. The launches are the frontends' own
(``common.attention.launch_description``) for contiguous tensors, so what compiles here is what they run.

    python -m transformer_engine.common.attention.kernels.resources                 # planned sm90, d=64/128/256
    python -m transformer_engine.common.attention.kernels.resources --target gfx942 # the CDNA3 plan
    python -m transformer_engine.common.attention.kernels.resources --dims 128 --kernel dkdv --tiles 64,128,8,3
    python -m transformer_engine.common.attention.kernels.resources --dims 256 --kernel dv --tiles 64,128,8,2
    python -m transformer_engine.common.attention.kernels.resources --dims 192x128  # d_qk x d_v: the Q/K split

The launches carry the plan's head-dim tiles (BLOCK_DQK, BLOCK_DQK2, BLOCK_DV), so what is reported for a
split Q/K head dim is the split kernels' registers, stack and shared memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Dict, Optional, Sequence, Tuple

from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType
from transformer_engine.common.attention.kernels.aot import CompiledKernel, Pointer, compile_kernel
from transformer_engine.common.attention.launch_description import (
    Bias, Call, Launch, Slot, View, backward_launches, forward_launches,
)
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.common.attention.plan import ARCHS, Tiles, backward_plan, forward_plan

__all__ = ["DEVICE_FACTS", "target", "contiguous_call", "planned_launches", "compile_args", "compile_launch",
           "job", "compile_report", "resources", "cuobjdump"]

# What each planned architecture looks like to AttnConfig (the frontends' device facts).
DEVICE_FACTS = {name: (dict(vendor="amd", compute_capability=None, gfx_arch=name) if t.vendor == "amd"
                       else dict(compute_capability=(int(name[2:-1]), int(name[-1]))))
                for name, t in ARCHS.items()}
# Element types of the slots that do not hold the call's dtype.
_SLOT_DTYPES = {"lse": "float32", "delta": "float32", "softmax_offset": "float32", "dsink": "float32",
                "alibi_slopes": "float32", "rng_state": "int64", "seq_start_q": "int32", "seq_start_k": "int32",
                "seq_len_q": "int32", "seq_len_k": "int32", "part_o": "float32", "part_ml": "float32",
                "page_table": "int32"}


def target(name: str):
    """Triton's GPUTarget of a planned architecture (plan.ARCHS name: "sm90", "gfx942")."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*ARCHS[name].triton_target)


def _contiguous(shape: Sequence[int]) -> Tuple[int, ...]:
    return tuple(int(_prod(shape[i + 1:])) for i in range(len(shape)))


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def contiguous_call(config: AttnConfig, batch: int = 2, seqlen: int = 1024, thd: bool = False,
                    bias_shape: Optional[Tuple[int, int, int, int]] = None, softmax_scale: float = 0.125,
                    seqlen_kv: Optional[int] = None, segments_per_row: int = 1, page_size: int = 0) -> Call:
    """The launches' view of ``config`` on contiguous [b, s, h, d] tensors (``thd``: packed sequences) of
    ``seqlen`` query tokens and ``seqlen_kv`` (default ``seqlen``) key tokens per sequence; a
    post_scale_bias of ``bias_shape`` (default [1, h, s_q, s_kv]); ``segments_per_row``: packed sequences
    in rows of that many (Call.segments_per_row); ``page_size`` > 0: K and V a paged cache's rows (the k and v
    tensors' rows: the pools) read through a page table (Call.page_size; a forward only)."""
    hq, hk, dqk, dv = config.num_heads_q, config.num_heads_kv, config.head_dim_qk, config.head_dim_v
    sq, sk = seqlen, seqlen if seqlen_kv is None else seqlen_kv
    shapes = dict(q=(batch, sq, hq, dqk), k=(batch, sk, hk, dqk), v=(batch, sk, hk, dv),
                  out=(batch, sq, hq, dv), d_out=(batch, sq, hq, dv), dq=(batch, sq, hq, dqk),
                  dk=(batch, sk, hk, dqk), dv=(batch, sk, hk, dv))
    views = {}
    for name, shape in shapes.items():
        strides = _contiguous(shape)
        views[name] = View((0,) + strides[1:] if thd else strides)
    bias = None
    if config.attn_bias_type == AttnBiasType.POST_SCALE_BIAS:
        shape = bias_shape or (1, hq, sq, sk)
        bias = Bias(tuple(shape), _contiguous(shape))
    params = dataclasses.replace(config.params, scaling_factor=softmax_scale, bottom_right_diagonal=config.bottom_right)
    return Call(
        params=params, num_heads_q=hq, num_heads_kv=hk, head_dim_qk=dqk, head_dim_v=dv, dtype=config.dtype,
        num_seqs=batch, max_q=sq, max_k=sk, packed=thd, has_seqlens=thd or config.attn_mask_type.is_padding(),
        views=views, lse_strides=(hq * sq, sq),
        device=dict(device_type=config.device_type, vendor=config.vendor,
                    compute_capability=config.compute_capability, gfx_arch=config.gfx_arch),
        bias=bias, alibi_batch_stride=0 if config.attn_bias_type == AttnBiasType.ALIBI else None,
        segments_per_row=segments_per_row, page_size=page_size,
        page_table_stride=-(-sk // page_size) if page_size else 0,
        page_rows=batch * -(-sk // page_size) * page_size if page_size else 0,  # every sequence's pages
    )


def planned_launches(call: Call) -> Tuple[Launch, ...]:
    """Every launch of a training step of ``call``: the forward and the backward with the bias's and the
    learnable sink's gradients where the call has them; a paged call's forward alone (inference only)."""
    if call.paged:
        return forward_launches(call)
    return forward_launches(call) + backward_launches(call, bias_grad=call.bias is not None,
                                                      sink_grad=call.params.softmax_type.is_learnable)


def compile_args(launch: Launch, dtype: str) -> Dict[str, object]:
    """``launch``'s arguments for compile_kernel: each slot a Pointer of its element type."""
    return {name: Pointer(_SLOT_DTYPES.get(value.name, dtype)) if isinstance(value, Slot) else value
            for name, value in launch.args.items()}


def compile_launch(launch: Launch, dtype: str, target_name: str = "sm90") -> CompiledKernel:
    """Compile one launch for a planned architecture, as Triton's JIT specialises it."""
    return compile_kernel(launch.kernel, compile_args(launch, dtype), launch.options, target(target_name))


def job(launch: Launch, dtype: str, target_name: str) -> tuple:
    """One launch as plain data (a process pool can take it): (target, kernel name, args, options)."""
    return (target_name, launch.name, tuple(compile_args(launch, dtype).items()),
            tuple(sorted(launch.options.items())))


def _kernels() -> Dict[str, object]:
    from transformer_engine.common.attention.kernels import backward, forward, hopper_ws

    fns = (forward.attn_fwd_kernel, forward.attn_fwd_combine_kernel, backward.attn_bwd_preprocess_kernel,
           backward.attn_bwd_dkdv_kernel, backward.attn_bwd_dq_kernel, backward.attn_bwd_dbias_kernel,
           backward.attn_bwd_dsink_kernel, hopper_ws.attn_fwd_ws_kernel, hopper_ws.attn_bwd_dkdv_ws_kernel, hopper_ws.attn_bwd_dq_ws_kernel)
    return {fn.__name__: fn for fn in fns}


def compile_report(compile_job: tuple) -> dict:
    """Compile one :func:`job`. Returns resources(), or {"error": ...} when it does not compile."""
    target_name, kernel, args, options = compile_job
    try:
        return resources(compile_kernel(_kernels()[kernel], dict(args), dict(options), target(target_name)))
    except Exception as err:  # reported, and failed on, by the caller
        return {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}


def resources(kernel: CompiledKernel) -> dict:
    """Registers per thread and spill bytes (NVIDIA: stack, from cuobjdump; AMD: private scratch per
    work-item, from the AMDGPU backend), shared memory (LDS) from Triton."""
    if kernel.binary_format == "hsaco":
        hip = dict(kernel.hip_resources)
        return {"regs": hip.get("vgpr_count", -1), "stack": hip.get("private_segment_fixed_size", -1),
                "smem": kernel.shared}
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", cuobjdump(kernel, "-res-usage")))
    return {"regs": int(found.get("REG", -1)), "stack": int(found.get("STACK", -1)), "smem": kernel.shared}


def cuobjdump(kernel: CompiledKernel, flag: str) -> str:
    """What the CUDA toolkit's cuobjdump (the one Triton's wheel carries) prints for an NVIDIA kernel's cubin with
    ``flag`` (``-res-usage``: its resources; ``-sass``: its machine code)."""
    from transformer_engine.common.attention.kernels.triton_compat import cuobjdump_path

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.cubin)
    try:
        return subprocess.run([cuobjdump_path(), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


_PASSES = {"fwd": ("attn_fwd_kernel", "attn_fwd_ws_kernel"),
           "dkdv": ("attn_bwd_dkdv_kernel", "attn_bwd_dkdv_ws_kernel"),
           "dq": ("attn_bwd_dq_kernel", "attn_bwd_dq_ws_kernel"),
           # dK and dV as two passes (BackwardPlan.dv): the first and the second dK/dV launch
           "dk": ("attn_bwd_dkdv_kernel",), "dv": ("attn_bwd_dkdv_kernel",)}


def _with_tiles(call: Call, name: str, tiles: Optional[Tiles]) -> Launch:
    """The planned launch of pass ``name`` (fwd, dkdv, dq; dk and dv: the two-pass form, each with the planned
    dK/dV tiles unless ``tiles``), or the Triton kernel's with ``tiles``."""
    config = call.plan_key
    if name == "fwd":
        plan = forward_plan(config)
        if tiles is not None:
            plan = dataclasses.replace(plan, tiles=tiles, warp_specialized=None)
        described = forward_launches(call, plan)
    elif name in ("dk", "dv"):
        plan = backward_plan(config)
        plan = dataclasses.replace(plan, dkdv_warp_specialized=None, dv=plan.dkdv)
        if tiles is not None:
            plan = dataclasses.replace(plan, **{"dkdv" if name == "dk" else "dv": tiles})
        described = [x for x in backward_launches(call, plan) if x.name in _PASSES[name]]
        return described[0 if name == "dk" else 1]
    else:
        plan = backward_plan(config)
        if tiles is not None:
            plan = dataclasses.replace(plan, **{name: tiles, f"{name}_warp_specialized": None})
        described = backward_launches(call, plan)
    return next(x for x in described if x.name in _PASSES[name])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="sm90", choices=sorted(ARCHS), help="architecture whose plan to compile")
    ap.add_argument("--dims", default="64,128,256", help="head dims: d (d_qk = d_v) or d_qk x d_v, as 192x128")
    ap.add_argument("--kernel", choices=sorted(_PASSES), action="append", help="default: all")
    ap.add_argument("--tiles", nargs="*", help="block_m,block_n,warps,stages (default: the planned tiles)")
    args = ap.parse_args()
    for dims in args.dims.split(","):
        d, dv = (int(x) for x in dims.split("x")) if "x" in dims else (int(dims),) * 2
        for causal in (False, True):
            cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=d, head_dim_v=dv,
                             max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16",
                             attn_mask_type=AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK,
                             deterministic=True, device_type="cuda", **DEVICE_FACTS[args.target])
            call = contiguous_call(cfg, seqlen=4096)
            for name in args.kernel or ("fwd", "dkdv", "dq"):  # dk, dv: only when named
                candidates = [Tiles(*map(int, t.split(","))) for t in args.tiles] if args.tiles else [None]
                for tiles in candidates:
                    launch = _with_tiles(call, name, tiles)
                    r = compile_report(job(launch, cfg.dtype, args.target))
                    mark = " " if tiles is not None else "*"
                    if "error" in r:  # an over-sized tile fails to compile: say so and go on
                        text = f"fails: {r['error'].splitlines()[0][:100]}"
                    else:
                        text = f"regs {r['regs']:3d}  stack {r['stack']:5d} B  smem {r['smem']:6d} B"
                    print(f"d={dims:>7s} {'causal' if causal else 'none  '} {name:4s} {mark}{launch.name} "
                          f"{launch.options} {launch.grid}: {text}", flush=True)


if __name__ == "__main__":
    main()
