"""FP8 in the JAX frontend: recipes' scales and amax histories against an fp64 recomputation of
TransformerEngine's formulas over 20 steps, ``dense``'s forward and gradients against an fp64
reference of the quantized math, bitwise repeats, the Flax state layout, and the refusals.

The reference quantizes as the formulas say (scale in fp64, rounded once to float32; operand times
scale in float32, clipped to +-fp8_max and rounded to the FP8 format by ml_dtypes), then multiplies
the dequantized operands in fp64. The quantized operands and the scales must be bitwise those of
the implementation; the GEMMs, which accumulate in float32, within float32's accumulation error.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from transformer_engine.common import recipe
from transformer_engine.jax import autocast, fp8_autocast
from transformer_engine.jax.dense import CollectiveOp, CollectiveOpSet, dense
from transformer_engine.jax.flax.module import TransformerEngineBase
from transformer_engine.jax.quantize import (BlockScaleQuantizer, CurrentScaleQuantizer, DelayedScaleQuantizer,
                                             QuantizerFactory, ScalingMode, is_fp8_available, noop_quantizer_set)

FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
F32_MAX = float(np.finfo(np.float32).max)
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}


# ------------------------------------------------------------------------------------------------
# fp64 reference of TransformerEngine's formulas
# ------------------------------------------------------------------------------------------------


def ref_current_scale(amax, fmax, epsilon=0.0, power_2=False):
    amax = np.maximum(np.asarray(amax, np.float64), epsilon)
    degenerate = (amax == 0) | np.isinf(amax)
    with np.errstate(divide="ignore"):
        scale = fmax / np.where(degenerate, 1.0, amax)
    scale = np.where(np.isinf(scale) | (scale > F32_MAX), F32_MAX, scale)
    if power_2:
        scale = 2.0 ** np.floor(np.log2(scale))
    return np.where(degenerate, 1.0, scale).astype(np.float32)


def ref_cast(x, scale, fmt):
    """float32 product, clipped and rounded to the format: the values the FP8 operand holds."""
    dtype, fmax = FP8[fmt]
    prod = np.asarray(x, np.float32) * np.asarray(scale, np.float32)
    return np.clip(prod, -fmax, fmax).astype(dtype)


def ref_block(x, block, fmt, power_2=True):
    """(fp8 data, per-element float32 scale_inv) of a 2-D tensor tiled by ``block``."""
    rows, cols = block
    m, n = x.shape
    xp = np.pad(np.asarray(x, np.float32), ((0, -m % rows), (0, -n % cols)))
    tiles = xp.reshape(xp.shape[0] // rows, rows, xp.shape[1] // cols, cols)
    scale = ref_current_scale(np.abs(tiles).max(axis=(1, 3)), FP8[fmt][1], power_2=power_2)
    full = np.repeat(np.repeat(scale, rows, 0), cols, 1)
    return ref_cast(xp, full, fmt)[:m, :n], (np.float32(1) / full)[:m, :n]


def ftz(v):
    """XLA flushes float32 denormals to zero (1 / the largest float32 is one: a clipped scale's inverse is 0)."""
    return np.where(np.abs(v) < np.finfo(np.float32).tiny, np.float32(0), v).astype(np.float32)


def dequant(data, scale_inv):
    return np.asarray(data, np.float64) * np.asarray(scale_inv, np.float64)


def assert_gemm_close(actual, a, b):
    """``actual`` (float32 accumulation) against the fp64 product ``a @ b``."""
    exact = a @ b
    bound = 4e-6 * (np.abs(a) @ np.abs(b)) + 1e-30
    err = np.abs(np.asarray(actual, np.float64) - exact)
    assert np.all(err <= bound), f"max error {err.max()} (bound there {bound.flat[np.argmax(err - bound)]})"


def inputs(seed, m=21, k=160, n=136, x_scale=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, m // 3, k)) * x_scale).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    dy = rng.standard_normal((3, m // 3, n)).astype(np.float32) * 1e-3
    return x, w, bias, dy


# ------------------------------------------------------------------------------------------------
# 20 steps of each recipe's scaling state
# ------------------------------------------------------------------------------------------------


class FP8Dense(TransformerEngineBase):
    features: int
    fp8_recipe: object = None

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.05), (x.shape[-1], self.features), jnp.float32)
        quantizer_set = self.generate_quantizer_set(fp8_recipe=self.fp8_recipe)
        return dense(x, kernel, quantizer_set=quantizer_set)


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 0), ("max", 2)])
def test_delayed_scaling_state_over_20_steps_equals_fp64_recomputation(algo, margin):
    hist_len = 4  # shorter than the run: entries leave the window
    r = recipe.DelayedScaling(amax_history_len=hist_len, amax_compute_algo=algo, margin=margin)
    model = FP8Dense(features=24, fp8_recipe=r)
    rng = np.random.default_rng(0)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((4, 32)))
    assert set(variables["fp8_metas"]) == {f"{t}_{v}" for t in ("x", "kernel", "grad")
                                           for v in ("scale", "amax_history")}

    @jax.jit
    def step(variables, x, dy):
        def loss(v):
            return jnp.sum(model.apply(v, x) * dy)

        grads = jax.grad(loss)(variables)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, variables["params"], grads["params"])
        return {"params": params, "fp8_metas": grads["fp8_metas"]}

    state = {t: (np.ones(1), np.zeros(hist_len)) for t in ("x", "kernel", "grad")}
    fmax = {"x": 448.0, "kernel": 448.0, "grad": 57344.0}
    for i in range(20):
        # Magnitudes that rise and fall, so that the history's max and its newest entry differ.
        x = (rng.standard_normal((4, 32)) * (1 + 3 * np.sin(i))).astype(np.float32)
        dy = (rng.standard_normal((4, 24)) * 10.0 ** (i % 5 - 2)).astype(np.float32)
        amax = {"x": np.abs(x).max(), "kernel": np.abs(np.asarray(variables["params"]["kernel"])).max(),
                "grad": np.abs(dy).max()}
        variables = step(variables, x, dy)
        for t in state:
            scale, hist = state[t]
            hist = hist.copy()
            hist[0] = amax[t]
            a = hist.max() if algo == "max" else hist[0]
            scale = np.array([fmax[t] / 2.0**margin / a]) if (a > 0 and np.isfinite(a)) else scale
            hist = np.roll(hist, -1)
            hist[0] = 0.0
            state[t] = (scale, hist)
            np.testing.assert_array_equal(np.asarray(variables["fp8_metas"][f"{t}_amax_history"]),
                                          hist.astype(np.float32), err_msg=f"step {i} {t}")
            np.testing.assert_array_equal(np.asarray(variables["fp8_metas"][f"{t}_scale"]),
                                          scale.astype(np.float32), err_msg=f"step {i} {t}")


