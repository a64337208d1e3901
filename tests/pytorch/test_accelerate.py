"""Hugging Face Accelerate's TransformerEngine backend on this package (CPU).

Accelerate finds TransformerEngine through the distribution metadata ``transformer-engine``, which this
package (distribution ``deterministic-attention``) provides only through the metadata-only alias in
shims/transformer-engine. The alias is built here into a wheel and unpacked into a temporary folder
put first on ``sys.path`` (or a subprocess's PYTHONPATH), so nothing is installed globally. With it,
Accelerate detects the package, ``prepare`` converts a small BERT's ``nn.Linear`` / ``nn.LayerNorm``
to ours, and ``Accelerator(mixed_precision="fp8")`` trains it with every GEMM of those layers in FP8
(counted), bitwise the same twice and close to the float32 run, and ``has_transformer_engine_layers`` finds
our Linear, LayerNorm and TransformerLayer. Without it, Accelerate refuses FP8.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import TERecipeKwargs  # noqa: E402

import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch import quantization_linear  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "shims" / "transformer-engine"
STEPS = 10
DEFAULT = "cuda" if torch.cuda.is_available() else "cpu"  # the modules' default device (and Accelerate's)
FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


def _visible_transformer_engine_distribution() -> bool:
    try:
        importlib.metadata.distribution("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def shim_wheel(tmp_path_factory) -> Path:
    """The alias's wheel, built by pip from a copy of shims/transformer-engine laid out as in a checkout
    (its setup.py reads transformer_engine/common/version.py two folders up), so the tree stays clean."""
    root = tmp_path_factory.mktemp("shim_src")
    shutil.copytree(SHIM, root / "shims" / "transformer-engine",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    (root / "transformer_engine" / "common").mkdir(parents=True)
    shutil.copy(REPO / "transformer_engine" / "common" / "version.py", root / "transformer_engine" / "common")
    out = tmp_path_factory.mktemp("shim_wheel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                           "-w", str(out), str(root / "shims" / "transformer-engine")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def shim_site(shim_wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own: a metadata-only wheel's install is its unpacking."""
    site = tmp_path_factory.mktemp("shim_site")
    with zipfile.ZipFile(shim_wheel) as whl:
        whl.extractall(site)
    return site


@pytest.fixture
def with_shim(shim_site, monkeypatch):
    monkeypatch.syspath_prepend(str(shim_site))  # also invalidates the import system's caches
    yield shim_site


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps one state per process; each test (and each run in one) builds its own."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_the_alias_is_metadata_only_and_names_this_package(shim_wheel, shim_site):
    names = zipfile.ZipFile(shim_wheel).namelist()
    dist_info = f"transformer_engine-{transformer_engine.__version__}.dist-info"
    assert names and all(n.startswith(dist_info + "/") for n in names), names  # no module, no other file
    record = (shim_site / dist_info / "RECORD").read_text().splitlines()
    assert all(line.startswith(dist_info + "/") for line in record), record  # pip uninstall removes only these
    dist = importlib.metadata.Distribution.at(shim_site / dist_info)
    assert dist.metadata["Name"] == "transformer-engine"
    # The version Megatron-core reads from the module: the TE API level, with our version as local label.
    assert dist.version == transformer_engine.__version__ == f"{transformer_engine.te_api_level}+da" \
        f"{transformer_engine.package_version}"
    assert "deterministic-attention" in dist.metadata["Summary"] and "NVIDIA" in dist.metadata["Summary"]
    assert sorted(dist.requires) == sorted([
        f"deterministic-attention=={transformer_engine.package_version}",
        f'deterministic-attention[pytorch]=={transformer_engine.package_version}; extra == "pytorch"',
        f'deterministic-attention[jax]=={transformer_engine.package_version}; extra == "jax"'])


