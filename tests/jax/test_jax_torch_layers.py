"""The same layer in PyTorch and in JAX: LayerNormMLP (TE-PyTorch's and TE-JAX's parameter layouts, mapped onto
each other) for each activation family and both norms, and a TransformerLayer, give outputs and gradients equal
to float32 rounding (largest difference relative to the values' scale, measured: LayerNormMLP 4.8e-7,
TransformerLayer 5.5e-7, i.e. a few float32 ulps).

The two frameworks write the math once (transformer_engine/common/modules.py: the activation table; the norms in
float32) but run it on their own GEMMs and elementwise kernels, so they agree to rounding, not bitwise; the
largest difference measured is asserted against a bound of a few float32 ulps of the values' scale.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.jax.flax import LayerNormMLP as FlaxLayerNormMLP  # noqa: E402

HIDDEN, FFN, TOKENS = 32, 48, 10
EPS = 1e-5
# (TE-PyTorch activation, TE-JAX activations)
ACTIVATIONS = [("gelu", ("gelu",)), ("qgelu", ("quick_gelu",)), ("srelu", ("squared_relu",)),
               ("geglu", ("gelu", "linear")), ("swiglu", ("silu", "linear")), ("reglu", ("relu", "linear")),
               ("clamped_swiglu", ("clamped_silu", "clamped_linear"))]
CLAMP = {"limit": 0.75, "alpha": 1.702, "glu_linear_offset": 1.0}  # a limit the inputs cross


def _jax_layer(acts, normalization):
    return FlaxLayerNormMLP(intermediate_dim=FFN, activations=acts, use_bias=True, epsilon=EPS,
                            activation_params=CLAMP if "clamped_silu" in acts else None,
                            layernorm_type="rmsnorm" if normalization == "RMSNorm" else "layernorm")


def _torch_params_from(params, normalization):
    """TE-JAX's LayerNormMLP parameters as TE-PyTorch's: wi_kernel [H, n_acts, F] -> fc1_weight [n_acts * F, H]
    (the activated half first, the linear half second, as TE-PyTorch's gated FC1 splits its output)."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, dtype=np.float32), params)
    wi = p["wi_kernel"]
    out = {
        "layer_norm_weight": p["scale"],
        "fc1_weight": np.concatenate([wi[:, i, :].T for i in range(wi.shape[1])], axis=0),
        "fc1_bias": p["wi_bias"].reshape(-1),
        "fc2_weight": p["wo_kernel"].T,
        "fc2_bias": p["wo_bias"],
    }
    if normalization == "LayerNorm":
        out["layer_norm_bias"] = p["ln_bias"]
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in out.items()}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("torch_act,jax_acts", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
def test_layernorm_mlp_pytorch_equals_jax_to_float32_rounding(torch_act, jax_acts, normalization):
    layer = _jax_layer(jax_acts, normalization)
    x = np.random.default_rng(0).standard_normal((2, TOKENS // 2, HIDDEN)).astype(np.float32)
    dy = np.random.default_rng(1).standard_normal((2, TOKENS // 2, HIDDEN)).astype(np.float32)
    variables = layer.init(jax.random.PRNGKey(0), jnp.asarray(x), deterministic=True)
    # Non-trivial norm parameters and biases (they start at 1 and 0).
    rng = np.random.default_rng(2)
    params = jax.tree_util.tree_map(
        lambda a: jnp.asarray(np.asarray(a) + 0.1 * rng.standard_normal(a.shape).astype(np.float32)),
        nn.unbox(variables["params"]))

    def loss(params, x):
        out, _ = layer.apply({"params": params}, x, deterministic=True)
        return jnp.sum(out * dy), out

    (_, out_j), (grads_j, dx_j) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, jnp.asarray(x))

    mlp = te.LayerNormMLP(HIDDEN, FFN, eps=EPS, normalization=normalization, activation=torch_act,
                          activation_params=CLAMP if torch_act == "clamped_swiglu" else None,
                          params_dtype=torch.float32, device="cpu")
    tparams = _torch_params_from(params, normalization)
    with torch.no_grad():
        for name, value in tparams.items():
            getattr(mlp, name).copy_(value)
    xt = torch.from_numpy(x).requires_grad_()
    out_t = mlp(xt)
    out_t.backward(torch.from_numpy(dy))

    mapped_grads = _torch_params_from(grads_j, normalization)
    pairs = {"out": (out_t.detach(), np.asarray(out_j)), "dx": (xt.grad, np.asarray(dx_j))}
    pairs.update({name: (getattr(mlp, name).grad, mapped_grads[name].numpy()) for name in tparams})
    worst = {}
    for name, (t, j) in pairs.items():
        t = t.numpy().astype(np.float64)
        scale = max(1.0, np.abs(j).max())
        worst[name] = np.abs(t - j).max() / scale
        assert worst[name] <= 64 * np.finfo(np.float32).eps, (name, worst[name])



HEADS = 4


def _torch_layer_params_from(params):
    """TE-JAX's TransformerLayer parameters (fused qkv, biases, LayerNorm) as TE-PyTorch's (separate q/k/v)."""
    p = jax.tree_util.tree_map(lambda a: np.array(a, dtype=np.float32), params)
    att, mlp = p["attention"], p["mlp"]
    qkv = att["qkv"]
    out = {"self_attention.layernorm_qkv.layer_norm_weight": qkv["scale"],
           "self_attention.layernorm_qkv.layer_norm_bias": qkv["ln_bias"]}
    for i, name in enumerate(("query", "key", "value")):
        out[f"self_attention.layernorm_qkv.{name}_weight"] = qkv["kernel"][:, i, :].T
        out[f"self_attention.layernorm_qkv.{name}_bias"] = qkv["bias"][i]
    out["self_attention.proj.weight"] = att["out"]["kernel"].T
    out["self_attention.proj.bias"] = att["out"]["bias"]
    out.update({"layernorm_mlp.layer_norm_weight": mlp["scale"], "layernorm_mlp.layer_norm_bias": mlp["ln_bias"],
                "layernorm_mlp.fc1_weight": mlp["wi_kernel"][:, 0, :].T, "layernorm_mlp.fc1_bias": mlp["wi_bias"][0],
                "layernorm_mlp.fc2_weight": mlp["wo_kernel"].T, "layernorm_mlp.fc2_bias": mlp["wo_bias"]})
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in out.items()}


def test_transformer_layer_pytorch_equals_jax_to_float32_rounding():
    """A causal pre-LayerNorm encoder layer with biases and GELU: TE-JAX's (relative position bias off, logits
    scaled by 1/sqrt(d) as TE-PyTorch scales them) and TE-PyTorch's, the same weights."""
    from transformer_engine.jax.flax import TransformerLayer as FlaxTransformerLayer

    layer = FlaxTransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
                                 layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0,
                                 intermediate_dropout=0.0, use_bias=True, enable_relative_embedding=False,
                                 scale_attn_logits=True, self_attn_mask_type="causal", mlp_activations=("gelu",))
    x = np.random.default_rng(3).standard_normal((2, 6, HIDDEN)).astype(np.float32)
    dy = np.random.default_rng(4).standard_normal((2, 6, HIDDEN)).astype(np.float32)
    variables = layer.init(jax.random.PRNGKey(1), jnp.asarray(x), deterministic=True)
    rng = np.random.default_rng(5)
    params = jax.tree_util.tree_map(
        lambda a: jnp.asarray(np.asarray(a) + 0.1 * rng.standard_normal(a.shape).astype(np.float32)),
        nn.unbox(variables["params"]))

    def loss(params, x):
        out = layer.apply({"params": params}, x, deterministic=True)
        return jnp.sum(out * dy), out

    (_, out_j), (grads_j, dx_j) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, jnp.asarray(x))

    tl = te.TransformerLayer(HIDDEN, FFN, HEADS, layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0,
                             self_attn_mask_type="causal", attn_input_format="bshd", params_dtype=torch.float32,
                             device="cpu")
    tparams = _torch_layer_params_from(params)
    assert set(tparams) == {n for n, _ in tl.named_parameters()}
    with torch.no_grad():
        for name, p in tl.named_parameters():
            p.copy_(tparams[name])
    xt = torch.from_numpy(x).requires_grad_()
    out_t = tl(xt)
    out_t.backward(torch.from_numpy(dy))

    mapped = _torch_layer_params_from(grads_j)
    pairs = {"out": (out_t.detach(), np.asarray(out_j)), "dx": (xt.grad, np.asarray(dx_j))}
    pairs.update({name: (p.grad, mapped[name].numpy()) for name, p in tl.named_parameters()})
    for name, (t, j) in pairs.items():
        diff = np.abs(t.numpy().astype(np.float64) - j).max() / max(1.0, np.abs(j).max())
        assert diff <= 256 * np.finfo(np.float32).eps, (name, diff)
