"""TransformerEngine's ``transformer_engine.jax.cpp_extensions`` helpers that user code calls.

:class:`FusedAttnHelper` answers "can the fused kernels run this configuration here, now?" with
TransformerEngine's fields and methods; here the answer comes from the project's backend selection
(:func:`transformer_engine.jax.attention.fused_attn_unavailable_reasons`), and
:meth:`FusedAttnHelper.unavailable_reasons` also says why not. TransformerEngine's other
extensions (GEMM, normalization, quantization) are not part of this project.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, List, Tuple

from transformer_engine.common import settings

__all__ = ["FusedAttnHelper", "NVTE_Fused_Attn_Backend"]


class NVTE_Fused_Attn_Backend(Enum):  # noqa: N801 - TransformerEngine's name
    """What :meth:`FusedAttnHelper.get_fused_attn_backend` returns: no fused backend, or the
    fused kernels (they take arbitrary sequence lengths, the role of TransformerEngine's
    ``NVTE_F16_arbitrary_seqlen``)."""

    NVTE_No_Backend = -1
    NVTE_F16_arbitrary_seqlen = 1


@dataclass(frozen=True)
class FusedAttnHelper:
    """TransformerEngine's fused-attention availability query, field for field."""

    is_training: bool
    q_dtype: Any
    kv_dtype: Any
    qkv_layout: Any
    attn_bias_type: Any
    attn_mask_type: Any
    softmax_type: Any
    dropout_probability: float
    q_num_heads: int
    kv_num_heads: int
    q_max_seqlen: int
    kv_max_seqlen: int
    head_dim_qk: int
    head_dim_v: int
    window_size: Tuple[int, int]

    def unavailable_reasons(self) -> List[str]:
        """Why the fused backend would not run this configuration (empty: it would)."""
        from transformer_engine.jax.attention import fused_attn_unavailable_reasons

        return fused_attn_unavailable_reasons(
            self.is_training, self.q_dtype, self.kv_dtype, self.qkv_layout, self.attn_bias_type, self.attn_mask_type,
            self.softmax_type, self.dropout_probability, self.q_num_heads, self.kv_num_heads, self.q_max_seqlen,
            self.kv_max_seqlen, self.head_dim_qk, self.head_dim_v, self.window_size,
        )

    def is_fused_attn_kernel_available(self) -> bool:
        """True when the fused kernels can run this configuration here, now."""
        return not self.unavailable_reasons()

    def get_fused_attn_backend(self) -> NVTE_Fused_Attn_Backend:
        """The fused backend this configuration would run on."""
        if self.is_fused_attn_kernel_available():
            return NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
        return NVTE_Fused_Attn_Backend.NVTE_No_Backend

    @staticmethod
    def is_non_deterministic_allowed() -> bool:
        """False when ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (read now)."""
        return bool(settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO"))


# TransformerEngine-JAX's collective-GEMM descriptors, which clients (MaxText's dot_general) read
# from this module; they live with ``dense``.
from transformer_engine.jax.dense import CollectiveOp, CollectiveOpSet, noop_collective_op_set  # noqa: E402

__all__ += ["CollectiveOp", "CollectiveOpSet", "noop_collective_op_set"]
