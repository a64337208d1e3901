"""TransformerEngine's PyTorch quickstart with this package: a transformer layer in plain PyTorch, then
``te.TransformerLayer`` built with the same three numbers, the same weights, the same output.

    python examples/te_quickstart_pytorch.py      # GPU if there is one (bf16), else CPU (fp32, small sizes)

Steps, as in TransformerEngine's quickstart:

1. ``BasicTransformerLayer``: LayerNorm, a fused QKV projection, softmax attention, the output projection and a
   residual; then LayerNorm, an MLP (tanh-approximated GELU) and a residual; written with torch.nn modules.
2. ``te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)``: the same layer in one module (its
   defaults: causal self attention, LayerNorm, GELU, pre-norm residuals, separate Q/K/V parameters).
3. The plain layer takes the TransformerEngine layer's weights and both run in eval mode: the outputs agree.
4. A training step (forward and backward, dropout on) run twice from the same seeds gives the same bits.
5. Where FP8 GEMMs run (te.check_fp8_support()), the step again inside ``te.autocast`` with a delayed-scaling recipe.
"""

import argparse
import math
import os

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # step 4: a backward that repeats its bits

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Format  # noqa: E402


class BasicTransformerLayer(torch.nn.Module):
    """A pre-norm transformer layer in plain PyTorch (causal attention, as TransformerLayer's default)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int, dropout: float = 0.1):
        super().__init__()
        self.heads, self.dropout = num_attention_heads, dropout
        self.ln1 = torch.nn.LayerNorm(hidden_size, eps=1e-5)
        self.qkv = torch.nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = torch.nn.Linear(hidden_size, hidden_size)
        self.ln2 = torch.nn.LayerNorm(hidden_size, eps=1e-5)
        self.fc1 = torch.nn.Linear(hidden_size, ffn_hidden_size)
        self.fc2 = torch.nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, hidden]
        s, b, hidden = x.shape
        d = hidden // self.heads
        q, k, v = (t.reshape(s, b, self.heads, d).permute(1, 2, 0, 3)  # [b, h, s, d]
                   for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.dropout(scores.masked_fill(causal, float("-inf")).softmax(-1), self.dropout, self.training)
        context = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, hidden)
        x = x + F.dropout(self.proj(context), self.dropout, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x + F.dropout(mlp, self.dropout, self.training)


def copy_weights(basic: BasicTransformerLayer, layer: te.TransformerLayer) -> None:
    """The TransformerEngine layer's parameters (TransformerEngine's names) into the plain layer."""
    qkv, mlp = layer.self_attention.layernorm_qkv, layer.layernorm_mlp
    with torch.no_grad():
        basic.ln1.weight.copy_(qkv.layer_norm_weight)
        basic.ln1.bias.copy_(qkv.layer_norm_bias)
        basic.qkv.weight.copy_(torch.cat([qkv.query_weight, qkv.key_weight, qkv.value_weight]))
        basic.qkv.bias.copy_(torch.cat([qkv.query_bias, qkv.key_bias, qkv.value_bias]))
        basic.proj.weight.copy_(layer.self_attention.proj.weight)
        basic.proj.bias.copy_(layer.self_attention.proj.bias)
        basic.ln2.weight.copy_(mlp.layer_norm_weight)
        basic.ln2.bias.copy_(mlp.layer_norm_bias)
        basic.fc1.weight.copy_(mlp.fc1_weight)
        basic.fc1.bias.copy_(mlp.fc1_bias)
        basic.fc2.weight.copy_(mlp.fc2_weight)
        basic.fc2.bias.copy_(mlp.fc2_bias)


def training_step(layer, x, dy, seed):
    """Forward and backward with dropout on: the output and every gradient."""
    torch.manual_seed(seed)
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, attention_mask=None)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def main() -> None:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024 if on_gpu else 64)
    parser.add_argument("--ffn-hidden-size", type=int, default=4096 if on_gpu else 256)
    parser.add_argument("--heads", type=int, default=16 if on_gpu else 4)
    parser.add_argument("--seq-len", type=int, default=512 if on_gpu else 32)
    parser.add_argument("--batch", type=int, default=4 if on_gpu else 2)
    args = parser.parse_args()
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(1234)

    layer = te.TransformerLayer(args.hidden_size, args.ffn_hidden_size, args.heads).to(device=device, dtype=dtype)
    basic = BasicTransformerLayer(args.hidden_size, args.ffn_hidden_size, args.heads).to(device=device, dtype=dtype)
    copy_weights(basic, layer)
    x = torch.randn(args.seq_len, args.batch, args.hidden_size, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    with torch.no_grad():
        ours, plain = layer.eval()(x), basic.eval()(x)
        if dtype == torch.float32:
            diff, tol = (ours - plain).abs().max().item(), 1e-4
        else:  # against the plain layer in float32: within twice the plain bf16 layer's own error
            exact = basic.float()(x.float())
            diff = (ours.float() - exact).abs().max().item()
            tol = 2 * (plain.float() - exact).abs().max().item() + 1e-3
    print(f"te.TransformerLayer({args.hidden_size}, {args.ffn_hidden_size}, {args.heads}) on {device} ({dtype}); "
          f"attention backend: {layer.self_attention.core_attention.last_backend}")
    print(f"max |te - plain| = {diff:.3g} (allowed {tol:.3g}); matches the plain PyTorch layer: {diff <= tol}")

    layer.train()
    first, second = training_step(layer, x, dy, seed=7), training_step(layer, x, dy, seed=7)
    print(f"training step: output {tuple(first[0].shape)}, {len(first) - 2} parameter gradients; "
          f"two runs bitwise equal: {all(torch.equal(a, b) for a, b in zip(first, second))}")

    fp8_ok, reason = te.check_fp8_support()
    if fp8_ok:
        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
        with te.autocast(enabled=True, recipe=recipe):
            y = layer(x, attention_mask=None)
        y.backward(dy)
        print(f"FP8 training step (DelayedScaling, HYBRID): output {tuple(y.shape)}")
    else:
        print(f"FP8 step skipped: {reason}")


if __name__ == "__main__":
    main()
