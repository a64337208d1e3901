"""PyTorch == JAX, bit for bit, in batch-invariant mode: the same layer with the same weights (TE-PyTorch's and
TE-JAX's parameter layouts mapped onto each other as tests/jax/test_jax_torch_layers.py maps them) gives equal
outputs and gradients, because both frameworks launch the same Triton kernels (common/batch_invariant) with the
same arguments, under Triton's interpreter here (on a GPU: the same cubins). Layers: Linear / dense, LayerNorm
and RMSNorm, LayerNormMLP, an encoder TransformerLayer with biases; then a tiny language model of two
TransformerLayers and an output projection: equal logits and gradients of every parameter and of the input.
Bias gradients are equal because both frameworks sum them with the shared column-sum kernel in the mode.

Elementwise pieces: residual adds, bias adds and scaling are one IEEE operation each (the same bits in both
frameworks), attention's softmax runs inside the shared fused kernel. The activations are not: torch's and XLA's
``tanh`` differ on 59% of float32 inputs (up to 2.4e-7) and ``exp`` on 9% (measured on this host), so outside the
mode a GELU / SiLU LayerNormMLP differs by an ulp in most outputs. In the mode both frameworks run the shared
elementwise activation kernel (forward and backward), so every activation of the table agrees bitwise.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
ON_GPU = jax.devices()[0].platform == "gpu" and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not ON_GPU,
                                reason="the batch-invariant kernels run on a CUDA GPU or under TRITON_INTERPRET=1")
DEVICE = "cuda" if ON_GPU else "cpu"

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.jax import batch_invariant  # noqa: E402
from transformer_engine.jax.dense import dense  # noqa: E402
from transformer_engine.jax.flax import DenseGeneral  # noqa: E402
from transformer_engine.jax.flax import LayerNormMLP as FlaxLayerNormMLP  # noqa: E402
from transformer_engine.jax.flax import TransformerLayer as FlaxTransformerLayer  # noqa: E402
from transformer_engine.jax.flax.module import layernorm  # noqa: E402

HIDDEN, FFN, HEADS, VOCAB, EPS = 32, 64, 2, 40, 1e-5
DTYPES = {"float32": (torch.float32, jnp.float32), "float16": (torch.float16, jnp.float16)}


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    monkeypatch.setenv("NVTE_JAX_TRITON_INTERPRET", "1")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    monkeypatch.delenv("NVTE_BATCH_INVARIANT", raising=False)


def _np(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# JAX dispatches asynchronously and runs the interpreted kernels in a host callback; Triton's interpreter patches
# triton.language globally while a kernel runs, so the tests wait for JAX's results before PyTorch launches.


def _equal(name, t, j):
    t = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    j = np.asarray(j)
    assert t.dtype == j.dtype and t.shape == j.shape, (name, t.dtype, j.dtype, t.shape, j.shape)
    if not np.array_equal(t, j):
        diff = np.abs(t.astype(np.float64) - j.astype(np.float64)).max()
        raise AssertionError(f"{name}: PyTorch and JAX differ (max |diff| {diff:.3g})")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_linear_equals_dense_bitwise(dtype):
    tdt, jdt = DTYPES[dtype]
    x, dy, w = _np((2, 9, 48), 0), _np((2, 9, HIDDEN), 1), _np((HIDDEN, 48), 2, 0.2)
    lin = te.Linear(48, HIDDEN, bias=False, params_dtype=tdt, device=DEVICE)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    xt = torch.from_numpy(x).to(DEVICE, tdt).requires_grad_()
    with te.batch_invariant():
        out_t = lin(xt)
        out_t.backward(torch.from_numpy(dy).to(DEVICE, tdt))

    def loss(x, kernel):
        out = dense(x, kernel)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dy)), out

    with batch_invariant():
        (_, out_j), (dx_j, dk_j) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            jnp.asarray(x, jdt), jnp.asarray(w.T, jdt))
    jax.block_until_ready((out_j, dx_j, dk_j))  # see _equal: one interpreter at a time
    _equal("out", out_t, out_j)
    _equal("dx", xt.grad, dx_j)
    _equal("dW", lin.weight.grad, np.asarray(dk_j).T)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("normalization,zero_centered", [("LayerNorm", False), ("RMSNorm", True)])
def test_norm_equals_flax_norm_bitwise(dtype, normalization, zero_centered):
    tdt, jdt = DTYPES[dtype]
    x, dy = _np((3, 7, HIDDEN), 3, 2.0) + 0.5, _np((3, 7, HIDDEN), 4)
    scale, bias = _np((HIDDEN,), 5, 0.1) + (0.0 if zero_centered else 1.0), _np((HIDDEN,), 6)
    cls = te.LayerNorm if normalization == "LayerNorm" else te.RMSNorm
    norm = cls(HIDDEN, eps=EPS, zero_centered_gamma=zero_centered, params_dtype=tdt, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(scale))
        if normalization == "LayerNorm":
            norm.bias.copy_(torch.from_numpy(bias))
    xt = torch.from_numpy(x).to(DEVICE, tdt).requires_grad_()
    with te.batch_invariant():
        out_t = norm(xt)
        out_t.backward(torch.from_numpy(dy).to(DEVICE, tdt))

    norm_type = normalization.lower()

    def loss(x, scale, bias):
        out = layernorm(x, scale, bias if norm_type == "layernorm" else None, norm_type, zero_centered, EPS)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dy)), out

    with batch_invariant():
        (_, out_j), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            jnp.asarray(x, jdt), jnp.asarray(scale, jdt), jnp.asarray(bias, jdt))
    jax.block_until_ready((out_j, grads))
    _equal("out", out_t, out_j)
    _equal("dx", xt.grad, grads[0])
    _equal("dscale", norm.weight.grad, grads[1])
    if normalization == "LayerNorm":
        _equal("dbias", norm.bias.grad, grads[2])


def _perturbed(variables, seed):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a) + 0.1 * rng.standard_normal(a.shape)
                                                        .astype(np.float32)), nn.unbox(variables["params"]))


ACTIVATIONS = [("gelu", ("gelu",)), ("qgelu", ("quick_gelu",)), ("srelu", ("squared_relu",)),
               ("geglu", ("gelu", "linear")), ("swiglu", ("silu", "linear")), ("reglu", ("relu", "linear")),
               ("glu", ("sigmoid", "linear")), ("clamped_swiglu", ("clamped_silu", "clamped_linear"))]
CLAMP = {"limit": 0.75, "alpha": 1.702, "glu_linear_offset": 1.0}  # a limit the inputs cross


@pytest.mark.parametrize("torch_act,jax_acts", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
def test_layernorm_mlp_equals_bitwise(torch_act, jax_acts):
    clamped = torch_act == "clamped_swiglu"
    layer = FlaxLayerNormMLP(intermediate_dim=FFN, activations=jax_acts, epsilon=EPS, layernorm_type="rmsnorm",
                             activation_params=CLAMP if clamped else None)
    x, dy = _np((2, 5, HIDDEN), 7), _np((2, 5, HIDDEN), 8)
    params = _perturbed(layer.init(jax.random.PRNGKey(0), jnp.asarray(x), deterministic=True), 9)

    def loss(params, x):
        out, _ = layer.apply({"params": params}, x, deterministic=True)
        return jnp.sum(out * jnp.asarray(dy)), out

    with batch_invariant():
        (_, out_j), (grads_j, dx_j) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, jnp.asarray(x))
    jax.block_until_ready((out_j, grads_j, dx_j))
    mlp = te.LayerNormMLP(HIDDEN, FFN, eps=EPS, normalization="RMSNorm", activation=torch_act, bias=False,
                          activation_params=CLAMP if clamped else None, params_dtype=torch.float32, device=DEVICE)
    tparams = _mlp_params_from(params)
    assert set(tparams) == {n for n, _ in mlp.named_parameters()}
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_(tparams[name])
    xt = torch.from_numpy(x).to(DEVICE).requires_grad_()
    with te.batch_invariant():
        out_t = mlp(xt)
        out_t.backward(torch.from_numpy(dy).to(DEVICE))
    _equal("out", out_t, out_j)
    _equal("dx", xt.grad, dx_j)
    mapped = _mlp_params_from(grads_j)
    for name, p in mlp.named_parameters():
        _equal(name, p.grad, mapped[name])


def _mlp_params_from(p, prefix=""):
    """TE-JAX's LayerNormMLP parameters (no biases) as TE-PyTorch's: wi_kernel [H, n_acts, F] -> fc1_weight
    [n_acts * F, H] (the activated half first, as TE-PyTorch's gated FC1 splits its output)."""
    p = jax.tree_util.tree_map(lambda a: np.array(a, dtype=np.float32), p)
    wi = p["wi_kernel"]
    out = {"layer_norm_weight": p["scale"],
           "fc1_weight": np.concatenate([wi[:, i, :].T for i in range(wi.shape[1])], axis=0),
           "fc2_weight": p["wo_kernel"].T}
    if "ln_bias" in p:
        out["layer_norm_bias"] = p["ln_bias"]
    return {prefix + k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------------
# A tiny language model: two TransformerLayers (RMSNorm, SwiGLU, causal, no biases) and a head.


class FlaxTinyLM(nn.Module):
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = FlaxTransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
                                     layernorm_type="rmsnorm", layernorm_epsilon=EPS, hidden_dropout=0.0,
                                     attention_dropout=0.0, intermediate_dropout=0.0, use_bias=False,
                                     enable_relative_embedding=False, scale_attn_logits=True,
                                     self_attn_mask_type="causal", mlp_activations=("silu", "linear"),
                                     dtype=self.dtype, name=f"layer{i}")(x, deterministic=True)
        return DenseGeneral(VOCAB, use_bias=False, dtype=self.dtype, name="head")(x)


class TorchTinyLM(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(HIDDEN, FFN, HEADS, layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", normalization="RMSNorm", activation="swiglu",
                                bias=False, attn_input_format="bshd", layer_number=i + 1,
                                params_dtype=dtype, device=DEVICE)
            for i in range(2))
        self.head = te.Linear(HIDDEN, VOCAB, bias=False, params_dtype=dtype, device=DEVICE)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _lm_params_from(params, dtype=torch.float32):
    """FlaxTinyLM's parameters as TorchTinyLM's (the fused qkv kernel split into query/key/value weights)."""
    p = jax.tree_util.tree_map(lambda a: np.array(a, dtype=np.float32), params)
    out = {"head.weight": p["head"]["kernel"].T}
    for i in range(2):
        att, mlp, pre = p[f"layer{i}"]["attention"], p[f"layer{i}"]["mlp"], f"layers.{i}."
        out[pre + "self_attention.layernorm_qkv.layer_norm_weight"] = att["qkv"]["scale"]
        for j, name in enumerate(("query", "key", "value")):
            out[pre + f"self_attention.layernorm_qkv.{name}_weight"] = att["qkv"]["kernel"][:, j, :].T
        out[pre + "self_attention.proj.weight"] = att["out"]["kernel"].T
        out.update({k: v.numpy() for k, v in _mlp_params_from(mlp, pre + "layernorm_mlp.").items()})
    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(dtype) for k, v in out.items()}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tiny_model_logits_and_gradients_equal_bitwise(dtype):
    tdt, jdt = DTYPES[dtype]
    x, dlogits = _np((2, 8, HIDDEN), 10), _np((2, 8, VOCAB), 11)
    flax_lm = FlaxTinyLM(dtype)
    params = _perturbed(flax_lm.init(jax.random.PRNGKey(2), jnp.asarray(x, jdt)), 12)
    params = jax.tree_util.tree_map(lambda a: a.astype(jdt), params)
    x = x.astype(np.dtype(dtype))

    def loss(params, x):
        logits = flax_lm.apply({"params": params}, x)
        return jnp.sum(logits.astype(jnp.float32) * jnp.asarray(dlogits)), logits

    with batch_invariant():
        (_, logits_j), (grads_j, dx_j) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, jnp.asarray(x))
    jax.block_until_ready((logits_j, grads_j, dx_j))
    model = TorchTinyLM(tdt)
    tparams = _lm_params_from(params)
    assert set(tparams) == {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tparams[name])
    xt = torch.from_numpy(x).to(DEVICE).requires_grad_()
    with te.batch_invariant():
        logits_t = model(xt)
        logits_t.backward(torch.from_numpy(dlogits).to(DEVICE, tdt))
    _equal("logits", logits_t, logits_j)
    _equal("dx", xt.grad, dx_j)
    mapped = _lm_params_from(grads_j, tdt)
    for name, p in model.named_parameters():
        _equal(name, p.grad, mapped[name])


