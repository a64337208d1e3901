"""JAX's paged KV cache read in place: kv_cache_attention on a paged cache runs the paged forward primitive
(transformer_engine.jax.primitives.paged: the planned forward follows the page table, the Triton one row by row,
Hopper's Gluon one by its loader's TMA loads) where the fused backend runs and the paged plan is the gathered call's
(plan.pages_keep_bits: on Hopper, page sizes the Gluon loader can follow), and gathers the pages elsewhere.

Checked here: the rows of the paged path are bitwise the non-paged cache's rows and, on a GPU, the training rows
(shuffled page tables; page sizes 1, 5, 8 on CPU, 16, 24 (not a multiple of any key block), 64, 256 on a GPU, at
d=64 and, on Hopper the Gluon forward's, d=128; GQA, MQA, causal and windowed masks, a learnable sink, chunked
prefill and decode, both step formats, sharded and ``shard_map`` steps); which path a step takes (the jaxpr holds
the paged primitive, or none); that the CUDA lowering of a paged step describes exactly PyTorch's launches for the
same call (sm_80 and sm_90, the Gluon paged forward included; lowered on the CPU through ``jax.export`` with the
launches recorded, not compiled) and compiles with the Gluon forward's descriptor scratch; gradients through the
gathered call; bad tables named.
On CPU ``fused_attn`` selects the unfused backend (JAX launches no Triton interpreter), so the fused path is
forced there (:func:`_force_backend`, the steps' selection monkeypatched: the fused primitives' jnp lowering, whose
paged form gathers inside the primitive); on a GPU the selection runs and the kernels read the pages.
"""

from __future__ import annotations

import dataclasses
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from case_grid import grid
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer_engine.common.attention import enums as common
from transformer_engine.common.attention.backends import backend_named
from transformer_engine.common.attention.plan import pages_keep_bits
from transformer_engine.jax import attention as te_attention
from transformer_engine.jax import inference
from transformer_engine.jax.attention import SequenceDescriptor, fused_attn
from transformer_engine.jax.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout
from transformer_engine.jax.inference import init_kv_cache, init_paged_kv_cache, kv_cache_attention
from transformer_engine.jax.primitives import gpu


@pytest.fixture(autouse=True)
def _gluon_paged(monkeypatch):
    """This file tests the Gluon forward's paged loads, which NVTE_FUSED_ATTN_GLUON_PAGED turns on (off by default:
    those configs gather, test_explain_plan.py::test_gluon_paged_loads_are_off_by_default)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_GLUON_PAGED", "1")
from transformer_engine.jax.primitives.attention import FusedAttnStatic
from transformer_engine.jax.primitives.paged import fused_attn_paged

ON_GPU = jax.default_backend() == "gpu"
BACKEND = None if ON_GPU else "fused"  # the selection on a GPU; the fused primitives' jnp lowering on CPU
PAGED_PRIMITIVE = "te_fused_attn_paged_fwd"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the kernels read the page table there)")


def _force_backend(monkeypatch, name):
    """kv_cache_attention's steps run on backend ``name`` ('fused', 'unfused') instead of ``fused_attn``'s
    selection (None: the selection); other calls (the training rows) keep theirs."""
    if name is not None:
        forced = types.SimpleNamespace(backend=backend_named(name, te_attention._CANDIDATES))
        monkeypatch.setattr(inference, "select_attention_backend", lambda config: forced)


@pytest.fixture
def step_backend(monkeypatch):
    """The steps on ``BACKEND``: the selection on a GPU, the fused primitives' jnp lowering on CPU."""
    _force_backend(monkeypatch, BACKEND)


def _sequences(lengths, h, hk, d, dtype, seed):
    rng = np.random.default_rng(seed)
    return [tuple(jnp.asarray(rng.standard_normal((n, heads, d)), dtype) for heads in (h, hk, hk)) for n in lengths]


