"""Context parallelism of ``fused_attn`` on 8 CPU host devices (conftest sets
``--xla_force_host_platform_device_count=8``): the sequence split over a ``cp`` mesh axis of size
2, 4 and 8, keys and values gathered with ``all_gather`` or a ``ppermute`` ring, with and without
DualChunkSwap load balancing. In deterministic mode the outputs and gradients of every token are
bitwise the single-device call's (the fused primitives' CPU lowering, whole sequence) and bitwise
the same over repeats, and close to an fp64 reference. Also: the same from inside the user's own
``shard_map``, the Flax module passing the arguments through, gradients of ``fused_attn`` inside
``shard_map`` (the manual-axes type of the primitives' results), and the refusals.

Compiling dominates here (XLA's CPU compiler): the shapes are small and each configuration
compiles one jitted function (output and gradients together) that its checks share.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from te_jax_testing import assert_close_to_reference, reference_attention
from transformer_engine.jax.attention import (
    AttnBiasType,
    AttnMaskType,
    CPStrategy,
    QKVLayout,
    ReorderStrategy,
    SequenceDescriptor,
    fused_attn,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from te_jax_testing import fused_attn_with_backend
from transformer_engine.jax.sharding import MeshResource, global_shard_guard

if len(jax.devices()) < 8:
    pytest.skip(
        f"needs 8 devices, found {len(jax.devices())}: run with XLA_FLAGS=--xla_force_host_platform_device_count=8",
        allow_module_level=True,
    )

pytestmark = pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")

B, S, H_Q, H_KV, D = 2, 64, 4, 2, 16  # GQA; S / (2 * 8) = 4-token chunks at cp = 8
SCALE = D**-0.5
LB = ReorderStrategy.DualChunkSwap


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


@functools.lru_cache(maxsize=None)
def _inputs(dtype_name: str):
    """BSHD q, k, v, dout (fixed seeds)."""
    dtype = jnp.dtype(dtype_name)
    rng = np.random.default_rng(7)
    shapes = ((B, S, H_Q, D), (B, S, H_KV, D), (B, S, H_KV, D), (B, S, H_Q, D))
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes)


def _attention(layout, mask, strategy=CPStrategy.DEFAULT, load_balanced=False, axis="", stripe=None):
    """``(q, k, v, dout) -> (out, dq, dk, dv)`` in the layout's own format, through the fused primitives."""

    def loss(q, k, v, dout):
        out = fused_attn_with_backend(
            "fused", (q, k, v), None, None, None, AttnBiasType.NO_BIAS, mask, layout, SCALE, 0.0, True,
            context_parallel_strategy=strategy, context_parallel_causal_load_balanced=load_balanced,
            context_parallel_axis=axis, stripe_size=stripe)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    def fn(q, k, v, dout):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, dout)
        return (out, *grads)

    return jax.jit(fn)


def _seq_axis(layout) -> int:
    return 0 if layout == QKVLayout.SBHD_SBHD_SBHD else 1


def _to_layout(x, layout):
    return jnp.swapaxes(x, 0, 1) if _seq_axis(layout) == 0 else x


@functools.lru_cache(maxsize=None)
def _single_device(layout, mask, dtype_name):
    """The whole sequence on one device (no context-parallel axis): out, dq, dk, dv as numpy."""
    args = [_to_layout(x, layout) for x in _inputs(dtype_name)]
    return tuple(np.asarray(x) for x in _attention(layout, mask)(*args))