def test_transformer_layer_with_biases_equals_bitwise():
    """test_jax_torch_layers' encoder layer (LayerNorm, GELU, biases everywhere) in the mode: outputs and every
    gradient bitwise equal, the biases' too (their gradients are the shared fixed-order column sum in both
    frameworks: autograd's and XLA's own row sums differ in the last bit)."""
    from test_jax_torch_layers import _torch_layer_params_from

    layer = FlaxTransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
                                 layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0,
                                 intermediate_dropout=0.0, use_bias=True, enable_relative_embedding=False,
                                 scale_attn_logits=True, self_attn_mask_type="causal", mlp_activations=("gelu",))
    x, dy = _np((2, 16, HIDDEN), 13), _np((2, 16, HIDDEN), 14)
    params = _perturbed(layer.init(jax.random.PRNGKey(1), jnp.asarray(x), deterministic=True), 15)

    def loss(params, x):
        out = layer.apply({"params": params}, x, deterministic=True)
        return jnp.sum(out * jnp.asarray(dy)), out

    with batch_invariant():
        (_, out_j), (grads_j, dx_j) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, jnp.asarray(x))
    jax.block_until_ready((out_j, grads_j, dx_j))
    tl = te.TransformerLayer(HIDDEN, FFN, HEADS, layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0,
                             self_attn_mask_type="causal", attn_input_format="bshd", params_dtype=torch.float32,
                             device=DEVICE)
    tparams = _torch_layer_params_from(params)
    with torch.no_grad():
        for name, p in tl.named_parameters():
            p.copy_(tparams[name])
    xt = torch.from_numpy(x).to(DEVICE).requires_grad_()
    with te.batch_invariant():
        out_t = tl(xt)
        out_t.backward(torch.from_numpy(dy).to(DEVICE))
    _equal("out", out_t, out_j)
    _equal("dx", xt.grad, dx_j)
    mapped = _torch_layer_params_from(grads_j)
    for name, p in tl.named_parameters():
        _equal(name, p.grad, mapped[name])
