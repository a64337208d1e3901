"""Batch, padding and packing invariance of the unfused attention path (PyTorch math, CPU).

The README's promise: the same sequence gives the same outputs and gradients, bit for bit, alone,
inside a batch padded to any length, or packed (THD) next to other sequences, and run after run.
The unfused path keeps it through a fixed reduction structure over keys and queries
(``transformer_engine/common/attention/reduction.py``). Each test runs one target sequence alone,
padded next to longer sequences at several padded lengths (across block and tree-level
boundaries), and packed, and compares the target's output and q/k/v gradients with
``torch.equal``. Accuracy is checked against an fp64 reference written here from the definition.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from reduction_reference import tree_sum_order
from transformer_engine.common.attention.reduction import KEY_BLOCK, QUERY_BLOCK
from transformer_engine.pytorch.attention.unfused import _tree_sum, unfused_attention

SCALE = 0.25
D = 16
L = 70  # the target sequence: more than two key/query blocks, not a multiple of either
OTHERS = (150, 3, 97)  # its neighbours: longer (more blocks, deeper trees) and shorter
PADS = (L + 1, L + 29, 2 * L + 3, 150, 4 * KEY_BLOCK + 9)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (name, mask alone, mask in a padded/packed batch, window)
MASKS = (
    ("no_mask", "no_mask", "padding", None),
    ("causal", "causal", "padding_causal", None),
    ("sliding_window", "causal", "padding_causal", (17, 0)),
    ("two_sided_window", "no_mask", "padding", (9, 5)),
)


def _seq(n, seed, hq, hk, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: (torch.randn(n, h, D, generator=g) * scale).to(dtype)  # noqa: E731
    return mk(hq), mk(hk), mk(hk), mk(hq)  # q, k, v, dO


def _batch(hq, hk, dtype, scale=1.0):
    target = _seq(L, 1, hq, hk, dtype, scale)
    others = [_seq(n, 10 + i, hq, hk, dtype, scale) for i, n in enumerate(OTHERS)]
    return target, others


def _cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def _grads(out, do, tensors):
    out.backward(do)
    return [t.grad for t in tensors]


def run_alone(seq, mask, window, **kw):
    q, k, v, do = (t.unsqueeze(0).clone() for t in seq)
    for t in (q, k, v):
        t.requires_grad_()
    out = unfused_attention(q, k, v, "bshd", mask, window, SCALE, **kw)
    grads = _grads(out, do, (q, k, v))
    return [out.detach()[0]] + [g_[0] for g_ in grads]


def run_padded(seqs, pad, mask, window, first_only=True, **kw):
    """bshd padded to ``pad`` with a padding mask; the first sequence's rows of out, dq, dk, dv."""
    b, lens = len(seqs), [s[0].shape[0] for s in seqs]
    hq, hk, dtype = seqs[0][0].shape[1], seqs[0][1].shape[1], seqs[0][0].dtype
    q = torch.full((b, pad, hq, D), float("nan"), dtype=dtype)  # padding is garbage: it must not leak
    k = torch.full((b, pad, hk, D), float("nan"), dtype=dtype)
    v = torch.full((b, pad, hk, D), float("nan"), dtype=dtype)
    do = torch.full((b, pad, hq, D), float("nan"), dtype=dtype)
    for i, (qi, ki, vi, doi) in enumerate(seqs):
        q[i, :lens[i]], k[i, :lens[i]], v[i, :lens[i]], do[i, :lens[i]] = qi, ki, vi, doi
    for t in (q, k, v):
        t.requires_grad_()
    cu = _cu(lens)
    out = unfused_attention(q, k, v, "bshd", mask, window, SCALE, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=pad, max_seqlen_kv=pad, **kw)
    grads = _grads(out, do, (q, k, v))
    n = lens[0]
    return [out.detach()[0, :n]] + [g_[0, :n] for g_ in grads]