def _mesh(cp: int, with_dp: bool):
    if with_dp:
        return Mesh(np.array(jax.devices()[:8]).reshape(8 // cp, cp), ("dp", "cp"))
    return Mesh(np.array(jax.devices()[:cp]), ("cp",))


def _run_cp(layout, mask, dtype_name, cp, strategy, load_balanced, with_dp, axis_by_resource, repeats=1,
            stripe=None):
    """The context-parallel call under jit, inputs placed sequence-sharded (when load balanced in DualChunkSwap
    order, or with ``stripe`` in the Striped order of such stripes); results back in global token order, as
    numpy, one tuple per repeat."""
    mesh = _mesh(cp, with_dp)
    seq = _seq_axis(layout)
    resource = MeshResource(dp_resource="dp" if with_dp else None, cp_resource="cp" if axis_by_resource else None)
    spec = [None] * 4
    spec[seq] = "cp"
    if with_dp:
        spec[1 - seq] = "dp"
    fn = _attention(layout, mask, strategy, load_balanced, axis="" if axis_by_resource else "cp", stripe=stripe)
    args = [_to_layout(x, layout) for x in _inputs(dtype_name)]
    order = (ReorderStrategy.Striped if stripe is not None else LB, cp, seq, stripe)
    if load_balanced:
        args = [reorder_causal_load_balancing(x, *order) for x in args]
    results = []
    with mesh, global_shard_guard(resource):
        placed = [jax.device_put(x, NamedSharding(mesh, P(*spec))) for x in args]
        for _ in range(repeats):
            results.append(fn(*placed))
    if load_balanced:
        results = [[inverse_reorder_causal_load_balancing(x, *order) for x in r] for r in results]
    return [tuple(np.asarray(x) for x in r) for r in results]


NAMES = ("out", "dq", "dk", "dv")


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _assert_bitwise(actual, expected, what):
    """Equal bit patterns (a -0.0 against a +0.0 counts)."""
    for name, a, e in zip(NAMES, actual, expected):
        np.testing.assert_array_equal(_bits(a), _bits(e), err_msg=f"{name}: {what}")


def _assert_close_to_fp64(results, layout, mask, dtype_name):
    q, k, v, dout = _inputs(dtype_name)
    visible = np.tril(np.ones((S, S), bool)) if mask == AttnMaskType.CAUSAL_MASK else np.ones((S, S), bool)
    visible = visible[None, None]
    ref32 = reference_attention(q, k, v, None, dout, visible, SCALE)
    ref_lowp = reference_attention(q, k, v, None, dout, visible, SCALE, compute_dtype=jnp.dtype(dtype_name))
    for i, name in enumerate(NAMES):
        actual = np.asarray(results[i], np.float64)
        if _seq_axis(layout) == 0:
            actual = np.swapaxes(actual, 0, 1)
        assert_close_to_reference(name, actual, ref32[i], ref_lowp[i])


# (cp, strategy, load balanced, mask, dtype, layout, dp axis too, axis from MeshResource)
CASES = [
    (2, CPStrategy.ALL_GATHER, True, AttnMaskType.CAUSAL_MASK, "float16", QKVLayout.BSHD_BSHD_BSHD, False, False),
    (4, CPStrategy.RING, True, AttnMaskType.CAUSAL_MASK, "float32", QKVLayout.BSHD_BSHD_BSHD, True, True),
    (8, CPStrategy.ALL_GATHER, False, AttnMaskType.CAUSAL_MASK, "float16", QKVLayout.SBHD_SBHD_SBHD, False, False),
    (8, CPStrategy.RING, True, AttnMaskType.CAUSAL_MASK, "float16", QKVLayout.BSHD_BSHD_BSHD, False, True),
    (4, CPStrategy.DEFAULT, False, AttnMaskType.NO_MASK, "float16", QKVLayout.BSHD_BSHD_BSHD, True, False),
    (2, CPStrategy.RING, False, AttnMaskType.NO_MASK, "float32", QKVLayout.SBHD_SBHD_SBHD, False, False),
    (8, CPStrategy.ALL_GATHER, True, AttnMaskType.NO_MASK, "float16", QKVLayout.BSHD_BSHD_BSHD, False, False),
]


def _case_id(case):
    cp, strategy, lb, mask, dtype, layout, with_dp, by_resource = case
    parts = [f"cp{cp}", strategy.name.lower(), "lb" if lb else "contiguous", mask.value, dtype,
             layout.value.split("_")[0], "dp" if with_dp else "", "resource" if by_resource else ""]
    return "-".join(p for p in parts if p)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bitwise_equal_to_single_device_and_over_repeats(case):
    cp, strategy, lb, mask, dtype, layout, with_dp, by_resource = case
    first, second = _run_cp(layout, mask, dtype, cp, strategy, lb, with_dp, by_resource, repeats=2)
    _assert_bitwise(first, _single_device(layout, mask, dtype), f"cp={cp} differs from the single-device call")
    _assert_bitwise(second, first, "a repeat differs")
    _assert_close_to_fp64(first, layout, mask, dtype)


def test_inside_the_users_shard_map():
    """Called on the local chunks inside ``shard_map`` over the cp axis (grad inside too): the same bits."""
    cp, layout, mask, dtype = 4, QKVLayout.BSHD_BSHD_BSHD, AttnMaskType.CAUSAL_MASK, "float16"
    mesh = _mesh(cp, with_dp=False)
    fn = _attention(layout, mask, CPStrategy.RING, True, axis="cp")
    spec = P(None, "cp")
    local = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4)
    args = [reorder_causal_load_balancing(x, LB, cp, 1) for x in _inputs(dtype)]
    results = jax.jit(local)(*args)
    results = tuple(np.asarray(inverse_reorder_causal_load_balancing(x, LB, cp, 1)) for x in results)
    _assert_bitwise(results, _single_device(layout, mask, dtype), "inside shard_map")


def test_grad_of_fused_attn_inside_shard_map():
    """Regression: grad through the fused primitives inside ``shard_map`` failed with "Custom VJP bwd
    rule must produce an output with the same type" (the results lacked the manual-axes type). Batch
    split over dp: bitwise the unsharded gradients; query heads split with one replicated key/value
    head (MQA): its cotangents summed over the shards (the pcast's transpose), within rounding."""
    layout, mask, dtype = QKVLayout.BSHD_BSHD_BSHD, AttnMaskType.CAUSAL_MASK, "float32"
    fn = _attention(layout, mask)
    q, k, v, dout = _inputs(dtype)
    expected = _single_device(layout, mask, dtype)
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    split = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("dp"),) * 4, out_specs=(P("dp"),) * 4))
    _assert_bitwise(tuple(np.asarray(x) for x in split(q, k, v, dout)), expected, "batch over dp in shard_map")

    # MQA with the query heads split over dp: each shard reads the one replicated key/value head.
    k1, v1 = k[:, :, :1], v[:, :, :1]
    heads = P(None, None, "dp")
    rep = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(heads, P(), P(), heads), out_specs=(heads, heads, P(), P())))
    whole = _attention(layout, mask)(q, k1, v1, dout)
    for name, a, e in zip(NAMES, rep(q, k1, v1, dout), whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5, err_msg=name)


