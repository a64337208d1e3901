"""Batch-invariant mode for the PyTorch modules: GEMMs and norms whose rows do not depend on the batch.

With ``NVTE_BATCH_INVARIANT=1`` (read at each call), or inside ``with batch_invariant():``, the GEMMs of
``Linear``, ``LayerNormLinear`` and ``LayerNormMLP`` (forward, dgrad and wgrad) and the norms of ``LayerNorm``,
``RMSNorm`` and the fused norm modules run on the Triton kernels of
``transformer_engine.common.batch_invariant``: a row of an output or of an input gradient gets the same bits
whether it is computed alone, in a batch of 7 or in a batch of 1024, padded or packed. ``LayerNormMLP``'s
activation runs on the shared elementwise kernel too, and the norms' parameter gradients on a fixed-order column
sum: JAX's mode (``transformer_engine.jax.batch_invariance``) launches the same kernels, so the two frameworks give
the same bits. cuBLAS and the
framework's norms choose their algorithm, tiling and split-K by the row count, so by default a sequence's
logits depend on what else is in the batch. Weight gradients sum over the rows and so depend on the batch by
definition; they are deterministic (a fixed order for a given shape).

The kernels run on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``); elsewhere the
mode raises rather than run a GEMM that is not batch-invariant. FP8: Float8BlockScaling keeps a row's FP8
values its own (a scale per 1x128 tile of a row), and its GEMMs run here on the batch-invariant kernel over
the exactly dequantized operands; delayed and current scaling are refused (their per-tensor scales come from
the whole batch's amax).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton

from transformer_engine.common.batch_invariant.mode import batch_invariant, is_batch_invariant
from transformer_engine.common.batch_invariant.plan import (activation_args, activation_tiles, col_sum_tiles,
                                                            gemm_tiles, norm_tiles)
from transformer_engine.pytorch.main_grad import accumulate_into_main_grad

__all__ = ["batch_invariant", "is_batch_invariant", "bi_linear", "bi_matmul", "bi_norm", "bi_activation",
           "bias_add", "row_exp_sums"]

def _check_device(t: torch.Tensor, what: str) -> None:
    from transformer_engine.pytorch.attention.config import triton_interpreting

    if t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreting()):
        return
    raise NotImplementedError(
        f"batch-invariant mode: {what} on device {t.device} needs CUDA, or the CPU under Triton's interpreter "
        "(TRITON_INTERPRET=1); unset NVTE_BATCH_INVARIANT (or leave the batch_invariant() context) to run it "
        "on the framework's own kernels")


def _gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (2-D, any strides) on the batch-invariant kernel, float32 accumulation."""
    from transformer_engine.common.batch_invariant.kernels import bi_gemm_kernel

    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    tiles = gemm_tiles(n, k, str(a.dtype).replace("torch.", ""), a.device.type)
    grid = (triton.cdiv(m, tiles.BLOCK_M), triton.cdiv(n, tiles.BLOCK_N))
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        bi_gemm_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                             c.stride(1), BLOCK_M=tiles.BLOCK_M, BLOCK_N=tiles.BLOCK_N, BLOCK_K=tiles.BLOCK_K,
                             num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return c


def _col_sums(dy: torch.Tensor, out_dtype: torch.dtype, x2d: Optional[torch.Tensor] = None,
              mean: Optional[torch.Tensor] = None, rstd: Optional[torch.Tensor] = None):
    """``(sum_r dy * xhat, sum_r dy)`` over the rows of ``dy`` (2-D, contiguous rows) on the fixed-order
    column-sum kernel; the first only with ``x2d``, ``mean``, ``rstd`` (else None)."""
    from transformer_engine.common.batch_invariant.kernels import bi_col_sum_kernel

    rows, hidden = dy.shape
    has_x = x2d is not None
    dw = torch.empty(hidden, device=dy.device, dtype=out_dtype) if has_x else None
    db = torch.empty(hidden, device=dy.device, dtype=out_dtype)
    if rows == 0 or hidden == 0:
        return (dw.zero_() if has_x else None), db.zero_()
    tiles = col_sum_tiles(hidden, dy.device.type)
    with torch.cuda.device(dy.device) if dy.device.type == "cuda" else contextlib.nullcontext():
        bi_col_sum_kernel[(triton.cdiv(hidden, tiles.BLOCK_H),)](
            dy, x2d if has_x else dy, mean if has_x else db, rstd if has_x else db, dw if has_x else db, db, rows,
            hidden, dy.stride(0), x2d.stride(0) if has_x else dy.stride(0), HAS_X=has_x, BLOCK_R=tiles.BLOCK_R,
            BLOCK_H=tiles.BLOCK_H, num_warps=tiles.num_warps)
    return dw, db