@pytest.mark.parametrize("power_2,epsilon", [(False, 0.0), (True, 0.0), (False, 1e-2)])
def test_current_scaling_over_20_steps_equals_fp64_recomputation(power_2, epsilon):
    rng = np.random.default_rng(1)
    for fmt, dtype in (("e4m3", jnp.float8_e4m3fn), ("e5m2", jnp.float8_e5m2)):
        q = CurrentScaleQuantizer(dtype, power_2_scale=power_2, amax_epsilon=epsilon)
        for i in range(20):
            x = (rng.standard_normal((9, 13)) * 10.0 ** (i % 7 - 4)).astype(np.float32)
            if i == 3:
                x[:] = 0  # amax 0: scale 1
            if i == 5:
                x[:] = 2e-38  # a tiny (normal) amax: the scale overflows float32 and is clipped
            tensor, same = q.quantize_2d(jnp.asarray(x), 1)
            assert same is q
            scale = ref_current_scale(np.abs(x).max(), FP8[fmt][1], epsilon, power_2)
            np.testing.assert_array_equal(np.asarray(tensor.scale_inv), ftz(np.float32(1) / scale), err_msg=f"step {i}")
            np.testing.assert_array_equal(np.asarray(tensor.data).view(np.uint8),
                                          ref_cast(x, scale, fmt).view(np.uint8), err_msg=f"step {i}")


def test_block_scaling_over_20_steps_equals_fp64_recomputation():
    rng = np.random.default_rng(2)
    q1 = BlockScaleQuantizer(jnp.float8_e4m3fn, ScalingMode.BLOCK_SCALING_1D)
    q2 = BlockScaleQuantizer(jnp.float8_e4m3fn, ScalingMode.BLOCK_SCALING_2D)
    for i in range(20):
        # Odd sizes: partial tiles are zero-padded; tiles of very different magnitudes.
        x = (rng.standard_normal((130, 200)) * 10.0 ** rng.integers(-3, 4, size=(130, 1))).astype(np.float32)
        for q, axis, block in ((q1, 1, (1, 128)), (q1, 0, (128, 1)), (q2, 0, (128, 128)), (q2, 1, (128, 128))):
            tensor, _ = q.quantize_2d(jnp.asarray(x), axis)
            assert tensor.block == block
            data, scale_inv = ref_block(x, block, "e4m3")
            deq = np.asarray(tensor.dequantize())
            np.testing.assert_array_equal(np.asarray(tensor.data)[:130, :200].view(np.uint8), data.view(np.uint8),
                                          err_msg=f"step {i} {block}")
            np.testing.assert_array_equal(deq, (data.astype(np.float32) * scale_inv), err_msg=f"step {i} {block}")


