"""FP8 Linear and LayerNormLinear: forward and gradients against a float64 product of the same FP8 operands,
a training step bitwise equal run to run and across torch.use_deterministic_algorithms, weight caching,
fuse_wgrad_accumulation, autocast state, refusals, and the amax all-reduce over two processes."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import quantization_linear as ql
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
M, K, N = 37, 200, 136  # odd token count, K and N not multiples of 128
# CPU always; the GPU where it has FP8 GEMMs (block scaling needs sm90+: skipped by its own reason below).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and te.check_fp8_support("cuda")[0] else [])


def _skip_unsupported(name, device):
    if name == "block":
        ok, reason = te.check_fp8_block_scaling_support(device)
        if not ok:
            pytest.skip(reason)


@pytest.fixture(autouse=True)
def _fresh_fp8_state():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


@pytest.fixture
def gemms(monkeypatch):
    calls = []
    real = ql.scaled_gemm

    def recording(a, b, out_dtype, split=True):
        out = real(a, b, out_dtype, split)
        calls.append((a, b, out))
        return out

    monkeypatch.setattr(ql, "scaled_gemm", recording)
    return calls


def _ref(a, b):
    """The float64 product of the dequantized operands (exact dequantization in float64)."""
    return a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()


def _close(got, want, what, fast_accum=False):
    # float32 accumulation of K products against float64: a few float32 ulps of the largest partial sums.
    # cuBLAS's fast-accumulate FP8 GEMM (use_split_accumulator=False: the per-tensor recipes' fprop) keeps
    # fewer accumulator bits on Hopper: 2**-10 of the largest value there.
    rel = 2.0 ** -10 if fast_accum else 1e-5
    bound = rel * (want.abs().max().item() + 1e-30) + 1e-30
    err = (got.double() - want).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_forward_and_gradients_equal_fp64_product_of_the_fp8_operands(gemms, name, module, device):
    _skip_unsupported(name, device)
    torch.manual_seed(0)
    if module == "Linear":
        mod = te.Linear(K, N, params_dtype=torch.float32, device=device)
    else:
        mod = te.LayerNormLinear(K, N, params_dtype=torch.float32, device=device, return_layernorm_output=True)
    with torch.no_grad():
        mod.bias.uniform_(-1, 1)
    x = torch.randn(M, K).to(device).requires_grad_()
    g = torch.randn(M, N).to(device)
    rec = RECIPES[name]()
    for _ in range(2):  # the second step runs with updated delayed scales
        gemms.clear()
        x.grad = None
        mod.zero_grad()
        with te.autocast(enabled=True, recipe=rec):
            out = mod(x)
        y, ln_out = out if module == "LayerNormLinear" else (out, x)
        y.backward(g)
    (qx, qw, fprop), (qdy, qw_t, dgrad), (qdy_c, qx_c, wgrad) = gemms
    fast = device == "cuda" and name != "block"
    _close(fprop, _ref(qx, qw), "fprop", fast)
    _close(y.detach() - mod.bias.detach(), _ref(qx, qw), "output", fast)
    _close(dgrad, _ref(qdy, qw_t), "dgrad")
    _close(wgrad, _ref(qdy_c, qx_c), "wgrad")
    _close(mod.weight.grad, _ref(qdy_c, qx_c), "weight.grad")
    assert torch.equal(mod.bias.grad, g.sum(0))
    if module == "Linear":
        _close(x.grad, _ref(qdy, qw_t), "x.grad")
    # the operands are quantizations of the GEMM's inputs: within half an FP8 step of them
    rel = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
    for op, src in ((qx, ln_out.detach()), (qw, mod.weight.detach()), (qdy, g)):
        deq = op.dequantize(torch.float64)
        tiny = op.scale_inv.double().max().item() * 2.0 ** -9  # subnormal spacing, scaled
        assert ((deq - src.double()).abs() <= src.double().abs() * rel[op.fmt] + tiny).all()
    # and FP8 was used: the output is not the high-precision one
    hp = torch.nn.functional.linear(ln_out.detach(), mod.weight.detach(), mod.bias.detach())
    assert not torch.equal(y.detach(), hp)
    assert (y.detach() - hp).abs().max() < 0.1 * hp.abs().max()


def _train(name, steps=3, deterministic=False, dtype=torch.float32, microbatches=2, device="cpu"):
    """A small LayerNormLinear -> gelu -> Linear model trained a few steps; returns every parameter and grad."""
    torch.manual_seed(0)
    fc1 = te.LayerNormLinear(64, 96, params_dtype=dtype, device=device)
    fc2 = te.Linear(96, 64, params_dtype=dtype, device=device, fuse_wgrad_accumulation=True)
    fc2.weight.main_grad = torch.zeros(fc2.weight.shape, dtype=torch.float32, device=device)
    params = list(fc1.parameters()) + list(fc2.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    rec = RECIPES[name]()
    losses = []
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for _ in range(steps):
            for mb in range(microbatches):
                x = torch.randn(2, 9, 64, generator=gen).to(device=device, dtype=dtype)
                with te.autocast(enabled=True, recipe=rec):
                    h = torch.nn.functional.gelu(fc1(x, is_first_microbatch=mb == 0))
                    y = fc2(h, is_first_microbatch=mb == 0)
                loss = y.float().square().mean()
                loss.backward()
                losses.append(loss.detach())
            with torch.no_grad():
                fc2.weight.grad = fc2.weight.main_grad.to(dtype)
            opt.step()
            opt.zero_grad()
            fc2.weight.main_grad.zero_()
    finally:
        torch.use_deterministic_algorithms(prev)
    return [p.detach().clone() for p in params] + losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_training_step_is_bitwise_reproducible_and_independent_of_deterministic_mode(name, device):
    _skip_unsupported(name, device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    first = _train(name, dtype=dtype, device=device)
    FP8GlobalStateManager.reset()
    second = _train(name, dtype=dtype, device=device)
    FP8GlobalStateManager.reset()
    third = _train(name, deterministic=True, dtype=dtype, device=device)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(torch.isfinite(t).all() for t in first)


def test_bf16_training_step_is_bitwise_reproducible():
    a = _train("delayed", steps=2, dtype=torch.bfloat16)
    FP8GlobalStateManager.reset()
    b = _train("delayed", steps=2, dtype=torch.bfloat16)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_is_first_microbatch_quantizes_the_weight_once_and_reuses_it(gemms, name):
    torch.manual_seed(0)
    lin = te.Linear(K, N, params_dtype=torch.float32, device="cpu")
    x = torch.randn(M, K)
    rec = RECIPES[name]()
    with te.autocast(enabled=True, recipe=rec):
        y1 = lin(x, is_first_microbatch=True)
        with torch.no_grad():
            lin.weight.mul_(2.0)  # ignored by the cached FP8 weight
        y2 = lin(x, is_first_microbatch=False)
        y3 = lin(x, is_first_microbatch=True)
    assert gemms[0][1] is gemms[1][1]
    assert gemms[2][1] is not gemms[1][1]
    assert torch.equal(y1, y2) and not torch.equal(y2, y3)
    if name == "delayed":
        # the weight amax is recorded when the weight is quantized (before the doubling and after it)
        meta = lin._fp8_state.fwd_meta
        assert meta.amax_history[-1, 1].item() == lin.weight.abs().max().item()


def test_fuse_wgrad_accumulation_adds_the_fp8_wgrad_into_main_grad():
    torch.manual_seed(0)
    fused = te.Linear(K, N, params_dtype=torch.float32, device="cpu", fuse_wgrad_accumulation=True)
    plain = te.Linear(K, N, params_dtype=torch.float32, device="cpu")
    plain.load_state_dict(fused.state_dict())
    fused.weight.main_grad = torch.full(fused.weight.shape, 0.25)
    fused.weight.grad_added_to_main_grad = False
    x = torch.randn(M, K)
    g = torch.randn(M, N)
    for mod in (fused, plain):
        FP8GlobalStateManager.reset()
        with te.autocast(enabled=True, recipe=recipe.Float8CurrentScaling()):
            mod(x).backward(g)
    assert torch.equal(fused.weight.main_grad, plain.weight.grad + 0.25)
    assert fused.weight.grad_added_to_main_grad is True
    assert torch.count_nonzero(fused.weight.grad) == 0


def test_autocast_nests_and_restores_the_state():
    outer, inner = recipe.DelayedScaling(), recipe.Float8CurrentScaling()
    assert FP8GlobalStateManager.get_fp8_recipe() is None and not FP8GlobalStateManager.is_fp8_enabled()
    with te.fp8_autocast(enabled=True, fp8_recipe=outer, fp8_group=None):
        assert FP8GlobalStateManager.get_fp8_recipe() is outer
        with te.autocast(enabled=True, recipe=inner):
            assert FP8GlobalStateManager.get_fp8_recipe() is inner
            with te.autocast(enabled=False):
                assert not FP8GlobalStateManager.is_fp8_enabled()
            assert FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() is outer
    assert FP8GlobalStateManager.get_autocast_state()[:4] == (False, False, None, None)
    with te.autocast():
        assert isinstance(FP8GlobalStateManager.get_fp8_recipe(), recipe.DelayedScaling)
    with te.autocast(enabled=False, calibrating=True):
        assert FP8GlobalStateManager.is_fp8_calibration()
    assert FP8GlobalStateManager.AUTOCAST_DEPTH == 0


def test_support_queries_answer_for_cpu():
    assert te.check_fp8_support("cpu") == (True, "")
    assert te.check_fp8_block_scaling_support("cpu") == (True, "")
    ok, reason = te.check_mxfp8_support()
    assert not ok and "Blackwell" in reason
    ok, reason = te.check_nvfp4_support()
    assert not ok and "Blackwell" in reason


@pytest.mark.parametrize("rec,match", [(recipe.MXFP8BlockScaling(), "MXFP8BlockScaling.*Blackwell"),
                                       (recipe.NVFP4BlockScaling(), "NVFP4BlockScaling.*Blackwell"),
                                       (recipe.CustomRecipe(qfactory=lambda role: None), "CustomRecipe")])
def test_unbuilt_recipes_are_refused_by_name(rec, match):
    with pytest.raises(NotImplementedError, match=match):
        with te.autocast(enabled=True, recipe=rec):
            pass
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.AUTOCAST_DEPTH == 0


def test_fp8_output_grad_and_fp8_parameters_are_refused_by_name():
    lin = te.Linear(16, 16, device="cpu")
    with te.autocast(enabled=True):
        with pytest.raises(NotImplementedError, match="fp8_output"):
            lin(torch.randn(2, 16), fp8_output=True)
        with pytest.raises(NotImplementedError, match="fp8_grad"):
            lin(torch.randn(2, 16), fp8_grad=True)
    for ctx in (te.fp8_model_init, te.quantized_model_init):
        with ctx(enabled=False):
            pass
        with pytest.raises(NotImplementedError, match="FP8 parameters"):
            with ctx(enabled=True):
                pass


_REDUCTION_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    torch.manual_seed(0)
    lin = te.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 32) * (1.0 + 9.0 * rank)  # rank 1 sees the larger input
    g = torch.randn(8, 16) * (3.0 - 2.0 * rank)  # rank 0 sees the larger gradient
    for reduce in (True, False):
        r = recipe.DelayedScaling(amax_history_len=2, reduce_amax=reduce)
        lin._fp8_state = None
        lin.__dict__.pop("_fp8_state", None)
        with te.autocast(enabled=True, recipe=r, amax_reduction_group=dist.group.WORLD):
            y = lin(x)
        y.backward(g)
        fwd, bwd = lin._fp8_state.fwd_meta, lin._fp8_state.bwd_meta
        out = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(out, torch.stack([fwd.amax_history[-1, 0], bwd.amax_history[-1, 0]]))
        mine = torch.stack([x.abs().max(), g.abs().max()])
        theirs = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(theirs, mine)
        if reduce:
            want = torch.maximum(theirs[0], theirs[1])
            assert torch.equal(out[0], want) and torch.equal(out[1], want), (out, want)
        else:
            assert torch.equal(out[rank], mine)
    dist.barrier()
    print("PASS", rank, flush=True)
    # Leave without tearing gloo down: torch 2.15's gloo teardown at interpreter exit sometimes aborts
    # ("terminate called without an active exception") after all the work is done.
    os._exit(0)
""")


