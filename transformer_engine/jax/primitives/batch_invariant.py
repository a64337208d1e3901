"""JAX primitives of the batch-invariant kernels (``transformer_engine.common.batch_invariant``): the GEMM without
split-K, the LayerNorm / RMSNorm rows (forward, input gradient) and the column sums of the parameter gradients.

They launch the kernels PyTorch's batch-invariant mode launches, with the same arguments, so one row gets the
same bits in either framework: on a CUDA GPU through the XLA FFI launch path of the fused attention
(``primitives.gpu``: compiled at lowering time, one ``te_triton_launch`` custom call), on CPU under Triton's
interpreter through the host callback of ``primitives.interpret`` (``NVTE_JAX_TRITON_INTERPRET=1`` with
``TRITON_INTERPRET=1``). Elsewhere lowering raises: XLA's own dot or reductions would not be batch-invariant.

Operands are contiguous row-major arrays; a GEMM operand may be read transposed (strides swapped), as PyTorch
reads ``w.t()`` or ``grad.t()``, so the JAX launches equal PyTorch's in every argument.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from transformer_engine.common.attention.launch_description import Launch, Slot
from transformer_engine.common.batch_invariant.plan import (ActivationArgs, activation_tiles, col_sum_tiles,
                                                            gemm_tiles, norm_tiles)

__all__ = ["gemm", "norm_fwd", "norm_bwd", "col_sums", "act_fwd", "act_bwd", "unavailable_reason"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _GemmSpec:
    a_t: bool  # operand a is A^T stored row-major ([K, M])
    b_t: bool  # operand b is B^T stored row-major ([N, K])
    out_dtype: str


@dataclass(frozen=True)
class _NormSpec:
    is_rms: bool
    zero_centered: bool
    has_bias: bool
    eps: float


@dataclass(frozen=True)
class _ColSumSpec:
    has_x: bool
    out_dtype: str


def _gemm_dims(a_shape, b_shape, spec: _GemmSpec):
    m, k = (a_shape[1], a_shape[0]) if spec.a_t else tuple(a_shape)
    kb, n = (b_shape[1], b_shape[0]) if spec.b_t else tuple(b_shape)
    if k != kb:
        raise ValueError(f"GEMM operands must share K, got {tuple(a_shape)} and {tuple(b_shape)} (a_t={spec.a_t}, "
                         f"b_t={spec.b_t})")
    return m, n, k


# ------------------------------------------------------------------------------------------------
# Launches (framework-free descriptions; the program runs them on the GPU or under the interpreter)
# ------------------------------------------------------------------------------------------------


def _gemm_impl(a, b, *, spec: _GemmSpec, program, device_type: str):
    from transformer_engine.common.batch_invariant.kernels import bi_gemm_kernel

    m, n, k = _gemm_dims(a.shape, b.shape, spec)
    prog = program([jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype)])
    c = prog.result((m, n), spec.out_dtype)
    if m == 0 or n == 0 or k == 0:
        return (jnp.zeros((m, n), spec.out_dtype),)
    tiles = gemm_tiles(n, k, jnp.dtype(a.dtype).name, device_type)
    stride_am, stride_ak = (1, m) if spec.a_t else (k, 1)
    stride_bk, stride_bn = (1, k) if spec.b_t else (n, 1)
    args = dict(A=Slot("a"), B=Slot("b"), C=Slot("c"), M=m, N=n, K=k, stride_am=stride_am, stride_ak=stride_ak,
                stride_bk=stride_bk, stride_bn=stride_bn, stride_cm=n, stride_cn=1, BLOCK_M=tiles.BLOCK_M,
                BLOCK_N=tiles.BLOCK_N, BLOCK_K=tiles.BLOCK_K)
    grid = (_cdiv(m, tiles.BLOCK_M), _cdiv(n, tiles.BLOCK_N), 1)
    launch = Launch(bi_gemm_kernel, grid, args, dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    from transformer_engine.jax.primitives import gpu

    prog.add_launches([launch], dict(a=gpu.Buf(0), b=gpu.Buf(1), c=gpu.Buf(c)))
    return tuple(prog.call(a, b))


def _norm_fwd_impl(x, w, bias, *, spec: _NormSpec, program, device_type: str):
    from transformer_engine.common.batch_invariant.kernels import bi_norm_fwd_kernel
    from transformer_engine.jax.primitives import gpu

    rows, hidden = x.shape
    if rows == 0:
        return jnp.zeros_like(x), jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)
    prog = program([jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (x, w, bias)])
    y = prog.result(x.shape, x.dtype)
    mean = prog.result((rows,), jnp.float32)
    rstd = prog.result((rows,), jnp.float32)
    tiles = norm_tiles(hidden, device_type)
    args = dict(X=Slot("x"), W=Slot("w"), Bias=Slot("bias"), Y=Slot("y"), Mean=Slot("mean"), Rstd=Slot("rstd"),
                R=rows, H=hidden, stride_x=hidden, stride_y=hidden, eps=spec.eps, IS_RMS=spec.is_rms,
                HAS_BIAS=spec.has_bias, ZERO_CENTERED=spec.zero_centered, BLOCK_R=tiles.BLOCK_R,
                BLOCK_H=tiles.BLOCK_H)
    launch = Launch(bi_norm_fwd_kernel, (_cdiv(rows, tiles.BLOCK_R), 1, 1), args, dict(num_warps=tiles.num_warps))
    prog.add_launches([launch], dict(x=gpu.Buf(0), w=gpu.Buf(1), bias=gpu.Buf(2), y=gpu.Buf(y),
                                     mean=gpu.Buf(mean), rstd=gpu.Buf(rstd)))
    return tuple(prog.call(x, w, bias))


def _norm_bwd_impl(x, w, dy, mean, rstd, *, spec: _NormSpec, program, device_type: str):
    from transformer_engine.common.batch_invariant.kernels import bi_norm_bwd_kernel
    from transformer_engine.jax.primitives import gpu

    rows, hidden = x.shape
    if rows == 0:
        return (jnp.zeros_like(x),)
    prog = program([jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (x, w, dy, mean, rstd)])
    dx = prog.result(x.shape, x.dtype)
    tiles = norm_tiles(hidden, device_type)
    args = dict(X=Slot("x"), W=Slot("w"), DY=Slot("dy"), DX=Slot("dx"), Mean=Slot("mean"), Rstd=Slot("rstd"),
                R=rows, H=hidden, stride_x=hidden, stride_dy=hidden, stride_dx=hidden, IS_RMS=spec.is_rms,
                ZERO_CENTERED=spec.zero_centered, BLOCK_R=tiles.BLOCK_R, BLOCK_H=tiles.BLOCK_H)
    launch = Launch(bi_norm_bwd_kernel, (_cdiv(rows, tiles.BLOCK_R), 1, 1), args, dict(num_warps=tiles.num_warps))
    prog.add_launches([launch], dict(x=gpu.Buf(0), w=gpu.Buf(1), dy=gpu.Buf(2), mean=gpu.Buf(3), rstd=gpu.Buf(4),
                                     dx=gpu.Buf(dx)))
    return tuple(prog.call(x, w, dy, mean, rstd))


def _col_sums_impl(dy, x, mean, rstd, *, spec: _ColSumSpec, program, device_type: str):
    from transformer_engine.common.batch_invariant.kernels import bi_col_sum_kernel
    from transformer_engine.jax.primitives import gpu

    rows, hidden = dy.shape
    if rows == 0:
        return jnp.zeros((hidden,), spec.out_dtype), jnp.zeros((hidden,), spec.out_dtype)
    prog = program([jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (dy, x, mean, rstd)])
    dw = prog.result((hidden,), spec.out_dtype)
    db = prog.result((hidden,), spec.out_dtype)
    tiles = col_sum_tiles(hidden, device_type)
    args = dict(DY=Slot("dy"), X=Slot("x"), Mean=Slot("mean"), Rstd=Slot("rstd"), DW=Slot("dw"), DB=Slot("db"),
                R=rows, H=hidden, stride_dy=hidden, stride_x=hidden, HAS_X=spec.has_x, BLOCK_R=tiles.BLOCK_R,
                BLOCK_H=tiles.BLOCK_H)
    launch = Launch(bi_col_sum_kernel, (_cdiv(hidden, tiles.BLOCK_H), 1, 1), args, dict(num_warps=tiles.num_warps))
    prog.add_launches([launch], dict(dy=gpu.Buf(0), x=gpu.Buf(1), mean=gpu.Buf(2), rstd=gpu.Buf(3), dw=gpu.Buf(dw),
                                     db=gpu.Buf(db)))
    return tuple(prog.call(dy, x, mean, rstd))


def _act_launch(kernel, rows: int, f: int, scalars, spec: ActivationArgs, device_type: str) -> Launch:
    tiles = activation_tiles(f, device_type)
    args = dict(scalars, alpha=spec.alpha, limit=spec.limit, offset=spec.offset, FN=spec.FN, GATED=spec.GATED,
                CLAMPED=spec.CLAMPED, BLOCK_R=tiles.BLOCK_R, BLOCK_F=tiles.BLOCK_H)
    return Launch(kernel, (_cdiv(rows, tiles.BLOCK_R), _cdiv(f, tiles.BLOCK_H), 1), args,
                  dict(num_warps=tiles.num_warps))


def _act_fwd_impl(x, *, spec: ActivationArgs, program, device_type: str):
    from transformer_engine.common.batch_invariant.kernels import bi_act_fwd_kernel
    from transformer_engine.jax.primitives import gpu

    rows, width = x.shape
    f = width // 2 if spec.GATED else width
    if rows == 0 or f == 0:
        return (jnp.zeros((rows, f), x.dtype),)
    prog = program([jax.ShapeDtypeStruct(x.shape, x.dtype)])
    y = prog.result((rows, f), x.dtype)
    scalars = dict(X=Slot("x"), Y=Slot("y"), R=rows, F=f, stride_x=width, stride_y=f)
    prog.add_launches([_act_launch(bi_act_fwd_kernel, rows, f, scalars, spec, device_type)],
                      dict(x=gpu.Buf(0), y=gpu.Buf(y)))
    return tuple(prog.call(x))


def _act_bwd_impl(x, dy, *, spec: ActivationArgs, program, device_type: str):
    from transformer_engine.common.batch_invariant.kernels import bi_act_bwd_kernel
    from transformer_engine.jax.primitives import gpu

    rows, width = x.shape
    f = dy.shape[1]
    if rows == 0 or f == 0:
        return (jnp.zeros_like(x),)
    prog = program([jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (x, dy)])
    dx = prog.result(x.shape, x.dtype)
    scalars = dict(X=Slot("x"), DY=Slot("dy"), DX=Slot("dx"), R=rows, F=f, stride_x=width, stride_dy=f,
                   stride_dx=width)
    prog.add_launches([_act_launch(bi_act_bwd_kernel, rows, f, scalars, spec, device_type)],
                      dict(x=gpu.Buf(0), dy=gpu.Buf(1), dx=gpu.Buf(dx)))
    return tuple(prog.call(x, dy))


# ------------------------------------------------------------------------------------------------
# Primitives
# ------------------------------------------------------------------------------------------------


def unavailable_reason(platform: str) -> Optional[str]:
    """Why the batch-invariant kernels cannot run on ``platform`` ('cpu', 'cuda', ...), or None when they can."""
    from transformer_engine.jax.primitives import gpu, interpret

    if platform == "cpu":
        if not interpret.interpreting():
            return ("on CPU they run under Triton's interpreter only: set NVTE_JAX_TRITON_INTERPRET=1 and "
                    "TRITON_INTERPRET=1")
        return interpret.unavailable_reason()
    if platform == "cuda":
        return gpu.unavailable_reason()
    return f"they launch through the CUDA FFI path or Triton's interpreter on CPU, not on {platform}"


def _check(platform: str) -> None:
    reason = unavailable_reason(platform)
    if reason:
        raise NotImplementedError(
            f"batch-invariant mode on {platform}: {reason}; leave transformer_engine.jax.batch_invariant() (or "
            "unset NVTE_BATCH_INVARIANT) to run XLA's own dots and reductions")


def _lowerings(impl):
    def cpu(ctx, *args, spec):
        from transformer_engine.jax.primitives import interpret

        _check("cpu")
        fn = functools.partial(impl, spec=spec, program=interpret.InterpretedProgram, device_type="cpu")
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    def cuda(ctx, *args, spec):
        from transformer_engine.jax.primitives import gpu

        _check("cuda")
        fn = functools.partial(impl, spec=spec, program=gpu.Program, device_type="cuda")
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    def other(ctx, *args, spec):
        _check("rocm")

    return cpu, cuda, other


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, spec):
    return jax.jit(functools.partial(prim.bind, spec=spec))


def _make(name, abstract, impl):
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(abstract)
    prim.def_impl(lambda *args, spec: _jitted_bind(prim, spec)(*args))
    cpu, cuda, other = _lowerings(impl)
    mlir.register_lowering(prim, cpu, platform="cpu")
    mlir.register_lowering(prim, cuda, platform="cuda")
    mlir.register_lowering(prim, other, platform="rocm")
    return prim


def _gemm_abstract(a, b, *, spec):
    m, n, _ = _gemm_dims(a.shape, b.shape, spec)
    return (jax.core.ShapedArray((m, n), jnp.dtype(spec.out_dtype)),)


def _norm_fwd_abstract(x, w, bias, *, spec):
    rows = x.shape[0]
    return (jax.core.ShapedArray(x.shape, x.dtype), jax.core.ShapedArray((rows,), jnp.float32),
            jax.core.ShapedArray((rows,), jnp.float32))


def _norm_bwd_abstract(x, w, dy, mean, rstd, *, spec):
    return (jax.core.ShapedArray(x.shape, x.dtype),)


def _col_sums_abstract(dy, x, mean, rstd, *, spec):
    shape = (dy.shape[1],)
    return (jax.core.ShapedArray(shape, jnp.dtype(spec.out_dtype)),
            jax.core.ShapedArray(shape, jnp.dtype(spec.out_dtype)))


def _act_fwd_abstract(x, *, spec):
    rows, width = x.shape
    return (jax.core.ShapedArray((rows, width // 2 if spec.GATED else width), x.dtype),)


def _act_bwd_abstract(x, dy, *, spec):
    return (jax.core.ShapedArray(x.shape, x.dtype),)


_gemm_p = _make("te_batch_invariant_gemm", _gemm_abstract, _gemm_impl)
_norm_fwd_p = _make("te_batch_invariant_norm_fwd", _norm_fwd_abstract, _norm_fwd_impl)
_norm_bwd_p = _make("te_batch_invariant_norm_bwd", _norm_bwd_abstract, _norm_bwd_impl)
_col_sums_p = _make("te_batch_invariant_col_sums", _col_sums_abstract, _col_sums_impl)
_act_fwd_p = _make("te_batch_invariant_act_fwd", _act_fwd_abstract, _act_fwd_impl)
_act_bwd_p = _make("te_batch_invariant_act_bwd", _act_bwd_abstract, _act_bwd_impl)


def gemm(a: jax.Array, b: jax.Array, out_dtype, a_t: bool = False, b_t: bool = False) -> jax.Array:
    """``A @ B`` in ``out_dtype`` (float32 accumulation): ``A`` is ``a`` (``[M, K]``) or, with ``a_t``, ``a``'s
    transpose (``a``: ``[K, M]``); ``B`` is ``b`` (``[K, N]``) or, with ``b_t``, ``b``'s transpose."""
    if a.dtype != b.dtype:
        raise ValueError(f"GEMM operands must share a dtype, got {a.dtype} and {b.dtype}")
    return _gemm_p.bind(a, b, spec=_GemmSpec(bool(a_t), bool(b_t), jnp.dtype(out_dtype).name))[0]


