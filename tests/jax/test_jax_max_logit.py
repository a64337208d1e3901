"""``fused_attn(..., return_max_logit=True)``: ``(out, max_logit)``, ``max_logit`` ``[h_q]`` in q's dtype, each
head's largest ``scale * q k^T + bias`` over the visible (query, key) pairs of the batch.

Both backends: ``fused`` (the forward primitive's row maxima, then a max over rows: on CPU the primitive's jnp
lowering, which computes them in the kernel's base-2 arithmetic; on a GPU the forward kernel) and ``unfused``
(jnp math). Checked against an fp64 reference (masks, windows, GQA, bias, THD, sink softmax: the sink is not a
logit), fused against unfused, and bitwise: run after run, whatever else is in the batch, packed or padded,
under vmap, sharded over dp/tp and under context parallelism; the output and gradients are the bits of the call
without the max logit. Last, PyTorch == JAX bitwise (under Triton's interpreter on CPU, with inputs whose
products are exact; on a GPU both launch the same kernel).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from case_grid import grid
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from te_jax_testing import BACKENDS, Segments, make_case, pack
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVLayout
from transformer_engine.jax.attention import (
    CPStrategy,
    ReorderStrategy,
    SequenceDescriptor,
    fused_attn,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from transformer_engine.jax.sharding import MeshResource, global_shard_guard
from te_jax_testing import fused_attn_with_backend

ON_GPU = jax.devices()[0].platform == "gpu"
EIGHT_DEVICES = pytest.mark.skipif(len(jax.devices()) < 8,
                                   reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
TOL = {jnp.dtype(jnp.float32): dict(rtol=2e-6, atol=2e-6), jnp.dtype(jnp.float16): dict(rtol=1e-3, atol=1e-3)}


def _deterministic(monkeypatch):
    # The fused primitives' CPU lowering contracts row by row in deterministic mode (attention_math): a row's
    # scores, so its max, do not depend on the rows around it. The GPU kernels are so in both modes.
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def _reference(case) -> np.ndarray:
    """fp64 ``[h_q]``: the max over visible pairs of the scaled scores plus bias (the inputs as given)."""
    q, k = (np.asarray(x.astype(jnp.float32), np.float64) for x in (case.q, case.k))
    g = q.shape[2] // k.shape[2]
    raw = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, g, axis=2))
    bias = 0.0 if case.bias is None else np.asarray(case.bias.astype(jnp.float32), np.float64)
    if case.bias_type == AttnBiasType.PRE_SCALE_BIAS:
        scores = (raw + bias) * case.scale
    else:
        scores = raw * case.scale + bias
    return np.where(case.visible, scores, -np.inf).max(axis=(0, 2, 3))


def _call(case, max_logit=True, **overrides):
    """A jitted ``(q, k, v, bias, dout) -> (out, max_logit or None, (dq, dk, dv, dbias))`` of ``case`` (BSHD)."""
    kwargs = dict(case.kwargs, **overrides)
    sbhd = QKVLayout(case.layout).qkv_format.value == "sbhd"
    tr = (lambda x: jnp.swapaxes(x, 0, 1)) if sbhd else (lambda x: x)

    def run(q, k, v, bias, dout):
        def f(q, k, v, bias):
            res = fused_attn_with_backend(case.backend, pack(q, k, v, case.layout), bias, return_max_logit=max_logit,
                                          **kwargs)
            return (res[0], res[1]) if max_logit else (res, None)

        out, ml = f(q, k, v, bias)
        grads = jax.grad(lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * tr(dout).astype(jnp.float32)),
                         argnums=(0, 1, 2) + ((3,) if bias is not None else ()))(q, k, v, bias)
        return tr(out), ml, grads

    return jax.jit(run)


def _assert_bitwise(a, b, what):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


# (mask, layout, dtype, window, bias type, bias shape, h_kv, s_q, s_kv, m)
CASES = {
    "padding_causal-gqa-fp16": (AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, jnp.float16, None,
                                AttnBiasType.NO_BIAS, None, 2, 32, 32, 1),
    "causal_bottom_right-window-fp32": (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, QKVLayout.BSHD_BS2HD, jnp.float32,
                                        (5, 0), AttnBiasType.NO_BIAS, None, 1, 24, 40, 1),
    "no_mask-sbhd-post_bias-fp32": (AttnMaskType.NO_MASK, QKVLayout.SBHD_SBHD_SBHD, jnp.float32, None,
                                    AttnBiasType.POST_SCALE_BIAS, (1, 4, 24, 32), 2, 24, 32, 1),
    "padding-pre_bias-fp16": (AttnMaskType.PADDING_MASK, QKVLayout.BSHD_BSHD_BSHD, jnp.float16, (3, 2),
                              AttnBiasType.PRE_SCALE_BIAS, (2, 4, 24, 24), 4, 24, 24, 1),
    "thd-padding_causal-fp16": (AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD, jnp.float16, None,
                                AttnBiasType.NO_BIAS, None, 2, 40, 40, 3),
}


@pytest.mark.parametrize("name,backend", grid("name,backend", list(CASES), BACKENDS))
def test_max_logit_is_the_definition_and_leaves_the_call_alone(backend, name):
    mask, layout, dtype, window, bias_type, bias_shape, h_kv, s_q, s_kv, m = CASES[name]
    case = make_case(backend, layout=layout, mask=mask, dtype=dtype, h_kv=h_kv, s_q=s_q, s_kv=s_kv, window=window,
                     bias_type=bias_type, bias_shape=bias_shape, m=m, desc_kind="offsets" if m > 1 else "seqlens",
                     seed=3)
    args = (case.q, case.k, case.v, case.bias, case.dout)
    out, max_logit, grads = _call(case)(*args)
    assert max_logit.shape == (4,) and max_logit.dtype == dtype
    np.testing.assert_allclose(np.asarray(max_logit, np.float64), _reference(case), **TOL[jnp.dtype(dtype)])
    # The output and gradients are the call's without the max logit, bit for bit.
    plain_out, none, plain_grads = _call(case, max_logit=False)(*args)
    assert none is None
    _assert_bitwise((out, grads), (plain_out, plain_grads), "return_max_logit changed the call")
    # Fused and unfused agree within the dtype's rounding (each is that close to the fp64 definition).
    other = make_case("unfused" if backend == "fused" else "fused", layout=layout, mask=mask, dtype=dtype, h_kv=h_kv,
                      s_q=s_q, s_kv=s_kv, window=window, bias_type=bias_type, bias_shape=bias_shape, m=m,
                      desc_kind="offsets" if m > 1 else "seqlens", seed=3)
    np.testing.assert_allclose(np.asarray(_call(other)(*args)[1], np.float64), np.asarray(max_logit, np.float64),
                               **TOL[jnp.dtype(dtype)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sink_is_not_a_logit(backend):
    """Learnable sink softmax with sink logits far above every score: the max logit is the keys' only."""
    case = make_case(backend, mask=AttnMaskType.CAUSAL_MASK, h_kv=2, seed=5)
    offset = jnp.full((1, 4, 1, 1), 100.0, jnp.float32)
    ml = fused_attn_with_backend(backend, (case.q, case.k, case.v), None, return_max_logit=True,
                                 **dict(case.kwargs, softmax_type="learnable", softmax_offset=offset))[1]
    np.testing.assert_allclose(np.asarray(ml, np.float64), _reference(case), **TOL[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_head_that_sees_nothing_is_minus_inf(backend):
    """Query padding rows see nothing, and a -inf bias hides every key of head 0."""
    case = make_case(backend, mask=AttnMaskType.PADDING_MASK, bias_type=AttnBiasType.POST_SCALE_BIAS,
                     bias_shape=(1, 4, 32, 32), seed=6)
    bias = case.bias.at[:, 0].set(-jnp.inf)
    ml = fused_attn_with_backend(backend, (case.q, case.k, case.v), bias, return_max_logit=True, **case.kwargs)[1]
    assert np.asarray(ml)[0] == -np.inf and np.all(np.isfinite(np.asarray(ml)[1:]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_over_runs_batch_composition_and_packing(backend, monkeypatch):
    """The same sequences: run twice, each alone (max over the calls), reordered, padded in BSHD rows, packed
    into one THD row: the same bits (a max is order-free; each row's max depends on its own scores only)."""
    _deterministic(monkeypatch)
    lens = [23, 9, 17]
    s, h, h_kv, d = 24, 4, 2, 16
    rng = np.random.default_rng(11)
    seqs = [tuple(jnp.asarray(rng.standard_normal((n, hh, d)) * sc, jnp.float16) for hh, sc in
                  ((h, 2.0), (h_kv, 1.0), (h_kv, 1.0))) for n in lens]

    def padded(order):
        rows = [[jnp.pad(seqs[i][j], ((0, s - lens[i]), (0, 0), (0, 0))) for i in order] for j in range(3)]
        q, k, v = (jnp.stack(r) for r in rows)
        n = jnp.asarray([lens[i] for i in order], jnp.int32)
        return fused_attn_with_backend(backend, (q, k, v), None, SequenceDescriptor.from_seqlens((n, n)), None,
                                       AttnBiasType.NO_BIAS, AttnMaskType.PADDING_CAUSAL_MASK,
                                       QKVLayout.BSHD_BSHD_BSHD, d**-0.5, return_max_logit=True)[1]

    def packed(order):
        total = 56
        q, k, v = (jnp.pad(jnp.concatenate([seqs[i][j] for i in order]), ((0, total - sum(lens)), (0, 0), (0, 0)))[None]
                   for j in range(3))
        n = jnp.asarray([[lens[i] for i in order]], jnp.int32)
        return fused_attn_with_backend(backend, (q, k, v), None, SequenceDescriptor.from_seqlens((n, n)), None,
                                       AttnBiasType.NO_BIAS, AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD,
                                       d**-0.5, max_segments_per_seq=3, return_max_logit=True)[1]

    first = padded([0, 1, 2])
    _assert_bitwise(padded([0, 1, 2]), first, "run after run")
    _assert_bitwise(padded([2, 0, 1]), first, "batch order")
    _assert_bitwise(jnp.max(jnp.stack([padded([i]) for i in range(3)]), axis=0), first, "each sequence alone")
    _assert_bitwise(packed([1, 2, 0]), first, "packed in one THD row")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_and_jit(backend):
    case = make_case(backend, mask=AttnMaskType.CAUSAL_MASK, h_kv=2, seed=8)
    f = functools.partial(fused_attn_with_backend, backend, return_max_logit=True, **case.kwargs)
    qs = jnp.stack([case.q, case.q * 2])
    batched = jax.jit(jax.vmap(lambda q: f((q, case.k, case.v), None)[1]))(qs)
    assert batched.shape == (2, 4)
    for i in range(2):
        _assert_bitwise(batched[i], jax.jit(lambda q: f((q, case.k, case.v), None)[1])(qs[i]), f"vmap instance {i}")


@EIGHT_DEVICES
@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")
def test_sharded_over_dp_and_tp_is_the_unsharded_bits(monkeypatch):
    """Batch over dp (the per-head max over shards: XLA's all-reduce of the row maxima's max), heads over tp."""
    _deterministic(monkeypatch)
    case = make_case("fused", mask=AttnMaskType.PADDING_CAUSAL_MASK, b=4, h_kv=2, seed=9)
    fn = jax.jit(lambda q, k, v: fused_attn_with_backend("fused", (q, k, v), None, return_max_logit=True,
                                                           **case.kwargs))
    whole = fn(case.q, case.k, case.v)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))
    resource = MeshResource(dp_resource="dp", tp_resource="tp")
    with jax.set_mesh(mesh), global_shard_guard(resource):
        placed = [jax.device_put(x, NamedSharding(mesh, P("dp", None, "tp", None))) for x in (case.q, case.k, case.v)]
        sharded = fn(*placed)
    _assert_bitwise(sharded, whole, "dp/tp sharded")


# ------------------------------------------------------------------------------------------------
# Context parallelism: the max over the whole sequence (pmax over the cp axis, and the dp axis)
# ------------------------------------------------------------------------------------------------


B, S, H_Q, H_KV, D = 2, 32, 4, 2, 16


@functools.lru_cache(maxsize=None)
def _cp_inputs():
    rng = np.random.default_rng(13)
    return tuple(jnp.asarray(rng.standard_normal(shape) * sc, jnp.float16)
                 for shape, sc in (((B, S, H_Q, D), 2.0), ((B, S, H_KV, D), 1.0), ((B, S, H_KV, D), 1.0)))


def _cp_fn(mask, layout=QKVLayout.BSHD_BSHD_BSHD, desc=None, m=1, **cp):
    def fn(q, k, v, *desc_args):
        descriptor = SequenceDescriptor.from_segment_ids_and_pos(*desc_args) if desc_args else None
        out, ml = fused_attn_with_backend("fused", (q, k, v), None, descriptor, None, AttnBiasType.NO_BIAS, mask,
                                          layout, D**-0.5, max_segments_per_seq=m, return_max_logit=True, **cp)
        return out, ml

    return jax.jit(fn)


@EIGHT_DEVICES
@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")
@pytest.mark.parametrize("cp,strategy,lb,mask,with_dp", [
    (4, CPStrategy.RING, True, AttnMaskType.CAUSAL_MASK, True),
    (2, CPStrategy.ALL_GATHER, False, AttnMaskType.NO_MASK, False),
], ids=["cp4-ring-lb-causal-dp", "cp2-allgather-no_mask"])
def test_context_parallel_is_the_single_device_bits(monkeypatch, cp, strategy, lb, mask, with_dp):
    _deterministic(monkeypatch)
    q, k, v = _cp_inputs()
    whole = _cp_fn(mask)(q, k, v)
    mesh = (Mesh(np.array(jax.devices()[:8]).reshape(8 // cp, cp), ("dp", "cp")) if with_dp
            else Mesh(np.array(jax.devices()[:cp]), ("cp",)))
    resource = MeshResource(dp_resource="dp" if with_dp else None, cp_resource="cp")
    args = [reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, cp, 1) for x in (q, k, v)] if lb \
        else [q, k, v]
    with mesh, global_shard_guard(resource):
        placed = [jax.device_put(x, NamedSharding(mesh, P("dp" if with_dp else None, "cp"))) for x in args]
        out, ml = _cp_fn(mask, context_parallel_strategy=strategy, context_parallel_causal_load_balanced=lb)(*placed)
    if lb:
        out = inverse_reorder_causal_load_balancing(out, ReorderStrategy.DualChunkSwap, cp, 1)
    _assert_bitwise((out, ml), whole, f"cp={cp}")


@EIGHT_DEVICES
def test_context_parallel_inside_the_users_shard_map(monkeypatch):
    """On the local chunks inside shard_map over cp: every rank gets the whole sequence's max."""
    _deterministic(monkeypatch)
    q, k, v = _cp_inputs()
    whole = _cp_fn(AttnMaskType.CAUSAL_MASK)(q, k, v)
    cp = 4
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    fn = _cp_fn(AttnMaskType.CAUSAL_MASK, context_parallel_strategy=CPStrategy.RING,
                context_parallel_causal_load_balanced=True, context_parallel_axis="cp")
    local = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=(P(None, "cp"), P()))
    args = [reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, cp, 1) for x in (q, k, v)]
    out, ml = jax.jit(local)(*args)
    out = inverse_reorder_causal_load_balancing(out, ReorderStrategy.DualChunkSwap, cp, 1)
    _assert_bitwise((out, ml), whole, "inside shard_map")


@EIGHT_DEVICES
@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")
def test_thd_context_parallel_is_the_single_device_bits(monkeypatch):
    _deterministic(monkeypatch)
    q, k, v = _cp_inputs()
    lens = np.array([[13, 11, 0], [5, 20, 6]], np.int32)
    seg = Segments(lens, np.array([[0, 14, 25], [0, 5, 25]], np.int32), S)
    ids, pos = jnp.asarray(seg.ids), jnp.asarray(seg.pos)
    mask, layout = AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD
    whole = _cp_fn(mask, layout, m=3)(q, k, v, ids, pos)
    cp = 2
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, cp), ("dp", "cp"))
    with mesh, global_shard_guard(MeshResource(dp_resource="dp", cp_resource="cp")):
        placed = [jax.device_put(x, NamedSharding(mesh, P(None, "cp"))) for x in (q, k, v, ids, pos)]
        got = _cp_fn(mask, layout, m=3)(*placed)
    _assert_bitwise(got, whole, "THD cp=2")