def test_delayed_scaling_amaxes_are_all_reduced_max_over_the_group(tmp_path):
    # a file store: no TCP port to race other processes for
    store = str(tmp_path / "store")
    script = tmp_path / "worker.py"
    script.write_text(_REDUCTION_WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS {rank}" in out, err[-3000:]


def test_activation_recompute_of_an_fp8_forward_outside_autocast_is_refused():
    """torch.utils.checkpoint re-runs the forward inside the backward, after the autocast has exited: the
    recompute would be high precision where the first forward was FP8, so it is refused by name."""
    lin = te.Linear(32, 32, params_dtype=torch.float32, device="cpu")
    x = torch.randn(4, 32, requires_grad=True)
    with te.autocast(enabled=True):
        y = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)
    with pytest.raises(NotImplementedError, match="activation recompute"):
        y.sum().backward()
    # outside a backward pass, the module runs in high precision as usual
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_fp8_output_can_be_modified_in_place():
    """Megatron's MLP adds an expert's bias to the linear output in place: the FP8 path's output must allow it
    (it was a view made inside the autograd Function: "Output 0 of _FP8Linear is a view ... modified inplace")."""
    from transformer_engine.common import recipe

    lin = te.Linear(32, 16, bias=False, params_dtype=torch.float32, device="cpu")
    x = torch.randn(2, 8, 32, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    with te.autocast(enabled=True, recipe=recipe.Float8CurrentScaling()):
        out = lin(x)
    out += bias
    out.sum().backward()
    assert x.grad is not None and torch.equal(bias.grad, torch.full_like(bias, 16.0))


@pytest.mark.parametrize("name", ["none", "delayed", "current", "block"])
def test_output_dtype_under_torch_autocast_does_not_depend_on_the_recipe(name):
    """fp32 parameters and input under torch.autocast(bfloat16): every path computes in bfloat16, as torch's
    Linear does (delayed and current scaling returned float32 before)."""
    recipes = {"none": None, "delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling(),
               "block": recipe.Float8BlockScaling()}
    lin = te.Linear(64, 32, device="cpu")
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=name != "none", recipe=recipes[name]):
        y = lin(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
