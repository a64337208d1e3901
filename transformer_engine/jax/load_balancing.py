"""Token reordering for causal load balancing across context-parallel ranks, as TE-JAX defines it.

With a causal mask, the last chunk of a sequence has the most keys to attend to. Splitting the
sequence axis evenly over ``cp_size`` ranks therefore leaves the last rank with the most work;
reordering the tokens before the split balances it. These are pure data permutations along
``seq_dim`` (any array: q, k, v, segment ids, positions), and each ``inverse_*`` undoes its
forward:

- :attr:`ReorderStrategy.DualChunkSwap`: ``2 * cp_size`` chunks; rank ``r`` gets chunks ``r``
  and ``2 * cp_size - 1 - r``. ``cp_size`` must be 1 or even, and the sequence length a
  multiple of ``2 * cp_size``.
- :attr:`ReorderStrategy.Striped`: stripes of ``stripe_size`` tokens (default 1) dealt round-robin
  to the ranks. The sequence length must be a multiple of ``cp_size * stripe_size``.

``fused_attn(..., context_parallel_causal_load_balanced=True)`` expects its inputs in the
DualChunkSwap order for BSHD/SBHD layouts (with a ``stripe_size``, ours: the Striped order of such
stripes) and in the Striped order (with its ``stripe_size``) for THD layouts
(:mod:`transformer_engine.jax.context_parallel`).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from transformer_engine.common.attention import context_parallel as cp_plan
from transformer_engine.jax.enums import ReorderStrategy

__all__ = ["reorder_causal_load_balancing", "inverse_reorder_causal_load_balancing"]


def _check(tensor, strategy, cp_size, seq_dim, stripe_size) -> ReorderStrategy:
    if not isinstance(strategy, ReorderStrategy):
        raise ValueError(f"`strategy` must be a ReorderStrategy, got {strategy!r}")
    if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"`cp_size` must be a positive int, got {cp_size!r}")
    if not isinstance(seq_dim, (int, np.integer)) or not -tensor.ndim <= seq_dim < tensor.ndim:
        raise ValueError(f"`seq_dim` must be an axis of the {tensor.ndim}-d tensor, got {seq_dim!r}")
    if strategy == ReorderStrategy.DualChunkSwap:
        if stripe_size is not None:
            raise ValueError(f"`stripe_size` must be None with ReorderStrategy.DualChunkSwap, got {stripe_size!r}")
    elif stripe_size is not None and (not isinstance(stripe_size, (int, np.integer)) or stripe_size <= 0):
        raise ValueError(f"`stripe_size` must be a positive int (or None: 1), got {stripe_size!r}")
    return strategy


def _permute_chunks(tensor, seq_dim: int, order, inverse: bool):
    """``tensor`` with its sequence cut into ``len(order)`` equal chunks, chunk ``order[i]`` at place ``i``
    (``inverse``: back)."""
    order = np.asarray(order, np.int32)
    if inverse:
        order = np.argsort(order).astype(np.int32)
    s = tensor.shape[seq_dim]
    chunks = tensor.reshape(*tensor.shape[:seq_dim], len(order), s // len(order), *tensor.shape[seq_dim + 1:])
    return jnp.take(chunks, jnp.asarray(order), axis=seq_dim).reshape(tensor.shape)


def _dual_chunk_swap(tensor, cp_size: int, seq_dim: int, inverse: bool):
    if cp_size == 1:
        return tensor
    if cp_size % 2:
        raise ValueError(f"`cp_size` must be 1 or even for ReorderStrategy.DualChunkSwap, got {cp_size}")
    s = tensor.shape[seq_dim]
    if s % (2 * cp_size):
        raise ValueError(
            f"`tensor` must have a sequence length (axis {seq_dim}) that is a multiple of 2 * cp_size = "
            f"{2 * cp_size}, got {s}"
        )
    return _permute_chunks(tensor, seq_dim, cp_plan.chunk_order(cp_size, cp_plan.LoadBalance.DUAL_CHUNK), inverse)


def _striped(tensor, cp_size: int, seq_dim: int, stripe_size: int, inverse: bool):
    s = tensor.shape[seq_dim]
    if s % (cp_size * stripe_size):
        raise ValueError(
            f"`tensor` must have a sequence length (axis {seq_dim}) that is a multiple of cp_size * stripe_size = "
            f"{cp_size * stripe_size}, got {s}"
        )
    rounds = s // (cp_size * stripe_size)
    return _permute_chunks(tensor, seq_dim, cp_plan.chunk_order(cp_size, cp_plan.LoadBalance.STRIPED, rounds),
                           inverse)


def _reorder(tensor, strategy, cp_size, seq_dim, stripe_size, inverse):
    tensor = jnp.asarray(tensor)
    strategy = _check(tensor, strategy, cp_size, seq_dim, stripe_size)
    seq_dim = int(seq_dim) % tensor.ndim
    if strategy == ReorderStrategy.DualChunkSwap:
        return _dual_chunk_swap(tensor, int(cp_size), seq_dim, inverse)
    return _striped(tensor, int(cp_size), seq_dim, 1 if stripe_size is None else int(stripe_size), inverse)


def reorder_causal_load_balancing(tensor, strategy: ReorderStrategy, cp_size: int, seq_dim: int,
                                  stripe_size: Optional[int] = None):
    """Reorder ``tensor`` along ``seq_dim`` so that an even split over ``cp_size`` ranks balances
    causal attention (see the module docstring for the strategies)."""
    return _reorder(tensor, strategy, cp_size, seq_dim, stripe_size, inverse=False)


def inverse_reorder_causal_load_balancing(tensor, strategy: ReorderStrategy, cp_size: int, seq_dim: int,
                                          stripe_size: Optional[int] = None):
    """Undo :func:`reorder_causal_load_balancing` with the same arguments."""
    return _reorder(tensor, strategy, cp_size, seq_dim, stripe_size, inverse=True)
