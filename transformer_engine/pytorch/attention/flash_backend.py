"""flash-attn-4 (``flash_attn.cute``, CuTe DSL) behind the project's fused-attention call.

:func:`flash_attn_func` takes the arguments of
:func:`transformer_engine.pytorch.attention.fused_attn.fused_attn_func` and gives the same
answer, computed by flash-attn-4's ``flash_attn_func`` / ``flash_attn_varlen_func``:

- ``bshd`` goes to flash-attn as it is, ``sbhd`` as transposed views. Padding masks (``bshd`` /
  ``sbhd`` with ``cu_seqlens``) and ``thd`` go to the varlen call: ``cu_seqlens`` there are where
  sequences start (``cu_seqlens_*_padded`` when given, multiples of s for padded batches) and
  ``seqused`` how many tokens each sequence has.
- flash-attn aligns causal masks and windows bottom-right (query i of a sequence sees keys up to
  ``i + s_kv - s_q``), as TransformerEngine does for every mask but ``causal`` and
  ``padding_causal``, which are top-left. The two agree when s_q == s_kv. When s_kv > s_q, no query
  sees a key past s_q under a top-left causal mask, so flash-attn gets the first s_q keys only
  (a slice, or ``seqused_k = min(len_kv, len_q)``) and the answer is exact. s_kv < s_q cannot be
  expressed: :class:`~transformer_engine.common.attention.backends.FlashAttention` declares it as
  a reason for static shapes; for per-sequence lengths given by distinct ``cu_seqlens_q`` and
  ``cu_seqlens_kv`` this function checks (one host sync) and raises ``NotImplementedError``.
- flash-attn leaves tokens outside every sequence unwritten (output and dQ/dK/dV): they are set
  to zero here, as the fused kernels do.

GQA/MQA and sliding windows are native. ``deterministic`` is passed through to flash-attn's
backward (ordered dQ/dK/dV accumulation behind semaphores). Everything else flash-attn-4 cannot do
(dropout, bias, fp32, arbitrary masks, head dims) is declared by the backend class, so selection
never routes such a call here.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional, Tuple

import torch

from transformer_engine.common.attention.backends import FlashAttention
from transformer_engine.common.attention.enums import AttnMaskType, QKVFormat
from transformer_engine.common.attention.kernels.fill import zero_outside_sequences

__all__ = ["flash_attn_func", "flash_attention", "unavailable_reason"]


@functools.lru_cache(maxsize=1)
def _import_error() -> Optional[str]:
    """Why ``flash_attn.cute`` does not import (None when it does); tried once per process."""
    try:
        importlib.import_module("flash_attn.cute")
    except ModuleNotFoundError as err:
        if err.name in ("flash_attn", "flash_attn.cute"):
            return "flash-attn-4 is not installed (pip install .[flash])"
        return f"flash_attn.cute failed to import: ModuleNotFoundError: {err}"
    except Exception as err:  # any import failure means the backend cannot run
        return f"flash_attn.cute failed to import: {type(err).__name__}: {err}"
    return None


def unavailable_reason() -> Optional[str]:
    """None when flash-attn-4 can run on the current CUDA device, else why not.

    The device check comes first, so a machine without a Hopper/Blackwell GPU never imports the
    (slow to import) CuTe DSL; the import is tried once per process.
    """
    if not torch.cuda.is_available():
        return "no CUDA device (flash-attn-4 needs an SM90 or SM100 GPU)"
    if torch.version.hip is not None:
        return "ROCm device: flash-attn-4 runs on NVIDIA SM90 and SM100 GPUs only"
    major, minor = torch.cuda.get_device_capability()
    if major not in FlashAttention.SUPPORTED_ARCHS:
        return f"compute capability ({major}, {minor}): flash-attn-4 runs on SM90 and SM100 here"
    return _import_error()


def _flash_attn_cute():
    return importlib.import_module("flash_attn.cute")


class _ZeroGradOutside(torch.autograd.Function):
    """Identity forward; the backward zeroes the gradient rows of tokens outside every sequence
    (flash-attn does not write them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, starts: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(starts, used)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        starts, used = ctx.saved_tensors
        # flash-attn's gradients are fresh dense tensors: cleared in place, gap rows only.
        grad = grad if grad.is_contiguous() else grad.contiguous()
        return zero_outside_sequences(grad, starts, used), None, None


def _fa_window(mask: AttnMaskType, window_size: Tuple[int, int]) -> Tuple[Optional[int], Optional[int]]:
    """TransformerEngine's (left, right), -1 = unbounded, as flash-attn's (left, right), None = unbounded
    (the backend class's rule, which the JAX frontend passes too)."""
    return FlashAttention.window_arguments(mask, window_size)


def _check_top_left_lengths(lens_q: torch.Tensor, lens_kv: torch.Tensor, mask: AttnMaskType) -> None:
    """A top-left causal mask needs len_kv >= len_q in every sequence (one host sync)."""
    if bool((lens_kv < lens_q).any()):
        raise NotImplementedError(
            f"attn_mask_type={mask.value!r} (top-left causal) with a sequence that has fewer keys than queries "
            "cannot run on flash-attn-4, which aligns causal masks bottom-right; use "
            "'padding_causal_bottom_right', or NVTE_FLASH_ATTN=0 for the fused backend"
        )


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv_format: str,
    attn_mask_type: str,
    window_size: Tuple[int, int],
    softmax_scale: float,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention on flash-attn-4 with ``fused_attn_func``'s arguments and semantics.

    Shapes: ``bshd`` [b, s, h, d], ``sbhd`` [s, b, h, d], ``thd`` [t, h, d] (sequences delimited by
    ``cu_seqlens_*``, int32 [b+1]; ``cu_seqlens_*_padded`` give their starts when there are gaps).
    Query head ``i`` uses key/value head ``i // (h_q // h_kv)``. Padded positions and rows that see
    no key are zero. Returns q's format with head dim d_v. Differentiable; with
    ``deterministic=True`` flash-attn's backward accumulates in a fixed order (bitwise repeatable).
    """
    return flash_attention(q, k, v, QKVFormat(qkv_format), AttnMaskType(attn_mask_type), tuple(window_size),
                           float(softmax_scale), cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                           cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, bool(deterministic))


# flash-attn compiles its kernels at the first call of each configuration (CuTe DSL) and takes raw
# pointers: under torch.compile it runs as an opaque region (a graph break), not traced.
@torch.compiler.disable
def flash_attention(q, k, v, fmt: QKVFormat, mask: AttnMaskType, window_size, softmax_scale: float,
                    cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                    max_seqlen_q, max_seqlen_kv, deterministic: bool) -> torch.Tensor:
    """:func:`flash_attn_func` on converted arguments (DotProductAttention's backend runner calls this)."""
    fa = _flash_attn_cute()
    options = dict(softmax_scale=softmax_scale, causal=mask.is_causal(), window_size=_fa_window(mask, window_size),
                   num_splits=1, deterministic=deterministic)
    top_left = mask.is_top_left_causal()

    if fmt != QKVFormat.THD and not mask.is_padding():
        qb, kb, vb = (t.transpose(0, 1) if fmt == QKVFormat.SBHD else t for t in (q, k, v))
        sq, skv = qb.shape[1], kb.shape[1]
        if top_left and skv > sq:  # keys past s_q are never visible: bottom-right == top-left on the rest
            kb, vb = kb.narrow(1, 0, sq), vb.narrow(1, 0, sq)
        elif top_left and skv < sq:
            raise NotImplementedError(
                f"attn_mask_type={mask.value!r} (top-left causal) with s_q={sq} > s_kv={skv} cannot run on "
                "flash-attn-4 (causal masks aligned bottom-right); use 'causal_bottom_right' or the fused backend"
            )
        out, _ = fa.flash_attn_func(qb, kb, vb, **options)
        return out.transpose(0, 1) if fmt == QKVFormat.SBHD else out

    if cu_seqlens_q is None or cu_seqlens_kv is None:
        raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_kv` must be given for qkv_format={fmt.value!r}, "
                         f"attn_mask_type={mask.value!r}")
    same_lengths = cu_seqlens_kv is cu_seqlens_q
    lens_q = torch.diff(cu_seqlens_q)
    lens_kv = lens_q if same_lengths else torch.diff(cu_seqlens_kv)
    seqused_q = seqused_kv = None
    if fmt == QKVFormat.THD:
        qt, kt, vt = q, k, v
        starts_q, starts_kv = cu_seqlens_q, cu_seqlens_kv
        if cu_seqlens_q_padded is not None:
            starts_q, seqused_q = cu_seqlens_q_padded, lens_q
        if cu_seqlens_kv_padded is not None:
            starts_kv, seqused_kv = cu_seqlens_kv_padded, lens_kv
        if max_seqlen_q is None or max_seqlen_kv is None:
            # One host sync; pass max_seqlen_* to avoid it.
            max_seqlen_q, max_seqlen_kv = int(lens_q.max().item()), int(lens_kv.max().item())
    else:
        # Padded batch as packed tokens: sequence n starts at n * s and has cu_seqlens' length.
        qb, kb, vb = (t.transpose(0, 1) if fmt == QKVFormat.SBHD else t for t in (q, k, v))
        batch, max_seqlen_q, max_seqlen_kv = qb.shape[0], qb.shape[1], kb.shape[1]
        qt, kt, vt = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (qb, kb, vb))
        offsets = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
        starts_q, starts_kv = offsets * max_seqlen_q, offsets * max_seqlen_kv
        seqused_q, seqused_kv = lens_q, lens_kv
    if top_left and not same_lengths:
        _check_top_left_lengths(lens_q, lens_kv, mask)
        seqused_kv = torch.minimum(lens_kv, lens_q)  # keys past len_q are never visible

    def as_int32(t):
        return None if t is None else t.to(torch.int32).contiguous()

    starts_q, starts_kv, seqused_q, seqused_kv = map(as_int32, (starts_q, starts_kv, seqused_q, seqused_kv))
    used_q = as_int32(lens_q) if seqused_q is None else seqused_q
    used_kv = as_int32(lens_kv) if seqused_kv is None else seqused_kv
    if torch.is_grad_enabled():
        qt = _ZeroGradOutside.apply(qt, starts_q, used_q) if qt.requires_grad else qt
        kt = _ZeroGradOutside.apply(kt, starts_kv, used_kv) if kt.requires_grad else kt
        vt = _ZeroGradOutside.apply(vt, starts_kv, used_kv) if vt.requires_grad else vt

    out, _ = fa.flash_attn_varlen_func(
        qt, kt, vt, cu_seqlens_q=starts_q, cu_seqlens_k=starts_kv,
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_kv),
        seqused_q=seqused_q, seqused_k=seqused_kv, **options,
    )
    # Gap rows cleared by a Triton kernel, which bumps no autograd version counter: flash-attn
    # saves `out` for its backward but reads only rows inside sequences, so this is safe, and it
    # avoids a copy of the whole output.
    zero_outside_sequences(out, starts_q, used_q)
    if fmt == QKVFormat.THD:
        return out
    out = out.view(batch, max_seqlen_q, *out.shape[1:])
    return out.transpose(0, 1) if fmt == QKVFormat.SBHD else out