def run_packed(seqs, mask, window, gap=0, **kw):
    """thd, the sequences packed in order (``gap`` unused tokens after each); the first one's rows."""
    lens = [s[0].shape[0] for s in seqs]
    cat = lambda i: torch.cat(  # noqa: E731
        [torch.cat([s[i], s[i].new_zeros((gap,) + tuple(s[i].shape[1:]))]) for s in seqs])
    q, k, v, do = (cat(i) for i in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    cu = _cu(lens)
    padded = _cu([n + gap for n in lens]) if gap else None
    out = unfused_attention(q, k, v, "thd", mask, window, SCALE, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                            max_seqlen_q=max(lens), max_seqlen_kv=max(lens), **kw)
    grads = _grads(out, do, (q, k, v))
    n = lens[0]
    return [out.detach()[:n]] + [g_[:n] for g_ in grads]


def assert_same(a, b, what):
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert torch.isfinite(x).all(), f"{what}: {name} not finite"
        if not torch.equal(x, y):
            rows = (x != y).reshape(x.shape[0], -1).any(-1).sum().item()
            raise AssertionError(f"{what}: {name} differs bitwise in {rows} of {x.shape[0]} rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name,mask_alone,mask_batch,window", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_alone_padded_packed_bitwise(dtype, name, mask_alone, mask_batch, window, heads):
    target, others = _batch(*heads, dtype)
    ref = run_alone(target, mask_alone, window)
    assert_same(ref, run_alone(target, mask_alone, window), "repeated run")
    # alone with a padding mask, at its own length
    assert_same(ref, run_padded([target], L, mask_batch, window), "alone, padding mask")
    for pad in PADS:
        assert_same(ref, run_padded([target], pad, mask_batch, window), f"alone padded to {pad}")
    for pad in (150, 3 * KEY_BLOCK + 5):
        assert_same(ref, run_padded([target] + others, pad, mask_batch, window), f"batch padded to {pad}")
    assert_same(ref, run_packed([target] + others, mask_batch, window), "packed")
    assert_same(ref, run_packed([target] + others, mask_batch, window, gap=5), "packed with gaps")
    # not first in the batch: the target packed after the others
    assert_same(ref, _last(others + [target], mask_batch, window), "last in a packed batch")


def _last(seqs, mask, window):
    """The last sequence's rows of a thd run (out, dq, dk, dv)."""
    lens = [s[0].shape[0] for s in seqs]
    q, k, v, do = (torch.cat([s[i] for s in seqs]) for i in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    cu = _cu(lens)
    out = unfused_attention(q, k, v, "thd", mask, window, SCALE, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    grads = _grads(out, do, (q, k, v))
    start = sum(lens[:-1])
    return [out.detach()[start:]] + [g_[start:] for g_ in grads]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mask_alone,mask_batch", [("no_mask", "padding"), ("causal", "padding_causal")])
def test_alibi_bitwise(dtype, mask_alone, mask_batch):
    target, others = _batch(4, 2, dtype)
    kw = dict(core_attention_bias_type="alibi")
    ref = run_alone(target, mask_alone, None, **kw)
    for pad in PADS:
        assert_same(ref, run_padded([target], pad, mask_batch, None, **kw), f"alone padded to {pad}")
    assert_same(ref, run_padded([target] + others, 150, mask_batch, None, **kw), "batch padded")
    assert_same(ref, run_packed([target] + others, mask_batch, None, **kw), "packed")


@pytest.mark.parametrize("mask_alone,mask_batch", [("no_mask", "padding"), ("causal", "padding_causal")])
def test_post_scale_bias_bitwise(mask_alone, mask_batch):
    """A [b, h, s, s] bias: the target's block in the top-left of each padded bias; bias gradients too."""
    target, others = _batch(2, 2, torch.float32)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 2, L, L, generator=g)

    def run(seqs, pad):
        b = len(seqs)
        full = torch.randn(b, 2, pad, pad, generator=g)
        full[0, :, :L, :L] = bias[0]
        full.requires_grad_()
        kw = dict(core_attention_bias_type="post_scale_bias", core_attention_bias=full)
        res = run_padded(seqs, pad, mask_batch, None, **kw)
        return res + [full.grad[0, :, :L, :L]]

    alone_bias = bias.clone().requires_grad_()
    ref = run_alone(target, mask_alone, None, core_attention_bias_type="post_scale_bias",
                    core_attention_bias=alone_bias) + [alone_bias.grad[0]]
    for seqs, pad in (([target], L + 29), ([target], 150), ([target] + others, 150)):
        got = run(seqs, pad)
        assert_same(ref[:4], got[:4], f"padded to {pad}")
        assert torch.equal(ref[4], got[4]), f"bias gradient, padded to {pad}"


def test_sink_softmax_bitwise():
    target, others = _batch(4, 2, torch.float32)
    kw = dict(softmax_type="off-by-one")
    ref = run_alone(target, "causal", None, **kw)
    for pad in PADS:
        assert_same(ref, run_padded([target] + others[:1], max(pad, OTHERS[0]), "padding_causal", None, **kw),
                    f"padded to {pad}")
    assert_same(ref, run_packed([target] + others, "padding_causal", None, **kw), "packed")


def test_sbhd_matches_bshd_bitwise():
    target, _ = _batch(4, 2, torch.float32)
    ref = run_alone(target, "causal", None)
    q, k, v, do = (t.unsqueeze(1).clone() for t in target)
    for t in (q, k, v):
        t.requires_grad_()
    out = unfused_attention(q, k, v, "sbhd", "causal", None, SCALE)
    grads = _grads(out, do, (q, k, v))
    assert_same(ref, [out.detach()[:, 0]] + [g_[:, 0] for g_ in grads], "sbhd")


def test_repeated_runs_bitwise():
    target, others = _batch(4, 2, torch.float32)
    first = run_packed([target] + others, "padding_causal", (17, 0))
    for _ in range(3):
        assert_same(first, run_packed([target] + others, "padding_causal", (17, 0)), "repeat")


def _reference(seq, causal, window, dtype=torch.float64):
    """Definition in ``dtype`` (plain softmax and einsum over the whole sequence)."""
    q, k, v = (t.to(dtype) for t in seq[:3])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    i = torch.arange(L).view(-1, 1)
    j = torch.arange(L).view(1, -1)
    keep = torch.ones(L, L, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= j >= i - window[0]
        if window[1] >= 0:
            keep &= j <= i + window[1]
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (17, 0))])
def test_accuracy_against_fp64(causal, window):
    """fp32 error against fp64 no worse than plain fp32 math (one matmul, torch.softmax) on the same inputs,
    for the output and for the gradients (fp64 autograd of the definition)."""
    target, _ = _batch(4, 2, torch.float32, scale=2.0)
    mask = "causal" if causal else "no_mask"
    got = run_alone(target, mask, window)

    def ref_run(dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in target[:3])
        out = _reference((q, k, v), causal, window, dtype)
        out.backward(target[3].to(dtype))
        return [out.detach(), q.grad, k.grad, v.grad]

    exact = ref_run(torch.float64)
    plain = ref_run(torch.float32)
    for name, x, p32, e in zip(("out", "dq", "dk", "dv"), got, plain, exact):
        err = (x.double() - e).abs().max().item()
        err_plain = (p32.double() - e).abs().max().item()
        assert err <= 2.0 * err_plain + 1e-7, f"{name}: error {err:.3e}, plain fp32 math {err_plain:.3e}"


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=lambda d: str(d).split(".")[-1])
def test_low_precision_accuracy(dtype):
    """fp16/bf16 inputs: the output's error against fp64 is the rounding of the result to ``dtype``."""
    target, _ = _batch(4, 2, dtype)
    out = run_alone(target, "causal", None)[0]
    exact = _reference(target, True, None)
    err = (out.double() - exact).abs().max().item()
    rounding = (exact.to(dtype).double() - exact).abs().max().item()
    assert err <= 2.0 * rounding, f"error {err:.3e}, rounding of the exact result to {dtype} {rounding:.3e}"


def test_tree_sum_matches_the_common_description():
    """``_tree_sum`` follows ``tree_sum_order`` (fp64 = Python floats) and ignores trailing zeros."""
    g = torch.Generator().manual_seed(7)
    for n in (1, 2, 3, 7, 64, 100, 129):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (n,), generator=g)
        expect = tree_sum_order(x.tolist())
        assert _tree_sum(x, 0).item() == expect
        for extra in (1, 5, 64, 200):
            assert _tree_sum(torch.cat([x, x.new_zeros(extra)]), 0).item() == expect
    assert _tree_sum(torch.zeros(3, 0), -1).shape == (3,)
    assert KEY_BLOCK > 0 and QUERY_BLOCK > 0 and math.log2(KEY_BLOCK).is_integer()
