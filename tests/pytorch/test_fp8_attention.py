"""FP8 attention on the Triton kernels (kernels/fp8.py) through fp8_attn_func, on CPU under Triton's interpreter.

Checks: forward and backward against an fp64 reference of the same quantized math (the same FP8 operands
dequantized, P quantized to E4M3 with the kernel's fixed scale relative to the online softmax's running max
at the kernel's key blocks, dO quantized as the Function does), relative error under 1e-2; bitwise run to
run; the bf16-style path within TransformerEngine's FP8-vs-F16 tolerances; refusals by name.
"""

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from transformer_engine.common.attention.fp8 import P_SCALE, fp8_plan  # noqa: E402
from transformer_engine.common.attention.kernels.fp8 import to_fp8  # noqa: E402
from transformer_engine.common.quantization import FP8_MAX, scale_from_current_amax  # noqa: E402
from transformer_engine.pytorch.attention.fp8_attention import AMAX_SLOTS, fp8_attn_func, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

E4M3 = torch.float8_e4m3fn


def _q8(x, scale, dtype=E4M3):
    return quantize(x, torch.tensor(scale), dtype).double() / scale


def _ref_sequence(q, k, v, dout, scales, sm_scale, causal, window, bottom_right, block_n, do_scale, do_dtype, out):
    """fp64 reference of one sequence, [s, h, d] tensors: (out, dq, dk, dv)."""
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    qd, kd, vd = _q8(q, scales[0]), _q8(k, scales[1]), _q8(v, scales[2])
    g = hq // hk
    kd_, vd_ = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    t = torch.einsum("ihd,jhd->hij", qd, kd_) * sm_scale * math.log2(math.e)  # log2 units
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = sk - sq if bottom_right else 0
    left, right = window
    if causal:
        right = 0
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        vis &= j - (i + diag) <= right
    if left >= 0:
        vis &= j - (i + diag) >= -left
    t = t.masked_fill(~vis, -math.inf)
    # The kernel's running max at each key block (ascending blocks of block_n keys from key 0).
    nb = -(-sk // block_n)
    tp = torch.nn.functional.pad(t, (0, nb * block_n - sk), value=-math.inf)
    m_blk = tp.view(hq, sq, nb, block_n).amax(-1).cummax(-1).values  # [h, sq, nb]
    m_key = m_blk.repeat_interleave(block_n, -1)[..., :sk]
    m_fin = m_blk[..., -1:]
    ok = torch.isfinite(m_fin)
    m_key_s = torch.where(torch.isfinite(m_key), m_key, torch.zeros_like(m_key))
    p_run = torch.exp2(t - m_key_s)  # what the kernel quantizes
    p_q = (p_run * P_SCALE).to(torch.float32).clamp(max=448).to(E4M3).double() / P_SCALE
    m_fin_s = torch.where(ok, m_fin, torch.zeros_like(m_fin))
    fold = torch.exp2(m_key_s - m_fin_s).masked_fill(~vis, 0)
    l = (torch.exp2(t - m_fin_s)).sum(-1, keepdim=True)
    o = torch.einsum("hij,jhd->ihd", p_q * fold / torch.where(l > 0, l, 1), vd_)
    # Backward: P from the exact softmax, quantized with the same fixed scale for dV.
    p = torch.exp2(t - m_fin_s) / torch.where(l > 0, l, 1)
    dod = _q8(dout, do_scale, do_dtype)
    pq = (p * P_SCALE).to(torch.float32).to(E4M3).double() / P_SCALE
    dv_ = torch.einsum("hij,ihd->jhd", pq, dod)
    dp = torch.einsum("ihd,jhd->hij", dod, vd_)
    delta = (dod * out.double()).sum(-1).transpose(0, 1)[..., None]  # [h, sq, 1]
    ds = p * (dp - delta)
    dq = torch.einsum("hij,jhd->ihd", ds, kd_) * sm_scale
    dk_ = torch.einsum("hij,ihd->jhd", ds, qd) * sm_scale
    dk = dk_.view(sk, hk, g, -1).sum(2)
    dv = dv_.view(sk, hk, g, -1).sum(2)
    return o, dq, dk, dv


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(shape_q, shape_kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g) * 1.5
    k = torch.randn(shape_kv, generator=g) * 1.5
    v = torch.randn(shape_kv, generator=g)
    return q, k, v


def _scales(*xs, fmt="e4m3"):
    return [float(scale_from_current_amax(torch, x.abs().amax(), FP8_MAX[fmt])) for x in xs]


def _run(q, k, v, dout, **kw):
    """out, dq, dk, dv (on the CPU) of fp8_attn_func on DEVICE."""
    kw = {n: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    q, k, v = (x.detach().to(DEVICE).clone().requires_grad_() for x in (q, k, v))
    out = fp8_attn_func(q, k, v, **kw)
    out.backward(dout.to(DEVICE))
    return out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()


CASES = [  # (format, mask, window, h_q, h_kv, s_q, s_kv, d)
    ("bshd", "no_mask", (-1, -1), 2, 1, 40, 40, 32),
    ("sbhd", "causal", (-1, -1), 2, 2, 37, 37, 32),
    ("bshd", "causal_bottom_right", (8, 0), 4, 2, 24, 45, 32),
]


@pytest.mark.parametrize("fmt,mask,window,hq,hk,sq,sk,d", CASES)
def test_fp8_attention_matches_fp64_reference_of_the_quantized_math(fmt, mask, window, hq, hk, sq, sk, d):
    b = 2
    if fmt == "bshd":
        q, k, v = _inputs((b, sq, hq, d), (b, sk, hk, d))
        dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(1)) * 1e-3
    else:
        q, k, v = _inputs((sq, b, hq, d), (sk, b, hk, d))
        dout = torch.randn(sq, b, hq, d, generator=torch.Generator().manual_seed(1)) * 1e-3
    scales = _scales(q, k, v)
    amax = torch.zeros(len(AMAX_SLOTS), device=DEVICE)
    out, dq, dk, dv = _run(q, k, v, dout, qkv_format=fmt, attn_mask_type=mask, window_size=window, q_scale=scales[0],
                           k_scale=scales[1], v_scale=scales[2], amax=amax)
    amax = amax.cpu()
    do_scale = float(scale_from_current_amax(torch, dout.abs().amax(), FP8_MAX["e5m2"]))
    sm = d ** -0.5
    block_n = fp8_plan(d, d, "interpreter").forward.block_n
    bt = (lambda x: x) if fmt == "bshd" else (lambda x: x.transpose(0, 1))
    refs = []
    for i in range(b):
        refs.append(_ref_sequence(bt(q)[i], bt(k)[i], bt(v)[i], bt(dout)[i], scales, sm, "causal" in mask, window,
                                  "bottom_right" in mask or window != (-1, -1), block_n, do_scale, torch.float8_e5m2,
                                  bt(out)[i]))
    for n, got in enumerate((out, dq, dk, dv)):
        ref = torch.stack([r[n] for r in refs])
        assert _rel(bt(got), ref) < 1e-2, ("out", "dq", "dk", "dv")[n]
    # amaxes: O as stored, the softmax's largest probability, the inputs'
    assert amax[AMAX_SLOTS["o"]] == out.abs().max()
    assert amax[AMAX_SLOTS["q"]] == q.abs().max() and amax[AMAX_SLOTS["dq"]] == dq.abs().max()
    assert 0 < amax[AMAX_SLOTS["s"]] <= 1 and amax[AMAX_SLOTS["dp"]] > 0
    # bitwise run to run
    again = _run(q, k, v, dout, qkv_format=fmt, attn_mask_type=mask, window_size=window, q_scale=scales[0],
                 k_scale=scales[1], v_scale=scales[2])
    for a, b_ in zip((out, dq, dk, dv), again):
        assert torch.equal(a, b_)


def _packed_case(seed=3):
    """Three sequences of lengths 5, 33, 20 (q) and 9, 33, 20 (kv), thd with gaps (padded offsets)."""
    lq, lk = [5, 33, 20], [9, 33, 20]
    gap = 3
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)
    cu_pad = lambda ls: torch.tensor([0] + list(torch.tensor([n + gap for n in ls]).cumsum(0)), dtype=torch.int32)
    tq, tk = int(cu_pad(lq)[-1]), int(cu_pad(lk)[-1])
    q, k, v = _inputs((tq, 4, 32), (tk, 2, 32), seed)
    dout = torch.randn(tq, 4, 32, generator=torch.Generator().manual_seed(seed + 1)) * 1e-2
    return lq, lk, cu(lq), cu(lk), cu_pad(lq), cu_pad(lk), q, k, v, dout


