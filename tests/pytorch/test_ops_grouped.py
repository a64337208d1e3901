"""The grouped MLP's operations: ops.GroupedLinear, ops.ScaledSwiGLU, ops.ScaledClampedQGeGLU, ops.ScaledSReLU.

Each against a plain float64 torch reference of the same math (forward and gradients, uneven and empty groups),
ops.GroupedLinear bitwise equal to the GroupedLinear module with the same weights (both GEMM paths, FP8 too), the
Sequential Megatron builds (GroupedLinear -> ScaledSwiGLU -> GroupedLinear(scale_bias=True)) bitwise equal to the
modules composed by hand and bitwise run to run, main_grad accumulation, and the refusals."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import grouped_gemm, ops
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

DEV = "cpu"
H, F = 32, 24
SPLITS = [5, 0, 9, 2]
G = len(SPLITS)
N = sum(SPLITS)


@pytest.fixture(autouse=True)
def _fresh_state():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


def _data(dtype=torch.float32, width=H, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, width, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    probs = torch.rand(N, generator=g, dtype=torch.float64).to(torch.float32).requires_grad_()
    return x, probs


def _randomize(op, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return op


def _grads(*tensors):
    return [t.grad.clone() for t in tensors]


def _named_grads(*modules):
    """The parameters' gradients, module by module, weights then biases, each by group index."""
    out = []
    for m in modules:
        names = [n for n, _ in m.named_parameters()]
        for kind in ("weight", "bias"):
            out += [m.get_parameter(n).grad.clone() for n in sorted(
                (n for n in names if n.startswith(kind)), key=lambda n: int(n[len(kind):]))]
    return out


def _ref_swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


def _ref_grouped(x, weights, biases, scales=None):
    rows = []
    for i, (xi, w) in enumerate(zip(x.split(SPLITS), weights)):
        y = xi @ w.t()
        if biases is not None:
            y = y + (biases[i] if scales is None else scales.split(SPLITS)[i].unsqueeze(-1) * biases[i])
        rows.append(y)
    return torch.cat(rows)


@pytest.mark.parametrize("force_grouped_mm", [False, True])
def test_grouped_linear_op_is_the_module_bitwise_and_the_reference(force_grouped_mm, monkeypatch):
    monkeypatch.setattr(grouped_gemm, "FORCE_GROUPED_MM", force_grouped_mm)
    op = _randomize(ops.GroupedLinear(G, H, F, device=DEV))
    mod = te.GroupedLinear(G, H, F, device=DEV, params_dtype=torch.float32)
    mod.load_state_dict({k: v for k, v in op.state_dict().items()}, strict=False)
    x, _ = _data()
    dy = torch.randn(N, F, generator=torch.Generator().manual_seed(5))
    y_op = op(x, torch.tensor(SPLITS))
    y_op.backward(dy)
    g_op = _grads(x) + _named_grads(op)
    x.grad = None
    y_mod = mod(x, SPLITS)
    y_mod.backward(dy)
    assert torch.equal(y_op, y_mod)
    assert all(torch.equal(a, b) for a, b in zip(g_op, _grads(x) + _named_grads(mod), strict=True))
    # Against float64.
    x64 = x.detach().double().requires_grad_()
    w64 = [op.get_parameter(f"weight{i}").detach().double().requires_grad_() for i in range(G)]
    b64 = [op.get_parameter(f"bias{i}").detach().double().requires_grad_() for i in range(G)]
    ref = _ref_grouped(x64, w64, b64)
    ref.backward(dy.double())
    torch.testing.assert_close(y_op.double(), ref, rtol=1e-5, atol=1e-5)
    # (the empty group's gradients are zeros)
    for got, want in zip(g_op, [x64.grad] + [t.grad for t in w64 + b64], strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(g_op[2], torch.zeros(F, H)) and torch.equal(g_op[G + 2], torch.zeros(F))


def _megatron_sequential(bias):
    fc1 = _randomize(ops.GroupedLinear(G, H, 2 * F, bias=bias, device=DEV), seed=2)
    fc2 = _randomize(ops.GroupedLinear(G, F, H, bias=bias, device=DEV, scale_bias=bias), seed=3)
    return ops.Sequential(fc1, ops.ScaledSwiGLU(), fc2)


def _run_sequential(seq, x, probs, bias):
    x.grad = probs.grad = None
    for p in seq.parameters():
        p.grad = None
    splits = torch.tensor(SPLITS, dtype=torch.int32)
    extra = (splits, probs) if bias else (splits,)
    y = seq(x, splits, probs, *extra)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view(y.shape))
    return [y.detach()] + _grads(x, probs) + _named_grads(seq[0], seq[2])