def row_exp_sums(x2d: torch.Tensor, shift: torch.Tensor, with_sum: bool = False):
    """``(sum_h exp(x - shift), sum_h x)`` of each row of the float32 ``x2d`` (the second only with
    ``with_sum``, else None), each row reduced alone in a fixed order: a cross entropy's normalizer that
    does not depend on how many rows there are (torch's row reductions pick their strategy by shape)."""
    from transformer_engine.common.batch_invariant.kernels import bi_row_exp_sum_kernel

    _check_device(x2d, "a row reduction")
    if x2d.dtype != torch.float32 or x2d.dim() != 2 or x2d.stride(1) != 1:
        raise ValueError(f"`x2d` must be a row-contiguous 2-D float32 tensor, got {x2d.dtype} "
                         f"{tuple(x2d.shape)} with strides {x2d.stride()}")
    rows, hidden = x2d.shape
    exp_sum = torch.zeros(rows, device=x2d.device, dtype=torch.float32)
    row_sum = torch.zeros(rows, device=x2d.device, dtype=torch.float32) if with_sum else None
    if rows == 0 or hidden == 0:
        return exp_sum, row_sum
    tiles = norm_tiles(hidden, x2d.device.type)
    with torch.cuda.device(x2d.device) if x2d.device.type == "cuda" else contextlib.nullcontext():
        bi_row_exp_sum_kernel[(triton.cdiv(rows, tiles.BLOCK_R),)](
            x2d, shift.contiguous(), exp_sum, row_sum if with_sum else exp_sum, rows, hidden, x2d.stride(0),
            WITH_SUM=with_sum, BLOCK_R=tiles.BLOCK_R, BLOCK_H=tiles.BLOCK_H, num_warps=tiles.num_warps)
    return exp_sum, row_sum


