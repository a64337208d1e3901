"""DotProductAttention in deterministic mode: two identical backward passes, bit for bit.

    python examples/pytorch_attention.py            # GPU if there is one, else CPU
    TRITON_INTERPRET=1 python examples/pytorch_attention.py --device cpu   # the fused kernels on CPU (slow)
"""

import argparse
import os

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # deterministic mode, read at every call

import torch  # noqa: E402

from transformer_engine.pytorch import DotProductAttention  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    # 8 query heads sharing 2 key/value heads (GQA), head dim 64, causal, [batch, seq, heads, dim].
    attn = DotProductAttention(num_attention_heads=8, kv_channels=64, num_gqa_groups=2, qkv_format="bshd",
                               attn_mask_type="causal")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, args.seq_len, 8, 64, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(2, args.seq_len, 2, 64, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(2, args.seq_len, 2, 64, generator=g).to(device, dtype).requires_grad_()

    grads = []
    for _ in range(2):
        out = attn(q, k, v)  # [batch, seq, heads * dim]
        dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        grads.append((dq, dk, dv))
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    print(f"backend: {attn.last_backend}; output {tuple(out.shape)}; gradients bitwise equal: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
