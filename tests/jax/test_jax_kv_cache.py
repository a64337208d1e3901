"""JAX KV cache (transformer_engine.jax.inference): prefill, chunked prefill and decode rows are bitwise the
training forward's rows.

For random sequences the training forward (``fused_attn`` over whole sequences, causal: each alone, padded
into one batch, and packed into one THD row) gives each token's output row; a simulated serving loop then
feeds the same sequences through ``kv_cache_attention`` in jitted steps (token by token, chunks of 7, the
whole prompt at once; a sequence arriving while others decode and taking the slot or the pages of one that
finished, whose stale keys must not leak in), and every row must equal the training row
(``np.testing.assert_array_equal``): both step formats (bshd rows per slot, thd packed tokens), non-paged
and paged caches with shuffled page tables (fixed, or pages assigned as sequences grow), GQA/MQA, causal and
sliding-window masks, sink softmax, a batch sharded over two devices. On CPU ``fused_attn`` runs its unfused
backend (JAX never launches Triton's interpreter), whose fixed reduction structure makes rows independent of
the batch, padding and packing in any determinism mode; on a GPU the Triton/Gluon kernels, and there
PyTorch's InferenceParams path gives the same bits (on CPU the two frameworks' ``exp`` differ in the last
bit, so there they agree within rounding).
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from case_grid import grid
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer_engine.jax.attention import SequenceDescriptor, fused_attn
from transformer_engine.jax.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout
from transformer_engine.jax.inference import (KVCache, init_kv_cache, init_paged_kv_cache, kv_cache_attention,
                                              reset_slots)

ON_GPU = jax.default_backend() == "gpu"
LENGTHS = (29, 18, 5, 11) if not ON_GPU else (300, 141, 5, 77)
MAX_SEQLEN = 32 if not ON_GPU else 320
PAGE = 8
SLOTS = 3
BSHD = QKVLayout.BSHD_BSHD_BSHD
THD = QKVLayout.THD_THD_THD
gpu_only = pytest.mark.skipif(not ON_GPU, reason="GPU shapes and dtypes (bf16, d=128, long contexts)")


def _sequences(lengths, h, hk, d, dtype, seed):
    rng = np.random.default_rng(seed)
    return [tuple(jnp.asarray(rng.standard_normal((n, heads, d)), dtype) for heads in (h, hk, hk)) for n in lengths]


def _training_rows(seqs, window, softmax_type, offset):
    """Each sequence's rows from the training forward, alone (BSHD causal); the same sequences padded into one
    batch (BSHD padding_causal) and packed into one row (THD padding_causal) must give the same rows (batch
    and packing invariance), and the alone rows are returned."""
    kw = dict(softmax_type=softmax_type, softmax_offset=offset, window_size=window, is_training=False)
    alone = [fused_attn(tuple(t[None] for t in s), None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
                        BSHD, **kw)[0] for s in seqs]
    lens = [s[0].shape[0] for s in seqs]
    width = max(lens)
    padded = [jnp.stack([jnp.pad(s[j], ((0, width - s[j].shape[0]), (0, 0), (0, 0))) for s in seqs])
              for j in range(3)]
    seqlens = jnp.asarray(lens, jnp.int32)
    batch = fused_attn(tuple(padded), None, SequenceDescriptor.from_seqlens(seqlens), None, AttnBiasType.NO_BIAS,
                       AttnMaskType.PADDING_CAUSAL_MASK, BSHD, **kw)
    packed = fused_attn(tuple(jnp.concatenate([s[j] for s in seqs])[None] for j in range(3)), None,
                        SequenceDescriptor.from_seqlens(seqlens[None]), None, AttnBiasType.NO_BIAS,
                        AttnMaskType.PADDING_CAUSAL_MASK, THD, max_segments_per_seq=len(seqs), **kw)[0]
    starts = np.cumsum([0] + lens)
    for i, rows in enumerate(alone):
        np.testing.assert_array_equal(np.asarray(batch[i, :lens[i]]), np.asarray(rows),
                                      err_msg=f"training rows of sequence {i} depend on the batch")
        np.testing.assert_array_equal(np.asarray(packed[starts[i]:starts[i + 1]]), np.asarray(rows),
                                      err_msg=f"training rows of sequence {i} depend on the packing")
    return alone


class _Pages:
    """Pages assigned as sequences grow (a host-side allocator over a shuffled free list), returned when they
    finish: the page table changes every few steps and a new sequence reuses a finished one's pages."""

    def __init__(self, seed):
        self.free = list(range(SLOTS * MAX_SEQLEN // PAGE))
        random.Random(seed).shuffle(self.free)
        self.table = np.full((SLOTS, MAX_SEQLEN // PAGE), -1, np.int32)

    def grow(self, cache, slot, total):
        for column in range(-(-total // PAGE)):
            if self.table[slot, column] < 0:
                self.table[slot, column] = self.free.pop(0)
        return cache.replace(page_table=jnp.asarray(self.table))

    def release(self, slot):
        self.free += [int(p) for p in self.table[slot] if p >= 0]
        self.table[slot] = -1


def _step_inputs(seqs, active, slot_of, pos, width, fmt):
    """The step's q, k, v (fp32 numpy) and step_lens: bshd ``[SLOTS, width, ...]`` rows per slot, thd
    ``[SLOTS * width, ...]`` tokens packed in slot order; padding is NaN (never read)."""
    h, d, hk, dv = seqs[0][0].shape[1], seqs[0][0].shape[2], seqs[0][1].shape[1], seqs[0][2].shape[2]
    shapes = [(h, d), (hk, d), (hk, dv)]
    lead = (SLOTS, width) if fmt == "bshd" else (SLOTS * width,)
    arrays = [np.full(lead + shape, np.nan, np.float32) for shape in shapes]
    step = np.zeros(SLOTS, np.int32)
    for i, n in active.items():
        step[slot_of[i]] = n
    first = np.cumsum(step) - step
    for i, n in active.items():
        s = slot_of[i]
        for arr, src in zip(arrays, seqs[i]):
            rows = np.asarray(src[pos[i]:pos[i] + n], np.float32)
            if fmt == "bshd":
                arr[s, :n] = rows
            else:
                arr[first[s]:first[s] + n] = rows
    return arrays, step, first


def _serve(seqs, cache, chunks, arrivals, width, step_fn, fmt="bshd", pages=None):
    """Run the sequences through ``cache`` in steps of at most ``width`` tokens per slot: sequence i joins at
    step ``arrivals[i]`` in the first free slot and brings ``chunks[i]`` tokens per step; a finished sequence's
    slot is reset and reused (with ``pages``, a _Pages, its pages go back to the free list). Returns each
    sequence's rows and the number of steps."""
    lens = [s[0].shape[0] for s in seqs]
    pos, rows, slot_of, t = [0] * len(seqs), [[] for _ in seqs], {}, 0
    dtype = seqs[0][0].dtype
    while any(p < n for p, n in zip(pos, lens)):
        for i in range(len(seqs)):
            if arrivals[i] <= t and i not in slot_of and pos[i] == 0:
                free = [s for s in range(SLOTS) if s not in slot_of.values()]
                if free:
                    slot_of[i] = free[0]
                    cache = reset_slots(cache, jnp.asarray([free[0]]))
        t += 1
        active = {i: min(chunks[i], lens[i] - pos[i]) for i in slot_of if pos[i] < lens[i]}
        if not active:
            continue
        if pages is not None:
            for i, n in active.items():
                cache = pages.grow(cache, slot_of[i], pos[i] + n)
        (q, k, v), step, first = _step_inputs(seqs, active, slot_of, pos, width, fmt)
        out, cache = step_fn(*(jnp.asarray(x, dtype) for x in (q, k, v)), cache, jnp.asarray(step))
        out = np.asarray(out)
        for i, n in active.items():
            s = slot_of[i]
            rows[i].append(out[s, :n] if fmt == "bshd" else out[first[s]:first[s] + n])
            pos[i] += n
            if pos[i] == lens[i]:
                del slot_of[i]
                if pages is not None:
                    pages.release(s)
        if fmt == "thd":
            assert not out[int(step.sum()):].any(), "rows past the step's packed tokens must be zero"
        else:
            for s in range(SLOTS):
                assert not out[s, step[s]:].any(), "rows past a slot's new tokens must be zero"
    return [np.concatenate(r) for r in rows], t


def _cache(paged, hk, d, dtype, seed=0):
    if paged == "lazy":
        table = np.full((SLOTS, MAX_SEQLEN // PAGE), -1, np.int32)
        return init_paged_kv_cache(SLOTS, SLOTS * MAX_SEQLEN // PAGE, PAGE, hk, d, dtype, page_table=table)
    if not paged:
        return init_kv_cache(SLOTS, MAX_SEQLEN, hk, d, dtype)
    pages = list(range(SLOTS * MAX_SEQLEN // PAGE))
    random.Random(seed).shuffle(pages)  # each slot's pages scattered over the pool
    table = np.asarray(pages, np.int32).reshape(SLOTS, MAX_SEQLEN // PAGE)
    return init_paged_kv_cache(SLOTS, len(pages), PAGE, hk, d, dtype, page_table=table)


# (dtype, heads, kv heads, window, softmax, cache, chunk per sequence, arrival step per sequence). Three
# slots; the fourth sequence arrives after the shortest finished and takes its slot (and pages).
SCENARIOS = {
    "fp32_gqa_lazy_pages": ("float32", 4, 2, None, "vanilla", "lazy", (1, 7, 100, 1), (0, 2, 1, 8)),
    "fp32_mqa_window": ("float32", 2, 1, (5, 0), "vanilla", False, (100, 1, 7, 7), (0, 0, 3, 7)),
    "fp16_sink_window_paged": ("float16", 2, 2, (19, 0), "learnable", True, (7, 100, 1, 1), (1, 0, 0, 6)),
}


@pytest.mark.parametrize("name,fmt", grid("name,fmt", sorted(SCENARIOS), ["bshd", "thd"]))
def test_prefill_and_decode_rows_equal_training_rows(name, fmt):
    dtype, h, hk, window, softmax, paged, chunks, arrivals = SCENARIOS[name]
    dtype = jnp.dtype(dtype) if not ON_GPU or dtype == "float32" else jnp.bfloat16
    d = 16 if not ON_GPU else 128
    softmax_type = AttnSoftmaxType(softmax)
    offset = jnp.linspace(-1.0, 1.5, h, dtype=jnp.float32) if softmax == "learnable" else None
    seqs = _sequences(LENGTHS, h, hk, d, dtype, seed=len(name))
    expected = _training_rows(seqs, window, softmax_type, offset)
    width = max(min(c, max(LENGTHS)) for c in chunks)
    step = jax.jit(lambda q, k, v, c, n: kv_cache_attention(q, k, v, c, n, window_size=window,
                                                            softmax_type=softmax_type, softmax_offset=offset,
                                                            qkv_format=fmt))
    pages = _Pages(seed=len(name)) if paged == "lazy" else None
    got, steps = _serve(seqs, _cache(paged, hk, d, dtype), chunks, arrivals, width, step, fmt, pages)
    assert steps >= max(n for n, c in zip(LENGTHS, chunks) if c == 1)  # decoded token by token for a while
    for i, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(g, np.asarray(e), err_msg=f"sequence {i}")


@pytest.mark.parametrize("sizes", [(1,) * 12, (7, 5), (12,)], ids=["decode", "chunks", "whole"])
def test_step_sizes_and_formats_give_the_same_rows(sizes):
    """One sequence fed token by token, in chunks or whole, its steps alternating between the bshd and thd
    formats (thd with room to spare), gives one set of rows: the training forward's."""
    (q, k, v), = _sequences([sum(sizes)], 2, 2, 16, jnp.float32, seed=1)
    expected = np.asarray(_training_rows([(q, k, v)], None, AttnSoftmaxType.VANILLA_SOFTMAX, None)[0])
    cache, pos, rows = init_kv_cache(1, 16, 2, 16, jnp.float32), 0, []
    for j, n in enumerate(sizes):
        part = [x[pos:pos + n] for x in (q, k, v)]
        if j % 2:
            part = [jnp.pad(x, ((0, 3), (0, 0), (0, 0)), constant_values=np.nan) for x in part]
            out, cache = kv_cache_attention(*part, cache, jnp.asarray([n]), qkv_format="thd")
            assert not np.asarray(out[n:]).any()
            rows.append(np.asarray(out[:n]))
        else:
            out, cache = kv_cache_attention(*(x[None] for x in part), cache, jnp.asarray([n]))
            rows.append(np.asarray(out[0]))
        pos += n
    np.testing.assert_array_equal(np.concatenate(rows), expected)
    assert int(cache.lengths[0]) == sum(sizes)


def test_non_causal_steps_see_every_cached_key():
    """Without a causal mask a step's queries see every cached key: a whole prompt's rows are that prompt's
    training rows, and a next token's row is the training row of the sequence ending there."""
    (q, k, v), = _sequences([10], 2, 2, 16, jnp.float32, seed=2)

    def training(n):
        return np.asarray(fused_attn((q[None, :n], k[None, :n], v[None, :n]), None, None, None,
                                     AttnBiasType.NO_BIAS, AttnMaskType.NO_MASK, BSHD, is_training=False)[0])

    cache = init_kv_cache(1, 16, 2, 16, jnp.float32)
    prompt, cache = kv_cache_attention(q[None, :9], k[None, :9], v[None, :9], cache, jnp.asarray([9]),
                                       attn_mask_type="no_mask")
    last, cache = kv_cache_attention(q[None, 9:], k[None, 9:], v[None, 9:], cache, jnp.asarray([1]),
                                     attn_mask_type=AttnMaskType.PADDING_MASK)
    np.testing.assert_array_equal(np.asarray(prompt[0]), training(9))
    np.testing.assert_array_equal(np.asarray(last[0]), training(10)[-1:])
    assert not np.array_equal(np.asarray(prompt[0, -1]), training(10)[-2])  # the prompt did not see key 9


def test_paged_and_non_paged_caches_hold_the_same_tokens():
    (q, k, v), = _sequences([13], 2, 1, 16, jnp.float32, seed=4)
    flat = init_kv_cache(2, 16, 1, 16, jnp.float32)
    paged = init_paged_kv_cache(2, 4, 8, 1, 16, jnp.float32, page_table=np.asarray([[3, 0], [2, 1]], np.int32))
    for cache in (flat, paged):
        out, cache = kv_cache_attention(jnp.stack([q[:13], q[:13]]), jnp.stack([k, k]), jnp.stack([v, v]), cache,
                                        jnp.asarray([13, 6]))
        if cache.is_paged:
            np.testing.assert_array_equal(np.asarray(cache.k[3]), np.asarray(k[:8]))  # slot 0's first page
            np.testing.assert_array_equal(np.asarray(cache.k[0, :5]), np.asarray(k[8:13]))
            np.testing.assert_array_equal(np.asarray(cache.k[2, :6]), np.asarray(k[:6]))  # slot 1
        else:
            np.testing.assert_array_equal(np.asarray(cache.k[0, :13]), np.asarray(k))
            np.testing.assert_array_equal(np.asarray(cache.k[1, :6]), np.asarray(k[:6]))
        np.testing.assert_array_equal(np.asarray(cache.lengths), [13, 6])
        np.testing.assert_array_equal(np.asarray(out[1, :6]), np.asarray(out[0, :6]))  # a prefix's rows


def _two_device_mesh():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs two devices (XLA_FLAGS=--xla_force_host_platform_device_count=2 on CPU)")
    return Mesh(np.asarray(devices[:2]), ("dp",))


def test_a_bshd_batch_sharded_over_two_devices_gives_the_training_rows():
    """Slots split over a dp axis (cache, step tensors, step_lens sharded on their first axis): the step keeps
    the sharding and every row is the training row, prompt (a whole-prompt step) and next token (a decode
    step)."""
    mesh = _two_device_mesh()
    seqs = _sequences([9, 6], 2, 2, 16, jnp.float32, seed=5)
    expected = _training_rows(seqs, None, AttnSoftmaxType.VANILLA_SOFTMAX, None)
    shard = NamedSharding(mesh, PartitionSpec("dp"))
    step = jax.jit(kv_cache_attention)
    cache = jax.device_put(init_kv_cache(2, 16, 2, 16, jnp.float32), shard)
    prompt = [jnp.stack([jnp.pad(s[j][:-1], ((0, 9 - s[j].shape[0]), (0, 0), (0, 0))) for s in seqs])
              for j in range(3)]
    out, cache = step(*(jax.device_put(x, shard) for x in prompt), cache, jax.device_put(jnp.asarray([8, 5]), shard))
    assert out.sharding.spec[0] == "dp" and cache.k.sharding.spec[0] == "dp"
    last = [jnp.stack([s[j][-1:] for s in seqs]) for j in range(3)]
    nxt, cache = step(*(jax.device_put(x, shard) for x in last), cache, jax.device_put(jnp.asarray([1, 1]), shard))
    for i, n in enumerate((8, 5)):
        got = np.concatenate([np.asarray(out[i, :n]), np.asarray(nxt[i, :1])])
        np.testing.assert_array_equal(got, np.asarray(expected[i]), err_msg=f"sequence {i}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), [9, 6])


def test_thd_steps_under_shard_map_give_the_training_rows():
    """thd steps inside ``shard_map`` over a dp axis: each device steps its own slots (its part of the cache)
    with its own packed tokens; every row is the training row."""
    mesh = _two_device_mesh()
    lens = (9, 6, 4, 7)  # slots 0, 1 on the first device, 2, 3 on the second
    seqs = _sequences(lens, 4, 2, 16, jnp.float32, seed=6)
    expected = _training_rows(seqs, (3, 0), AttnSoftmaxType.VANILLA_SOFTMAX, None)
    spec = PartitionSpec("dp")
    local = jax.shard_map(lambda q, k, v, c, n: kv_cache_attention(q, k, v, c, n, window_size=(3, 0),
                                                                   qkv_format="thd"),
                          mesh=mesh, in_specs=spec, out_specs=spec)
    step = jax.jit(local)
    cache = init_kv_cache(4, 16, 2, 16, jnp.float32)
    rows, done = [[] for _ in seqs], [0] * 4
    for chunk in ((5, 2, 4, 3), (4, 4, 0, 4)):  # a prompt part each, then the rest (slot 2 sits out)
        tokens = 16  # per device
        parts, step_lens = [[], [], []], []
        for half in (slice(0, 2), slice(2, 4)):
            for j in range(3):
                block = jnp.concatenate([seqs[i][j][done[i]:done[i] + chunk[i]] for i in range(4)[half]])
                parts[j].append(jnp.pad(block, ((0, tokens - block.shape[0]), (0, 0), (0, 0))))
            step_lens += [min(chunk[i], lens[i] - done[i]) for i in range(4)[half]]
        out, cache = step(*(jnp.concatenate(x) for x in parts), cache, jnp.asarray(step_lens, jnp.int32))
        out = np.asarray(out)
        for device, half in enumerate((range(0, 2), range(2, 4))):
            first = device * tokens
            for i in half:
                rows[i].append(out[first:first + step_lens[i]])
                first += step_lens[i]
                done[i] += step_lens[i]
    for i, e in enumerate(expected):
        np.testing.assert_array_equal(np.concatenate(rows[i]), np.asarray(e), err_msg=f"sequence {i}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)


def test_the_cache_is_a_pytree_and_reset_frees_slots():
    cache = init_paged_kv_cache(2, 4, 8, 1, 16, jnp.bfloat16)
    leaves, tree = jax.tree_util.tree_flatten(cache)
    assert len(leaves) == 4 and isinstance(jax.tree_util.tree_unflatten(tree, leaves), KVCache)
    assert cache.is_paged and cache.max_seqlen == 16 and cache.max_batch_size == 2
    cache = KVCache(cache.k, cache.v, jnp.asarray([5, 7], jnp.int32), cache.page_table)
    np.testing.assert_array_equal(np.asarray(reset_slots(cache, [1]).lengths), [5, 0])
    np.testing.assert_array_equal(np.asarray(reset_slots(cache, jnp.asarray([True, False])).lengths), [0, 7])
    grown = cache.replace(page_table=jnp.asarray([[0, -1], [2, 3]]))
    assert grown.k is cache.k and grown.page_table.tolist() == [[0, -1], [2, 3]]
    with pytest.raises(ValueError, match="repeated pages"):
        cache.replace(page_table=np.asarray([[0, 1], [1, -1]]))
    with pytest.raises(ValueError, match="`fields` must be among"):
        cache.replace(pages=None)


def test_bad_inputs_name_the_argument():
    cache = init_kv_cache(2, 8, 1, 16, jnp.float32)
    q, k = jnp.zeros((2, 3, 2, 16)), jnp.zeros((2, 3, 1, 16))
    n = jnp.asarray([3, 0])
    with pytest.raises(ValueError, match="`q` must have the cache's dtype"):
        kv_cache_attention(q.astype(jnp.float16), k, k, cache, n)
    with pytest.raises(ValueError, match=r"`k` must be \[max_batch_size=2"):
        kv_cache_attention(q, k[:1], k, cache, n)
    with pytest.raises(ValueError, match=r"`v` must be \[2, 3, 1, \.\.\.\]"):
        kv_cache_attention(q, k, k[:, :2], cache, n)
    with pytest.raises(ValueError, match=r"`q` heads \(3\) must be a multiple of the cache's kv heads \(2\)"):
        k2 = jnp.zeros((2, 3, 2, 16))
        kv_cache_attention(jnp.zeros((2, 3, 3, 16)), k2, k2, init_kv_cache(2, 8, 2, 16, jnp.float32), n)
    with pytest.raises(ValueError, match=r"`step_lens` must be in \[0, 3\]"):
        kv_cache_attention(q, k, k, cache, jnp.asarray([4, 0]))
    with pytest.raises(ValueError, match="`step_lens` must be given with qkv_format='thd'"):
        kv_cache_attention(q[0], k[0], k[0], cache, None, qkv_format="thd")
    # None in bshd: every slot takes the step's tokens (here 3 each)
    _, stepped = kv_cache_attention(q, k, k, cache, None)
    np.testing.assert_array_equal(np.asarray(stepped.lengths), [3, 3])
    with pytest.raises(ValueError, match=r"`step_lens` must be an int array \[max_batch_size=2\]"):
        kv_cache_attention(q, k, k, cache, jnp.asarray([1.0, 0.0]))
    with pytest.raises(ValueError, match="`step_lens` must fit the cache"):
        full = KVCache(cache.k, cache.v, jnp.asarray([7, 0], jnp.int32))
        kv_cache_attention(q, k, k, full, n)
    with pytest.raises(ValueError, match=r"`q` must be \[step tokens, heads, 16\] \(qkv_format='thd'"):
        kv_cache_attention(q, k, k, cache, n, qkv_format="thd")
    with pytest.raises(ValueError, match=r"`step_lens` must sum to at most q's 3 packed tokens, got \[3, 1\]"):
        kv_cache_attention(q[0], k[0], k[0], cache, jnp.asarray([3, 1]), qkv_format="thd")
    with pytest.raises(ValueError, match=r"`k` must be \[3, 1, \.\.\.\]"):
        kv_cache_attention(q[0], k[0, :2], k[0], cache, jnp.asarray([2, 0]), qkv_format="thd")
    with pytest.raises(ValueError, match="`qkv_format` must be one of 'bshd', 'thd', got 'sbhd'"):
        kv_cache_attention(q, k, k, cache, n, qkv_format="sbhd")
    with pytest.raises(ValueError, match=r"`cache.page_table` must assign pages to the positions a step writes: "
                                         r"slot 1 writes positions \[0, 2\) of pages \[-1\]"):
        lazy = init_paged_kv_cache(2, 2, 8, 1, 16, jnp.float32, page_table=np.asarray([[1], [-1]]))
        kv_cache_attention(q[0], k[0], k[0], lazy, jnp.asarray([1, 2]), qkv_format="thd")
    with pytest.raises(ValueError, match="`attn_mask_type` must be one of"):
        kv_cache_attention(q, k, k, cache, n, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match="`cache` must be a KVCache"):
        kv_cache_attention(q, k, k, (cache.k, cache.v), n)
    with pytest.raises(ValueError, match="`dtype` must be float16, bfloat16 or float32"):
        init_kv_cache(1, 8, 1, 16, jnp.int8)
    with pytest.raises(ValueError, match="`max_seqlen` must be a positive int"):
        init_kv_cache(1, 0, 1, 16, jnp.float32)
    with pytest.raises(ValueError, match="`page_table` must hold page indices in"):
        init_paged_kv_cache(1, 2, 8, 1, 16, jnp.float32, page_table=np.asarray([[0, 2]]))
    with pytest.raises(ValueError, match="repeated pages"):
        init_paged_kv_cache(2, 4, 8, 1, 16, jnp.float32, page_table=np.asarray([[0, 1], [1, 2]]))


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_pytorch_and_jax_steps_give_the_same_rows(fmt):
    """The same steps through PyTorch's InferenceParams and through kv_cache_attention: two sequences, the
    second joining at the third step, prompts in chunks then decode. On a GPU both launch the same kernels
    and the rows are the same bits. On CPU PyTorch runs its unfused backend (or the interpreted kernels
    under TRITON_INTERPRET=1) and JAX its unfused jnp path, whose ``exp`` differs from torch's in the last
    bit: there the two agree within each other's error against fp64."""
    torch = pytest.importorskip("torch")
    from collections import OrderedDict

    from transformer_engine.pytorch import DotProductAttention
    from transformer_engine.pytorch.attention.inference import InferenceParams

    h, hk, d, lens, width = (4, 2, 16, (21, 12), 32) if not ON_GPU else (8, 2, 128, (700, 300), 1024)
    jdtype, tdtype = (jnp.float32, torch.float32) if not ON_GPU else (jnp.bfloat16, torch.bfloat16)
    device = "cuda" if ON_GPU else "cpu"
    seqs = _sequences(lens, h, hk, d, jdtype, seed=7)
    cache = init_kv_cache(2, width, hk, d, jdtype)
    params = InferenceParams(2, width, hk, d, tdtype)
    params.allocate_memory(1)
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type="causal",
                              layer_number=1).to(device).eval()

    def to_torch(x):
        return torch.from_dlpack(x) if ON_GPU else torch.from_numpy(np.array(x))

    chunks = [(7, 0), (1, 0), (5, 12), (1, 0)] + [(1, 0)] * 7 if not ON_GPU else [(300, 0), (399, 299), (1, 1)]
    pos, ours, theirs = [0, 0], [[], []], [[], []]
    for step in chunks:
        active = [i for i in range(2) if step[i]]
        parts = [[x[i][pos[i]:pos[i] + step[i]] for i in active] for x in zip(*seqs)]
        if fmt == "thd":
            tensors = [jnp.concatenate(p) for p in parts]
        else:
            t = max(step)
            tensors = [jnp.stack([jnp.pad(x, ((0, t - x.shape[0]), (0, 0), (0, 0))) for x in p]) for p in parts]
        step_lens = jnp.asarray(step, jnp.int32)
        if fmt == "bshd" and len(active) < 2:  # bshd rows are slots: an absent slot gets an empty row
            tensors = [jnp.concatenate([x, jnp.zeros_like(x)]) if active == [0] else x for x in tensors]
        out, cache = kv_cache_attention(*tensors, cache, step_lens, qkv_format=fmt)
        params.pre_step(OrderedDict((i, step[i]) for i in active))
        ref = dpa(*(to_torch(x[:len(active)] if fmt == "bshd" else x) for x in tensors), inference_params=params)
        ref = ref.float().cpu().numpy().reshape(*ref.shape[:-1], h, d)
        out = np.asarray(out.astype(jnp.float32))
        first = 0
        for b, i in enumerate(active):
            ours[i].append(out[b, :step[i]] if fmt == "bshd" else out[first:first + step[i]])
            theirs[i].append(ref[b, :step[i]] if fmt == "bshd" else ref[first:first + step[i]])
            first += step[i]
            pos[i] += step[i]
    for i, n in enumerate(lens):
        a, b = np.concatenate(ours[i]), np.concatenate(theirs[i])
        assert a.shape[0] == n == b.shape[0]
        if ON_GPU:
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {i}")
            continue
        q, k, v = (np.asarray(x, np.float64) for x in seqs[i])
        k, v = (np.repeat(x, h // hk, axis=1) for x in (k, v))
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        exact = np.einsum("hqk,khd->qhd", probs / probs.sum(-1, keepdims=True), v)
        err_jax, err_torch = np.abs(a - exact).max(), np.abs(b - exact).max()
        assert err_jax <= 2.0 * err_torch + 1e-7 and err_torch <= 2.0 * err_jax + 1e-7, (i, err_jax, err_torch)
        np.testing.assert_allclose(a, b, rtol=0, atol=4.0 * max(err_jax, err_torch) + 1e-7, err_msg=f"seq {i}")


@gpu_only
@pytest.mark.parametrize("d", [128, 64])
def test_long_context_prefill_and_decode_rows_equal_training_rows(d):
    """A 16k-token prompt in 4k chunks, then 64 decode steps next to a short sequence (bf16, GQA, paged, thd):
    the rows are the training forward's. The keys are summed in chunks (the Triton forward at d=64 on every GPU,
    Hopper's Gluon forward at d=128): the training call folds them in one program per row block, the decode steps
    (a small grid) split them over programs and combine."""
    n, h, hk, page = 16384 + 64, 16, 4, 256
    seqs = _sequences([n, 100], h, hk, d, jnp.bfloat16, seed=8)
    expected = _training_rows(seqs, None, AttnSoftmaxType.VANILLA_SOFTMAX, None)
    pages = list(range(2 * (n + page) // page))
    random.Random(3).shuffle(pages)
    cache = init_paged_kv_cache(2, len(pages), page, hk, d, jnp.bfloat16,
                                page_table=np.asarray(pages, np.int32).reshape(2, -1))
    step = jax.jit(lambda q, k, v, c, s: kv_cache_attention(q, k, v, c, s, qkv_format="thd"))
    sizes = [(4096, 100)] * 4 + [(1, 0)] * 64
    pos, rows = [0, 0], [[], []]
    for size in sizes:
        size = tuple(min(s, len_ - p) for s, len_, p in zip(size, (n, 100), pos))
        parts = [jnp.concatenate([x[i][pos[i]:pos[i] + size[i]] for i in range(2)]) for x in zip(*seqs)]
        parts = [jnp.pad(x, ((0, 4196 - x.shape[0]), (0, 0), (0, 0))) for x in parts]  # one compiled shape
        out, cache = step(*parts, cache, jnp.asarray(size, jnp.int32))
        out = np.asarray(out.astype(jnp.float32))
        rows[0].append(out[:size[0]])
        rows[1].append(out[size[0]:size[0] + size[1]])
        pos = [p + s for p, s in zip(pos, size)]
    for i, e in enumerate(expected):
        np.testing.assert_array_equal(np.concatenate(rows[i]), np.asarray(e.astype(jnp.float32)),
                                      err_msg=f"sequence {i}")
