"""MaxText's TransformerEngine attention call (``attention: cudnn_flash_te``) on this frontend.

MaxText 0.2.5 cannot be imported without its heavy dependencies (aqt, qwix, tokamax, orbax), so
its call is reproduced here from its source, ``maxtext/layers/attention_op.py``
(``AttentionOp.cudnn_flash_attention`` and the ``generate_attention_mask`` branch it uses, with
``_sinks_to_te_softmax_offset`` / ``_inject_te_softmax_offset``) and
``maxtext/utils/max_utils.py`` (``transformer_engine_context`` and, for context parallelism, the
input pipeline's ``reorder_causal_load_balanced``): the same module fields, descriptors, masks
and ``lazy_init`` on dummy inputs. Its ``nnx_wrappers.ToNNX`` is a fork of Flax's
``nnx.bridge.ToNNX``, used here.

The forms: the dense non-packed path (a uint8 ``[b, 1, 1, s, s]`` mask with ``padding_causal``),
packed THD rows, attention sinks (``lazy_init`` on batch-1 dummy queries, then the sink logits
grafted into ``softmax_offset``), and context parallelism over the ``context`` mesh axis
(all_gather and ring; BSHD with DualChunkSwap, packed THD with the Striped order). Forward and
gradients against an fp32 reference; with context parallelism bitwise against the cp = 1 call of
the fused primitives; every form bitwise over repeats in deterministic mode. On a CUDA GPU the
same cases run in bfloat16 on the fused kernels (the context-parallel ones need 2+ GPUs).
"""

from __future__ import annotations

from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="Flax is not installed")
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from te_jax_testing import assert_close_to_reference  # noqa: E402
import te_jax_testing as te_testing  # noqa: E402
from transformer_engine.jax.attention import (  # noqa: E402
    ReorderStrategy,
    SequenceDescriptor,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from transformer_engine.jax.flax.transformer import DotProductAttention  # noqa: E402
from transformer_engine.jax.sharding import MeshResource, global_mesh_resource  # noqa: E402

ON_GPU = jax.devices()[0].platform in ("gpu", "cuda")
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32
# On GPU, 2048 tokens keep the context-parallel chunks (s / (2 cp), cp <= 8) at multiples of 128,
# the kernels' block size, which the bitwise cp invariance needs.
B, S, H_Q, H_KV, D = 2, (2048 if ON_GPU else 64), 4, 2, (64 if ON_GPU else 16)
MAX_SEGMENTS = 4
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)  # maxtext/common/common_types.py


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


# ------------------------------------------------------------------------------------------------
# MaxText 0.2.5, reproduced
# ------------------------------------------------------------------------------------------------


@contextmanager
def transformer_engine_context():
    """maxtext/utils/max_utils.py ``transformer_engine_context`` (0.2.5), verbatim in behaviour."""
    try:
        from transformer_engine.jax.sharding import global_shard_guard, MeshResource  # noqa: F811

        mesh_resource = MeshResource(dp_resource="data", tp_resource="tensor", tpsp_resource="tensor_sequence",
                                     fsdp_resource="fsdp", pp_resource=None, cp_resource="context",
                                     ep_resource="expert")
        with global_shard_guard(mesh_resource):
            yield
    except Exception:  # noqa: BLE001  (MaxText's own broad except, the subject of a test below)
        yield


def _dense_mask(decoder_segment_ids):
    """``generate_attention_mask`` for AttentionType.FULL in training (segment separation only),
    then ``cudnn_flash_attention``'s conversion to TE's uint8 convention (1 = masked out)."""
    seg = decoder_segment_ids
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
    mask = jnp.where(mask[:, None, None, :, :], 0.0, DEFAULT_MASK_VALUE)
    return jnp.where((mask >= DEFAULT_MASK_VALUE * 0.5), 0, 1).astype(jnp.uint8)


