"""A TransformerEngine-JAX-style encoder classifier built from transformer_engine.jax.flax's layers,
trained a few steps on synthetic padded sentences, twice: the two runs' losses are bitwise equal.

    python examples/te_jax_encoder.py                  # float32 GEMMs
    python examples/te_jax_encoder.py --fp8 delayed    # FP8 GEMMs (DelayedScaling; also current, block)

The model follows TransformerEngine's JAX encoder example: an embedding, one
``TransformerLayer(layer_type=ENCODER, self_attn_mask_type='padding')``, two ``DenseGeneral`` layers
over the flattened sequence and a 2-way classifier. The task: is the sentence's first token in the
lower half of the vocabulary (a training set of two batches, cycled). Dropout is on (its keys are
fixed per step, so the runs repeat).
"""

import argparse
import os

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # read when the step is traced

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import transformer_engine.jax as te  # noqa: E402
import transformer_engine.jax.flax as te_flax  # noqa: E402
from transformer_engine.common import recipe  # noqa: E402

VOCAB, HIDDEN, HEADS = 64, 32, 4
BATCHES = 2  # the training set: this many batches, cycled
RECIPES = {"none": None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling}


class Net(nn.Module):
    """Embedding, one TE encoder layer, two TE dense layers, a classifier."""

    @nn.compact
    def __call__(self, tokens, mask, deterministic=False):
        table = self.param("embedding", nn.initializers.normal(1.0), (VOCAB, HIDDEN))
        # A one-hot matmul rather than a gather: its gradient is a matmul, deterministic on GPUs too.
        x = jax.nn.one_hot(tokens, VOCAB, dtype=jnp.float32) @ table
        x = te_flax.TransformerLayer(
            hidden_size=HIDDEN, mlp_hidden_size=4 * HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.1,
            attention_dropout=0.1, dropout_rng_name="dropout", layer_type=te_flax.TransformerLayerType.ENCODER,
            self_attn_mask_type="padding", enable_relative_embedding=False, mlp_activations=("gelu", "linear"),
        )(x, attention_mask=mask, deterministic=deterministic)
        x = x.reshape(x.shape[0], -1)
        x = te_flax.DenseGeneral(features=HIDDEN)(x)
        x = te_flax.DenseGeneral(features=HIDDEN)(x)
        return nn.Dense(features=2)(x)


def dataset(key, batches: int, batch: int, seq_len: int):
    """Token ids [batches, batch, seq], padding masks [batches, batch, 1, seq, seq] (True = masked out), labels."""
    k_tok, k_len = jax.random.split(key)
    tokens = jax.random.randint(k_tok, (batches, batch, seq_len), 0, VOCAB)
    lengths = jax.random.randint(k_len, (batches, batch), seq_len // 2, seq_len + 1)
    pad = jnp.arange(seq_len) >= lengths[..., None]  # [batches, batch, seq]
    tokens = jnp.where(pad, 0, tokens)
    mask = (pad[..., :, None] | pad[..., None, :])[:, :, None]
    labels = (tokens[..., 0] < VOCAB // 2).astype(jnp.int32)
    return tokens, mask, labels


def train(steps: int, batch: int, seq_len: int, fp8: str, lr: float = 0.01):
    model = Net()
    tokens, masks, labels = dataset(jax.random.PRNGKey(1), BATCHES, batch, seq_len)
    fp8_recipe = RECIPES[fp8]() if RECIPES[fp8] else None
    # The recipe is read while the model is traced: init and the step are traced inside autocast.
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        variables = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)}, tokens[0],
                               masks[0], deterministic=True)

        @jax.jit
        def step(variables, tokens, mask, labels, key):
            def loss_fn(v):
                logits = model.apply(v, tokens, mask, rngs={"dropout": key})
                return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

            loss, grads = jax.value_and_grad(loss_fn)(variables)
            new = dict(variables, params=jax.tree_util.tree_map(lambda p, g: p - lr * g, variables["params"],
                                                                grads["params"]))
            if "fp8_metas" in grads:  # DelayedScaling: the state's gradient is its next value
                new["fp8_metas"] = grads["fp8_metas"]
            return new, loss

        losses = []
        for i in range(steps):
            b = i % BATCHES
            variables, loss = step(variables, tokens[b], masks[b], labels[b], jax.random.PRNGKey(100 + i))
            losses.append(loss)
    return jnp.stack(losses)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--batch", type=int, default=8, help="sentences per step")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sentence")
    p.add_argument("--fp8", choices=list(RECIPES), default="none", help="FP8 recipe of the GEMMs")
    args = p.parse_args()
    first, second = (train(args.steps, args.batch, args.seq_len, args.fp8) for _ in range(2))
    same = bool(jnp.array_equal(first, second))
    finite = bool(jnp.all(jnp.isfinite(first)))
    print(f"device {jax.devices()[0].platform}; fp8 {args.fp8}; losses {[round(float(x), 5) for x in first]}; "
          f"two runs bitwise equal: {same}")
    if not (same and finite):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
