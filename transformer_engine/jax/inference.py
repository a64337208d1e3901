"""KV cache for inference in JAX: prefill, chunked prefill and decode whose rows are the training forward's bits.

The functional counterpart of PyTorch's ``InferenceParams`` (:mod:`transformer_engine.pytorch.attention.inference`):
the cache is a pytree of arrays (:class:`KVCache`), a step is a pure function that returns the step's attention
rows and the updated cache, and every shape is static, so a step jits once per step shape and shards like any
array program::

    cache = init_kv_cache(max_batch_size, max_seqlen, num_heads_kv, head_dim, jnp.bfloat16)  # one per layer
    step = jax.jit(kv_cache_attention, static_argnames=("attn_mask_type", "qkv_format"))
    out, cache = step(q, k, v, cache, step_lens)      # the step's new tokens only (see qkv_format)
    cache = reset_slots(cache, finished)               # a finished sequence's slot starts empty again

Slot ``i`` of the cache holds one sequence and ``step_lens[i]`` is its number of new tokens this step (0: the
slot sits the step out), so one step mixes prefill, chunked prefill and decode. The new tokens come in one of
two formats (``qkv_format``):

- ``"thd"``: ``q`` ``[T, h, d]``, every slot's new tokens packed in slot order (slot 0's first), ``T`` a
  static capacity of at least ``sum(step_lens)`` (the rest is padding, never read). The step's attention is
  one ``fused_attn`` call in THD layout: the PyTorch step's call.
- ``"bshd"``: ``q`` ``[max_batch_size, t, h, d]``, slot ``i``'s new tokens first in row ``i`` (the rest is
  padding). The step's attention is one BSHD call, whose batch axis shards (dp/fsdp) as in training.

Why the rows equal the training forward's
-----------------------------------------
The call attends the step's queries to each slot's cached keys, read from position 0 of the slot, with
``padding_causal_bottom_right`` (``padding`` without a causal mask): query ``j`` of slot ``i`` is position
``lengths[i] + j`` of its sequence and sees the cached keys ``[0, lengths[i] + j]`` (within the window, if
any). That is the training forward's row for that position (a causal call over the whole sequence, alone,
padded or packed in a batch), computed the same way: the fused kernels compute each row from its own
sequence's keys in fixed key blocks whose tiles depend only on head dims, dtype, mask kind and GPU, and the
blocks one call visits and the other does not are hidden from the row; the unfused backend (the CPU, and the
GPU's fallbacks) has a fixed reduction structure whose sums trailing zeros do not change. So a row's bits
depend neither on the step size (token by token, chunks, the whole prompt), nor on the other slots, nor on
the step's format, nor on where a paged cache keeps the tokens.

Paged caches (:func:`init_paged_kv_cache`): a pool ``[num_pages, page_size, h_kv, d]`` and a page table
``[max_batch_size, pages_per_sequence]`` (``-1``: no page yet; the host may assign pages as sequences grow,
:meth:`KVCache.replace`). Where the fused backend runs the step and its paged plan is the same call's on
gathered rows (``plan.pages_keep_bits``, as PyTorch: any page size for the Triton forward, on Hopper's Gluon
configs the page sizes its loader follows), the planned forward reads the keys and values through the page table
in place (:func:`transformer_engine.jax.primitives.paged.fused_attn_paged`), with the bits of the gathered call;
elsewhere (Hopper's Gluon configs with other page sizes, the unfused backend) each step gathers the slots' pages
into contiguous rows (a copy of the cached keys and values per layer and step) before the same call.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_engine.common.attention.backends import FusedAttention
from transformer_engine.common.attention.plan import pages_keep_bits
from transformer_engine.jax import attention as _attention
from transformer_engine.jax.attention import SequenceDescriptor, _FusedAttnArgs, select_attention_backend
from transformer_engine.jax.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout
from transformer_engine.jax.primitives.paged import fused_attn_paged

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

_FORMATS = ("bshd", "thd")


@jax.tree_util.register_pytree_node_class
class KVCache:
    """One layer's cache: ``k``, ``v`` (non-paged ``[max_batch_size, max_seqlen, h_kv, d]``; paged: pools
    ``[num_pages, page_size, h_kv, d]``), ``lengths`` ``[max_batch_size]`` int32 (tokens cached per slot) and,
    when paged, ``page_table`` ``[max_batch_size, pages_per_sequence]`` int32 (slot ``i``'s position ``p`` is
    row ``p % page_size`` of page ``page_table[i, p // page_size]``; ``-1``: no page assigned). Build it with
    :func:`init_kv_cache` or :func:`init_paged_kv_cache`."""

    def __init__(self, k: jax.Array, v: jax.Array, lengths: jax.Array, page_table: Optional[jax.Array] = None):
        self.k, self.v, self.lengths, self.page_table = k, v, lengths, page_table

    def tree_flatten(self):
        return (self.k, self.v, self.lengths, self.page_table), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def replace(self, **fields) -> "KVCache":
        """A copy with some of ``k``, ``v``, ``lengths``, ``page_table`` replaced (e.g. a page table in which
        the host assigned pages to growing sequences)."""
        unknown = set(fields) - {"k", "v", "lengths", "page_table"}
        if unknown:
            raise ValueError(f"`fields` must be among k, v, lengths, page_table, got {sorted(unknown)}")
        if "page_table" in fields and self.is_paged:
            fields["page_table"] = _check_page_table(fields["page_table"], self.max_batch_size, self.k.shape[0])
        return KVCache(**{**dict(k=self.k, v=self.v, lengths=self.lengths, page_table=self.page_table), **fields})

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


def _concrete(x) -> Optional[np.ndarray]:
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _check_page_table(page_table, batch: int, pages: int) -> jax.Array:
    table = _concrete(page_table)
    if table is not None:
        if table.ndim != 2 or table.shape[0] != batch:
            raise ValueError(f"`page_table` must be [max_batch_size={batch}, pages_per_sequence], got shape "
                             f"{table.shape}")
        if not np.issubdtype(table.dtype, np.integer) or table.size and (table.min() < -1 or table.max() >= pages):
            raise ValueError(f"`page_table` must hold page indices in [0, {pages}) or -1 (none), got {table.dtype} "
                             f"values in [{table.min() if table.size else '-'}, {table.max() if table.size else '-'}]")
        used = table[table >= 0]
        if len(np.unique(used)) != used.size:
            raise ValueError("`page_table` must give each page to at most one slot position (repeated pages)")
    elif page_table.ndim != 2 or page_table.shape[0] != batch or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"`page_table` must be an int array [max_batch_size={batch}, pages_per_sequence], got "
                         f"{page_table.dtype} {tuple(page_table.shape)}")
    return jnp.asarray(page_table, jnp.int32)


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
    in any order, distinct across slots; ``-1`` where no page is assigned yet: a step must not write there);
    by default slot ``i`` gets pages ``[i * n, (i + 1) * n)`` with ``n = num_pages // max_batch_size``."""
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
    table = _check_page_table(page_table, b, p)
    return KVCache(jnp.zeros((p, ps, h, d), dt), jnp.zeros((p, ps, h, dv), dt), jnp.zeros((b,), jnp.int32), table)


def reset_slots(cache: KVCache, slots) -> KVCache:
    """``cache`` with the given slots (indices, or a ``[max_batch_size]`` bool mask) empty: a finished
    sequence's slot (and its pages) can take a new sequence. The stale keys stay in memory but are never read:
    a row reads only positions below its slot's length."""
    slots = jnp.asarray(slots)
    if slots.dtype == jnp.bool_:
        lengths = jnp.where(slots, 0, cache.lengths)
    else:
        lengths = cache.lengths.at[slots].set(0)
    return cache.replace(lengths=lengths)


def _check_step(q, k, v, cache: KVCache, step_lens, fmt: str):
    """The step's arguments; returns ``step_lens`` as int32. Values are checked where they are concrete
    (eager calls): under ``jit`` a step that overflows a slot loses the tokens past its end."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"`cache` must be a KVCache, got {type(cache).__name__}")
    b, hk, dk, dv = cache.max_batch_size, cache.k.shape[2], cache.k.shape[3], cache.v.shape[3]
    lead = (f"max_batch_size={b}, step tokens" if fmt == "bshd" else "step tokens")
    ndim = 4 if fmt == "bshd" else 3
    for name, x, d in (("q", q, dk), ("k", k, dk), ("v", v, dv)):
        if x.ndim != ndim or (fmt == "bshd" and x.shape[0] != b) or x.shape[-1] != d:
            raise ValueError(f"`{name}` must be [{lead}, heads, {d}] (qkv_format={fmt!r}: the cache's slots and "
                             f"head dim), got shape {tuple(x.shape)}")
        if x.dtype != cache.k.dtype:
            raise ValueError(f"`{name}` must have the cache's dtype {cache.k.dtype}, got {x.dtype}")
    tok = ndim - 3  # the axis of the step's tokens
    t = q.shape[tok]
    for name, x in (("k", k), ("v", v)):
        if x.shape[:tok + 1] != q.shape[:tok + 1] or x.shape[-2] != hk:
            raise ValueError(f"`{name}` must be [{', '.join(map(str, q.shape[:tok + 1]))}, {hk}, ...] (q's step "
                             f"tokens, the cache's kv heads), got shape {tuple(x.shape)}")
    if q.shape[-2] % hk:
        raise ValueError(f"`q` heads ({q.shape[-2]}) must be a multiple of the cache's kv heads ({hk})")
    if fmt == "bshd" and t > cache.max_seqlen:
        raise ValueError(f"`q` must bring at most the cache's max_seqlen ({cache.max_seqlen}) tokens per slot, "
                         f"got {t}")
    if step_lens is None:
        if fmt != "bshd":
            raise ValueError("`step_lens` must be given with qkv_format='thd' (the packed tokens' slots), got None")
        step_lens = jnp.full((b,), t, jnp.int32)
    step_lens = jnp.asarray(step_lens)
    if step_lens.shape != (b,) or not jnp.issubdtype(step_lens.dtype, jnp.integer):
        raise ValueError(f"`step_lens` must be an int array [max_batch_size={b}], got {step_lens.dtype} "
                         f"{tuple(step_lens.shape)}")
    lens, cached = _concrete(step_lens), _concrete(cache.lengths)
    if lens is not None:
        if lens.min() < 0 or (fmt == "bshd" and lens.max() > t):
            raise ValueError(f"`step_lens` must be in [0, {t}] (q's step tokens), got {lens.tolist()}")
        if fmt == "thd" and lens.sum() > t:
            raise ValueError(f"`step_lens` must sum to at most q's {t} packed tokens, got {lens.tolist()} "
                             f"(sum {int(lens.sum())})")
        if cached is not None and (cached + lens).max() > cache.max_seqlen:
            raise ValueError(f"`step_lens` must fit the cache: cached {cached.tolist()} + new {lens.tolist()} "
                             f"exceeds max_seqlen {cache.max_seqlen}")
        table = _concrete(cache.page_table) if cache.is_paged and cached is not None else None
        if table is not None:
            ps = cache.k.shape[1]
            for slot in np.flatnonzero(lens):
                pages = table[slot, cached[slot] // ps:(cached[slot] + lens[slot] - 1) // ps + 1]
                if (pages < 0).any():
                    raise ValueError(f"`cache.page_table` must assign pages to the positions a step writes: slot "
                                     f"{slot} writes positions [{cached[slot]}, {cached[slot] + lens[slot]}) of "
                                     f"pages {pages.tolist()}")
    return step_lens.astype(jnp.int32)


def _token_places(cache: KVCache, step_lens, fmt: str, t: int):
    """Each new token's slot, position in its sequence and whether it is real, flattened in the order of the
    step's token rows (``[b * t]`` for bshd, ``[t]`` for thd)."""
    b = cache.max_batch_size
    j = jnp.arange(t, dtype=jnp.int32)
    if fmt == "bshd":
        slot = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)).reshape(-1)
        index = jnp.broadcast_to(j[None, :], (b, t)).reshape(-1)  # the token's index among its slot's new ones
        real = index < step_lens[slot]
    else:
        ends = jnp.cumsum(step_lens)
        slot = jnp.minimum(jnp.searchsorted(ends, j, side="right").astype(jnp.int32), b - 1)
        index = j - (ends - step_lens)[slot]
        real = j < ends[-1]
    return slot, cache.lengths[slot] + index, real