# ------------------------------------------------------------------------------------------------
# PyTorch == JAX
# ------------------------------------------------------------------------------------------------


def _torch_or_skip():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if ON_GPU:
        if not torch.cuda.is_available():
            pytest.skip("torch sees no CUDA device")
        return torch, "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on CPU the PyTorch fused forward runs under Triton's interpreter: set TRITON_INTERPRET=1")
    return torch, "cpu"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_pytorch_and_jax_max_logit_are_bitwise_equal(monkeypatch, dtype, fmt):
    """Both frontends' fused max logit: on a GPU the same kernel; on CPU the Triton forward under the
    interpreter against the jnp lowering, equal where the scores are: inputs on a grid of quarters, so every
    product and sum of ``q k^T`` is exact in any order, and both then scale and reduce as the kernel does."""
    torch, device = _torch_or_skip()
    _deterministic(monkeypatch)
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    from transformer_engine.pytorch import DotProductAttention

    lens, s, h, h_kv, d = [19, 7, 12], 20, 4, 2, 16
    rng = np.random.default_rng(17)
    grid = lambda shape: (np.round(rng.standard_normal(shape) * 4) / 4).astype(dtype)  # noqa: E731
    q, k, v = grid((3, s, h, d)), grid((3, s, h_kv, d)), grid((3, s, h_kv, d))
    n = np.asarray(lens, np.int32)
    if fmt == "bshd":
        mask = np.arange(s)[None, :] < n[:, None]
        q, k, v = (np.where(mask[:, :, None, None], x, 0).astype(dtype) for x in (q, k, v))
    tq, tk, tv = (torch.from_numpy(x).to(device) for x in (q, k, v))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    dpa = DotProductAttention(h, d, num_gqa_groups=h_kv, qkv_format=fmt, attn_mask_type="padding_causal",
                              return_max_logit=True).to(device)
    if fmt == "thd":
        packed = [torch.cat([x[i, :lens[i]] for i in range(3)]) for x in (tq, tk, tv)]
        _, torch_ml = dpa(*packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
        total = 40
        jq, jk, jv = (jnp.pad(jnp.concatenate([jnp.asarray(x[i, :lens[i]]) for i in range(3)]),
                              ((0, total - sum(lens)), (0, 0), (0, 0)))[None] for x in (q, k, v))
        desc, layout, m = SequenceDescriptor.from_seqlens((jnp.asarray(n)[None],) * 2), QKVLayout.THD_THD_THD, 3
    else:
        _, torch_ml = dpa(tq, tk, tv, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
        desc, layout, m = SequenceDescriptor.from_seqlens((jnp.asarray(n),) * 2), QKVLayout.BSHD_BSHD_BSHD, 1
    assert dpa.last_backend == "FusedAttention"
    jax_ml = fused_attn_with_backend("fused", (jq, jk, jv), None, desc, None, AttnBiasType.NO_BIAS,
                                     AttnMaskType.PADDING_CAUSAL_MASK, layout, d**-0.5, max_segments_per_seq=m,
                                     return_max_logit=True)[1]
    np.testing.assert_array_equal(np.asarray(jax_ml), torch_ml.cpu().numpy())


def test_selection_takes_the_fused_backend_and_a_bad_value_is_refused():
    from transformer_engine.common.attention.backends import FusedAttention
    from transformer_engine.jax import attention as te_attention

    case = make_case("fused", mask=AttnMaskType.CAUSAL_MASK, seed=1)
    call = te_attention._parse_call(te_attention._FusedAttnArgs((case.q, case.k, case.v), None,
                                                                return_max_logit=True, **case.kwargs))
    assert call.config.return_max_logit and call.static.return_max_logit
    assert not any("max_logit" in r for r in FusedAttention.not_supported_reasons(call.config))
    with pytest.raises(ValueError, match="`return_max_logit` must be a bool, got 'yes'"):
        fused_attn((case.q, case.k, case.v), None, return_max_logit="yes", **case.kwargs)