def test_fp8_attention_thd_with_gaps_gqa_causal_bottom_right_e4m3_backward():
    lq, lk, cq, ck, cqp, ckp, q, k, v, dout = _packed_case()
    scales = _scales(q, k, v)
    do_scale = 3.0e4  # an explicit dO scale (delayed scaling's), E4M3 under Format.E4M3
    kw = dict(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", q_scale=scales[0], k_scale=scales[1],
              v_scale=scales[2], d_out_scale=do_scale, fp8_format="E4M3", cu_seqlens_q=cq, cu_seqlens_kv=ck,
              cu_seqlens_q_padded=cqp, cu_seqlens_kv_padded=ckp)
    out, dq, dk, dv = _run(q, k, v, dout, **kw)
    block_n = fp8_plan(32, 32, "interpreter").forward.block_n
    for i in range(3):
        sq_, sk_ = slice(int(cqp[i]), int(cqp[i]) + lq[i]), slice(int(ckp[i]), int(ckp[i]) + lk[i])
        ref = _ref_sequence(q[sq_], k[sk_], v[sk_], dout[sq_], scales, 32 ** -0.5, True, (-1, -1), True, block_n,
                            do_scale, E4M3, out[sq_])
        for n, got in enumerate((out[sq_], dq[sq_], dk[sk_], dv[sk_])):
            assert _rel(got, ref[n]) < 1e-2, (i, ("out", "dq", "dk", "dv")[n])
    # the gaps between sequences stay zero
    gaps_q = torch.ones(q.shape[0], dtype=torch.bool)
    for i in range(3):
        gaps_q[int(cqp[i]):int(cqp[i]) + lq[i]] = False
    assert torch.equal(out[gaps_q], torch.zeros_like(out[gaps_q])) and torch.equal(dq[gaps_q], torch.zeros_like(dq[gaps_q]))
    # packing invariance: sequence 1 alone (bshd, batch 1) gives the same bits
    s1q, s1k = slice(int(cqp[1]), int(cqp[1]) + lq[1]), slice(int(ckp[1]), int(ckp[1]) + lk[1])
    alone = _run(q[s1q][None], k[s1k][None], v[s1k][None], dout[s1q][None], qkv_format="bshd",
                 attn_mask_type="causal_bottom_right", q_scale=scales[0], k_scale=scales[1], v_scale=scales[2],
                 d_out_scale=do_scale, fp8_format="E4M3")
    for a, b_ in zip((out[s1q], dq[s1q], dk[s1k], dv[s1k]), alone):
        assert torch.equal(a, b_[0])


