"""``FusedAdam``: TransformerEngine's Adam/AdamW constructor on torch's own fused Adam kernel."""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
from torch.optim import adam as _torch_adam

from transformer_engine.pytorch.optimizers._common import (
    check_dtype_is_fp32,
    grad_of,
    torch_fused_ok,
    zero_grads,
)


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``, L2 regularisation) or AdamW (``adam_w_mode=True``, decoupled
    weight decay, the default), with TransformerEngine's ``FusedAdam`` constructor.

    Each step runs ``torch.optim.adam.adam`` with ``fused=True`` where torch has a fused kernel
    for the parameters' device (CUDA, CPU, ...) and its single-tensor path elsewhere: the result
    equals ``torch.optim.AdamW(..., fused=True)`` (``torch.optim.Adam`` when ``adam_w_mode`` is
    false) bit for bit. The update is elementwise, so repeated runs give the same bits.

    Supported beyond torch's arguments: ``master_weights`` (an fp32 copy of each fp16/bf16
    parameter in ``state["master_param"]``, updated by the step and copied back rounded),
    ``use_decoupled_grad`` (read ``param.decoupled_grad`` instead of ``param.grad``),
    ``capturable`` (passed to torch), ``amsgrad`` (passed to torch), ``set_grad_none``
    (deprecated; the default of ``zero_grad``), ``store_param_remainders`` (accepted; the master
    weight is stored whole in fp32, so it saves no memory). Not supported, raising
    ``NotImplementedError`` by name: ``bias_correction=False``, optimizer states or master weights
    in a dtype other than fp32, a ``grad_scaler`` in ``step``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: Optional[bool] = None,
    ):
        if not isinstance(lr, torch.Tensor) and lr < 0.0:
            raise ValueError(f"`lr` must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"`eps` must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"`betas` must be two values in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"`weight_decay` must be >= 0, got {weight_decay}")
        if not bias_correction:
            raise NotImplementedError(
                "`bias_correction` must be True, got False (torch's Adam always corrects the bias)"
            )
        check_dtype_is_fp32("exp_avg_dtype", exp_avg_dtype)
        check_dtype_is_fp32("exp_avg_sq_dtype", exp_avg_sq_dtype)
        if master_weights:
            check_dtype_is_fp32("master_weight_dtype", master_weight_dtype)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "bias_correction": True,
        }
        super().__init__(params, defaults)
        # Attributes, not group options: callers (Megatron-core) set them after construction.
        self.adam_w_mode = bool(adam_w_mode)
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Resets ``grad`` (or ``decoupled_grad``); ``set_to_none`` defaults to ``set_grad_none``,
        else True."""
        zero_grads(self, set_to_none)

    def _uses_master(self, param: torch.Tensor) -> bool:
        return bool(self.master_weights) and param.dtype in (torch.float16, torch.bfloat16)

    def initialize_state(self, param: torch.nn.Parameter, store_param_remainders: bool = False) -> None:
        """Creates the zero moments (and the master weight) of ``param``."""
        del store_param_remainders  # the master weight is stored whole
        state = self.state[param]
        if self._uses_master(param) and "master_param" not in state:
            state["master_param"] = param.detach().float().clone()
        like = state.get("master_param", param)
        for name in ("exp_avg", "exp_avg_sq"):
            if name not in state:
                state[name] = torch.zeros_like(like, memory_format=torch.preserve_format)

    def get_unscaled_state(self, param: torch.nn.Parameter, state_name: str, skip_unscale: bool = False):
        """The state ``state_name`` of ``param`` (fp32: there is no scaling to undo)."""
        del skip_unscale
        return self.state[param][state_name]

    def set_scaled_state(self, param: torch.nn.Parameter, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Sets the state ``state_name`` of ``param`` from an fp32 tensor."""
        state = self.state[param]
        if state_name not in state:
            self.initialize_state(param)
        if state_name in state:
            state[state_name].copy_(unscaled_state)
        else:
            state[state_name] = unscaled_state.detach().clone()

    def _step_tensor(self, state: dict, device: torch.device, on_device: bool) -> torch.Tensor:
        step = state.get("step")
        if not isinstance(step, torch.Tensor):
            # A state made by a caller (moments only) has no step yet.
            step = torch.tensor(float(step or 0), dtype=torch.float32)
            state["step"] = step
        want = device if on_device else torch.device("cpu")
        if step.device != want:
            state["step"] = step = step.to(want)
        return step

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One Adam step over every parameter that has a gradient; returns ``closure()``'s loss."""
        if grad_scaler is not None:
            raise NotImplementedError(f"`grad_scaler` must be None, got {grad_scaler!r}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            owners: List[torch.Tensor] = []
            params: List[torch.Tensor] = []
            grads: List[torch.Tensor] = []
            for p in group["params"]:
                grad = grad_of(p, self.use_decoupled_grad)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise NotImplementedError("`params` must have dense gradients, got a sparse one")
                self.initialize_state(p)
                target = self.state[p]["master_param"] if self._uses_master(p) else p
                owners.append(p)
                params.append(target)
                grads.append(grad if grad.dtype == target.dtype else grad.to(target.dtype))
            if not params:
                continue
            fused = torch_fused_ok(params)
            on_device = fused or bool(self.capturable)
            states = [self.state[p] for p in owners]
            if group["amsgrad"]:
                for state in states:
                    state.setdefault("max_exp_avg_sq", torch.zeros_like(state["exp_avg_sq"]))
            exp_avgs = [state["exp_avg"] for state in states]
            exp_avg_sqs = [state["exp_avg_sq"] for state in states]
            max_exp_avg_sqs = [state["max_exp_avg_sq"] for state in states] if group["amsgrad"] else []
            steps = [self._step_tensor(state, t.device, on_device) for state, t in zip(states, params)]
            beta1, beta2 = group["betas"]
            _torch_adam.adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                foreach=False,
                capturable=bool(self.capturable),
                differentiable=False,
                fused=fused,
                decoupled_weight_decay=self.adam_w_mode,
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            for p, target in zip(owners, params):
                if target is not p:
                    p.copy_(target)
        return loss
