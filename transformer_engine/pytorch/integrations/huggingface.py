"""Hugging Face ``transformers`` models on this project's attention.

::

    from transformers import AutoModelForCausalLM
    from transformer_engine.pytorch.integrations import huggingface

    huggingface.register()  # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation=huggingface.ATTN_IMPLEMENTATION)

:func:`register` adds :func:`attention_forward` to ``transformers.AttentionInterface`` and a mask
function to ``transformers.AttentionMaskInterface`` under :data:`ATTN_IMPLEMENTATION`. Every
attention layer of the model then calls :class:`~transformer_engine.pytorch.DotProductAttention`
with the layer's heads, head dim, GQA groups, scaling, dropout and sliding window, so
determinism (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` or ``torch.use_deterministic_algorithms(True)``)
and backend selection work as for any other call.

Layouts and masks:

- ``transformers`` passes q, k, v as [b, h, s, d]; they become [b, s, h, d] views (``bshd``),
  and the output goes back as [b, s, h, d].
- No padding (the mask function returns ``None`` when every token is real): ``bshd`` with
  ``causal`` (``causal_bottom_right`` when the query is shorter than the keys, as when decoding
  with a cache) or ``no_mask`` for non-causal layers.
- A padding mask (``transformers``' [b, s] mask, 1 = real token, left or right padding): the real
  tokens are gathered into the packed ``thd`` layout with ``cu_seqlens`` and scattered back after.
  This needs the token indices and the longest length on the host: **one device-to-host sync per
  call**, which a CUDA graph capture cannot contain.
- Packed sequences without padding (``transformers``' ``DataCollatorWithFlattening``, which passes
  ``cu_seq_lens_q/k`` and ``max_length_q/k``): ``thd`` directly from those, with no host sync; the
  route for CUDA graphs and ``torch.compile`` without graph breaks.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from transformer_engine.pytorch.attention import DotProductAttention

__all__ = ["ATTN_IMPLEMENTATION", "register", "attention_forward", "padding_mask_to_cu_seqlens"]

#: The name to pass as ``attn_implementation`` after :func:`register`.
ATTN_IMPLEMENTATION = "te_deterministic"


@functools.lru_cache(maxsize=256)
def _dpa(num_heads: int, num_kv_heads: int, d_qk: int, d_v: int, qkv_format: str, mask: str,
         window: Optional[Tuple[int, int]], scale: float, dropout: float) -> DotProductAttention:
    # One module per attention shape: modules hold no tensors, and a call reads determinism and the
    # environment afresh, so sharing one between layers changes nothing.
    return DotProductAttention(num_heads, (d_qk, d_v), num_gqa_groups=num_kv_heads, attention_dropout=dropout,
                               qkv_format=qkv_format, attn_mask_type=mask, window_size=window,
                               softmax_scale=scale)


def padding_mask_to_cu_seqlens(attention_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``transformers``' padding mask [b, s] (nonzero/True = real token) -> ``(indices, cu_seqlens, max_seqlen)``.

    ``indices`` are the flat positions of the real tokens in [b * s] (gather with them to pack,
    scatter to unpack); ``cu_seqlens`` is int32 [b + 1]. ``max_seqlen`` is a Python int, and it
    and ``indices`` are read on the host: this function synchronises the device once.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"`attention_mask` must be a [batch, seq] padding mask, got shape {tuple(attention_mask.shape)}")
    real = attention_mask.to(torch.bool)
    lengths = real.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(real.reshape(-1), as_tuple=False).reshape(-1)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    return indices, cu_seqlens, max_seqlen


def _window(sliding_window: Optional[int]) -> Optional[Tuple[int, int]]:
    # transformers' sliding_window counts the query's own key: left size sliding_window - 1.
    return None if sliding_window is None else (int(sliding_window) - 1, 0)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      **kwargs) -> Tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: q [b, h, s_q, d], k/v [b, h_kv, s_kv, d] -> ([b, s_q, h, d_v], None).

    ``attention_mask`` is what :func:`register`'s mask function returns: ``None`` or a [b, s]
    padding mask. Attention weights are never returned (``output_attentions`` is not supported).
    """
    if softcap is not None:
        raise NotImplementedError("attention logit soft-capping (`softcap`) is not supported by DotProductAttention")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"`attention_mask` must be a [batch, seq] padding mask (register()'s mask function), got shape "
            f"{tuple(attention_mask.shape)}: was the model created with attn_implementation={ATTN_IMPLEMENTATION!r} "
            "after register()?"
        )
    batch, heads, s_q, d_qk = query.shape
    kv_heads, s_kv, d_v = key.shape[1], key.shape[2], value.shape[-1]
    causal = bool(getattr(module, "is_causal", True))
    scale = float(scaling) if scaling is not None else d_qk ** -0.5
    dropout = float(dropout) if module.training else 0.0
    window = _window(sliding_window)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, h, d] views

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and attention_mask is None:
        # Packed by the data collator: batch 1, the sequences back to back. No host sync.
        if batch != 1:
            raise ValueError(f"`cu_seq_lens_q/k` need the packed batch of 1, got batch {batch}")
        dpa = _dpa(heads, kv_heads, d_qk, d_v, "thd", "padding_causal" if causal else "padding", window, scale, dropout)
        out = dpa(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_kv=cu_k.to(torch.int32),
                  max_seqlen_q=int(kwargs["max_length_q"]), max_seqlen_kv=int(kwargs["max_length_k"]))
        return out.reshape(1, s_q, heads, d_v), None

    if attention_mask is None:
        mask = ("causal" if s_q == s_kv else "causal_bottom_right") if causal else "no_mask"
        out = _dpa(heads, kv_heads, d_qk, d_v, "bshd", mask, window, scale, dropout)(q, k, v)
        return out.reshape(batch, s_q, heads, d_v), None

    if s_q != s_kv or attention_mask.shape != (batch, s_kv):
        raise NotImplementedError(
            f"a padding mask needs queries and keys of one length (training, prefill): got s_q={s_q}, s_kv={s_kv}, "
            f"mask {tuple(attention_mask.shape)}; decode with a cache through attn_implementation='sdpa'"
        )
    indices, cu_seqlens, max_seqlen = padding_mask_to_cu_seqlens(attention_mask)
    packed = [t.reshape(batch * s_q, t.shape[2], t.shape[3]).index_select(0, indices) for t in (q, k, v)]
    dpa = _dpa(heads, kv_heads, d_qk, d_v, "thd", "padding_causal" if causal else "padding", window, scale, dropout)
    out = dpa(*packed, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
              max_seqlen_kv=max_seqlen).reshape(-1, heads, d_v)
    full = out.new_zeros(batch * s_q, heads, d_v).index_copy(0, indices, out)
    return full.reshape(batch, s_q, heads, d_v), None


def _padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
    """The mask :func:`attention_forward` takes: ``None`` when no token is padding, else the [b, s_kv] mask."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`attention_forward` and its mask function with ``transformers`` under ``name``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise ImportError(
            "transformer_engine.pytorch.integrations.huggingface needs transformers with AttentionInterface "
            "and AttentionMaskInterface: pip install 'deterministic-attention[hf]'"
        ) from err
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _padding_mask)
    return name
