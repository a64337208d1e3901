"""Linear with TransformerEngine's arguments, tensor parallel through torch.distributed.

``parallel_mode="column"``: the weight is split along its output dim; the input is the whole
sequence (all-gathered first when ``sequence_parallel``), the output stays split. ``"row"``: the
weight is split along its input dim; partial products are all-reduced (reduce-scattered along
the sequence dim when ``sequence_parallel``) and the bias is added once, after the reduction.
``None``: no communication.

Inside ``transformer_engine.pytorch.autocast(enabled=True, recipe=...)`` the forward, dgrad and
wgrad GEMMs run in FP8 under the recipe (``transformer_engine.pytorch.quantization_linear``; the
collectives and the bias stay in the activation dtype); ``is_first_microbatch=True`` quantizes the
weight and caches it for the calls with ``False``.

In batch-invariant mode (``NVTE_BATCH_INVARIANT=1`` or ``transformer_engine.pytorch.batch_invariant()``) the
GEMMs run on the batch-invariant kernel: a row of the output and of the input gradient does not depend on the
other rows (``transformer_engine.pytorch.batch_invariant``).

``fuse_wgrad_accumulation=True`` (Megatron's gradient-accumulation fusion): the backward adds the
weight gradient, computed in fp32, to ``weight.main_grad`` in place (it overwrites it instead on
``is_first_microbatch=True`` or when ``weight.overwrite_main_grad`` is set) and gives autograd no
weight gradient: None, or, when ``weight`` has Megatron's ``grad_added_to_main_grad`` flag, a
zero gradient (the flag is then set) so that Megatron's gradient hooks still fire and know the
gradient is already in ``main_grad``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from transformer_engine.pytorch.batch_invariance import bi_linear, bias_add, check_no_fp8, is_batch_invariant
from transformer_engine.pytorch.module import _parallel
from transformer_engine.pytorch.quantization_linear import accumulate_into_main_grad, fp8_linear
from transformer_engine.pytorch.module.base import (
    TransformerEngineBaseModule,
    check_features,
    check_parallel_mode,
    divide,
    refuse_unsupported,
    resolve_device,
    resolve_dtype,
    set_tensor_parallel_attributes,
)


class _LinearIntoMainGrad(torch.autograd.Function):
    """``x W^T`` whose backward accumulates the weight gradient into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, x, weight, overwrite):
        ctx.save_for_backward(x, weight)
        ctx.overwrite = overwrite
        return torch.nn.functional.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad_out, weight if weight.dtype == grad_out.dtype else weight.to(grad_out.dtype))
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None
        main_grad = getattr(weight, "main_grad", None)
        dtype = main_grad.dtype if main_grad is not None else torch.float32
        # The same product autograd forms for F.linear's weight (x^T dY, transposed), in the main
        # gradient's dtype: with fp32 activations its bits equal the unfused gradient's.
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)
        dy2d = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        wgrad = torch.mm(x2d.t(), dy2d).t()
        return grad_x, accumulate_into_main_grad(weight, wgrad, ctx.overwrite), None


def parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], parallel_mode: Optional[str],
                    group: Optional[Any], sequence_parallel: bool, return_bias: bool,
                    fuse_wgrad_accumulation: bool = False, is_first_microbatch: Optional[bool] = None,
                    fp8_plan: Optional[Any] = None):
    """The GEMM and its collectives; returns (out, bias to return or None).

    ``fp8_plan`` (from the module's ``_fp8_plan``): run the GEMMs in FP8, or, when calibrating, record
    the amaxes and run in high precision.
    """
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input's last dim must be in_features={weight.shape[1]} (this rank's), got shape {tuple(x.shape)}")
    if torch.is_autocast_enabled(x.device.type):
        # Under torch.autocast the GEMMs run in autocast's dtype, as torch's own Linear and TransformerEngine's
        # modules do, whichever path (FP8 or not) runs them: the output dtype never depends on the recipe.
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if parallel_mode == "column":
        x = _parallel.column_input(x, group, sequence_parallel)
    fp8 = fp8_plan is not None and fp8_plan.enabled
    if fp8 and is_batch_invariant():
        check_no_fp8("Linear", fp8_plan)  # row-invariant recipes only; their GEMMs on the batch-invariant kernel
    if is_batch_invariant() and not fp8:
        if fp8_plan is not None:
            fp8_plan.calibrate(x, weight)
        fuse = fuse_wgrad_accumulation and weight.requires_grad and torch.is_grad_enabled()
        out = bi_linear(x, weight, bool(is_first_microbatch) if fuse else None)
    elif fp8:
        out = fp8_linear(x, weight, fp8_plan, is_first_microbatch, fuse_wgrad_accumulation)
    elif fuse_wgrad_accumulation and weight.requires_grad and torch.is_grad_enabled():
        if fp8_plan is not None:
            fp8_plan.calibrate(x, weight)
        out = _LinearIntoMainGrad.apply(x, weight, bool(is_first_microbatch))
    else:
        if fp8_plan is not None:
            fp8_plan.calibrate(x, weight)
        out = torch.nn.functional.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
    if parallel_mode == "row":
        out = _parallel.row_output(out, group, sequence_parallel)
    if bias is not None:
        bias = bias if bias.dtype == out.dtype else bias.to(out.dtype)
    if return_bias:
        return out, bias
    if bias is not None:
        out = bias_add(out, bias)  # x + bias; in batch-invariant mode, JAX's bias gradient
    return out, None


