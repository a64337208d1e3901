"""The GEMMs of GroupedLinear: ``y_i = x_i W_i^T (+ b_i)`` for consecutive row blocks ``x_i`` of one input.

Two paths, both deterministic (no split-K atomics; each expert's weight gradient is its own GEMM over its own
rows, and bias gradients are per-expert row sums):

- torch's grouped GEMM (``torch._grouped_mm``) on CUDA for bfloat16 / float16 activations, where this torch has
  it for the dtype and device (a feature test on first use: it must run and agree with per-expert GEMMs on
  uneven and empty groups) and the row strides meet its 16-byte alignment. The weights are stacked into one
  [G, N, K] tensor, cached until a weight changes (the optimizer step bumps its version).
- otherwise one GEMM per expert through Linear's own path (``module.linear.parallel_linear``): the FP8 GEMMs
  under each recipe Linear supports (each expert with its own quantization state), Megatron's
  ``main_grad`` accumulation, and in batch-invariant mode the batch-invariant GEMM, so that an expert's output
  rows do not depend on how many tokens that expert (or any other) got.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from transformer_engine.pytorch.batch_invariance import check_no_fp8, is_batch_invariant
from transformer_engine.pytorch.quantization_linear import accumulate_into_main_grad

__all__ = ["grouped_linear", "grouped_mm_supported"]

# Tests set this to True to run the grouped-GEMM path where torch has it on the CPU, or False to force the
# per-expert path; None: the rule in the module docstring.
FORCE_GROUPED_MM: Optional[bool] = None

_FEATURE: dict = {}


def _feature_test(device: torch.device, dtype: torch.dtype) -> Tuple[bool, bool]:
    """(grouped GEMM usable, its weight-gradient form takes out_dtype=float32) for this device and dtype."""
    key = (str(device), dtype)
    if key in _FEATURE:
        return _FEATURE[key]
    ok = fp32_out = False
    if hasattr(torch, "_grouped_mm"):
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(10, 16, generator=g).to(device=device, dtype=dtype)
            w = torch.randn(3, 8, 16, generator=g).to(device=device, dtype=dtype)
            dy = torch.randn(10, 8, generator=g).to(device=device, dtype=dtype)
            splits = [3, 0, 7]
            offs = torch.tensor([3, 3, 10], dtype=torch.int32, device=device)
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            dx = torch._grouped_mm(dy, w, offs=offs)
            dw = torch._grouped_mm(dy.t(), x, offs=offs)
            ref_y = torch.cat([xi @ wi.t() for xi, wi in zip(x.split(splits), w)])
            ref_dx = torch.cat([di @ wi for di, wi in zip(dy.split(splits), w)])
            tol = dict(rtol=2e-2, atol=2e-2)
            ok = (torch.allclose(y.float(), ref_y.float(), **tol) and torch.allclose(dx.float(), ref_dx.float(), **tol)
                  and torch.allclose(dw[2].float(), (dy[3:].t() @ x[3:]).float(), **tol))
            try:
                torch._grouped_mm(dy.t(), x, offs=offs, out_dtype=torch.float32)
                fp32_out = True
            except (RuntimeError, TypeError):
                fp32_out = False
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
    _FEATURE[key] = (ok, fp32_out)
    return ok, fp32_out


def grouped_mm_supported(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether ``x`` (2-D activations) and ``weights`` take the grouped-GEMM path (module docstring)."""
    if FORCE_GROUPED_MM is not None:
        return FORCE_GROUPED_MM and _feature_test(x.device, x.dtype)[0]
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    size = x.element_size()
    n, k = weights[0].shape
    if (k * size) % 16 or (n * size) % 16:
        return False
    return _feature_test(x.device, x.dtype)[0]


