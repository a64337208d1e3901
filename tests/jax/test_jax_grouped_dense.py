"""transformer_engine.jax.dense.grouped_dense (TE-JAX's grouped GEMM for MoE experts): forward and gradients
against a float64 numpy reference (uneven and empty groups, rows past the last group, with and without bias),
under jit with traced group sizes, bitwise run to run, equal to float32 rounding to PyTorch's GroupedLinear with
the same weights, and the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common import recipe
from transformer_engine.jax import grouped_dense as grouped_dense_module
from transformer_engine.jax.dense import grouped_dense
from transformer_engine.jax.quantize import QuantizerFactory, noop_quantizer_set

M, K, N = 16, 32, 24
SIZES = [(5, 0, 9, 2), (0, 16, 0, 0), (3, 3, 3, 3)]  # the last leaves 4 rows in no group


def _data(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(dtype)
    kernel = (rng.standard_normal((4, K, N)) * 0.2).astype(dtype)
    bias = rng.standard_normal((4, N)).astype(dtype)
    dy = rng.standard_normal((M, N)).astype(dtype)
    return x, kernel, bias, dy


def _reference(x, kernel, bias, dy, sizes):
    """float64 numpy: per group, y = x_g K_g + b_g; dx_g = dy_g K_g^T; dK_g = x_g^T dy_g; db_g = sum dy_g."""
    x, kernel, dy = x.astype(np.float64), kernel.astype(np.float64), dy.astype(np.float64)
    y, dx = np.zeros((M, N)), np.zeros((M, K))
    dk, db = np.zeros_like(kernel), np.zeros((4, N))
    start = 0
    for g, m in enumerate(sizes):
        rows = slice(start, start + m)
        y[rows] = x[rows] @ kernel[g] + (bias[g] if bias is not None else 0.0)
        dx[rows] = dy[rows] @ kernel[g].T
        dk[g] = x[rows].T @ dy[rows]
        db[g] = dy[rows].sum(axis=0)
        start += m
    return y, dx, dk, db


def _value_and_grads(use_bias, jit=True):
    def loss(x, kernel, bias, group_sizes, dy):
        y = grouped_dense(x, kernel, group_sizes, bias=bias)
        return jnp.sum(y * dy), y

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2) if use_bias else (0, 1), has_aux=True)
    # Under jit the group sizes are traced: one compilation serves every split (the boundaries are data).
    return jax.jit(fn) if jit else fn


def _run(fn, x, kernel, bias, dy, sizes):
    (_, y), grads = fn(jnp.asarray(x), jnp.asarray(kernel), None if bias is None else jnp.asarray(bias),
                       jnp.asarray(sizes, jnp.int32), jnp.asarray(dy))
    return [np.asarray(y)] + [np.asarray(g) for g in grads]


@pytest.mark.parametrize("tile", [128, 4, 3], ids=["one-tile", "tiles-4", "tiles-3-padded"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_against_float64_and_bitwise_run_to_run(use_bias, tile, monkeypatch):
    # Tiles of 4 and 3 rows: groups start and end inside tiles, tiles hold several groups (empty ones too), and
    # 16 rows in tiles of 3 leave a padded last tile.
    monkeypatch.setattr(grouped_dense_module, "TILE_ROWS", tile)
    x, kernel, bias, dy = _data()
    b = bias if use_bias else None
    fn = _value_and_grads(use_bias)
    for sizes in SIZES:  # uneven with an empty group; one group; rows left in no group
        got = _run(fn, x, kernel, b, dy, sizes)
        y, dx, dk, db = _reference(x, kernel, b, dy, sizes)
        want = [y, dx, dk] + ([db] if use_bias else [])
        for a, w in zip(got, want, strict=True):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
        for g, m in enumerate(sizes):
            if m == 0:  # an empty group: zero gradients
                assert not got[2][g].any() and (not use_bias or not got[3][g].any())
        if sum(sizes) < M:  # rows in no group: zero outputs and input gradients
            assert not got[0][sum(sizes):].any() and not got[1][sum(sizes):].any()
        for a, b2 in zip(got, _run(fn, x, kernel, b, dy, sizes), strict=True):
            np.testing.assert_array_equal(a, b2)
        if tile == 3 and use_bias:  # eager (concrete group sizes): the same computation
            for a, b2 in zip(got, _run(_value_and_grads(use_bias, jit=False), x, kernel, b, dy, sizes),
                             strict=True):
                np.testing.assert_allclose(a, b2, rtol=1e-6, atol=1e-6)


def test_bfloat16_and_preferred_element_type():
    x, kernel, _, _ = _data()
    xb, kb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(kernel, jnp.bfloat16)
    sizes = jnp.asarray(SIZES[0], jnp.int32)
    y = grouped_dense(xb, kb, sizes)
    assert y.dtype == jnp.bfloat16
    y32 = grouped_dense(xb, kb, sizes, preferred_element_type=jnp.float32)
    assert y32.dtype == jnp.float32
    ref = _reference(np.asarray(xb, np.float64), np.asarray(kb, np.float64), None, np.zeros((M, N)), SIZES[0])[0]
    np.testing.assert_allclose(np.asarray(y32), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2e-2, atol=2e-2)


def test_equals_pytorch_grouped_linear():
    torch = pytest.importorskip("torch")
    import transformer_engine.pytorch as te

    x, kernel, bias, dy = _data(seed=3)
    sizes = SIZES[0]
    got = _run(_value_and_grads(True), x, kernel, bias, dy, sizes)
    m = te.GroupedLinear(4, K, N, bias=True, params_dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for g in range(4):  # TE-JAX's kernel [G, K, N] is TE-PyTorch's weight_g [N, K] transposed
            getattr(m, f"weight{g}").copy_(torch.from_numpy(kernel[g].T.copy()))
            getattr(m, f"bias{g}").copy_(torch.from_numpy(bias[g]))
    xt = torch.from_numpy(x).requires_grad_()
    y = m(xt, list(sizes))
    y.backward(torch.from_numpy(dy))
    want = [y.detach().numpy(), xt.grad.numpy(),
            np.stack([getattr(m, f"weight{g}").grad.numpy().T for g in range(4)]),
            np.stack([getattr(m, f"bias{g}").grad.numpy() for g in range(4)])]
    diffs = []
    for a, w in zip(got, want, strict=True):
        scale = max(np.abs(w).max(), 1.0)
        diffs.append(float(np.abs(a - w).max() / scale))
    print("grouped_dense vs GroupedLinear, max |diff| / scale (y, dx, dkernel, dbias):", diffs)
    # Measured: 1.2e-7 (y), 3.1e-7 (dx), 0 (dkernel), 7.6e-8 (dbias): a few float32 ulps; the two frameworks run
    # their own GEMMs, so rounding, not bits, is what they share.
    assert max(diffs) < 8 * np.finfo(np.float32).eps, diffs


def test_refusals_and_checks():
    x, kernel, bias, _ = _data()
    xs, ks, sizes = jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(SIZES[0], jnp.int32)
    qs = QuantizerFactory.create_set(fp8_recipe=recipe.Float8CurrentScaling())
    assert not qs.is_noop
    with pytest.raises(NotImplementedError, match="quantizer_set"):
        grouped_dense(xs, ks, sizes, quantizer_set=qs)
    with pytest.raises(NotImplementedError, match="group_offset"):
        grouped_dense(xs, ks, sizes, group_offset=jnp.zeros(1, jnp.int32))
    with pytest.raises(NotImplementedError, match="contracting_dims"):
        grouped_dense(xs, ks, sizes, contracting_dims=((1,), (2,)))
    with pytest.raises(NotImplementedError, match="kernel_fsdp_info"):
        grouped_dense(xs, ks, sizes, kernel_fsdp_info=("fsdp", 1))
    with pytest.raises(ValueError, match="`group_sizes`"):
        grouped_dense(xs, ks, jnp.asarray([9, 9, 0, 0], jnp.int32))
    with pytest.raises(ValueError, match="`group_sizes`"):
        grouped_dense(xs, ks, jnp.asarray([5, -1, 9, 2], jnp.int32))
    with pytest.raises(ValueError, match="`group_sizes`"):
        grouped_dense(xs, ks, jnp.asarray([5, 9, 2], jnp.int32))
    with pytest.raises(ValueError, match="`bias`"):
        grouped_dense(xs, ks, sizes, bias=jnp.asarray(bias[:, :3]))
    with pytest.raises(ValueError, match="`kernel`"):
        grouped_dense(xs, ks[:, :3], sizes)
    assert grouped_dense(xs, ks, sizes, quantizer_set=noop_quantizer_set).shape == (M, N)