def _caches(slots, max_seqlen, page_size, hk, d, dtype, seed):
    """(non-paged cache, paged cache with a shuffled table over a pool with spare pages)."""
    n = -(-max_seqlen // page_size)
    pages = list(range(slots * n + 3))
    random.Random(seed).shuffle(pages)
    table = np.asarray(pages[:slots * n], np.int32).reshape(slots, n)
    return (init_kv_cache(slots, n * page_size, hk, d, dtype),
            init_paged_kv_cache(slots, len(pages), page_size, hk, d, dtype, page_table=table))


def _steps(seqs, plan, fmt, slots):
    """Yield (q, k, v, step_lens, take) per step of ``plan`` (tokens per sequence per step; sequence i in slot i):
    ``take(out)`` gives each sequence's rows of the step's output."""
    pos = [0] * len(seqs)
    for step in plan:
        step = [min(n, s[0].shape[0] - p) for n, s, p in zip(step, seqs, pos)]
        width = max(max(step), 1)
        if fmt == "bshd":
            arrays = [jnp.stack([jnp.pad(s[j][p:p + n], ((0, width - n), (0, 0), (0, 0)))
                                 for s, p, n in zip(seqs, pos, step)]) for j in range(3)]
        else:
            total = sum(step) + 3  # room to spare: padding rows are never read
            arrays = [jnp.pad(jnp.concatenate([s[j][p:p + n] for s, p, n in zip(seqs, pos, step)]),
                              ((0, total - sum(step)), (0, 0), (0, 0))) for j in range(3)]
        first = np.cumsum([0] + step)

        def take(out, step=step, first=first):
            out = np.asarray(out)
            return [out[i, :n] if fmt == "bshd" else out[first[i]:first[i] + n] for i, n in enumerate(step)]

        yield (*arrays, jnp.asarray(step, jnp.int32), take)
        pos = [p + n for p, n in zip(pos, step)]


def _serve(seqs, cache, plan, fmt, step_fn):
    rows = [[] for _ in seqs]
    for q, k, v, step_lens, take in _steps(seqs, plan, fmt, cache.max_batch_size):
        out, cache = step_fn(q, k, v, cache, step_lens)
        for i, r in enumerate(take(out)):
            rows[i].append(r)
    return [np.concatenate(r) for r in rows]


def _training_rows(seqs, window, softmax_type, offset):
    """Each sequence's rows of the training forward (alone, causal)."""
    kw = dict(softmax_type=softmax_type, softmax_offset=offset, window_size=window, is_training=False)
    return [np.asarray(fused_attn(tuple(t[None] for t in s), None, None, None, AttnBiasType.NO_BIAS,
                                  AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, **kw)[0]) for s in seqs]


def _uses_paged(step_fn, *args) -> bool:
    return PAGED_PRIMITIVE in str(jax.make_jaxpr(step_fn)(*args))


# name: (lengths, h, hk, window, softmax, plan of tokens per sequence per step)
CASES = {
    "gqa_chunks_decode": ((29, 18, 11), 4, 2, None, "vanilla", [(7, 18, 1)] * 4 + [(1, 0, 1)] * 8),
    "mqa_window_decode": ((21, 9, 15), 4, 1, (5, 0), "vanilla", [(9, 1, 4), (12, 8, 1)] + [(1, 1, 1)] * 12),
    "sink_whole_prompt": ((17, 13, 4), 2, 2, None, "learnable", [(17, 2, 4)] + [(0, 1, 0)] * 11),
}
PAGE_SIZES = (1, 5, 8) if not ON_GPU else (16, 24, 64, 256)


# Head dims: on a GPU d=64 (the Triton forward) and d=128 (on Hopper the Gluon forward where the page size fits).
HEAD_DIMS = (16,) if not ON_GPU else (64, 128)


@pytest.mark.parametrize("name,page_size,fmt,d", grid("name,page_size,fmt,d", sorted(CASES), PAGE_SIZES,
                                                       ["bshd", "thd"], HEAD_DIMS))
def test_paged_rows_equal_non_paged_and_training_rows(step_backend, name, page_size, fmt, d):
    """Chunked prefill and decode on a paged cache (shuffled pages): every row is bitwise the non-paged cache's
    and, on a GPU, the training forward's (the existing non-paged rows are: test_jax_kv_cache.py); the step reads
    through the table (the paged primitive) where the paged plan is the gathered call's, which on Hopper at d=128
    (the Gluon forward, sink softmax aside) is every page size here but 24."""
    lengths, h, hk, window, softmax, plan = CASES[name]
    dtype = jnp.float32 if not ON_GPU else jnp.bfloat16
    if ON_GPU:
        lengths = tuple(n * 11 for n in lengths)
        plan = [tuple(x * 11 if x > 1 else x for x in step) for step in plan] + [(1, 1, 1)] * 4
    softmax_type = AttnSoftmaxType(softmax)
    offset = jnp.linspace(-1.0, 1.5, h, dtype=jnp.float32) if softmax == "learnable" else None
    seqs = _sequences(lengths, h, hk, d, dtype, seed=len(name) + page_size)
    flat, paged = _caches(len(seqs), max(lengths) + 2, page_size, hk, d, dtype, seed=page_size)
    step = jax.jit(lambda q, k, v, c, n: kv_cache_attention(q, k, v, c, n, window_size=window,
                                                            softmax_type=softmax_type, softmax_offset=offset,
                                                            qkv_format=fmt))
    q, k, v, n, _ = next(_steps(seqs, plan, fmt, len(seqs)))
    contiguous = inference._contiguous_call(q, paged, n, fmt, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
                                        dict(softmax_type=softmax_type, scaling_factor=None, is_training=False,
                                             window_size=window, softmax_offset=offset,
                                             bottom_right_diagonal=True))
    reads_pages = pages_keep_bits(contiguous.config, page_size)
    assert _uses_paged(step, q, k, v, paged, n) == reads_pages
    assert not _uses_paged(step, q, k, v, flat, n)
    assert reads_pages or ON_GPU  # on CPU no Gluon plan: the paged primitive always
    if ON_GPU and d == 128 and jax.devices()[0].compute_capability == "9.0" and softmax == "vanilla":
        assert reads_pages == (page_size != 24)  # the Gluon forward follows pages of 16, 64, 256 keys
    got = _serve(seqs, paged, plan, fmt, step)
    want = _serve(seqs, flat, plan, fmt, step)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"sequence {i}: paged != non-paged")
    if ON_GPU:  # the jnp lowering of the fused primitives (CPU) is not padding-invariant: the kernels are
        # The plan may serve a prefix of a sequence: causal rows are the training forward's on the whole one.
        for i, (g, e) in enumerate(zip(got, _training_rows(seqs, window, softmax_type, offset))):
            np.testing.assert_array_equal(g, e[:len(g)], err_msg=f"sequence {i}: paged != training")