def maxtext_cudnn_flash_attention(query, key, value, decoder_segment_ids, segment_positions, sinks=None, *,
                                  packing=False, cp_size=1, strategy="all_gather", load_balance=True):
    """``AttentionOp.cudnn_flash_attention`` (0.2.5) for a FULL-attention training call with no
    dropout: the branch taken by (packing, context parallelism, sinks) and the module it builds."""
    max_target_length = query.shape[1]
    using_cp = cp_size > 1
    mask_type, qkv_layout, max_segments_per_seq = "padding_causal", "BSHD_BSHD_BSHD", 1
    dummy_attn_mask = None
    if packing:
        qkv_layout = "THD_THD_THD"
        if decoder_segment_ids is None:
            decoder_segment_ids = jnp.ones(shape=query.shape[:2], dtype=jnp.int32)

        def _sequence_descriptor(segment_ids):
            try:
                return SequenceDescriptor.from_segment_ids_and_pos(
                    segment_ids=segment_ids, segment_pos=segment_positions, is_thd=True,
                    is_segment_ids_reordered=False)
            except TypeError:
                return SequenceDescriptor.from_segment_ids_and_pos(segment_ids=segment_ids,
                                                                   segment_pos=segment_positions)

        attn_mask = _sequence_descriptor(decoder_segment_ids)
        if sinks is not None:
            dummy_attn_mask = _sequence_descriptor(jnp.ones(shape=query.shape[:2], dtype=jnp.int32))
        max_segments_per_seq = MAX_SEGMENTS
    elif using_cp:
        attn_mask, mask_type = None, "causal"
    else:
        if decoder_segment_ids is None:
            decoder_segment_ids = jnp.ones(shape=query.shape[:2], dtype=jnp.int32)
        if sinks is not None:
            dummy_attn_mask = jnp.zeros((1, 1, 1, max_target_length, max_target_length), dtype=jnp.uint8)
        attn_mask = _dense_mask(decoder_segment_ids)

    dpa_layer = DotProductAttention(
        head_dim=query.shape[-1], num_attention_heads=H_Q, num_gqa_groups=H_KV, attn_mask_type=mask_type,
        attn_bias_type="no_bias", attention_dropout=0.0, dropout_rng_name="aqt", dtype=query.dtype,
        float32_logits=False, qkv_layout=qkv_layout, scale_factor=1.0, transpose_batch_sequence=False,
        window_size=None, context_parallel_causal_load_balanced=load_balance, context_parallel_axis="context",
        context_parallel_strategy=strategy, max_segments_per_seq=max_segments_per_seq,
        softmax_type="learnable" if sinks is not None else "vanilla",
    )
    dpa_layer = nnx.bridge.ToNNX(dpa_layer, rngs=nnx.Rngs(params=0))
    if sinks is not None:
        dummy = jnp.zeros((1, max_target_length, H_Q, query.shape[-1]), dtype=query.dtype)
        dummy_kv = jnp.zeros((1, max_target_length, H_KV, query.shape[-1]), dtype=query.dtype)
        dpa_layer.lazy_init(dummy, dummy_kv, dummy_kv, sequence_descriptor=dummy_attn_mask)
        # _sinks_to_te_softmax_offset, then _inject_te_softmax_offset
        offset = jnp.asarray(sinks, dtype=jnp.float32).reshape(1, H_Q, 1, 1)
        flat_state = nnx.to_flat_state(nnx.state(dpa_layer))
        offset_path = next((path for path, _ in flat_state if path[-1] == "softmax_offset"), None)
        assert offset_path is not None, "no softmax_offset parameter after lazy_init"
        nnx.update(dpa_layer, nnx.from_flat_state([(offset_path, nnx.Param(offset))]))
    return dpa_layer(query, key, value, sequence_descriptor=attn_mask)


# ------------------------------------------------------------------------------------------------
# Inputs and the fp32 reference
# ------------------------------------------------------------------------------------------------


def _inputs(seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (B, S, H_Q, D), jnp.float32).astype(DTYPE)
    k = jax.random.normal(keys[1], (B, S, H_KV, D), jnp.float32).astype(DTYPE)
    v = jax.random.normal(keys[2], (B, S, H_KV, D), jnp.float32).astype(DTYPE)
    dout = jax.random.normal(keys[3], (B, S, H_Q, D), jnp.float32).astype(DTYPE)
    sinks = jax.random.normal(keys[4], (H_Q,), jnp.float32)
    return q, k, v, dout, sinks


