"""TransformerEngine-JAX's Flax layers (transformer_engine.jax.flax): each against a plain jax.numpy
float32 reference built from the module's own parameters (outputs and gradients), their parameter
trees, FP8 through LayerNormMLP, bitwise repeatability, a sharded run on 8 host devices, refusals.

The references here are written independently of the modules: norms from their formulas, activations
from ``jax.nn``, rotary embedding as complex multiplication, attention as an explicit softmax, relative
position buckets element by element, and the layer order as TransformerEngine-JAX writes it.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer_engine.common import recipe
from transformer_engine.jax import autocast
from transformer_engine.jax.flax import (DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP,
                                         MultiHeadAttention, RelativePositionBiases, TransformerLayer,
                                         TransformerLayerType, extend_logical_axis_rules)
from transformer_engine.jax.sharding import MeshResource, global_shard_guard

B, S, HID = 2, 8, 32
RTOL = ATOL = 2e-5


def _x(seed=0, shape=(B, S, HID), scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _init(model, *args, **kwargs):
    """The module's parameters as its init makes them."""
    return nn.unbox(jax.jit(lambda: model.init(jax.random.PRNGKey(11), *args, **kwargs))())["params"]


def _randomize(params, seed=5, scale=0.3):
    """Every parameter replaced by random values (biases and norm parameters would start at 0 / 1)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    rng = np.random.default_rng(seed)
    new = [jnp.asarray(rng.standard_normal(leaf.shape) * scale + (1.0 if leaf.ndim == 1 else 0.0), leaf.dtype)
           for leaf in leaves]
    return jax.tree_util.tree_unflatten(tree, new)


def _params(model, *args, seed=5, scale=0.3, **kwargs):
    """Random parameters of the module's tree (its init traced, not run: no compile)."""
    shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(11), *args, **kwargs))["params"])
    return _randomize(shapes, seed, scale)


def _assert_tree_close(actual, expected, rtol=RTOL, atol=ATOL):
    """Leaf by leaf: |a - e| <= atol * max(1, max|e|) + rtol * |e| (float32 rounding of sums scales
    with the leaf's magnitude, not each element's). Returns the worst |a - e| / max(1, max|e|)."""
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    worst = 0.0
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        size = max(1.0, float(np.max(np.abs(e))))
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * size, err_msg=jax.tree_util.keystr(path))
        worst = max(worst, float(np.max(np.abs(a - e))) / size)
    return worst


def _check(module_fn, ref_fn, params, *inputs, seed=7):
    """module_fn(params, *inputs) and ref_fn(params, *inputs): equal outputs, and equal gradients of
    sum(out * dy) with respect to the parameters and the float inputs (one jitted vjp per side)."""
    shapes = jax.eval_shape(module_fn, params, *inputs)
    dys = jax.tree_util.tree_map(lambda leaf: _x(seed + leaf.ndim, leaf.shape), shapes)

    def run(fn):
        out, vjp = jax.vjp(fn, params, *inputs)
        return out, vjp(dys)

    got, want = jax.jit(lambda: run(module_fn))(), jax.jit(lambda: run(ref_fn))()
    return _assert_tree_close(got, want)


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------


def ref_norm(x, p, kind, zero_centered_gamma=False, eps=1e-6):
    if kind == "layernorm":
        mu = jnp.mean(x, -1, keepdims=True)
        y = (x - mu) / jnp.sqrt(jnp.mean((x - mu) ** 2, -1, keepdims=True) + eps)
    else:
        y = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
    y = y * (p["scale"] + 1.0 if zero_centered_gamma else p["scale"])
    return y + p["ln_bias"] if kind == "layernorm" else y


REF_ACTS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "squared_relu": lambda x: jax.nn.relu(x) ** 2,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
    "clamped_silu": lambda x: jnp.minimum(x, 7.0) * jax.nn.sigmoid(1.702 * jnp.minimum(x, 7.0)),
    "clamped_linear": lambda x: jnp.clip(x, -7.0, 7.0) + 1.0,
}


