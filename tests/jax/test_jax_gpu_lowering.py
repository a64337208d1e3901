"""The CUDA lowering of the fused primitives, checked without a GPU.

Triton's wheel carries ptxas, so the kernels compile for sm_90 on the CPU; JAX lowers for the
``cuda`` platform on the CPU too (``jax.export``). These tests lower forward and backward for
CUDA, decode the launch programs the native handler will run, and check them against the
kernels' signatures: what a GPU would launch, short of launching it. The native extension's
source is compiled (syntax only) against jaxlib's FFI headers and Triton's ``cuda.h``.
Running it is the GPU suites' job (qa/L1_jax_gpu, qa/L3_determinism).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

from transformer_engine.common.attention.launch_description import LOG2E  # noqa: E402
from transformer_engine.common.attention.enums import AttnMaskType, QKVLayout  # noqa: E402
from transformer_engine.common.attention.plan import backward_plan, forward_plan, mask_flags  # noqa: E402
from transformer_engine.jax import attention as te_attention  # noqa: E402
import te_jax_testing as te_testing  # noqa: E402
from transformer_engine.jax.attention import SequenceDescriptor  # noqa: E402
from transformer_engine.jax.primitives import gpu  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KINDS = ("buffer", "i32", "i64", "f32", "null")

from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel  # noqa: E402

# Under TRITON_INTERPRET=1 (set for the PyTorch CPU suites) @triton.jit gives interpreted
# functions, which cannot be compiled (JAX runs them only with NVTE_JAX_TRITON_INTERPRET=1, on CPU), so these
# tests then run in a child process without the variable.
INTERPRETED = not isinstance(attn_fwd_kernel, triton.runtime.jit.JITFunction)
compiles = pytest.mark.skipif(INTERPRETED, reason="kernels loaded for the interpreter: run in the child process")


@pytest.mark.skipif(not INTERPRETED, reason="the kernels compile in this process")
def test_lowering_in_a_child_process_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
        env=env, cwd=str(REPO), capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def decode(program: np.ndarray, blob: np.ndarray):
    """The launch program as the native handler reads it (csrc/triton_launch.cpp)."""
    words = iter(int(w) for w in program)
    assert next(words) == gpu.PROGRAM_VERSION
    kernels = []
    for _ in range(next(words)):
        h, cubin_off, cubin_len, name_off, name_len, shared, warps = (next(words) for _ in range(7))
        name = bytes(blob[name_off:name_off + name_len]).decode()
        kernels.append(dict(name=name, cubin=bytes(blob[cubin_off:cubin_off + cubin_len]), shared=shared,
                            num_warps=warps, hash=h))
    fills = [tuple(next(words) for _ in range(3)) for _ in range(next(words))]
    launches = []
    for _ in range(next(words)):
        kernel, gx, gy, gz, n = (next(words) for _ in range(5))
        params = [(KINDS[next(words)], next(words)) for _ in range(n)]
        launches.append(dict(kernel=kernels[kernel]["name"], grid=(gx, gy, gz), params=params))
    assert next(words, None) is None, "trailing words"
    return kernels, fills, launches


@pytest.fixture
def captured_programs(monkeypatch):
    """Lower for CUDA on this machine: pretend an sm_90 GPU with the extension built, and keep
    every Program the lowering builds."""
    monkeypatch.setattr(gpu, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(gpu, "_require_extension", lambda: None)
    programs = []
    real_call = gpu.Program.call

    def call(self, *operands):
        programs.append(self)
        return real_call(self, *operands)

    monkeypatch.setattr(gpu.Program, "call", call)
    return programs


def _lower_for_cuda(fn, *args):
    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(gpu.FFI_TARGET)],
    )(*args)
    return exported.mlir_module()


def _attention_grad_fn(mask, layout=QKVLayout.BSHD_BSHD_BSHD, m=1, window=None, deterministic=True,
                       bottom_right_diagonal=None):
    def fn(q, k, v, lens, offsets):
        if mask.is_padding():
            desc = (SequenceDescriptor.from_seqlens_and_offsets(lens, offsets) if m > 1
                    else SequenceDescriptor.from_seqlens(lens))
        else:
            desc = None
        f = lambda q, k, v: te_testing.fused_attn_with_backend(  # noqa: E731
            "fused", (q, k, v), None, desc, None, "no_bias", mask, layout, q.shape[-1] ** -0.5, 0.0, True,
            max_segments_per_seq=m, window_size=window, bottom_right_diagonal=bottom_right_diagonal)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(out)

    return fn


def _shapes(b, s, hq, hk, d, dtype=jnp.bfloat16, m=1):
    q = jax.ShapeDtypeStruct((b, s, hq, d), dtype)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), dtype)
    lens = jax.ShapeDtypeStruct((b, m) if m > 1 else (b,), jnp.int32)
    offsets = jax.ShapeDtypeStruct((b, m + 1), jnp.int32)
    return q, kv, kv, lens, offsets


def _check_program(prog: gpu.Program, expected_kernels):
    program, blob = prog.encode()
    kernels, fills, launches = decode(program, blob)
    n_buffers = len(prog.operands) + len(prog.results)
    assert [launch["kernel"] for launch in launches] == expected_kernels
    for kernel in kernels:
        assert kernel["cubin"][:4] == b"\x7fELF", kernel["name"]
        assert 1 <= kernel["num_warps"] <= 16 and kernel["shared"] <= 232448
    by_name = {k.name: k for k in prog._kernels}
    for launch in launches:
        compiled = by_name[launch["kernel"]]
        # Triton's launch ABI: every non-constexpr parameter, then global and profile scratch.
        assert len(launch["params"]) == len(compiled.params) + 2
        for (name, ty), (kind, value) in zip(compiled.params, launch["params"]):
            if ty.startswith("*"):
                assert kind == "buffer" and 0 <= value < n_buffers, (name, kind, value)
                buffer = (prog.operands + prog.results)[value]
                assert ty[1:] == {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32"}[
                    buffer.dtype.name], (name, ty, buffer.dtype)
            else:
                assert kind in ("i32", "i64", "f32"), (name, ty, kind)
        # Global scratch (the tensor descriptors of TMA loads) is a workspace the program allocates;
        # profile scratch is never asked for.
        assert launch["params"][-2][0] == ("buffer" if compiled.global_scratch_size > 0 else "null"), launch["kernel"]
        assert launch["params"][-1] == ("null", 0)
        assert all(g > 0 for g in launch["grid"])
    for index, value, width in fills:
        assert len(prog.operands) <= index < n_buffers and width in (1, 4)
    return kernels, fills, launches


@compiles
def test_bshd_causal_forward_and_backward_programs(captured_programs):
    b, s, hq, hk, d = 2, 256, 8, 2, 64
    text = _lower_for_cuda(_attention_grad_fn(AttnMaskType.CAUSAL_MASK), *_shapes(b, s, hq, hk, d))
    assert text.count(f"@{gpu.FFI_TARGET}") == 2
    fwd, bwd = captured_programs
    _, fills, launches = _check_program(fwd, ["attn_fwd_kernel"])
    assert fills == []  # BSHD mode writes every row
    (launch,) = launches
    plan = forward_plan(_plan_key(_static(AttnMaskType.CAUSAL_MASK), *_fake(b, s, hq, hk, d)[:2]))
    assert launch["grid"] == (s // plan.tiles.block_m, b * hq, 1)  # plan.block_grid
    assert [r.shape for r in fwd.results] == [(b, s, hq, d), (b, hq, s)]
    _, fills, launches = _check_program(bwd, ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel",
                                              "attn_bwd_dq_kernel"])
    assert fills == []


@compiles
def test_padding_runs_the_packed_mode_with_zero_and_inf_fills(captured_programs):
    b, s, hq, hk, d, m = 2, 128, 4, 4, 128, 3
    _lower_for_cuda(_attention_grad_fn(AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD, m=m),
                    *_shapes(b, s, hq, hk, d, m=m))
    fwd, bwd = captured_programs
    # d=128 bf16 on sm_90: the plan routes the forward, dK/dV and dQ to the warp-specialized Gluon kernels.
    _, fills, launches = _check_program(fwd, ["attn_fwd_ws_kernel"])
    n_ops = len(fwd.operands)
    assert fills == [(n_ops, 0, 1), (n_ops + 1, 0x7F800000, 4)]  # output zeroed, lse +inf
    scratch = fwd._kernels[0].global_scratch_size  # the tensor descriptors' workspace, one per program
    assert [r.shape for r in fwd.results] == [(b, s, hq, d), (b * m, hq, s),
                                              (int(np.prod(launches[0]["grid"])) * scratch,)]
    # the segment-row grid: per (row, head), the row's blocks (at most cdiv(s, 128) + m - 1 over its m sequences)
    assert launches[0]["grid"][:2] == (-(-s // 128) + m - 1, b * hq)
    _, fills, launches = _check_program(bwd, ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_ws_kernel",
                                              "attn_bwd_dq_ws_kernel"])
    n_ops = len(bwd.operands)
    # dq, dk, dv zeroed (then the Gluon kernels' tensor-descriptor workspaces, not filled)
    assert fills == [(n_ops, 0, 1), (n_ops + 1, 0, 1), (n_ops + 2, 0, 1)]
    for prog in (fwd, bwd):  # the Gluon kernels: 12 warps (two consumer warpgroups and a loader), scratch
        for k in prog._kernels:
            if k.name.endswith("_ws_kernel"):
                assert k.num_warps == 12 and k.global_scratch_size > 0, k.name


@compiles
def test_window_mqa_fp16_lowers(captured_programs):
    _lower_for_cuda(_attention_grad_fn(AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, window=(32, 0)),
                    *_shapes(1, 96, 4, 1, 64, dtype=jnp.float16))
    for prog in captured_programs:
        _check_program(prog, [k.name for k in prog._kernels])


@compiles
@pytest.mark.parametrize("mask", [AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK], ids=lambda m: m.value)
def test_narrow_v_192_lowers_to_the_split_qk_kernels(captured_programs, compile_calls, mask):
    """192/128 on sm_90 (Hopper's narrow-V tiles): the forward and dQ (Gluon) and dK/dV (Triton) kernels
    compile with Q/K in chunks of 128 and 64 (plan.split_head_dim), as the PyTorch launches run them."""
    b, s, hq, hk, m = 2, 128, 4, 2, 2
    q, k, _, lens, offsets = _shapes(b, s, hq, hk, 192, m=m if mask.is_padding() else 1)
    v = jax.ShapeDtypeStruct((b, s, hk, 128), jnp.bfloat16)
    layout = QKVLayout.THD_THD_THD if mask.is_padding() else QKVLayout.BSHD_BSHD_BSHD
    _lower_for_cuda(_attention_grad_fn(mask, layout, m=m if mask.is_padding() else 1), q, k, v, lens, offsets)
    fwd, bwd = captured_programs
    _check_program(fwd, ["attn_fwd_ws_kernel"])
    _check_program(bwd, ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_ws_kernel"])
    compiled = {fn.__name__: args for fn, args, _, _ in compile_calls}
    for name in ("attn_fwd_ws_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_ws_kernel"):
        assert (compiled[name]["BLOCK_DQK"], compiled[name]["BLOCK_DQK2"], compiled[name]["BLOCK_DV"]) == \
            (128, 64, 128), name


@compiles
def test_compiled_specialization_is_tritons_own():
    """compile_kernel uses Triton's JIT binder: ints equal to 1 become constants, the rest stay
    parameters, pointers carry their dtype."""
    from transformer_engine.common.attention.kernels.backward import attn_bwd_preprocess_kernel as fn

    args = {name: gpu.Pointer("float32" if name == "DELTA" else "bfloat16") for name in ("O", "DO", "DELTA")}
    args.update(SEQ_START_Q=gpu.Pointer("float32"), SEQ_LEN_Q=gpu.Pointer("float32"))
    strides = dict(stride_ob=4096, stride_os=64, stride_oh=16, stride_od=1, stride_dob=4096, stride_dos=64,
                   stride_doh=16, stride_dod=1, stride_lb=256, stride_lh=64)
    args.update(strides, num_heads_q=4, seqlen_q=64, HEAD_DIM_V=16, BLOCK_DV=16, BLOCK_M=64, IS_THD=False,
                HAS_SEQLENS=False, SEGMENTS=1)
    kernel = gpu.compile_kernel(fn, args, dict(num_warps=4),
                                triton.backends.compiler.GPUTarget("cuda", 90, 32))
    names = [name for name, _ in kernel.params]
    assert "stride_od" not in names and "stride_dod" not in names  # == 1: specialized away
    assert dict(kernel.params)["DELTA"] == "*fp32" and dict(kernel.params)["O"] == "*bf16"
    assert kernel.name == "attn_bwd_preprocess_kernel" and kernel.cubin[:4] == b"\x7fELF"


def _bias_grad_fn(mask, bias_shape, layout=QKVLayout.BSHD_BSHD_BSHD, m=1, dropout=0.0):
    """``(q, k, v, lens, offsets, bias) -> (out, (dq, dk, dv, dbias))`` through the forced fused backend."""

    def fn(q, k, v, lens, offsets, bias):
        if mask.is_padding():
            desc = (SequenceDescriptor.from_seqlens_and_offsets(lens, offsets) if m > 1
                    else SequenceDescriptor.from_seqlens(lens))
        else:
            desc = None
        f = lambda q, k, v, bias: te_testing.fused_attn_with_backend(  # noqa: E731
            "fused", (q, k, v), bias, desc, jax.random.PRNGKey(0) if dropout else None, "post_scale_bias", mask,
            layout, q.shape[-1] ** -0.5, dropout, True, max_segments_per_seq=m)
        out, vjp = jax.vjp(f, q, k, v, bias)
        return out, vjp(out)

    return fn


def _named_params(prog: gpu.Program, launch):
    """{parameter name: (kind, value)} of one decoded launch (scratch pointers left out)."""
    compiled = {k.name: k for k in prog._kernels}[launch["kernel"]]
    return {name: param for (name, _), param in zip(compiled.params, launch["params"])}


@pytest.fixture
def compile_calls(monkeypatch):
    """Every (kernel name, args, launch options) the lowering compiles, in order."""
    calls = []
    real = gpu.compile_kernel

    def record(fn, args, launch_options, target):
        calls.append((fn, dict(args), dict(launch_options), target))
        return real(fn, args, launch_options, target)

    monkeypatch.setattr(gpu, "compile_kernel", record)
    return calls


@compiles
@pytest.mark.parametrize("bottom_right_diagonal", [None, True])
def test_window_diagonal_reaches_the_kernels(captured_programs, compile_calls, bottom_right_diagonal):
    """A no_mask window is top-left by default (TransformerEngine-JAX) and bottom-right on request: every
    kernel that masks is compiled with that BOTTOM_RIGHT."""
    fn = _attention_grad_fn(AttnMaskType.NO_MASK, window=(8, 8), bottom_right_diagonal=bottom_right_diagonal)
    _lower_for_cuda(fn, *_shapes(1, 64, 2, 2, 64))
    masked = [(fn.__name__, args) for fn, args, _, _ in compile_calls if "BOTTOM_RIGHT" in args]
    assert {name for name, _ in masked} >= {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"}
    for name, args in masked:
        assert args["BOTTOM_RIGHT"] is bool(bottom_right_diagonal), name
        assert args["HAS_LEFT"] and args["HAS_RIGHT"], name


BIAS_SHAPES = {"1hss": (1, 4), "b1ss": (2, 1), "bhss": (2, 4), "11ss": (1, 1)}


@compiles
@pytest.mark.parametrize("mask", [AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, AttnMaskType.NO_MASK],
                         ids=["padding", "no_mask"])
@pytest.mark.parametrize("bias_kind", list(BIAS_SHAPES))
def test_bias_is_passed_to_the_kernels(captured_programs, compile_calls, mask, bias_kind):
    """Bias strides (0 along broadcast dims), HAS_BIAS, and the dBias launch (common.attention.launch_description):
    tiles min(dq.block_m, 64), grid (s_q / tile, s_kv / tile, bias b * h), dq's
    warps, one stage, contiguous dBias strides, lengths (padding) and batch strides."""
    b, s_q, s_kv, hq, hk, d = 2, 128, 192, 4, 2, 64
    bias_shape = (*BIAS_SHAPES[bias_kind], s_q, s_kv)
    q = jax.ShapeDtypeStruct((b, s_q, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s_kv, hk, d), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct(bias_shape, jnp.bfloat16)
    lens, offsets = jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, 2), jnp.int32)
    text = _lower_for_cuda(_bias_grad_fn(mask, bias_shape), q, kv, kv, lens, offsets, bias)
    assert text.count(f"@{gpu.FFI_TARGET}") == 2
    fwd, bwd = captured_programs
    from dataclasses import replace

    from transformer_engine.common.attention.config import normalize_window

    static = replace(_static(mask), window_size=normalize_window(None, mask))
    zb = bias_shape[1] * s_q * s_kv if bias_shape[0] > 1 else 0
    zh = s_q * s_kv if bias_shape[1] > 1 else 0
    packed = mask.is_padding()

    _, _, (launch,) = _check_program(fwd, ["attn_fwd_kernel"])
    bias_index = len(fwd.operands) - 1  # appended last
    assert fwd.operands[bias_index].shape == bias_shape
    params = _named_params(fwd, launch)
    assert params["BIAS"] == ("buffer", bias_index)
    assert (params["stride_zb"], params["stride_zh"], params["stride_zm"]) == (("i32", zb), ("i32", zh),
                                                                                ("i32", s_kv))
    assert "stride_zn" not in params  # 1: a constant in Triton's specialization, as in the PyTorch launch
    assert dict({k.name: k for k in fwd._kernels}["attn_fwd_kernel"].params)["BIAS"] == "*bf16"

    kernels = ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dbias_kernel", "attn_bwd_dq_kernel"]
    _, fills, launches = _check_program(bwd, kernels)
    bias_index = len(bwd.operands) - 1
    assert bwd.operands[bias_index].shape == bias_shape
    n_ops = len(bwd.operands)
    dbias_index = n_ops + 4  # dq, dk, dv, delta, dbias
    assert bwd.results[4].shape == bias_shape and bwd.results[4].dtype == jnp.bfloat16
    assert dbias_index not in [index for index, _, _ in fills]  # the dBias kernel writes every element
    for launch in (launches[1], launches[3]):
        params = _named_params(bwd, launch)
        assert params["BIAS"] == ("buffer", bias_index), launch["kernel"]
        assert (params["stride_zb"], params["stride_zh"], params["stride_zm"]) == (("i32", zb), ("i32", zh),
                                                                                    ("i32", s_kv))
        assert "stride_zn" not in params

    config = _plan_key(static, q, kv, bias_shape)
    plan = backward_plan(config)
    tile = min(plan.dq.block_m, 64)
    dbias_launch = launches[2]
    assert dbias_launch["grid"] == (-(-s_q // tile), -(-s_kv // tile), bias_shape[0] * bias_shape[1])
    params = _named_params(bwd, dbias_launch)
    assert params["BIAS"] == ("buffer", bias_index) and params["DBIAS"] == ("buffer", dbias_index)
    assert "stride_zn" not in params and "stride_dzn" not in params  # 1: constants, as Triton's JIT makes them
    assert params["Q"] == ("buffer", 0) and params["DO"] == ("buffer", 4) and params["LSE"] == ("buffer", 5)
    assert params["DELTA"] == ("buffer", n_ops + 3)
    assert params["RNG_STATE"] == ("buffer", 5)  # placeholder: no dropout
    # Padded reads: real batch strides (the kernel has no packed mode), the rows' lengths.
    assert params["stride_qb"] == ("i32", s_q * hq * d) and params["stride_kb"] == ("i32", s_kv * hk * d)
    assert params["SEQ_LEN_Q"] == ("buffer", 8 if packed else 5) and params["SEQ_LEN_K"] == ("buffer", 9 if packed
                                                                                                 else 5)
    assert (params["stride_zb"], params["stride_zh"]) == (("i32", zb), ("i32", zh))
    contiguous = (bias_shape[1] * s_q * s_kv, s_q * s_kv, s_kv)
    assert (params["stride_dzb"], params["stride_dzh"], params["stride_dzm"]) == tuple(("i32", x)
                                                                                       for x in contiguous)
    for name, value in (("batch_size", b), ("num_heads_q", hq), ("gqa_group", hq // hk), ("seqlen_q", s_q),
                        ("seqlen_k", s_kv)):
        assert params[name] == ("i32", value), name
    for name, value in (("bias_batch", bias_shape[0]), ("bias_heads", bias_shape[1])):
        assert params.get(name, ("i32", 1)) == ("i32", value), name  # absent when 1 (a constant)

    # What each kernel was compiled for (constexprs are not launch parameters).
    compiled = {fn.__name__: (args, options) for fn, args, options, _ in compile_calls}
    for name in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        args, _ = compiled[name]
        assert args["HAS_BIAS"] is True and args["HAS_ALIBI"] is False and args["DROPOUT"] is False, name
        assert args["IS_THD"] is packed and args["HAS_SEQLENS"] is packed, name
    args, options = compiled["attn_bwd_dbias_kernel"]
    assert options == dict(num_warps=plan.dq.num_warps, num_stages=1, enable_fp_fusion=True)
    assert (args["BLOCK_M"], args["BLOCK_N"], args["HAS_SEQLENS"], args["DROPOUT"]) == (tile, tile, packed, False)
    assert (args["BLOCK_DQK"], args["BLOCK_DV"]) == (plan.block_dqk, plan.block_dv)
    flags, _, _ = mask_flags(config)
    assert {k: args[k] for k in flags} == flags
    assert args["qk_scale"] == pytest.approx(d**-0.5 * LOG2E) and args["dropout_p"] == 0.0


@compiles
def test_dropout_and_unsupported_bias_are_not_lowered_to_the_kernels(captured_programs):
    from dataclasses import replace

    from transformer_engine.common.attention.enums import AttnBiasType, QKVFormat

    static = replace(_static(AttnMaskType.PADDING_MASK), attn_bias_type=AttnBiasType.POST_SCALE_BIAS)
    gpu._check_supported(static, 1)  # padded, one sequence per row: lowered
    with pytest.raises(NotImplementedError, match="no dropout"):
        gpu._check_supported(replace(static, dropout_probability=0.1), 1)
    with pytest.raises(NotImplementedError, match="post_scale_bias"):
        gpu._check_supported(replace(static, attn_bias_type=AttnBiasType.PRE_SCALE_BIAS), 1)
    with pytest.raises(NotImplementedError, match="padded layout"):
        gpu._check_supported(replace(static, qkv_format=QKVFormat.THD), 1)
    with pytest.raises(NotImplementedError, match="padded layout"):
        gpu._check_supported(static, 2)

    # Through the lowering: a THD bias call and a dropout call stop before any program is built.
    b, s, h, d, m = 2, 64, 2, 32, 2
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, h, s, s), jnp.bfloat16)
    lens, offsets = jax.ShapeDtypeStruct((b, m), jnp.int32), jax.ShapeDtypeStruct((b, m + 1), jnp.int32)
    with pytest.raises(NotImplementedError, match="padded layout"):
        _lower_for_cuda(_bias_grad_fn(AttnMaskType.PADDING_MASK, bias.shape, QKVLayout.THD_THD_THD, m=m),
                        q, q, q, lens, offsets, bias)
    lens, offsets = jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, 2), jnp.int32)
    with pytest.raises(NotImplementedError, match="no dropout"):
        _lower_for_cuda(_bias_grad_fn(AttnMaskType.NO_MASK, bias.shape, dropout=0.1), q, q, q, lens, offsets, bias)
    assert captured_programs == []


def test_selection_picks_the_fused_bias_path_on_a_gpu(monkeypatch):
    """On a CUDA device fused_attn's selection (and the public fused_attn_unavailable_reasons, which says
    what it picks) has nothing against a post_scale_bias over padded sequences (the bias path runs fused
    on the GPU, checked by qa/L1_jax_gpu)."""
    from transformer_engine.common.attention.enums import AttnBiasType

    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", (9, 0)))
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: None)
    args = dict(is_training=True, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, qkv_layout="bshd_bshd_bshd",
                attn_bias_type=AttnBiasType.POST_SCALE_BIAS, attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK,
                softmax_type="vanilla", dropout_probability=0.0, q_num_heads=4, kv_num_heads=2, q_max_seqlen=128,
                kv_max_seqlen=128, head_dim_qk=64, bias_shape=(1, 4, 128, 128))
    assert te_attention._fused_reasons(**args) == []
    assert te_attention.fused_attn_unavailable_reasons(**args) == []


@pytest.mark.parametrize("descriptor", ["seqlens", "offsets", "segment_ids"])
def test_bias_with_sequences_that_may_start_late_stays_unfused(monkeypatch, descriptor):
    """The kernels index a bias from each sequence's first token, the bias is laid out by row
    position: a padded call whose sequences may start after token 0 (seq_offsets, segment_ids)
    selects the unfused backend with that reason; from_seqlens selects fused. Selection only: on
    this CPU the call itself would run jnp either way."""
    from transformer_engine.common.attention.enums import AttnBiasType

    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", (9, 0)))
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: None)
    b, s, h, d = 2, 16, 2, 16
    q = jnp.zeros((b, s, h, d), jnp.float16)
    lens = jnp.array([16, 9], jnp.int32)
    seq = {
        "seqlens": lambda: te_attention.SequenceDescriptor.from_seqlens((lens, lens)),
        "offsets": lambda: te_attention.SequenceDescriptor.from_seqlens_and_offsets(
            (lens[:, None], lens[:, None]), (jnp.zeros((b, 1), jnp.int32),) * 2),
        "segment_ids": lambda: te_attention.SequenceDescriptor.from_segment_ids_and_pos(
            ((jnp.arange(s)[None, :] < lens[:, None]).astype(jnp.int32),) * 2),
    }[descriptor]()
    call = te_attention._parse_call(te_attention._FusedAttnArgs(
        (q, q, q), jnp.zeros((1, h, s, s), jnp.float16), seq, None, AttnBiasType.POST_SCALE_BIAS,
        AttnMaskType.PADDING_MASK, QKVLayout.BSHD_BSHD_BSHD, "vanilla", None, 0.0, True, 1, None))
    selection = te_attention.select_attention_backend(call.config)
    if descriptor == "seqlens":
        assert selection.backend.SHORT_NAME == "fused", selection.rejected
    else:
        assert selection.backend.SHORT_NAME == "unfused"
        assert any("from_seqlens" in r for r in selection.rejected[te_attention.FusedAttention.NAME])


def _static(mask):
    from transformer_engine.common.attention.enums import AttnBiasType, QKVFormat
    from transformer_engine.jax.primitives.attention import FusedAttnStatic

    return FusedAttnStatic(AttnMaskType(mask), AttnBiasType.NO_BIAS, QKVFormat.BSHD, (-1, 0), 0.125, 0.0, True, True)


def _plan_key(static, q, kv, bias_shape=None):
    """The plan key of the lowering's launches for these shapes on sm_90."""
    call = gpu.launch_call(static, dict(q=q.shape, k=kv.shape, v=kv.shape), q.dtype, q.shape[0], bias_shape, (9, 0))
    return call.plan_key


