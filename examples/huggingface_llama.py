"""A Hugging Face Llama on this project's attention: deterministic training, twice, bit for bit.

    pip install --no-build-isolation ".[pytorch,hf]"   # this package with transformers, from the repository's root
    python examples/huggingface_llama.py               # GPU if there is one, else CPU

The model is built from a small config (no download). For a pretrained one, pass the same
``attn_implementation`` to ``from_pretrained``.
"""

import argparse
import os
import sys

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402

INSTALL_HINT = ('transformers is not installed: pip install "transformers>=4.56" '
                '(or ".[hf]" from the repository\'s root)')


def train(device, dtype, steps: int, seq_len: int):
    import transformers

    from transformer_engine.pytorch.integrations import huggingface

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=huggingface.ATTN_IMPLEMENTATION)
    model.to(device, dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, seq_len), generator=data).to(device)
        mask = torch.ones_like(ids)
        mask[1, seq_len // 2:] = 0  # the second sequence is padded: real tokens are packed (thd) for attention
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().float().cpu())
    return torch.stack(losses)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    args = p.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2) from None
    from transformer_engine.pytorch.integrations import huggingface

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    huggingface.register()
    first, second = (train(device, dtype, args.steps, args.seq_len) for _ in range(2))
    same = torch.equal(first, second)
    print(f"losses {[round(x, 5) for x in first.tolist()]}; two runs bitwise equal: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
