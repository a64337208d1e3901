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


@pytest.mark.parametrize("fp8_recipe", ["delayed", "tensorwise", "blockwise"])
def test_megatron_checkpoint_resume_in_fp8_is_bitwise(megatron_world, fp8_recipe, tmp_path):  # noqa: F811
    """Megatron's checkpoint of the model (``state_dict_for_save_checkpoint``, what its ``--ckpt-format torch``
    saves, with ``torch.save``; the ``_extra_state`` entries carry the FP8 state) at step K, loaded into a fresh
    model in strict mode and trained on to N: bitwise the uninterrupted run (losses, parameters, FP8 states).
    Under delayed scaling the same resume without the FP8 state differs (the control). (Megatron's
    ``dist_checkpointing`` torch_dist writer calls CUDA unconditionally, so it does not run on a CPU.)"""
    from test_megatron_gpt import BATCH

    megatron_world._GLOBAL_MEMORY_BUFFER = _ScoreBuffer("cpu")
    n, k = 5, 2
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(n)]
    position_ids = torch.arange(SEQ)[None].expand(BATCH, -1)
    mask = torch.triu(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool), 1)

    def train(model, steps):  # SGD keeps no optimizer state
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in steps:
            # Megatron's schedules do this each step: the FP8 weights are quantized again from the updated
            # weights (otherwise the cache of a model's first step would be reused, and a resumed model's
            # first step would cache different weights than the uninterrupted run uses).
            model.set_is_first_microbatch()
            opt.zero_grad()
            loss = model(data[step], position_ids, mask, labels=torch.roll(data[step], -1, dims=1)).float().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    def fp8_states(model):
        out = {}
        for name, mod in model.named_modules():
            if isinstance(mod, te.module.base.TransformerEngineBaseModule):
                for attr in mod._fp8_state_attrs():
                    st = mod.__dict__.get(attr)
                    if st is not None and st.fwd_meta is not None:
                        for d, meta in (("fwd", st.fwd_meta), ("bwd", st.bwd_meta)):
                            out[f"{name}.{attr}.{d}.scale"] = meta.scale.clone()
                            out[f"{name}.{attr}.{d}.amax_history"] = meta.amax_history.clone()
        return out

    FP8GlobalStateManager.reset()
    ref = _build(fp8_recipe)
    ref_losses = train(ref, range(n))
    FP8GlobalStateManager.reset()
    first = _build(fp8_recipe)
    train(first, range(k))
    torch.save({"model": first.state_dict_for_save_checkpoint()}, tmp_path / "ckpt.pt")

    def resumed(keep_fp8_state):
        FP8GlobalStateManager.reset()
        model = _build(fp8_recipe, seed=1)
        state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
        if not keep_fp8_state:
            state = {key: v for key, v in state.items() if not key.endswith("_extra_state")}
        model.load_state_dict(state, strict=keep_fp8_state)
        return model, train(model, range(k, n))

    model, losses = resumed(True)
    assert torch.equal(losses, ref_losses[k:]), (losses, ref_losses[k:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    got, want = fp8_states(model), fp8_states(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)
    if fp8_recipe == "delayed":
        assert len(want) == 2 * 4 * 4  # 2 layers x 4 GEMMs x (scale, history) x (fwd, bwd)
        _, control = resumed(False)
        assert not torch.equal(control, ref_losses[k:])
    else:
        assert not want
