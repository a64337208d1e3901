"""DotProductAttention under te.pytorch.autocast with fp8_dpa=True (DelayedScaling, Float8CurrentScaling) on the FP8
Triton kernels, CPU under Triton's interpreter: amax histories against an fp64 recomputation over 10 steps,
TransformerEngine's FP8-vs-F16 tolerances against the module's own high-precision path, refusals by name."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"  # qa/L1_pytorch_gpu runs these on CUDA (TRITON_INTERPRET=0)
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

B, S, H, D = 1, 33, 2, 32


def _dpa():
    return te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format="bshd").to(DEVICE)


def _step(dpa, recipe, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(DEVICE) * (1 + seed % 3) for _ in range(3))
    dout = torch.randn(B, S, H * D, generator=g).to(DEVICE) * 1e-2
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with te.autocast(enabled=True, recipe=recipe):
        out = dpa(q, k, v)
    out.backward(dout)
    return q, k, v, out.detach(), dout, (q.grad, k.grad, v.grad)


def test_delayed_scaling_amax_history_equals_fp64_recomputation_over_10_steps():
    """The module's forward and backward DelayedScalingMeta (registered with the linear modules' metas, updated at
    the autocast's exit and after the backward): histories and scales against an fp64 recomputation."""
    from transformer_engine.pytorch.attention.fp8_attention import BWD_SLOTS, FWD_SLOTS

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4, amax_compute_algo="max", fp8_dpa=True)
    dpa = _dpa()
    hists = {"fwd": torch.zeros(4, len(FWD_SLOTS), dtype=torch.float64),
             "bwd": torch.zeros(4, len(BWD_SLOTS), dtype=torch.float64)}
    fmax = {"fwd": 448.0, "bwd": 57344.0}
    for step in range(10):
        q, k, v, out, dout, grads = _step(dpa, recipe, step)
        seen = dict(q=q, k=k, v=v, o=out, do=dout, dq=grads[0], dk=grads[1], dv=grads[2])
        state = dpa._fp8_attention_state
        for d, slots, meta in (("fwd", FWD_SLOTS, state.fwd_meta), ("bwd", BWD_SLOTS, state.bwd_meta)):
            hist = hists[d]
            for i, name in enumerate(slots):
                if name in seen:
                    hist[0, i] = seen[name].detach().cpu().double().abs().max()
                else:  # the kernels' own amaxes (softmax probability, dS): read back, checked for range below
                    hist[0, i] = meta.amax_history[-1, i].double()
            expect_scale = fmax[d] / hist.max(0).values  # margin 0, "max" over the history before its roll
            hist.copy_(torch.roll(hist, -1, 0))
            hist[0] = 0
            got = meta.amax_history.double().cpu()
            assert torch.equal(got, hist), (step, d)
            torch.testing.assert_close(meta.scale.double().cpu(), expect_scale, rtol=1e-6, atol=0)
        assert 0 < state.fwd_meta.amax_history[-1, FWD_SLOTS.index("s")] <= 1
        assert state.bwd_meta.amax_history[-1, BWD_SLOTS.index("dp")] > 0
    assert state.steps == 10


def _assert_te_fp8_tolerance(a, b):
    """TransformerEngine's test_dpa_fp8_vs_f16 check: atol 0.5, rtol 0.05, RMSE under 0.11 of the joint range."""
    torch.testing.assert_close(a, b, atol=5e-1, rtol=5e-2)
    rmse = (a.double() - b.double()).pow(2).mean().sqrt()
    assert rmse < 0.11 * (max(a.max(), b.max()) - min(a.min(), b.min()))


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(fp8_dpa=True),
                                    DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent", fp8_dpa=True)],
                         ids=["current", "delayed"])
def test_dpa_fp8_vs_high_precision_within_te_tolerances(recipe):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(DEVICE) for _ in range(3))
    dout = torch.randn(B, S, H * D, generator=g).to(DEVICE)
    results = []
    for fp8 in (True, False):
        dpa = _dpa()
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        runs = 2 if (fp8 and type(recipe).delayed()) else 1  # delayed: the second step scales from the first's amax
        for _ in range(runs):
            qq.grad = kk.grad = vv.grad = None
            with te.autocast(enabled=fp8, recipe=recipe):
                out = dpa(qq, kk, vv)
            out.backward(dout)
        if fp8:
            assert dpa.last_backend == "FusedAttention(FP8)"
        results.append(tuple(t.cpu() for t in (out.detach(), qq.grad, kk.grad, vv.grad)))
    for a, b in zip(*results):
        _assert_te_fp8_tolerance(a, b)
    assert not torch.equal(results[0][0], results[1][0])  # FP8 did run


def test_dpa_fp8_refuses_by_name():
    q = torch.randn(B, S, H, D).to(DEVICE)
    with te.autocast(enabled=True, recipe=DelayedScaling(fp8_dpa=True, fp8_mha=True)):
        with pytest.raises(NotImplementedError, match="fp8_mha"):
            _dpa()(q, q, q)
    dpa = te.DotProductAttention(H, D, attn_mask_type="no_mask", qkv_format="bshd", attention_dropout=0.1).to(DEVICE)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match="attention_dropout=0.1"):
            dpa(q, q, q)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's requirements")
@pytest.mark.parametrize("interpret,dtype", [("0", torch.float16), ("0", torch.bfloat16), ("1", torch.bfloat16)])
def test_dpa_fp8_on_cpu_names_both_requirements(interpret, dtype, monkeypatch):
    """Whichever of the two the call misses, the error names both (the interpreter and a non-bfloat16 dtype)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q = torch.randn(B, S, H, D, dtype=dtype)
    with te.autocast(enabled=True, recipe=DelayedScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match=r"TRITON_INTERPRET=1 .* float16 or float32"):
            _dpa()(q, q, q)


def test_dpa_fp8_logs_why_it_runs_fp8(caplog):
    import logging

    q = torch.randn(B, S, H, D).to(DEVICE)
    with caplog.at_level(logging.INFO, logger="transformer_engine"):
        with te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_dpa=True)):
            _dpa()(q, q, q)
    text = caplog.text
    assert "Selected backend = FusedAttention(FP8)" in text and "Float8CurrentScaling" in text
    assert "no FP8 variant yet" in text and "attn_fp8_fwd_kernel" in text
