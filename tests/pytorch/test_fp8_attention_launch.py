"""FP8 attention on the shared launch path: its launches come from the launch description
(``launch_description.fp8_forward_launches`` / ``fp8_backward_launches``) and run behind the custom ops
``transformer_engine::fp8_attn_fwd`` / ``fp8_attn_bwd``, so DotProductAttention under fp8_dpa compiles with
``torch.compile(fullgraph=True)`` to eager's bits. CPU under Triton's interpreter."""

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.attention import launch_description  # noqa: E402
from transformer_engine.common.attention.fp8 import fp8_plan  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from transformer_engine.pytorch.attention import kernel_runner  # noqa: E402
from transformer_engine.pytorch.attention.fp8_attention import fp8_attn_call, quantize  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"  # qa/L1_pytorch_gpu runs these on CUDA (TRITON_INTERPRET=0)
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

B, S, H, HK, D = 2, 16, 2, 1, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, S, H, D, generator=g)
    k, v = (torch.randn(B, S, HK, D, generator=g) * (1 + i) for i in range(2))
    return [x.to(DEVICE) for x in (q, k, v, torch.randn(B, S, H * D, generator=g))]


@pytest.mark.parametrize("scaling", ["per_tensor", "per_sequence"])
def test_compiled_fullgraph_equals_eager_bitwise(scaling):
    q, k, v, dout = _inputs()
    dpa = te.DotProductAttention(H, D, num_gqa_groups=HK, attn_mask_type="causal", qkv_format="bshd").to(DEVICE)
    dpa.fp8_dpa_scaling = scaling
    results = []
    for fn in (dpa, torch.compile(dpa, fullgraph=True, backend="aot_eager")):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        with te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_dpa=True)):
            out = fn(qq, kk, vv)
        out.backward(dout)
        results.append([out.detach(), qq.grad, kk.grad, vv.grad])
    assert dpa.last_backend == "FusedAttention(FP8)"
    for a, b in zip(*results):
        assert torch.equal(a, b), (a - b).abs().max()


def test_delayed_scaling_under_compile_is_refused_by_name():
    q, k, v, _ = _inputs()
    dpa = te.DotProductAttention(H, D, num_gqa_groups=HK, attn_mask_type="causal", qkv_format="bshd").to(DEVICE)
    with te.autocast(enabled=True, recipe=DelayedScaling(fp8_dpa=True)):
        with pytest.raises(Exception, match="DelayedScaling inside torch.compile"):
            torch.compile(dpa, fullgraph=True, backend="aot_eager")(q, k, v)


def test_launches_are_the_launch_descriptions():
    """The forward's and backward's launches: the FP8 kernels with the bf16 launches' sequence slots and strides,
    descale as a slot (batch/kv-head strides 0 per tensor, the [batch, h_kv, 4] array's per sequence)."""
    q, k, v, _ = _inputs()
    for per_sequence in (False, True):
        scale = torch.full((B, HK), 40.0, device=DEVICE) if per_sequence else 40.0
        meta, call = fp8_attn_call(q, k, v, "bshd", "causal", q_scale=scale, k_scale=scale, v_scale=scale)
        q8, k8, v8 = (quantize(x, torch.tensor(40.0), torch.float8_e4m3fn) for x in (q, k, v))
        seqs = kernel_runner.sequences(q8, k8, call)
        out = torch.empty(B, S, H, D, device=DEVICE)
        views = dict(q=q8, k=k8, v=v8, out=out, d_out=q8, dq=out, dk=k, dv=v)
        strides = (HK * 4, 4) if per_sequence else (0, 0)
        described = dataclasses.replace(kernel_runner.describe(q8, k8, v8, call, seqs, views, (H * S, S)),
                                        descale_strides=strides)
        plan = fp8_plan(D, D, "interpreter")
        fwd = launch_description.fp8_forward_launches(described, plan)
        bwd = launch_description.fp8_backward_launches(described, plan)
        assert [x.name for x in fwd + bwd] == ["attn_fp8_fwd_kernel", "attn_fp8_bwd_preprocess_kernel",
                                               "attn_fp8_bwd_dkdv_kernel", "attn_fp8_bwd_dq_kernel"]
        for launch in fwd + bwd:
            args = dict(launch.describe()[2])
            assert args["DESCALE"] == ("slot", "descale")
            assert (args["stride_db"], args["stride_dh"]) == strides
            if "HAS_RIGHT" in args:  # causal: plan.window_mask_flags, as the bf16 launches
                assert args["HAS_RIGHT"] is True and args["window_right"] == 0 and args["HAS_LEFT"] is False
        assert dict(fwd[0].describe()[2])["AMAX"] == ("slot", "fwd_amax")
        assert fwd[0].grid == (1, B * H, 1) and bwd[1].grid == (1, B * HK, 1)