def _fake(b, s, hq, hk, d):
    return (jax.ShapeDtypeStruct((b, s, hq, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16))


def test_unavailable_reason_says_what_is_missing():
    reason = gpu.unavailable_reason()
    if INTERPRETED:
        assert reason is not None and "TRITON_INTERPRET=1" in reason
        return
    try:
        from transformer_engine.jax import transformer_engine_jax_ffi  # noqa: F401
    except ImportError:
        assert reason is not None and "transformer_engine_jax_ffi" in reason and "NVTE_FRAMEWORK=jax" in reason


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_native_extension_source_compiles():
    pybind11 = pytest.importorskip("pybind11", reason="pybind11 is not installed")
    cuda_include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    if not (cuda_include / "cuda.h").exists():
        pytest.skip("triton's wheel carries no cuda.h here")
    cmd = [
        "g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Werror=return-type",
        f"-I{cuda_include}", f"-I{jax.ffi.include_dir()}", f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}", str(REPO / "transformer_engine" / "jax" / "csrc" / "triton_launch.cpp"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    own = [line for line in result.stderr.splitlines() if "triton_launch.cpp" in line and "warning" in line]
    assert not own, "\n".join(own)


@compiles
@pytest.mark.parametrize("softmax_type", ["off_by_one", "learnable"])
def test_sink_softmax_lowers_to_the_triton_forward_and_the_sink_gradient_kernel(captured_programs, softmax_type):
    """d=128 bf16 (where vanilla takes the Gluon kernels): sink configs run the Triton forward with the
    sink logits as its last operand, and the learnable sink's backward adds the sink-gradient kernel,
    one program per (sequence, head), writing each sequence's part."""
    b, s, hq, hk, d, m = 2, 128, 4, 2, 128, 2
    learnable = softmax_type == "learnable"

    def fn(q, k, v, lens, offsets, softmax_offset):
        desc = SequenceDescriptor.from_seqlens_and_offsets(lens, offsets)
        f = lambda q, k, v, off: te_testing.fused_attn_with_backend(  # noqa: E731
            "fused", (q, k, v), None, desc, None, "no_bias", AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD,
            q.shape[-1] ** -0.5, 0.0, True, max_segments_per_seq=m, softmax_type=softmax_type,
            softmax_offset=off if learnable else None)
        out, vjp = jax.vjp(f, q, k, v, softmax_offset)
        return out, vjp(out)

    offset = jax.ShapeDtypeStruct((1, hq, 1, 1), jnp.float32)
    _lower_for_cuda(fn, *_shapes(b, s, hq, hk, d, m=m), offset)
    fwd, bwd = captured_programs
    _, _, (launch,) = _check_program(fwd, ["attn_fwd_kernel"])
    sink_index = len(fwd.operands) - 1
    assert fwd.operands[sink_index].shape == (hq,) and fwd.operands[sink_index].dtype == jnp.float32
    assert _named_params(fwd, launch)["SINK"] == ("buffer", sink_index)
    expected = ["attn_bwd_preprocess_kernel"] + (["attn_bwd_dsink_kernel"] if learnable else []) + [
        "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
    _, _, launches = _check_program(bwd, expected)
    if learnable:
        params = _named_params(bwd, launches[1])
        assert launches[1]["grid"] == (b * m, hq, 1)
        assert params["SINK"] == ("buffer", len(bwd.operands) - 1)
        parts = (bwd.operands + bwd.results)[params["DSINK"][1]]
        assert parts.shape == (b * m, hq) and parts.dtype == jnp.float32


def _partial_bwd_fn(static, grads):
    """``(q, k, v, out, dout, aux, lens, offsets) -> (dq, dk, dv)`` of the backward primitive running ``grads``."""
    from dataclasses import replace

    from transformer_engine.jax.attention_math import SeqInfo, full_seq_info
    from transformer_engine.jax.primitives.attention import fused_attn_bwd

    def fn(q, k, v, out, dout, aux, lens, offsets):
        b, s = q.shape[:2]
        seq = SeqInfo(lens, lens, offsets, offsets) if static.attn_mask_type.is_padding() else full_seq_info(b, s, s)
        seeds = jnp.zeros((b, q.shape[2], 2), jnp.uint32)
        return fused_attn_bwd(q, k, v, jnp.zeros((0,), q.dtype), out, dout, aux, seq, seeds,
                              replace(static, backward_grads=grads))[:3]

    return fn


@compiles
@pytest.mark.parametrize("grads", ["dq", "dkdv"])
@pytest.mark.parametrize("mask,d", [(AttnMaskType.CAUSAL_MASK, 64), (AttnMaskType.PADDING_CAUSAL_MASK, 128)],
                         ids=["bshd-d64", "packed-d128-gluon"])
def test_partial_backward_program_runs_one_gradient_pass(captured_programs, grads, mask, d):
    """Context parallelism's partial backwards: the program has the preprocess and the one pass, results
    (and zero fills, packed mode) only for the gradients asked for; the others are zeros outside it."""
    from dataclasses import replace

    from transformer_engine.common.attention.enums import BackwardGrads, QKVFormat

    which = BackwardGrads(grads)
    b, s, hq, hk, m = 2, 128, 4, 2, (2 if mask.is_padding() else 1)
    static = replace(_static(mask), qkv_format=QKVFormat.THD if mask.is_padding() else QKVFormat.BSHD)
    q = jax.ShapeDtypeStruct((b, s, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
    aux = jax.ShapeDtypeStruct((b, m, hq, s), jnp.float32)
    lens, offsets = jax.ShapeDtypeStruct((b, m), jnp.int32), jax.ShapeDtypeStruct((b, m + 1), jnp.int32)
    text = _lower_for_cuda(_partial_bwd_fn(static, which), q, kv, kv, q, q, aux, lens, offsets)
    assert text.count(f"@{gpu.FFI_TARGET}") == 1
    (bwd,) = captured_programs
    gluon = "_ws" if d == 128 else ""
    kernel = f"attn_bwd_dq{gluon}_kernel" if which.has_dq else f"attn_bwd_dkdv{gluon}_kernel"
    _, fills, _ = _check_program(bwd, ["attn_bwd_preprocess_kernel", kernel])
    n_ops = len(bwd.operands)
    grad_shapes = [(b, s, hq, d)] if which.has_dq else [(b, s, hk, d), (b, s, hk, d)]
    assert [r.shape for r in bwd.results[:len(grad_shapes) + 1]] == grad_shapes + [(b * m, hq, s)]  # then delta
    assert fills == ([(n_ops + i, 0, 1) for i in range(len(grad_shapes))] if mask.is_padding() else [])


@compiles
@pytest.mark.parametrize("packed", [False, True], ids=["bshd-causal", "thd-padding_causal"])
def test_max_logit_lowers_to_the_gluon_forward_with_a_row_max_result(captured_programs, compile_calls, packed):
    """return_max_logit at d=128 bf16 on sm_90: the Gluon forward, as the call without it, with HAS_ROW_MAX, its
    ROW_MAX parameter a third fp32 result laid out as the log-sum-exp (-inf-filled in packed mode, whose kernels
    write only rows inside sequences); the backward is the call's without the max logit."""
    b, s, hq, hk, d, m = 2, 128, 4, 2, 128, (2 if packed else 1)
    mask = AttnMaskType.PADDING_CAUSAL_MASK if packed else AttnMaskType.CAUSAL_MASK
    layout = QKVLayout.THD_THD_THD if packed else QKVLayout.BSHD_BSHD_BSHD

    def fn(q, k, v, lens, offsets):
        desc = SequenceDescriptor.from_seqlens_and_offsets(lens, offsets) if packed else None
        f = lambda q, k, v: te_testing.fused_attn_with_backend(  # noqa: E731
            "fused", (q, k, v), None, desc, None, "no_bias", mask, layout, q.shape[-1] ** -0.5, 0.0, True,
            max_segments_per_seq=m, return_max_logit=True)
        (out, max_logit), vjp = jax.vjp(f, q, k, v)
        return out, max_logit, vjp((out, jnp.zeros_like(max_logit)))

    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(gpu.FFI_TARGET)],
    )(*_shapes(b, s, hq, hk, d, m=m))
    assert exported.out_avals[1].shape == (hq,) and exported.out_avals[1].dtype == jnp.bfloat16
    fwd, bwd = captured_programs
    _, fills, (launch,) = _check_program(fwd, ["attn_fwd_ws_kernel"])
    n_ops, nseq = len(fwd.operands), b * m
    assert [r.shape for r in fwd.results[:3]] == [(b, s, hq, d), (nseq, hq, s), (nseq, hq, s)]
    assert fwd.results[2].dtype == jnp.float32
    assert _named_params(fwd, launch)["ROW_MAX"] == ("buffer", n_ops + 2)
    assert fills == ([(n_ops, 0, 1), (n_ops + 1, 0x7F800000, 4), (n_ops + 2, 0xFF800000, 4)] if packed else [])
    compiled = {fn.__name__: args for fn, args, _, _ in compile_calls}
    assert compiled["attn_fwd_ws_kernel"]["HAS_ROW_MAX"] is True
    _check_program(bwd, ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_ws_kernel", "attn_bwd_dq_ws_kernel"])


@compiles
def test_batch_invariant_mode_lowers_to_the_shared_kernels(captured_programs, monkeypatch):
    """JAX's batch-invariant mode on CUDA (transformer_engine.jax.batch_invariance): the norm, dense, the
    activation and a bias addition, forward and backward, lower to launch programs of the
    common/batch_invariant kernels compiled for sm_90, the forward GEMM reading the kernel as PyTorch reads
    ``W^T`` (stride_bk 1, specialized away; stride_bn K)."""
    from transformer_engine.jax import batch_invariant
    from transformer_engine.jax.batch_invariance import bi_activation, bias_add
    from transformer_engine.jax.dense import dense
    from transformer_engine.jax.flax.module import layernorm
    from transformer_engine.jax.primitives import batch_invariant as bi_primitives

    monkeypatch.setattr(bi_primitives, "unavailable_reason", lambda platform: None)
    hidden, ffn = 32, 64

    def fn(x, kernel, bias, scale, ln_bias):
        y = layernorm(x, scale, ln_bias, "layernorm", False, 1e-5)
        z = bi_activation(dense(y, kernel, bias), "swiglu")
        return jnp.sum(bias_add(z, bias[:ffn // 2]).astype(jnp.float32))

    args = [jnp.ones(s, jnp.bfloat16) for s in ((8, hidden), (hidden, ffn), (ffn,), (hidden,), (hidden,))]
    with batch_invariant():
        module = _lower_for_cuda(jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4)), *args)
    assert "dot_general" not in module
    launched = []
    for prog in captured_programs:
        _, _, launches = decode(*prog.encode())
        _check_program(prog, [launch["kernel"] for launch in launches])
        launched += [(prog, launch) for launch in launches]
    assert {launch["kernel"] for _, launch in launched} == {
        "bi_norm_fwd_kernel", "bi_gemm_kernel", "bi_act_fwd_kernel", "bi_act_bwd_kernel", "bi_col_sum_kernel",
        "bi_norm_bwd_kernel"}
    prog, first_gemm = next((p, launch) for p, launch in launched if launch["kernel"] == "bi_gemm_kernel")
    params = _named_params(prog, first_gemm)
    assert params["stride_am"] == ("i32", hidden) and params["stride_bn"] == ("i32", hidden)
    assert "stride_bk" not in params and "stride_ak" not in params
