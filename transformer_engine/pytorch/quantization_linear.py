"""FP8 GEMMs of Linear and LayerNormLinear: the per-module state, the per-call plan, the autograd Function.

Forward ``y = x W^T`` (fprop), backward ``dx = dy W`` (dgrad) and ``dW = dy^T x`` (wgrad) all run on
quantized operands, as TransformerEngine's modules run them. The recipe is read once, as its quantizer
specs (``common.quantizer_roles.quantizers_for``: a spec per role, input, weight and grad_output, and
each GEMM's accumulation); the plan holds one ``pytorch.quantization.Quantizer`` per role and never
looks at the recipe's type:

- a stateful (delayed-scaling) spec: one scale per tensor from the module's amax history (forward:
  input, weight, output; backward: grad output, grad input). Each quantization uses the scale current
  at that moment (computed by the last update) and folds its amax into history row 0; the updates
  happen when the outermost autocast exits (forward) and at the end of the backward of the first FP8
  module (backward);
- current scaling: one scale per tensor from its own amax, no state;
- block scaling: 1x128 tiles along the contraction for activations and gradients (quantized a second
  time, from high precision, along the token dim for wgrad), 128x128 tiles for weights (whose
  transpose is exact, so dgrad reuses them).

Per-tensor operands are transposed for the backward GEMMs (same values, same scale). The weight is
quantized once per step when the caller passes ``is_first_microbatch=True`` and reused while it passes
False. With ``fuse_wgrad_accumulation`` the wgrad GEMM produces float32 and is added to ``main_grad``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from transformer_engine.common import quantizer_roles as roles
from transformer_engine.common import recipe as _recipe
from transformer_engine.pytorch.main_grad import accumulate_into_main_grad
from transformer_engine.pytorch.quantization import DelayedScalingMeta, Quantized, Quantizer, scaled_gemm

# Columns of the delayed-scaling metas, in TransformerEngine's order.
FWD_INPUT, FWD_WEIGHT, FWD_OUTPUT = 0, 1, 2
BWD_GRAD_OUTPUT, BWD_GRAD_INPUT = 0, 1


class LinearFP8State:
    """What a linear module keeps across steps: its delayed-scaling metas and its cached FP8 weight."""

    def __init__(self) -> None:
        self.fwd_meta: Optional[DelayedScalingMeta] = None
        self.bwd_meta: Optional[DelayedScalingMeta] = None
        self._weight_cache: Optional[Tuple[Any, Quantized]] = None
        self.last_enabled = False  # whether the module's last forward ran in FP8

    def _delayed_metas(self, recipe: _recipe.DelayedScaling, device: torch.device):
        if self.fwd_meta is None:
            self.fwd_meta = DelayedScalingMeta(3, recipe, True, device)
            self.bwd_meta = DelayedScalingMeta(2, recipe, False, device)
        else:
            if self.fwd_meta.scale.device != device:
                # The module moved (or its state was loaded from a checkpoint before the move): the
                # state moves with it rather than starting afresh.
                for meta in (self.fwd_meta, self.bwd_meta):
                    meta.scale, meta.amax_history = meta.scale.to(device), meta.amax_history.to(device)
            self.fwd_meta.set_recipe(recipe)
            self.bwd_meta.set_recipe(recipe)
        return self.fwd_meta, self.bwd_meta

    def plan(self, recipe: _recipe.Recipe, group: Optional[Any], device: torch.device, enabled: bool) -> "LinearFP8Plan":
        """This call's plan; registers delayed-scaling metas for their updates when FP8 is enabled."""
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        quantizers = roles.quantizers_for(recipe)
        fwd_meta = bwd_meta = None
        if quantizers.stateful:
            fwd_meta, bwd_meta = self._delayed_metas(recipe, device)
            if enabled:
                fwd_meta.group = bwd_meta.group = group
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(fwd_meta, True)
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(bwd_meta, False)
        return LinearFP8Plan(recipe, fwd_meta, bwd_meta, self, quantizers)

    def quantized_weight(self, plan: "LinearFP8Plan", weight: torch.Tensor,
                         is_first_microbatch: Optional[bool]) -> Quantized:
        """The weight's FP8 operand: cached on is_first_microbatch=True, reused while it is False."""
        key = (plan.quantizers.weight, weight.device, tuple(weight.shape))
        if is_first_microbatch is False and self._weight_cache is not None and self._weight_cache[0] == key:
            return self._weight_cache[1]
        with torch.no_grad():
            qw = plan.quantize_weight(weight.detach())
        self._weight_cache = (key, qw) if is_first_microbatch is not None else None
        return qw


class _FrozenScales:
    """A forward delayed-scaling meta as one forward read it: its scales, recording nothing."""

    def __init__(self, meta: Any) -> None:
        self.scale = meta.scale.clone()
        self.fmt = meta.fmt

    def record_amax(self, index: int, amax: torch.Tensor) -> None:
        pass


