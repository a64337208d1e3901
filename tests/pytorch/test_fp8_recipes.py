"""FP8 recipes in Linear over 20 training steps: every scale, amax history and quantized operand equals a
float64 re-computation of TransformerEngine's formulas (delayed scaling's update points included)."""

import math

import numpy as np
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import quantization_linear as ql
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

F32_MAX = float(np.finfo(np.float32).max)
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
STEPS, M, K, N = 20, 24, 160, 40


@pytest.fixture(autouse=True)
def _fresh_fp8_state():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


@pytest.fixture
def gemms(monkeypatch):
    """Every FP8 GEMM's operands, in call order: (a, b) of dequant(a) @ dequant(b).T."""
    calls = []
    real = ql.scaled_gemm

    def recording(a, b, out_dtype, split=True):
        calls.append((a, b))
        return real(a, b, out_dtype, split)

    monkeypatch.setattr(ql, "scaled_gemm", recording)
    return calls


def _ref_update(history, scale, fmt_max, margin, algo):
    """TransformerEngine's delayed-scaling update in float64 (lists of rows)."""
    length, n = len(history), len(history[0])
    new_scale = []
    for j in range(n):
        col = [history[i][j] for i in range(length)]
        amax = max(col) if algo == "max" else col[0]
        if math.isfinite(amax) and amax > 0:
            s = min(fmt_max / amax / 2.0 ** margin, F32_MAX)
        else:
            s = scale[j]
        new_scale.append(s)
    rolled = [list(history[(i + 1) % length]) for i in range(length)]
    rolled[0] = [0.0] * n
    return rolled, new_scale


def _f32(values):
    return torch.tensor(np.array(values, np.float64).astype(np.float32))


def _ref_quantize(x, scale, fmt):
    """TransformerEngine's cast: x * scale in float32, saturated to the format's max, rounded to FP8."""
    scaled = (x.detach().double() * float(scale)).float()  # float64 product of two float32s, rounded once: the float32 product
    return scaled.clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_TORCH[fmt])


def _inputs(step, gen):
    # magnitudes that move by orders of magnitude, so that scales change and the history matters
    mag = 10.0 ** ((step * 7) % 5 - 2)
    x = torch.randn(M, K, generator=gen) * mag
    g = torch.randn(M, N, generator=gen) * 10.0 ** ((step * 3) % 4 - 3)
    return x.requires_grad_(), g