class WeightStack:
    """The experts' weights as one [G, N, K] tensor in a dtype, made again when a weight changes."""

    def __init__(self) -> None:
        self._key = None
        self._value: Optional[torch.Tensor] = None

    def get(self, weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        key = (dtype,) + tuple((w.data_ptr(), w._version, w.device) for w in weights)
        if key != self._key:
            with torch.no_grad():
                self._value = torch.stack([w.detach().to(dtype) for w in weights])
            self._key = key
        return self._value


def _offsets(m_splits: Sequence[int], device: torch.device) -> torch.Tensor:
    ends, total = [], 0
    for m in m_splits:
        total += m
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


class _GroupedMM(torch.autograd.Function):
    """``x_i W_i^T + b_i`` for all experts in one grouped GEMM (forward, dgrad, wgrad)."""

    @staticmethod
    def forward(ctx, x, stacked, m_splits, fuse_wgrad, overwrite, num_gemms, *params):
        weights, biases = params[:num_gemms], params[num_gemms:]
        offs = _offsets(m_splits, x.device)
        out = torch._grouped_mm(x, stacked.transpose(1, 2), offs=offs)
        if biases:
            for y, b in zip(out.split(list(m_splits)), biases):
                if y.shape[0]:
                    y.add_(b.to(y.dtype))
        ctx.save_for_backward(x, stacked, offs)
        ctx.m_splits, ctx.fuse_wgrad, ctx.overwrite = list(m_splits), fuse_wgrad, overwrite
        ctx.weights, ctx.has_bias = weights, bool(biases)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, stacked, offs = ctx.saved_tensors
        weights, splits, n = ctx.weights, ctx.m_splits, len(ctx.weights)
        ctx.weights = None
        dy = grad_out.contiguous()
        grad_x = torch._grouped_mm(dy, stacked, offs=offs) if ctx.needs_input_grad[0] else None
        grad_w: List[Optional[torch.Tensor]] = [None] * n
        if any(ctx.needs_input_grad[6:6 + n]):
            main_grad = getattr(weights[0], "main_grad", None) if ctx.fuse_wgrad else None
            want = main_grad.dtype if main_grad is not None else weights[0].dtype
            fp32_out = _feature_test(x.device, x.dtype)[1]
            if want == torch.float32 and x.dtype != torch.float32 and fp32_out:
                wg = torch._grouped_mm(dy.t(), x, offs=offs, out_dtype=torch.float32)
            else:
                wg = torch._grouped_mm(dy.t(), x, offs=offs)
            for i, m in enumerate(splits):
                g = wg[i] if m else torch.zeros_like(wg[i])  # an expert without tokens: a zero gradient
                if not ctx.needs_input_grad[6 + i]:
                    continue
                if ctx.fuse_wgrad:
                    grad_w[i] = accumulate_into_main_grad(weights[i], g, ctx.overwrite)
                else:
                    grad_w[i] = g.to(weights[i].dtype)
        grad_b: List[Optional[torch.Tensor]] = []
        if ctx.has_bias:
            for i, dyi in enumerate(dy.split(splits)):
                # Per expert, a float32 column sum over its rows (a fixed-order reduction, no scatter).
                grad_b.append(dyi.float().sum(dim=0).to(weights[i].dtype) if ctx.needs_input_grad[6 + n + i]
                              else None)
        return (grad_x, None, None, None, None, None, *grad_w, *grad_b)


def grouped_linear(x: torch.Tensor, m_splits: Sequence[int], weights: Sequence[torch.Tensor],
                   biases: Optional[Sequence[torch.Tensor]], *, fuse_wgrad_accumulation: bool = False,
                   is_first_microbatch: Optional[bool] = None, fp8_plans: Optional[Sequence[Any]] = None,
                   stack: Optional[WeightStack] = None, owner: str = "GroupedLinear") -> torch.Tensor:
    """``cat_i(x_i W_i^T + b_i)`` with ``x_i`` the ``m_splits[i]`` rows of ``x`` (2-D) after the previous ones.

    ``fp8_plans``: one plan per GEMM (module ``_fp8_plan``), or None outside FP8 and calibration. ``biases``:
    None, or one per GEMM, added to that expert's rows.
    """
    from transformer_engine.pytorch.module.linear import parallel_linear

    fp8 = fp8_plans is not None and any(p is not None and p.enabled for p in fp8_plans)
    if fp8 and is_batch_invariant():
        check_no_fp8(owner, next(p for p in fp8_plans if p is not None and p.enabled))
    if not fp8 and not is_batch_invariant() and grouped_mm_supported(x, weights):
        if fp8_plans is not None:  # calibration: record what delayed scaling would record
            for plan, xi, w in zip(fp8_plans, x.split(list(m_splits)), weights):
                if plan is not None and xi.shape[0]:
                    plan.calibrate(xi, w)
        fuse = fuse_wgrad_accumulation and torch.is_grad_enabled() and weights[0].requires_grad
        stacked = (stack or WeightStack()).get(weights, x.dtype)
        params = list(weights) + (list(biases) if biases is not None else [])
        return _GroupedMM.apply(x, stacked, tuple(m_splits), fuse, bool(is_first_microbatch), len(weights), *params)
    outs = []
    for i, xi in enumerate(x.split(list(m_splits))):
        # An expert without tokens still runs its (empty) GEMM: under delayed scaling it records its weight's
        # amax, as a Linear per expert does, and its weight gradient is a zero, not None.
        plan = fp8_plans[i] if fp8_plans is not None else None
        out, _ = parallel_linear(xi, weights[i], None if biases is None else biases[i], None, None, False, False,
                                 fuse_wgrad_accumulation, is_first_microbatch, plan)
        outs.append(out)
    return torch.cat(outs)
