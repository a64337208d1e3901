"""Shared plumbing for the DotProductAttention tests: device, an independent fp64 reference, tolerances.

The reference loops over sequences and states TransformerEngine's mask semantics directly
(query i of a sequence sees key j when ``i + d - left <= j <= i + d + right``, d = 0 for
causal/padding_causal and len_kv - len_q otherwise; ``bottom_right=False`` makes d = 0 for the
non-causal masks, TransformerEngine's ``bottom_right_diagonal``). Errors are judged against PyTorch's own error
in the inputs' dtype on the same inputs: ``err(ours) <= 2 * err(torch low precision) + atol``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"

requires_fused = pytest.mark.skipif(
    not ON_GPU and not INTERPRET,
    reason="fused kernels need a GPU, or TRITON_INTERPRET=1 set before triton is imported (CPU interpreter)",
)
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

# The Triton interpreter computes tl.dot on bfloat16 wrongly: bf16 runs on the GPU only.
LOWP_DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]
ALL_MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(shape, dtype, g: torch.Generator, requires_grad: bool = True, scale: float = 1.0) -> torch.Tensor:
    t = (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)
    return t.requires_grad_(requires_grad)


def to_bshd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t.transpose(0, 1) if fmt == "sbhd" else t


def make_qkv(fmt: str, b: int, sq: int, skv: int, h: int, hk: int, d: int, dv: int, dtype, seed: int = 0):
    """Leaf q, k, v in ``fmt`` ('bshd' or 'sbhd')."""
    g = gen(seed)
    shapes = [(b, sq, h, d), (b, skv, hk, d), (b, skv, hk, dv)]
    if fmt == "sbhd":
        shapes = [(s[1], s[0]) + s[2:] for s in shapes]
    return tuple(randn(s, dtype, g) for s in shapes)


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def diagonal(lq: int, lk: int, mask: str, bottom_right: Optional[bool] = None) -> int:
    """The diagonal offset d of windows and ALiBi, by TransformerEngine-PyTorch's rule: causal masks fix
    it (top-left / bottom-right), the others take ``bottom_right`` (None: bottom-right)."""
    if mask in ("causal", "padding_causal"):
        return 0
    if "bottom_right" in mask or bottom_right is None or bottom_right:
        return lk - lq
    return 0


def visible(lq: int, lk: int, mask: str, window: Tuple[int, int], bottom_right: Optional[bool] = None) -> torch.Tensor:
    """[lq, lk] bool: what query i of one sequence sees."""
    left, right = window
    if "causal" in mask:
        right = 0
    diag = diagonal(lq, lk, mask, bottom_right)
    rel = torch.arange(lk)[None, :] - (torch.arange(lq)[:, None] + diag)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    return keep


def reference(q, k, v, mask: str = "no_mask", window=(-1, -1), scale: Optional[float] = None,
              lens_q: Optional[Sequence[int]] = None, lens_kv: Optional[Sequence[int]] = None,
              bias: Optional[torch.Tensor] = None, pre_scale_bias: bool = False,
              alibi_slopes: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
              dtype=torch.float64, dropout_keep: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              bottom_right: Optional[bool] = None) -> torch.Tensor:
    """Attention on padded bshd tensors, one sequence at a time, computed in ``dtype``.

    q [b, sq, h, d], k/v [b, skv, hk, d/dv] -> [b, sq, h, dv]; rows past a length and rows that
    see no key are zero. ``hidden``: bool [b|1, h|1, sq, skv], True = masked out.
    ``dropout_keep``: bool [b, h, sq, skv], the kept probabilities (scaled by 1 / (1 - dropout_p)).
    """
    b, sq, h, d = q.shape
    skv, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = d ** -0.5 if scale is None else scale
    outs = []
    for n in range(b):
        lq = lens_q[n] if lens_q is not None else sq
        lk = lens_kv[n] if lens_kv is not None else skv
        qi = q[n, :lq].to(dtype)
        ki = k[n, :lk].to(dtype).repeat_interleave(h // hk, dim=1)
        vi = v[n, :lk].to(dtype).repeat_interleave(h // hk, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, ki)
        if bias is not None:
            bn = bias[n if bias.shape[0] > 1 else 0][:, :lq, :lk].to(dtype)
            s = (s + bn) * scale if pre_scale_bias else s * scale + bn
        else:
            s = s * scale
        keep = visible(lq, lk, mask, window, bottom_right).to(q.device)
        if alibi_slopes is not None:
            sl = alibi_slopes[n] if alibi_slopes.dim() == 2 else alibi_slopes
            diag = diagonal(lq, lk, mask, bottom_right)
            rel = (torch.arange(lk, device=q.device)[None, :] - torch.arange(lq, device=q.device)[:, None] - diag)
            s = s - sl.to(dtype)[:, None, None] * rel.abs().to(dtype)
        keep = keep.expand(h, lq, lk)
        if hidden is not None:
            keep = keep & ~hidden[n if hidden.shape[0] > 1 else 0][:, :lq, :lk].expand(h, lq, lk)
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros_like(p))
        if dropout_keep is not None:
            p = p * dropout_keep[n][:, :lq, :lk].to(dtype) / (1.0 - dropout_p)
        o = torch.einsum("hqk,khd->qhd", p, vi)
        full = torch.zeros(sq, h, dv, dtype=dtype, device=q.device)
        full = torch.cat([o, full[lq:]], dim=0)
        outs.append(full)
    return torch.stack(outs)


def reference_and_lowp(inputs: Sequence[torch.Tensor], d_out: torch.Tensor, fn) -> List[List[torch.Tensor]]:
    """[fp64 results, results in the inputs' dtype] of ``fn(*inputs, dtype=...)`` and its grads."""
    results = []
    for dtype in (torch.float64, inputs[0].dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        out = fn(*leaves, dtype=dtype)
        grads = torch.autograd.grad(out, leaves, d_out.to(dtype), allow_unused=True)
        results.append([out] + [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)])
    return results


def max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours.detach().to(torch.float64) - ref.detach().to(torch.float64)).abs().max().item() if ref.numel() else 0.0


