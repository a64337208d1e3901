"""The modules' ``device`` argument: None (the default) is CUDA when CUDA is available, else the CPU;
an explicit device is kept, and an explicit CUDA device on a machine without CUDA is refused by name.

TransformerEngine's modules default to ``"cuda"``; tools that build them without a device (Hugging
Face Accelerate's ``convert_model``, Lightning's layer replacement) then fail on a CPU machine, where
these modules run. Every public class of ``transformer_engine.pytorch`` with a ``device`` argument is
covered (a new one must be added to CONSTRUCTORS), and the parameter-holding modules without one
(DotProductAttention's softmax offset, RotaryPositionEmbedding's frequencies) follow the same default.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import transformer_engine.pytorch as te

DEFAULT = "cuda" if torch.cuda.is_available() else "cpu"
REFUSED = "`device` must be an available device, got cuda but CUDA is not available (pass device='cpu')"

#: name -> a constructor taking the device keyword(s), at small sizes (TransformerEngine's argument order).
CONSTRUCTORS = {
    "Linear": lambda **kw: te.Linear(32, 16, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(32, 16, **kw),
    "LayerNorm": lambda **kw: te.LayerNorm(32, **kw),
    "RMSNorm": lambda **kw: te.RMSNorm(32, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(32, 64, **kw),
    "MultiheadAttention": lambda **kw: te.MultiheadAttention(32, 4, **kw),
    "TransformerLayer": lambda **kw: te.TransformerLayer(32, 64, 4, **kw),
    "InferenceParams": lambda **kw: te.InferenceParams(2, 16, 2, 8, dtype=torch.float32, **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(2, 32, 16, **kw),
}


def _with_device_argument():
    return sorted(name for name, obj in vars(te).items() if inspect.isclass(obj) and not name.startswith("_")
                  and "device" in inspect.signature(obj.__init__).parameters)


PRESENT = [name for name in CONSTRUCTORS if hasattr(te, name)]


def _tensors(obj):
    """Where the object keeps its tensors: a module's parameters and buffers, or an InferenceParams' device."""
    if isinstance(obj, torch.nn.Module):
        tensors = list(obj.parameters()) + list(obj.buffers())
        assert tensors, f"{type(obj).__name__} holds no tensor to check"
        return {t.device.type for t in tensors}
    return {obj.device.type}


def test_every_class_with_a_device_argument_is_covered():
    found = _with_device_argument()
    assert {"Linear", "LayerNormLinear", "LayerNorm", "RMSNorm", "InferenceParams"} <= set(found), found
    assert set(found) <= set(CONSTRUCTORS), f"add to CONSTRUCTORS: {sorted(set(found) - set(CONSTRUCTORS))}"


@pytest.mark.parametrize("name", PRESENT)
def test_default_device_is_cuda_when_available_else_cpu(name):
    assert inspect.signature(getattr(te, name).__init__).parameters["device"].default is None
    assert _tensors(CONSTRUCTORS[name]()) == {DEFAULT}
    assert _tensors(CONSTRUCTORS[name](device=None)) == {DEFAULT}


@pytest.mark.parametrize("name", PRESENT)
def test_explicit_device_is_kept_and_cuda_without_cuda_is_refused(name):
    assert _tensors(CONSTRUCTORS[name](device="cpu")) == {"cpu"}
    assert _tensors(CONSTRUCTORS[name](device=torch.device("cpu"))) == {"cpu"}
    if torch.cuda.is_available():
        assert _tensors(CONSTRUCTORS[name](device="cuda")) == {"cuda"}
    else:
        with pytest.raises(ValueError) as err:
            CONSTRUCTORS[name](device="cuda")
        assert str(err.value) == REFUSED


def test_modules_without_a_device_argument_follow_the_same_default():
    dpa = te.DotProductAttention(4, 8, softmax_type="learnable")
    assert dpa.softmax_offset.device.type == DEFAULT
    rope = te.RotaryPositionEmbedding(8)
    assert rope.inv_freq.device.type == DEFAULT
