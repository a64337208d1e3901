"""Single-tensor operations: only ``L2Normalization`` (see ``transformer_engine.pytorch.ops``)."""

from transformer_engine.pytorch.ops.basic.l2normalization import L2Normalization

__all__ = ["L2Normalization"]