def _packed_ids():
    """Row 0: three sequences and trailing padding; row 1: one sequence over the whole row."""
    lens = [[S // 8, S // 4 + 3, S // 2 - 7], [S]]
    ids = np.zeros((B, S), np.int32)
    pos = np.zeros((B, S), np.int32)
    for r, row in enumerate(lens):
        t = 0
        for i, n in enumerate(row):
            ids[r, t:t + n] = i + 1
            pos[r, t:t + n] = np.arange(n)
            t += n
    return jnp.asarray(ids), jnp.asarray(pos)


def _padded_ids(lengths):
    ids = np.zeros((B, S), np.int32)
    for r, n in enumerate(lengths):
        ids[r, :n] = 1
    return jnp.asarray(ids)


def _visible(ids, pos):
    """[b, 1, s, s]: same nonzero segment, and causal by position within the segment."""
    ids, pos = np.asarray(ids), np.asarray(pos)
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)
    causal = pos[:, None, :] <= pos[:, :, None]
    return jnp.asarray((same & causal)[:, None])


def _reference(q, k, v, dout, visible, sinks, dtype):
    """softmax(Q K^T + mask) V with optional per-head sink logits in the normaliser, computed in
    ``dtype`` (float32: the reference; the inputs' dtype: the framework's own error), with the
    gradients by autodiff. Rows with no visible key give 0."""

    def attention(q, k, v, sinks):
        g = H_Q // H_KV
        kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, kr, precision=jax.lax.Precision.HIGHEST).astype(jnp.float32)
        logits = jnp.where(visible, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        if sinks is not None:
            row_max = jnp.maximum(row_max, sinks[None, :, None, None])
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        e = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
        denom = jnp.sum(e, axis=-1, keepdims=True)
        if sinks is not None:
            denom = denom + jnp.exp(sinks[None, :, None, None] - row_max)
        p = (e / jnp.where(denom > 0, denom, 1.0)).astype(dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vr.astype(dtype), precision=jax.lax.Precision.HIGHEST)

    qkv = [x.astype(dtype) for x in (q, k, v)]
    if sinks is None:
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, None), *qkv)
    else:
        out, vjp = jax.vjp(attention, *qkv, sinks)
    return (out, *vjp(dout.astype(out.dtype)))


def _run(fn, q, k, v, dout, sinks=None):
    """(out, dq, dk, dv[, dsinks]) of ``fn`` under jit, with loss = sum(out * dout)."""
    def loss(q, k, v, sinks):
        out = fn(q, k, v, sinks)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    return (out, *grads)


def _check_against_reference(results, q, k, v, dout, ids, pos, sinks):
    """``results`` of a call with ``dout`` against the reference, over the real tokens: padding
    (id 0) gets a zero output gradient, so no gradient flows from it, and its output rows (the
    kernels' fill) are not compared."""
    real = (np.asarray(ids) != 0)[:, :, None, None]
    dout = jnp.where(real, dout, 0).astype(DTYPE)
    visible = _visible(ids, pos)
    ref32 = _reference(q, k, v, dout, visible, sinks, jnp.float32)
    ref_lowp = _reference(q, k, v, dout, visible, sinks, DTYPE)
    for i, (name, actual, r32, rlp) in enumerate(zip(("out", "dq", "dk", "dv", "dsinks"), results, ref32, ref_lowp)):
        if i == 0:
            actual, r32, rlp = (jnp.where(real, x, 0) for x in (actual, r32, rlp))
        assert_close_to_reference(name, actual, r32, rlp, atol=2e-5 if DTYPE == jnp.float32 else 2e-2)


def _real_dout(dout, ids):
    return jnp.where((np.asarray(ids) != 0)[:, :, None, None], dout, 0).astype(DTYPE)


