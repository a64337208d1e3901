"""Megatron-core (0.19.2, unchanged) training in FP8 on this package: the tiny GPT of test_megatron_gpt.py with
the TransformerEngine layer spec and ``fp8="hybrid"``, under each ``fp8_recipe`` Megatron maps onto
TransformerEngine's recipes ("delayed" -> DelayedScaling, "tensorwise" -> Float8CurrentScaling,
"blockwise" -> Float8BlockScaling). Megatron enters our ``fp8_autocast`` itself (fp8_utils.get_fp8_context).

Each recipe trains 20 steps twice from the same seed with bitwise equal losses and parameters, its losses stay
within 2% of the same model trained in fp32, its Linear/LayerNormLinear GEMMs ran in FP8 (counted), and no
warning is raised."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.19.2)", allow_module_level=True)

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch import quantization_linear as ql  # noqa: E402
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # noqa: E402

from test_megatron_gpt import SEQ, VOCAB, _ScoreBuffer, _config, megatron_world  # noqa: E402,F401  (shared)
from test_megatron_gpt import _train as train_gpt  # noqa: E402

STEPS = 20  # the tiny GPT of test_megatron_gpt.py (its VOCAB, SEQ, BATCH, LR), trained longer


def _build(fp8_recipe, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    config = _config(torch.float32, "cpu")
    if fp8_recipe is not None:
        config = dataclasses.replace(config, fp8="hybrid", fp8_recipe=fp8_recipe)
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    return model


def _train(model):
    return train_gpt(model, "cpu", STEPS)


@pytest.fixture(scope="module")
def fp32_losses(megatron_world):  # noqa: F811
    megatron_world._GLOBAL_MEMORY_BUFFER = _ScoreBuffer("cpu")
    return _train(_build(None))[0]


@pytest.mark.parametrize("fp8_recipe", ["delayed", "tensorwise", "blockwise"])
def test_megatron_gpt_trains_in_fp8_bitwise_twice_and_like_fp32(megatron_world, fp32_losses, fp8_recipe,  # noqa: F811
                                                                 monkeypatch):
    from megatron.core.fp8_utils import get_fp8_recipe

    megatron_world._GLOBAL_MEMORY_BUFFER = _ScoreBuffer("cpu")
    expected = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
                "blockwise": "Float8BlockScaling"}[fp8_recipe]
    runs = []
    for _ in range(2):
        FP8GlobalStateManager.reset()
        model = _build(fp8_recipe)
        rec = get_fp8_recipe(model.config)
        assert expected in [c.__name__ for c in type(rec).__mro__]
        calls = []
        real = ql.fp8_linear

        def counted(*args, **kwargs):
            calls.append(args[2].recipe)
            return real(*args, **kwargs)

        monkeypatch.setattr("transformer_engine.pytorch.module.linear.fp8_linear", counted)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs.append(_train(model))
        relevant = [str(w.message) for w in caught if "megatron" in w.filename or "transformer_engine" in w.filename]
        assert not relevant, relevant
        # 2 layers x (qkv, proj, fc1, fc2) per step, every one in FP8 under the recipe Megatron built
        assert len(calls) == STEPS * 2 * 4
        assert all(type(r).__name__ == type(rec).__name__ for r in calls)
    (losses1, params1), (losses2, params2) = runs
    assert torch.equal(losses1, losses2), (losses1, losses2)
    assert all(torch.equal(params1[k], params2[k]) for k in params1)
    assert torch.isfinite(losses1).all()
    rel = ((losses1 - fp32_losses).abs() / fp32_losses.abs()).max().item()
    print(f"{fp8_recipe}: max relative loss difference to fp32 {rel:.4f}")
    assert rel <= 0.02, (rel, losses1, fp32_losses)
    # FP8 changed the numbers (it is not the fp32 run relabelled)
    assert not torch.equal(losses1, fp32_losses)
