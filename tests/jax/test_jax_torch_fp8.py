"""The same FP8 math in both frameworks: PyTorch's ``Linear`` and JAX's ``dense`` with the same weights,
inputs, output gradients and recipe over 20 steps.

Both read the recipe through ``common.quantizer_roles`` and take the delayed-scaling update once per
step (PyTorch at autocast exit and after the backward, JAX in the state that leaves the step), so the
recipe state (amax histories and scales of input, weight and grad_output) must be bitwise equal after
every step, and so must every quantized operand; the GEMMs (torch's and XLA's float32 accumulation)
may differ by float32 rounding: outputs and gradients are compared to a bound of a few float32 ulps of
the result's scale (the measured maximum is printed). Block scaling is one float32 GEMM over the
dequantized operands in both.

Each step draws new values of a different magnitude (the delayed scales lag them: some steps
saturate), with a contraction of 160 (two 128-tiles, the second partial) and 24 tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe  # noqa: E402
from transformer_engine.jax.dense import dense  # noqa: E402
from transformer_engine.jax.quantize import QuantizerFactory  # noqa: E402
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # noqa: E402

TOKENS, IN, OUT, STEPS, HIST = 24, 160, 40, 20, 8
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=HIST, margin=1),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
# Relative to the largest |value| of the compared tensor: float32 GEMMs of 160 exact products.
BOUND = 16 * np.finfo(np.float32).eps


def _torch_step(lin, r, x, w, dy):
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    lin.weight.grad = None
    xt = torch.from_numpy(x).requires_grad_(True)
    with te.autocast(enabled=True, recipe=r):
        y = lin(xt)
    y.backward(torch.from_numpy(dy))
    return y.detach().numpy(), xt.grad.numpy(), lin.weight.grad.numpy()


def _torch_state(lin):
    """{role: (scale [1], amax_history [HIST])} of the Linear's delayed-scaling metas."""
    st = lin._fp8_state
    f, b = st.fwd_meta, st.bwd_meta
    return {"x": (f.scale[0:1].numpy(), f.amax_history[:, 0].numpy()),
            "kernel": (f.scale[1:2].numpy(), f.amax_history[:, 1].numpy()),
            "grad": (b.scale[0:1].numpy(), b.amax_history[:, 0].numpy())}


@jax.jit
def _jax_step(x, k, qset, dy):
    out, vjp = jax.vjp(lambda x, k, q: dense(x, k, quantizer_set=q), x, k, qset)
    dx, dk, next_q = vjp(dy)
    return out, dx, dk, next_q


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_and_dense_same_state_bitwise_and_outputs_to_float32_rounding(name):
    FP8GlobalStateManager.reset()
    r = RECIPES[name]()
    torch.manual_seed(0)
    lin = te.Linear(IN, OUT, bias=False, params_dtype=torch.float32, device="cpu")
    rng = np.random.default_rng(7)
    meta = None  # JAX's delayed-scaling state, carried as the quantizer set's successor
    worst = {"out": 0.0, "dgrad": 0.0, "wgrad": 0.0}
    for step in range(STEPS):
        x = (rng.standard_normal((TOKENS, IN)) * 2.0 ** (step % 5 - 2)).astype(np.float32)
        w = (rng.standard_normal((OUT, IN)) * 0.1 * 2.0 ** (step % 3)).astype(np.float32)
        dy = (rng.standard_normal((TOKENS, OUT)) * 10.0 ** (step % 4 - 2)).astype(np.float32)
        if step == 6:
            x[3, 100] = 300.0  # one outlier: a lagging delayed scale saturates it

        ty, tdx, tdw = _torch_step(lin, r, x, w, dy)

        qset = QuantizerFactory.create_set(fp8_recipe=r, quantize_meta_set=meta or {})
        jy, jdx, jdk, next_q = _jax_step(jnp.asarray(x), jnp.asarray(w.T), qset, jnp.asarray(dy))
        for key, t, j in (("out", ty, jy), ("dgrad", tdx, jdx), ("wgrad", tdw, np.asarray(jdk).T)):
            j = np.asarray(j)
            assert t.shape == j.shape and t.dtype == j.dtype == np.float32
            rel = float(np.max(np.abs(t - j)) / np.max(np.abs(j)))
            worst[key] = max(worst[key], rel)
            assert rel <= BOUND, f"{name} step {step} {key}: {rel:.3g} of scale"

        if r.delayed():
            meta = {"x": (next_q.x.scale, next_q.x.amax_history),
                    "kernel": (next_q.kernel.scale, next_q.kernel.amax_history),
                    "grad": (next_q.dgrad.scale, next_q.dgrad.amax_history)}
            for role, (t_scale, t_hist) in _torch_state(lin).items():
                np.testing.assert_array_equal(np.asarray(meta[role][0]), t_scale, err_msg=f"step {step} {role} scale")
                np.testing.assert_array_equal(np.asarray(meta[role][1]), t_hist,
                                              err_msg=f"step {step} {role} amax_history")
            assert step < HIST - 1 or np.all(np.asarray(meta["x"][1])[1:] > 0)  # rolled: row 0 cleared
        else:
            assert lin._fp8_state.fwd_meta is None and not jax.tree_util.tree_leaves(next_q)  # no state
    print(f"{name}: max |torch - jax| / max |jax| over {STEPS} steps: "
          + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))


