"""torch.compile over a model that uses DotProductAttention: one graph, eager's results.

    python examples/pytorch_compile.py                      # inductor on a GPU, aot_eager on CPU
    python examples/pytorch_compile.py --backend inductor   # inductor on CPU too (needs a C++ compiler)
"""

import argparse

import torch

from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on GPU, aot_eager on CPU)")
    args = p.parse_args()
    device = torch.device(args.device)
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    torch.manual_seed(0)
    cfg = TinyConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_gqa_groups=2)
    model = TinyTransformerLM(cfg).to(device, dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), device=device)
    # fullgraph=True: a graph break anywhere (our attention included) would be an error.
    compiled = torch.compile(model.loss, fullgraph=True, backend=backend)
    eager_loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    compiled_loss = compiled(tokens[:, :-1], tokens[:, 1:])
    compiled_loss.backward()
    close = torch.allclose(eager_loss.float(), compiled_loss, rtol=1e-3, atol=1e-3)
    print(f"backend {backend}: eager loss {eager_loss.item():.6f}, compiled loss {compiled_loss.item():.6f}; "
          f"attention ran {', '.join(model.attention_backends())}; close: {close}")
    if not close:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