class _BatchInvariantLinear(torch.autograd.Function):
    """``x W^T`` with its forward, dgrad and wgrad on the batch-invariant GEMM."""

    @staticmethod
    def forward(ctx, x2d, weight, main_grad_overwrite):
        w = weight if weight.dtype == x2d.dtype else weight.to(x2d.dtype)
        ctx.save_for_backward(x2d, weight)
        ctx.main_grad_overwrite = main_grad_overwrite
        return _gemm(x2d, w.t(), x2d.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w = weight if weight.dtype == grad_out.dtype else weight.to(grad_out.dtype)
            grad_x = _gemm(grad_out, w, grad_out.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.main_grad_overwrite is not None:  # Megatron's wgrad fusion into main_grad
                main_grad = getattr(weight, "main_grad", None)
                dtype = main_grad.dtype if main_grad is not None else torch.float32
                wgrad = _gemm(grad_out.t().to(dtype), x2d.to(dtype), dtype)
                grad_w = accumulate_into_main_grad(weight, wgrad, ctx.main_grad_overwrite)
            else:
                grad_w = _gemm(grad_out.t(), x2d, weight.dtype)
        return grad_x, grad_w, None


def bi_linear(x: torch.Tensor, weight: torch.Tensor, main_grad_overwrite: Optional[bool] = None) -> torch.Tensor:
    """``x W^T`` over the last dim of ``x``, batch-invariant. ``main_grad_overwrite`` (None: off) accumulates
    (False) or writes (True) the weight gradient into ``weight.main_grad`` as ``fuse_wgrad_accumulation`` does."""
    _check_device(x, "a GEMM")
    lead = x.shape[:-1]
    out = _BatchInvariantLinear.apply(x.reshape(-1, x.shape[-1]), weight, main_grad_overwrite)
    return out.reshape(*lead, weight.shape[0])


class _BatchInvariantNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, eps, is_rms, zero_centered):
        from transformer_engine.common.batch_invariant.kernels import bi_norm_fwd_kernel

        rows, hidden = x2d.shape
        tiles = norm_tiles(hidden, x2d.device.type)
        y = torch.empty_like(x2d)
        mean = torch.empty(rows, device=x2d.device, dtype=torch.float32)
        rstd = torch.empty(rows, device=x2d.device, dtype=torch.float32)
        if rows:
            with torch.cuda.device(x2d.device) if x2d.device.type == "cuda" else contextlib.nullcontext():
                bi_norm_fwd_kernel[(triton.cdiv(rows, tiles.BLOCK_R),)](
                    x2d, weight, bias if bias is not None else weight, y, mean, rstd, rows, hidden, x2d.stride(0),
                    y.stride(0), eps, IS_RMS=is_rms, HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered,
                    BLOCK_R=tiles.BLOCK_R, BLOCK_H=tiles.BLOCK_H, num_warps=tiles.num_warps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.flags = (is_rms, zero_centered, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        from transformer_engine.common.batch_invariant.kernels import bi_norm_bwd_kernel

        x2d, weight, mean, rstd = ctx.saved_tensors
        is_rms, zero_centered, has_bias = ctx.flags
        dy = dy.contiguous()
        rows, hidden = x2d.shape
        dx = torch.empty_like(x2d)
        if rows:
            tiles = norm_tiles(hidden, x2d.device.type)
            with torch.cuda.device(x2d.device) if x2d.device.type == "cuda" else contextlib.nullcontext():
                bi_norm_bwd_kernel[(triton.cdiv(rows, tiles.BLOCK_R),)](
                    x2d, weight, dy, dx, mean, rstd, rows, hidden, x2d.stride(0), dy.stride(0), dx.stride(0),
                    IS_RMS=is_rms, ZERO_CENTERED=zero_centered, BLOCK_R=tiles.BLOCK_R, BLOCK_H=tiles.BLOCK_H,
                    num_warps=tiles.num_warps)
        # Parameter gradients sum over the rows (they depend on the batch by definition): the fixed-order column
        # sums of the shared kernel, so that JAX's mode (the same kernel) gets the same bits.
        grad_w, grad_b = _col_sums(dy, weight.dtype, x2d, mean, rstd)
        grad_w = grad_w if ctx.needs_input_grad[1] else None
        grad_b = grad_b if has_bias and ctx.needs_input_grad[2] else None
        return dx, grad_w, grad_b, None, None, None


def bi_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, normalization: str,
            zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm / RMSNorm over the last dim of ``x``, batch-invariant (float32 inside, ``x``'s dtype out)."""
    _check_device(x, "a norm")
    shape = x.shape
    x2d = x.reshape(-1, shape[-1]).contiguous()
    y = _BatchInvariantNorm.apply(x2d, weight.contiguous(), None if bias is None else bias.contiguous(), float(eps),
                                  normalization == "RMSNorm", bool(zero_centered_gamma))
    return y.reshape(shape)


class _BatchInvariantActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, args):
        from transformer_engine.common.batch_invariant.kernels import bi_act_fwd_kernel

        rows, width = x2d.shape
        f = width // 2 if args.GATED else width
        y = torch.empty((rows, f), device=x2d.device, dtype=x2d.dtype)
        if rows and f:
            tiles = activation_tiles(f, x2d.device.type)
            with torch.cuda.device(x2d.device) if x2d.device.type == "cuda" else contextlib.nullcontext():
                bi_act_fwd_kernel[(triton.cdiv(rows, tiles.BLOCK_R), triton.cdiv(f, tiles.BLOCK_H))](
                    x2d, y, rows, f, x2d.stride(0), y.stride(0), args.alpha, args.limit, args.offset, FN=args.FN,
                    GATED=args.GATED, CLAMPED=args.CLAMPED, BLOCK_R=tiles.BLOCK_R, BLOCK_F=tiles.BLOCK_H,
                    num_warps=tiles.num_warps)
        ctx.save_for_backward(x2d)
        ctx.args = args
        return y

    @staticmethod
    def backward(ctx, dy):
        from transformer_engine.common.batch_invariant.kernels import bi_act_bwd_kernel

        (x2d,) = ctx.saved_tensors
        args = ctx.args
        dy = dy.contiguous()
        rows, f = dy.shape
        dx = torch.empty_like(x2d)
        if rows and f:
            tiles = activation_tiles(f, x2d.device.type)
            with torch.cuda.device(x2d.device) if x2d.device.type == "cuda" else contextlib.nullcontext():
                bi_act_bwd_kernel[(triton.cdiv(rows, tiles.BLOCK_R), triton.cdiv(f, tiles.BLOCK_H))](
                    x2d, dy, dx, rows, f, x2d.stride(0), dy.stride(0), dx.stride(0), args.alpha, args.limit,
                    args.offset, FN=args.FN, GATED=args.GATED, CLAMPED=args.CLAMPED, BLOCK_R=tiles.BLOCK_R,
                    BLOCK_F=tiles.BLOCK_H, num_warps=tiles.num_warps)
        return dx, None


def bi_activation(fc1_out: torch.Tensor, name: str, params: Optional[dict]) -> torch.Tensor:
    """``LayerNormMLP``'s activation ``name`` of FC1's output (last dim) on the shared elementwise kernel, float32
    inside, FC1's dtype out: the same bits as JAX's mode (torch's and XLA's tanh / exp round differently)."""
    _check_device(fc1_out, "an activation")
    shape = fc1_out.shape
    args = activation_args(name, params)
    y = _BatchInvariantActivation.apply(fc1_out.reshape(-1, shape[-1]).contiguous(), args)
    return y.reshape(*shape[:-1], y.shape[-1])


class _BatchInvariantBiasAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.bias_shape = bias.shape
        return x + bias

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[-1]
        grad_bias = _col_sums(grad.reshape(-1, n).contiguous(), grad.dtype)[1] if ctx.needs_input_grad[1] else None
        return grad, None if grad_bias is None else grad_bias.reshape(ctx.bias_shape)


def bias_add(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias`` (a bias over the last dim, in ``x``'s dtype). In batch-invariant mode the bias's gradient is the
    fixed-order column sum JAX's mode computes too (autograd's own sum over the rows would differ from XLA's)."""
    if not is_batch_invariant() or bias.dim() != 1 or bias.dtype != x.dtype:
        return x + bias
    _check_device(x, "a bias addition")
    return _BatchInvariantBiasAdd.apply(x, bias)


def check_no_fp8(owner: str, plan=None) -> None:
    """Batch-invariant mode runs FP8 GEMMs only under a recipe whose scales are a row's own (``plan``'s
    quantizers ``row_invariant``: Float8BlockScaling's 1x128 tiles); per-tensor scales are the whole batch's
    amax, so they are refused."""
    quantizers = getattr(plan, "quantizers", None)
    if quantizers is not None and quantizers.row_invariant:
        return
    name = type(plan.recipe).__name__ if plan is not None else "this recipe"
    raise NotImplementedError(
        f"{owner}: FP8 GEMMs under {name} in batch-invariant mode are not implemented (delayed and current "
        "scaling take their scales from the whole batch's amax, so a row's FP8 value depends on the batch); "
        "Float8BlockScaling keeps rows invariant (a scale per 1x128 tile of a row), or leave the FP8 autocast "
        "or the batch-invariant mode")


def bi_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (2-D) on the batch-invariant GEMM kernel (FP8 block scaling's dequantized operands)."""
    _check_device(a, "a GEMM")
    return _gemm(a, b, out_dtype)