def test_unfused_backend_gathers(monkeypatch):
    """The unfused backend reads no page table: a paged step gathers (no paged primitive), and its rows are the
    non-paged cache's."""
    seqs = _sequences((12, 7), 2, 2, 16, jnp.float32, seed=3)
    flat, paged = _caches(2, 16, 8, 2, 16, jnp.float32, seed=3)
    _force_backend(monkeypatch, "unfused")
    step = jax.jit(lambda q, k, v, c, n: kv_cache_attention(q, k, v, c, n))
    q, k, v, n, _ = next(_steps(seqs, [(5, 7)], "bshd", 2))
    assert not _uses_paged(step, q, k, v, paged, n)
    plan = [(5, 7), (1, 0), (6, 0)]
    for a, b in zip(_serve(seqs, paged, plan, "bshd", step), _serve(seqs, flat, plan, "bshd", step)):
        np.testing.assert_array_equal(a, b)


def test_eager_steps_read_pages_and_match_jit(step_backend):
    """An eager (unjitted) paged step gives the jitted step's rows (the gathered call's shapes are traced
    abstractly: no gather is made to decide)."""
    seqs = _sequences((10, 6), 4, 2, 16, jnp.float32, seed=4)
    _, paged = _caches(2, 16, 4, 2, 16, jnp.float32, seed=4)
    eager = lambda q, k, v, c, n: kv_cache_attention(q, k, v, c, n, qkv_format="thd")  # noqa: E731
    plan = [(4, 6), (6, 0)]
    for a, b in zip(_serve(seqs, paged, plan, "thd", eager), _serve(seqs, paged, plan, "thd", jax.jit(eager))):
        np.testing.assert_array_equal(a, b)


