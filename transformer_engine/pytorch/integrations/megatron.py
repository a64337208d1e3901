"""Megatron-core's CUDA-graph decode on this project's attention.

Megatron-core (0.19.2) captures a decode step in CUDA graphs (``cuda_graph_impl="local"``) only with static
batching and ``flash_decode=True``: its ``Attention`` then refuses the ordinary decode call ("CUDA graphs
must use flash decode with static batching!") and calls the module-level ``flash_attn_with_kvcache`` of
``megatron.core.transformer.attention`` (flash-attn's) instead of ``core_attention``. Dynamic batching calls
flash-attn's varlen kernels directly. So no decode step that Megatron captures reaches
:class:`~transformer_engine.pytorch.DotProductAttention` on its own.

:func:`flash_attn_with_kvcache` takes the arguments Megatron passes there and runs the step on
:class:`~transformer_engine.pytorch.DotProductAttention`; :func:`install` puts it in Megatron's module::

    from transformer_engine.pytorch.integrations import megatron as te_megatron

    te_megatron.install()            # once per process (returns what it replaced; uninstall(previous))
    config = TransformerConfig(..., flash_decode=True, cuda_graph_impl="local")

Everything a step does depends on tensors only (``cache_seqlens`` on the device, shapes fixed by the cache),
so the step can be captured once and replayed at every later position: the new keys and values are scattered
into the cache at each sequence's length, and attention is one ``bshd`` call over the whole cache
(``max_seqlen_kv`` = its capacity) with ``padding`` lengths ``cache_seqlens + new tokens`` given as
``cu_seqlens``, which reads nothing on the host while a graph is captured. Its rows are the rows of a call over
exactly the cached keys (the kernels skip the keys past each length), so with graphs on or off, and with
``flash_decode`` on or off, a step gives the same bits.
"""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

import torch

from transformer_engine.pytorch.attention.rope import apply_rotary_tables

__all__ = ["flash_attn_with_kvcache", "install", "uninstall", "MEGATRON_ATTENTION_MODULE"]

MEGATRON_ATTENTION_MODULE = "megatron.core.transformer.attention"

# One DotProductAttention per (heads, kv heads, head dims, scale, causal): the module holds no per-step state,
# and keeping it keeps its per-signature caches warm from one step to the next.
_MODULES: Dict[tuple, torch.nn.Module] = {}


