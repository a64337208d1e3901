"""GroupedLinear: named so that subclasses can be defined (Megatron's MoE experts); not implemented."""

from __future__ import annotations

import torch


class GroupedLinear(torch.nn.Module):
    """Several Linear GEMMs in one call (TransformerEngine's MoE expert layer). Not implemented:
    constructing one raises NotImplementedError (Megatron: use the local MoE expert layers)."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("GroupedLinear is not implemented by the deterministic-attention package; "
                                  "use per-expert Linear layers (Megatron: moe_grouped_gemm=False or the local spec)")