# ------------------------------------------------------------------------------------------------
# dense against the fp64 reference of the quantized math
# ------------------------------------------------------------------------------------------------


def _quantizer_set(name):
    r = RECIPES[name]()
    if name != "delayed":
        return r, QuantizerFactory.create_set(fp8_recipe=r)
    # A state from earlier steps: scales other than 1, a history that is not all zeros.
    meta = {t: (jnp.asarray([s], jnp.float32), jnp.asarray([0.0, 3.0, 0.5, 2.0], jnp.float32))
            for t, s in (("x", 37.5), ("kernel", 1200.0), ("grad", 2.0e7))}
    return r, QuantizerFactory.create_set(fp8_recipe=r, quantize_meta_set=meta)


def _ref_operands(name, qset, x2, w2, g2):
    """Reference fp64 dequantized operands: (x for fprop, w, g for dgrad, x for wgrad, g for wgrad)."""
    if name == "block":
        xr = dequant(*ref_block(x2, (1, 128), "e4m3"))
        xc = dequant(*ref_block(x2, (128, 1), "e4m3"))
        wq = dequant(*ref_block(w2, (128, 128), "e4m3"))
        gr = dequant(*ref_block(g2, (1, 128), "e4m3"))
        gc = dequant(*ref_block(g2, (128, 1), "e4m3"))
        return xr, wq, gr, xc, gc
    if name == "delayed":
        scales = {t: np.asarray(getattr(qset, t).scale)[0] for t in ("x", "kernel", "dgrad")}
    else:
        scales = {"x": ref_current_scale(np.abs(x2).max(), 448.0), "kernel": ref_current_scale(np.abs(w2).max(), 448.0),
                  "dgrad": ref_current_scale(np.abs(g2).max(), 57344.0)}
    fmts = {"x": "e4m3", "kernel": "e4m3", "dgrad": "e5m2"}
    deq = {t: dequant(ref_cast(v, scales[t], fmts[t]), np.float32(1) / np.float32(scales[t]))
           for t, v in (("x", x2), ("kernel", w2), ("dgrad", g2))}
    return deq["x"], deq["kernel"], deq["dgrad"], deq["x"], deq["dgrad"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_dense_forward_and_gradients_match_fp64_reference(name):
    x, w, bias, dy = inputs(3)
    r, qset = _quantizer_set(name)
    out, vjp = jax.vjp(lambda x, w, b, q: dense(x, w, b, quantizer_set=q), jnp.asarray(x), jnp.asarray(w),
                       jnp.asarray(bias), qset)
    dx, dw, db, dq = vjp(jnp.asarray(dy))
    x2, g2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    xr, wq, gr, xc, gc = _ref_operands(name, qset, x2, w, g2)
    assert out.shape == (3, 7, 136) and out.dtype == jnp.float32
    assert_gemm_close(np.asarray(out).reshape(-1, 136) - bias, xr, wq)
    assert_gemm_close(np.asarray(dx).reshape(-1, x.shape[-1]), gr, wq.T)
    assert_gemm_close(np.asarray(dw), xc.T, gc)
    np.testing.assert_allclose(np.asarray(db), g2.astype(np.float64).sum(0), rtol=1e-6, atol=1e-9)
    if name == "delayed":
        # The quantizer set's cotangent is its next state (history [0.0, 3.0, 0.5, 2.0] with this amax in row 0).
        for t, a, fmax in (("x", np.abs(x).max(), 448.0), ("kernel", np.abs(w).max(), 448.0),
                           ("dgrad", np.abs(dy).max(), 57344.0)):
            nxt = getattr(dq, t)
            np.testing.assert_array_equal(np.asarray(nxt.amax_history), np.float32([0.0, 0.5, 2.0, a]))
            np.testing.assert_array_equal(np.asarray(nxt.scale), np.float32([fmax / max(a, 3.0)]))
    # Sanity: the FP8 result is the real product to FP8 accuracy, not something else.
    np.testing.assert_allclose(np.asarray(out), x @ w + bias, atol=0.15 * np.abs(x @ w).max())


def test_dense_accepts_several_contracted_dims_and_bfloat16():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 5, 4, 40)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 40, 16)) * 0.05, jnp.float32)
    qset = QuantizerFactory.create_set(fp8_recipe=recipe.Float8CurrentScaling())
    out = dense(x, w, contracting_dims=((2, 3), (0, 1)), quantizer_set=qset)
    assert out.shape == (2, 5, 16) and out.dtype == jnp.bfloat16
    flat = dense(x.reshape(10, 160), w.reshape(160, 16), quantizer_set=qset)
    np.testing.assert_array_equal(np.asarray(out.reshape(10, 16), np.float32), np.asarray(flat, np.float32))
    grads = jax.grad(lambda x, w: dense(x, w, contracting_dims=((2, 3), (0, 1)), quantizer_set=qset)
                     .astype(jnp.float32).sum(), argnums=(0, 1))(x, w)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32