def test_gradients_through_a_paged_step_are_the_gathered_calls(step_backend):
    """jax.grad through a paged step: the custom VJP recomputes on gathered rows, so q's and the pools' gradients
    are the non-paged step's (the pools' scattered back through the table)."""
    seqs = _sequences((9, 5), 2, 1, 16, jnp.float32, seed=5)
    flat, paged = _caches(2, 16, 4, 1, 16, jnp.float32, seed=5)
    q, k, v, n, _ = next(_steps(seqs, [(9, 5)], "bshd", 2))

    def loss(q, k, v, cache):
        out, _ = kv_cache_attention(q, k, v, cache, n)
        return jnp.sum(out * out)

    assert _uses_paged(lambda *a: loss(*a), q, k, v, paged)
    g_paged = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, paged)
    g_flat = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, flat)
    for a, b in zip(g_paged, g_flat):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(g_paged[1])).max() > 0


def _static(page_size, **kw):
    return FusedAttnStatic(attn_mask_type=common.AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
                           qkv_format=common.QKVFormat.THD, attn_bias_type=common.AttnBiasType.NO_BIAS,
                           window_size=(-1, 0), scaling_factor=0.25, kv_page_size=page_size, is_training=False, **kw)


def test_bad_page_tables_name_the_argument():
    q = jnp.zeros((1, 6, 2, 16), jnp.float32)
    pages = jnp.zeros((4, 8, 2, 16), jnp.float32)
    lens, offs = jnp.asarray([[3, 3]], jnp.int32), jnp.asarray([[0, 3, 6]], jnp.int32)
    table = jnp.asarray([[[0, 1], [2, 3]]], jnp.int32)
    static = _static(8)
    fused_attn_paged(q, pages, pages, table, (lens, lens, offs), static)  # valid
    with pytest.raises(ValueError, match=r"`page_table` must be int32 \[1, segments, pages_per_sequence\], got "
                                         r"int32\[2, 2\]"):
        fused_attn_paged(q, pages, pages, table[0], (lens, lens, offs), static)
    for bad in (table.astype(jnp.float32), table.astype(jnp.int16)):
        with pytest.raises(ValueError, match=rf"`page_table` must be int32 .*, got {bad.dtype}\[1, 2, 2\]"):
            jax.jit(lambda t: fused_attn_paged(q, pages, pages, t, (lens, lens, offs), static))(bad)
    with pytest.raises(ValueError, match=r"`q_seqlens` must be int \[1, 1\] \(page_table's 1 segments"):
        fused_attn_paged(q, pages, pages, table[:, :1], (lens, lens, offs), static)
    with pytest.raises(ValueError, match="`kv_page_size` must be the pools' page size 8, got 4"):
        fused_attn_paged(q, pages, pages, table, (lens, lens, offs), _static(4))
    with pytest.raises(ValueError, match=r"`k_pages` must be float32"):
        fused_attn_paged(q, pages.astype(jnp.float16), pages, table, (lens, lens, offs), static)
    # The cache's own checks (KVCache.replace, init_paged_kv_cache) name `page_table` too.
    cache = init_paged_kv_cache(2, 4, 8, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"`page_table` must be \[max_batch_size=2, pages_per_sequence\]"):
        cache.replace(page_table=jnp.zeros((3, 2), jnp.int32))
    with pytest.raises(ValueError, match="`page_table` must hold page indices"):
        cache.replace(page_table=np.asarray([[0.0, 1.0], [2.0, 3.0]]))
    with pytest.raises(ValueError, match=r"`page_table` must be an int array \[max_batch_size=2"):
        jax.jit(lambda t: cache.replace(page_table=t))(jnp.zeros((2, 2), jnp.float32))


# ------------------------------------------------------------------------------------------------
# The CUDA lowering's launches == PyTorch's for the same paged call
# ------------------------------------------------------------------------------------------------


def _as_gpu(monkeypatch, cc):
    """JAX's CUDA lowering and device facts as on a GPU of compute capability ``cc`` with the extension built."""
    monkeypatch.setattr(gpu, "_compute_capability", lambda: cc)
    monkeypatch.setattr(gpu, "_require_extension", lambda: None)
    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", cc))