def _module(h: int, hk: int, d: int, dv: int, scale: Optional[float], causal: bool) -> torch.nn.Module:
    from transformer_engine.pytorch import DotProductAttention

    key = (h, hk, d, dv, scale, causal)
    if key not in _MODULES:
        kv_channels = d if d == dv else (d, dv)
        # A one-token step sees every cached key either way; a longer step is causal within its new tokens
        # when asked, aligned to the cache's end (flash-attn's causal convention).
        mask = "padding_causal_bottom_right" if causal else "padding"
        _MODULES[key] = DotProductAttention(h, kv_channels, num_gqa_groups=hk, qkv_format="bshd",
                                            attn_mask_type=mask, softmax_scale=scale).eval()
    return _MODULES[key]


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                            rotary_cos: Optional[torch.Tensor] = None, rotary_sin: Optional[torch.Tensor] = None,
                            cache_seqlens: Optional[torch.Tensor] = None, cache_batch_idx=None, block_table=None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), rotary_interleaved: bool = True,
                            return_softmax_lse: bool = False, **unsupported):
    """A decode step over a KV cache, with flash-attn's ``flash_attn_with_kvcache`` arguments (the ones
    Megatron passes), on :class:`~transformer_engine.pytorch.DotProductAttention`.

    ``q`` [b, s, h, d]; ``k_cache``, ``v_cache`` [b_cache >= b, S, h_kv, d] (views are fine: the new rows are
    written through them); ``k``, ``v`` [b, s, h_kv, d], the step's new keys and values, written at rows
    ``cache_seqlens[i]`` ... of sequence ``i`` (int32 [b] on the device; None: the cache is empty); ``rotary_cos``,
    ``rotary_sin`` [>= S, r/2]: RoPE applied to ``q`` and ``k`` at those positions before the write. Returns
    [b, s, h, d_v]. Not implemented (``NotImplementedError``): ``cache_batch_idx``, ``block_table``,
    sliding windows, ``return_softmax_lse`` and other flash-attn arguments.
    """
    if cache_batch_idx is not None or block_table is not None or tuple(window_size) != (-1, -1) \
            or return_softmax_lse or any(v_ is not None and v_ is not False for v_ in unsupported.values()):
        given = [n for n, v_ in dict(cache_batch_idx=cache_batch_idx, block_table=block_table,
                                     return_softmax_lse=return_softmax_lse or None, **unsupported).items()
                 if v_ is not None and v_ is not False]
        if tuple(window_size) != (-1, -1):
            given.append("window_size")
        raise NotImplementedError(f"flash_attn_with_kvcache on this package: not implemented: {given}")
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass both k and v, or neither")
    b, s, h, d = q.shape
    cap, hk = k_cache.shape[1], k_cache.shape[2]
    kc, vc = k_cache[:b], v_cache[:b]  # Megatron's cache has max_batch_size rows; the step uses the first b
    device = q.device
    lens = (torch.zeros(b, dtype=torch.int32, device=device) if cache_seqlens is None
            else cache_seqlens.to(device=device, dtype=torch.int32).expand(b))
    positions = lens[:, None].long() + torch.arange(s, device=device)[None, :]  # [b, s]: the new tokens'
    if rotary_cos is not None:
        # flash-attn's tables hold one value per channel pair: widened to the rotary channels' pairing, the
        # rotation is the package's own (attention/rope.py), each sequence starting at its cached length.
        def widen(table):
            table = table.reshape(table.shape[0], -1)
            return table.repeat_interleave(2, dim=-1) if rotary_interleaved else torch.cat((table, table), dim=-1)

        cos, sin = widen(rotary_cos), widen(rotary_sin)
        q = apply_rotary_tables(q, cos, sin, "bshd", start_positions=lens, interleaved=rotary_interleaved)
        if k is not None:
            k = apply_rotary_tables(k, cos, sin, "bshd", start_positions=lens, interleaved=rotary_interleaved)
    new = 0
    if k is not None:
        # Scatter through the views into the caller's cache (an index_put on the device: no host read, so
        # a captured step writes at whatever lengths the replayed cache_seqlens hold).
        rows = torch.arange(b, device=device)[:, None].expand(b, s)
        kc[rows, positions] = k.to(kc.dtype)
        vc[rows, positions] = v.to(vc.dtype)
        new = s
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    cu_kv = torch.cat((zero, torch.cumsum(lens + new, 0, dtype=torch.int32)))
    dpa = _module(h, hk, d, vc.shape[-1], softmax_scale, bool(causal) and s > 1)
    # max_seqlen_kv is the cache's capacity whatever the lengths: the call is the same at every step.
    out = dpa(q, kc, vc, qkv_format="bshd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=s,
              max_seqlen_kv=cap)
    return out.view(b, s, h, vc.shape[-1])  # flash-attn's layout (DotProductAttention merges the heads)


def install(module: str = MEGATRON_ATTENTION_MODULE):
    """Make Megatron's flash decode call :func:`flash_attn_with_kvcache`; returns the function it replaced
    (flash-attn's, or None when flash-attn is not installed), for :func:`uninstall`."""
    mod = importlib.import_module(module)
    previous = getattr(mod, "flash_attn_with_kvcache", None)
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    return previous


def uninstall(previous, module: str = MEGATRON_ATTENTION_MODULE) -> None:
    """Put back what :func:`install` replaced."""
    importlib.import_module(module).flash_attn_with_kvcache = previous
