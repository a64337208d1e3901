"""JAX's batch-invariant mode (transformer_engine.jax.batch_invariance) under Triton's interpreter: ``dense`` and
the Flax norms give a row the same output and input-gradient bits for any row count M, their parameter gradients
are deterministic, they agree with plain float64 math to the dtype's rounding, the mode switches by the context
and by NVTE_BATCH_INVARIANT, and FP8 is refused by name."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch", reason="Triton's interpreter reads torch CPU tensors")
ON_GPU = jax.devices()[0].platform == "gpu"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not ON_GPU,
                                reason="the batch-invariant kernels run on a CUDA GPU or under TRITON_INTERPRET=1")

from transformer_engine.jax import batch_invariant, is_batch_invariant  # noqa: E402
from transformer_engine.jax.dense import dense  # noqa: E402
from transformer_engine.jax.flax.module import layernorm  # noqa: E402

K, N = 48, 40
ROWS = (1, 7, 64, 300)
TOL = {"float32": 1e-5, "float16": 2e-3}


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    monkeypatch.setenv("NVTE_JAX_TRITON_INTERPRET", "1")
    monkeypatch.delenv("NVTE_BATCH_INVARIANT", raising=False)


def _rand(shape, seed, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def _dense_grads(x, kernel, bias, dy):
    def loss(x, kernel, bias):
        out = dense(x, kernel, bias)
        return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

    with batch_invariant():
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, kernel, bias)
    return out, grads


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dense_rows_equal_for_any_row_count(dtype):
    rows = max(ROWS)
    x, dy = _rand((rows, K), 0, dtype), _rand((rows, N), 1, dtype)
    kernel, bias = _rand((K, N), 2, dtype) * 0.2, _rand((N,), 3, dtype)
    full, (dx_full, dw_full, db_full) = _dense_grads(x, kernel, bias, dy)
    for m in ROWS[:-1]:
        out, (dx, _, _) = _dense_grads(x[:m], kernel, bias, dy[:m])
        np.testing.assert_array_equal(np.asarray(out), np.asarray(full[:m]), err_msg=f"M={m}")
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_full[:m]), err_msg=f"M={m}")
    # The last row alone (a row at the end of a partial tile in the batch).
    out, (dx, _, _) = _dense_grads(x[-1:], kernel, bias, dy[-1:])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(full[-1:]))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_full[-1:]))
    # Against float64 math, and bitwise twice.
    x64, k64, dy64 = (np.asarray(a, np.float64) for a in (x, kernel, dy))
    want = {"out": x64 @ k64 + np.asarray(bias, np.float64), "dx": dy64 @ k64.T, "dw": x64.T @ dy64,
            "db": dy64.sum(0)}
    got = {"out": full, "dx": dx_full, "dw": dw_full, "db": db_full}
    for name, ref in want.items():
        err = np.abs(np.asarray(got[name], np.float64) - ref).max() / max(1.0, np.abs(ref).max())
        assert err <= TOL[dtype], (name, err)
    again, grads = _dense_grads(x, kernel, bias, dy)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(full))
    for a, b in zip(grads, (dx_full, dw_full, db_full)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _norm_grads(x, scale, ln_bias, norm_type, zero_centered, dy):
    def loss(x, scale, ln_bias):
        out = layernorm(x, scale, ln_bias, norm_type, zero_centered, 1e-5)
        return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

    with batch_invariant():
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, scale, ln_bias)
    return out, grads


def _norm_ref(x, scale, ln_bias, norm_type, zero_centered):
    x = np.asarray(x, np.float64)
    gamma = np.asarray(scale, np.float64) + (1.0 if zero_centered else 0.0)
    c = x - x.mean(-1, keepdims=True) if norm_type == "layernorm" else x
    y = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * gamma
    return y + np.asarray(ln_bias, np.float64) if norm_type == "layernorm" else y


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("norm_type,zero_centered", [("layernorm", False), ("rmsnorm", True)])
def test_norm_rows_equal_for_any_row_count(dtype, norm_type, zero_centered):
    rows, hidden = max(ROWS), 40
    x, dy = _rand((rows, hidden), 4, dtype) * 2 + 0.5, _rand((rows, hidden), 5, dtype)
    scale, ln_bias = _rand((hidden,), 6, dtype) * 0.1 + (0.0 if zero_centered else 1.0), _rand((hidden,), 7, dtype)
    full, (dx_full, dw_full, db_full) = _norm_grads(x, scale, ln_bias, norm_type, zero_centered, dy)
    for m in ROWS[:-1]:
        out, (dx, _, _) = _norm_grads(x[:m], scale, ln_bias, norm_type, zero_centered, dy[:m])
        np.testing.assert_array_equal(np.asarray(out), np.asarray(full[:m]), err_msg=f"M={m}")
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_full[:m]), err_msg=f"M={m}")
    ref = _norm_ref(x, scale, ln_bias, norm_type, zero_centered)
    err = np.abs(np.asarray(full, np.float64) - ref).max() / max(1.0, np.abs(ref).max())
    assert err <= TOL[dtype], err
    # Gradients against the default (XLA) path's autodiff, to rounding.
    def loss(x, scale, ln_bias):
        out = layernorm(x.astype(jnp.float32), scale.astype(jnp.float32), ln_bias.astype(jnp.float32), norm_type,
                        zero_centered, 1e-5)
        return jnp.sum(out * dy.astype(jnp.float32))

    want = jax.grad(loss, argnums=(0, 1, 2))(x, scale, ln_bias)
    names = ("dx", "dscale", "dln_bias") if norm_type == "layernorm" else ("dx", "dscale")
    for name, got, ref in zip(names, (dx_full, dw_full, db_full), want):
        ref = np.asarray(ref, np.float64)
        err = np.abs(np.asarray(got, np.float64) - ref).max() / max(1.0, np.abs(ref).max())
        assert err <= 4 * TOL[dtype], (name, err)


def test_gradients_keep_the_parameters_dtypes():
    """float16 activations with float32 parameters: each gradient in its primal's dtype."""
    x, dy = _rand((5, K), 14, "float16"), _rand((5, N), 15, "float16")
    kernel, bias = _rand((K, N), 16, "float32") * 0.2, _rand((N,), 17, "float32")
    out, (dx, dw, db) = _dense_grads(x, kernel, bias, dy)
    assert (out.dtype, dx.dtype, dw.dtype, db.dtype) == (jnp.float16, jnp.float16, jnp.float32, jnp.float32)
    np.testing.assert_allclose(np.asarray(db), np.asarray(dy, np.float64).sum(0), rtol=1e-3, atol=1e-3)
    scale, ln_bias = _rand((K,), 18, "float16"), _rand((K,), 19, "float32")
    _, grads = _norm_grads(x, scale, ln_bias, "layernorm", False, _rand((5, K), 20, "float16"))
    assert tuple(g.dtype for g in grads) == (jnp.float16, jnp.float16, jnp.float32)