@pytest.mark.parametrize("bias", [False, True])
def test_megatron_grouped_mlp_sequential(bias):
    """Megatron's fused grouped MLP: ``p * (FC2(SwiGLU(FC1 x)) + b2)`` per expert (probabilities ``p``)."""
    seq = _megatron_sequential(bias)
    x, probs = _data()
    got = _run_sequential(seq, x, probs, bias)
    assert all(torch.equal(a, b) for a, b in zip(got, _run_sequential(seq, x, probs, bias)))

    # The modules composed by hand as Megatron's unfused TEGroupedMLP does (use_te_activation_func): bitwise.
    fc1 = te.GroupedLinear(G, H, 2 * F, bias=bias, device=DEV, params_dtype=torch.float32)
    fc2 = te.GroupedLinear(G, F, H, bias=bias, return_bias=True, device=DEV, params_dtype=torch.float32)
    fc1.load_state_dict(seq[0].state_dict(), strict=False)
    fc2.load_state_dict(seq[2].state_dict(), strict=False)
    x.grad = probs.grad = None
    h = ops.SwiGLU()(fc1(x, SPLITS)) * probs.unsqueeze(-1)
    y, b2 = fc2(h, SPLITS)
    if bias:
        y = torch.cat([t + b * p for t, b, p in zip(y.split(SPLITS), b2, probs.unsqueeze(-1).split(SPLITS))])
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view(y.shape))
    want = [y.detach()] + _grads(x, probs) + _named_grads(fc1, fc2)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(got, want))

    # float64 reference.
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    # The parameters in _named_grads' order: FC1's weights (, biases), FC2's weights (, biases).
    params = [p.detach().double().requires_grad_() for p in seq.parameters()]
    w1, w2 = params[:G], (params[2 * G:3 * G] if bias else params[G:])
    b1, b2 = (params[G:2 * G], params[3 * G:]) if bias else (None, None)
    ref = _ref_grouped(_ref_swiglu(_ref_grouped(x64, w1, b1)) * p64.unsqueeze(-1), w2, b2, p64 if bias else None)
    ref.backward(torch.cos(torch.arange(ref.numel(), dtype=ref.dtype)).view(ref.shape))
    for a, b in zip(got, [ref, x64.grad, p64.grad] + [p.grad for p in params], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)


def _ref_clamped_qgeglu(x, limit, alpha, offset):
    a, b = x.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    return a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + offset)


@pytest.mark.parametrize("name", ["ScaledSwiGLU", "ScaledClampedQGeGLU", "ScaledSReLU", "interleaved"])
def test_scaled_activation_against_float64(name):
    if name == "ScaledSwiGLU":
        op, ref_fn = ops.ScaledSwiGLU(), _ref_swiglu
    elif name == "ScaledClampedQGeGLU":
        op = ops.ScaledClampedQGeGLU(limit=0.8, alpha=1.5, glu_linear_offset=0.5)
        ref_fn = lambda t: _ref_clamped_qgeglu(t, 0.8, 1.5, 0.5)  # noqa: E731
    elif name == "ScaledSReLU":
        op, ref_fn = ops.ScaledSReLU(), lambda t: torch.relu(t) ** 2  # noqa: E731
    else:  # gates and units in interleaved blocks of 4 columns: [a0..a3, b0..b3, a4..a7, b4..b7]
        op = ops.ScaledSwiGLU(glu_interleave_size=4)
        ref_fn = lambda t: _ref_swiglu(  # noqa: E731
            torch.cat([t.view(N, 2, 2, 4)[:, :, 0].reshape(N, 8), t.view(N, 2, 2, 4)[:, :, 1].reshape(N, 8)], -1))
    x, probs = _data(width=16)
    y = op(x, probs)
    dy = torch.sin(torch.arange(y.numel(), dtype=y.dtype)).view(y.shape)
    y.backward(dy)
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    ref = ref_fn(x64) * p64.unsqueeze(-1)
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probs.grad.double(), p64.grad, rtol=1e-6, atol=1e-6)
    y2 = op(x, probs)
    assert torch.equal(y, y2)
    # bf16: the product is rounded once from float32 (TransformerEngine's kernel), the scales taken in bf16.
    xb = x.detach().bfloat16()
    yb = op(xb, probs.detach())
    assert yb.dtype == torch.bfloat16
    xf = xb.float()
    want = op(xf, probs.detach().bfloat16().float())
    assert torch.equal(yb, want.bfloat16())


