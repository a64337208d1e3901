"""fp64 reference attention on padded (b, s, h, d) tensors with per-sequence lengths."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


def visible_mask(len_q: int, len_k: int, sq: int, sk: int, mask: str, window: Tuple[int, int]) -> torch.Tensor:
    """[sq, sk] bool, TransformerEngine semantics (rows/cols past the lengths invisible)."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    left, right = window
    if "causal" in mask:
        right = 0
    diag = 0 if mask in ("causal", "padding_causal") else len_k - len_q
    keep = (i < len_q) & (j < len_k)
    if right >= 0:
        keep &= (j - (i + diag)) <= right
    if left >= 0:
        keep &= (j - (i + diag)) >= -left
    return keep


def reference_attention(q, k, v, mask: str = "no_mask", window=(-1, -1), scale: Optional[float] = None,
                        lens_q: Optional[Sequence[int]] = None, lens_k: Optional[Sequence[int]] = None,
                        dtype=torch.float64, bias=None, alibi_slopes=None, dropout_keep=None, dropout_p=0.0):
    """q [b, sq, h, d], k/v [b, sk, hk, d]; returns [b, sq, h, dv] in ``dtype`` (zeros where unseen).

    ``bias`` [b|1, h|1, sq, sk] is added after scaling; ``alibi_slopes`` [h] or [b, h] adds
    ``-slope * |j - (i + d)|``; ``dropout_keep`` [b, h, sq, sk] bool drops probabilities.
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    k = k.repeat_interleave(h // hk, 2)
    v = v.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    keep = torch.stack([
        visible_mask(lens_q[i] if lens_q else sq, lens_k[i] if lens_k else sk, sq, sk, mask, window)
        for i in range(b)
    ])[:, None].to(s.device)
    if bias is not None:
        s = s + bias.to(dtype)
    if alibi_slopes is not None:
        i = torch.arange(sq, device=s.device).view(sq, 1)
        j = torch.arange(sk, device=s.device).view(1, sk)
        slopes = alibi_slopes.to(dtype).view(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1) \
            if alibi_slopes.dim() == 2 else alibi_slopes.to(dtype).view(1, h, 1, 1)
        rows = []
        for bi in range(b):
            lq, lk = (lens_q[bi] if lens_q else sq), (lens_k[bi] if lens_k else sk)
            d = 0 if mask in ("causal", "padding_causal") else lk - lq
            rows.append(-(j - (i + d)).abs().to(dtype))
        s = s + torch.stack(rows)[:, None] * slopes
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if dropout_keep is not None:
        p = p * dropout_keep.to(dtype) / (1.0 - dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)
