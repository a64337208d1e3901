"""The partial fused backward (``grads="dq"`` / ``"dkdv"`` of ``transformer_engine::fused_attn_bwd``).

Context parallelism keeps dQ of one backward call and dK/dV of another, so it asks each call for its
part only. The part runs the whole backward's launches less the other gradient pass (the launch lists
are compared in tests/common/test_launches.py); here the gradients it returns are checked to be
bitwise the whole backward's, on the kernels (the interpreter on CPU), and the unrequested gradients
to be empty tensors, in the real op and in its fake implementation.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fused_helpers import DEVICE, requires_fused
from transformer_engine.common.attention import AttnMaskType, BackwardGrads, QKVFormat
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention import ops  # noqa: F401  (registers the custom ops)
from transformer_engine.pytorch.attention.call import flatten
from transformer_engine.pytorch.attention.call import fused_call

OPS = torch.ops.transformer_engine

# (fmt, mask, (h_q, h_kv), dtype): causal and no mask, MHA and GQA, padded and packed sequences.
CASES = [
    ("bshd", "no_mask", (2, 2), torch.float16),
    ("bshd", "causal", (4, 2), torch.float16),
    ("sbhd", "causal", (2, 1), torch.float32),
    ("thd", "padding", (4, 2), torch.float16),
    ("thd", "padding_causal", (2, 2), torch.float32),
    ("thd", "padding_causal_bottom_right", (4, 1), torch.float16),
]
D = 16
LENGTHS = (23, 40)  # thd: sequences not a multiple of the tiles
S = 40  # padded formats: one length, not a multiple of the tiles


def _inputs(fmt, heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, hk = heads
    if fmt == "thd":
        lead = (sum(LENGTHS),)
    elif fmt == "bshd":
        lead = (2, S)
    else:
        lead = (S, 2)
    q, k, v, d_out = (torch.randn(*lead, n, D, generator=g).to(DEVICE, dtype) for n in (h, hk, hk, h))
    return q, k, v, d_out


def _call(fmt, mask, **kwargs):
    """The AttnCall of a fused call of these tests (the ops take it flattened: call.flatten)."""
    if fmt == "thd":
        cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32, device=DEVICE)
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
    return fused_call(fmt, mask, None, D ** -0.5, **kwargs)


def _backward(fmt, mask, q, k, v, d_out, grads=None, softmax_type="vanilla", softmax_offset=None,
              softmax_offset_grad=False):
    """The op's backward after its forward; ``grads`` None: the default (the whole backward)."""
    flat = flatten(_call(fmt, mask, softmax_type=softmax_type, softmax_offset=softmax_offset))
    out, lse, _ = OPS.fused_attn_fwd(q, k, v, *flat)
    kwargs = {} if grads is None else dict(grads=grads)
    return OPS.fused_attn_bwd(q, k, v, out, d_out, lse, *flat, False, softmax_offset_grad, **kwargs)


@requires_fused
@pytest.mark.parametrize("fmt,mask,heads,dtype", CASES, ids=lambda x: str(x))
def test_partial_backward_gradients_are_the_whole_backwards_bits(fmt, mask, heads, dtype):
    q, k, v, d_out = _inputs(fmt, heads, dtype)
    dq, dk, dv, _, _ = _backward(fmt, mask, q, k, v, d_out)
    dq_only = _backward(fmt, mask, q, k, v, d_out, "dq")
    dkdv_only = _backward(fmt, mask, q, k, v, d_out, "dkdv")
    assert torch.equal(dq_only[0], dq), f"dq: max diff {(dq_only[0].float() - dq.float()).abs().max().item()}"
    assert torch.equal(dkdv_only[1], dk) and torch.equal(dkdv_only[2], dv)
    # The gradients left out: empty tensors (numel 0), of the inputs' dtype.
    assert dq_only[1].numel() == dq_only[2].numel() == 0 and dkdv_only[0].numel() == 0
    assert dq_only[1].dtype == k.dtype and dkdv_only[0].dtype == q.dtype
    # The default is the whole backward.
    whole = _backward(fmt, mask, q, k, v, d_out, BackwardGrads.DQ_DKDV.value)
    assert all(torch.equal(a, b) for a, b in zip(whole[:3], (dq, dk, dv)))


@requires_fused
def test_dq_only_backward_keeps_the_sink_gradient():
    """The learnable sink's gradient runs with either part (it reads only lse and delta)."""
    fmt, mask = "bshd", "causal"
    q, k, v, d_out = _inputs(fmt, (2, 2), torch.float32)
    offset = torch.tensor([0.3, -0.5], dtype=torch.float32, device=DEVICE)
    extra = dict(softmax_type="learnable", softmax_offset=offset, softmax_offset_grad=True)
    whole = _backward(fmt, mask, q, k, v, d_out, **extra)
    for grads, kept in (("dq", (0,)), ("dkdv", (1, 2))):
        part = _backward(fmt, mask, q, k, v, d_out, grads, **extra)
        assert torch.equal(part[4], whole[4]), grads
        assert all(torch.equal(part[i], whole[i]) for i in kept), grads


