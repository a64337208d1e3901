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

from transformer_engine.common.attention.enums import AttnMaskType, QKVLayout  # noqa: E402
from transformer_engine.jax import attention as te_attention  # noqa: E402
from transformer_engine.jax.attention import SequenceDescriptor  # noqa: E402
from transformer_engine.jax.primitives import gpu  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KINDS = ("buffer", "i32", "i64", "f32", "null")

from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel  # noqa: E402

# Under TRITON_INTERPRET=1 (set for the PyTorch CPU suites) @triton.jit gives interpreted
# functions, which cannot be compiled; JAX never interprets Triton, so these tests then run in a
# child process without the variable.
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


def _attention_grad_fn(mask, layout=QKVLayout.BSHD_BSHD_BSHD, m=1, window=None, deterministic=True):
    def fn(q, k, v, lens, offsets):
        if mask.is_padding:
            desc = (SequenceDescriptor.from_seqlens_and_offsets(lens, offsets) if m > 1
                    else SequenceDescriptor.from_seqlens(lens))
        else:
            desc = None
        f = lambda q, k, v: te_attention._fused_attn_with_backend(  # noqa: E731
            "fused", (q, k, v), None, desc, None, "no_bias", mask, layout, q.shape[-1] ** -0.5, 0.0, True,
            max_segments_per_seq=m, window_size=window)
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
        assert launch["params"][-2:] == [("null", 0), ("null", 0)]
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
    plan = gpu.forward_plan(gpu._plan_config(_static(AttnMaskType.CAUSAL_MASK), *_fake(b, s, hq, hk, d), False))
    assert launch["grid"] == (s // plan.tiles.block_m, b * hq, 1)
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
    _, fills, launches = _check_program(fwd, ["attn_fwd_kernel"])
    n_ops = len(fwd.operands)
    assert fills == [(n_ops, 0, 1), (n_ops + 1, 0x7F800000, 4)]  # output zeroed, lse +inf
    assert [r.shape for r in fwd.results] == [(b, s, hq, d), (b * m, hq, s)]
    assert launches[0]["grid"][1] == b * m * hq  # one program column per (sequence, head)
    _, fills, _ = _check_program(bwd, ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"])
    n_ops = len(bwd.operands)
    assert fills == [(n_ops, 0, 1), (n_ops + 1, 0, 1), (n_ops + 2, 0, 1)]  # dq, dk, dv zeroed


@compiles
def test_window_mqa_fp16_lowers(captured_programs):
    _lower_for_cuda(_attention_grad_fn(AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, window=(32, 0)),
                    *_shapes(1, 96, 4, 1, 64, dtype=jnp.float16))
    for prog in captured_programs:
        _check_program(prog, [k.name for k in prog._kernels])


@compiles
def test_compiled_specialization_is_tritons_own():
    """compile_kernel uses Triton's JIT binder: ints equal to 1 become constants, the rest stay
    parameters, pointers carry their dtype."""
    from transformer_engine.common.attention.kernels.backward import attn_bwd_preprocess_kernel as fn

    args = {name: gpu.Pointer(jnp.float32 if name == "DELTA" else jnp.bfloat16) for name in ("O", "DO", "DELTA")}
    args.update(SEQ_START_Q=gpu.Pointer(jnp.float32), SEQ_LEN_Q=gpu.Pointer(jnp.float32))
    strides = dict(stride_ob=4096, stride_os=64, stride_oh=16, stride_od=1, stride_dob=4096, stride_dos=64,
                   stride_doh=16, stride_dod=1, stride_lb=256, stride_lh=64)
    args.update(strides, num_heads_q=4, seqlen_q=64, HEAD_DIM_V=16, BLOCK_DV=16, BLOCK_M=64, IS_THD=False,
                HAS_SEQLENS=False)
    kernel = gpu.compile_kernel(fn, gpu._hashable(args), dict(num_warps=4),
                                triton.backends.compiler.GPUTarget("cuda", 90, 32))
    names = [name for name, _ in kernel.params]
    assert "stride_od" not in names and "stride_dod" not in names  # == 1: specialized away
    assert dict(kernel.params)["DELTA"] == "*fp32" and dict(kernel.params)["O"] == "*bf16"
    assert kernel.name == "attn_bwd_preprocess_kernel" and kernel.cubin[:4] == b"\x7fELF"


@compiles
def test_bias_and_dropout_are_not_lowered_to_the_kernels(captured_programs):
    static = _static(AttnMaskType.NO_MASK)
    from dataclasses import replace

    from transformer_engine.common.attention.enums import AttnBiasType

    with pytest.raises(NotImplementedError, match="no dropout"):
        gpu._check_supported(replace(static, dropout_probability=0.1))
    with pytest.raises(NotImplementedError, match="no bias"):
        gpu._check_supported(replace(static, attn_bias_type=AttnBiasType.POST_SCALE_BIAS))


def _static(mask):
    from transformer_engine.common.attention.enums import AttnBiasType, QKVFormat
    from transformer_engine.jax.primitives.attention import FusedAttnStatic

    return FusedAttnStatic(AttnMaskType(mask), AttnBiasType.NO_BIAS, QKVFormat.BSHD, (-1, 0), 0.125, 0.0, True, True)


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