@pytest.fixture
def recorded_cuda_launches(monkeypatch):
    """Lower for CUDA here (an sm_80 GPU with the extension built, as JAX reports it to the frontend) and keep
    the launches each lowering describes instead of compiling them."""
    _as_gpu(monkeypatch, (8, 0))
    _force_backend(monkeypatch, "fused")
    recorded = []
    monkeypatch.setattr(gpu.Program, "add_launches", lambda prog, described, buffers: recorded.append(tuple(described)))
    return recorded


def _export_for_cuda(fn, *args):
    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(gpu.FFI_TARGET)])(*args)


def _launches_equal_pytorchs(recorded, fmt, page_size, window, d, cc):
    """Lower a paged step (fp16, head dim ``d``) for a GPU of compute capability ``cc`` and describe PyTorch's
    launches for the same call on the same table: the lists must be equal. Returns JAX's launches."""
    torch = pytest.importorskip("torch")
    from transformer_engine.common.attention import launch_description
    from transformer_engine.pytorch.attention import kernel_runner
    from transformer_engine.pytorch.attention.call import fused_call

    slots, h, hk, n = 3, 4, 2, 7
    dtype = jnp.float16
    step_lens = [5, 0, 2]
    t = 5 if fmt == "bshd" else 9
    cache = init_paged_kv_cache(slots, slots * n + 2, page_size, hk, d, dtype,
                                page_table=np.arange(slots * n, dtype=np.int32).reshape(slots, n)[::-1].copy())
    cache = cache.replace(lengths=jnp.asarray([40 % (n * page_size), 3, 7 % (n * page_size)], jnp.int32))
    if page_size == 1024:
        cache = cache.replace(lengths=jnp.asarray([5000, 3, 7000], jnp.int32))
    q = jnp.zeros((slots, t, h, d) if fmt == "bshd" else (t, h, d), dtype)
    kv = jnp.zeros(q.shape[:-2] + (hk, d), dtype)
    step = lambda q, k, v, c, s: kv_cache_attention(q, k, v, c, s, window_size=window, qkv_format=fmt)  # noqa: E731
    _export_for_cuda(step, q, kv, kv, cache, jnp.asarray(step_lens, jnp.int32))
    (jax_launches,) = recorded
    assert jax_launches[0].args["PAGE_SIZE"] == page_size
    assert len(jax_launches) == (2 if n * page_size > 4096 else 1)  # split-KV over the table's keys

    # PyTorch: the same call (thd, one sequence per slot, max_seqlen_q the step's rows, max_seqlen_kv the table's
    # keys) on the cache's rows with the same page table.
    cached = np.asarray(cache.lengths) + np.asarray(step_lens)
    cu = lambda lens: torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)  # noqa: E731
    call = fused_call("thd", "padding_causal_bottom_right", window, d ** -0.5, cu_seqlens_q=cu(step_lens),
                      cu_seqlens_kv=cu(cached), max_seqlen_q=t, max_seqlen_kv=n * page_size)
    table = torch.from_numpy(np.array(cache.page_table))
    call = dataclasses.replace(call, page_table=table,
                               params=dataclasses.replace(call.params, kv_page_size=page_size))
    tq = torch.zeros(slots * t if fmt == "bshd" else t, h, d, dtype=torch.float16)
    tk = torch.zeros(cache.k.shape[0] * page_size, hk, d, dtype=torch.float16)
    seqs = kernel_runner.sequences(tq, tk, call)
    lse = torch.zeros(slots, h, t)
    tensors = dict(q=tq, k=tk, v=tk, out=tq)
    device = dict(device_type="cuda", vendor="nvidia", compute_capability=cc, gfx_arch=None)
    kernel_runner_device = kernel_runner._device
    try:
        kernel_runner._device = lambda _: device
        described = kernel_runner.describe(tq, tk, tk, call, seqs, tensors, (lse.stride(0), lse.stride(1)))
    finally:
        kernel_runner._device = kernel_runner_device
    torch_launches = launch_description.forward_launches(described)
    assert [x.describe() for x in jax_launches] == [x.describe() for x in torch_launches]
    return jax_launches


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
@pytest.mark.parametrize("page_size,window", [(16, None), (24, (40, 0)), (1, None), (1024, (100, 0))])
def test_cuda_launches_equal_pytorchs_for_the_same_paged_call(recorded_cuda_launches, fmt, page_size, window):
    """sm_80, d=64: the Triton forward reads the pages, in JAX and in PyTorch alike."""
    launches = _launches_equal_pytorchs(recorded_cuda_launches, fmt, page_size, window, 64, (8, 0))
    assert launches[0].name == "attn_fwd_kernel"


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
@pytest.mark.parametrize("page_size,window", [(16, None), (64, (40, 0)), (128, None), (1024, (100, 0))])
def test_cuda_launches_equal_pytorchs_for_the_same_gluon_paged_call(recorded_cuda_launches, monkeypatch, fmt,
                                                                     page_size, window):
    """sm_90, fp16 at d=128: the Gluon forward reads the pages (its paged arguments: the table's slot and row
    stride, the page size and the pools' rows), split-KV over the table's keys alike, in JAX and in PyTorch."""
    _as_gpu(monkeypatch, (9, 0))
    launches = _launches_equal_pytorchs(recorded_cuda_launches, fmt, page_size, window, 128, (9, 0))
    assert launches[0].name == "attn_fwd_ws_kernel" and launches[0].args["page_rows"] == (3 * 7 + 2) * page_size
    assert launches[0].args["SPLIT_KV"] == (len(launches) == 2)


