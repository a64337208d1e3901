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

from transformer_engine.common.attention.fp8 import P_SCALE, fp8_plan  # noqa: E402
from transformer_engine.common.quantization import FP8_MAX, scale_from_current_amax  # noqa: E402
from transformer_engine.pytorch.attention.fp8_attention import AMAX_SLOTS, fp8_attn_func, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

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
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = fp8_attn_func(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


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
    amax = torch.zeros(len(AMAX_SLOTS))
    out, dq, dk, dv = _run(q, k, v, dout, qkv_format=fmt, attn_mask_type=mask, window_size=window, q_scale=scales[0],
                           k_scale=scales[1], v_scale=scales[2], amax=amax)
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
