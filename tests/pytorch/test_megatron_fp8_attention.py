"""Megatron-core's tiny GPT with the TransformerEngine layer spec, fp8="hybrid" and fp8_dot_product_attention=True:
its core attention runs this package's FP8 attention kernels (under Triton's interpreter on CPU), and two trainings
from the same seed give bitwise equal losses and parameters. Skipped without megatron-core (qa/L0_newest runs it)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.19.2)", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("FP8 attention on CPU needs TRITON_INTERPRET=1", allow_module_level=True)

import transformer_engine.pytorch as te  # noqa: E402

from test_megatron_gpt import SEQ, STEPS, VOCAB, _ScoreBuffer, _train, megatron_world  # noqa: E402,F401  (shared)


def _build(device, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=2, ffn_hidden_size=64, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
        deterministic_mode=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        fp8="hybrid", fp8_recipe="delayed", fp8_dot_product_attention=True,
    )
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    return model.to(device=device, dtype=dtype)


def test_te_spec_gpt_with_fp8_dot_product_attention_trains_bitwise_twice(megatron_world):
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    megatron_world._GLOBAL_MEMORY_BUFFER = _ScoreBuffer(device)
    first = _build(device)
    dpas = [m for m in first.modules() if isinstance(m, te.DotProductAttention)]
    assert len(dpas) == 2
    losses1, params1 = _train(first, device)
    # every core attention ran the FP8 kernels and kept its own amax history
    assert all(m.last_backend == "FusedAttention(FP8)" for m in dpas)
    assert all(m._fp8_attention_state.steps == STEPS for m in dpas)
    losses2, params2 = _train(_build(device), device)
    assert torch.isfinite(losses1).all()
    assert torch.equal(losses1, losses2), (losses1, losses2)
    assert all(torch.equal(params1[k], params2[k]) for k in params1)
