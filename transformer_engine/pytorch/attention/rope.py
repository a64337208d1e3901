"""Rotary position embedding with TransformerEngine's interface: ``RotaryPositionEmbedding`` makes
the angles, ``apply_rotary_pos_emb`` rotates a tensor by them.

Formats: ``sbhd`` ([s, b, h, d]), ``bshd`` ([b, s, h, d]) and ``thd`` ([t, h, d], sequences packed
by ``cu_seqlens``). ``freqs`` is [s2, 1, 1, d2] (angles, any float dtype, used in fp32); the first d2
channels of each head are rotated, the rest pass through. Non-interleaved rotation pairs channel i
with i + d2/2; interleaved pairs 2i with 2i+1 (``freqs`` then repeats each angle twice in a row,
as ``RotaryPositionEmbedding(interleaved=True)`` makes it).

The token at local index ``s`` of a sequence of local length ``L`` takes angle row
``s + start_positions[b]``, and with context parallelism (``cp_size > 1``) the load-balanced
split: the sequence was cut into ``2 * cp_size`` chunks and rank ``r`` holds chunks ``r`` and
``2 * cp_size - 1 - r``, so its first ``L/2`` tokens start at ``r * L/2`` and the rest at
``L * cp_size - (r + 1) * L/2``. In ``thd`` ``cu_seqlens`` are the global (padded) boundaries; this
rank's are ``cu_seqlens // cp_size``; rows after the last sequence pass through.

The rotation is computed in fp32 and rounded once to the input dtype; the backward applies the
transposed rotation (the rotation by the negated angle) the same way. Both are elementwise, so results
are deterministic, and a token's bits do not depend on batch, packing or CP rank.

``fused=True`` runs one Triton kernel per direction (``common/attention/kernels/rope.py``) on GPU
tensors, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``); other CPU tensors take
the torch path. Both paths use the same fp32 cos/sin tables and the same operations in the same order
(two rounded products, one rounded sum: the kernel is compiled without FMA contraction), so fused and
unfused give the same bits.

Arguments are checked before anything runs, each error naming the argument. The values of
``cu_seqlens`` and ``start_positions`` are checked when they are on the CPU; on a GPU that would wait
for it, so a position outside ``freqs`` there gives NaN in that token's rotated channels (fused) instead.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.common.attention.kernels import rope as rope_kernels
from transformer_engine.pytorch.attention.config import triton_interpreting

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]

_FORMATS = ("sbhd", "bshd", "thd")


class RotaryPositionEmbedding(torch.nn.Module):
    """The rotary angles ``positions x inv_freq`` as a [max_seq_len, 1, 1, dim] fp32 tensor.

    ``dim`` channels (``int(dim * rotary_percent)`` when ``rotary_percent < 1``) get
    ``dim / 2`` frequencies ``rotary_base ** (-2i / dim)``. ``seq_len_interpolation_factor`` divides
    the positions (position interpolation); with ``pretrained_max_position_embeddings`` as well, a
    ``max_seq_len`` beyond ``pretrained * factor`` scales them by ``pretrained / max_seq_len``
    instead. Non-interleaved output is ``[angles, angles]``; interleaved repeats each angle twice.
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[int] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ):
        super().__init__()
        if not isinstance(dim, int) or dim < 2:
            raise ValueError(f"`dim` must be an int >= 2, got {dim!r}")
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"`rotary_percent` must be in (0, 1], got {rotary_percent}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        factor = self.seq_len_interpolation_factor
        pretrained = self.pretrained_max_position_embeddings
        if factor is not None and pretrained is not None:
            if max_seq_len > pretrained * factor:
                seq *= 1 / (max_seq_len / pretrained)
            else:
                seq *= 1 / factor
        angles = torch.outer(seq, self.inv_freq)
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((angles, angles), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


def _tables(freqs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles, fp32 [s2, d2]: computed once per call, and the same values for the
    fused and the unfused path (each gathers a token's row from them)."""
    rows = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    return torch.cos(rows).contiguous(), torch.sin(rows).contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
            transpose: bool) -> torch.Tensor:
    """``x * cos + R(x) * sin`` on the first d2 channels in fp32 (``transpose``: the adjoint,
    ``x * cos + R^T(x * sin)``), rounded once to x's dtype; the other channels copied."""
    d2 = cos.shape[-1]
    xr = x[..., :d2].float()
    y = xr * sin if transpose else xr
    if interleaved:
        even, odd = y[..., 0::2], y[..., 1::2]
        pair = (odd, -even) if transpose else (-odd, even)
        rotated = torch.stack(pair, dim=-1).flatten(-2)
    else:
        first, second = y[..., : d2 // 2], y[..., d2 // 2:]
        rotated = torch.cat((second, -first) if transpose else (-second, first), dim=-1)
    out = xr * cos + (rotated if transpose else rotated * sin)
    out = out.to(x.dtype)
    if d2 == x.shape[-1]:
        return out
    return torch.cat((out, x[..., d2:]), dim=-1)


class _RotaryFunction(torch.autograd.Function):
    """Rotation by per-token angles (cos, sin broadcast against t); backward is the transpose."""

    @staticmethod
    def forward(ctx, t, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate(t, cos, sin, interleaved, transpose=False)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        return _rotate(grad_out, cos, sin, ctx.interleaved, transpose=True), None, None, None


def _launch(x: torch.Tensor, cos, sin, tensor_format, cu_seqlens, start_positions, cp_size, cp_rank,
            interleaved, backward) -> torch.Tensor:
    """The Triton kernel (common/attention/kernels/rope.py) into a new contiguous tensor of x's shape and dtype,
    on x's device (its CUDA device made current: Triton launches on the current one)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kwargs = dict(cu_seqlens=cu_seqlens, start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank,
                  interleaved=interleaved, backward=backward)
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):
            return rope_kernels.rope(x, out, cos, sin, tensor_format, **kwargs)
    return rope_kernels.rope(x, out, cos, sin, tensor_format, **kwargs)


class _FusedRotaryFunction(torch.autograd.Function):
    """The rotation as one Triton kernel per direction; positions are found in the kernel."""

    @staticmethod
    def forward(ctx, t, cos, sin, tensor_format, cu_seqlens, start_positions, cp_size, cp_rank, interleaved):
        ctx.save_for_backward(cos, sin, cu_seqlens, start_positions)
        ctx.config = (tensor_format, cp_size, cp_rank, interleaved)
        return _launch(t, cos, sin, tensor_format, cu_seqlens, start_positions, cp_size, cp_rank, interleaved,
                       backward=False)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin, cu_seqlens, start_positions = ctx.saved_tensors
        tensor_format, cp_size, cp_rank, interleaved = ctx.config
        grad = _launch(grad_out, cos, sin, tensor_format, cu_seqlens, start_positions, cp_size, cp_rank,
                       interleaved, backward=True)
        return (grad,) + (None,) * 8


def _cp_positions(local: torch.Tensor, length: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of local indices under the load-balanced 2 * cp_size chunk split."""
    if cp_size == 1:
        return local
    half = length // 2
    return torch.where(local < half, local + cp_rank * half, local + length * cp_size - (cp_rank + 1) * half - half)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)


def _describe(x) -> str:
    return f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def _check_args(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank) -> None:
    """What the arguments' types, shapes and dtypes must be (no values read: nothing waits for a GPU)."""
    if tensor_format not in _FORMATS:
        raise ValueError(f"`tensor_format` must be one of {_FORMATS}, got {tensor_format!r}")
    if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
        raise ValueError(f"`t` must be a float32, float16 or bfloat16 tensor, got {_describe(t)}")
    want_dim = 3 if tensor_format == "thd" else 4
    if t.dim() != want_dim:
        raise ValueError(f"`t` must have {want_dim} dims in {tensor_format!r} format, got shape {tuple(t.shape)}")
    if not isinstance(freqs, torch.Tensor) or not freqs.is_floating_point():
        raise ValueError(f"`freqs` must be a floating-point tensor, got {_describe(freqs)}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"`freqs` must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    if freqs.device != t.device:
        raise ValueError(f"`freqs` must be on t's device ({t.device}), got {freqs.device}")
    d2 = freqs.shape[-1]
    if d2 % 2 or d2 > t.shape[-1] or d2 == 0:
        raise ValueError(f"`freqs` must have an even last dim (the rotary dim) of at most t's head dim "
                         f"{t.shape[-1]}, got {d2}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"`cp_size` must be a positive int, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"`cp_rank` must be in [0, cp_size={cp_size}), got {cp_rank!r}")
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("`cu_seqlens` must be given when tensor_format='thd', got None")
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in _INT_DTYPES
                or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
            raise ValueError(f"`cu_seqlens` must be a 1-D int32 or int64 tensor of b + 1 >= 2 boundaries, got "
                             f"{_describe(cu_seqlens)}")
        batch = cu_seqlens.numel() - 1
    else:
        if cu_seqlens is not None:
            raise ValueError(f"`cu_seqlens` must be None when tensor_format={tensor_format!r}, got a tensor")
        batch = t.shape[1] if tensor_format == "sbhd" else t.shape[0]
    if start_positions is not None and (
            not isinstance(start_positions, torch.Tensor) or start_positions.dtype not in _INT_DTYPES
            or tuple(start_positions.shape) != (batch,)):
        raise ValueError(f"`start_positions` must be a 1-D int32 or int64 tensor of the {batch} sequences' "
                         f"offsets, got {_describe(start_positions)}")


def _check_positions(t, s2, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank) -> None:
    """What the values of ``cu_seqlens`` and ``start_positions`` must be, checked where they are on the host
    (reading a GPU tensor would wait for it; the kernel then writes NaN for a row outside ``freqs``)."""
    on_host = lambda x: x is None or x.device.type == "cpu"  # noqa: E731
    start = None
    if start_positions is not None and on_host(start_positions):
        start = start_positions.to(torch.int64)
        if bool((start < 0).any()):
            raise ValueError(f"`start_positions` must be non-negative, got {start_positions.tolist()}")
    if tensor_format == "thd":
        if not on_host(cu_seqlens):
            return
        cu = cu_seqlens.to(torch.int64)
        if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
            raise ValueError(f"`cu_seqlens` must start at 0 and never decrease, got {cu_seqlens.tolist()}")
        if cp_size > 1 and bool((cu.diff() % (2 * cp_size) != 0).any()):
            raise ValueError(f"`cu_seqlens` must give every sequence a length divisible by 2 * cp_size = "
                             f"{2 * cp_size}, got {cu_seqlens.tolist()}")
        if int(cu[-1]) // cp_size > t.shape[0]:
            raise ValueError(f"`cu_seqlens` must end at most at t's {t.shape[0]} tokens"
                             f"{f' times cp_size = {cp_size}' if cp_size > 1 else ''}, got {cu_seqlens.tolist()}")
        lengths = cu.diff() // cp_size
    else:
        length = t.shape[0 if tensor_format == "sbhd" else 1]
        if cp_size > 1 and length % 2:
            raise ValueError(f"`t` must have an even sequence length with cp_size > 1, got {length}")
        lengths = torch.full((t.shape[1 if tensor_format == "sbhd" else 0],), length, dtype=torch.int64)
    if start_positions is not None and start is None:
        return
    # The last position of each sequence: its length, or with CP the end of this rank's second chunk.
    last = lengths - 1 if cp_size == 1 else lengths * cp_size - cp_rank * (lengths // 2) - 1
    if start is not None:
        last = last + start
    last = last[lengths > 0]
    if last.numel() and int(last.max()) >= s2:
        raise ValueError(f"`freqs` must have at least {int(last.max()) + 1} positions for these tokens, got {s2}")


def _angles(t, cos_table, sin_table, tensor_format, start_positions, cu_seqlens, cp_size,
            cp_rank) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each token's rows of the cos and sin tables, shaped to broadcast against ``t`` (heads dim of size 1)."""
    device = cos_table.device
    d2 = cos_table.shape[-1]
    if tensor_format == "thd":
        bounds = cu_seqlens.to(device=device, dtype=torch.int64) // cp_size
        token = torch.arange(t.shape[0], device=device)
        seq = (torch.searchsorted(bounds, token, right=True) - 1).clamp(0, bounds.numel() - 2)
        start, end = bounds[seq], bounds[seq + 1]
        inside = token < bounds[-1]
        pos = _cp_positions(token - start, end - start, cp_size, cp_rank)
        if start_positions is not None:
            pos = pos + start_positions.to(device=device, dtype=torch.int64)[seq]
        pos = torch.where(inside, pos, torch.zeros_like(pos))
        shape = (t.shape[0], 1, d2)
    else:
        seq_dim = 0 if tensor_format == "sbhd" else 1
        length = t.shape[seq_dim]
        pos = _cp_positions(torch.arange(length, device=device), torch.tensor(length, device=device), cp_size, cp_rank)
        pos = pos[:, None]  # [s, 1]
        if start_positions is not None:
            pos = pos + start_positions.to(device=device, dtype=torch.int64)[None, :]  # [s, b]
        inside = None
        if tensor_format == "bshd":
            pos = pos.t()
        shape = pos.shape + (1, d2)
    index = pos.reshape(-1)
    cos, sin = cos_table[index].reshape(shape), sin_table[index].reshape(shape)
    if inside is not None:  # rows after the last sequence pass through
        keep = inside.reshape(-1, 1, 1)
        cos = torch.where(keep, cos, torch.ones_like(cos))
        sin = torch.where(keep, sin, torch.zeros_like(sin))
    return cos, sin


def apply_rotary_tables(t: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, tensor_format: str = "bshd",
                        start_positions: Optional[torch.Tensor] = None, interleaved: bool = False) -> torch.Tensor:
    """:func:`apply_rotary_pos_emb`'s unfused rotation from given cos and sin tables (fp32 ``[s2, d2]``, one row per
    position, the rotary channels in ``interleaved``'s pairing) instead of ``freqs``: for callers that hold the
    tables, as flash-attn's KV-cache call does. sbhd or bshd; nothing checked or read on the host."""
    cos, sin = _angles(t, cos_table.float(), sin_table.float(), tensor_format, start_positions, None, 1, 0)
    return _RotaryFunction.apply(t, cos, sin, bool(interleaved))


def _kernel_runs(t: torch.Tensor) -> bool:
    """Whether ``fused=True`` launches the Triton kernel for ``t``: on a GPU, and on the CPU under Triton's
    interpreter (TRITON_INTERPRET=1); otherwise the torch path, which gives the same bits."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreting())


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Rotates ``t`` ([s, b, h, d], [b, s, h, d] or [t, h, d] by ``tensor_format``) by the angles
    ``freqs`` ([s2, 1, 1, d2], d2 <= d): see the module docstring for positions, ``start_positions``
    ([b], per-sequence offsets), ``cu_seqlens`` ([b + 1], thd; the padded boundaries with CP) and
    ``cp_size``/``cp_rank``. Returns a tensor of t's shape and dtype; differentiable in ``t``.
    ``fused=True`` runs one Triton kernel per direction on a GPU (and on the CPU under Triton's
    interpreter); the results are the unfused path's, bitwise."""
    _check_args(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    _check_positions(t, freqs.shape[0], tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    cos_table, sin_table = _tables(freqs)
    if fused and _kernel_runs(t):
        on_device = lambda x: None if x is None else x.to(t.device)  # noqa: E731
        return _FusedRotaryFunction.apply(t, cos_table, sin_table, tensor_format, on_device(cu_seqlens),
                                          on_device(start_positions), cp_size, cp_rank, bool(interleaved))
    cos, sin = _angles(t, cos_table, sin_table, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    return _RotaryFunction.apply(t, cos, sin, bool(interleaved))