def norm_fwd(x, w, bias, eps: float, is_rms: bool, zero_centered: bool):
    """``(y, mean, rstd)`` of ``x`` ``[R, H]``; ``bias`` None for none (RMSNorm)."""
    spec = _NormSpec(bool(is_rms), bool(zero_centered), bias is not None, float(eps))
    return tuple(_norm_fwd_p.bind(x, w, w if bias is None else bias, spec=spec))


def norm_bwd(x, w, dy, mean, rstd, is_rms: bool, zero_centered: bool):
    """The input gradient of :func:`norm_fwd`."""
    spec = _NormSpec(bool(is_rms), bool(zero_centered), False, 0.0)
    return _norm_bwd_p.bind(x, w, dy, mean, rstd, spec=spec)[0]


def col_sums(dy, out_dtype, x=None, mean=None, rstd=None):
    """``(sum_r dy * xhat, sum_r dy)`` over the rows of ``dy`` ``[R, H]`` (the first only with ``x``, ``mean``,
    ``rstd``: a norm's weight gradient; else it is not computed and its value is undefined)."""
    has_x = x is not None
    if not has_x:
        x, mean, rstd = dy, jnp.zeros((dy.shape[0],), jnp.float32), jnp.zeros((dy.shape[0],), jnp.float32)
    return tuple(_col_sums_p.bind(dy, x, mean, rstd, spec=_ColSumSpec(has_x, jnp.dtype(out_dtype).name)))


def act_fwd(x, args: ActivationArgs):
    """An activation of FC1's output ``x`` ``[R, width]`` (``plan.activation_args``): ``[R, F]``."""
    return _act_fwd_p.bind(x, spec=args)[0]


def act_bwd(x, dy, args: ActivationArgs):
    """The input gradient of :func:`act_fwd`."""
    return _act_bwd_p.bind(x, dy, spec=args)[0]