def ref_mlp(p, x, gate_order, kind="layernorm", use_bias=False):
    y = ref_norm(x, p, kind)
    h = jnp.einsum("bsh,hni->bsni", y, p["wi_kernel"])
    if use_bias:
        h = h + p["wi_bias"]
    z = 1.0
    for i, name in enumerate(gate_order):
        z = z * REF_ACTS[name](h[..., i, :])
    out = z @ p["wo_kernel"]
    return (out + p["wo_bias"] if use_bias else out), y


def ref_rotary(x, windows, method):
    """Rotary embedding of x [b, s, h, d] as complex multiplication by exp(i * position / timescale)."""
    d = x.shape[-1]
    half = d // 2
    ts = windows[0] * (windows[1] / windows[0]) ** (2.0 * np.arange(half) / d)
    theta = np.arange(x.shape[1])[:, None] / ts[None, :]
    rot = jnp.asarray(np.exp(1j * theta), jnp.complex64)[None, :, None, :]
    if method == "alternate":
        z = (x[..., :half] + 1j * x[..., half:]) * rot
        return jnp.concatenate([z.real, z.imag], -1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
    return jnp.stack([z.real, z.imag], -1).reshape(x.shape)


def ref_attention(q, k, v, scale, mask_type, mask=None, bias=None, window=None):
    h, hk = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        logits = logits + bias
    sq, sk = q.shape[1], k.shape[1]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    masked = np.zeros((sq, sk), bool)
    if "causal" in mask_type:
        masked |= j > i
    if window is not None:
        left, right = window
        if left >= 0:
            masked |= j < i - left
        if right >= 0:
            masked |= j > i + right
    masked = jnp.asarray(masked)[None, None]
    if mask is not None and "padding" in mask_type:
        masked = masked | mask
    logits = jnp.where(masked, -jnp.inf, logits)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)


def ref_mha(p, xq, xkv, cfg, self_attn, mask=None, bias=None, input_layernorm=True, mask_type=None):
    heads, groups, d = cfg["heads"], cfg["groups"], cfg["head_dim"]
    kind = cfg.get("kind", "layernorm")
    if "qkv" in p:
        y = ref_norm(xq, p["qkv"], kind) if input_layernorm else xq
        qkv = jnp.einsum("bsh,hnf->bsnf", y, p["qkv"]["kernel"])
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        y = ref_norm(xq, p["query"], kind) if input_layernorm else xq
        q = y @ p["query"]["kernel"]
        src = y if self_attn else xkv
        if "kv" in p:
            kv = jnp.einsum("bsh,hnf->bsnf", src, p["kv"]["kernel"])
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k, v = src @ p["key"]["kernel"], src @ p["value"]["kernel"]
    q = q.reshape(*q.shape[:2], heads, d)
    k = k.reshape(*k.shape[:2], groups, d)
    v = v.reshape(*v.shape[:2], groups, d)
    if cfg.get("rotary"):
        q, k = ref_rotary(q, (1, 10000), cfg["rotary"]), ref_rotary(k, (1, 10000), cfg["rotary"])
    scale = d**-0.5 if cfg.get("scale_attn_logits") else 1.0
    o = ref_attention(q, k, v, scale, mask_type or cfg.get("mask_type", "causal"), mask, bias, cfg.get("window"))
    return o.reshape(*o.shape[:2], heads * d) @ p["out"]["kernel"], y


def ref_buckets(sq, sk, num_buckets, max_distance, bidirectional):
    out = np.zeros((sq, sk), np.int32)
    for i in range(sq):
        for j in range(sk):
            n, nb, ret = i - j, num_buckets, 0
            if bidirectional:
                nb //= 2
                ret += nb if n < 0 else 0
                n = abs(n)
            else:
                n = max(n, 0)
            exact = nb // 2
            if n < exact:
                ret += n
            else:
                eps = float(np.finfo(np.float32).eps)
                large = exact + int(math.log(n / exact + eps) / math.log(max_distance / exact) * (nb - exact))
                ret += min(large, nb - 1)
            out[i, j] = ret
    return out


