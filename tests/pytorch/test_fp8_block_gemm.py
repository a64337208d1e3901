"""Float8BlockScaling's GEMM dispatch: torch's block-scaled FP8 GEMM on CUDA where it runs, the dequantized
float32 GEMM elsewhere.

CPU: torch refuses 1x128 / 128x128 scales there, so the dispatch must take the dequantized path (the same
bits as asking for it); the operands and scale layouts handed to torch's block-scaled GEMM pass torch's own
layout checks (its meta kernel). CUDA (Hopper): torch's block-scaled GEMM against the dequantized float32 GEMM of
the same FP8 operands, for the fprop (1x128 x 128x128) and wgrad (1x128 x 1x128) layouts, with and without
padding, and a Linear's forward and gradients under Float8BlockScaling; tolerance: 2e-3 of the result's
largest |value| (the tensor cores accumulate each 128-long block in reduced precision before promoting it
to float32); bitwise run to run.
"""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import quantizer_roles as roles
from transformer_engine.common import recipe
from transformer_engine.pytorch import quantization
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from transformer_engine.pytorch.quantization import block_scaled_gemm_available, quantize_blocks, scaled_gemm

QP = recipe.QParams(power_2_scale=True)
TOL = 2e-3


def _operands(m, k, n, b_tile, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)  # tiles of different magnitudes
    b = torch.randn(n, k, generator=g)
    return (quantize_blocks(a.to(device), roles.ROW_TILE, "e4m3", QP),
            quantize_blocks(b.to(device), b_tile, "e4m3", QP))


def test_cpu_takes_the_dequantized_path():
    assert not block_scaled_gemm_available("cpu")
    for b_tile in (roles.ROW_TILE, roles.SQUARE_TILE):
        a, b = _operands(24, 160, 40, b_tile, "cpu")
        out = scaled_gemm(a, b, torch.float32)
        assert torch.equal(out, scaled_gemm(a, b, torch.float32, dequantized=True))
        ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("b_tile", [roles.SQUARE_TILE, roles.ROW_TILE])
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (200, 300, 130), (24, 160, 40)])
def test_block_scaled_gemm_layouts_pass_torchs_checks(m, k, n, b_tile):
    """The operands and scales handed to torch's block-scaled GEMM (padded, scale layouts per tile kind) pass
    torch's own shape and stride checks, run by its meta kernel on CPU (a wrong layout raises there)."""
    functional = torch.nn.functional
    if not hasattr(functional, "scaled_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    meta = dict(device="meta")
    try:  # a row-major scale_a must fail the checks, or this torch's meta kernel checks no layouts
        functional.scaled_mm(torch.empty(256, 512, dtype=torch.float8_e4m3fn, **meta),
                             torch.empty(384, 512, dtype=torch.float8_e4m3fn, **meta).t(), torch.empty(256, 4, **meta),
                             functional.ScalingType.BlockWise1x128, torch.empty(3, 4, **meta),
                             functional.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    except RuntimeError as e:
        assert "blockwise scaling" in str(e)
    else:
        pytest.skip(f"torch {torch.__version__}'s meta kernel does not check block-scale layouts")
    b_scales = (-(-n // 128), -(-k // 128)) if b_tile == roles.SQUARE_TILE else (n, -(-k // 128))
    a = quantization.Quantized(torch.empty(m, k, dtype=torch.float8_e4m3fn, **meta),
                               torch.empty(m, -(-k // 128), **meta), "e4m3", roles.ROW_TILE)
    b = quantization.Quantized(torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta), torch.empty(*b_scales, **meta),
                               "e4m3", b_tile)
    out = quantization._torch_block_scaled_mm(a, b, torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _hopper(), reason="torch's block-scaled FP8 GEMM is checked on a Hopper GPU")
@pytest.mark.parametrize("b_tile", [roles.SQUARE_TILE, roles.ROW_TILE])
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (200, 300, 130)])
def test_cuda_block_scaled_gemm_matches_dequantized(m, k, n, b_tile):
    if not hasattr(torch.nn.functional, "scaled_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    assert block_scaled_gemm_available("cuda", b_tile), "torch's block-scaled GEMM did not run on this Hopper GPU"
    a, b = _operands(m, k, n, b_tile, "cuda")
    out = scaled_gemm(a, b, torch.float32)
    ref = scaled_gemm(a, b, torch.float32, dequantized=True)
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    print(f"block-scaled vs dequantized {m}x{k}x{n} {b_tile}: {err:.3g} of scale")
    assert err <= TOL
    assert torch.equal(out, scaled_gemm(a, b, torch.float32))
    assert scaled_gemm(a, b, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.skipif(not _hopper(), reason="torch's block-scaled FP8 GEMM is checked on a Hopper GPU")
def test_cuda_linear_block_scaling_matches_dequantized(monkeypatch):
    if not hasattr(torch.nn.functional, "scaled_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    torch.manual_seed(0)
    lin = te.Linear(384, 256, bias=False, params_dtype=torch.float32, device="cuda")
    x = torch.randn(4, 64, 384, device="cuda")
    dy = torch.randn(4, 64, 256, device="cuda")

    def run():
        FP8GlobalStateManager.reset()
        lin.weight.grad = None
        xx = x.clone().requires_grad_(True)
        with te.autocast(enabled=True, recipe=recipe.Float8BlockScaling()):
            y = lin(xx)
        y.backward(dy)
        return y.detach(), xx.grad, lin.weight.grad.clone()

    fast = run()
    assert all(torch.equal(u, v) for u, v in zip(fast, run()))
    monkeypatch.setattr(quantization, "block_scaled_gemm_available", lambda *a, **k: False)
    slow = run()
    for name, u, v in zip(("out", "dgrad", "wgrad"), fast, slow):
        err = (u - v).abs().max().item() / v.abs().max().item()
        print(f"Linear {name}: block-scaled vs dequantized {err:.3g} of scale")
        assert err <= TOL, name
