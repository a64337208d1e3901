"""Sink softmax in TE-JAX: ``softmax_type`` off-by-one / learnable through ``fused_attn`` (the fused
primitives: on CPU their jnp lowering, on a GPU the Triton kernels; and the unfused backend) against
an fp64 reference, the gradient of ``softmax_offset`` (vmap, sharding), and the Flax module's
``softmax_offset`` parameter.

The reference states the definition directly: per sequence, softmax over the visible keys plus one
sink logit (0, or ``softmax_offset[h]``) without a value vector, in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from te_jax_testing import assert_close_to_reference, random_qkv
import te_jax_testing as te_testing
from transformer_engine.jax.attention import AttnSoftmaxType, SequenceDescriptor
from transformer_engine.jax.sharding import MeshResource, global_shard_guard

SCALE = 0.3
BACKENDS = ["fused", "unfused"]


def _reference_grads(q, k, v, offset, dout, segments_q, segments_kv, causal, dtype):
    """(out, dq, dk, dv, d_offset) of the reference, computed in ``dtype`` (float64 or float32) and
    differentiated by JAX: ``segments_*`` per row, lists of (start, length); ``causal`` is top-left."""
    with jax.enable_x64(True):
        jdt = jnp.float64 if dtype == np.float64 else jnp.float32

        def f(q, k, v, off):
            b, s_q, h, _ = q.shape
            g = h // k.shape[2]
            kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
            out = jnp.zeros((b, s_q, h, v.shape[3]), jdt)
            for r in range(b):
                for (sq0, lq), (sk0, lk) in zip(segments_q[r], segments_kv[r]):
                    if lq == 0:
                        continue
                    s = jnp.einsum("qhd,khd->hqk", q[r, sq0:sq0 + lq], kk[r, sk0:sk0 + lk]) * SCALE
                    if causal:
                        s = jnp.where(jnp.arange(lk)[None, None, :] <= jnp.arange(lq)[None, :, None], s, -jnp.inf)
                    s = jnp.concatenate([s, jnp.broadcast_to(off.reshape(h)[:, None, None], (h, lq, 1))], axis=-1)
                    p = jax.nn.softmax(s, axis=-1)[..., :-1]
                    out = out.at[r, sq0:sq0 + lq].set(jnp.einsum("hqk,khd->qhd", p, vv[r, sk0:sk0 + lk]))
            return out

        args = [jnp.asarray(np.asarray(x, np.float32), jdt) for x in (q, k, v, offset)]
        out, vjp = jax.vjp(jax.jit(f), *args)
        grads = vjp(jnp.asarray(np.asarray(dout, np.float32), jdt))
        return [np.asarray(x) for x in (out, *grads)]


def _call(backend, qkv, desc, layout, mask, softmax_type, offset, m=1):
    kwargs = dict(sequence_descriptor=desc, seed=None, attn_bias_type="no_bias", attn_mask_type=mask,
                  qkv_layout=layout, scaling_factor=SCALE, dropout_probability=0.0, is_training=True,
                  max_segments_per_seq=m, softmax_type=softmax_type, softmax_offset=offset)
    return te_testing.fused_attn_with_backend(backend, tuple(qkv), None, **kwargs)


def _grads(backend, q, k, v, offset, dout, desc, layout, mask, softmax_type, m=1):
    learnable = AttnSoftmaxType.from_str(softmax_type) == AttnSoftmaxType.LEARNABLE_SOFTMAX

    def f(q, k, v, off):
        return _call(backend, (q, k, v), desc, layout, mask, softmax_type, off if learnable else None, m)

    out, vjp = jax.vjp(f, q, k, v, offset)
    return (out,) + vjp(dout)


def _case(b, s, h, hk, d, seed=0):
    q, k, v = random_qkv(jax.random.PRNGKey(seed), b, s, s, h, hk, d, d, jnp.float32)
    offset = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, h, 1, 1), jnp.float32) * 1.5
    dout = jax.random.normal(jax.random.PRNGKey(seed + 2), q.shape, jnp.float32)
    return q, k, v, offset, dout


def _check(results, q, k, v, offset, dout, seg_q, seg_kv, causal, learnable):
    if not learnable:
        offset = jnp.zeros_like(offset)  # off-by-one: a zero sink logit
    ref = _reference_grads(q, k, v, offset, dout, seg_q, seg_kv, causal, np.float64)
    low = _reference_grads(q, k, v, offset, dout, seg_q, seg_kv, causal, np.float32)
    names = ("out", "dq", "dk", "dv", "d_softmax_offset")
    for i, name in enumerate(names if learnable else names[:4]):
        assert_close_to_reference(name, results[i], ref[i], low[i])
    if not learnable:  # the offset does not enter off-by-one: no gradient
        assert not np.any(np.asarray(results[4]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softmax_type", ["off_by_one", "learnable"])
def test_padded_gqa_matches_reference(backend, softmax_type):
    b, s, h, hk = 2, 20, 4, 2
    q, k, v, offset, dout = _case(b, s, h, hk, 16)
    lens = [s, 11]
    desc = SequenceDescriptor.from_seqlens(jnp.asarray(lens, jnp.int32))
    segments = [[(0, n)] for n in lens]
    # Padded query rows: the reference leaves them zero, the cotangent there must not matter.
    mask = (np.arange(s)[None, :] < np.asarray(lens)[:, None])[:, :, None, None]
    dout = jnp.where(mask, dout, 0.0)
    results = _grads(backend, q, k, v, offset, dout, desc, "bshd_bshd_bshd", "padding_causal", softmax_type)
    _check(results, q, k, v, offset, dout, segments, segments, True, softmax_type == "learnable")


@pytest.mark.parametrize("backend", BACKENDS)
def test_thd_segments_and_rows_without_keys(backend):
    """THD rows of two segments (one of them empty) under no_mask-per-segment (padding)."""
    b, s, h = 2, 24, 2
    q, k, v, offset, dout = _case(b, s, h, h, 8, seed=3)
    lens = jnp.asarray([[10, 9], [14, 0]], jnp.int32)
    offsets = jnp.asarray([[0, 12], [3, 17]], jnp.int32)
    desc = SequenceDescriptor.from_seqlens_and_offsets(lens, offsets)
    segments = [[(0, 10), (12, 9)], [(3, 14), (17, 0)]]
    inside = np.zeros((b, s), bool)
    for r, segs in enumerate(segments):
        for start, n in segs:
            inside[r, start:start + n] = True
    dout = jnp.where(jnp.asarray(inside)[:, :, None, None], dout, 0.0)
    results = _grads(backend, q, k, v, offset, dout, desc, "thd_thd_thd", "padding", "learnable", m=2)
    _check(results, q, k, v, offset, dout, segments, segments, False, True)
    assert not np.any(np.asarray(results[0])[~inside])  # tokens outside every segment output zeros


def test_fused_sink_gradient_is_the_fixed_order_sum_of_each_sequences_part():
    """Deterministic mode: a sequence's part of d softmax_offset is the same in any batch (the
    gradient of that sequence alone), and the batch's gradient is the fixed pairwise tree of the parts."""
    from transformer_engine.jax.attention_math import fixed_order_sum

    b, s, h = 3, 16, 2
    q, k, v, offset, dout = _case(b, s, h, h, 8, seed=5)
    desc = SequenceDescriptor.from_seqlens(jnp.full((b,), s, jnp.int32))
    fn = jax.jit(lambda q, k, v, off, dout, d: _grads("fused", q, k, v, off, dout, d, "bshd_bshd_bshd", "causal",
                                                      "learnable"))
    full = fn(q, k, v, offset, dout, desc)
    again = fn(q, k, v, offset, dout, desc)
    for a, c in zip(full, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    parts = []
    for r in range(b):
        one = SequenceDescriptor.from_seqlens(jnp.full((1,), s, jnp.int32))
        alone = fn(q[r:r + 1], k[r:r + 1], v[r:r + 1], offset, dout[r:r + 1], one)
        parts.append(np.asarray(alone[4]).reshape(h))
    expected = fixed_order_sum(jnp.asarray(np.stack(parts)), axis=0)
    np.testing.assert_array_equal(np.asarray(full[4]).reshape(h), np.asarray(expected))


def test_vmap_gives_each_instance_its_own_offset_gradient():
    b, s, h = 1, 12, 2
    qs, ks, vs, offset, dout = _case(3, s, h, h, 8, seed=7)  # 3 vmap instances of batch 1

    def grad_offset(q, k, v, dout):
        _, vjp = jax.vjp(lambda off: _call("fused", (q, k, v), None, "bshd_bshd_bshd", "causal", "learnable", off),
                         offset)
        return vjp(dout)[0]

    batched = jax.vmap(grad_offset)(qs[:, None], ks[:, None], vs[:, None], dout[:, None])
    for i in range(3):
        single = grad_offset(qs[i:i + 1], ks[i:i + 1], vs[i:i + 1], dout[i:i + 1])
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(single), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(batched[0]), np.asarray(batched[1]))


