"""GroupedLinear: ``num_gemms`` Linear layers applied to consecutive row blocks of one input (MoE experts).

``forward(inp, m_splits)`` multiplies the first ``m_splits[0]`` rows by ``weight0``, the next ``m_splits[1]``
by ``weight1``, and so on (an expert may get no rows). As in TransformerEngine, the module does no
tensor-parallel communication: ``tp_size`` and ``parallel_mode`` only decide the shapes of the weights (the
MoE token dispatcher moves the tokens), and a bias with ``tp_size > 1`` is refused.

The GEMMs (``transformer_engine.pytorch.grouped_gemm``): torch's grouped GEMM on CUDA for bfloat16/float16,
otherwise one GEMM per expert through Linear's path: FP8 under each recipe Linear supports with one
quantization state per GEMM (all of them in the state dict's ``_extra_state``), Megatron's ``main_grad``
accumulation, and the batch-invariant GEMM in batch-invariant mode. Weight gradients are computed per expert
over that expert's rows; nothing is accumulated with atomics.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from transformer_engine.pytorch.grouped_gemm import WeightStack, grouped_linear
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


def check_m_splits(m_splits: Any, num_gemms: int, rows: int) -> List[int]:
    """``m_splits`` (a list of ints or a 1-D integer tensor) as a list: ``num_gemms`` non-negative sizes
    summing to ``rows``."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype == torch.bool:
            raise ValueError(f"`m_splits` must be a 1-D integer tensor or a list of ints, got a {m_splits.dtype} "
                             f"tensor of shape {tuple(m_splits.shape)}")
        splits = [int(m) for m in m_splits.tolist()]
    elif isinstance(m_splits, (list, tuple)) and all(isinstance(m, int) and not isinstance(m, bool)
                                                     for m in m_splits):
        splits = list(m_splits)
    else:
        raise ValueError(f"`m_splits` must be a list of ints or a 1-D integer tensor, got {m_splits!r}")
    if len(splits) != num_gemms:
        raise ValueError(f"`m_splits` must have num_gemms={num_gemms} entries, got {len(splits)}")
    if any(m < 0 for m in splits):
        raise ValueError(f"`m_splits` must be non-negative, got {splits}")
    if sum(splits) != rows:
        raise ValueError(f"`m_splits` must sum to the input's row count {rows}, got sum {sum(splits)} ({splits})")
    return splits