def test_fp8_attention_padding_mask_bshd():
    b, s, h, d = 2, 36, 2, 32
    q, k, v = _inputs((b, s, h, d), (b, s, h, d), 5)
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(6)) * 1e-2
    lens = torch.tensor([36, 17], dtype=torch.int32)
    cu = torch.tensor([0, 36, 53], dtype=torch.int32)
    scales = _scales(q, k, v)
    out, dq, dk, dv = _run(q, k, v, dout, qkv_format="bshd", attn_mask_type="padding", q_scale=scales[0],
                           k_scale=scales[1], v_scale=scales[2], cu_seqlens_q=cu, cu_seqlens_kv=cu)
    do_scale = float(scale_from_current_amax(torch, dout.abs().amax(), FP8_MAX["e5m2"]))
    n = int(lens[1])
    ref = _ref_sequence(q[1, :n], k[1, :n], v[1, :n], dout[1, :n], scales, d ** -0.5, False, (-1, -1), False,
                        fp8_plan(d, d, "interpreter").forward.block_n, do_scale, torch.float8_e5m2, out[1, :n])
    for i, got in enumerate((out[1, :n], dq[1, :n], dk[1, :n], dv[1, :n])):
        assert _rel(got, ref[i]) < 1e-2
    for t in (out, dq, dk, dv):
        assert torch.equal(t[1, n:], torch.zeros_like(t[1, n:]))


def _assert_te_fp8_tolerance(a, b):
    """TransformerEngine's FP8-vs-F16 attention check (tests/pytorch/attention/test_attention.py,
    test_dpa_fp8_vs_f16): atol 0.5, rtol 0.05, and RMSE under 0.11 of the two tensors' joint range."""
    torch.testing.assert_close(a, b, atol=5e-1, rtol=5e-2)
    rmse = (a.double() - b.double()).pow(2).mean().sqrt()
    span = max(a.max(), b.max()) - min(a.min(), b.min())
    assert rmse < 0.11 * span, (rmse, span)