def test_sharded_sink_gradient_equals_unsharded_bitwise():
    """Batch over dp, heads over tp: each shard returns its sequences' parts; the sum over sequences
    is the same fixed tree on the gathered parts, so the gradient does not depend on the sharding."""
    devices = np.asarray(jax.devices()[:8])
    if devices.size < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.sharding.Mesh(devices[:4].reshape(2, 2), ("dp", "tp"))
    resource = MeshResource(dp_resource="dp", tp_resource="tp")
    b, s, h = 4, 16, 4
    q, k, v, offset, dout = _case(b, s, h, h, 8, seed=9)
    lens = jnp.asarray([16, 9, 12, 5], jnp.int32)

    def fn(q, k, v, off, dout, lens):
        return _grads("fused", q, k, v, off, dout, SequenceDescriptor.from_seqlens(lens), "bshd_bshd_bshd",
                      "padding_causal", "learnable")

    unsharded = jax.jit(fn)(q, k, v, offset, dout, lens)
    with jax.set_mesh(mesh), global_shard_guard(resource):
        place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        args = [place(x, P("dp", None, "tp", None)) for x in (q, k, v)]
        args += [place(offset, P(None, "tp", None, None)), place(dout, P("dp", None, "tp", None)),
                 place(lens, P("dp"))]
        sharded = jax.jit(fn)(*args)
    for name, a, c in zip(("out", "dq", "dk", "dv", "d_softmax_offset"), sharded, unsharded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=name)


