"""A whole model in batch-invariant mode: a small language model of TransformerLayers (RMSNorm, SwiGLU, GQA, RoPE)
with a final norm and an output Linear gives every sequence the same logits, bit for bit, when it is scored in a
batch of 8, alone, or decoded token by token through the KV cache, and the same input gradients in a batch and
alone. Its GEMMs and norms run on the batch-invariant kernels, its attention on the fused kernels (Triton's
interpreter on CPU, whose dot is a fixed-order sum)."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the batch-invariant kernels run on CUDA or under TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, FFN, HEADS, GROUPS, D, VOCAB, LAYERS = 32, 64, 2, 1, 16, 40, 2


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, normalization="RMSNorm",
                                activation="swiglu", attn_input_format="bshd", hidden_dropout=0.0,
                                attention_dropout=0.0, layer_number=i + 1, device=DEVICE)
            for i in range(LAYERS))
        self.norm = te.RMSNorm(HIDDEN, device=DEVICE)
        self.head = te.Linear(HIDDEN, VOCAB, bias=False, device=DEVICE)
        self.rope = te.RotaryPositionEmbedding(D)(32)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.05 * torch.randn_like(p))

    def forward(self, x, **kw):
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=self.rope, **kw)
        return self.head(self.norm(x))


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def _seqs(n=8, length=9):
    gen = torch.Generator().manual_seed(5)
    return torch.randn(n, length, HIDDEN, generator=gen).to(DEVICE)


def test_logits_and_input_gradients_in_a_batch_of_8_equal_each_sequence_alone():
    model = TinyLM().eval()
    x = _seqs()
    dlogits = torch.randn(x.shape[0], x.shape[1], VOCAB, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with te.batch_invariant():
        xb = x.clone().requires_grad_()
        batch = model(xb)
        batch.backward(dlogits)
        for i in (0, 3, 7):
            xi = x[i:i + 1].clone().requires_grad_()
            alone = model(xi)
            alone.backward(dlogits[i:i + 1])
            assert torch.equal(alone[0], batch[i].detach()), i
            assert torch.equal(xi.grad[0], xb.grad[i]), i


def test_kv_cache_decode_token_by_token_equals_the_training_logits():
    model = TinyLM().eval()
    x = _seqs(n=3, length=7)
    prompts = (3, 1, 4)
    with torch.no_grad(), te.batch_invariant():
        train = model(x)
        params = te.InferenceParams(3, 16, GROUPS, D, torch.float32, qkv_format="bshd")
        pos, got = [0, 0, 0], [[], [], []]
        while any(p < x.shape[1] for p in pos):
            step = OrderedDict((i, prompts[i] if pos[i] == 0 else 1) for i in range(3) if pos[i] < x.shape[1])
            params.pre_step(step)
            inp = torch.zeros(len(step), max(step.values()), HIDDEN, device=DEVICE)
            for b, (i, n) in enumerate(step.items()):
                inp[b, :n] = x[i, pos[i]:pos[i] + n]
            out = model(inp, inference_params=params)
            for b, (i, n) in enumerate(step.items()):
                got[i].append(out[b, :n])
                pos[i] += n
    for i in range(3):
        rows = torch.cat(got[i])
        bad = (rows != train[i]).any(-1).nonzero().flatten().tolist()
        assert not bad, f"sequence {i}: logits of positions {bad} differ by up to {(rows - train[i]).abs().max()}"


def test_the_same_model_outside_the_mode_differs_only_by_rounding():
    model = TinyLM().eval()
    x = _seqs(n=2)
    with torch.no_grad():
        default = model(x)
        with te.batch_invariant():
            invariant = model(x)
    torch.testing.assert_close(invariant, default, atol=1e-5, rtol=1e-5)


def test_determinism_check_reports_whole_model_batch_invariance(monkeypatch):
    import io

    from transformer_engine.pytorch import determinism_check as check

    args = check._parser().parse_args(["--batch-invariant", "--steps", "1", "--seq-len", "8", "--batch-size", "3",
                                       "--no-reference", "--quiet"]
                                      + (["--fused-interpreter"] if DEVICE == "cpu" else []))
    result = check.run_check(args, out=io.StringIO(), err=io.StringIO())
    probe = result.extra["batch_invariance"]
    assert probe["bitwise"] and probe["sequences"] == 3 and probe["positions_decoded"] == 8, probe
    assert result.exit_status == 0 and "Whole-model batch invariance" in result.message
    assert result.to_json()["batch_invariance"] == probe
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        args = check._parser().parse_args(["--batch-invariant", "--steps", "1", "--no-reference", "--quiet",
                                           "--device", "cpu"])
        with pytest.raises(ValueError, match="--batch-invariant"):
            check.run_check(args, out=io.StringIO(), err=io.StringIO())