class GroupedLinear(TransformerEngineBaseModule):
    """``y_i = x_i W_i^T + b_i`` for ``num_gemms`` row blocks ``x_i`` of the input, with TransformerEngine's
    constructor and forward signatures.

    Parameters ``weight0`` .. ``weight{num_gemms-1}`` [out_features, in_features] and, with ``bias=True``,
    ``bias0`` .. (zero-initialized; without a bias the ``bias{i}`` attributes are empty tensors, as in
    TransformerEngine). ``init_method`` runs on each weight, inside ``get_rng_state_tracker().fork(
    rng_tracker_name)`` when a tracker is given. ``return_bias=True`` returns ``(out, [bias_i])`` with the
    biases not added. ``fuse_wgrad_accumulation=True``: each weight gradient is added to (or, on
    ``is_first_microbatch=True`` / ``overwrite_main_grad``, written into) ``weight{i}.main_grad``.

    Not implemented (refused by name): ``delay_wgrad_compute``, userbuffer overlap, ``single_grouped_weight``,
    ``single_grouped_bias``, and the forward's ``out`` / ``dgrad_out`` buffers. ``use_grouped_tensor`` selects
    TransformerEngine's kernels; here the GEMM path is chosen by device and dtype (module docstring), so its
    value does not change what runs.
    """

    def __init__(
        self,
        num_gemms: int,
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
        device: Union[str, int, torch.device, None] = None,
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        name: Optional[str] = None,
        use_grouped_tensor: Optional[bool] = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        refuse_unsupported(owner, delay_wgrad_compute=delay_wgrad_compute, ub_overlap_rs=ub_overlap_rs,
                           ub_overlap_ag=ub_overlap_ag)
        for arg, value in (("single_grouped_weight", single_grouped_weight),
                           ("single_grouped_bias", single_grouped_bias)):
            if value:
                raise NotImplementedError(f"{owner}: `{arg}=True` is not implemented: the experts' parameters are "
                                          "kept as one parameter per GEMM (weight0, bias0, ...)")
        if use_grouped_tensor not in (None, True, False):
            raise ValueError(f"`use_grouped_tensor` must be None or a bool, got {use_grouped_tensor!r}")
        if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms < 1:
            raise ValueError(f"`num_gemms` must be a positive int, got {num_gemms!r}")
        check_parallel_mode(owner, parallel_mode)
        check_features(in_features, out_features)
        self._setup_tensor_parallel(tp_group, tp_size)
        if self.tp_size > 1 and bias:
            raise ValueError(f"{owner}: `bias` must be False when tp_size > 1 (got tp_size={self.tp_size}): the "
                             "tensor-parallel communication happens outside the module (the MoE dispatcher)")
        self.num_gemms = num_gemms
        self.single_grouped_weight = self.single_grouped_bias = False  # read by Megatron's grouped MLP
        self.parallel_mode = parallel_mode
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.apply_bias = self.use_bias and not self.return_bias
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.ub_name = ub_name
        self.name = name
        self.save_original_input = save_original_input
        self.use_grouped_tensor = use_grouped_tensor
        self.in_features = divide(in_features, self.tp_size, "in_features") if parallel_mode == "row" else in_features
        self.out_features = (divide(out_features, self.tp_size, "out_features") if parallel_mode == "column"
                             else out_features)
        # One FP8 state per GEMM (`_fp8_state_0`, ...), saved side by side in the extra state, GEMM 0 first.
        self._fp8_gemms = tuple(str(i) for i in range(num_gemms))
        self._weight_stack = WeightStack()
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        self.params_dtype = dtype
        for i in range(num_gemms):
            weight = self._new_parameter((self.out_features, self.in_features), device, dtype)
            self.register_parameter(f"weight{i}", weight)
            # TransformerEngine marks every expert weight as a shard along its split dim (0 unless row).
            set_tensor_parallel_attributes(weight, 1 if parallel_mode == "row" else 0)
            if self.use_bias:
                b = self._new_parameter((self.out_features,), device, dtype)
                self.register_parameter(f"bias{i}", b)
                if parallel_mode == "row":
                    b.sequence_parallel = self.sequence_parallel
                elif parallel_mode == "column":
                    set_tensor_parallel_attributes(b, 0)
            else:
                setattr(self, f"bias{i}", torch.empty(0, dtype=dtype, device=device))
        self._init_args = (init_method, get_rng_state_tracker, rng_tracker_name)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for i in range(self.num_gemms):
            self._init_weight(getattr(self, f"weight{i}"), *self._init_args)
            if self.use_bias and getattr(self, f"bias{i}").device.type != "meta":
                with torch.no_grad():
                    getattr(self, f"bias{i}").zero_()

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TransformerEngine's preparation of the FP8 metadata, which Megatron's TEGroupedLinear calls before it
        loads a state dict. Nothing to prepare here: each GEMM's FP8 state is made by its first FP8 forward or
        by ``set_extra_state``."""
        if num_gemms != self.num_gemms:
            raise ValueError(f"`num_gemms` must be this module's num_gemms={self.num_gemms}, got {num_gemms!r}")

    def _weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _biases(self) -> List[torch.Tensor]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor],
                is_first_microbatch: Optional[bool] = None, out: Optional[torch.Tensor] = None,
                dgrad_out: Optional[torch.Tensor] = None):
        """``inp`` [..., in_features] (its rows in expert order), ``m_splits`` the row count of each expert.
        Returns [..., out_features] (and the list of biases with ``return_bias=True``)."""
        owner = type(self).__name__
        self._check_forward_flags(owner, is_first_microbatch, False, False)
        for arg, value in (("out", out), ("dgrad_out", dgrad_out)):
            if value is not None:
                raise NotImplementedError(f"{owner}: `{arg}=...` (a preallocated buffer) is not implemented: the "
                                          "module returns a new tensor")
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1 or inp.shape[-1] != self.in_features:
            raise ValueError(f"`inp` must be a tensor whose last dim is in_features={self.in_features}, got "
                             f"{tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__}")
        x = inp.reshape(-1, self.in_features)
        splits = check_m_splits(m_splits, self.num_gemms, x.shape[0])
        if torch.is_autocast_enabled(x.device.type):
            # As Linear: under torch.autocast the GEMMs run in autocast's dtype, whichever path runs them.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        plans = [self._fp8_plan(x.device, gemm) for gemm in self._fp8_gemms]
        if all(p is None for p in plans):
            plans = None
        biases = self._biases() if self.apply_bias else None
        y = grouped_linear(x, splits, self._weights(), biases, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                           is_first_microbatch=is_first_microbatch, fp8_plans=plans, stack=self._weight_stack,
                           owner=owner)
        y = y.view(*inp.shape[:-1], self.out_features)
        if not self.return_bias:
            return y
        return y, [b if b.dtype == y.dtype else b.to(y.dtype) for b in self._biases()]

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, parallel_mode={self.parallel_mode}, tp_size={self.tp_size}")