@pytest.mark.parametrize("cc,page_size,kernel,reads", [((8, 0), 16, "attn_fwd_kernel", True),
                                                       ((9, 0), 16, "attn_fwd_ws_kernel", True),
                                                       ((9, 0), 64, "attn_fwd_ws_kernel", True),
                                                       ((9, 0), 24, "attn_fwd_ws_kernel", False),
                                                       ((9, 0), 8, "attn_fwd_ws_kernel", False)])
def test_hopper_gluon_configs_read_pages_where_the_loader_can(recorded_cuda_launches, monkeypatch, cc, page_size,
                                                              kernel, reads):
    """fp16 at d=128: on Hopper the gathered call plans the Gluon forward, whose loader follows pages of 16 keys
    and more that divide or fill its key blocks of 128: the step reads them in place (the paged primitive, a
    PAGE_SIZE launch); with pages of 24 or 8 keys the paged plan would run the Triton forward, whose bits differ,
    so the step gathers into the Gluon forward (no paged primitive, no PAGE_SIZE). On Ampere the Triton forward
    reads any pages."""
    _as_gpu(monkeypatch, cc)
    _, paged = _caches(2, 256, page_size, 2, 128, jnp.float16, seed=0)
    q = jnp.zeros((2, 4, 4, 128), jnp.float16)
    kv = jnp.zeros((2, 4, 2, 128), jnp.float16)
    step = lambda q, k, v, c, s: kv_cache_attention(q, k, v, c, s)  # noqa: E731
    n = jnp.asarray([4, 1], jnp.int32)
    assert _uses_paged(step, q, kv, kv, paged, n) == reads
    _export_for_cuda(step, q, kv, kv, paged, n)
    (launches,) = recorded_cuda_launches
    assert launches[0].name == kernel
    assert launches[0].args.get("PAGE_SIZE", 0) == (page_size if reads else 0)


@gpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_pytorch_and_jax_paged_steps_give_the_same_bits(d):
    """The same paged steps through PyTorch's InferenceParams (paged, pages read in place) and JAX's paged
    cache: the same rows, bit for bit (bf16, GQA, chunked prefill then decode; at d=128 on Hopper both read the
    pages with the Gluon forward)."""
    torch = pytest.importorskip("torch")
    from collections import OrderedDict

    from transformer_engine.pytorch import DotProductAttention
    from transformer_engine.pytorch.attention.inference import InferenceParams

    h, hk, lens, page = 8, 2, (702, 300), 64  # the plan below serves every token
    seqs = _sequences(lens, h, hk, d, jnp.bfloat16, seed=7)
    width = 1024
    _, cache = _caches(2, width, page, hk, d, jnp.bfloat16, seed=7)
    params = InferenceParams(2, width, hk, d, torch.bfloat16, is_paged=True, page_size=page, qkv_format="thd")
    params.allocate_memory(1)
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="thd", attn_mask_type="causal",
                              layer_number=1).cuda().eval()
    plan = [(300, 0), (400, 299), (1, 1), (1, 0)]
    pos, ours, theirs = [0, 0], [[], []], [[], []]
    step = jax.jit(lambda q, k, v, c, s: kv_cache_attention(q, k, v, c, s, qkv_format="thd"))
    for sizes in plan:
        active = [i for i in range(2) if sizes[i]]
        parts = [jnp.concatenate([x[i][pos[i]:pos[i] + sizes[i]] for i in active]) for x in zip(*seqs)]
        out, cache = step(*parts, cache, jnp.asarray(sizes, jnp.int32))
        params.pre_step(OrderedDict((i, sizes[i]) for i in active))
        with torch.no_grad():
            ref = dpa(*(torch.from_dlpack(x) for x in parts), inference_params=params)
        ref = ref.float().cpu().numpy().reshape(-1, h, d)
        out = np.asarray(out.astype(jnp.float32))
        first = 0
        for i in active:
            ours[i].append(out[first:first + sizes[i]])
            theirs[i].append(ref[first:first + sizes[i]])
            first += sizes[i]
            pos[i] += sizes[i]
    for i in range(2):
        np.testing.assert_array_equal(np.concatenate(ours[i]), np.concatenate(theirs[i]), err_msg=f"sequence {i}")


def _two_device_mesh():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs two devices (XLA_FLAGS=--xla_force_host_platform_device_count=2 on CPU)")
    return Mesh(np.asarray(devices[:2]), ("dp",))


def test_sharded_slots_read_pages_in_place(step_backend):
    """Slots split over a dp axis under jit (q, step_lens, lengths and the table's rows sharded; the pools
    replicated: the table holds global page indices), and thd steps inside shard_map (each device its own pool
    and table): the paged primitive runs and the rows are the non-paged cache's."""
    mesh = _two_device_mesh()
    seqs = _sequences((9, 6, 4, 7), 4, 2, 16, jnp.float32, seed=6)
    flat, paged = _caches(4, 12, 4, 2, 16, jnp.float32, seed=6)
    plan = [(5, 2, 4, 3), (4, 4, 0, 4), (1, 1, 1, 1)]
    dp, rep = NamedSharding(mesh, PartitionSpec("dp")), NamedSharding(mesh, PartitionSpec())
    placed = inference.KVCache(jax.device_put(paged.k, rep), jax.device_put(paged.v, rep),
                               jax.device_put(paged.lengths, dp), jax.device_put(paged.page_table, dp))
    step = jax.jit(lambda q, k, v, c, n: kv_cache_attention(q, k, v, c, n, window_size=(3, 0)))
    q, k, v, n, _ = next(_steps(seqs, plan, "bshd", 4))
    assert _uses_paged(step, q, k, v, placed, n)
    sharded = lambda q, k, v, c, n: step(*(jax.device_put(x, dp) for x in (q, k, v)), c,  # noqa: E731
                                         jax.device_put(n, dp))
    for a, b in zip(_serve(seqs, placed, plan, "bshd", sharded), _serve(seqs, flat, plan, "bshd", step)):
        np.testing.assert_array_equal(a, b)

    # shard_map: each device steps slots {0, 1} or {2, 3} of its own cache (local page indices).
    # Two pools of 8 pages laid end to end (the pool axis split over dp); each device's table indexes its own.
    local = [random.Random(seed).sample(range(8), 6) for seed in (1, 2)]
    table = np.asarray(local, np.int32).reshape(4, 3)
    empty = init_paged_kv_cache(4, 16, 4, 2, 16, jnp.float32)
    per_device = inference.KVCache(empty.k, empty.v, empty.lengths, jnp.asarray(table))
    spec = PartitionSpec("dp")
    body = lambda q, k, v, c, n: kv_cache_attention(q, k, v, c, n, qkv_format="thd")  # noqa: E731
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    for cache, fn in ((per_device, mapped), (flat, mapped)):
        rows = [[] for _ in seqs]
        pos = [0] * 4
        for sizes in plan:
            sizes = [min(s, x[0].shape[0] - p) for s, x, p in zip(sizes, seqs, pos)]
            parts = [[], [], []]
            for half in (range(0, 2), range(2, 4)):
                for j in range(3):
                    block = jnp.concatenate([seqs[i][j][pos[i]:pos[i] + sizes[i]] for i in half])
                    parts[j].append(jnp.pad(block, ((0, 12 - block.shape[0]), (0, 0), (0, 0))))
            out, cache = fn(*(jnp.concatenate(x) for x in parts), cache, jnp.asarray(sizes, jnp.int32))
            out = np.asarray(out)
            for device, half in enumerate((range(0, 2), range(2, 4))):
                first = device * 12
                for i in half:
                    rows[i].append(out[first:first + sizes[i]])
                    first += sizes[i]
                    pos[i] += sizes[i]
        if cache.is_paged:
            got = [np.concatenate(r) for r in rows]
        else:
            want = [np.concatenate(r) for r in rows]
    assert PAGED_PRIMITIVE in str(jax.make_jaxpr(mapped)(*(jnp.zeros((24,) + x.shape[1:]) for x in seqs[0]),
                                                        per_device, jnp.asarray([1, 1, 1, 1], jnp.int32)))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cc,d,page_size,name", [((8, 0), 64, 24, "attn_fwd_kernel"),
                                                 ((9, 0), 128, 16, "attn_fwd_ws_kernel")])