def test_grouped_linear_op_in_fp8_is_the_module_bitwise():
    op = _randomize(ops.GroupedLinear(G, H, F, device=DEV))
    mod = te.GroupedLinear(G, H, F, device=DEV, params_dtype=torch.float32)
    mod.load_state_dict(op.state_dict(), strict=False)
    x, _ = _data()
    outs = []
    for m, call in ((op, lambda: op(x, SPLITS)), (mod, lambda: mod(x, SPLITS))):
        FP8GlobalStateManager.reset()
        x.grad = None
        for _ in range(2):  # the second step uses the first one's delayed-scaling history
            with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=3)):
                y = call()
            y.sum().backward()
        outs.append([y.detach()] + _grads(x) + _named_grads(m))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert not torch.equal(outs[0][0], op(x, SPLITS))  # FP8 rounding happened


def test_accumulate_into_main_grad():
    op = _randomize(ops.GroupedLinear(G, H, F, bias=False, device=DEV, accumulate_into_main_grad=True))
    for i in range(G):
        op.get_parameter(f"weight{i}").main_grad = torch.ones(F, H)
    x, _ = _data()
    op(x, SPLITS).sum().backward()
    for i, xi in enumerate(x.detach().split(SPLITS)):
        want = torch.ones(F, H) + torch.ones(xi.shape[0], F).t() @ xi
        torch.testing.assert_close(op.get_parameter(f"weight{i}").main_grad, want, rtol=1e-6, atol=1e-6)


def test_meta_shell_with_registered_parameters():
    """Megatron's way: a parameterless shell on meta, then its TEGroupedLinear's parameters registered."""
    mod = te.GroupedLinear(G, H, F, bias=False, device=DEV, params_dtype=torch.float32)
    op = ops.GroupedLinear(G, H, F, bias=False, device="meta", dtype=torch.float32)
    for i in range(G):
        op.register_parameter(f"weight{i}", mod.get_parameter(f"weight{i}"))
    x, _ = _data()
    assert torch.equal(op(x, SPLITS), mod(x, SPLITS))


def test_refusals_and_bad_arguments():
    for arg in ("single_grouped_weight", "single_grouped_bias", "delay_wgrad_compute"):
        with pytest.raises(NotImplementedError, match=arg):
            ops.GroupedLinear(G, H, F, device=DEV, **{arg: True})
    for cls in (ops.ScaledSwiGLU, ops.ScaledClampedQGeGLU, ops.ScaledSReLU):
        with pytest.raises(NotImplementedError, match="activation_recompute_in_mlp"):
            cls(activation_recompute_in_mlp=True)
    with pytest.raises(ValueError, match="`num_groups`"):
        ops.GroupedLinear(0, H, F, device=DEV)
    op = ops.GroupedLinear(G, H, F, device=DEV)
    with pytest.raises(ValueError, match="`m_splits`"):
        op(torch.zeros(N, H), [1, 2, 3, 4])
    with pytest.raises(ValueError, match="extra inputs"):
        ops.Sequential(op)(torch.zeros(N, H))
    assert ops.GroupedLinear(G, H, F, device=DEV, scale_bias=True).num_extra_inputs == 2
    assert ops.GroupedLinear(G, H, F, bias=False, device=DEV, scale_bias=True).num_extra_inputs == 1
    with pytest.raises(ValueError, match="`scales`"):
        ops.ScaledSwiGLU()(torch.zeros(N, 8), torch.zeros(N + 1))
    with pytest.raises(ValueError, match="glu_interleave_size"):
        ops.ScaledSwiGLU(glu_interleave_size=3)(torch.zeros(N, 8), torch.zeros(N))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: torch's grouped GEMM path for bfloat16")
def test_grouped_linear_op_on_cuda_bf16_is_the_module_bitwise():
    """On CUDA in bfloat16 the module and the operation take torch's grouped GEMM: the same bits."""
    op = _randomize(ops.GroupedLinear(G, 64, 48, device="cuda", dtype=torch.bfloat16))
    mod = te.GroupedLinear(G, 64, 48, device="cuda", params_dtype=torch.bfloat16)
    mod.load_state_dict(op.state_dict(), strict=False)
    x = torch.randn(N, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = []
    for m in (op, mod):
        x.grad = None
        y = m(x, SPLITS)
        y.float().square().sum().backward()
        results.append([y.detach()] + _grads(x) + _named_grads(m))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
