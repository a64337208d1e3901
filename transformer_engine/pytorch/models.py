"""A small decoder-only transformer built from the project's modules, for checks and examples.

Not a TransformerEngine ``TransformerLayer``: a minimal pre-norm block (fused QKV projection with
GQA, :class:`DotProductAttention`, output projection, GELU MLP) and a language model around it.
The determinism check (``python -m transformer_engine.pytorch.determinism_check``) trains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from transformer_engine.common.tiny_model import TinyShape
from transformer_engine.pytorch.attention import DotProductAttention

__all__ = ["TinyConfig", "TinyTransformerLayer", "TinyTransformerLM"]


@dataclass(frozen=True)
class TinyConfig(TinyShape):
    qkv_format: str = "bshd"  # "bshd" or "sbhd"

    def validate(self) -> None:
        super().validate()
        if self.qkv_format not in ("bshd", "sbhd"):
            raise ValueError(f"`qkv_format` must be 'bshd' or 'sbhd', got {self.qkv_format!r}")


class TinyTransformerLayer(torch.nn.Module):
    """Pre-norm block: x + proj(attn(ln(x))), then x + mlp(ln(x)).

    q, k and v are strided views into one fused projection, as in TransformerEngine's layers.
    """

    def __init__(self, cfg: TinyConfig, layer_number: int) -> None:
        super().__init__()
        h, g, d = cfg.num_attention_heads, cfg.num_gqa_groups, cfg.head_dim
        self.cfg = cfg
        self.ln_attn = torch.nn.LayerNorm(cfg.hidden_size)
        self.qkv = torch.nn.Linear(cfg.hidden_size, (h + 2 * g) * d)
        self.attention = DotProductAttention(
            h, d, num_gqa_groups=g, qkv_format=cfg.qkv_format, attn_mask_type=cfg.attn_mask_type,
            window_size=cfg.window_size, layer_number=layer_number,
        )
        self.proj = torch.nn.Linear(h * d, cfg.hidden_size)
        ffn = cfg.ffn_size
        self.ln_mlp = torch.nn.LayerNorm(cfg.hidden_size)
        self.fc1 = torch.nn.Linear(cfg.hidden_size, ffn)
        self.fc2 = torch.nn.Linear(ffn, cfg.hidden_size)

    def forward(self, x: torch.Tensor, inference_params=None) -> torch.Tensor:
        """``inference_params``: a KV-cache step (x holds the step's new tokens; attention's docstring)."""
        cfg = self.cfg
        h, g, d = cfg.num_attention_heads, cfg.num_gqa_groups, cfg.head_dim
        qkv = self.qkv(self.ln_attn(x))
        q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
        q = q.unflatten(-1, (h, d))
        k = k.unflatten(-1, (g, d))
        v = v.unflatten(-1, (g, d))
        x = x + self.proj(self.attention(q, k, v, inference_params=inference_params))
        return x + self.fc2(F.gelu(self.fc1(self.ln_mlp(x))))


class TinyTransformerLM(torch.nn.Module):
    """Embedding, ``num_layers`` blocks, final norm, untied LM head. Input tokens [b, s]."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(TinyTransformerLayer(cfg, i + 1) for i in range(cfg.num_layers))
        self.ln_f = torch.nn.LayerNorm(cfg.hidden_size)
        self.head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor, inference_params=None) -> torch.Tensor:
        """Logits [b, s, vocab]; with ``inference_params`` (an InferenceParams after its ``pre_step``) the
        tokens are a generation step's new ones and every layer reads and extends its KV cache."""
        x = self.embed(tokens)  # [b, s, hidden]
        if self.cfg.qkv_format == "sbhd":
            x = x.transpose(0, 1)
        for layer in self.layers:
            # Layers called plainly outside a KV-cache step, so wrappers that take one tensor (activation
            # checkpointing, FSDP) keep working.
            x = layer(x) if inference_params is None else layer(x, inference_params=inference_params)
        logits = self.head(self.ln_f(x))
        return logits.transpose(0, 1) if self.cfg.qkv_format == "sbhd" else logits

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy, in fp32.

        Written with log_softmax + gather rather than F.cross_entropy: PyTorch's NLLLoss has no
        deterministic CUDA implementation (it raises under torch.use_deterministic_algorithms), while
        gather's backward adds each gradient once here (one target per row), so it is reproducible.
        """
        logp = self(tokens).float().log_softmax(dim=-1)
        return -logp.gather(-1, targets.unsqueeze(-1)).mean()

    def attention_backends(self) -> List[Optional[str]]:
        """The backend each layer's attention used on its most recent call."""
        return [layer.attention.last_backend for layer in self.layers]