def test_flax_module_passes_the_arguments_through():
    pytest.importorskip("flax", reason="Flax is not installed")
    from transformer_engine.jax.flax.transformer import DotProductAttention

    cp, dtype = 2, "float16"
    q, k, v, _ = _inputs(dtype)
    layer = DotProductAttention(head_dim=D, num_attention_heads=H_Q, num_gqa_groups=H_KV, attn_mask_type="causal",
                                qkv_layout="bshd_bshd_bshd", scale_factor=SCALE, context_parallel_axis="cp",
                                context_parallel_strategy="ring", context_parallel_causal_load_balanced=True)
    mesh = _mesh(cp, with_dp=False)
    args = [reorder_causal_load_balancing(x, LB, cp, 1) for x in (q, k, v)]
    with mesh:
        placed = [jax.device_put(x, NamedSharding(mesh, P(None, "cp"))) for x in args]
        out = jax.jit(lambda q, k, v: layer.apply({}, q, k, v))(*placed)
    out = np.asarray(inverse_reorder_causal_load_balancing(out, LB, cp, 1))
    expected = jax.jit(lambda q, k, v: layer.apply({}, q, k, v))(q, k, v)  # no mesh: the cp = 1 call
    np.testing.assert_array_equal(_bits(out), _bits(expected))


