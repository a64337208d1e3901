"""TransformerEngine's fusible-operations namespace, holding only what the modules here use.

``L2Normalization`` (``basic/l2normalization.py``) is ``MultiheadAttention``'s ``qk_norm_type="L2Normalization"``,
at TransformerEngine's import path. The rest of TransformerEngine's operation API (``Sequential``, ``BasicLinear``,
the operation fuser, ...) is not implemented: asking for it raises an AttributeError that says so.
"""

from transformer_engine.pytorch.ops.basic import L2Normalization

__all__ = ["L2Normalization"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"transformer_engine.pytorch.ops.{name} is not implemented: of TransformerEngine's fusible "
                         "operations only L2Normalization is (the module classes are in transformer_engine.pytorch)")
