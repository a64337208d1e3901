"""Batch-invariant mode (NVTE_BATCH_INVARIANT=1 / te.batch_invariant()): a row's outputs and input gradients
through Linear, LayerNorm, RMSNorm, LayerNormLinear and LayerNormMLP are bitwise the same whether the row is computed alone,
in a batch of 7, 64, 300 or 1024 rows, in a padded [b, s, h] batch or packed; the values match a float64
reference within the framework's own rounding; weight gradients are deterministic.

On CPU the kernels run under Triton's interpreter (qa/L0_pytorch_unittest sets TRITON_INTERPRET=1), whose dot
is a fixed-order sum, so these proofs do not rest on the host BLAS.
"""

import os

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import batch_invariance as bi_module

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the batch-invariant kernels run on CUDA or under TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, OUT = 64, 48
ROWS = (1, 7, 64, 300, 1024)


def _model(dtype):
    torch.manual_seed(0)
    ln = te.LayerNorm(HIDDEN, params_dtype=dtype, device=DEVICE)
    lin = te.Linear(HIDDEN, HIDDEN, params_dtype=dtype, device=DEVICE)
    lnl = te.LayerNormLinear(HIDDEN, HIDDEN, normalization="RMSNorm", params_dtype=dtype, device=DEVICE)
    mlp = te.LayerNormMLP(HIDDEN, 32, activation="swiglu", params_dtype=dtype, device=DEVICE)
    mlp.fc2_weight.data = mlp.fc2_weight.data[:OUT].clone()  # FC2 to OUT features: the model's output width
    mlp.fc2_bias.data = mlp.fc2_bias.data[:OUT].clone()
    with torch.no_grad():  # non-trivial norm parameters
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
        lnl.layer_norm_weight.uniform_(0.5, 1.5)
        lin.bias.uniform_(-0.5, 0.5)
    return ln, lin, lnl, mlp


def _forward(mods, x):
    ln, lin, lnl, mlp = mods
    return mlp(lnl(lin(ln(x))))


def _run(mods, x, grad_seed=1):
    x = x.detach().clone().requires_grad_()
    with te.batch_invariant():
        y = _forward(mods, x)
    gen = torch.Generator(device="cpu").manual_seed(grad_seed)
    dy = torch.randn(y.shape, generator=gen).to(y)
    y.backward(dy)
    return y.detach(), x.grad