def test_accelerate_detects_the_package_through_the_alias(with_shim):
    from accelerate.utils import is_fp8_available, is_transformer_engine_available, is_transformer_engine_mxfp8_available

    assert importlib.metadata.version("transformer-engine") == transformer_engine.__version__
    assert importlib.metadata.version("transformer_engine") == transformer_engine.__version__
    assert is_transformer_engine_available() and is_fp8_available()
    # Accelerate asks the package itself whether MXFP8 runs: not implemented here, and it says why.
    assert is_transformer_engine_mxfp8_available() is False
    assert Accelerator(mixed_precision="fp8").fp8_backend == "TE"


# Without the alias, in a fresh interpreter: what Accelerate does when it cannot see the package. When
# this environment has a transformer-engine distribution installed, it is hidden from the metadata
# lookups (not uninstalled) so that the case is the one a user without the alias meets.
_WITHOUT_SHIM = r"""
import importlib.metadata as md, json, sys
if sys.argv[1] == "hide":
    _from_name = md.Distribution.from_name.__func__
    def from_name(cls, name):
        if name.lower().replace("_", "-") == "transformer-engine":
            raise md.PackageNotFoundError(name)
        return _from_name(cls, name)
    md.Distribution.from_name = classmethod(from_name)
import torch
from accelerate import Accelerator
from accelerate.utils import is_transformer_engine_available
from accelerate.utils.transformer_engine import convert_model
out = {"find_spec": __import__("importlib.util").util.find_spec("transformer_engine") is not None,
       "available": is_transformer_engine_available()}
try:
    Accelerator(mixed_precision="fp8")
    out["fp8"] = "accepted"
except Exception as err:
    out["fp8"] = f"{type(err).__name__}: {err}"
try:
    convert_model(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    out["convert"] = "converted"
except Exception as err:
    out["convert"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def test_without_the_alias_accelerate_refuses_fp8():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    hide = "hide" if _visible_transformer_engine_distribution() else "as-is"
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_SHIM, hide], capture_output=True, text=True, env=env,
                          cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["find_spec"] is True  # the module is there; only the distribution name is not
    assert out["available"] is False
    assert out["fp8"] == "ValueError: Using `fp8` precision requires `transformer_engine` or `torchao` to be installed."
    assert out["convert"] == "ImportError: Using `convert_model` requires transformer_engine to be installed."


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, tie_word_embeddings=False,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _train(mixed_precision: str, model=None, handlers=None):
    """(losses, final parameters, the prepared model, the accelerator) of STEPS AdamW steps."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = _bert() if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (2, 16), generator=data).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], model, accelerator


def test_prepare_converts_linear_and_layernorm_and_fp8_trains_bitwise(with_shim, monkeypatch):
    from accelerate.utils import has_transformer_engine_layers

    plain = _bert()
    n_linear = sum(type(m) is torch.nn.Linear for m in plain.modules())
    n_norm = sum(type(m) is torch.nn.LayerNorm for m in plain.modules())
    assert (n_linear, n_norm) == (14, 6)

    # Every FP8 GEMM of the Linear layers: the operands' dtypes, and torch's scaled GEMM really called.
    seen, scaled_mm_calls = [], [0]
    scaled_gemm, scaled_mm = quantization_linear.scaled_gemm, torch._scaled_mm

    def counting_gemm(a, b, *args, **kwargs):
        seen.append((a.data.dtype, b.data.dtype))
        return scaled_gemm(a, b, *args, **kwargs)

    def counting_scaled_mm(*args, **kwargs):
        scaled_mm_calls[0] += 1
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(quantization_linear, "scaled_gemm", counting_gemm)
    monkeypatch.setattr(torch, "_scaled_mm", counting_scaled_mm)

    losses, params, model, accelerator = _train("fp8", model=plain)
    assert accelerator.fp8_backend == "TE" and accelerator.state.mixed_precision == "fp8"
    # prepare converted every layer (all dims are multiples of 16; the weights are copied: test below)
    assert sum(type(m) is te.Linear for m in model.modules()) == n_linear
    assert sum(type(m) is te.LayerNorm for m in model.modules()) == n_norm
    assert not any(type(m) in (torch.nn.Linear, torch.nn.LayerNorm) for m in model.modules())
    assert {p.device.type for p in model.parameters()} == {DEFAULT}
    assert has_transformer_engine_layers(model) is True
    # three GEMMs (forward, dgrad, wgrad) per Linear per step, each on FP8 operands through torch's kernel
    assert len(seen) == scaled_mm_calls[0] == 3 * n_linear * STEPS
    assert all(set(pair) <= FP8_DTYPES for pair in seen), set(seen)
    assert {torch.float8_e4m3fn, torch.float8_e5m2} <= {d for pair in seen for d in pair}  # HYBRID: E5M2 grads

    again, params_again, _, _ = _train("fp8")
    assert torch.equal(losses, again)
    assert all(torch.equal(a, b) for a, b in zip(params, params_again))

    monkeypatch.setattr(quantization_linear, "scaled_gemm", scaled_gemm)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    reference, _, fp32_model, _ = _train("no")
    assert not any(type(m) is te.Linear for m in fp32_model.modules())  # no FP8: nothing converted
    assert torch.isfinite(losses).all()
    # The data is learnable (each token's label is itself) and the model learns it, so the comparison below
    # means something: loss 4.85 -> 4.25 over 10 steps, measured on CPU.
    assert reference[-1] < reference[0] - 0.4 and losses[-1] < losses[0] - 0.4, (losses, reference)
    # FP8 (E4M3 forward, E5M2 gradients) against float32 over 10 steps: measured 0.017 on CPU, against a drop of 0.6
    assert (losses - reference).abs().max() < 0.02, (losses, reference)