# ------------------------------------------------------------------------------------------------
# LayerNorm, DenseGeneral, LayerNormDenseGeneral
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_matches_reference(kind, zero_centered_gamma):
    m = LayerNorm(layernorm_type=kind.upper() if zero_centered_gamma else kind, zero_centered_gamma=zero_centered_gamma,
                  epsilon=1e-5)
    x = _x(scale=3.0) + 1.5
    params = _init(m, x)
    assert set(params) == ({"scale", "ln_bias"} if kind == "layernorm" else {"scale"})
    np.testing.assert_array_equal(params["scale"], 0.0 if zero_centered_gamma else 1.0)  # TE's default inits
    params = _randomize(params)
    _check(lambda p, x: m.apply({"params": p}, x), lambda p, x: ref_norm(x, p, kind, zero_centered_gamma, 1e-5),
           params, x)


def test_dense_general_features_tuple_axis_and_bias():
    m = DenseGeneral(features=(3, 5), axis=(1,), kernel_axes=("a", "b", "c"), bias_axes=("b", "c"))
    x = _x(shape=(B, 6, 4))
    params = _params(m, x)
    assert params["kernel"].shape == (6, 3, 5) and params["bias"].shape == (3, 5)
    _check(lambda p, x: m.apply({"params": p}, x),
           lambda p, x: jnp.einsum("bkc,kfg->bcfg", x, p["kernel"]) + p["bias"], params, x)
    assert set(_params(DenseGeneral(features=4, use_bias=False), x)) == {"kernel"}


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_layernorm_dense_general_matches_reference(kind):
    m = LayerNormDenseGeneral(features=24, layernorm_type=kind, use_bias=True, return_layernorm_output=True,
                              depth_scaling=2.0)
    x = _x()
    params = _params(m, x)
    assert params["kernel"].shape == (HID, 24)

    def ref(p, x):
        y = ref_norm(x, p, kind)
        return (y @ p["kernel"] + p["bias"]) / 2.0, y

    _check(lambda p, x: m.apply({"params": p}, x), ref, params, x)
    out, ln = LayerNormDenseGeneral(features=24, enable_layernorm=False).apply(
        {"params": {"kernel": params["kernel"]}}, x)
    assert ln is None
    np.testing.assert_allclose(out, x @ params["kernel"], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------------------------------
# LayerNormMLP
# ------------------------------------------------------------------------------------------------

# (activations as given, the gate order TransformerEngine-JAX applies them in)
ACTIVATIONS = [
    (("gelu",), ("gelu",)), (("gelu", "linear"), ("gelu", "linear")), (("silu",), ("silu",)),
    (("silu", "linear"), ("silu", "linear")), (("relu",), ("relu",)), (("relu", "linear"), ("relu", "linear")),
    (("quick_gelu",), ("quick_gelu",)), (("quick_gelu", "linear"), ("quick_gelu", "linear")),
    (("squared_relu",), ("squared_relu",)), (("squared_relu", "linear"), ("squared_relu", "linear")),
    (("sigmoid", "linear"), ("sigmoid", "linear")),
    (("clamped_silu", "clamped_linear"), ("clamped_silu", "clamped_linear")),
    (("linear", "GELU"), ("gelu", "linear")),  # a leading 'linear' moves last; names in any case
    (("gelu", "tanh"), ("gelu", "tanh")),  # outside the fused table: the product of jax.nn functions
]


@pytest.mark.parametrize("acts, gate_order", ACTIVATIONS, ids=["-".join(a) for a, _ in ACTIVATIONS])
def test_layernorm_mlp_matches_reference(acts, gate_order):
    kind = "rmsnorm" if "silu" in acts else "layernorm"
    use_bias = len(acts) == 2
    m = LayerNormMLP(intermediate_dim=48, activations=acts, layernorm_type=kind, use_bias=use_bias,
                     return_layernorm_output=True)
    x = _x(scale=2.0)
    params = _params(m, x)
    assert params["wi_kernel"].shape == (HID, len(acts), 48) and params["wo_kernel"].shape == (48, HID)
    if use_bias:
        assert params["wi_bias"].shape == (len(acts), 48) and params["wo_bias"].shape == (HID,)
    _check(lambda p, x: m.apply({"params": p}, x, deterministic=True),
           lambda p, x: ref_mlp(p, x, gate_order, kind, use_bias), params, x)


def test_layernorm_mlp_clamped_swiglu_params_and_dropout():
    m = LayerNormMLP(intermediate_dim=16, activations=("clamped_silu", "clamped_linear"),
                     activation_params={"limit": 0.5, "alpha": 1.0, "glu_linear_offset": 0.25},
                     intermediate_dropout_rate=0.5)
    x = _x(scale=3.0)
    params = _params(m, x, deterministic=True)

    def ref(p, x):
        y = ref_norm(x, p, "layernorm")
        h = jnp.einsum("bsh,hni->bsni", y, p["wi_kernel"])
        a = jnp.minimum(h[..., 0, :], 0.5)
        return (a * jax.nn.sigmoid(a) * (jnp.clip(h[..., 1, :], -0.5, 0.5) + 0.25)) @ p["wo_kernel"]

    out, _ = m.apply({"params": params}, x, deterministic=True)
    np.testing.assert_allclose(out, ref(params, x), rtol=RTOL, atol=ATOL)
    # Dropout: the same rng gives the same mask; a different one another.
    run = jax.jit(lambda key: m.apply({"params": params}, x, rngs={"dropout": key})[0])
    a, b, c = run(jax.random.PRNGKey(1)), run(jax.random.PRNGKey(1)), run(jax.random.PRNGKey(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.allclose(a, out)


# ------------------------------------------------------------------------------------------------
# FP8 through LayerNormMLP
# ------------------------------------------------------------------------------------------------


def _fake_fp8(t, fmt=jnp.float8_e4m3fn, fmax=448.0):
    """Current scaling: t * (fmax / amax) cast to FP8 and back, divided by the scale."""
    scale = jnp.float32(fmax) / jnp.max(jnp.abs(t))
    return (t * scale).astype(fmt).astype(jnp.float32) / scale


def test_layernorm_mlp_fp8_current_scaling_matches_quantized_reference():
    m = LayerNormMLP(intermediate_dim=64, activations=("gelu", "linear"))
    x = _x(scale=2.0)
    params = _params(m, x, scale=0.2)
    with autocast(enabled=True, recipe=recipe.Float8CurrentScaling()):
        fp8_fn = jax.jit(lambda p, x: m.apply({"params": p}, x)[0])
        out = fp8_fn(params, x)
        grads = jax.jit(jax.grad(lambda p, x: jnp.sum(m.apply({"params": p}, x)[0] ** 2)))(params, x)

    def ref(p, x):
        y = ref_norm(x, p, "layernorm")
        h = jnp.einsum("bsh,hni->bsni", _fake_fp8(y), _fake_fp8(p["wi_kernel"]))
        z = REF_ACTS["gelu"](h[..., 0, :]) * h[..., 1, :]
        return _fake_fp8(z) @ _fake_fp8(p["wo_kernel"])

    plain = jax.jit(lambda p, x: m.apply({"params": p}, x)[0])(params, x)
    scale = float(jnp.max(jnp.abs(plain)))
    diff_ref = float(jnp.max(jnp.abs(out - ref(params, x))))
    diff_plain = float(jnp.max(jnp.abs(out - plain)))
    # The FP8 product is the quantized operands' product (up to float32 rounding that may move an
    # operand across an FP8 rounding boundary), and visibly not the unquantized one.
    assert diff_ref < 1e-3 * scale, (diff_ref, scale)
    assert diff_plain > 20 * diff_ref and diff_plain < 0.1 * scale, (diff_plain, diff_ref, scale)
    want = jax.jit(jax.grad(lambda p, x: jnp.sum(m.apply({"params": p}, x)[0] ** 2)))(params, x)
    # Gradients: the backward GEMMs take E5M2 gradients (2 mantissa bits, up to 12.5% per element).
    for key in ("wi_kernel", "wo_kernel", "scale"):
        g, w = np.asarray(grads[key]), np.asarray(want[key])
        assert np.linalg.norm(g - w) < 0.15 * np.linalg.norm(w), (key, np.linalg.norm(g - w) / np.linalg.norm(w))


def test_layernorm_mlp_delayed_scaling_keeps_its_state_per_gemm():
    m = LayerNormMLP(intermediate_dim=16)
    x = _x()
    with autocast(enabled=True, recipe=recipe.DelayedScaling(amax_history_len=4)):
        variables = jax.jit(lambda: m.init(jax.random.PRNGKey(0), x))()
        grads = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x)[0])))(variables)
    names = set(variables["fp8_metas"])
    assert {"x_0_scale", "kernel_0_amax_history", "grad_0_scale", "x_1_scale", "kernel_1_scale",
            "grad_1_amax_history"} <= names, names
    # The state's "gradient" is its next value: this step's amax enters the history.
    assert float(grads["fp8_metas"]["x_0_amax_history"][-1]) > 0.0


