"""Batch-invariant FP8 attention: DotProductAttention's ``fp8_dpa_scaling = "per_sequence"`` under
Float8CurrentScaling(fp8_dpa=True) gives each sequence and kv head its own current scales (Q, K, V and dO), so
a sequence's output and gradients are bitwise the same alone, batched with a larger-amax neighbour, and packed
(thd); the default per-tensor scaling is not (the control). CPU under Triton's interpreter, fp16 and fp32."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"  # qa/L1_pytorch_gpu runs these on CUDA (TRITON_INTERPRET=0)
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

H, HK, D = 2, 1, 16
S_A, S_B = 16, 11  # the sequence under test, and its neighbour (shorter: thd packs it first, unaligned)


def _dpa(fmt, mask, scaling):
    dpa = te.DotProductAttention(H, D, num_gqa_groups=HK, attn_mask_type=mask, qkv_format=fmt).to(DEVICE)
    dpa.fp8_dpa_scaling = scaling
    return dpa


def _data(dtype):
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(S_A, h, D, generator=g) for h in (H, HK, HK)] + [torch.randn(S_A, H * D, generator=g) * 1e-2]
    # the neighbour: 8x the amax of every tensor (per-tensor scales would follow it)
    b = [torch.randn(S_B, h, D, generator=g) * 8 for h in (H, HK, HK)] + [torch.randn(S_B, H * D, generator=g)]
    return [x.to(DEVICE, dtype) for x in a], [x.to(DEVICE, dtype) for x in b]


def _run(dpa, inputs, dout, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in inputs)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_dpa=True)):
        out = dpa(q, k, v, **kw)
    out.backward(dout)
    assert dpa.last_backend == "FusedAttention(FP8)"
    return [out.detach(), q.grad, k.grad, v.grad]


def _alone(a, scaling):
    return [t[0] for t in _run(_dpa("bshd", "causal", scaling), [x[None] for x in a[:3]], a[3][None])]


def _batched(a, b, scaling):
    # the neighbour cut to S_A rows: a bshd batch of equal lengths, sequence A second
    nb = [torch.cat([x, x[: S_A - S_B]]) for x in b]
    got = _run(_dpa("bshd", "causal", scaling), [torch.stack([y, x]) for x, y in zip(a[:3], nb[:3])],
               torch.stack([nb[3], a[3]]))
    return [t[1] for t in got]


def _packed(a, b, scaling):
    cu = torch.tensor([0, S_B, S_B + S_A], dtype=torch.int32, device=DEVICE)
    got = _run(_dpa("thd", "padding_causal", scaling), [torch.cat([y, x]) for x, y in zip(a[:3], b[:3])],
               torch.cat([b[3], a[3]]), cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S_A, max_seqlen_kv=S_A)
    return [t[S_B:] for t in got]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_per_sequence_scaling_alone_equals_batched_equals_packed_bitwise(dtype):
    a, b = _data(dtype)
    alone = _alone(a, "per_sequence")
    for name, got in (("batched", _batched(a, b, "per_sequence")), ("packed", _packed(a, b, "per_sequence"))):
        for what, x, y in zip(("out", "dq", "dk", "dv"), got, alone):
            assert torch.isfinite(x).all()
            assert torch.equal(x, y), (name, what, (x.float() - y.float()).abs().max().item())
    assert torch.equal(_alone(a, "per_sequence")[0], alone[0])  # run to run


def test_per_tensor_scaling_depends_on_the_neighbour():
    """The control: TransformerEngine's per-tensor current scales follow the batch's amax."""
    a, b = _data(torch.float32)
    alone, batched = _alone(a, "per_tensor"), _batched(a, b, "per_tensor")
    assert not torch.equal(alone[0], batched[0])


def test_per_sequence_scaling_is_refused_by_name_outside_current_scaling():
    a, _ = _data(torch.float32)
    dpa = _dpa("bshd", "causal", "per_sequence")
    with te.autocast(enabled=True, recipe=DelayedScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match="fp8_dpa_scaling='per_sequence' under DelayedScaling"):
            dpa(*[x[None] for x in a[:3]])
    dpa.fp8_dpa_scaling = "per_batch"
    with te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_dpa=True)):
        with pytest.raises(ValueError, match="`fp8_dpa_scaling` must be one of"):
            dpa(*[x[None] for x in a[:3]])


def test_env_var_picks_the_scaling_where_the_attribute_is_unset(monkeypatch):
    """NVTE_FP8_DPA_SCALING=per_sequence (a Megatron run turns it on without code) gives the attribute's bits;
    the attribute wins where set; unset, per-tensor."""
    a, b = _data(torch.float32)
    attr = _batched(a, b, "per_sequence")
    monkeypatch.setenv("NVTE_FP8_DPA_SCALING", "per_sequence")
    assert all(torch.equal(x, y) for x, y in zip(_batched(a, b, None), attr))
    assert torch.equal(_batched(a, b, "per_tensor")[0], _batched(a, b, "per_tensor")[0])
    assert not torch.equal(_batched(a, b, "per_tensor")[0], attr[0])
    monkeypatch.delenv("NVTE_FP8_DPA_SCALING")
    assert torch.equal(_batched(a, b, None)[0], _batched(a, b, "per_tensor")[0])
    monkeypatch.setenv("NVTE_FP8_DPA_SCALING", "per_batch")
    with pytest.raises(ValueError, match="NVTE_FP8_DPA_SCALING must be one of per_tensor, per_sequence"):
        _batched(a, b, None)


def test_functional_per_sequence_scales_equal_each_sequence_alone_with_its_scale():
    """fp8_attn_func with [batch, h_kv] scales (flash-attn 3's descale layout): each sequence of the batch is
    bitwise the sequence alone with its own per-tensor scales (forward and backward, explicit dO scales)."""
    from transformer_engine.pytorch.attention.fp8_attention import fp8_attn_func

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, S_A, h, D, generator=g).to(DEVICE) for h in (H, HK, HK))
    dout = torch.randn(2, S_A, H, D, generator=g).to(DEVICE)
    scales = {name: torch.tensor([[20.0], [90.0]], device=DEVICE) + i for i, name in
              enumerate(("q_scale", "k_scale", "v_scale", "d_out_scale"))}

    def run(sl, sc):
        qq, kk, vv = (x[sl].clone().requires_grad_() for x in (q, k, v))
        out = fp8_attn_func(qq, kk, vv, "bshd", "causal", **sc)
        out.backward(dout[sl])
        return [out.detach(), qq.grad, kk.grad, vv.grad]

    batched = run(slice(None), scales)
    for b in range(2):
        alone = run(slice(b, b + 1), {n: s[b, 0] for n, s in scales.items()})
        for x, y in zip(batched, alone):
            assert torch.equal(x[b:b + 1], y)


def test_per_sequence_scaling_sbhd_and_thd_with_gaps_equal_alone():
    """sbhd batched, and thd with padded offsets whose gap holds large values (outside every sequence: no scale
    reads them), bitwise the sequence alone."""
    a, b = _data(torch.float32)
    alone = _alone(a, "per_sequence")
    sbhd = _run(_dpa("sbhd", "causal", "per_sequence"),
                [torch.stack([torch.cat([y, y[: S_A - S_B]]), x], 1) for x, y in zip(a[:3], b[:3])],
                torch.stack([torch.cat([b[3], b[3][: S_A - S_B]]), a[3]], 1))
    gap = 3
    cu = torch.tensor([0, S_B, S_B + S_A], dtype=torch.int32, device=DEVICE)
    cu_padded = torch.tensor([0, S_B + gap, S_B + gap + S_A], dtype=torch.int32, device=DEVICE)

    def packed(x, y):
        return torch.cat([y, torch.full((gap,) + tuple(y.shape[1:]), 1e3, dtype=y.dtype, device=DEVICE), x])

    thd = _run(_dpa("thd", "padding_causal", "per_sequence"), [packed(x, y) for x, y in zip(a[:3], b[:3])],
               packed(a[3], b[3]), cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
               cu_seqlens_kv_padded=cu_padded, max_seqlen_q=S_A, max_seqlen_kv=S_A)
    for x, y, z in zip(sbhd, thd, alone):
        assert torch.equal(x[:, 1], z) and torch.equal(y[S_B + gap:], z)