def test_the_paged_forward_compiles_with_the_table_as_an_int32_buffer(monkeypatch, cc, d, page_size, name):
    """The CUDA lowering compiled (Triton's ptxas, no GPU): the forward's PAGE_TABLE parameter is bound to the
    int32 table operand, and the program launches the planned forward only: the Triton one on sm_80, on sm_90 the
    Gluon one, whose descriptors over the pools are built on the device in a global scratch result of the
    program (its size per program times the grid)."""
    triton = pytest.importorskip("triton")
    from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel

    if not isinstance(attn_fwd_kernel, triton.runtime.jit.JITFunction):
        pytest.skip("kernels loaded for the interpreter (TRITON_INTERPRET=1): they cannot be compiled here")
    _as_gpu(monkeypatch, cc)
    _force_backend(monkeypatch, "fused")
    programs = []
    real_call = gpu.Program.call
    monkeypatch.setattr(gpu.Program, "call", lambda self, *ops: (programs.append(self), real_call(self, *ops))[1])
    _, paged = _caches(2, 40, page_size, 2, d, jnp.float16, seed=1)
    q, kv = jnp.zeros((9, 4, d), jnp.float16), jnp.zeros((9, 2, d), jnp.float16)
    step = lambda q, k, v, c, s: kv_cache_attention(q, k, v, c, s, qkv_format="thd")  # noqa: E731
    _export_for_cuda(step, q, kv, kv, paged, jnp.asarray([6, 3], jnp.int32))
    (prog,) = programs
    (kernel,) = prog._kernels
    assert kernel.name == name
    buffers = prog.operands + prog.results
    (launch,) = prog._launches
    (table_param,) = [i for i, (param, _) in enumerate(kernel.params) if param == "PAGE_TABLE"]
    assert kernel.params[table_param][1] == "*i32"
    kind, index = launch[2][table_param]
    pages = -(-40 // page_size)  # _caches: max_seqlen 40, in pages per slot
    assert kind == 0 and buffers[index].dtype == jnp.int32 and buffers[index].shape == (2, pages)  # [slots, pages]
    if name == "attn_fwd_ws_kernel":
        assert kernel.global_scratch_size > 0
        kind, index = launch[2][len(kernel.params)]  # the global scratch pointer follows the kernel's parameters
        grid = launch[1]
        assert kind == 0 and buffers[index].shape == (grid[0] * grid[1] * grid[2] * kernel.global_scratch_size,)