def assert_close_to_reference(name: str, ours: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor,
                              factor: float = 2.0) -> None:
    """Our error vs fp64 within ``factor`` x PyTorch's own low-precision error, plus a tiny atol."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(ours.detach().to(torch.float64)).all(), f"{name}: non-finite values"
    err, base = max_err(ours, ref), max_err(lowp, ref)
    atol = {torch.float32: 1e-5, torch.float64: 1e-10}.get(ours.dtype, 1e-3)
    assert err <= factor * base + atol, f"{name}: max error {err:.3e} > {factor} x torch's {base:.3e} + {atol}"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """torch.use_deterministic_algorithms for one block, restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


class SelectionSpy:
    """Wraps ``transformer_engine.pytorch.attention.backends.select``; records each config and selection.
    While installed, DotProductAttention keeps no decisions per call signature (``signature_cache``), so every
    call selects and is recorded (tests/pytorch/test_signature_cache.py tests the cache)."""

    def __init__(self, monkeypatch) -> None:
        from transformer_engine.pytorch.attention import backends as attn_config
        from transformer_engine.pytorch.attention import dot_product_attention

        monkeypatch.setattr(dot_product_attention._PREPARED_CALLS, "enabled", False)

        self.configs: List = []
        self.selections: List = []
        original = attn_config.select

        def spy(config, *args, **kwargs):
            self.configs.append(config)
            selection = original(config, *args, **kwargs)
            self.selections.append(selection)
            return selection

        monkeypatch.setattr(attn_config, "select", spy)

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.selections]

    def rejected(self, index: int = -1) -> Dict[str, List[str]]:
        return self.selections[index].rejected
