"""LayerNormMLP: a LayerNorm or RMSNorm, FC1, an activation and FC2, with TransformerEngine's arguments.

``FC2(act(FC1(Norm(x))))``. The two GEMMs run through ``Linear``'s ``parallel_linear`` (so FP8 under
every recipe ``Linear`` supports, ``fuse_wgrad_accumulation`` and the tensor-parallel collectives are
``Linear``'s), each with its own FP8 state. With ``set_parallel_mode=True`` FC1 is column parallel and
FC2 row parallel: the norm output is gathered (all-gathered along the sequence with
``sequence_parallel``), FC1 and the activation run on this rank's slice of the hidden width, and FC2's
partial products are all-reduced (reduce-scattered along the sequence) before its bias is added.

The activation (``transformer_engine.common.modules``: gelu, geglu, glu, qgelu, qgeglu, relu, reglu,
srelu, sreglu, silu, swiglu, clamped_swiglu) is computed in float32 (float64 for float64 activations)
and cast back to the activation dtype. A gated activation doubles FC1's width: on each rank the first
half of FC1's output goes through the activation and multiplies the second half, so a rank's
``fc1_weight`` holds its slice of the gate rows, then its slice of the linear rows (Megatron's layout).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from transformer_engine.common import modules as _modules
from transformer_engine.pytorch.module import _parallel
from transformer_engine.pytorch.module.base import (
    TransformerEngineBaseModule,
    check_normalization,
    divide,
    refuse_unsupported,
    resolve_device,
    resolve_dtype,
    set_tensor_parallel_attributes,
)
from transformer_engine.pytorch.module.layernorm import apply_norm
from transformer_engine.pytorch.module.linear import parallel_linear


def apply_mlp_activation(fc1_out: torch.Tensor, name: str, params: Optional[dict]) -> torch.Tensor:
    """The activation of FC1's output in float32 (float64 stays float64), returned in FC1's dtype."""
    from transformer_engine.pytorch.batch_invariance import bi_activation, is_batch_invariant

    if is_batch_invariant() and fc1_out.dtype != torch.float64:  # the kernel JAX's mode runs too
        return bi_activation(fc1_out, name, params)
    compute = torch.promote_types(fc1_out.dtype, torch.float32)
    return _modules.apply_activation(torch, name, fc1_out.to(compute), params).to(fc1_out.dtype)


class LayerNormMLP(TransformerEngineBaseModule):
    """``FC2(act(FC1(Norm(x))))``, returning what TransformerEngine's LayerNormMLP returns.

    Parameters are named as TransformerEngine names them: ``layer_norm_weight``, ``layer_norm_bias``
    (LayerNorm only), ``fc1_weight`` [fc1 width / tp, hidden], ``fc1_bias``, ``fc2_weight``
    [hidden, ffn_hidden_size / tp], ``fc2_bias`` (without ``bias`` the biases are None). ``init_method``
    initializes ``fc1_weight`` and ``output_layer_init_method`` ``fc2_weight`` (normal, std 0.023, by
    default), inside ``get_rng_state_tracker().fork()`` when a tracker is given; biases start at zero.

    ``forward`` returns ``out``, ``(out, ln_out)`` (``return_layernorm_output``), ``(out, fc2_bias)``
    (``return_bias``: FC2's bias not added, an empty tensor without a bias) or ``(out, fc2_bias,
    ln_out)``; ``ln_out`` is this rank's norm output, or the gathered one with
    ``return_layernorm_output_gathered``. ``zero_centered_gamma``: the norm scales by ``1 + weight``.
    ``fuse_wgrad_accumulation``: both weight gradients go into ``fc1_weight.main_grad`` and
    ``fc2_weight.main_grad`` (as ``Linear``'s). ``checkpoint=True`` keeps only the module's input for the
    backward and recomputes the forward there (``transformer_engine.pytorch.checkpoint``: same RNG state,
    same FP8 scales, so the gradients are bitwise those of the stored forward). ``seq_length`` and
    ``micro_batch_size`` (TransformerEngine's JIT warm-up) are accepted and have no effect.
    Userbuffer overlap (``ub_*``), ``delay_wgrad_compute`` and ``symmetric_ar_type`` are refused.
    """

    _fp8_gemms = ("fc1", "fc2")  # one FP8 state per GEMM, saved side by side in the extra state

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        output_layer_init_method: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device: Union[str, int, torch.device, None] = None,
        ub_overlap_ag: bool = False,
        name: Optional[str] = None,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        refuse_unsupported(owner, delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type,
                           ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                           ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                           ub_bulk_wgrad=ub_bulk_wgrad)
        check_normalization(owner, normalization)
        for arg, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{arg}` must be a positive int, got {value!r}")
        if activation_params is not None and not isinstance(activation_params, dict):
            raise ValueError(f"`activation_params` must be a dict or None, got {activation_params!r}")
        _modules.activation(activation, activation_params)  # checks the name and its parameters
        if not float(eps) > 0:
            raise ValueError(f"`eps` must be positive, got {eps!r}")
        self._setup_tensor_parallel(tp_group, tp_size)
        # As TransformerEngine: sequence parallelism only means something on more than one rank.
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        if self.sequence_parallel and not set_parallel_mode:
            # TransformerEngine would gather the norm output for FC1 and leave FC2's output unscattered.
            raise NotImplementedError(f"{owner}: `sequence_parallel=True` with tp_size={self.tp_size} is not "
                                      "implemented without `set_parallel_mode=True` (the sequence split needs "
                                      "FC1 column parallel and FC2 row parallel)")
        self.set_parallel_mode = bool(set_parallel_mode)
        self.eps = float(eps)
        self.normalization = normalization
        self.activation = activation
        self.activation_params = None if activation_params is None else dict(activation_params)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered)
        self.checkpoint = bool(checkpoint)
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.name = name
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.size_per_partition = divide(ffn_hidden_size, self.tp_size, "ffn_hidden_size")
        fc1_out = _modules.fc1_width(self.size_per_partition, activation)

        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        self._new_norm_parameters(hidden_size, normalization, device, dtype)
        # Registered in TransformerEngine's order (the state dict's and the optimizer's).
        self.fc1_weight = self._new_parameter((fc1_out, hidden_size), device, dtype)
        self.fc1_bias = self._new_parameter((fc1_out,), device, dtype) if self.use_bias else None
        self.fc2_weight = self._new_parameter((hidden_size, self.size_per_partition), device, dtype)
        self.fc2_bias = self._new_parameter((hidden_size,), device, dtype) if self.use_bias else None
        # TransformerEngine marks both weights (and FC1's bias) as tensor-parallel shards whatever the mode.
        set_tensor_parallel_attributes(self.fc1_weight, 0)
        set_tensor_parallel_attributes(self.fc2_weight, 1)
        if self.use_bias:
            set_tensor_parallel_attributes(self.fc1_bias, 0)
            if self.set_parallel_mode:
                # Replicated, added after the reduce-scatter: its gradient is a per-rank partial sum.
                self.fc2_bias.sequence_parallel = self.sequence_parallel
        self._init_args = (init_method, output_layer_init_method, get_rng_state_tracker)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_method, output_layer_init_method, tracker = self._init_args
        self._init_weight(self.fc1_weight, init_method, tracker, None)
        self._init_weight(self.fc2_weight, output_layer_init_method, tracker, None)
        if self.fc1_weight.device.type == "meta":
            return
        with torch.no_grad():
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            for param in (self.layer_norm_bias, self.fc1_bias, self.fc2_bias):
                if param is not None:
                    param.zero_()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """Norm, FC1, activation, FC2 of ``inp`` [..., hidden_size] (this rank's sequence slice with
        ``sequence_parallel``); ``is_first_microbatch`` as ``Linear``'s (FP8 weight caching, and with
        ``fuse_wgrad_accumulation`` the first micro-batch overwrites ``main_grad``)."""
        self._check_forward_flags(type(self).__name__, is_first_microbatch, False, False)
        if self.checkpoint and torch.is_grad_enabled():
            from transformer_engine.pytorch.distributed import checkpoint

            # Non-reentrant: the parameters get their gradients even when the input needs none.
            return checkpoint(self._forward, inp, is_first_microbatch, use_reentrant=False)
        return self._forward(inp, is_first_microbatch)

    def _forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool]):
        group = self._group_for_forward(self.set_parallel_mode)
        ln_out = apply_norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
                            self.zero_centered_gamma)
        total = _parallel.column_input(ln_out, group, self.sequence_parallel) if self.set_parallel_mode else ln_out
        # The gather is done: FC1 multiplies as a local Linear.
        fc1_out, _ = parallel_linear(total, self.fc1_weight, self.fc1_bias, None, None, False, False,
                                     self.fuse_wgrad_accumulation, is_first_microbatch,
                                     self._fp8_plan(inp.device, "fc1"))
        act = apply_mlp_activation(fc1_out, self.activation, self.activation_params)
        out, bias = parallel_linear(act, self.fc2_weight, self.fc2_bias, "row" if self.set_parallel_mode else None,
                                    group, self.sequence_parallel, self.return_bias, self.fuse_wgrad_accumulation,
                                    is_first_microbatch, self._fp8_plan(inp.device, "fc2"))
        if self.return_bias:
            bias = self._returned_bias(out, bias)
        if self.return_layernorm_output:
            ln_ret = total if self.return_layernorm_output_gathered else ln_out
            return (out, bias, ln_ret) if self.return_bias else (out, ln_ret)
        return (out, bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}, bias={self.use_bias}, "
                f"set_parallel_mode={self.set_parallel_mode}, tp_size={self.tp_size}")