@requires_fused
def test_partial_backward_keeps_the_bias_gradient():
    fmt, mask = "bshd", "no_mask"
    q, k, v, d_out = _inputs(fmt, (2, 2), torch.float32)
    bias = torch.randn(1, 2, S, S, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    flat = flatten(_call(fmt, mask, bias=bias))
    out, lse, _ = OPS.fused_attn_fwd(q, k, v, *flat)
    whole = OPS.fused_attn_bwd(q, k, v, out, d_out, lse, *flat, True)
    for grads, kept in (("dq", (0,)), ("dkdv", (1, 2))):
        part = OPS.fused_attn_bwd(q, k, v, out, d_out, lse, *flat, True, grads=grads)
        assert torch.equal(part[3], whole[3]), grads
        assert all(torch.equal(part[i], whole[i]) for i in kept), grads


@pytest.mark.parametrize("grads", [g.value for g in BackwardGrads])
def test_fake_implementation_gives_the_real_shapes(grads):
    """Under FakeTensorMode (torch.compile's tracing) the op gives each result the shape the real op gives:
    empty for an unrequested gradient."""
    fmt, mask = "bshd", "causal"
    with FakeTensorMode():
        q, k, v, d_out = (torch.empty(2, S, n, D, dtype=torch.float16) for n in (4, 2, 2, 4))
        out = torch.empty_like(q)
        lse = torch.empty(2, 4, S, dtype=torch.float32)
        dq, dk, dv, dbias, d_offset = OPS.fused_attn_bwd(q, k, v, out, d_out, lse, *flatten(_call(fmt, mask)), False,
                                                         grads=grads)
    which = BackwardGrads(grads)
    assert tuple(dq.shape) == ((2, S, 4, D) if which.has_dq else (0,))
    assert tuple(dk.shape) == tuple(dv.shape) == ((2, S, 2, D) if which.has_dkdv else (0,))
    assert dbias.numel() == d_offset.numel() == 0


def test_unknown_part_is_refused():
    fmt, mask = "bshd", "causal"
    q, k, v, d_out = _inputs(fmt, (2, 2), torch.float32)
    lse = torch.zeros(2, 2, S)
    with pytest.raises(ValueError, match="`grads` must be one of"):
        OPS.fused_attn_bwd(q, k, v, q, d_out, lse, *flatten(_call(fmt, mask)), False, grads="dk")


@requires_fused
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_given_buffers_and_a_shared_delta_change_no_bit(fmt):
    """Context parallelism's per-chunk calls write into views of the rank's buffers and compute rowsum(dO * O)
    once: kernel_runner.forward / backward with ``out``, ``lse``, ``dq``, ``dk``, ``dv`` views and a ``delta``
    filled by another call (``preprocess=False``) give the bits of the calls that allocate and compute."""
    q, k, v, d_out = _inputs(fmt, (4, 2), torch.float16)
    fmt_ = QKVFormat(fmt)
    sd = 1 if fmt == "bshd" else 0
    call = _call(fmt_, AttnMaskType.CAUSAL_MASK)
    out, lse = kernel_runner.forward(q, k, v, call)
    want = kernel_runner.backward(q, k, v, out, d_out, lse, call)[:3]

    # Views into larger buffers: the tokens in the second half of a buffer twice as long.
    big = lambda t: t.new_full(tuple(t.shape[:sd]) + (2 * S,) + tuple(t.shape[sd + 1:]), float("nan"))  # noqa: E731
    out_big, dq_big, dk_big, dv_big = big(out), big(q), big(k), big(v)
    lse_big = lse.new_full((lse.shape[0], lse.shape[1], 2 * S), float("nan"))
    view = lambda t: t.narrow(sd, S, S)  # noqa: E731
    got_out, got_lse = kernel_runner.forward(q, k, v, call, out=view(out_big), lse=lse_big.narrow(2, S, S))
    assert torch.equal(got_out, out) and torch.equal(got_lse, lse)
    assert got_out.data_ptr() == view(out_big).data_ptr()

    delta = torch.empty_like(lse)
    kernel_runner.backward(q, k, v, out, d_out, lse, call, grads=BackwardGrads.DKDV, delta=delta)  # fills delta
    got = kernel_runner.backward(q, k, v, out, d_out, lse, call, dq=view(dq_big), dk=view(dk_big), dv=view(dv_big),
                                 delta=delta, preprocess=False)[:3]
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    assert torch.equal(view(dq_big), want[0])

    with pytest.raises(ValueError, match="`delta` must be given with preprocess=False"):
        kernel_runner.backward(q, k, v, out, d_out, lse, call, preprocess=False)
    with pytest.raises(ValueError, match="`delta` must be float32 with lse's shape"):
        kernel_runner.backward(q, k, v, out, d_out, lse, call, delta=lse_big)
    with pytest.raises(ValueError, match="`dq` must be a torch.float16 tensor of shape"):
        kernel_runner.backward(q, k, v, out, d_out, lse, call, dq=dq_big)
    with pytest.raises(ValueError, match="`out` must be a torch.float16 tensor of shape"):
        kernel_runner.forward(q, k, v, call, out=out_big)