def test_quantized_operands_are_bitwise_equal():
    """The operands the GEMMs multiply: the same FP8 bits and inverse scales in both frameworks, per role."""
    from transformer_engine.common import quantizer_roles as roles
    from transformer_engine.pytorch.quantization import Quantizer

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((TOKENS, IN)) * 3).astype(np.float32)
    for name in ("current", "block"):
        r = RECIPES[name]()
        specs = roles.quantizers_for(r)
        qset = QuantizerFactory.create_set(fp8_recipe=r)
        for spec, jq in ((specs.input, qset.x), (specs.weight, qset.kernel), (specs.grad_output, qset.dgrad)):
            tq, t_second = Quantizer(spec).quantize(torch.from_numpy(x))
            jt = jq.quantize_2d(jnp.asarray(x), 1)[0]
            np.testing.assert_array_equal(np.asarray(jt.data[:TOKENS, :IN]).view(np.uint8),
                                          tq.data.view(torch.uint8).numpy(), err_msg=f"{name} {spec.role}")
            np.testing.assert_array_equal(np.asarray(jt.dequantize()), tq.dequantize().numpy(),
                                          err_msg=f"{name} {spec.role}")
            if t_second is not None:  # the wgrad layout: tiled along the tokens
                js = jq.quantize_2d(jnp.asarray(x), 0)[0]
                np.testing.assert_array_equal(np.asarray(js.dequantize()).T, t_second.dequantize().numpy())


def test_a_new_recipe_is_its_class_and_its_builder():
    """A recipe declared outside the package (its class and a builder registered with
    ``common.quantizer_roles``) runs through PyTorch's Linear and JAX's dense unchanged: bitwise the
    built-in recipe whose quantizers it builds (current scaling with power-of-two scales)."""
    import dataclasses

    from transformer_engine.common import quantizer_roles as roles

    class PowerOfTwoCurrentScaling(recipe.Recipe):
        _DEFAULTS = dict(fp8_format=recipe.Format.HYBRID, fp8_dpa=False, fp8_mha=False)

    @roles.register(PowerOfTwoCurrentScaling)
    def _build(r):
        base = roles.quantizers_for(recipe.Float8CurrentScaling(fp8_format=r.fp8_format))
        return dataclasses.replace(base, recipe=r, **{
            role: dataclasses.replace(getattr(base, role), power_2_scale=True)
            for role in ("input", "weight", "grad_output")})

    p2 = recipe.QParams(power_2_scale=True)
    builtin = recipe.Float8CurrentScaling(fp8_quant_fwd_inp=p2, fp8_quant_fwd_weight=p2, fp8_quant_bwd_grad=p2)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((TOKENS, IN)).astype(np.float32)
    w = (rng.standard_normal((OUT, IN)) * 0.1).astype(np.float32)
    dy = rng.standard_normal((TOKENS, OUT)).astype(np.float32)
    results = {}
    for key, r in (("new", PowerOfTwoCurrentScaling()), ("builtin", builtin)):
        FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        lin = te.Linear(IN, OUT, bias=False, params_dtype=torch.float32, device="cpu")
        qset = QuantizerFactory.create_set(fp8_recipe=r)
        results[key] = (_torch_step(lin, r, x, w, dy),
                        [np.asarray(a) for a in _jax_step(jnp.asarray(x), jnp.asarray(w.T), qset,
                                                          jnp.asarray(dy))[:3]])
    for t_new, t_builtin in zip(results["new"][0], results["builtin"][0]):
        np.testing.assert_array_equal(t_new, t_builtin)
    for j_new, j_builtin in zip(results["new"][1], results["builtin"][1]):
        np.testing.assert_array_equal(j_new, j_builtin)
    assert not np.array_equal(results["new"][0][0], _torch_step(
        te.Linear(IN, OUT, bias=False, params_dtype=torch.float32, device="cpu"), recipe.Float8CurrentScaling(),
        x, w, dy)[0])  # power-of-two scales change the result: the builder's specs are what ran