def test_softmax_type_errors():
    q, k, v, offset, _ = _case(1, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="softmax_offset"):
        _call("unfused", (q, k, v), None, "bshd_bshd_bshd", "causal", "learnable", None)
    with pytest.raises(ValueError, match="softmax_offset"):
        _call("unfused", (q, k, v), None, "bshd_bshd_bshd", "causal", "off_by_one", offset)
    with pytest.raises(ValueError, match="softmax_offset"):
        _call("unfused", (q, k, v), None, "bshd_bshd_bshd", "causal", "learnable", offset.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="softmax_type"):
        _call("unfused", (q, k, v), None, "bshd_bshd_bshd", "causal", "sink", None)
    assert AttnSoftmaxType.from_str("off-by-one") is AttnSoftmaxType.OFF_BY_ONE_SOFTMAX


def test_flax_module_owns_the_learnable_offset():
    pytest.importorskip("flax")
    from transformer_engine.jax.flax import DotProductAttention

    q, k, v, _, _ = _case(2, 12, 4, 2, 8, seed=11)
    module = DotProductAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=2, softmax_type="learnable",
                                 scale_factor=SCALE, attn_mask_type="causal")
    params = module.init(jax.random.PRNGKey(0), q, k, v)
    offset = params["params"]["softmax_offset"]
    assert offset.shape == (1, 4, 1, 1) and offset.dtype == jnp.float32 and not np.any(np.asarray(offset))
    params = {"params": {"softmax_offset": jnp.asarray([0.5, -1.0, 2.0, 0.0]).reshape(1, 4, 1, 1)}}
    out = module.apply(params, q, k, v)
    expected = _call("unfused", (q, k, v), None, "bshd_bshd_bshd", "causal", "learnable",
                     params["params"]["softmax_offset"])
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)
    grads = jax.grad(lambda p: jnp.sum(module.apply(p, q, k, v) ** 2))(params)
    assert np.any(np.asarray(grads["params"]["softmax_offset"]))
    for softmax_type in ("vanilla", "off-by-one"):
        plain = DotProductAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=2, softmax_type=softmax_type)
        assert not jax.tree.leaves(plain.init(jax.random.PRNGKey(0), q, k, v))
