"""KV cache for inference in JAX: prefill, chunked prefill and decode whose rows are the training forward's bits.

The functional counterpart of PyTorch's ``InferenceParams`` (:mod:`transformer_engine.pytorch.attention.inference`):
the cache is a pytree of arrays (:class:`KVCache`), a step is a pure function that returns the step's attention
rows and the updated cache, and every shape is static, so a step jits once per step width and shards like any
array program::

    cache = init_kv_cache(max_batch_size, max_seqlen, num_heads_kv, head_dim, jnp.bfloat16)  # one per layer
    step = jax.jit(kv_cache_attention, static_argnames=("attn_mask_type",))
    out, cache = step(q, k, v, cache, step_lens)      # q [b, t, h, d]; k, v [b, t, h_kv, d]: new tokens only
    cache = reset_slots(cache, finished)               # a finished sequence's slot starts empty again

Slot ``i`` of the batch holds one sequence; ``step_lens[i]`` new tokens of it are the first ``step_lens[i]``
rows of ``q[i]``, ``k[i]``, ``v[i]`` (0: the slot sits this step out; the rest of the rows is padding, never
read). A step can mix prefill (many tokens), chunked prefill and decode (one token) across slots.

Why the rows equal the training forward's
-----------------------------------------
The step is one ``fused_attn`` call in BSHD layout with ``padding_causal_bottom_right`` (``padding`` without a
causal mask): query ``j`` of slot ``i`` is position ``lengths[i] + j`` of its sequence, attending to the cached
keys ``[0, lengths[i] + j]`` read from position 0 of the slot. That is the arithmetic of the training forward's
row for that position (a causal call over the whole sequence, alone, padded or packed in a batch): the fused
kernels compute each row from its own sequence's keys in fixed key blocks whose tiles depend only on head dims,
dtype, mask kind and GPU, and the blocks one call visits and the other does not are hidden from the row. So a
row's bits depend neither on the step size (token by token, chunks, the whole prompt), nor on the other slots,
nor on where a paged cache keeps the tokens. On CPU the fused path's jnp lowering keeps this in deterministic
mode (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``), where its sums have a fixed order per row.

Paged caches (:func:`init_paged_kv_cache`): a pool ``[num_pages, page_size, h_kv, d]`` and a page table
``[max_batch_size, pages_per_sequence]``; each step gathers the slots' pages into contiguous rows (a copy of the
cached keys and values per layer and step, as the PyTorch paged cache makes) before the same call.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_engine.jax.attention import SequenceDescriptor, fused_attn
from transformer_engine.jax.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout

__all__ = ["KVCache", "init_kv_cache", "init_paged_kv_cache", "kv_cache_attention", "reset_slots"]

# The mask a step runs with, by the mask of the training call whose rows it reproduces.
_STEP_MASK = {
    AttnMaskType.CAUSAL_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    AttnMaskType.PADDING_CAUSAL_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    AttnMaskType.NO_MASK: AttnMaskType.PADDING_MASK,
    AttnMaskType.PADDING_MASK: AttnMaskType.PADDING_MASK,
}


@jax.tree_util.register_pytree_node_class
class KVCache:
    """One layer's cache: ``k``, ``v`` (non-paged ``[max_batch_size, max_seqlen, h_kv, d]``; paged: pools
    ``[num_pages, page_size, h_kv, d]``), ``lengths`` ``[max_batch_size]`` int32 (tokens cached per slot) and,
    when paged, ``page_table`` ``[max_batch_size, pages_per_sequence]`` int32 (slot ``i``'s position ``p`` is
    row ``p % page_size`` of page ``page_table[i, p // page_size]``). Build it with :func:`init_kv_cache` or
    :func:`init_paged_kv_cache`."""

    def __init__(self, k: jax.Array, v: jax.Array, lengths: jax.Array, page_table: Optional[jax.Array] = None):
        self.k, self.v, self.lengths, self.page_table = k, v, lengths, page_table

    def tree_flatten(self):
        return (self.k, self.v, self.lengths, self.page_table), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def is_paged(self) -> bool:
        return self.page_table is not None

    @property
    def max_batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_seqlen(self) -> int:
        """Tokens a slot can hold."""
        return self.page_table.shape[1] * self.k.shape[1] if self.is_paged else self.k.shape[1]

    def __repr__(self) -> str:
        kind = f"paged, {self.k.shape[0]} pages of {self.k.shape[1]}" if self.is_paged else "non-paged"
        return (f"KVCache({kind}, max_batch_size={self.max_batch_size}, max_seqlen={self.max_seqlen}, "
                f"heads={self.k.shape[2]}, head_dims=({self.k.shape[3]}, {self.v.shape[3]}), dtype={self.k.dtype})")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return int(value)


def _dtype(dtype):
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"`dtype` must be float16, bfloat16 or float32, got {dt}")
    return dt


def init_kv_cache(max_batch_size: int, max_seqlen: int, num_heads_kv: int, head_dim_k: int, dtype,
                  head_dim_v: Optional[int] = None) -> KVCache:
    """An empty non-paged cache: ``max_batch_size`` slots of ``max_seqlen`` tokens each."""
    b, s, h, d = (_positive(n, x) for n, x in (("max_batch_size", max_batch_size), ("max_seqlen", max_seqlen),
                                               ("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k)))
    dv = d if head_dim_v is None else _positive("head_dim_v", head_dim_v)
    dt = _dtype(dtype)
    return KVCache(jnp.zeros((b, s, h, d), dt), jnp.zeros((b, s, h, dv), dt), jnp.zeros((b,), jnp.int32))


def init_paged_kv_cache(max_batch_size: int, num_pages: int, page_size: int, num_heads_kv: int, head_dim_k: int,
                        dtype, page_table=None, head_dim_v: Optional[int] = None) -> KVCache:
    """An empty paged cache: a pool of ``num_pages`` pages of ``page_size`` tokens. ``page_table``
    ``[max_batch_size, pages_per_sequence]`` gives each slot's pages in position order (any pages of the pool,
    in any order; distinct across slots); by default slot ``i`` gets pages ``[i * n, (i + 1) * n)`` with
    ``n = num_pages // max_batch_size``."""
    b, p, ps, h, d = (_positive(n, x) for n, x in (("max_batch_size", max_batch_size), ("num_pages", num_pages),
                                                   ("page_size", page_size), ("num_heads_kv", num_heads_kv),
                                                   ("head_dim_k", head_dim_k)))
    dv = d if head_dim_v is None else _positive("head_dim_v", head_dim_v)
    dt = _dtype(dtype)
    if page_table is None:
        if p < b:
            raise ValueError(f"`num_pages` must be at least `max_batch_size` ({b}) for the default page table, "
                             f"got {p}")
        page_table = np.arange(b * (p // b), dtype=np.int32).reshape(b, p // b)
    table = np.asarray(page_table) if not isinstance(page_table, jax.core.Tracer) else None
    if table is not None:
        if table.ndim != 2 or table.shape[0] != b:
            raise ValueError(f"`page_table` must be [max_batch_size={b}, pages_per_sequence], got shape "
                             f"{table.shape}")
        if not np.issubdtype(table.dtype, np.integer) or table.size and (table.min() < 0 or table.max() >= p):
            raise ValueError(f"`page_table` must hold page indices in [0, {p}), got {table.dtype} values in "
                             f"[{table.min() if table.size else '-'}, {table.max() if table.size else '-'}]")
        if len(np.unique(table)) != table.size:
            raise ValueError("`page_table` must give each page to at most one slot position (repeated pages)")
    return KVCache(jnp.zeros((p, ps, h, d), dt), jnp.zeros((p, ps, h, dv), dt), jnp.zeros((b,), jnp.int32),
                   jnp.asarray(page_table, jnp.int32))


def reset_slots(cache: KVCache, slots) -> KVCache:
    """``cache`` with the given slots (indices, or a ``[max_batch_size]`` bool mask) empty: a finished
    sequence's slot (and its pages) can take a new sequence. The stale keys stay in memory but are never read:
    a row reads only positions below its slot's length."""
    slots = jnp.asarray(slots)
    if slots.dtype == jnp.bool_:
        lengths = jnp.where(slots, 0, cache.lengths)
    else:
        lengths = cache.lengths.at[slots].set(0)
    return KVCache(cache.k, cache.v, lengths, cache.page_table)


def _concrete(x) -> Optional[np.ndarray]:
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _check_step(q, k, v, cache: KVCache, step_lens):
    if not isinstance(cache, KVCache):
        raise ValueError(f"`cache` must be a KVCache, got {type(cache).__name__}")
    b, hk, dk, dv = cache.max_batch_size, cache.k.shape[2], cache.k.shape[3], cache.v.shape[3]
    for name, x, d in (("q", q, dk), ("k", k, dk), ("v", v, dv)):
        if x.ndim != 4 or x.shape[0] != b or x.shape[-1] != d:
            raise ValueError(f"`{name}` must be [max_batch_size={b}, step tokens, heads, {d}] (the cache's slots "
                             f"and head dim), got shape {tuple(x.shape)}")
        if x.dtype != cache.k.dtype:
            raise ValueError(f"`{name}` must have the cache's dtype {cache.k.dtype}, got {x.dtype}")
    t = q.shape[1]
    for name, x in (("k", k), ("v", v)):
        if x.shape[1] != t or x.shape[2] != hk:
            raise ValueError(f"`{name}` must be [{b}, {t}, {hk}, ...] (q's step tokens, the cache's kv heads), got "
                             f"shape {tuple(x.shape)}")
    if q.shape[2] % hk:
        raise ValueError(f"`q` heads ({q.shape[2]}) must be a multiple of the cache's kv heads ({hk})")
    if t > cache.max_seqlen:
        raise ValueError(f"`q` must bring at most the cache's max_seqlen ({cache.max_seqlen}) tokens per slot, "
                         f"got {t}")
    step_lens = jnp.asarray(step_lens)
    if step_lens.shape != (b,) or not jnp.issubdtype(step_lens.dtype, jnp.integer):
        raise ValueError(f"`step_lens` must be an int array [max_batch_size={b}], got {step_lens.dtype} "
                         f"{tuple(step_lens.shape)}")
    lens, cached = _concrete(step_lens), _concrete(cache.lengths)
    if lens is not None:
        if lens.min() < 0 or lens.max() > t:
            raise ValueError(f"`step_lens` must be in [0, {t}] (q's step tokens), got {lens.tolist()}")
        if cached is not None and (cached + lens).max() > cache.max_seqlen:
            raise ValueError(f"`step_lens` must fit the cache: cached {cached.tolist()} + new {lens.tolist()} "
                             f"exceeds max_seqlen {cache.max_seqlen}")
    return step_lens.astype(jnp.int32)


def _append(cache: KVCache, k, v, step_lens) -> KVCache:
    """The cache with each slot's ``step_lens`` new tokens written after its cached ones (static shapes: the
    padding rows' writes go out of range and are dropped)."""
    b, t = k.shape[:2]
    pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [b, t] positions in the sequence
    new = jnp.arange(t, dtype=jnp.int32)[None, :] < step_lens[:, None]
    if not cache.is_paged:
        rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        pos = jnp.where(new, pos, cache.max_seqlen)
        return KVCache(cache.k.at[rows, pos].set(k, mode="drop"), cache.v.at[rows, pos].set(v, mode="drop"),
                       cache.lengths + step_lens, cache.page_table)
    pages, page_size = cache.k.shape[:2]
    page = jnp.take_along_axis(cache.page_table, jnp.minimum(pos // page_size, cache.page_table.shape[1] - 1),
                               axis=1)
    flat = jnp.where(new, page * page_size + pos % page_size, pages * page_size)
    kf = cache.k.reshape(pages * page_size, *cache.k.shape[2:]).at[flat].set(k, mode="drop")
    vf = cache.v.reshape(pages * page_size, *cache.v.shape[2:]).at[flat].set(v, mode="drop")
    return KVCache(kf.reshape(cache.k.shape), vf.reshape(cache.v.shape), cache.lengths + step_lens,
                   cache.page_table)


def _slot_rows(cache: KVCache) -> Tuple[jax.Array, jax.Array]:
    """Keys and values as ``[max_batch_size, max_seqlen, h_kv, d]``: the arrays themselves, or a paged cache's
    pages gathered in each slot's position order."""
    if not cache.is_paged:
        return cache.k, cache.v
    b, n = cache.page_table.shape
    return tuple(x[cache.page_table].reshape(b, n * x.shape[1], *x.shape[2:]) for x in (cache.k, cache.v))


def kv_cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, step_lens,
                       attn_mask_type: AttnMaskType = AttnMaskType.CAUSAL_MASK,
                       window_size: Optional[Tuple[int, int]] = None,
                       softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX,
                       softmax_offset: Optional[jax.Array] = None,
                       scaling_factor: Optional[float] = None) -> Tuple[jax.Array, KVCache]:
    """One generation step of one layer: append the new keys and values, attend the new queries to their
    sequences' cached keys. Returns ``(out, cache)``: ``out`` ``[max_batch_size, t, h, d_v]`` (rows past a
    slot's ``step_lens`` are zeros) and the updated cache.

    :param q: ``[max_batch_size, t, h, d]``: each slot's new queries first, padding after.
    :param k: ``[max_batch_size, t, h_kv, d]``, and ``v`` ``[..., d_v]``: the new keys and values, likewise.
    :param cache: this layer's :class:`KVCache`.
    :param step_lens: ``[max_batch_size]`` ints: the new tokens of each slot (0 = not in this step).
    :param attn_mask_type: the mask of the training call whose rows the step reproduces: the causal kinds
        (top-left and bottom-right are one mask over a whole sequence) or ``no_mask``/``padding`` (a step's
        queries then see every cached key, so a row equals the training row of the sequence ending there).
    :param window_size: ``(left, right)`` sliding window of the training call (``right`` 0 with a causal
        mask), ``None`` for none.
    :param softmax_type: and ``softmax_offset``, ``scaling_factor``: as in :func:`fused_attn`.
    """
    try:
        mask = AttnMaskType(attn_mask_type) if not isinstance(attn_mask_type, AttnMaskType) else attn_mask_type
    except ValueError:
        mask = None
    if mask not in _STEP_MASK:
        raise ValueError(f"`attn_mask_type` must be one of {', '.join(m.value for m in _STEP_MASK)} with a KV "
                         f"cache, got {attn_mask_type!r}")
    step_lens = _check_step(q, k, v, cache, step_lens)
    cache = _append(cache, k, v, step_lens)
    keys, values = _slot_rows(cache)
    out = fused_attn((q, keys, values), None, SequenceDescriptor.from_seqlens((step_lens, cache.lengths)), None,
                     AttnBiasType.NO_BIAS, _STEP_MASK[mask], QKVLayout.BSHD_BSHD_BSHD, softmax_type=softmax_type,
                     scaling_factor=scaling_factor, is_training=False, window_size=window_size,
                     softmax_offset=softmax_offset)
    new = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :] < step_lens[:, None]
    return jnp.where(new[:, :, None, None], out, jnp.zeros((), out.dtype)), cache