class Linear(TransformerEngineBaseModule):
    """``y = x W^T + b`` with TransformerEngine's constructor and forward signatures.

    Attributes ``in_features``/``out_features`` are this rank's (split by ``tp_size`` in the
    parallel dim), as TransformerEngine's are. ``return_bias=True`` returns ``(out, bias)`` with the
    bias not added (an empty tensor when ``bias=False``), for the caller to fuse into what follows.
    ``init_method`` runs on this rank's weight shard, inside ``get_rng_state_tracker().fork(
    rng_tracker_name)`` when a tracker is given; the bias starts at zero. ``parameters_split`` (names, or a dict
    of name to size) keeps the weight as one parameter per part, ``<name>_weight``/``<name>_bias`` (each part
    split over the tensor-parallel ranks under column parallelism), concatenated for the GEMM.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        parameters_split: Optional[Any] = None,
        device: Union[str, int, torch.device, None] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        save_original_input: bool = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        refuse_unsupported(owner, delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type,
                           ub_overlap_ag=ub_overlap_ag,
                           ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                           ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad)
        check_parallel_mode(owner, parallel_mode)
        check_features(in_features, out_features)
        self._setup_tensor_parallel(tp_group, tp_size)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = bool(sequence_parallel)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.ub_name = ub_name
        self.name = name
        # Always true in effect: the input kept for backward is the input given.
        self.save_original_input = save_original_input
        self.in_features = divide(in_features, self.tp_size, "in_features") if parallel_mode == "row" else in_features
        self.out_features = (divide(out_features, self.tp_size, "out_features") if parallel_mode == "column"
                             else out_features)
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        self._new_weight_and_bias(self.out_features, self.in_features, self.use_bias, device, dtype, parameters_split)
        if fuse_wgrad_accumulation and len(self.weight_names) > 1:
            raise NotImplementedError(f"{owner}: `fuse_wgrad_accumulation=True` with `parameters_split` is not "
                                      "implemented: the split weights are concatenated for the GEMM, so there is no "
                                      "one weight to accumulate main_grad into")
        for weight, bias in zip(self._split_weights(), self._split_biases()):
            if parallel_mode is not None:
                set_tensor_parallel_attributes(weight, 0 if parallel_mode == "column" else 1)
                if bias is not None and parallel_mode == "column":
                    set_tensor_parallel_attributes(bias, 0)
            if bias is not None and parallel_mode == "row":
                # Replicated bias added after a reduce-scatter: its gradient is a per-rank partial sum.
                bias.sequence_parallel = self.sequence_parallel
        self._init_args = (init_method, get_rng_state_tracker, rng_tracker_name)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight, bias in zip(self._split_weights(), self._split_biases()):
            self._init_weight(weight, *self._init_args)
            if bias is not None and bias.device.type != "meta":
                with torch.no_grad():
                    bias.zero_()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        self._check_forward_flags(type(self).__name__, is_first_microbatch, fp8_output, fp8_grad)
        weight, bias = self._weight_and_bias()
        out, bias = parallel_linear(inp, weight, bias, self.parallel_mode, self._group_for_forward(),
                                    self.sequence_parallel, self.return_bias, self.fuse_wgrad_accumulation,
                                    is_first_microbatch, self._fp8_plan(inp.device))
        if not self.return_bias:
            return out
        return out, self._returned_bias(out, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"parallel_mode={self.parallel_mode}, tp_size={self.tp_size}")
