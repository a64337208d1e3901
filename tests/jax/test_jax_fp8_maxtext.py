"""MaxText's TransformerEngine FP8 (``quantization=te_fp8_delayedscaling`` / ``te_fp8_currentscaling``)
on this frontend, on 8 CPU devices.

MaxText 0.2.5 cannot be imported without its heavy dependencies (aqt, qwix, tokamax, orbax), so its
calls are reproduced here from that release's source (the ``maxtext-0.2.5`` wheel):

- ``maxtext/layers/quantizations.py``: ``TransformerEngineQuantization`` (``_get_recipe``, ``_wrap``'s
  ``TEWrapper`` subclassing ``transformer_engine.jax.flax.module.TransformerEngineBase`` and routing
  ``generate_quantizer_set`` to the ``_overwrite_with_gradient`` collection with checkpoint name
  ``"quantization"``, ``dot_general_cls``'s ``te_dot_general`` calling
  ``transformer_engine.jax.dense.dense`` with ``tex.noop_collective_op_set``);
- ``maxtext/layers/linears.py``: ``DenseGeneral``'s quantized path (the Linen ``dot_general_cls()``
  wrapped in ``ToNNX``, initialized on zeros ``[block_size, *in_features]``, called with
  ``mutable=["aqt"]``), here with Flax's ``nnx.bridge.ToNNX`` of which MaxText's is a fork;
- ``maxtext/trainers/pre_train/train.py``: the NNX ``train_step``'s split into ``nnx.Param``, the
  ``_overwrite_with_gradient`` variables and the rest, ``value_and_grad`` over the first two, and the
  ``_overwrite_with_gradient`` variables replaced by their gradients (the params go to the optimizer).

A two-layer MLP of DenseGeneral layers (kernels sharded over the ``tensor`` axis, the batch over
``data``) trains 20 steps: bitwise equal twice, the loss falling and within a few percent of the
fp32 run, and the delayed-scaling state advancing as TransformerEngine-JAX's does.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="Flax is not installed")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.nnx import variablelib  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


# ------------------------------------------------------------------------------------------------
# MaxText 0.2.5, reproduced
# ------------------------------------------------------------------------------------------------


class TeCommGemmOverlapPolicy(str, Enum):
    """maxtext/configs/types.py (0.2.5)."""

    DISABLED = "disabled"
    MLP = "mlp"
    FULL = "full"


class Config:
    def __init__(self, quantization):
        self.quantization = quantization
        self.te_comm_gemm_overlap = TeCommGemmOverlapPolicy.DISABLED  # MaxText's default


class TransformerEngineQuantization:
    """maxtext/layers/quantizations.py ``TransformerEngineQuantization`` (0.2.5), the parts a dense uses."""

    def __init__(self, config):
        self.quant_mode = "train"
        if not config.quantization.startswith("te_"):
            raise ValueError(f"Invalid TransformerEngine quantization config: {config.quantization}")
        self._recipe = TransformerEngineQuantization._get_recipe(config.quantization)
        self._te_comm_gemm_overlap_policy = config.te_comm_gemm_overlap

    @staticmethod
    def _get_recipe(recipe_name: str):
        from transformer_engine.common import recipe

        RECIPES = {  # noqa: N806 - MaxText's name
            "te_no_quant": lambda: None,
            "te_fp8_delayedscaling": recipe.DelayedScaling,
            "te_fp8_currentscaling": recipe.Float8CurrentScaling,
            "te_mxfp8": recipe.MXFP8BlockScaling,
            "te_nvfp4": recipe.NVFP4BlockScaling,
            "te_nvfp4_no_rht": functools.partial(recipe.NVFP4BlockScaling, disable_rht=True),
        }
        if recipe_name not in RECIPES:
            raise ValueError(f"Invalid TransformerEngine recipe: {recipe_name}")
        return RECIPES[recipe_name]()

    @property
    def needs_apply_rngs(self) -> bool:
        from transformer_engine.common import recipe

        if not isinstance(self._recipe, recipe.NVFP4BlockScaling):
            return False
        return not self._recipe.disable_stochastic_rounding

    def get_block_size(self):
        from transformer_engine.common import recipe

        if isinstance(self._recipe, recipe.MXFP8BlockScaling):
            return 32
        if isinstance(self._recipe, recipe.NVFP4BlockScaling):
            return 128
        return 1

    def _wrap(self, f, name=None):
        import transformer_engine.jax
        import transformer_engine.jax.cpp_extensions as tex
        from transformer_engine.common import recipe

        default_recipe = self._recipe
        overlap_policy = self._te_comm_gemm_overlap_policy

        class TEWrapper(transformer_engine.jax.flax.module.TransformerEngineBase):
            def generate_quantizer_set(self, postfix: str = "", variable_collection: str | None = None,
                                       quantization_checkpoint_name: str | None = None,
                                       fp8_recipe: recipe.Recipe | None = default_recipe, n_groups: int | None = None):
                return super().generate_quantizer_set(
                    postfix=postfix,
                    variable_collection=OVERWRITE_WITH_GRADIENT,
                    quantization_checkpoint_name="quantization",
                    fp8_recipe=fp8_recipe,
                    n_groups=n_groups,
                )

            def generate_collective_op_set(self, mesh_axes: Tuple[str, ...] = ()):
                if overlap_policy == TeCommGemmOverlapPolicy.DISABLED:
                    return tex.noop_collective_op_set
                raise AssertionError("collective GEMM overlap is not reproduced")

            @nn.compact
            def __call__(self, *args, **kwargs):
                return f(self.generate_quantizer_set, self.generate_collective_op_set, *args, **kwargs)

        TEWrapper.__name__ = f"TEWrapper_{name if name else f.__name__}"
        return TEWrapper

    def dot_general_cls(self, mesh_axes: Tuple[str, ...] = ()):
        import transformer_engine.jax
        import transformer_engine.jax.cpp_extensions as tex

        def te_dot_general(generate_quantizer_set, generate_collective_op_set, x, kernel, dims, **kwargs):
            contracting_dims, batch_dims = dims
            assert batch_dims == ((), ()), "Batch dimensions must be empty for TransformerEngine dot."
            quantizer_set = generate_quantizer_set()
            collective_op_set = (
                generate_collective_op_set(mesh_axes)
                if self._te_comm_gemm_overlap_policy != TeCommGemmOverlapPolicy.DISABLED
                else tex.noop_collective_op_set
            )
            return transformer_engine.jax.dense.dense(
                x, kernel, contracting_dims=contracting_dims, quantizer_set=quantizer_set,
                collective_op_set=collective_op_set,
            )

        return self._wrap(te_dot_general, "dot_general")


def normalize_axes(axes, ndim):
    return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


class DenseGeneral(nnx.Module):
    """maxtext/layers/linears.py ``DenseGeneral`` (0.2.5): its kernel and quantized dot_general path."""

    def __init__(self, in_features_shape, out_features_shape, axis=-1, dtype=jnp.float32, quant=None,
                 kernel_axes=(), *, rngs: nnx.Rngs):
        self.in_features_shape = tuple(in_features_shape)
        self.out_features_shape = tuple(out_features_shape)
        self.axis = (axis,) if isinstance(axis, int) else tuple(axis)
        self.dtype = dtype
        self.quant = quant
        fan_in = int(np.prod(self.in_features_shape))
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        kernel = init(rngs.params(), (fan_in, int(np.prod(self.out_features_shape))), jnp.float32)
        self.kernel = nnx.Param(kernel.reshape(self.in_features_shape + self.out_features_shape))
        self.kernel_axes = kernel_axes
        if quant:
            dot_general_cls = quant.dot_general_cls(mesh_axes=kernel_axes)
            dot_general_linen = dot_general_cls()
            quant_dot_general = nnx.bridge.ToNNX(dot_general_linen, rngs=rngs)
            self._quant_dot_general_name = f"{type(dot_general_linen).__name__}_0"
            setattr(self, self._quant_dot_general_name, quant_dot_general)
            block_size = getattr(quant, "get_block_size", lambda: 1)()
            dummy_inputs = jnp.zeros((block_size, *self.in_features_shape), dtype=self.dtype)
            self(dummy_inputs, _initializing=True)
        else:
            self._quant_dot_general_name = None

    @property
    def quant_dot_general(self):
        return None if self._quant_dot_general_name is None else getattr(self, self._quant_dot_general_name)

    def __call__(self, inputs, _initializing: bool = False):
        inputs = jnp.asarray(inputs, self.dtype)
        norm_axis = normalize_axes(self.axis, inputs.ndim)
        kernel = jnp.asarray(self.kernel[...], self.dtype)
        contract_ind = tuple(range(0, len(self.axis)))
        dims = ((norm_axis, contract_ind), ((), ()))
        if self.quant_dot_general is not None:  # _compute_dot_general_nnx's quantized branch
            if _initializing:
                self.quant_dot_general.lazy_init(inputs, kernel, dims, precision=None)
            return self.quant_dot_general(inputs, kernel, dims, precision=None, mutable=["aqt"])
        return jax.lax.dot_general(inputs, kernel, dims)


class MLP(nnx.Module):
    def __init__(self, embed, mlp, quant, rngs):
        self.wi = DenseGeneral((embed,), (mlp,), quant=quant, kernel_axes=("embed", "mlp"), rngs=rngs)
        self.wo = DenseGeneral((mlp,), (embed,), quant=quant, kernel_axes=("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        return self.wo(jax.nn.relu(self.wi(x)))


def owg_type():
    return variablelib.variable_type_from_name(OVERWRITE_WITH_GRADIENT, allow_register=True)


def make_train_step(graphdef, lr=0.2):
    """train.py ``train_step`` (NNX, no gradient accumulation), with plain SGD for the optimizer."""
    custom_param_filter = nnx.Any(owg_type())

    def loss_fn(model, data):
        x, y = data
        return jnp.mean((model(x) - y) ** 2)

    @jax.jit
    def train_step(state, data):
        model = nnx.merge(graphdef, state)
        model_graphdef, curr_params, custom_params, rest = nnx.split(model, nnx.Param, custom_param_filter, ...)

        def diff_wrapper(curr_params, custom_params, rest, data):
            local_model = nnx.merge(model_graphdef, curr_params, custom_params, rest, copy=True)
            loss = loss_fn(local_model, data)
            non_param_rest = nnx.state(local_model, nnx.Not(nnx.Any(nnx.Param, custom_param_filter, nnx.Intermediate)))
            return loss, non_param_rest

        grad_func = jax.value_and_grad(diff_wrapper, argnums=(0, 1), has_aux=True)
        (loss, non_param_rest), (raw_grads, custom_grads) = grad_func(curr_params, custom_params, rest, data)
        nnx.update(model, nnx.State.merge(custom_grads, non_param_rest))
        nnx.update(model, jax.tree_util.tree_map(lambda p, g: p - lr * g, curr_params, raw_grads))
        return nnx.state(model), loss

    return train_step


# ------------------------------------------------------------------------------------------------
# The runs
# ------------------------------------------------------------------------------------------------

B, S, EMBED, HIDDEN, STEPS = 16, 8, 32, 64, 20
LOGICAL_TO_MESH = {"embed": None, "mlp": "tensor"}


def _mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, EMBED)).astype(np.float32)
    teacher = rng.standard_normal((EMBED, EMBED)).astype(np.float32) / np.sqrt(EMBED)
    return x, np.tanh(x @ teacher).astype(np.float32)


def train(quantization):
    """20 steps on 8 devices: (losses, final state leaves, the model's OWG variables per step)."""
    mesh = _mesh()
    quant = TransformerEngineQuantization(Config(quantization)) if quantization else None
    model = MLP(EMBED, HIDDEN, quant, nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def shard(path, leaf):
        names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        if "kernel" in names:
            layer = getattr(model, names[0])
            return jax.device_put(leaf, NamedSharding(mesh, P(*(LOGICAL_TO_MESH[a] for a in layer.kernel_axes))))
        return jax.device_put(leaf, NamedSharding(mesh, P()))

    state = jax.tree_util.tree_map_with_path(shard, state)
    x, y = _data()
    data = tuple(jax.device_put(a, NamedSharding(mesh, P("data", None, None))) for a in (x, y))
    step = make_train_step(graphdef)
    losses, owg = [], []
    for _ in range(STEPS):
        state, loss = step(state, data)
        losses.append(float(loss))
        owg.append(jax.tree_util.tree_map(np.asarray, nnx.state(nnx.merge(graphdef, state), owg_type()).to_pure_dict()))
    leaves = [np.asarray(jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf)
              for leaf in jax.tree_util.tree_leaves(state)]
    return np.asarray(losses), leaves, owg


@pytest.fixture(scope="module")
def fp32_run():
    return train(None)


@pytest.mark.parametrize("quantization", ["te_fp8_delayedscaling", "te_fp8_currentscaling"])
def test_maxtext_te_fp8_dense_general_trains_bitwise_twice_close_to_fp32(quantization, fp32_run):
    losses, leaves, owg = train(quantization)
    losses2, leaves2, _ = train(quantization)
    np.testing.assert_array_equal(losses, losses2)
    for a, b in zip(leaves, leaves2):
        np.testing.assert_array_equal(a, b)
    ref_losses = fp32_run[0]
    assert losses[-1] < 0.5 * losses[0], losses
    np.testing.assert_allclose(losses, ref_losses, rtol=0.05)
    assert not np.array_equal(losses, ref_losses)  # FP8 did run

    if quantization == "te_fp8_currentscaling":
        assert owg[-1] == {}  # no state
        return
    # The delayed-scaling state lives where TransformerEngine-JAX keeps it, under the wrapper module.
    for layer in ("wi", "wo"):
        meta = owg[-1][layer]["TEWrapper_dot_general_0"]
        assert sorted(meta) == sorted(f"{t}_{v}" for t in ("x", "kernel", "grad") for v in ("scale", "amax_history"))
        assert meta["x_amax_history"].shape == (1024,) and meta["x_scale"].shape == (1,)
        # One amax recorded per step (the init's dummy call records none: it is not differentiated).
        assert np.count_nonzero(meta["x_amax_history"]) == STEPS
        # The scale after step i is fp8_max over the largest amax in the history (recipe defaults: max, margin 0).
        for i, step_meta in enumerate(owg):
            m = step_meta[layer]["TEWrapper_dot_general_0"]
            for t, fmax in (("x", 448.0), ("kernel", 448.0), ("grad", 57344.0)):
                np.testing.assert_array_equal(m[f"{t}_scale"], np.float32([fmax / np.float64(m[f"{t}_amax_history"]
                                                                                          .max())]),
                                              err_msg=f"step {i} {layer} {t}")
