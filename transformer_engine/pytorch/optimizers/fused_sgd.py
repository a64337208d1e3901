"""``FusedSGD``: TransformerEngine's SGD constructor on torch's own fused SGD kernel."""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
from torch.optim import sgd as _torch_sgd
from torch.optim.optimizer import required

from transformer_engine.pytorch.optimizers._common import grad_of, torch_fused_ok, zero_grads


class FusedSGD(torch.optim.Optimizer):
    """SGD with optional momentum, dampening, Nesterov momentum and L2 weight decay, with
    TransformerEngine's ``FusedSGD`` constructor.

    Each step runs ``torch.optim.sgd.sgd`` with ``fused=True`` where torch has a fused kernel for
    the parameters' device and its single-tensor path elsewhere: the result equals
    ``torch.optim.SGD(..., fused=True)`` bit for bit, and repeated runs give the same bits. The
    momentum buffer starts as the first gradient (``v = momentum * v + (1 - dampening) * g``
    afterwards), as in TransformerEngine and torch. ``wd_after_momentum=True`` raises
    ``NotImplementedError``; ``materialize_master_grads`` concerns Apex's amp only and has no
    effect; ``set_grad_none`` (deprecated) is ``zero_grad``'s default.
    """

    def __init__(
        self,
        params: Iterable,
        lr=required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: Optional[bool] = None,
    ):
        if lr is not required and lr < 0.0:
            raise ValueError(f"`lr` must be >= 0, got {lr}")
        if momentum < 0.0:
            raise ValueError(f"`momentum` must be >= 0, got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"`weight_decay` must be >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError(
                f"`nesterov` must come with momentum > 0 and dampening 0, got momentum={momentum}, "
                f"dampening={dampening}"
            )
        if wd_after_momentum:
            raise NotImplementedError("`wd_after_momentum` must be False, got True")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.set_grad_none = set_grad_none

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Resets ``grad``; ``set_to_none`` defaults to ``set_grad_none``, else True."""
        zero_grads(self, set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One SGD step over every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: List[torch.Tensor] = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise NotImplementedError("`params` must have dense gradients, got a sparse one")
            buffers = [self.state[p].get("momentum_buffer") for p in params]
            _torch_sgd.sgd(
                params,
                grads,
                buffers,
                foreach=False,
                fused=torch_fused_ok(params),
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=False,
            )
            if group["momentum"] != 0:
                for p, buf in zip(params, buffers):
                    self.state[p]["momentum_buffer"] = buf
        return loss