# bfloat16 on the GPU only: Triton's interpreter computes bfloat16 dots wrongly.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
def test_rows_equal_in_every_batch_size(dtype):
    # float32 over every row count; the 16-bit dtypes up to 300 rows (the interpreter's time, the same tiles).
    rows_list = ROWS if dtype == torch.float32 or DEVICE == "cuda" else ROWS[:-1]
    mods = _model(dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows_list[-1], HIDDEN, generator=gen).to(device=DEVICE, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    dy_full = torch.randn(rows_list[-1], OUT, generator=gen).to(device=DEVICE, dtype=dtype)
    xf = x.clone().requires_grad_()
    with te.batch_invariant():
        y_full = _forward(mods, xf)
    y_full.backward(dy_full)
    for rows in rows_list[:-1]:
        xs = x[:rows].clone().requires_grad_()
        with te.batch_invariant():
            y = _forward(mods, xs)
        y.backward(dy_full[:rows])
        assert torch.equal(y, y_full[:rows].detach()), rows
        assert torch.equal(xs.grad, xf.grad[:rows]), rows


def test_a_sequence_alone_padded_and_packed():
    """A sequence's rows alone ([1, s, h]), in a padded [4, 37, h] batch and packed with others ([T, h])."""
    mods = _model(torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(2)
    lens = (23, 37, 5, 11)
    seqs = [torch.randn(n, HIDDEN, generator=gen).to(DEVICE) for n in lens]
    padded = torch.zeros(len(lens), max(lens), HIDDEN, device=DEVICE)
    for i, s in enumerate(seqs):
        padded[i, :lens[i]] = s
    packed = torch.cat(seqs)
    y_alone, _ = _run(mods, seqs[1][None])
    y_padded, _ = _run(mods, padded)
    y_packed, _ = _run(mods, packed)
    assert torch.equal(y_alone[0], y_padded[1, :lens[1]])
    assert torch.equal(y_alone[0], y_packed[lens[0]:lens[0] + lens[1]])


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_values_match_float64(normalization, zero_centered_gamma):
    torch.manual_seed(3)
    lnl = te.LayerNormLinear(HIDDEN, OUT, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                             params_dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        lnl.layer_norm_weight.uniform_(-0.5, 0.5)
        lnl.bias.uniform_(-0.5, 0.5)
        if lnl.layer_norm_bias is not None:
            lnl.layer_norm_bias.uniform_(-0.5, 0.5)
    x = torch.randn(50, HIDDEN, device=DEVICE, requires_grad=True)
    dy = torch.randn(50, OUT, device=DEVICE)
    with te.batch_invariant():
        y = lnl(x)
    y.backward(dy)
    got = (y.detach(), x.grad, lnl.weight.grad, lnl.layer_norm_weight.grad)
    # The framework's own float32 result (the default mode) and a float64 reference of the same math.
    lnl.zero_grad()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = lnl(x_ref)
    y_ref.backward(dy)
    ref32 = (y_ref.detach(), x_ref.grad, lnl.weight.grad, lnl.layer_norm_weight.grad)
    params = {n: p.detach().double().requires_grad_() for n, p in lnl.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    gamma = params["layer_norm_weight"] + (1 if zero_centered_gamma else 0)
    if normalization == "LayerNorm":
        h = torch.nn.functional.layer_norm(x64, (HIDDEN,), gamma, params["layer_norm_bias"], lnl.eps)
    else:
        h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + lnl.eps) * gamma
    y64 = h @ params["weight"].t() + params["bias"]
    y64.backward(dy.double())
    ref64 = (y64.detach(), x64.grad, params["weight"].grad, params["layer_norm_weight"].grad)
    for name, g, r32, r64 in zip(("out", "dx", "dW", "dgamma"), got, ref32, ref64):
        err = (g.double() - r64).abs().max().item()
        own = (r32.double() - r64).abs().max().item()
        assert err <= 4 * own + 1e-6 * r64.abs().max().item(), (name, err, own)


def test_weight_gradients_are_deterministic():
    mods = _model(torch.float32)
    x = torch.randn(100, HIDDEN, device=DEVICE)
    grads = []
    for _ in range(2):
        for m in mods:
            m.zero_grad()
        _run(mods, x)
        grads.append([p.grad.clone() for m in mods for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_env_var_and_context_switch_the_mode(monkeypatch):
    calls = []
    real = bi_module._gemm
    monkeypatch.setattr(bi_module, "_gemm", lambda *a: calls.append(1) or real(*a))
    lin = te.Linear(HIDDEN, OUT, device=DEVICE)
    x = torch.randn(3, HIDDEN, device=DEVICE)
    monkeypatch.delenv("NVTE_BATCH_INVARIANT", raising=False)
    assert not te.is_batch_invariant()
    lin(x)
    assert calls == []
    monkeypatch.setenv("NVTE_BATCH_INVARIANT", "1")
    assert te.is_batch_invariant()
    lin(x)
    assert len(calls) == 1
    with te.batch_invariant(False):
        lin(x)
    assert len(calls) == 1
    monkeypatch.setenv("NVTE_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="NVTE_BATCH_INVARIANT"):
        lin(x)


def test_refusals_name_the_reason(monkeypatch):
    with pytest.raises(ValueError, match="`enabled` must be a bool"):
        with te.batch_invariant("on"):
            pass
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with te.batch_invariant(), pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
            te.Linear(HIDDEN, OUT, device="cpu")(torch.randn(2, HIDDEN))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from transformer_engine.common import recipe

    lin = te.Linear(HIDDEN, OUT, device=DEVICE)
    with te.batch_invariant(), te.autocast(enabled=True, recipe=recipe.Float8CurrentScaling()), \
            pytest.raises(NotImplementedError, match="batch-invariant mode"):
        lin(torch.randn(16, HIDDEN, device=DEVICE))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_rows_equal_in_every_batch_size(label_smoothing):
    """parallel_cross_entropy in the mode: a token's loss and logit gradient are bitwise the same whether it is
    scored alone or among 7, 64 or 300 tokens, and match a float64 reference."""
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    vocab = 100  # not a multiple of the kernel's chunk: masked tail
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(300, vocab, generator=gen)).to(DEVICE)
    target = torch.randint(0, vocab, (300,), generator=gen).to(DEVICE)
    target[5] = -100  # an ignored token
    seen = {}
    for rows in ROWS[:-1]:
        x = logits[:rows].clone().unsqueeze(0).requires_grad_()
        with te.batch_invariant():
            loss = parallel_cross_entropy(x, target[:rows].unsqueeze(0), label_smoothing=label_smoothing)
        loss.backward(torch.ones_like(loss))
        seen[rows] = (loss[0].detach(), x.grad[0])
    for rows, (loss, grad) in seen.items():
        n = min(rows, 7)
        assert torch.equal(loss[:n], seen[7][0][:n]) and torch.equal(grad[:n], seen[7][1][:n]), rows
    loss, grad = seen[300]
    x64 = logits.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64, target, reduction="none", label_smoothing=label_smoothing)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), x64.grad, rtol=1e-6, atol=1e-6)
    assert loss[5] == 0 and not grad[5].any()


def test_fp8_block_scaling_rows_equal_in_every_batch_size():
    """Float8BlockScaling keeps a row's FP8 values its own (a scale per 1x128 tile of a row): in the mode its
    GEMMs run on the batch-invariant kernel over the exactly dequantized operands, so a row's output and input
    gradient are bitwise the same among 1, 7, 64 or 300 rows, and equal the default FP8 block path to float32
    rounding. Per-tensor recipes stay refused, naming the recipe that works."""
    from transformer_engine.common import recipe

    torch.manual_seed(0)
    mods = (te.LayerNormLinear(HIDDEN, HIDDEN, device=DEVICE), te.Linear(HIDDEN, OUT, device=DEVICE))
    x = torch.randn(300, HIDDEN, device=DEVICE)
    dy = torch.randn(300, OUT, device=DEVICE)

    def run(rows, invariant):
        xr = x[:rows].clone().requires_grad_()
        with te.batch_invariant(invariant), te.autocast(enabled=True, recipe=recipe.Float8BlockScaling()):
            y = mods[1](mods[0](xr))
        y.backward(dy[:rows])
        return y.detach(), xr.grad

    seen = {rows: run(rows, True) for rows in ROWS[:-1]}
    for rows, (y, gx) in seen.items():
        assert torch.equal(y[:1], seen[1][0]) and torch.equal(gx[:1], seen[1][1]), rows
    y_ref, gx_ref = run(300, False)
    torch.testing.assert_close(seen[300][0], y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen[300][1], gx_ref, rtol=1e-5, atol=1e-5)
    for rec in (recipe.DelayedScaling(), recipe.Float8CurrentScaling()):
        with te.batch_invariant(), te.autocast(enabled=True, recipe=rec), \
                pytest.raises(NotImplementedError, match=f"under {type(rec).__name__}.*Float8BlockScaling keeps"):
            mods[1](torch.randn(4, HIDDEN, device=DEVICE))
