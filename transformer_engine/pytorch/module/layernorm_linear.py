"""LayerNormLinear: a LayerNorm or RMSNorm followed by a Linear, with TransformerEngine's arguments.

The norm runs on this rank's input (a sequence shard when ``sequence_parallel``); the normalized
tensor is then gathered (column parallel) and multiplied as by ``Linear``. Parameters are named as
TransformerEngine names them: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
``weight``, ``bias`` (with ``parameters_split``, one ``<name>_weight``/``<name>_bias`` per part, concatenated
for the GEMM, as TransformerEngine's unfused QKV parameters are). Under FP8 ``autocast`` the norm runs in the activation dtype and its output is
quantized for the FP8 GEMMs (as ``Linear``'s input is); ``return_layernorm_output`` returns it
unquantized.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from transformer_engine.pytorch.module import _parallel
from transformer_engine.pytorch.module.base import (
    TransformerEngineBaseModule,
    check_features,
    check_normalization,
    check_parallel_mode,
    divide,
    refuse_unsupported,
    resolve_device,
    resolve_dtype,
    set_tensor_parallel_attributes,
)
from transformer_engine.pytorch.module.layernorm import apply_norm
from transformer_engine.pytorch.module.linear import parallel_linear


class LayerNormLinear(TransformerEngineBaseModule):
    """``Linear(Norm(x))``, returning what TransformerEngine's LayerNormLinear returns.

    ``return_bias`` as in ``Linear``; ``return_layernorm_output=True`` also returns the norm's
    output (this rank's, or the gathered one with ``return_layernorm_output_gathered=True``):
    ``out``, ``(out, ln_out)``, ``(out, bias)`` or ``(out, bias, ln_out)``. ``parallel_mode`` is
    "column" or None (a row split would cut the dim the norm reduces over).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Optional[Any] = None,
        zero_centered_gamma: bool = False,
        device: Union[str, int, torch.device, None] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        rng_tracker_name: Optional[str] = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        refuse_unsupported(owner, delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type,
                           ub_overlap_ag=ub_overlap_ag,
                           ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                           ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad)
        check_parallel_mode(owner, parallel_mode, (None, "column"))
        check_normalization(owner, normalization)
        check_features(in_features, out_features)
        if not float(eps) > 0:
            raise ValueError(f"`eps` must be positive, got {eps!r}")
        self._setup_tensor_parallel(tp_group, tp_size)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = bool(sequence_parallel)
        self.eps = float(eps)
        self.normalization = normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered)
        self.ub_name = ub_name
        self.name = name
        self.in_features = in_features
        self.out_features = (divide(out_features, self.tp_size, "out_features") if parallel_mode == "column"
                             else out_features)
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        self._new_norm_parameters(in_features, normalization, device, dtype)
        self._new_weight_and_bias(self.out_features, in_features, self.use_bias, device, dtype, parameters_split)
        if fuse_wgrad_accumulation and len(self.weight_names) > 1:
            raise NotImplementedError(f"{owner}: `fuse_wgrad_accumulation=True` with `parameters_split` is not "
                                      "implemented: the split weights are concatenated for the GEMM, so there is no "
                                      "one weight to accumulate main_grad into")
        if parallel_mode == "column":
            for weight, bias in zip(self._split_weights(), self._split_biases()):
                set_tensor_parallel_attributes(weight, 0)
                if bias is not None:
                    set_tensor_parallel_attributes(bias, 0)
        self._init_args = (init_method, get_rng_state_tracker, rng_tracker_name)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in self._split_weights():
            self._init_weight(weight, *self._init_args)
        if self.layer_norm_weight.device.type == "meta":
            return
        with torch.no_grad():
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.zero_()
            for bias in self._split_biases():
                if bias is not None:
                    bias.zero_()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        self._check_forward_flags(type(self).__name__, is_first_microbatch, fp8_output, fp8_grad)
        group = self._group_for_forward()
        ln_out = apply_norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
                            self.zero_centered_gamma)
        total = ln_out
        if self.parallel_mode == "column":
            total = _parallel.column_input(ln_out, group, self.sequence_parallel)
        # The collectives are done: multiply as a plain (local) Linear.
        weight, bias = self._weight_and_bias()
        out, bias = parallel_linear(total, weight, bias, None, None, False, self.return_bias,
                                    self.fuse_wgrad_accumulation, is_first_microbatch, self._fp8_plan(inp.device))
        if self.return_bias:
            bias = self._returned_bias(out, bias)
        if self.return_layernorm_output:
            ln_ret = total if self.return_layernorm_output_gathered else ln_out
            return (out, bias, ln_ret) if self.return_bias else (out, ln_ret)
        return (out, bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, normalization={self.normalization}, "
                f"bias={self.use_bias}, parallel_mode={self.parallel_mode}, tp_size={self.tp_size}")