# ------------------------------------------------------------------------------------------------
# MultiHeadAttention, RelativePositionBiases
# ------------------------------------------------------------------------------------------------

MHA_CASES = {
    "fused_qkv": dict(heads=4, groups=4, fuse=True, params={"qkv", "out"}),
    "gqa": dict(heads=4, groups=2, fuse=True, params={"query", "kv", "out"}),
    "mqa_unfused": dict(heads=4, groups=1, fuse=False, params={"query", "key", "value", "out"}),
    "rotary_consecutive": dict(heads=4, groups=2, fuse=True, rotary="consecutive", params={"query", "kv", "out"}),
    "rotary_alternate_qkv": dict(heads=4, groups=4, fuse=True, rotary="alternate", scale_attn_logits=True,
                                 params={"qkv", "out"}),
    "window_no_mask_rmsnorm": dict(heads=2, groups=2, fuse=False, mask_type="no_mask", window=(2, 1),
                                   kind="rmsnorm", params={"query", "key", "value", "out"}),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multi_head_attention_self_attention_matches_reference(case):
    cfg = dict(MHA_CASES[case], head_dim=8)
    m = MultiHeadAttention(head_dim=8, num_attention_heads=cfg["heads"], num_gqa_groups=cfg["groups"],
                           fuse_qkv_params=cfg["fuse"], transpose_batch_sequence=False,
                           attn_mask_type=cfg.get("mask_type", "causal"), window_size=cfg.get("window"),
                           enable_rotary_pos_emb="rotary" in cfg,
                           rotary_pos_emb_group_method=cfg.get("rotary", "consecutive"),
                           scale_attn_logits=cfg.get("scale_attn_logits", False),
                           layernorm_type=cfg.get("kind", "layernorm"),
                           return_layernorm_output=True)
    x = _x()
    params = _params(m, x, x, deterministic=True, scale=0.2)
    assert set(params) == cfg["params"]
    if "qkv" in params:
        assert params["qkv"]["kernel"].shape == (HID, 3, cfg["heads"] * 8)
    if "kv" in params:
        assert params["kv"]["kernel"].shape == (HID, 2, cfg["groups"] * 8)
    _check(lambda p, x: m.apply({"params": p}, x, x, deterministic=True),
           lambda p, x: ref_mha(p, x, x, cfg, True), params, x)


def test_multi_head_attention_cross_attention_with_padding_mask():
    cfg = dict(heads=4, groups=2, head_dim=8)
    m = MultiHeadAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="padding",
                           transpose_batch_sequence=False)
    xq, enc = _x(), _x(1, (B, 12, HID))
    kv_lens = np.array([12, 7])
    mask = jnp.asarray(np.arange(12)[None, None, None, :] >= kv_lens[:, None, None, None]).repeat(S, axis=2)
    params = _params(m, xq, enc, mask, deterministic=True, scale=0.2)
    assert set(params) == {"query", "kv", "out"} and params["kv"]["kernel"].shape == (HID, 2, 16)
    assert "scale" not in params["kv"]  # the keys and values come from the encoder's output, un-normalized
    worst = _check(lambda p, xq, enc: m.apply({"params": p}, xq, enc, mask, deterministic=True)[0],
                   lambda p, xq, enc: ref_mha(p, xq, enc, cfg, False, mask=mask, mask_type="padding")[0],
                   params, xq, enc)
    assert worst < ATOL