class LinearFP8Plan:
    """One call's quantization: the recipe's quantizer specs, a quantizer per role and (delayed scaling) the
    metas they read and record."""

    def __init__(self, recipe: _recipe.Recipe, fwd_meta: Optional[DelayedScalingMeta],
                 bwd_meta: Optional[DelayedScalingMeta], state: LinearFP8State,
                 quantizers: Optional[roles.RecipeQuantizers] = None) -> None:
        self.recipe = recipe
        self.quantizers = quantizers if quantizers is not None else roles.quantizers_for(recipe)
        self.fwd_fmt, self.bwd_fmt = self.quantizers.input.fmt, self.quantizers.grad_output.fmt
        self.fwd_meta, self.bwd_meta = fwd_meta, bwd_meta
        self.state = state
        self.input = Quantizer(self.quantizers.input, fwd_meta, FWD_INPUT)
        self.weight = Quantizer(self.quantizers.weight, fwd_meta, FWD_WEIGHT)
        self.grad_output = Quantizer(self.quantizers.grad_output, bwd_meta, BWD_GRAD_OUTPUT)

    def mm(self, gemm: str) -> bool:
        """use_split_accumulator of the fprop / dgrad / wgrad GEMM."""
        return self.quantizers.use_split_accumulator(gemm)

    # Each returns (operand along the GEMM's contraction, operand for the wgrad GEMM or None when it is
    # the transpose of the first).
    def quantize_input(self, x: torch.Tensor) -> Tuple[Quantized, Optional[Quantized]]:
        return self.input.quantize(x)

    def quantize_weight(self, w: torch.Tensor) -> Quantized:
        return self.weight.quantize(w)[0]

    def quantize_grad(self, dy: torch.Tensor) -> Tuple[Quantized, Optional[Quantized]]:
        return self.grad_output.quantize(dy)

    def frozen(self) -> "LinearFP8Plan":
        """This plan as activation recompute replays it: the forward scales current now, no amax recorded
        (the first forward recorded them); the backward's metas are the live ones."""
        fwd_meta = None if self.fwd_meta is None else _FrozenScales(self.fwd_meta)
        plan = LinearFP8Plan(self.recipe, fwd_meta, self.bwd_meta, self.state, self.quantizers)
        plan.enabled = getattr(self, "enabled", False)
        return plan

    def calibrate(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """Calibration (high-precision run): record the input and weight amaxes delayed scaling would record."""
        self.input.record(x)
        self.weight.record(weight)


def _saved(op: Optional[Quantized]):
    return (None, None) if op is None else (op.data, op.scale_inv)


def _restore(data, scale_inv, like: Optional[Quantized]) -> Optional[Quantized]:
    return None if like is None else Quantized(data, scale_inv, like.fmt, like.tile)


class _FP8Linear(torch.autograd.Function):
    """``x W^T`` with FP8 fprop, dgrad and wgrad GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, plan, qw, fuse_wgrad, overwrite_main_grad, reduce_bwd):
        in_features = weight.shape[1]
        x2d = x.reshape(-1, in_features)
        qx, qx_col = plan.quantize_input(x2d)
        out = scaled_gemm(qx, qw, x.dtype, plan.mm("fprop"))
        ctx.plan, ctx.fuse_wgrad, ctx.overwrite, ctx.reduce_bwd = plan, fuse_wgrad, overwrite_main_grad, reduce_bwd
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.templates = (qx, qx_col, qw)
        ctx.save_for_backward(weight, *_saved(qx), *_saved(qx_col), *_saved(qw))
        # 2-D: the caller reshapes. A Function's output that is a view cannot be modified in place, and
        # callers add biases in place (Megatron's MLP with biased experts).
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        weight, qx_d, qx_s, qxc_d, qxc_s, qw_d, qw_s = ctx.saved_tensors
        qx_t, qxc_t, qw_t = ctx.templates
        qx, qx_col, qw = _restore(qx_d, qx_s, qx_t), _restore(qxc_d, qxc_s, qxc_t), _restore(qw_d, qw_s, qw_t)
        ctx.templates = None
        plan = ctx.plan
        dy = grad_out.reshape(-1, weight.shape[0])
        qdy, qdy_col = plan.quantize_grad(dy)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_gemm(qdy, qw.t(), grad_out.dtype, plan.mm("dgrad")).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            a = qdy_col if qdy_col is not None else qdy.t()
            b = qx_col if qx_col is not None else qx.t()
            if ctx.fuse_wgrad:
                grad_w = accumulate_into_main_grad(weight, scaled_gemm(a, b, torch.float32, plan.mm("wgrad")),
                                                   ctx.overwrite)
            else:
                grad_w = scaled_gemm(a, b, weight.dtype, plan.mm("wgrad"))
        if ctx.reduce_bwd:
            # The first FP8 module of the forward runs its backward last: the step's backward amaxes are in.
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return grad_x, grad_w, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, plan: LinearFP8Plan, is_first_microbatch: Optional[bool],
               fuse_wgrad: bool) -> torch.Tensor:
    """``x W^T`` in FP8 under ``plan`` (no bias: the callers add it after their collectives)."""
    from transformer_engine.pytorch.recompute_frames import in_checkpointed_training_forward
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input's last dim must be in_features={weight.shape[1]}, got shape {tuple(x.shape)}")
    qw = plan.state.quantized_weight(plan, weight, is_first_microbatch)
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    # A reentrant checkpoint's first forward runs without gradients; its first module still takes the
    # first-module mark (the recompute hands it back), as it would in the same forward without recompute.
    first = (training or in_checkpointed_training_forward()) and FP8GlobalStateManager.is_first_fp8_module()
    reduce_bwd = training and first
    fuse = bool(fuse_wgrad and weight.requires_grad and training)
    out = _FP8Linear.apply(x, weight, plan, qw, fuse, bool(is_first_microbatch), reduce_bwd)
    return out.reshape(*x.shape[:-1], weight.shape[0])


__all__ = ["LinearFP8State", "LinearFP8Plan", "fp8_linear", "accumulate_into_main_grad"]