@pytest.mark.parametrize("algo,length,margin", [("max", 5, 1), ("most_recent", 3, 0), ("max", 1, 0)])
def test_delayed_scaling_state_and_operands_equal_te_formulas_over_20_steps(gemms, algo, length, margin):
    rec = recipe.DelayedScaling(margin=margin, amax_history_len=length, amax_compute_algo=algo,
                                fp8_format=recipe.Format.HYBRID)
    torch.manual_seed(0)
    lin = te.Linear(K, N, bias=False, params_dtype=torch.float32, device="cpu")
    opt = torch.optim.SGD(lin.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    fwd_hist, fwd_scale = [[0.0] * 3 for _ in range(length)], [1.0] * 3
    bwd_hist, bwd_scale = [[0.0] * 2 for _ in range(length)], [1.0] * 2
    for step in range(STEPS):
        x, g = _inputs(step, gen)
        w = lin.weight.detach().clone()
        gemms.clear()
        with te.autocast(enabled=True, recipe=rec):
            y = lin(x)
        # this step's quantization used the scales of the last update
        qx, qw = gemms[0]
        assert torch.equal(qx.data.view(torch.uint8), _ref_quantize(x, fwd_scale[0], "e4m3").view(torch.uint8))
        assert torch.equal(qw.data.view(torch.uint8), _ref_quantize(w, fwd_scale[1], "e4m3").view(torch.uint8))
        assert qx.scale_inv.item() == np.float32(1.0 / np.float32(fwd_scale[0]))
        # forward update at the autocast's exit
        fwd_hist[0][0] = max(fwd_hist[0][0], float(x.detach().abs().max()))
        fwd_hist[0][1] = max(fwd_hist[0][1], float(w.abs().max()))
        fwd_hist, fwd_scale = _ref_update(fwd_hist, fwd_scale, FP8_MAX["e4m3"], margin, algo)
        meta = lin._fp8_state.fwd_meta
        assert torch.equal(meta.amax_history, _f32(fwd_hist)) and torch.equal(meta.scale, _f32(fwd_scale))
        # backward: grad output quantized (E5M2) with the backward scale of the last update, then updated
        (y * g).sum().backward()
        qdy = gemms[2][0].t() if len(gemms) > 2 else None
        assert torch.equal(gemms[1][0].data.view(torch.uint8), _ref_quantize(g, bwd_scale[0], "e5m2").view(torch.uint8))
        bwd_hist[0][0] = max(bwd_hist[0][0], float(g.abs().max()))
        bwd_hist, bwd_scale = _ref_update(bwd_hist, bwd_scale, FP8_MAX["e5m2"], margin, algo)
        meta = lin._fp8_state.bwd_meta
        assert torch.equal(meta.amax_history, _f32(bwd_hist)) and torch.equal(meta.scale, _f32(bwd_scale))
        assert qdy is not None and qdy.fmt == "e5m2"
        opt.step()
        opt.zero_grad()
    assert fwd_scale[0] != 1.0 and bwd_scale[0] != 1.0


def _ref_current_scale(amax, fmt, qparams):
    amax = max(amax, float(np.float32(qparams.amax_epsilon)))
    if amax == 0 or math.isinf(amax):
        return 1.0
    s = min(FP8_MAX[fmt] / amax, F32_MAX)
    s = float(np.float32(s))
    if qparams.power_2_scale:
        s = 2.0 ** math.floor(math.log2(s))
    return s


@pytest.mark.parametrize("qparams", [recipe.QParams(), recipe.QParams(power_2_scale=True, amax_epsilon=1e-2)])
def test_current_scaling_operands_equal_te_formulas_over_20_steps(gemms, qparams):
    rec = recipe.Float8CurrentScaling(fp8_quant_fwd_inp=qparams, fp8_quant_fwd_weight=qparams,
                                      fp8_quant_bwd_grad=qparams)
    torch.manual_seed(0)
    lin = te.Linear(K, N, bias=False, params_dtype=torch.float32, device="cpu")
    opt = torch.optim.SGD(lin.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        x, g = _inputs(step, gen)
        if step == 3:
            x = (x.detach() * 1e-6).requires_grad_()  # amax below the epsilon of the second parametrization
        w = lin.weight.detach().clone()
        gemms.clear()
        with te.autocast(enabled=True, recipe=rec):
            y = lin(x)
        (y * g).sum().backward()
        (qx, qw), (qdy, _), (qdy_t, qx_t) = gemms
        for op, src, fmt in ((qx, x, "e4m3"), (qw, w, "e4m3"), (qdy, g, "e5m2")):
            scale = _ref_current_scale(float(src.detach().abs().max()), fmt, qparams)
            assert op.tile is None and op.scale_inv.item() == np.float32(1.0 / np.float32(scale))
            assert torch.equal(op.data.view(torch.uint8), _ref_quantize(src, scale, fmt).view(torch.uint8))
        # wgrad takes the transposes of the same operands
        assert torch.equal(qdy_t.data, qdy.data.t()) and torch.equal(qx_t.data, qx.data.t())
        opt.step()
        opt.zero_grad()
    assert lin._fp8_state.fwd_meta is None  # no state kept by current scaling


def _ref_blocks(x, tile, fmt, qparams):
    """Block scaling in float64: per tile of ``x`` (edge tiles partial), current scaling of the tile."""
    rows, cols = x.shape
    th, tw = tile
    nb_r, nb_c = -(-rows // th), -(-cols // tw)
    scale = np.zeros((nb_r, nb_c))
    full = torch.zeros(rows, cols, dtype=torch.float64)
    for i in range(nb_r):
        for j in range(nb_c):
            blk = x[i * th:(i + 1) * th, j * tw:(j + 1) * tw].detach().double()
            s = _ref_current_scale(float(blk.abs().max()), fmt, qparams)
            scale[i, j] = s
            full[i * th:(i + 1) * th, j * tw:(j + 1) * tw] = s
    data = (x.detach().double() * full).float().clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_TORCH[fmt])
    return data, torch.tensor((1.0 / scale.astype(np.float32)).astype(np.float32))


def test_block_scaling_operands_equal_te_formulas_over_20_steps(gemms):
    rec = recipe.Float8BlockScaling()
    qp = rec.fp8_quant_fwd_inp
    torch.manual_seed(0)
    lin = te.Linear(K, N, bias=False, params_dtype=torch.float32, device="cpu")
    opt = torch.optim.SGD(lin.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        x, g = _inputs(step, gen)
        with torch.no_grad():
            x[:, 130:] *= 1e3  # a second K tile of another magnitude
        w = lin.weight.detach().clone()
        gemms.clear()
        with te.autocast(enabled=True, recipe=rec):
            y = lin(x)
        (y * g).sum().backward()
        (qx, qw), (qdy, qw_t), (qdy_col, qx_col) = gemms
        expected = [(qx, x, (1, 128), "e4m3"), (qw, w, (128, 128), "e4m3"), (qdy, g, (1, 128), "e4m3"),
                    (qdy_col, g.t(), (1, 128), "e4m3"), (qx_col, x.t(), (1, 128), "e4m3")]
        for op, src, tile, fmt in expected:
            data, scale_inv = _ref_blocks(src, tile, fmt, qp)
            assert op.tile == tile
            assert torch.equal(op.scale_inv, scale_inv), (tile, op.scale_inv, scale_inv)
            assert torch.equal(op.data.view(torch.uint8), data.view(torch.uint8))
        # dgrad reuses the 128x128 weight tiles, transposed (exact)
        assert torch.equal(qw_t.data, qw.data.t()) and torch.equal(qw_t.scale_inv, qw.scale_inv.t())
        opt.step()
        opt.zero_grad()


def test_calibration_records_amaxes_and_computes_in_high_precision():
    torch.manual_seed(0)
    lin = te.Linear(K, N, params_dtype=torch.float32, device="cpu")
    x = torch.randn(M, K)
    with te.autocast(enabled=False, calibrating=True, recipe=recipe.DelayedScaling(amax_history_len=4)):
        y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    meta = lin._fp8_state.fwd_meta
    assert meta.amax_history[0, 0].item() == x.abs().max().item()
    assert meta.amax_history[0, 1].item() == lin.weight.abs().max().item()
    assert torch.equal(meta.scale, torch.ones(3))  # no update outside FP8
    # the first FP8 step quantizes with scale 1, then its update sees the calibrated amaxes
    with te.autocast(enabled=True, recipe=recipe.DelayedScaling(amax_history_len=4)):
        lin(x * 0.5)
    assert meta.scale[0].item() == np.float32(448.0 / x.abs().max().item())
