"""Checks of user input that every backend and both frameworks share (numpy only, no framework).

The frontends call these on the concrete values of their arguments: sequence extents
(``cu_seqlens`` and their padded starts in PyTorch, the segments of a ``SequenceDescriptor`` in
JAX), the softmax scale and the input dtypes. Under ``torch.compile``, CUDA-graph capture or
``jax.jit`` the sequence values are not concrete and are not checked (docs/validation.rst).

Errors: ``ValueError`` for malformed input, messages "`arg` must ..., got ...".
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "check_cu_seqlens_values",
    "check_segments",
    "check_softmax_scale",
    "kernel_scale",
    "check_input_dtype",
]


def _show(values: np.ndarray, limit: int = 16) -> str:
    flat = np.asarray(values).reshape(-1).tolist()
    text = ", ".join(str(v) for v in flat[:limit])
    return f"[{text}{', ...' if len(flat) > limit else ''}]"


def _check_extents(lengths: np.ndarray, starts: np.ndarray, ends: np.ndarray, *, lengths_arg: str,
                   starts_arg: str, capacity: str) -> None:
    """``[rows, m]`` lengths and starts of the sequences of each row, ``[rows]`` end of each row:
    lengths >= 0, every non-empty sequence inside ``[0, end)``, no two of one row overlapping."""
    if (lengths < 0).any():
        raise ValueError(f"{lengths_arg} must give non-negative sequence lengths, got {_show(lengths)}")
    used = lengths > 0
    if (used & (starts < 0)).any():
        raise ValueError(f"{starts_arg} must give non-negative sequence starts, got {_show(starts)}")
    over = used & (starts + lengths > ends[:, None])
    if over.any():
        row, seg = (int(i[0]) for i in np.nonzero(over))
        raise ValueError(
            f"{lengths_arg} must keep every sequence within {capacity} ({int(ends[row])}), got a sequence of "
            f"length {int(lengths[row, seg])} starting at {int(starts[row, seg])}"
        )
    if lengths.shape[1] > 1:
        # Non-empty sequences of a row, in order of their starts (empty ones sort last).
        key = np.where(used, starts, np.iinfo(np.int64).max)
        order = np.argsort(key, axis=1, kind="stable")
        s = np.take_along_axis(starts, order, axis=1)
        n = np.take_along_axis(lengths, order, axis=1)
        u = np.take_along_axis(used, order, axis=1)
        overlap = u[:, 1:] & (s[:, :-1] + n[:, :-1] > s[:, 1:])
        if overlap.any():
            row = int(np.nonzero(overlap.any(axis=1))[0][0])
            raise ValueError(
                f"{starts_arg} must give sequences that do not overlap, got starts {_show(starts[row])} for "
                f"lengths {_show(lengths[row])}"
            )


def check_cu_seqlens_values(
    name: str,
    cu_seqlens: Sequence[int],
    *,
    padded: Optional[Sequence[int]] = None,
    tokens: Optional[int] = None,
    max_seqlen: Optional[int] = None,
    max_seqlen_arg: Optional[str] = None,
) -> None:
    """One side (q or kv) of a PyTorch call, on the host values of its int32 ``[b + 1]`` tensors.

    ``cu_seqlens`` starts at 0 and never decreases (lengths = consecutive differences). Packed
    (thd) calls give ``tokens`` (the tensor's token count): without ``padded`` starts the last
    entry equals it; with them (``<name>_padded``, the packed start of each sequence and the end
    of the last) the starts never decrease, each sequence ends before the next starts and the
    last end is within ``tokens``. ``max_seqlen`` bounds every length: the ``max_seqlen_*``
    argument of a thd call (``max_seqlen_arg`` names it) or the padded sequence length of a
    bshd/sbhd one.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    lengths = cu[1:] - cu[:-1]
    if cu.size and cu[0] != 0:
        raise ValueError(f"`{name}` must start at 0, got {_show(cu)}")
    if (lengths < 0).any():
        raise ValueError(f"`{name}` must be non-decreasing (sequence lengths >= 0), got {_show(cu)}")
    longest = int(lengths.max()) if lengths.size else 0
    if max_seqlen is not None and longest > max_seqlen:
        if max_seqlen_arg is not None:
            raise ValueError(f"`{max_seqlen_arg}` must be at least the longest sequence of `{name}` ({longest}), "
                             f"got {max_seqlen}")
        raise ValueError(f"`{name}` must give lengths within the padded sequence length {max_seqlen}, got a "
                         f"sequence of length {longest}")
    if tokens is None:
        return
    if padded is None:
        if cu[-1] != tokens:
            raise ValueError(f"`{name}`'s last entry must equal the token count {tokens} (pass `{name}_padded` for "
                             f"gaps or trailing padding), got {int(cu[-1])}")
        return
    starts = np.asarray(padded, dtype=np.int64).reshape(-1)
    if starts.shape != cu.shape:
        raise ValueError(f"`{name}_padded` must have the shape of `{name}` {list(cu.shape)}, got {list(starts.shape)}")
    if (np.diff(starts) < 0).any() or starts[0] < 0:
        raise ValueError(f"`{name}_padded` must be non-negative and non-decreasing, got {_show(starts)}")
    if starts[-1] > tokens:
        raise ValueError(f"`{name}_padded`'s last entry must be within the token count {tokens}, got {int(starts[-1])}")
    # Each sequence ends before the next one starts (the last one before the final entry).
    bad = starts[:-1] + lengths > starts[1:]
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise ValueError(
            f"`{name}_padded` must leave room for each sequence of `{name}` (sequences must not overlap), got "
            f"sequence {i} of length {int(lengths[i])} at {int(starts[i])} with the next start at {int(starts[i + 1])}"
        )


def check_segments(seqlens, offsets, seqlen: int, *, seqlens_arg: str, offsets_arg: str, side: str = "") -> None:
    """One side of a JAX call: ``[b, m]`` segment lengths and ``[b, m + 1]`` (or ``[b, m]``) starts
    of rows of ``seqlen`` tokens. Lengths >= 0, each non-empty segment inside its row, no two of a
    row overlapping (unused segments, of length 0, may have any start). ``side`` ("q", "kv") is
    named in the messages after the argument."""
    lens = np.asarray(seqlens, dtype=np.int64)
    lens = lens.reshape(lens.shape[0], -1) if lens.ndim else lens.reshape(1, 1)
    m = lens.shape[1]
    starts = np.asarray(offsets, dtype=np.int64).reshape(lens.shape[0], -1)[:, :m]
    ends = np.full((lens.shape[0],), seqlen, dtype=np.int64)
    suffix = f" ({side})" if side else ""
    _check_extents(lens, starts, ends, lengths_arg=f"`{seqlens_arg}`{suffix}", starts_arg=f"`{offsets_arg}`{suffix}",
                   capacity="the row's sequence length")


def check_softmax_scale(scale, arg: str = "softmax_scale") -> float:
    """``scale`` as a finite Python float (0 and negative scales are valid)."""
    if isinstance(scale, (str, bytes)) or scale is None:
        raise ValueError(f"`{arg}` must be a finite number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"`{arg}` must be a finite number, got {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"`{arg}` must be a finite number, got {value}")
    return value


def kernel_scale(scale: float) -> Tuple[float, float]:
    """``(q_factor, scale)`` to launch the fused kernels with, for any finite softmax scale.

    The kernels need a positive scale (they scale the row max, which is the max of the scaled
    scores only then, and a zero scale turns masked -inf scores into NaN). Attention with
    ``q_factor * q`` and the returned positive scale equals attention with ``q`` and ``scale``:
    a negative scale flips the sign of q, a zero scale multiplies q by 0 (all scores 0, NaN and
    inf in q still propagate) and launches with scale 1. Differentiating through ``q_factor * q``
    gives the right dq in both cases.
    """
    if scale > 0:
        return 1.0, scale
    if scale < 0:
        return -1.0, -scale
    return 0.0, 1.0


def check_input_dtype(args: Iterable[Tuple[str, str]], supported: Sequence[str], what: str) -> None:
    """``(arg, dtype name)`` pairs: floating dtypes outside ``supported`` are NotImplementedError (valid,
    not supported by ``what``), anything else not floating is ValueError."""
    floating = ("float16", "bfloat16", "float32", "float64")
    for arg, dtype in args:
        if dtype in supported:
            continue
        if dtype in floating:
            raise NotImplementedError(f"`{arg}` must be {', '.join(supported)} for {what}, got {dtype}")
        raise ValueError(f"`{arg}` must be a floating-point tensor ({', '.join(supported)}), got {dtype}")