def _assert_same_bits(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{what}: result {i}")


# ------------------------------------------------------------------------------------------------
# The non-context-parallel forms
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_sinks", [False, True], ids=["vanilla", "sinks"])
@pytest.mark.parametrize("segments", ["synthetic", "padded"])
def test_dense_five_d_mask(segments, with_sinks):
    """The default dense path: uint8 [b, 1, 1, s, s] mask, padding_causal (MaxText's GPU tests and
    synthetic data); with sinks, lazy_init on a batch-1 dummy with a [1, 1, 1, s, s] mask."""
    q, k, v, dout, sinks = _inputs()
    lengths = [S, S] if segments == "synthetic" else [S, 5 * S // 8]
    ids = None if segments == "synthetic" else _padded_ids(lengths)
    sinks = sinks if with_sinks else None
    fn = lambda q, k, v, s: maxtext_cudnn_flash_attention(q, k, v, ids, None, s)  # noqa: E731
    ref_ids = _padded_ids(lengths)
    dout = _real_dout(dout, ref_ids)
    first = _run(fn, q, k, v, dout, sinks)
    _assert_same_bits(first, _run(fn, q, k, v, dout, sinks), "repeat")
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    _check_against_reference(first, q, k, v, dout, ref_ids, pos, sinks)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["vanilla", "sinks"])
def test_packed_thd(with_sinks):
    """Packing (dataset_type != synthetic): THD_THD_THD from segment ids and positions; with sinks,
    lazy_init on batch-1 dummy queries with a full-batch descriptor (TransformerEngine reads its
    first rows; so does this frontend, while initializing)."""
    q, k, v, dout, sinks = _inputs(1)
    ids, pos = _packed_ids()
    sinks = sinks if with_sinks else None
    fn = lambda q, k, v, s: maxtext_cudnn_flash_attention(q, k, v, ids, pos, s, packing=True)  # noqa: E731
    dout = _real_dout(dout, ids)
    first = _run(fn, q, k, v, dout, sinks)
    _assert_same_bits(first, _run(fn, q, k, v, dout, sinks), "repeat")
    _check_against_reference(first, q, k, v, dout, ids, pos, sinks)


def test_batch_mismatch_outside_initialization_still_raises():
    q, k, v, _, _ = _inputs()
    ids, pos = _packed_ids()
    layer = DotProductAttention(head_dim=D, num_attention_heads=H_Q, num_gqa_groups=H_KV,
                                attn_mask_type="padding_causal", qkv_layout="THD_THD_THD", max_segments_per_seq=4)
    with pytest.raises(ValueError, match=r"`segment_ids\[0\] \(q\)` must be an integer array of shape \[1, "):
        layer.apply({}, q[:1], k[:1], v[:1], sequence_descriptor=SequenceDescriptor.from_segment_ids_and_pos(
            ids, pos))


# ------------------------------------------------------------------------------------------------
# Context parallelism over the `context` axis
# ------------------------------------------------------------------------------------------------


def _cp_size():
    n = len(jax.devices())
    if n < 2:
        pytest.skip("context parallelism needs 2+ devices (CPU: the suite's 8 host devices)")
    return 8 if n >= 8 else (4 if n >= 4 else 2)


def _fused_cp1(packing, ids, pos):
    """The cp = 1 call of the fused primitives with the arguments MaxText's call reaches fused_attn with."""
    if packing:
        desc = SequenceDescriptor.from_segment_ids_and_pos(ids, pos)
        kwargs = dict(attn_mask_type="padding_causal", qkv_layout="THD_THD_THD", max_segments_per_seq=MAX_SEGMENTS)
    else:
        desc, kwargs = None, dict(attn_mask_type="causal", qkv_layout="BSHD_BSHD_BSHD")

    def fn(q, k, v, _):
        return te_testing.fused_attn_with_backend(
            "fused", (q, k, v), None, desc, None, attn_bias_type="no_bias", scaling_factor=1.0,
            dropout_probability=0.0, is_training=True, **kwargs)

    return fn


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("packing", [False, True], ids=["bshd_dual_chunk", "thd_striped"])
def test_context_parallel_is_bitwise_the_cp1_call(packing, strategy):
    """MaxText with ``context`` > 1: non-packed BSHD causal (DualChunkSwap order), or packed THD with
    load-balanced ring/all_gather (Striped order, reordered by the input pipeline with TE's
    reorder_causal_load_balancing, seq_dim=1). Output and gradients, put back in token order, are
    bitwise the cp = 1 fused call's; it is close to the fp32 reference."""
    cp = _cp_size()
    q, k, v, dout, _ = _inputs(2)
    ids, pos = _packed_ids()
    dout = _real_dout(dout, ids) if packing else dout
    if not packing:
        ids = jnp.ones((B, S), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    order = ReorderStrategy.Striped if packing else ReorderStrategy.DualChunkSwap
    fwd = lambda x: reorder_causal_load_balancing(x, order, cp, 1)  # noqa: E731
    back = lambda x: inverse_reorder_causal_load_balancing(x, order, cp, 1)  # noqa: E731
    mesh = Mesh(np.array(jax.devices()[:cp]).reshape(1, cp), ("data", "context"))
    r_ids, r_pos = fwd(ids), fwd(pos)

    def fn(q, k, v, _):
        return maxtext_cudnn_flash_attention(q, k, v, r_ids if packing else None, r_pos, packing=packing,
                                             cp_size=cp, strategy=strategy, load_balance=True)

    results = []
    with jax.set_mesh(mesh), transformer_engine_context():
        placed = [jax.device_put(fwd(x), NamedSharding(mesh, P(None, "context"))) for x in (q, k, v, dout)]
        for _ in range(2):
            results.append([back(x) for x in _run(fn, *placed)])
    _assert_same_bits(results[0], results[1], "repeat")
    expected = _run(_fused_cp1(packing, ids, pos), q, k, v, dout)
    _assert_same_bits(results[0], expected, f"cp={cp} against cp=1")
    _check_against_reference(results[0], q, k, v, dout, ids, pos, None)


# ------------------------------------------------------------------------------------------------
# Errors: through MaxText's context manager, and concrete descriptor values
# ------------------------------------------------------------------------------------------------


def test_errors_inside_maxtexts_context_manager_keep_their_message():
    """MaxText's ``transformer_engine_context`` catches any exception raised in its block and yields
    a second time, so contextlib raises ``RuntimeError: generator didn't stop after throw()``.
    That wrapper is MaxText's; what this frontend guarantees: the guard is active in the block, our
    error is the RuntimeError's context (printed above it) with its own message, and the guard's
    MeshResource is restored."""
    q, k, v, _, _ = _inputs()
    bad_mask = jnp.zeros((B, 2, S, S), jnp.uint8)
    seen = []
    with pytest.raises(RuntimeError, match="generator didn't stop after throw") as info:
        with transformer_engine_context():
            seen.append(global_mesh_resource())
            jax.jit(lambda q, k, v: maxtext_layer()(q, k, v, sequence_descriptor=bad_mask))(q, k, v)
    assert seen[0].cp_resource == "context" and seen[0].tpsp_resource == "tensor_sequence"
    cause = info.value.__context__
    assert isinstance(cause, ValueError), type(cause)
    assert "`sequence_descriptor` as a mask must be [b, 1, s_q, s_kv]" in str(cause)
    assert global_mesh_resource() == MeshResource()


def maxtext_layer():
    layer = DotProductAttention(head_dim=D, num_attention_heads=H_Q, num_gqa_groups=H_KV,
                                attn_mask_type="padding_causal", qkv_layout="BSHD_BSHD_BSHD", scale_factor=1.0)
    return nnx.bridge.ToNNX(layer, rngs=nnx.Rngs(params=0))


@pytest.mark.parametrize("make, words", [
    (lambda: SequenceDescriptor.from_seqlens([-3, 8]), "`seqlens` must be -1 (an unused slot) or non-negative, "
     "got [-3, 8]"),
    (lambda: SequenceDescriptor.from_seqlens((jnp.array([3, 8]), jnp.array([3, -8]))),
     "`seqlens[1] (kv)` must be -1 (an unused slot) or non-negative"),
    (lambda: SequenceDescriptor.from_seqlens(jnp.array([[3, -2]])), "`seqlens` must be -1 (an unused slot)"),
    (lambda: SequenceDescriptor.from_seqlens_and_offsets(jnp.array([[3, 2]]), jnp.array([[0, -4]])),
     "`seq_offsets` must be -1 (an unused slot) or non-negative"),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(jnp.array([[1, -1]]), jnp.array([[0, 0]])),
     "`segment_ids` must be non-negative"),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(jnp.array([[1, 1]]), jnp.array([[0, -1]])),
     "`segment_pos` must be non-negative"),
    (lambda: SequenceDescriptor.from_seqlens(jnp.array([2.0, 8.0])), "`seqlens` must be an integer array"),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(jnp.array([[1, 1]]), None, is_thd=True,
                                                         is_segment_ids_reordered=True),
     "`segment_pos` must be given for load-balanced"),
])
def test_descriptor_values_are_checked_eagerly(make, words):
    with pytest.raises(ValueError) as info:
        make()
    assert words in str(info.value)


def test_descriptor_accepts_te_fill_and_traced_values():
    SequenceDescriptor.from_seqlens(jnp.array([[3, 5, -1, -1]]))  # TE's fill of unused THD slots
    SequenceDescriptor.from_seqlens(jnp.array([-1, 3]))  # and of an empty row
    SequenceDescriptor.from_seqlens([0, 8])
    jax.jit(lambda x: SequenceDescriptor.from_seqlens(x).seqlens[0])(jnp.array([-3, 8]))  # traced: unchecked