def test_relative_position_biases_buckets_and_values():
    for sq, sk, nb, md, bidi in ((16, 16, 8, 20, True), (12, 16, 8, 20, False), (8, 8, 32, 128, True)):
        np.testing.assert_array_equal(RelativePositionBiases.buckets(sq, sk, nb, md, bidi),
                                      ref_buckets(sq, sk, nb, md, bidi))
    m = RelativePositionBiases(num_buckets=8, max_distance=20, num_attention_heads=3)
    params = _init(m, 16, 16, True)
    assert params["rel_embedding"].shape == (3, 8)
    out = m.apply({"params": params}, 16, 16, True)
    assert out.shape == (1, 3, 16, 16)
    np.testing.assert_array_equal(out[0], params["rel_embedding"][:, ref_buckets(16, 16, 8, 20, True)])


# ------------------------------------------------------------------------------------------------
# TransformerLayer
# ------------------------------------------------------------------------------------------------


def ref_layer(p, x, enc, cfg, enc_mask=None):
    """TransformerEngine-JAX's order, written out: self attention, (cross attention), MLP, each added
    to its residual (its input, or its norm output post-layernorm); a final norm with output_layernorm."""
    decoder, post, out_ln = cfg["decoder"], cfg.get("post_ln", False), cfg.get("output_ln", False)
    bias = None
    if "relpos_bias" in p:
        bk = ref_buckets(S, S, 32, 128, not decoder)
        bias = p["relpos_bias"]["rel_embedding"][:, bk][None]
    a, ln = ref_mha(p["self_attention" if decoder else "attention"], x, x, cfg, True, bias=bias,
                    input_layernorm=not out_ln)
    x = a + (ln if post else x)
    if decoder:
        c, ln = ref_mha(p["encoder_decoder_attention"], x, enc, cfg, False, mask=enc_mask, mask_type="padding")
        x = c + (ln if post else x)
    z, ln = ref_mlp(p["mlp"], x, cfg["acts"], cfg.get("kind", "layernorm"))
    z = z + (ln if post else x)
    return ref_norm(z, p["output_layernorm"], cfg.get("kind", "layernorm")) if out_ln else z