@pytest.mark.parametrize("name", list(RECIPES))
def test_dense_training_steps_are_bitwise_repeatable(name):
    r = RECIPES[name]()
    model = FP8Dense(features=136, fp8_recipe=r)
    x, _, _, dy = inputs(5)

    def run():
        variables = model.init(jax.random.PRNGKey(1), jnp.asarray(x))

        # A new function object each run: a separate trace and compile.
        @jax.jit
        def step(variables):
            grads = jax.grad(lambda v: jnp.sum(model.apply(v, jnp.asarray(x)) * dy))(variables)
            new = dict(variables, params=jax.tree_util.tree_map(lambda p, g: p - 1e-2 * g, variables["params"],
                                                                grads["params"]))
            if "fp8_metas" in grads:
                new["fp8_metas"] = grads["fp8_metas"]
            return new

        for _ in range(3):
            variables = step(variables)
        return jax.tree_util.tree_leaves(variables)

    first, second = run(), run()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------------
# autocast, the Flax state, refusals
# ------------------------------------------------------------------------------------------------


def test_autocast_recipe_reaches_generate_quantizer_set_and_off_is_plain():
    model = FP8Dense(features=8)  # fp8_recipe None: the autocast's
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 16)), jnp.float32)
    variables = model.init(jax.random.PRNGKey(0), x)
    assert "fp8_metas" not in variables
    plain = model.apply(variables, x)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(x @ variables["params"]["kernel"]))
    with autocast(enabled=True, recipe=recipe.DelayedScaling(amax_history_len=16)):
        fp8_vars = model.init(jax.random.PRNGKey(0), x)
        assert fp8_vars["fp8_metas"]["x_amax_history"].shape == (16,)
        assert fp8_vars["fp8_metas"]["grad_scale"].shape == (1,)
        quantized = model.apply(fp8_vars, x)
        with autocast(enabled=False):  # nested off: no quantization
            np.testing.assert_array_equal(np.asarray(model.apply(variables, x)), np.asarray(plain))
    assert not np.array_equal(np.asarray(quantized), np.asarray(plain))
    with autocast(enabled=True, recipe=recipe.Float8CurrentScaling()):
        assert "fp8_metas" not in model.init(jax.random.PRNGKey(0), x)  # no state
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated"):
        with fp8_autocast(enabled=True, fp8_recipe=recipe.Float8BlockScaling()):
            np.testing.assert_allclose(np.asarray(model.apply(variables, x)), np.asarray(plain), atol=0.1)


def test_generate_quantizer_set_collection_postfix_and_checkpoint_name():
    class TwoGemms(TransformerEngineBase):
        @nn.compact
        def __call__(self, x):
            k = self.param("k", nn.initializers.ones, (x.shape[-1], x.shape[-1]))
            r = recipe.DelayedScaling(amax_history_len=8)
            qs0 = self.generate_quantizer_set("_0", "my_fp8", "quantization", r)
            qs1 = self.generate_quantizer_set(postfix="_1", variable_collection="my_fp8", fp8_recipe=r)
            assert qs0.x.checkpoint_name == "quantization" and qs1.x.checkpoint_name is None
            return dense(dense(x, k, quantizer_set=qs0), k, quantizer_set=qs1)

    variables = TwoGemms().init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
    assert sorted(variables["my_fp8"]) == sorted(f"{t}_{i}_{v}" for t in ("x", "kernel", "grad") for i in (0, 1)
                                                 for v in ("scale", "amax_history"))


