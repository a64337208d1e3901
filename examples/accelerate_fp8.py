"""A Hugging Face BERT trained in FP8 through Accelerate's TransformerEngine backend, on this package.

    pip install --no-build-isolation ".[pytorch,hf]" accelerate   # from the repository's root
    pip install --no-build-isolation ./shims/transformer-engine   # lets Accelerate find the package
    python examples/accelerate_fp8.py                             # GPU if there is one, else CPU

``Accelerator(mixed_precision="fp8")`` picks TransformerEngine when the ``transformer-engine``
distribution is installed (the metadata-only alias in shims/transformer-engine stands for this
package). ``prepare`` then swaps the model's ``nn.Linear`` and ``nn.LayerNorm`` layers for
``transformer_engine.pytorch.Linear`` / ``LayerNorm`` (built without a ``device``: CUDA when there is
one, else the CPU) and runs the forward inside ``fp8_autocast`` with a ``DelayedScaling`` recipe, so
every GEMM of those layers runs in FP8. The script trains the same small model twice in FP8 and once
without mixed precision, and prints whether the FP8 runs are bitwise equal and how far their losses
are from the float32 run's. On a GPU older than Ada (compute capability below 8.9) Accelerate itself
falls back to fp16 and says so.
"""

import argparse
import sys

import torch

INSTALL_HINT = ('transformers and accelerate are needed: pip install "transformers>=4.56" accelerate '
                '(or ".[hf]" and accelerate from the repository\'s root)')
SHIM_HINT = ("accelerate does not see a transformer-engine distribution, so it cannot use this package for "
             "mixed_precision='fp8': pip install --no-build-isolation ./shims/transformer-engine (from the "
             "repository's root; metadata only, see shims/transformer-engine/README.md)")


def train(mixed_precision: str, steps: int, seq_len: int, fp8_format: str):
    """(losses, final parameters, TE layer counts) of one run; Accelerate's state is rebuilt for each."""
    import transformers
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TERecipeKwargs

    import transformer_engine.pytorch as te

    # One Accelerator per process is Accelerate's model; the runs here are separate trainings.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(0)
    # Every Linear's dims are multiples of 16 (Accelerate converts only those), and the decoder is not
    # tied to the embeddings (a converted layer gets a weight of its own).
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=False,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handlers = [TERecipeKwargs(fp8_format=fp8_format, amax_history_len=16)] if mixed_precision == "fp8" else None
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers)
    model, optimizer = accelerator.prepare(model, optimizer)
    layers = (sum(isinstance(m, te.Linear) for m in model.modules()),
              sum(isinstance(m, te.LayerNorm) for m in model.modules()))
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=data).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float().cpu())
    params = [p.detach().float().cpu().clone() for p in accelerator.unwrap_model(model).parameters()]
    return torch.stack(losses), params, layers, accelerator.state.mixed_precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    p.add_argument("--fp8-format", default="HYBRID", choices=("HYBRID", "E4M3"),
                   help="DelayedScaling's format (HYBRID: E4M3 forward, E5M2 gradients)")
    args = p.parse_args()
    try:
        import accelerate.utils
        import transformers  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2) from None
    if not accelerate.utils.is_transformer_engine_available():
        print(SHIM_HINT, file=sys.stderr)
        raise SystemExit(2)

    first, first_params, layers, used = train("fp8", args.steps, args.seq_len, args.fp8_format)
    second, second_params, _, _ = train("fp8", args.steps, args.seq_len, args.fp8_format)
    reference, _, _, _ = train("no", args.steps, args.seq_len, args.fp8_format)
    same = torch.equal(first, second) and all(torch.equal(a, b) for a, b in zip(first_params, second_params))
    print(f"Accelerate's mixed precision: {used}; converted to transformer_engine.pytorch: {layers[0]} Linear, "
          f"{layers[1]} LayerNorm")
    print(f"fp8 losses {[round(x, 5) for x in first.tolist()]}")
    print(f"fp32 losses {[round(x, 5) for x in reference.tolist()]}")
    print(f"max |fp8 - fp32| loss: {(first - reference).abs().max().item():.5f}")
    print(f"two FP8 runs bitwise equal: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
