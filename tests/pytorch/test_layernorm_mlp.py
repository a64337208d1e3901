"""LayerNormMLP with TransformerEngine's signature: every activation x both norms x bias, against plain torch
formulas in float64 (output, input and every parameter gradient), TransformerEngine's return conventions,
zero_centered_gamma, fuse_wgrad_accumulation, initialization, bitwise run to run, refusals; under each FP8
recipe bitwise equal to a LayerNorm and two FP8 Linear calls with the activation between; on 2 gloo ranks
(set_parallel_mode, with and without sequence parallelism) equal to the single-rank module
(tests/pytorch/distributed/layernorm_mlp_tp.py). Activation recompute is in test_checkpoint.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import modules as common_modules
from transformer_engine.common import recipe
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEVICE = "cpu"
SEQ, BATCH, HIDDEN, FFN = 8, 2, 32, 48
LIMIT = 0.75  # clamped_swiglu's limit: below the values drawn, so the clamps are exercised
ACT_PARAMS = {"clamped_swiglu": {"limit": LIMIT, "alpha": 1.5, "glu_linear_offset": 0.5}}
ACTIVATIONS = ["gelu", "geglu", "glu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu", "swiglu",
               "clamped_swiglu"]
# FP8 runs on the CPU always, and on a GPU with FP8 GEMMs (each recipe's support is checked in the test).
FP8_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}


@pytest.fixture(autouse=True)
def _fresh_fp8_state():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


# --- the reference: plain torch formulas -------------------------------------------------------

def _sigmoid(x):
    return 1 / (1 + torch.exp(-x))


# TransformerEngine's activations written out (its gelu is the tanh form with its CUDA kernel's constants).
_REF_FN = {
    "gelu": lambda x: x * (0.5 + 0.5 * torch.tanh(x * (0.79788456 + 0.03567741 * x * x))),
    "qgelu": lambda x: x * _sigmoid(1.702 * x),
    "relu": torch.relu,
    "srelu": lambda x: torch.relu(x) ** 2,
    "silu": lambda x: x * _sigmoid(x),
    "glu": _sigmoid,
}
_GATE = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu", "swiglu": "silu", "glu": "glu"}


def _ref_activation(name, x):
    if name in ("gelu", "qgelu", "relu", "srelu", "silu"):
        return _REF_FN[name](x)
    a, b = x.chunk(2, dim=-1)
    if name == "clamped_swiglu":
        p = ACT_PARAMS[name]
        a = a.clamp(max=p["limit"])
        return a * _sigmoid(p["alpha"] * a) * (b.clamp(-p["limit"], p["limit"]) + p["glu_linear_offset"])
    return _REF_FN[_GATE[name]](a) * b


def _ref_norm(x, weight, bias, normalization, zero_centered_gamma, eps=1e-5):
    if normalization == "LayerNorm":
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    else:
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    y = y * ((1 + weight) if zero_centered_gamma else weight)
    return y + bias if bias is not None else y


def _ref_mlp(mod, x, params):
    """The module's math in plain torch on ``params`` (name -> tensor): (out, ln_out)."""
    ln = _ref_norm(x, params["layer_norm_weight"], params.get("layer_norm_bias"), mod.normalization,
                   mod.zero_centered_gamma)
    h = ln @ params["fc1_weight"].t()
    if "fc1_bias" in params:
        h = h + params["fc1_bias"]
    out = _ref_activation(mod.activation, h) @ params["fc2_weight"].t()
    if "fc2_bias" in params:
        out = out + params["fc2_bias"]
    return out, ln


def _build(activation="gelu", normalization="LayerNorm", bias=True, dtype=torch.float32, seed=3, device=DEVICE,
           **kwargs):
    torch.manual_seed(0)
    params = ACT_PARAMS.get(activation)
    mod = te.LayerNormMLP(HIDDEN, FFN, activation=activation, activation_params=params, normalization=normalization,
                          bias=bias, params_dtype=dtype, device=device, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            fan_in = p.shape[1] if p.dim() == 2 else 1
            scale = 1 / math.sqrt(fan_in) if p.dim() == 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)
            if name == "layer_norm_weight" and not mod.zero_centered_gamma:
                p.add_(1.0)
    return mod


