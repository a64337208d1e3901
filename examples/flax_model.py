"""A Flax (linen) transformer on this project's attention: deterministic training, twice, bit for bit.

    python examples/flax_model.py     # JAX's default device (a GPU if jax has one), else CPU
"""

import argparse
import os

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # read when the step is traced

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from transformer_engine.jax.flax.models import TinyConfig, TinyTransformerLM  # noqa: E402


def train(steps: int, seq_len: int):
    cfg = TinyConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_gqa_groups=2)
    model = TinyTransformerLM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (steps, 2, seq_len + 1), 0, cfg.vocab_size)
    params = model.init(jax.random.PRNGKey(0), tokens[0, :, :-1])

    @jax.jit
    def step(params, batch):
        loss, grads = jax.value_and_grad(
            lambda p: model.apply(p, batch[:, :-1], batch[:, 1:], method=TinyTransformerLM.loss))(params)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-2 * g, params, grads), loss  # plain SGD

    losses = []
    for i in range(steps):
        params, loss = step(params, tokens[i])
        losses.append(loss)
    return jnp.stack(losses)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    args = p.parse_args()
    first, second = (train(args.steps, args.seq_len) for _ in range(2))
    same = bool(jnp.array_equal(first, second))
    print(f"device {jax.devices()[0].platform}; losses {[round(float(x), 5) for x in first]}; "
          f"two runs bitwise equal: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
