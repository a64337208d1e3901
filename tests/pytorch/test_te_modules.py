"""LayerNorm, RMSNorm, Linear, LayerNormLinear with TransformerEngine's signatures and semantics.

Each module is checked against the formula it implements computed in fp64 (forward and every
gradient), for TransformerEngine's return conventions (return_bias, return_layernorm_output,
zero_centered_gamma), bitwise against a second run, and on 2 gloo ranks against the single-rank
module (tests/pytorch/distributed/te_modules_tp.py). FP8 is tested in tests/pytorch/test_fp8_*.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import fp8 as te_fp8
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, get_all_rng_states

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEVICE = "cpu"


def _randomize(module, seed=3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype))


def _fwd_bwd(module, x, weights=None):
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    if weights is None:
        gen = torch.Generator().manual_seed(9)
        weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights) if o.numel()).backward()
    return [o.detach() for o in outs], x.grad, {n: p.grad for n, p in module.named_parameters()}, weights


def _ref_norm(x, weight, bias, eps, normalization, zero_centered_gamma):
    if normalization == "LayerNorm":
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    else:
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    y = y * ((1 + weight) if zero_centered_gamma else weight)
    return y + bias if bias is not None else y


def _fp64_grads(fn, inputs, weights):
    """Gradients of sum(fn(*inputs)_i * weights_i) in fp64."""
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o * w.double()).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs], [t.grad if t is not None else None for t in leaves]


def _close_to_fp64(got, ref, dtype):
    # fp32 results against the fp64 formula: TransformerEngine-level fp32 agreement
    # (torch.testing's fp32 defaults scaled by the reduction length, 32 here).
    tol = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol[0], atol=tol[1])


# --- normalization ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_norm_matches_fp64_formula(cls, zero_centered_gamma, dtype):
    norm = cls(32, eps=1e-5, zero_centered_gamma=zero_centered_gamma, params_dtype=dtype, device=DEVICE)
    _randomize(norm)
    x = torch.randn(5, 3, 32, dtype=dtype, generator=torch.Generator().manual_seed(1))
    outs, dx, grads, weights = _fwd_bwd(norm, x)
    normalization = "LayerNorm" if cls is te.LayerNorm else "RMSNorm"
    ref_outs, ref_grads = _fp64_grads(
        lambda x, w, b: _ref_norm(x, w, b, 1e-5, normalization, zero_centered_gamma),
        [x, norm.weight, norm.bias], weights)
    _close_to_fp64(outs[0], ref_outs[0], dtype)
    _close_to_fp64(dx, ref_grads[0], dtype)
    _close_to_fp64(grads["weight"], ref_grads[1], dtype)
    if cls is te.LayerNorm:
        _close_to_fp64(grads["bias"], ref_grads[2], dtype)
    else:
        assert norm.bias is None and "bias" not in grads


def test_zero_centered_gamma_starts_at_zero_and_scales_by_one_plus_weight():
    plain = te.LayerNorm(16, device=DEVICE)
    centered = te.LayerNorm(16, zero_centered_gamma=True, device=DEVICE)
    assert torch.equal(plain.weight, torch.ones(16)) and torch.equal(centered.weight, torch.zeros(16))
    x = torch.randn(4, 16)
    assert torch.equal(plain(x), centered(x))  # 1 + 0 == 1: the same scale, the same bits
    rms = te.RMSNorm(16, zero_centered_gamma=True, device=DEVICE)
    assert rms.bias is None and torch.equal(rms.weight, torch.zeros(16))


def test_norm_keeps_bf16_input_dtype_and_computes_in_fp32():
    norm = te.RMSNorm(64, device=DEVICE)
    _randomize(norm)
    x = torch.randn(8, 64).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    ref = _ref_norm(x.double(), norm.weight.double(), None, 1e-5, "RMSNorm", False)
    # fp32 compute then one rounding to bf16: within half a bf16 ulp (2**-8 relative) of fp64.
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-30).all()


# --- linear ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_fp64_formula(bias, dtype):
    lin = te.Linear(32, 24, bias=bias, params_dtype=dtype, device=DEVICE)
    _randomize(lin)
    x = torch.randn(7, 2, 32, dtype=dtype, generator=torch.Generator().manual_seed(2))
    outs, dx, grads, weights = _fwd_bwd(lin, x)
    ref_outs, ref_grads = _fp64_grads(lambda x, w, b: x @ w.t() + (b if b is not None else 0),
                                      [x, lin.weight, lin.bias], weights)
    _close_to_fp64(outs[0], ref_outs[0], dtype)
    _close_to_fp64(dx, ref_grads[0], dtype)
    _close_to_fp64(grads["weight"], ref_grads[1], dtype)
    if bias:
        _close_to_fp64(grads["bias"], ref_grads[2], dtype)


def test_linear_return_bias_returns_the_bias_unadded():
    lin = te.Linear(16, 8, return_bias=True, device=DEVICE)
    _randomize(lin)
    x = torch.randn(3, 16)
    out, bias = lin(x)
    assert bias is lin.bias or torch.equal(bias, lin.bias)
    assert torch.equal(out, x @ lin.weight.t())
    plain = te.Linear(16, 8, device=DEVICE)
    plain.load_state_dict(lin.state_dict())
    assert torch.equal(plain(x), out + bias)
    nobias = te.Linear(16, 8, bias=False, return_bias=True, device=DEVICE)
    out, bias = nobias(x)
    assert bias.numel() == 0  # TransformerEngine returns an empty tensor, not None


def test_linear_defaults_and_init():
    lin = te.Linear(64, 32, device=DEVICE)
    assert lin.weight.shape == (32, 64) and torch.equal(lin.bias, torch.zeros(32))
    assert 0.015 < lin.weight.std().item() < 0.031  # TransformerEngine's default: normal, std 0.023
    seen = []
    te.Linear(8, 4, init_method=lambda w: seen.append(tuple(w.shape)) or torch.nn.init.ones_(w), device=DEVICE)
    assert seen == [(4, 8)]
    col = te.Linear(8, 12, parallel_mode="column", tp_size=2, device=DEVICE)
    row = te.Linear(8, 12, parallel_mode="row", tp_size=2, device=DEVICE)
    assert (col.out_features, col.in_features, tuple(col.weight.shape)) == (6, 8, (6, 8))
    assert (row.out_features, row.in_features, tuple(row.weight.shape), tuple(row.bias.shape)) == (12, 4, (12, 4), (12,))
    assert col.weight.partition_dim == 0 and col.bias.partition_dim == 0 and row.weight.partition_dim == 1
    assert not getattr(row.bias, "tensor_model_parallel", False)
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        col(torch.randn(2, 8))
    with pytest.raises(ValueError, match="`parallel_mode`"):
        te.Linear(8, 4, parallel_mode="diagonal", device=DEVICE)
    with pytest.raises(ValueError, match="`out_features`"):
        te.Linear(8, 5, parallel_mode="column", tp_size=2, device=DEVICE)
    meta = te.Linear(8, 4, device="meta")
    assert meta.weight.is_meta


# The tracker forks CUDA's generator where CUDA is available (as TE's does), else the CPU's.
RNG_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rng_state():
    return torch.cuda.get_rng_state() if RNG_DEVICE == "cuda" else torch.get_rng_state()


def test_linear_init_runs_inside_the_rng_tracker_fork():
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    tracker.add("other", 99)
    torch.manual_seed(0)
    before = _rng_state()
    a = te.Linear(8, 4, get_rng_state_tracker=lambda: tracker, device=RNG_DEVICE)
    assert torch.equal(_rng_state(), before)  # the default stream is untouched
    b = te.Linear(8, 4, get_rng_state_tracker=lambda: tracker, rng_tracker_name="other", device=RNG_DEVICE)
    fresh = CudaRNGStatesTracker()
    fresh.add("model-parallel-rng", 1234)
    with fresh.fork():
        expected = torch.empty(4, 8, device=RNG_DEVICE).normal_(0, 0.023)
    assert torch.equal(a.weight, expected) and not torch.equal(b.weight, expected)


# --- layernorm + linear ----------------------------------------------------------------------

@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_linear_matches_fp64_formula(normalization, zero_centered_gamma):
    mod = te.LayerNormLinear(32, 20, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                             return_layernorm_output=True, device=DEVICE)
    _randomize(mod)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(4))
    outs, dx, grads, weights = _fwd_bwd(mod, x)

    def ref(x, lw, lb, w, b):
        ln = _ref_norm(x, lw, lb, 1e-5, normalization, zero_centered_gamma)
        return ln @ w.t() + b, ln

    ref_outs, ref_grads = _fp64_grads(ref, [x, mod.layer_norm_weight, mod.layer_norm_bias, mod.weight, mod.bias],
                                      weights)
    for got, exp in zip(outs, ref_outs):
        _close_to_fp64(got, exp, torch.float32)
    _close_to_fp64(dx, ref_grads[0], torch.float32)
    for name, exp in zip(["layer_norm_weight", "layer_norm_bias", "weight", "bias"], ref_grads[1:]):
        if exp is not None:
            _close_to_fp64(grads[name], exp, torch.float32)
    assert (mod.layer_norm_bias is None) == (normalization == "RMSNorm")


def test_layernorm_linear_equals_norm_then_linear_and_return_orders():
    mod = te.LayerNormLinear(16, 8, device=DEVICE)
    _randomize(mod)
    norm, lin = te.LayerNorm(16, device=DEVICE), te.Linear(16, 8, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(mod.layer_norm_weight), norm.bias.copy_(mod.layer_norm_bias)
        lin.weight.copy_(mod.weight), lin.bias.copy_(mod.bias)
    x = torch.randn(5, 16)
    assert torch.equal(mod(x), lin(norm(x)))
    both = te.LayerNormLinear(16, 8, return_bias=True, return_layernorm_output=True, device=DEVICE)
    both.load_state_dict(mod.state_dict())
    out, bias, ln_out = both(x)
    assert torch.equal(ln_out, norm(x)) and torch.equal(bias, mod.bias) and torch.equal(out + bias, mod(x))
    with pytest.raises(ValueError, match="`parallel_mode`"):
        te.LayerNormLinear(16, 8, parallel_mode="row", device=DEVICE)
    with pytest.raises(ValueError, match="`normalization`"):
        te.LayerNormLinear(16, 8, normalization="BatchNorm", device=DEVICE)


# --- determinism and tensor parallelism ------------------------------------------------------

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_runs_are_bitwise_equal(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16

    def once():
        torch.manual_seed(5)
        mod = torch.nn.Sequential(te.LayerNormLinear(48, 96, normalization="RMSNorm", device=device),
                                  torch.nn.GELU(), te.Linear(96, 48, device=device), te.LayerNorm(48, device=device))
        mod = mod.to(dtype)
        x = torch.randn(17, 3, 48).to(device=device, dtype=dtype)
        gen = torch.Generator().manual_seed(9)
        weights = [torch.randn(17, 3, 48, generator=gen).to(device=device, dtype=dtype)]
        return _fwd_bwd(mod, x, weights)[:3]

    (o1, dx1, g1), (o2, dx2, g2) = once(), once()
    assert all(torch.equal(a, b) for a, b in zip(o1, o2)) and torch.equal(dx1, dx2)
    assert g1.keys() == g2.keys() and all(torch.equal(g1[k], g2[k]) for k in g1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 on the GPU)")
def test_layernorm_linear_bf16_on_cuda_errs_no_more_than_torch():
    """bf16 on the GPU: the error against fp64 is within twice that of torch's own bf16
    layer_norm + linear on the same inputs (plus one bf16 ulp of the output scale)."""
    mod = te.LayerNormLinear(256, 512, device="cuda", params_dtype=torch.bfloat16)
    _randomize(mod)
    x = torch.randn(64, 4, 256, generator=torch.Generator().manual_seed(6)).cuda().bfloat16()
    out = mod(x)
    p = {n: t.double() for n, t in mod.named_parameters()}
    ref = torch.nn.functional.linear(torch.nn.functional.layer_norm(x.double(), (256,), p["layer_norm_weight"],
                                                                    p["layer_norm_bias"], 1e-5), p["weight"], p["bias"])
    torch_bf16 = torch.nn.functional.linear(
        torch.nn.functional.layer_norm(x, (256,), mod.layer_norm_weight, mod.layer_norm_bias, 1e-5), mod.weight, mod.bias)
    ours, theirs = (out.double() - ref).abs().max().item(), (torch_bf16.double() - ref).abs().max().item()
    assert ours <= 2 * theirs + 2 ** -8 * ref.abs().max().item(), (ours, theirs)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_tensor_parallel_on_two_gloo_ranks_matches_single_rank():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "distributed", "te_modules_tp.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and all(line.startswith("PASS") for line in lines), report
    # column, row, LayerNormLinear x {LayerNorm, RMSNorm}; x sequence_parallel; x return_bias
    assert len(lines) == 4 * 2 * 2, report


# --- refusals --------------------------------------------------------------------------------

def test_blackwell_only_fp8_recipes_are_reported_unavailable_and_refused():
    """FP8 itself runs (tests/pytorch/test_fp8_*.py); MXFP8 and NVFP4 need Blackwell and are refused by name."""
    assert te_fp8.FP8GlobalStateManager.is_fp8_available() == te_fp8.check_fp8_support()
    assert te_fp8.FP8GlobalStateManager.is_mxfp8_available()[0] is False
    assert te_fp8.FP8GlobalStateManager.is_nvfp4_available()[0] is False
    for rec in (recipe.MXFP8BlockScaling(), recipe.NVFP4BlockScaling()):
        with pytest.raises(NotImplementedError, match="Blackwell"):
            with te.fp8_autocast(enabled=True, fp8_recipe=rec):
                pass
    for ctx in (te.fp8_model_init, te.quantized_model_init):
        with ctx(enabled=False):
            pass
        with pytest.raises(NotImplementedError, match="FP8 parameters"):
            with ctx(enabled=True):
                pass
    lin = te.Linear(4, 4, device=DEVICE)
    with pytest.raises(NotImplementedError, match="fp8_output"):
        lin(torch.randn(2, 4), fp8_output=True)


@pytest.mark.parametrize("kwargs", [dict(delay_wgrad_compute=True),
                                    dict(ub_overlap_ag=True), dict(symmetric_ar_type="multimem_all_reduce")])
def test_unimplemented_te_switches_are_refused(kwargs):
    name = next(iter(kwargs))
    for cls in (te.Linear, te.LayerNormLinear):
        with pytest.raises(NotImplementedError, match=name):
            cls(8, 8, device=DEVICE, **kwargs)


def test_grouped_linear_refuses_unbuilt_switches_by_name():
    with pytest.raises(NotImplementedError, match="GroupedLinear.*delay_wgrad_compute"):
        te.GroupedLinear(2, 8, 8, device=DEVICE, delay_wgrad_compute=True)


# --- RNG tracker -----------------------------------------------------------------------------

def test_rng_tracker_fork_add_get_set_reset():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="`seed`"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="not a tracked"):
        with tracker.fork("missing"):
            pass
    torch.manual_seed(0)
    outside = _rng_state()
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4, device=RNG_DEVICE)
    with tracker.fork("a"):
        second = torch.rand(4, device=RNG_DEVICE)  # the stream continues where the last fork left it
    assert torch.equal(_rng_state(), outside) and not torch.equal(first, second)
    assert "a" in get_all_rng_states()
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4, device=RNG_DEVICE), first)
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # the seed is free again after reset
