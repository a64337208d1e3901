"""transformer_engine.common.quantization (the FP8 scaling math) against a plain float64 re-computation of
TransformerEngine's formulas, written out element by element, over numpy float32 arrays."""

import math

import numpy as np
import pytest

from transformer_engine.common import quantization as q
from transformer_engine.common import recipe

F32_MAX = float(np.finfo(np.float32).max)


def _ref_delayed_step(history, scale, fmt_max, margin, algo):
    """TransformerEngine's delayed-scaling update, one tensor column at a time, in float64."""
    length, n = len(history), len(history[0])
    new_scale = []
    for j in range(n):
        column = [history[i][j] for i in range(length)]
        amax = max(column) if algo == "max" else column[0]
        if math.isfinite(amax) and amax > 0:
            s = (fmt_max / amax) / 2.0 ** margin
            s = F32_MAX if s > F32_MAX else s
        else:
            s = scale[j]
        new_scale.append(s)
    # roll by -1 (the newest row moves to the end, row 1 becomes row 0), then clear row 0
    rolled = [list(history[(i + 1) % length]) for i in range(length)]
    rolled[0] = [0.0] * n
    return rolled, new_scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length,margin", [(1, 0), (4, 0), (7, 2)])
def test_delayed_update_equals_te_formula_in_fp64_over_20_steps(algo, length, margin):
    rng = np.random.default_rng(length * 10 + margin)
    n, fmt_max = 3, q.fp8_max("e4m3")
    history = np.zeros((length, n), np.float32)
    scale = np.ones(n, np.float32)
    ref_hist = [[0.0] * n for _ in range(length)]
    ref_scale = [1.0] * n
    for step in range(20):
        # this step's amaxes, including a zero (scale kept) and, once, an infinity (scale kept)
        amax = rng.uniform(0.01, 50.0, n).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 3))
        amax[step % n] = 0.0 if step % 5 == 0 else amax[step % n]
        if step == 11:
            amax[1] = np.inf
        history[0] = np.maximum(history[0], amax)
        for j in range(n):
            ref_hist[0][j] = max(ref_hist[0][j], float(amax[j]))
        history, scale = q.delayed_update(np, history, scale, fmt_max, margin, algo)
        ref_hist, ref_scale = _ref_delayed_step(ref_hist, ref_scale, fmt_max, margin, algo)
        # float64 results rounded once to float32: the float32 computation must be exactly that
        np.testing.assert_array_equal(history, np.array(ref_hist, np.float32))
        np.testing.assert_array_equal(scale, np.array(ref_scale, np.float64).astype(np.float32))
        assert history.dtype == np.float32 and scale.dtype == np.float32


def test_delayed_update_takes_a_custom_scaling_factor_algo():
    history = np.array([[2.0, 4.0], [8.0, 1.0]], np.float32)
    calls = []

    def sf(amax, scale, fmt_max, rec):
        calls.append((amax.copy(), rec))
        return scale * 2

    new_hist, new_scale = q.delayed_update(np, history, np.ones(2, np.float32), 448.0, 0, "max", sf, "R")
    np.testing.assert_array_equal(calls[0][0], [8.0, 4.0])
    assert calls[0][1] == "R"
    np.testing.assert_array_equal(new_scale, [2.0, 2.0])
    np.testing.assert_array_equal(new_hist, [[0.0, 0.0], [2.0, 4.0]])


def _ref_current_scale(amax, fmt_max, eps, pow2):
    amax = max(amax, float(np.float32(eps)))  # the epsilon is a float32 kernel argument in TransformerEngine
    if amax == 0 or math.isinf(amax):
        return 1.0
    s = fmt_max / amax
    s = F32_MAX if s > F32_MAX else s
    if pow2:
        s = 2.0 ** math.floor(math.log2(float(np.float32(s))))
    return s


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_current_scale_equals_te_formula_in_fp64(fmt, eps, pow2):
    rng = np.random.default_rng(3)
    amaxes = np.concatenate([rng.uniform(0, 1, 30) * 10.0 ** rng.integers(-8, 8, 30),
                             [0.0, np.inf, 1e-40, 3e38, 1e-4]]).astype(np.float32)
    with np.errstate(over="ignore"):  # 448 / 1e-40 overflows to inf, which the formula clips
        got = q.scale_from_current_amax(np, amaxes, q.fp8_max(fmt), eps, pow2)
    want = np.array([_ref_current_scale(float(a), q.fp8_max(fmt), eps, pow2) for a in amaxes]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_power_of_two_floor_is_exact():
    values = np.array([1.0, 1.5, 0.75, 3.0e-39, 448.0 / 3.0, 2.0 ** 100], np.float32)
    np.testing.assert_array_equal(q.power_of_two_floor(np, values),
                                  [1.0, 1.0, 0.5, 2.0 ** -128, 128.0, 2.0 ** 100])


def test_formats_follow_the_recipe_format():
    assert q.format_dtypes(recipe.Format.HYBRID) == ("e4m3", "e5m2")
    assert q.format_dtypes(recipe.Format.E4M3) == ("e4m3", "e4m3")
    assert q.format_dtypes("E5M2") == ("e5m2", "e5m2")
    assert recipe.Format.HYBRID.value.max_fwd == q.fp8_max("e4m3")
    assert recipe.Format.HYBRID.value.max_bwd == q.fp8_max("e5m2")
    with pytest.raises(ValueError, match="fp8_format"):
        q.format_dtypes("E3M4")


def test_recipes_take_transformer_engine_2x_fields():
    d = recipe.DelayedScaling(margin=1, fp8_format=recipe.Format.E4M3, amax_history_len=16,
                              amax_compute_algo="most_recent", reduce_amax=False, fp8_dpa=True, fp8_mha=True)
    assert (d.margin, d.amax_history_len, d.reduce_amax, d.fp8_dpa, d.fp8_mha) == (1, 16, False, True, True)
    assert d.delayed() and d.float8_per_tensor_scaling() and not d.float8_block_scaling()
    # Megatron-core hands DelayedScaling its module kwargs, which TransformerEngine's dataclass drops
    assert recipe.DelayedScaling(params_dtype=None, device="cpu").amax_history_len == 1024
    c = recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID, fp8_dpa=True)
    assert c.fp8_quant_fwd_inp == recipe.QParams() and c.fp8_gemm_fprop.use_split_accumulator is False
    b = recipe.Float8BlockScaling()
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert b.fp8_quant_fwd_weight.power_2_scale and b.fp8_format is recipe.Format.E4M3
    with pytest.raises(ValueError, match="fp8_format"):
        recipe.DelayedScaling(fp8_format=recipe.Format.E5M2)
    with pytest.raises(NotImplementedError, match="fp8_dpa"):
        recipe.Float8BlockScaling(fp8_dpa=True)
    for margin in (-10, -0.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="`margin` must be a non-negative number"):
            recipe.DelayedScaling(margin=margin)
    assert recipe.DelayedScaling(margin=2).margin == 2
    with pytest.raises(ValueError, match="at most one"):
        recipe.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=2)
    with pytest.raises(TypeError, match="unexpected"):
        recipe.Float8CurrentScaling(margin=1)
    with pytest.raises(NotImplementedError, match="override_linear_precision"):
        recipe.DelayedScaling(override_linear_precision=(False, False, True))