def _inputs(dtype=torch.float32, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    return x.to(dtype), dy.to(dtype)


def _fwd_bwd(mod, x, dy, **kwargs):
    """Output(s), input gradient and parameter gradients of sum((out + returned bias) * dy) (+ sum(ln_out) when
    returned)."""
    x = x.detach().clone().requires_grad_(True)
    mod.zero_grad(set_to_none=True)
    out = mod(x, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    y = outs[0] + outs[1] if mod.return_bias and outs[1].numel() else outs[0]  # the caller adds the bias
    loss = (y * dy).sum()
    if mod.return_layernorm_output:
        loss = loss + outs[-1].sum()
    loss.backward()
    return [o.detach() for o in outs], x.grad, {n: p.grad for n, p in mod.named_parameters()}


def _ref_grads(mod, x, dy):
    leaves = {n: p.detach().double().requires_grad_(True) for n, p in mod.named_parameters()}
    xd = x.detach().double().requires_grad_(True)
    out, ln = _ref_mlp(mod, xd, leaves)
    loss = (out * dy.double()).sum()
    if mod.return_layernorm_output:
        loss = loss + ln.sum()
    loss.backward()
    return out.detach(), ln.detach(), xd.grad, {n: t.grad for n, t in leaves.items()}


# Largest error / max|ref| per dtype over the comparisons run (measured: 6.9e-7 float32, 1.1e-15 float64).
MAX_REL_ERR = {}


def _close(got, ref, what, rel):
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    key = got.dtype
    MAX_REL_ERR[key] = max(MAX_REL_ERR.get(key, 0.0), err / max(scale, 1e-300))
    assert err <= rel * scale + 1e-300, f"{what}: max error {err:.3e} > {rel:.1e} x {scale:.3e}"


# --- against the float64 formulas ---------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_float64_formula(activation, normalization, bias):
    """float32 parameters and activations: within float32 rounding of the float64 formula; float64 module: equal
    to it to float64 rounding (a wrong constant, gate half or clamp would show at 1e-9)."""
    for dtype, rel in ((torch.float32, 5e-6), (torch.float64, 1e-12)):
        mod = _build(activation, normalization, bias, dtype)
        x, dy = _inputs(dtype)
        (out,), dx, grads = _fwd_bwd(mod, x, dy)
        ref_out, _, ref_dx, ref_grads = _ref_grads(mod, x, dy)
        assert out.dtype == dtype and dx.dtype == dtype
        _close(out, ref_out, "output", rel)
        _close(dx, ref_dx, "input grad", rel)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            _close(grad, ref_grads[name], f"{name} grad", rel)
    if activation == "clamped_swiglu":
        # The clamps were active: some of FC1's outputs lie beyond the limit on both halves.
        with torch.no_grad():
            h = _ref_norm(x.double(), mod.layer_norm_weight.double(), None if mod.layer_norm_bias is None else
                          mod.layer_norm_bias.double(), normalization, False) @ mod.fc1_weight.double().t()
        a, b = h.chunk(2, dim=-1)
        assert (a > LIMIT).any() and (b.abs() > LIMIT).any()


def test_activation_runs_in_float32_for_bfloat16_activations():
    """bf16 parameters and input: FC1's bf16 output goes through the activation in float32, then back to bf16."""
    mod = _build("swiglu", dtype=torch.bfloat16)
    x, _ = _inputs(torch.bfloat16)
    with torch.no_grad():
        ln = te.module.layernorm.apply_norm(x, mod.layer_norm_weight, mod.layer_norm_bias, mod.eps, "LayerNorm",
                                            False)
        # The GEMMs then the bias additions, as Linear runs them.
        h = torch.nn.functional.linear(ln, mod.fc1_weight) + mod.fc1_bias
        act32 = common_modules.apply_activation(torch, "swiglu", h.float()).to(torch.bfloat16)
        act16 = common_modules.apply_activation(torch, "swiglu", h)
        out = mod(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, torch.nn.functional.linear(act32, mod.fc2_weight) + mod.fc2_bias)
        # and not the activation computed in bf16
        assert not torch.equal(out, torch.nn.functional.linear(act16, mod.fc2_weight) + mod.fc2_bias)


# --- return conventions, zero-centered gamma, parameters, init ---------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_return_bias_and_layernorm_output_orders(bias):
    plain = _build("swiglu", "RMSNorm", bias)
    x, dy = _inputs()
    (want,), _, _ = _fwd_bwd(plain, x, dy)
    ref_out, ref_ln, _, _ = _ref_grads(plain, x, dy)
    cases = {
        (True, False): "out, bias",
        (False, True): "out, ln_out",
        (True, True): "out, bias, ln_out",
    }
    for (return_bias, return_ln), _order in cases.items():
        mod = _build("swiglu", "RMSNorm", bias, return_bias=return_bias, return_layernorm_output=return_ln)
        outs = mod(x)
        assert isinstance(outs, tuple) and len(outs) == return_bias + return_ln + 1
        out = outs[0]
        if return_bias:
            b = outs[1]
            if bias:
                assert b is mod.fc2_bias or torch.equal(b, mod.fc2_bias)
                assert torch.equal(out + b, want)  # the bias is returned, not added
            else:
                assert b.numel() == 0 and torch.equal(out, want)  # an empty tensor, as TransformerEngine's
        else:
            assert torch.equal(out, want)
        if return_ln:
            _close(outs[-1].detach(), ref_ln, "ln_out", 2e-5)
            # without tensor parallelism the gathered norm output is the local one
            gathered = _build("swiglu", "RMSNorm", bias, return_layernorm_output=True,
                              return_layernorm_output_gathered=True)(x)[-1]
            assert torch.equal(gathered, outs[-1])


def test_zero_centered_gamma_starts_at_zero_and_scales_by_one_plus_weight():
    mod = te.LayerNormMLP(HIDDEN, FFN, zero_centered_gamma=True, device=DEVICE)
    assert torch.equal(mod.layer_norm_weight, torch.zeros(HIDDEN))
    for normalization in ("LayerNorm", "RMSNorm"):
        mod = _build("gelu", normalization, zero_centered_gamma=True)
        x, dy = _inputs()
        (out,), dx, grads = _fwd_bwd(mod, x, dy)
        ref_out, _, ref_dx, ref_grads = _ref_grads(mod, x, dy)
        _close(out, ref_out, "output", 2e-5)
        _close(grads["layer_norm_weight"], ref_grads["layer_norm_weight"], "gamma grad", 2e-5)


def test_parameters_shapes_names_and_default_init():
    mod = te.LayerNormMLP(HIDDEN, FFN, activation="geglu", device=DEVICE)
    assert [n for n, _ in mod.named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    assert mod.fc1_weight.shape == (2 * FFN, HIDDEN) and mod.fc2_weight.shape == (HIDDEN, FFN)
    assert torch.equal(mod.layer_norm_weight, torch.ones(HIDDEN))
    assert torch.equal(mod.layer_norm_bias, torch.zeros(HIDDEN))
    assert torch.equal(mod.fc1_bias, torch.zeros(2 * FFN)) and torch.equal(mod.fc2_bias, torch.zeros(HIDDEN))
    for w in (mod.fc1_weight, mod.fc2_weight):
        assert 0.018 < w.std().item() < 0.028  # TransformerEngine's default: normal, std 0.023
    assert mod.fc1_weight.partition_dim == 0 and mod.fc2_weight.partition_dim == 1
    rms = te.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", bias=False, device=DEVICE)
    assert [n for n, _ in rms.named_parameters()] == ["layer_norm_weight", "fc1_weight", "fc2_weight"]
    assert rms.layer_norm_bias is None and rms.fc1_bias is None and rms.fc2_bias is None
    tp = te.LayerNormMLP(HIDDEN, FFN, activation="swiglu", tp_size=2, set_parallel_mode=True, device=DEVICE)
    assert tp.fc1_weight.shape == (FFN, HIDDEN) and tp.fc2_weight.shape == (HIDDEN, FFN // 2)
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        tp(torch.randn(2, HIDDEN))
    assert te.LayerNormMLP(HIDDEN, FFN, device="meta").fc1_weight.is_meta


def test_init_methods_run_on_their_weights_inside_the_rng_tracker_fork():
    seen = []
    te.LayerNormMLP(HIDDEN, FFN, activation="reglu", device=DEVICE,
                    init_method=lambda w: seen.append(("fc1", tuple(w.shape))) or torch.nn.init.ones_(w),
                    output_layer_init_method=lambda w: seen.append(("fc2", tuple(w.shape))) or torch.nn.init.ones_(w))
    assert seen == [("fc1", (2 * FFN, HIDDEN)), ("fc2", (HIDDEN, FFN))]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the tracker forks CUDA's generator where it can
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    before = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    mod = te.LayerNormMLP(HIDDEN, FFN, get_rng_state_tracker=lambda: tracker, device=device)
    after = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    assert torch.equal(before, after)  # the default stream is untouched
    fresh = CudaRNGStatesTracker()
    fresh.add("model-parallel-rng", 1234)
    with fresh.fork():
        fc1 = torch.empty(FFN, HIDDEN, device=device).normal_(0, 0.023)
        fc2 = torch.empty(HIDDEN, FFN, device=device).normal_(0, 0.023)
    assert torch.equal(mod.fc1_weight, fc1) and torch.equal(mod.fc2_weight, fc2)


def test_fuse_wgrad_accumulation_adds_both_weight_gradients_into_main_grad():
    plain = _build("swiglu")
    fused = _build("swiglu", fuse_wgrad_accumulation=True)
    x, dy = _inputs()
    _, dx, grads = _fwd_bwd(plain, x, dy)
    start = {}
    for name in ("fc1_weight", "fc2_weight"):
        w = getattr(fused, name)
        start[name] = torch.full(w.shape, 0.25)
        w.main_grad = start[name].clone()
    _, dx_fused, grads_fused = _fwd_bwd(fused, x, dy)
    assert torch.equal(dx_fused, dx)
    for name in ("fc1_weight", "fc2_weight"):
        w = getattr(fused, name)
        assert grads_fused[name] is None  # autograd gets nothing: it is in main_grad
        _close(w.main_grad - start[name], grads[name].double(), f"{name}.main_grad", 1e-6)
        w.main_grad.zero_()
    for name in ("layer_norm_weight", "layer_norm_bias", "fc1_bias", "fc2_bias"):
        assert torch.equal(grads_fused[name], grads[name])
    # From zero, the fp32 weight gradients are the unfused ones bitwise; is_first_microbatch=True overwrites.
    _fwd_bwd(fused, x, dy)
    assert torch.equal(fused.fc1_weight.main_grad, grads["fc1_weight"])
    assert torch.equal(fused.fc2_weight.main_grad, grads["fc2_weight"])
    _fwd_bwd(fused, x, dy, is_first_microbatch=True)
    assert torch.equal(fused.fc1_weight.main_grad, grads["fc1_weight"])


def test_repeated_runs_are_bitwise_equal():
    x, dy = _inputs()
    runs = []
    for _ in range(2):
        mod = _build("clamped_swiglu", "RMSNorm", return_bias=True, return_layernorm_output=True)
        outs, dx, grads = _fwd_bwd(mod, x, dy)
        runs.append(outs + [dx] + list(grads.values()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# --- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(delay_wgrad_compute=True), dict(ub_overlap_ag=True), dict(ub_overlap_rs=True),
                                    dict(ub_overlap_rs_dgrad=True), dict(ub_bulk_dgrad=True), dict(ub_bulk_wgrad=True),
                                    dict(symmetric_ar_type="one_shot")])
def test_unimplemented_switches_are_refused_by_name(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(NotImplementedError, match=f"LayerNormMLP: `{name}"):
        te.LayerNormMLP(HIDDEN, FFN, device=DEVICE, **kwargs)


def test_sequence_parallel_without_set_parallel_mode_is_refused():
    with pytest.raises(NotImplementedError, match="`sequence_parallel=True` with tp_size=2"):
        te.LayerNormMLP(HIDDEN, FFN, sequence_parallel=True, tp_size=2, device=DEVICE)
    # one rank: no sequence split, accepted as TransformerEngine accepts it
    assert not te.LayerNormMLP(HIDDEN, FFN, sequence_parallel=True, device=DEVICE).sequence_parallel


@pytest.mark.parametrize("kwargs, match", [
    (dict(activation="tanh"), "`activation` must be one of"),
    (dict(activation="clamped_swiglu"), "'limit'"),
    (dict(activation="gelu", activation_params={"limit": 1.0}), "`activation_params`"),
    (dict(activation="clamped_swiglu", activation_params={"limit": 1.0, "beta": 2}), "`activation_params`"),
    (dict(normalization="BatchNorm"), "`normalization`"),
    (dict(eps=0.0), "`eps`"),
    (dict(tp_size=5), "`ffn_hidden_size`"),
])
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        te.LayerNormMLP(HIDDEN, FFN, device=DEVICE, **kwargs)


def test_bad_sizes_are_value_errors():
    with pytest.raises(ValueError, match="`ffn_hidden_size`"):
        te.LayerNormMLP(HIDDEN, 0, device=DEVICE)
    with pytest.raises(ValueError, match="normalized size"):
        te.LayerNormMLP(HIDDEN, FFN, device=DEVICE)(torch.randn(2, HIDDEN + 1))


# --- FP8 ---------------------------------------------------------------------------------------

def _unfused_pieces(mod):
    """A LayerNorm and two Linear modules holding ``mod``'s parameters."""
    device = mod.fc1_weight.device
    norm = (te.LayerNorm if mod.normalization == "LayerNorm" else te.RMSNorm)(
        HIDDEN, zero_centered_gamma=mod.zero_centered_gamma, device=device)
    fc1 = te.Linear(HIDDEN, mod.fc1_weight.shape[0], bias=mod.use_bias, device=device)
    fc2 = te.Linear(mod.fc2_weight.shape[1], HIDDEN, bias=mod.use_bias, device=device)
    with torch.no_grad():
        norm.weight.copy_(mod.layer_norm_weight)
        if mod.layer_norm_bias is not None:
            norm.bias.copy_(mod.layer_norm_bias)
        fc1.weight.copy_(mod.fc1_weight)
        fc2.weight.copy_(mod.fc2_weight)
        if mod.use_bias:
            fc1.bias.copy_(mod.fc1_bias)
            fc2.bias.copy_(mod.fc2_bias)
    return norm, fc1, fc2


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_equals_a_norm_and_two_fp8_linears_bitwise(name, device):
    """Three training steps under the recipe (delayed scaling: the scales updated between them), the weights
    quantized per call, then cached (is_first_microbatch=True), then reused (False): outputs and every
    gradient equal those of a LayerNorm, two FP8 Linear modules and the activation between, bitwise."""
    ok, reason = (te.check_fp8_block_scaling_support if name == "block" else te.check_fp8_support)(device)
    if not ok:
        pytest.skip(reason)
    mod = _build("swiglu", "LayerNorm", return_layernorm_output=True, device=device)
    norm, fc1, fc2 = _unfused_pieces(mod)
    rec = RECIPES[name]()
    x, dy = (t.to(device) for t in _inputs())
    firsts = [None, True, False]
    fused_steps = []
    for first in firsts:
        with te.autocast(enabled=True, recipe=rec):
            outs, dx, grads = _fwd_bwd(mod, x, dy, is_first_microbatch=first)
        fused_steps.append((outs, dx, grads))
    # Delayed-scaling updates reach every registered module: the unfused run starts from a clean registry.
    FP8GlobalStateManager.reset()
    for step, first in enumerate(firsts):
        xr = x.detach().clone().requires_grad_(True)
        for m in (norm, fc1, fc2):
            m.zero_grad(set_to_none=True)
        with te.autocast(enabled=True, recipe=rec):
            ln = norm(xr)
            h = fc1(ln, is_first_microbatch=first)
            act = common_modules.apply_activation(torch, "swiglu", h.float()).to(h.dtype)
            out = fc2(act, is_first_microbatch=first)
        ((out * dy).sum() + ln.sum()).backward()
        outs, dx, grads = fused_steps[step]
        assert torch.equal(outs[0], out.detach()) and torch.equal(outs[1], ln.detach())
        assert torch.equal(dx, xr.grad)
        want = {"layer_norm_weight": norm.weight.grad, "layer_norm_bias": norm.bias.grad,
                "fc1_weight": fc1.weight.grad, "fc1_bias": fc1.bias.grad,
                "fc2_weight": fc2.weight.grad, "fc2_bias": fc2.bias.grad}
        for pname, grad in grads.items():
            assert torch.equal(grad, want[pname]), f"step {step}: {pname} grad differs"
    # FP8 was used (the output is not the high-precision one), and each GEMM has its own state.
    with torch.no_grad():
        hp = mod(x)[0]
    assert not torch.equal(hp, outs[0]) and (hp - outs[0]).abs().max() < 0.1 * hp.abs().max()
    assert mod._fp8_state_fc1 is not mod._fp8_state_fc2
    if name == "delayed":
        for gemm, lin in (("fc1", fc1), ("fc2", fc2)):
            state = getattr(mod, f"_fp8_state_{gemm}")
            assert torch.equal(state.fwd_meta.scale, lin._fp8_state.fwd_meta.scale)
            assert torch.equal(state.fwd_meta.amax_history, lin._fp8_state.fwd_meta.amax_history)
            assert torch.equal(state.bwd_meta.amax_history, lin._fp8_state.bwd_meta.amax_history)
            assert not torch.equal(state.fwd_meta.scale, torch.ones(3, device=device))  # the scales moved


# --- tensor parallel on two gloo ranks ----------------------------------------------------------

@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_tensor_parallel_on_two_gloo_ranks_matches_single_rank():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "distributed", "layernorm_mlp_tp.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and all(line.startswith("PASS") for line in lines), report
    # {gelu, swiglu} x sequence_parallel x return_bias, then te.checkpoint with distribute_saved_activations
    assert len(lines) == 2 * 2 * 2 + 1, report