@pytest.mark.parametrize("fp8_backward", [True, False])
def test_fp8_attention_vs_high_precision_path_within_te_tolerances(fp8_backward):
    """Against the fused fp32 kernels on the unquantized inputs (the F16 path of the interpreter), with
    TransformerEngine's own tolerances; fp8_backward=False (NVTE_FP8_DPA_BWD=0) runs the fused backward."""
    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

    b, s, h, d = 2, 40, 2, 32
    q, k, v = _inputs((b, s, h, d), (b, s, h, d), 7)
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(8))
    scales = _scales(q, k, v)
    fp8 = _run(q, k, v, dout, qkv_format="bshd", attn_mask_type="causal", q_scale=scales[0], k_scale=scales[1],
               v_scale=scales[2], fp8_backward=fp8_backward)
    qh, kh, vh = (x.to(DEVICE).requires_grad_() for x in (q, k, v))
    ref = fused_attn_func(qh, kh, vh, "bshd", "causal", (-1, 0), d ** -0.5)
    ref.backward(dout.to(DEVICE))
    ref = ref.detach().cpu()
    for a, r in zip(fp8, (ref, qh.grad.cpu(), kh.grad.cpu(), vh.grad.cpu())):
        _assert_te_fp8_tolerance(a, r)
    assert _rel(fp8[0], ref) < 0.05  # and much closer than the tolerance in norm


def test_nvte_fp8_dpa_bwd_0_runs_the_high_precision_backward(monkeypatch):
    b, s, h, d = 1, 33, 2, 32
    q, k, v = _inputs((b, s, h, d), (b, s, h, d), 9)
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(10))
    scales = _scales(q, k, v)
    kw = dict(qkv_format="bshd", attn_mask_type="no_mask", q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    env0 = _run(q, k, v, dout, **kw)
    assert all(torch.equal(a, b_) for a, b_ in zip(env0, _run(q, k, v, dout, fp8_backward=False, **kw)))
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "1")
    env1 = _run(q, k, v, dout, **kw)
    assert torch.equal(env0[0], env1[0]) and not torch.equal(env0[1], env1[1])


def test_fp8_attention_refuses_by_name():
    q, k, v = _inputs((1, 8, 2, 32), (1, 8, 2, 32))
    kw = dict(q_scale=1.0, k_scale=1.0, v_scale=1.0)
    with pytest.raises(NotImplementedError, match="arbitrary"):
        fp8_attn_func(q, k, v, attn_mask_type="arbitrary", **kw)
    with pytest.raises(NotImplementedError, match="fp8_format"):
        fp8_attn_func(q, k, v, fp8_format="E5M2", **kw)
    with pytest.raises(ValueError, match="`q_scale` must be finite and positive"):
        fp8_attn_func(q, k, v, q_scale=0.0, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="`query_layer` must be a high-precision tensor"):
        fp8_attn_func(q.to(E4M3), k, v, **kw)
    with pytest.raises(NotImplementedError, match="head_dim=320"):
        fp8_attn_func(torch.zeros(1, 8, 2, 320), torch.zeros(1, 8, 2, 320), torch.zeros(1, 8, 2, 320), **kw)


@triton.jit
def _cast_kernel(X, Y, n, DTYPE: tl.constexpr, EXACT_CAST: tl.constexpr):
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, to_fp8(x, DTYPE, EXACT_CAST), mask=offs < n)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rounding_is_round_to_nearest_even_with_saturation(dtype):
    """kernels/fp8.to_fp8 (the kernels' P and dO-side casts) equals torch's cast after clamping, for every FP8
    value, every midpoint between neighbours (ties to even), just off the midpoints, subnormals and overflow;
    with EXACT_CAST (the interpreter's plan) and, on a GPU, with the hardware conversion."""
    fmax = float(torch.finfo(dtype).max)
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.tensor([fmax * 1.1, -1e9, 2e-9])])
    expect = x.clamp(-fmax, fmax).to(dtype).float()
    tl_dtype = tl.float8e4nv if dtype == torch.float8_e4m3fn else tl.float8e5
    for exact in ([True] if INTERPRET else [True, False]):
        xd = x.to(DEVICE)
        y = torch.empty(x.shape, dtype=dtype, device=DEVICE)
        _cast_kernel[(triton.cdiv(x.numel(), 1024),)](xd, y, x.numel(), DTYPE=tl_dtype, EXACT_CAST=exact)
        assert torch.equal(y.float().cpu(), expect), exact