@pytest.mark.parametrize("bad", [recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling])
def test_blackwell_recipes_are_refused_by_name(bad):
    with pytest.raises(NotImplementedError, match=f"{bad.__name__}.*Blackwell"):
        with autocast(enabled=True, recipe=bad()):
            pass
    with pytest.raises(NotImplementedError, match="Blackwell"):
        QuantizerFactory.create_set(fp8_recipe=bad())
    available, reason = is_fp8_available(bad())
    assert not available and "Blackwell" in reason
    assert is_fp8_available(recipe.DelayedScaling()) == (True, "")  # CPU: the quantized math runs


def test_unsupported_options_are_refused():
    with pytest.raises(NotImplementedError, match="scaling_factor_compute_algo"):
        QuantizerFactory.create_set(fp8_recipe=recipe.DelayedScaling(scaling_factor_compute_algo=lambda *a: a[1]))
    with pytest.raises(NotImplementedError, match="n_groups"):
        QuantizerFactory.create_set(fp8_recipe=recipe.Float8CurrentScaling(), n_groups=4)
    qset = QuantizerFactory.create_set(fp8_recipe=recipe.Float8CurrentScaling())
    x, w = jnp.ones((4, 8)), jnp.ones((8, 4))
    with pytest.raises(NotImplementedError, match="collective_op_set"):
        dense(x, w, quantizer_set=qset, collective_op_set=CollectiveOpSet.create(CollectiveOp.ALL_GATHER))
    with pytest.raises(NotImplementedError, match="NN layout"):
        dense(x, w.T, contracting_dims=((1,), (1,)), quantizer_set=qset)
    with pytest.raises(ValueError, match="contracted sizes must match"):
        dense(x, jnp.ones((6, 4)), quantizer_set=qset)
    assert CollectiveOpSet.create(CollectiveOp.ALL_GATHER).backward is CollectiveOp.REDUCE_SCATTER
    np.testing.assert_array_equal(np.asarray(dense(x, w, quantizer_set=noop_quantizer_set)), np.asarray(x @ w))
    assert isinstance(qset.x, CurrentScaleQuantizer) and not isinstance(qset.x, DelayedScaleQuantizer)


def _hopper_or_newer():
    device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda"):
        return False
    major, minor = (int(p) for p in str(device.compute_capability).split(".")[:2])
    return (major, minor) >= (9, 0)


@pytest.mark.skipif(not _hopper_or_newer(), reason="FP8 GEMM lowering is checked on Hopper or newer CUDA GPUs")
@pytest.mark.parametrize("name", ["delayed", "current"])
def test_fp8_dots_lower_to_cublaslt_fp8_gemms_on_gpu(name):
    """The three GEMMs of the per-tensor recipes are cuBLASLt FP8 GEMMs in XLA's optimized program (no
    upcast dot). Block scaling is one float32 dot over the dequantized operands (XLA has no 1x128 /
    128x128 block-scaled FP8 GEMM), as PyTorch computes it where torch has none."""
    _, qset = _quantizer_set(name)
    x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 256), jnp.bfloat16)

    def step(x, w, q):
        out, vjp = jax.vjp(lambda x, w: dense(x, w, quantizer_set=q), x, w)
        return out, vjp(jnp.ones_like(out))

    hlo = jax.jit(step).lower(x, w, qset).compile().as_text()
    assert hlo.count("__cublas$lt$matmul$f8") >= 3, hlo[-4000:]


@pytest.mark.parametrize("name,split", [("delayed", (False, True, True)), ("current", (False, True, True)),
                                        ("block", (True, True, True))])
def test_gemm_accumulation_follows_the_recipe(name, split):
    """TransformerEngine's defaults: fast FP8 accumulation only in the per-tensor recipes' forward
    GEMM. XLA reads it from the dot's precision (DEFAULT: fast accumulation on cuBLASLt)."""
    _, qset = _quantizer_set(name)
    assert qset.split_accumulator == split
    x, w = jnp.ones((4, 8)), jnp.ones((8, 16))

    def step(x, w):
        out, vjp = jax.vjp(lambda x, w: dense(x, w, quantizer_set=qset), x, w)
        return out, vjp(jnp.ones_like(out))

    text = jax.jit(step).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 3
    assert [("HIGHEST" in line) for line in dots] == list(split), dots