LAYER_CASES = {
    "encoder": dict(decoder=False, heads=4, groups=4, acts=("gelu",)),
    "encoder_gqa_rotary_post_ln": dict(decoder=False, heads=4, groups=2, acts=("silu", "linear"), rotary="alternate",
                                       post_ln=True, relpos=False),
    "encoder_output_ln_rmsnorm": dict(decoder=False, heads=2, groups=1, acts=("gelu", "linear"), output_ln=True,
                                      kind="rmsnorm"),
    "decoder": dict(decoder=True, heads=4, groups=2, acts=("gelu", "linear")),
    "decoder_post_ln_rotary": dict(decoder=True, heads=4, groups=4, acts=("relu",), post_ln=True,
                                   rotary="consecutive", relpos=False),
}


def _layer(cfg, **kw):
    fields = dict(
        hidden_size=HID, mlp_hidden_size=48, num_attention_heads=cfg["heads"], num_gqa_groups=cfg["groups"],
        layernorm_type=cfg.get("kind", "layernorm"), hidden_dropout=0.0, attention_dropout=0.0,
        mlp_activations=cfg["acts"], apply_residual_connection_post_layernorm=cfg.get("post_ln", False),
        output_layernorm=cfg.get("output_ln", False),
        layer_type=TransformerLayerType.DECODER if cfg["decoder"] else TransformerLayerType.ENCODER,
        enable_relative_embedding=cfg.get("relpos", True), enable_rotary_pos_emb="rotary" in cfg,
        rotary_pos_emb_group_method=cfg.get("rotary", "consecutive"))
    return TransformerLayer(**dict(fields, **kw))


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_transformer_layer_matches_reference(case):
    cfg = dict(LAYER_CASES[case], head_dim=HID // LAYER_CASES[case]["heads"])
    m = _layer(cfg)
    x = _x()
    enc = _x(3, (B, 12, HID)) if cfg["decoder"] else None
    enc_mask = jnp.asarray(np.arange(12)[None, None, None, :] >= np.array([12, 9])[:, None, None, None]).repeat(S, 2)
    enc_mask = enc_mask if cfg["decoder"] else None
    params = _params(m, x, enc, None, enc_mask, deterministic=True, scale=0.2)
    expected = {"self_attention", "encoder_decoder_attention", "mlp"} if cfg["decoder"] else {"attention", "mlp"}
    expected |= {"relpos_bias"} if cfg.get("relpos", True) else set()
    expected |= {"output_layernorm"} if cfg.get("output_ln") else set()
    assert set(params) == expected
    if cfg["decoder"]:
        _check(lambda p, x, e: m.apply({"params": p}, x, e, None, enc_mask, deterministic=True),
               lambda p, x, e: ref_layer(p, x, e, cfg, enc_mask), params, x, enc)
    else:
        _check(lambda p, x: m.apply({"params": p}, x, deterministic=True),
               lambda p, x: ref_layer(p, x, None, cfg), params, x)


def test_transformer_layer_train_step_is_bitwise_run_to_run_with_dropout():
    cfg = LAYER_CASES["encoder"]
    m = _layer(cfg, hidden_dropout=0.1, attention_dropout=0.1, intermediate_dropout=0.1, drop_path=0.1)
    x = _x()
    params = _params(m, x, deterministic=True)

    def grads_fn():
        # A new function object each time: a separate trace and compile.
        return jax.jit(jax.grad(lambda p, key: jnp.sum(m.apply({"params": p}, x, rngs={"dropout": key}) ** 2)))

    key = jax.random.PRNGKey(4)
    second_fn = grads_fn()
    first, second = grads_fn()(params, key), second_fn(params, key)
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = second_fn(params, jax.random.PRNGKey(5))  # dropout is on: another key, other gradients
    assert not np.array_equal(first["mlp"]["wo_kernel"], other["mlp"]["wo_kernel"])


def test_transformer_layer_transpose_batch_sequence_is_the_transpose():
    cfg = LAYER_CASES["encoder_gqa_rotary_post_ln"]
    m, mt = _layer(cfg), _layer(cfg, transpose_batch_sequence=True)
    x = _x()
    params = _params(m, x, deterministic=True, scale=0.2)
    out = jax.jit(lambda p, x: m.apply({"params": p}, x, deterministic=True))(params, x)
    out_t = jax.jit(lambda p, x: mt.apply({"params": p}, x, deterministic=True))(params, x.transpose(1, 0, 2))
    np.testing.assert_allclose(out_t.transpose(1, 0, 2), out, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------------------------------
# Sharding: 8 host devices, data x tensor parallel, equal to the unsharded run
# ------------------------------------------------------------------------------------------------


def test_transformer_layer_sharded_over_data_and_tensor_axes_equals_unsharded():
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices (tests/jax/conftest.py sets --xla_force_host_platform_device_count=8)")
    cfg = LAYER_CASES["decoder"]
    m = _layer(cfg, mlp_activations=("gelu", "linear"))
    x, enc = _x(shape=(4, S, HID)), _x(3, (4, 12, HID))
    loss = lambda p, x, e: jnp.sum(m.apply({"params": p}, x, e, deterministic=True) ** 2)  # noqa: E731
    step = lambda p, x, e: (m.apply({"params": p}, x, e, deterministic=True), jax.grad(loss)(p, x, e))  # noqa: E731
    boxed = jax.eval_shape(lambda: m.init(jax.random.PRNGKey(11), x, enc, deterministic=True))["params"]
    params = _randomize(nn.unbox(boxed), scale=0.2)
    out, grads = jax.jit(step)(params, x, enc)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    with jax.set_mesh(mesh), global_shard_guard(MeshResource(dp_resource="data", tp_resource="model")):
        rules = extend_logical_axis_rules((("heads", "model"),))
        with nn.logical_axis_rules(rules):
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
            sharded = jax.device_put(params, shardings)
            batch = NamedSharding(mesh, P("data", None, None))
            out_s, grads_s = jax.jit(step)(sharded, jax.device_put(x, batch), jax.device_put(enc, batch))
    assert sharded["mlp"]["wi_kernel"].sharding.spec == P(None, None, "model")
    assert sharded["self_attention"]["out"]["kernel"].sharding.spec == P("model", None)
    assert sharded["relpos_bias"]["rel_embedding"].sharding.spec == P("model", None)
    # Tensor parallelism sums the output projections' partial products across devices: equal to
    # float32 rounding, not bitwise.
    _assert_tree_close((out_s, grads_s), (out, grads), rtol=1e-5, atol=1e-5)


def test_extend_logical_axis_rules():
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp", fsdp_resource="fsdp")):
        rules = dict(extend_logical_axis_rules((("embed", None),)))
        assert rules["nvte_batch"] == "fsdp" and rules["nvte_w_tp"] == "tp" and rules["nvte_w_fsdp"] == "fsdp"
        assert rules["nvte_head"] == "tp" and rules["nvte_hidden"] is None and rules["embed"] is None
        with pytest.raises(ValueError, match="nvte_w_tp"):
            extend_logical_axis_rules((("nvte_w_tp", "dp"),))


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, call, error, words", [
    (lambda: DenseGeneral(features=4, enable_low_rank_adaptation=True), "x", NotImplementedError,
     "enable_low_rank_adaptation=True"),
    (lambda: LayerNormMLP(intermediate_dim=4, axis=(-2, -1)), "x", NotImplementedError, "`axis` must be -1"),
    (lambda: LayerNormDenseGeneral(features=4, layernorm_type="batchnorm"), "x", ValueError, "`layernorm_type`"),
    (lambda: LayerNormMLP(intermediate_dim=4, activations=("nope",)), "x", ValueError, "`activations`"),
    (lambda: LayerNormMLP(intermediate_dim=4, activation_params={"beta": 1.0}), "x", ValueError,
     "`activation_params`"),
    (lambda: DenseGeneral(features=4, kernel_axes=("a",)), "x", ValueError, "`kernel_axes`"),
    (lambda: MultiHeadAttention(8, 4, low_rank_adaptation_scope="all", transpose_batch_sequence=False), "xx",
     NotImplementedError, "low_rank_adaptation_scope"),
    (lambda: MultiHeadAttention(8, 4, output_layernorm=True, transpose_batch_sequence=False), "xx", ValueError,
     "`output_layernorm`"),
    (lambda: MultiHeadAttention(8, 4, num_gqa_groups=3, transpose_batch_sequence=False), "xx", ValueError,
     "`num_gqa_groups`"),
    (lambda: MultiHeadAttention(8, 4, enable_rotary_pos_emb=True, rotary_pos_emb_group_method="spiral",
                                transpose_batch_sequence=False), "xx", ValueError, "rotary_pos_emb_group_method"),
    (lambda: MultiHeadAttention(8, 4, transpose_batch_sequence=False), "decode", NotImplementedError, "`decode=True`"),
    (lambda: TransformerLayer(hidden_size=HID, num_attention_heads=5), "x", ValueError, "`hidden_size`"),
    (lambda: TransformerLayer(hidden_size=HID, num_attention_heads=4, layer_type=TransformerLayerType.DECODER), "x",
     ValueError, "`encoded`"),
    (lambda: TransformerLayer(hidden_size=HID, num_attention_heads=4, layer_type="middle"), "x", ValueError,
     "`layer_type`"),
])
def test_refusals_are_named(make, call, error, words):
    x = _x()
    with pytest.raises(error, match=words):
        m = make()
        if call == "x":
            m.init(jax.random.PRNGKey(0), x)
        elif call == "xx":
            m.init(jax.random.PRNGKey(0), x, x)
        else:
            m.init(jax.random.PRNGKey(0), x, x, decode=True)


def test_mha_transpose_batch_sequence_none_warns_and_reads_false():
    x = _x()
    with pytest.warns(UserWarning, match="transpose_batch_sequence"):
        params = _params(MultiHeadAttention(8, 4), x, x, deterministic=True)
    assert params["qkv"]["kernel"].shape == (HID, 3, HID)


def test_transformer_layer_bfloat16_inputs_keep_their_dtype_and_track_float32():
    cfg = LAYER_CASES["decoder"]
    m = _layer(cfg)
    x, enc = _x(), _x(3, (B, 12, HID))
    params = _params(m, x, enc, deterministic=True, scale=0.2)
    run = jax.jit(lambda p, x, e: m.apply({"params": p}, x, e, deterministic=True))
    out32 = run(params, x, enc)
    out16 = run(params, x.astype(jnp.bfloat16), enc.astype(jnp.bfloat16))
    assert out16.dtype == jnp.bfloat16 and out32.dtype == jnp.float32
    err = float(jnp.max(jnp.abs(out16.astype(jnp.float32) - out32))) / float(jnp.max(jnp.abs(out32)))
    assert 0.0 < err < 0.05, err  # bfloat16's 8 bits of mantissa through a layer: about 1e-2
