"""MoE router kernels, as TransformerEngine's ``pytorch.router`` names them; not implemented.

Megatron imports these names unconditionally at TransformerEngine API level 2.7 and later and
calls them only when ``moe_router_fusion`` is set. Each raises NotImplementedError naming itself;
Megatron's unfused router (``moe_router_fusion=False``, its default) computes the same thing.
"""

from __future__ import annotations


def _not_implemented(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name} (fused MoE routing) is not implemented by the deterministic-attention "
                                  "package; Megatron: moe_router_fusion=False")
    refuse.__name__ = name
    refuse.__doc__ = f"Not implemented: raises NotImplementedError (Megatron: moe_router_fusion=False)."
    return refuse


fused_topk_with_score_function = _not_implemented("fused_topk_with_score_function")
fused_compute_score_for_moe_aux_loss = _not_implemented("fused_compute_score_for_moe_aux_loss")
fused_moe_aux_loss = _not_implemented("fused_moe_aux_loss")

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]