def _append(cache: KVCache, k, v, step_lens, fmt: str) -> KVCache:
    """The cache with each slot's ``step_lens`` new tokens written after its cached ones (static shapes: the
    padding rows' writes go out of range and are dropped)."""
    t = k.shape[0] if fmt == "thd" else k.shape[1]
    slot, pos, real = _token_places(cache, step_lens, fmt, t)
    rows_k = k.reshape(-1, *k.shape[-2:])
    rows_v = v.reshape(-1, *v.shape[-2:])
    if cache.is_paged:
        pages, page_size = cache.k.shape[:2]
        column = jnp.minimum(pos // page_size, cache.page_table.shape[1] - 1)
        page = cache.page_table[slot, column]
        real = real & (page >= 0) & (pos < cache.max_seqlen)
        flat = page * page_size + pos % page_size
    else:
        pages, page_size = cache.k.shape[:2]  # a slot is a "page" of max_seqlen tokens
        real = real & (pos < cache.max_seqlen)
        flat = slot * page_size + pos
    flat = jnp.where(real, flat, pages * page_size)  # out of range: dropped
    kf = cache.k.reshape(pages * page_size, *cache.k.shape[2:]).at[flat].set(rows_k, mode="drop")
    vf = cache.v.reshape(pages * page_size, *cache.v.shape[2:]).at[flat].set(rows_v, mode="drop")
    return cache.replace(k=kf.reshape(cache.k.shape), v=vf.reshape(cache.v.shape),
                         lengths=jnp.minimum(cache.lengths + step_lens, cache.max_seqlen))


def _slot_rows(cache: KVCache) -> Tuple[jax.Array, jax.Array]:
    """Keys and values as ``[max_batch_size, max_seqlen, h_kv, d]``: the arrays themselves, or a paged cache's
    pages gathered in each slot's position order (unassigned pages read page 0: past the slot's length)."""
    if not cache.is_paged:
        return cache.k, cache.v
    b, n = cache.page_table.shape
    table = jnp.maximum(cache.page_table, 0)
    return tuple(x[table].reshape(b, n * x.shape[1], *x.shape[2:]) for x in (cache.k, cache.v))


def _step_descriptor(cache: KVCache, step_lens, fmt: str, t: int):
    """(descriptor, max_segments_per_seq) of the step's call: bshd, row ``i`` = slot ``i``; thd, one row packing
    every slot's new queries (segment ``i`` = slot ``i``, empty when it sits out) against the slots' keys laid
    end to end (``max_seqlen`` keys per slot)."""
    if fmt == "bshd":
        return SequenceDescriptor.from_seqlens((step_lens, cache.lengths)), 1
    b, s = cache.max_batch_size, cache.max_seqlen
    zero = jnp.zeros((1,), jnp.int32)
    q_offsets = jnp.concatenate([zero, jnp.cumsum(step_lens)[:-1].astype(jnp.int32), jnp.full((1,), t, jnp.int32)])
    kv_offsets = jnp.arange(b + 1, dtype=jnp.int32) * s
    return SequenceDescriptor.from_seqlens_and_offsets((step_lens[None], cache.lengths[None]),
                                                       (q_offsets[None], kv_offsets[None])), b


def _step_args(q, keys, values, cache: KVCache, step_lens, fmt: str, mask: AttnMaskType, kw) -> _FusedAttnArgs:
    """The ``fused_attn`` arguments of the step's one call on ``keys``/``values`` (``[max_batch_size, max_seqlen,
    h_kv, d]``, the slots' rows): bshd as they are, thd laid end to end in one row."""
    t = q.shape[0] if fmt == "thd" else q.shape[1]
    descriptor, m = _step_descriptor(cache, step_lens, fmt, t)
    if fmt == "bshd":
        qkv, layout = (q, keys, values), QKVLayout.BSHD_BSHD_BSHD
    else:
        b, s = keys.shape[:2]
        qkv = (q[None], keys.reshape(1, b * s, *keys.shape[2:]), values.reshape(1, b * s, *values.shape[2:]))
        layout = QKVLayout.THD_THD_THD
    return _FusedAttnArgs(qkv, None, descriptor, None, AttnBiasType.NO_BIAS, mask, layout, max_segments_per_seq=m,
                          **kw)


def _contiguous_call(q, cache: KVCache, step_lens, fmt: str, mask: AttnMaskType, kw):
    """The parsed call of the step on the slots' gathered rows (``fused_attn``'s canonical form), from shapes
    alone: traced abstractly, so nothing is gathered. Its static arguments and config are what the step's
    backend selection and plan read; its arrays are abstract and never used."""
    parsed = []
    shapes = [(cache.max_batch_size, cache.max_seqlen) + x.shape[2:] for x in (cache.k, cache.v)]

    def parse(q, lengths, step_lens, offset):
        keys, values = (jnp.zeros(shape, cache.k.dtype) for shape in shapes)
        parsed.append(_attention._parse_call(_step_args(q, keys, values, cache.replace(lengths=lengths), step_lens,
                                                        fmt, mask, dict(kw, softmax_offset=offset))))
        return ()

    jax.eval_shape(parse, q, cache.lengths, step_lens, kw.get("softmax_offset"))
    return parsed[0]


def _step_attention(q, cache: KVCache, step_lens, fmt: str, mask: AttnMaskType, kw):
    """The step's attention rows (q's format): on a paged cache where the fused backend runs and reads the pages
    in place (``plan.pages_keep_bits``), the paged forward on the pools and the page table; otherwise the call on
    the slots' rows (a paged cache's pages gathered). The backend is ``fused_attn``'s selection for the call."""
    if not cache.is_paged:  # the slots' rows in place
        call = _attention._parse_call(_step_args(q, cache.k, cache.v, cache, step_lens, fmt, mask, kw))
        out = _attention._run(call, select_attention_backend(call.config).backend)
        return out if fmt == "bshd" else out[0]
    contiguous = _contiguous_call(q, cache, step_lens, fmt, mask, kw)
    runner = select_attention_backend(contiguous.config).backend
    if issubclass(runner, FusedAttention):
        static = contiguous.static
        if pages_keep_bits(contiguous.config, cache.k.shape[1]):
            t = q.shape[0] if fmt == "thd" else q.shape[1]
            descriptor, m = _step_descriptor(cache, step_lens, fmt, t)
            rows = q.shape[0] if fmt == "bshd" else 1
            seq = descriptor.to_seq_info(rows, t, cache.max_seqlen, fmt == "thd", m)
            table = cache.page_table if fmt == "thd" else cache.page_table[:, None]
            offset = _attention._check_softmax_offset(static.softmax_type, kw.get("softmax_offset"), q.shape[-2])
            out = fused_attn_paged(q if fmt == "bshd" else q[None], cache.k, cache.v, table.reshape(rows, -1,
                                   table.shape[-1]), (seq.q_seqlens, seq.kv_seqlens, seq.q_offsets),
                                   dataclasses.replace(static, kv_page_size=cache.k.shape[1]), offset)
            return out if fmt == "bshd" else out[0]
    keys, values = _slot_rows(cache)  # the pages gathered
    out = _attention._run(_attention._parse_call(_step_args(q, keys, values, cache, step_lens, fmt, mask, kw)),
                          runner)
    return out if fmt == "bshd" else out[0]


def kv_cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, step_lens,
                       attn_mask_type: AttnMaskType = AttnMaskType.CAUSAL_MASK,
                       window_size: Optional[Tuple[int, int]] = None,
                       softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX,
                       softmax_offset: Optional[jax.Array] = None,
                       scaling_factor: Optional[float] = None,
                       qkv_format: str = "bshd") -> Tuple[jax.Array, KVCache]:
    """One generation step of one layer: append the new keys and values, attend the new queries to their
    sequences' cached keys. Returns ``(out, cache)``: ``out`` in q's format with ``d_v`` (rows that are not
    new tokens are zeros) and the updated cache.

    :param q: ``qkv_format="bshd"``: ``[max_batch_size, t, h, d]``, each slot's new queries first in its row;
        ``"thd"``: ``[T, h, d]``, every slot's new queries packed in slot order, padding after.
    :param k: and ``v`` (``d_v``): the new keys and values with ``h_kv`` heads, laid out as ``q``.
    :param cache: this layer's :class:`KVCache`.
    :param step_lens: ``[max_batch_size]`` ints: the new tokens of each slot (0 = not in this step); ``None``
        with ``qkv_format="bshd"``: every slot takes the step's ``t`` tokens.
    :param attn_mask_type: the mask of the training call whose rows the step reproduces: the causal kinds
        (top-left and bottom-right are one mask over a whole sequence) or ``no_mask``/``padding`` (a step's
        queries then see every cached key, so a row equals the training row of the sequence ending there).
    :param window_size: ``(left, right)`` sliding window of the training call (``right`` 0 with a causal
        mask), ``None`` for none; aligned with each query's position in its sequence.
    :param softmax_type: and ``softmax_offset``, ``scaling_factor``: as in :func:`fused_attn`.
    :param qkv_format: ``"bshd"`` (default) or ``"thd"``: the layout of the step's new tokens and of ``out``.
    """
    try:
        mask = AttnMaskType(attn_mask_type) if not isinstance(attn_mask_type, AttnMaskType) else attn_mask_type
    except ValueError:
        mask = None
    if mask not in _STEP_MASK:
        raise ValueError(f"`attn_mask_type` must be one of {', '.join(m.value for m in _STEP_MASK)} with a KV "
                         f"cache, got {attn_mask_type!r}")
    if qkv_format not in _FORMATS:
        raise ValueError(f"`qkv_format` must be one of {', '.join(map(repr, _FORMATS))}, got {qkv_format!r}")
    step_lens = _check_step(q, k, v, cache, step_lens, qkv_format)
    cache = _append(cache, k, v, step_lens, qkv_format)
    # bottom_right_diagonal: a non-causal window is aligned at each query's position too (the causal step
    # mask is bottom-right already).
    kw = dict(softmax_type=softmax_type, scaling_factor=scaling_factor, is_training=False, window_size=window_size,
              softmax_offset=softmax_offset, bottom_right_diagonal=True)
    out = _step_attention(q, cache, step_lens, qkv_format, _STEP_MASK[mask], kw)
    t = q.shape[0] if qkv_format == "thd" else q.shape[1]
    _, _, real = _token_places(cache, step_lens, qkv_format, t)
    real = real.reshape(out.shape[:-2])
    return jnp.where(real[..., None, None], out, jnp.zeros((), out.dtype)), cache
