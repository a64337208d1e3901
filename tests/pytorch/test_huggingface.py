"""The Hugging Face adapter: a transformers model on DotProductAttention matches the same model on
transformers' own attention, with and without padding, packed, and through backward."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dpa_helpers import DEVICE, INTERPRET, ON_GPU  # noqa: E402
from transformer_engine.pytorch.integrations import huggingface  # noqa: E402

DTYPE = torch.float32 if not ON_GPU else torch.bfloat16
TOL = dict(atol=2e-5, rtol=1e-4) if DTYPE == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _models(sliding_window=None):
    """The same tiny Llama (GQA, 2 layers) on our attention and on eager attention, equal weights."""
    huggingface.register()
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    # Each model gets its own config: transformers records the attention implementation in it.
    ours = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config),
                                                      attn_implementation=huggingface.ATTN_IMPLEMENTATION)
    theirs = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="eager")
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == huggingface.ATTN_IMPLEMENTATION
    assert theirs.config._attn_implementation == "eager"
    return ours.to(DEVICE, DTYPE).eval(), theirs.to(DEVICE, DTYPE).eval()


def _tokens(batch, seq, seed=1):
    return torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_model_matches_eager_without_padding():
    ours, theirs = _models()
    ids = _tokens(2, 11)
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, **TOL)


@pytest.mark.parametrize("side", ["right", "left"])
def test_model_matches_eager_with_padding(side):
    ours, theirs = _models()
    ids = _tokens(3, 12)
    mask = torch.ones_like(ids)
    for row, length in enumerate((12, 7, 4)):
        if side == "right":
            mask[row, length:] = 0
        else:
            mask[row, : 12 - length] = 0
    got, want = ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], **TOL)


def test_backward_matches_eager():
    ours, theirs = _models()
    ids = _tokens(2, 9)
    for model in (ours, theirs):
        model.train()
        model(ids, labels=ids).loss.backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_packed_sequences_match_separate_ones():
    """DataCollatorWithFlattening's route: one row, cu_seq_lens and max_length kwargs, no mask."""
    ours, _ = _models()
    lengths = (5, 8, 3)
    seqs = [_tokens(1, n, seed=i) for i, n in enumerate(lengths)]
    ids = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    cu = torch.tensor([0, 5, 13, 16], dtype=torch.int32, device=DEVICE)
    packed = ours(ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8,
                  max_length_k=8).logits
    separate = torch.cat([ours(s).logits for s in seqs], dim=1)
    torch.testing.assert_close(packed, separate, **TOL)


def test_padding_mask_to_cu_seqlens():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]])
    indices, cu, max_seqlen = huggingface.padding_mask_to_cu_seqlens(mask)
    assert indices.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert cu.tolist() == [0, 3, 6, 7] and cu.dtype == torch.int32
    assert max_seqlen == 3


def test_four_dimensional_mask_is_refused_with_a_hint():
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="register"):
        huggingface.attention_forward(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_every_attention_layer_runs_through_the_adapter(monkeypatch):
    ours, _ = _models()
    backends = []
    forward = huggingface.attention_forward

    def spy(module, *args, **kwargs):
        out = forward(module, *args, **kwargs)
        backends.append(huggingface._dpa(4, 2, 16, 16, "bshd", "causal", None, 16 ** -0.5, 0.0).last_backend)
        return out

    monkeypatch.setattr(huggingface, "attention_forward", spy)
    huggingface.register()
    try:
        ours(_tokens(1, 6))
    finally:
        monkeypatch.undo()
        huggingface.register()
    expected = {"FusedAttention"} if INTERPRET and not ON_GPU else {"UnfusedDotProductAttention"}
    assert len(backends) == 2, backends  # one per layer
    assert set(backends) == expected or (ON_GPU and set(backends) <= {"FusedAttention", "FlashAttention"}), backends