# ------------------------------------------------------------------------------------------------
# Refusals name the argument
# ------------------------------------------------------------------------------------------------
# Striped input (``stripe_size``: ours for BSHD/SBHD): (cp, strategy, mask, dtype, layout, dp axis too, stripe).
# Stripes per rank: 2, 4, 1 and 8 (the plan's STRIPED order, a call per own stripe and pass).
STRIPED_CASES = [
    (2, CPStrategy.ALL_GATHER, AttnMaskType.CAUSAL_MASK, "float32", QKVLayout.BSHD_BSHD_BSHD, False, 16),
    (4, CPStrategy.RING, AttnMaskType.CAUSAL_MASK, "float16", QKVLayout.SBHD_SBHD_SBHD, True, 4),
    (2, CPStrategy.RING, AttnMaskType.NO_MASK, "float16", QKVLayout.BSHD_BSHD_BSHD, False, 32),
    (4, CPStrategy.ALL_GATHER, AttnMaskType.NO_MASK, "float32", QKVLayout.SBHD_SBHD_SBHD, False, 2),
]


@pytest.mark.parametrize("case", STRIPED_CASES, ids=lambda c: "-".join(
    [f"cp{c[0]}", c[1].name.lower(), c[2].value, c[3], c[4].value.split("_")[0], f"stripe{c[6]}"]
    + (["dp"] if c[5] else [])))
def test_striped_input_is_bitwise_the_single_device_call(case):
    """BSHD/SBHD inputs in the Striped order (``context_parallel_causal_load_balanced=True, stripe_size=n``):
    the plan runs the STRIPED order, and the outputs and gradients, back in token order, are the
    single-device call's bits, over repeats too."""
    cp, strategy, mask, dtype, layout, with_dp, stripe = case
    first, second = _run_cp(layout, mask, dtype, cp, strategy, True, with_dp, False, repeats=2, stripe=stripe)
    _assert_bitwise(first, _single_device(layout, mask, dtype), f"striped cp={cp} differs from the single-device call")
    _assert_bitwise(second, first, "a repeat differs")
    _assert_close_to_fp64(first, layout, mask, dtype)


_BASE = dict(attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=AttnMaskType.CAUSAL_MASK,
             qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=SCALE, dropout_probability=0.0, is_training=True,
             context_parallel_axis="cp")