def test_mode_switch_context_and_environment(monkeypatch):
    assert not is_batch_invariant()
    with batch_invariant():
        assert is_batch_invariant()
        with batch_invariant(False):
            assert not is_batch_invariant()
    monkeypatch.setenv("NVTE_BATCH_INVARIANT", "1")
    assert is_batch_invariant()
    x, kernel = _rand((3, K), 8, "float32"), _rand((K, N), 9, "float32")
    text = jax.jit(lambda x, k: dense(x, k)).lower(x, kernel).as_text()
    assert "dot_general" not in text  # the kernels (a host callback here), not XLA's dot
    with batch_invariant(False):
        text = jax.jit(lambda x, k: dense(x, k)).lower(x, kernel).as_text()
    assert "dot_general" in text
    with pytest.raises(ValueError, match="`enabled` must be a bool"):
        with batch_invariant(1):
            pass


def test_fp8_dense_is_refused_in_the_mode():
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.jax.quantize import QuantizerFactory

    qset = QuantizerFactory.create_set(fp8_recipe=DelayedScaling())
    x, kernel = _rand((4, 32), 10, "float32"), _rand((32, 32), 11, "float32")
    with batch_invariant(), pytest.raises(NotImplementedError, match="FP8 GEMMs in batch-invariant mode"):
        dense(x, kernel, quantizer_set=qset)


@pytest.mark.skipif(ON_GPU, reason="the CPU lowering's refusal")
def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("NVTE_JAX_TRITON_INTERPRET", "0")
    x, kernel = _rand((2, K), 12, "float32"), _rand((K, N), 13, "float32")
    with batch_invariant(), pytest.raises(NotImplementedError, match="NVTE_JAX_TRITON_INTERPRET=1"):
        jax.jit(lambda x, k: dense(x, k))(x, kernel)


def test_determinism_check_reports_whole_model_batch_invariance(monkeypatch):
    import io

    from transformer_engine.jax import determinism_check as check

    args = check._parser().parse_args(["--batch-invariant", "--steps", "1", "--seq-len", "8", "--batch-size", "3",
                                       "--hidden-size", "32", "--num-heads", "2", "--gqa-groups", "1", "--layers",
                                       "1", "--no-reference", "--quiet"] + ([] if ON_GPU else ["--fused-interpreter"]))
    result = check.run_check(args, out=io.StringIO(), err=io.StringIO())
    probe = result.extra["batch_invariance"]
    assert probe == {"sequences": 3, "sequences_differing_alone": 0, "bitwise": True}, probe
    assert result.exit_status == 0 and "Whole-model batch invariance" in result.message
    assert result.to_json()["batch_invariance"] == probe
    if ON_GPU:
        return
    args = check._parser().parse_args(["--batch-invariant", "--steps", "1", "--no-reference", "--quiet",
                                       "--device", "cpu"])
    with pytest.raises(ValueError, match="--batch-invariant"):
        check.run_check(args, out=io.StringIO(), err=io.StringIO())


def test_grouped_dense_is_refused_in_the_mode():
    """JAX grouped_dense runs XLA's dots (not the batch-invariant GEMM): refused in the mode, by name."""
    from transformer_engine.jax.grouped_dense import grouped_dense

    x, kernel = _rand((4, 8), 21, "float32"), _rand((2, 8, 8), 22, "float32")
    with batch_invariant(), pytest.raises(NotImplementedError, match="grouped_dense in batch-invariant mode"):
        grouped_dense(x, kernel, jnp.asarray([2, 2], jnp.int32), contracting_dims=((1,), (1,)))