def test_converted_model_starts_from_the_same_weights(with_shim):
    """convert_model copies each layer's parameters; under FP8 autocast off, the converted model computes
    what the original does (float32; our LayerNorm and Linear are plain torch math)."""
    from accelerate.utils.transformer_engine import convert_model

    Accelerator()  # convert_model reads Accelerate's state (whether parameters are sharded)
    plain = _bert().to(DEFAULT).eval()  # converted layers are built on the default device
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2)).to(DEFAULT)
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
        before = {k: v.clone() for k, v in plain.state_dict().items()}
        convert_model(plain)
        # The converted layers add their (empty: no FP8 ran) FP8 state entries, as TransformerEngine's do.
        after = {k: v for k, v in plain.state_dict().items() if not k.endswith("._extra_state")}
        got = plain(input_ids=ids).logits
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_has_transformer_engine_layers_answers_for_our_modules(with_shim):
    """Accelerate looks for te.LayerNorm, te.Linear and te.TransformerLayer (not for DotProductAttention or
    RMSNorm, which it never converts to)."""
    from accelerate.utils import has_transformer_engine_layers

    assert has_transformer_engine_layers(_bert()) is False
    assert has_transformer_engine_layers(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))) is False
    assert has_transformer_engine_layers(torch.nn.Sequential(te.Linear(16, 16))) is True
    assert has_transformer_engine_layers(torch.nn.Sequential(torch.nn.Linear(16, 16), te.LayerNorm(16))) is True
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    assert has_transformer_engine_layers(torch.nn.ModuleList([layer])) is True
    assert has_transformer_engine_layers(torch.nn.Sequential(te.DotProductAttention(4, 8), te.RMSNorm(16))) is False


def test_mxfp8_request_is_refused_with_our_reason(with_shim):
    with pytest.raises(ValueError, match=r"MXFP8 block scaling is not available: MXFP8 \(MXFP8BlockScaling\) needs "
                                         r"Blackwell"):
        _train("fp8", handlers=[TERecipeKwargs(use_mxfp8_block_scaling=True)])


def test_example_trains_in_fp8_bitwise(shim_site):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("ACCELERATE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(shim_site), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "accelerate_fp8.py"), "--steps", "4"],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Accelerate's mixed precision: fp8; converted to transformer_engine.pytorch: 14 Linear, 6 LayerNorm" \
        in proc.stdout, proc.stdout
    assert "two FP8 runs bitwise equal: True" in proc.stdout, proc.stdout