@pytest.mark.parametrize("overrides, s, error, words", [
    (dict(context_parallel_causal_load_balanced=True), 36, ValueError,
     "`qkv` sequence length (s_q) must be a multiple of 2 * cp_size = 8"),
    (dict(), 42, ValueError, "`qkv` sequence length (s_q) must be a multiple of cp_size = 4"),
    (dict(context_parallel_strategy="ring"), 64, ValueError, "`context_parallel_strategy` must be a CPStrategy"),
    (dict(context_parallel_causal_load_balanced="yes"), 64, ValueError,
     "`context_parallel_causal_load_balanced` must be a bool"),
    (dict(attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK), 64, NotImplementedError, "`attn_mask_type` must be"),
    (dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS), 64, NotImplementedError, "`attn_bias_type` must be"),
    (dict(window_size=(8, 0)), 64, NotImplementedError, "`window_size` must be None"),
    (dict(dropout_probability=0.1), 64, NotImplementedError, "`dropout_probability` must be 0"),
    (dict(qkv_layout=QKVLayout.THD_THD_THD, attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK,
          dropout_probability=0.1), 64, NotImplementedError, "`dropout_probability` must be 0"),
    (dict(qkv_layout=QKVLayout.THD_THD_THD, attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK,
          context_parallel_causal_load_balanced=True, stripe_size=4), 40, ValueError,
     "`qkv` sequence length must be a multiple of cp_size * stripe_size = 16"),
    (dict(stripe_size=4), 64, ValueError,
     "`stripe_size` must be None without context_parallel_causal_load_balanced=True with qkv_layout='bshd_bshd_bshd'"),
    (dict(context_parallel_causal_load_balanced=True, stripe_size=3), 40, ValueError,
     "`qkv` sequence length (s_q) must be a multiple of cp_size * stripe_size = 12 (Striped order)"),
    (dict(stripe_size=0), 64, ValueError, "`stripe_size` must be None or a positive int"),
])
def test_refusals_name_the_argument(overrides, s, error, words):
    q = jnp.zeros((B, s, H_Q, D), jnp.float16)
    k = jnp.zeros((B, s, H_KV, D), jnp.float16)
    kwargs = {**_BASE, **overrides}
    bias = jnp.zeros((1, H_Q, s, s), jnp.float16) if kwargs["attn_bias_type"] != AttnBiasType.NO_BIAS else None
    desc = SequenceDescriptor.from_seqlens(jnp.full((B,), s, jnp.int32)) if "padding" in kwargs[
        "attn_mask_type"].value else None
    with _mesh(4, with_dp=False), pytest.raises(error) as info:
        fused_attn((q, k, k), bias, desc, jax.random.PRNGKey(0), **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("mask", [AttnMaskType.CAUSAL_MASK, AttnMaskType.NO_MASK], ids=lambda m: m.value)
def test_backward_calls_run_one_gradient_pass_each(mask, monkeypatch):
    """Each fused backward call of a rank asks for dQ only or dK/dV only (``FusedAttnStatic.backward_grads``),
    one of each per own chunk, and the result stays the single-device call's bits."""
    from transformer_engine.common.attention.enums import BackwardGrads
    from transformer_engine.jax import context_parallel

    asked = []
    real = context_parallel.fused_attn_bwd

    def record(*args):
        asked.append(args[9].backward_grads)  # the FusedAttnStatic
        return real(*args)

    monkeypatch.setattr(context_parallel, "fused_attn_bwd", record)
    layout, dtype = QKVLayout.BSHD_BSHD_BSHD, "float32"
    (results,) = _run_cp(layout, mask, dtype, 2, CPStrategy.ALL_GATHER, True, False, False)
    chunks = 2 if mask == AttnMaskType.CAUSAL_MASK else 1  # per rank: one call pair per own chunk (no mask: one)
    assert sorted(asked) == sorted([BackwardGrads.DQ, BackwardGrads.DKDV] * chunks), asked
    _assert_bitwise(results, _single_device(layout, mask, dtype), "partial backwards")


def test_cp_scaling_benchmark_dry_run_is_bitwise(tmp_path):
    """benchmarks/attention/bench_cp_scaling_jax.py on 8 host devices: each strategy's results, back in token
    order, are the one-device call's bits; its JSON is written."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "attention", "bench_cp_scaling_jax.py"),
                           "--dry-run", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["cp"], r["bitwise"]) for r in rows] == [("all_gather", 8, True), ("ring", 8, True)]


@pytest.mark.parametrize("strategy", [CPStrategy.ALL_GATHER, CPStrategy.RING], ids=lambda s: s.name)
@pytest.mark.parametrize("load_balanced", [True, False, 4], ids=["dual_chunk_swap", "contiguous", "striped4"])
@pytest.mark.parametrize("cp", [4, 8])
def test_chunk_calls_start_at_the_tile_boundary(cp, load_balanced, strategy, monkeypatch):
    """With a tile (16 rows) longer than the chunks (16, 8 or 4 tokens; Striped: stripes of 4), each causal
    chunk call starts at the tile boundary before its chunk, the common plan's ``ChunkRange.aligned_start``
    (zero rows in front, dropped), as on a GPU whose tiles do not divide the chunk length: still the
    single-device bits."""
    from transformer_engine.jax import context_parallel

    monkeypatch.setattr(context_parallel, "tile_alignment", lambda *args, **kwargs: 16)
    seen = []
    real = context_parallel.fused_attn_fwd

    def record(*args):
        seen.append(args[6].qkv_format)
        return real(*args)

    monkeypatch.setattr(context_parallel, "fused_attn_fwd", record)
    layout, mask, dtype = QKVLayout.BSHD_BSHD_BSHD, AttnMaskType.CAUSAL_MASK, "float32"
    stripe = None if isinstance(load_balanced, bool) else load_balanced
    (results,) = _run_cp(layout, mask, dtype, cp, strategy, bool(load_balanced), False, False, stripe=stripe)
    chunk = stripe or S // (2 * cp if load_balanced else cp)
    offset_calls = chunk % 16 != 0  # else every chunk starts on a tile: the plain chunk calls
    assert seen and {f.value for f in seen} == {"thd" if offset_calls else "bshd"}, seen
    _assert_bitwise(results, _single_device(layout, mask, dtype), "tile-aligned chunk calls")
    _assert_close_to_fp64(results, layout, mask, dtype)
