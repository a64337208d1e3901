"""What the fused path writes besides its kernels' outputs: nothing.

``torch.use_deterministic_algorithms(True)`` makes every ``torch.empty`` fill its memory (NaN), a memset per
buffer that the kernels then overwrite in full; the fused path allocates the buffers its kernels write
whole without that fill (``buffers.unfilled``), and autograd does not zero-fill a gradient for the
non-differentiable log-sum-exp. The host reads of ``cu_seqlens`` (its checks) copy them without the fill
that ``tolist`` of a device tensor gets. Packed (thd) outputs keep their zeros: the kernels leave the rows
between sequences unwritten. Checked with the profiler's record of ``aten::fill_`` and ``aten::zero_`` (the fills
run below the Python dispatcher), and the results bitwise against the same call without torch's flag.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dpa_helpers import deterministic_algorithms
from fused_helpers import DEVICE, ON_GPU, cu_from_lengths, make_qkv, requires_fused

from transformer_engine.pytorch.attention import buffers
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

pytestmark = requires_fused

DTYPE = torch.bfloat16 if ON_GPU else torch.float16
S, H, D = (256, 4, 64) if ON_GPU else (24, 2, 16)


def _filled_shapes(prof) -> list:
    """Shapes of the tensors that ``aten::fill_`` or ``aten::zero_`` wrote (0-element fills write nothing; a
    0-dim tensor has one element)."""
    shapes = []
    for event in prof.events():
        if event.name in ("aten::fill_", "aten::zero_") and event.input_shapes:
            shape = tuple(event.input_shapes[0])
            if all(n > 0 for n in shape):
                shapes.append(shape)
    return shapes


def _step(case: str):
    """One fwd+bwd of the case: (outputs and gradients, the fill_ shapes during it)."""
    q, k, v, leaves = make_qkv(2, S, S, H, H, D, D, DTYPE)
    kwargs = {}
    mask = "causal"
    if case == "padding":
        mask = "padding_causal"
        kwargs = dict(cu_seqlens_q=cu_from_lengths([S, S - 5]), cu_seqlens_kv=cu_from_lengths([S, S - 5]))
    elif case == "bias_sink":
        g = torch.Generator(device="cpu").manual_seed(3)
        kwargs = dict(core_attention_bias=torch.randn(1, H, S, S, generator=g).to(DEVICE, DTYPE).requires_grad_(),
                      softmax_type="learnable",
                      softmax_offset=torch.randn(H, generator=g).to(DEVICE, torch.float32).requires_grad_())
        leaves = leaves + [kwargs["core_attention_bias"], kwargs["softmax_offset"]]
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = fused_attn_func(q, k, v, "bshd", mask, (-1, 0), D ** -0.5, deterministic=True, **kwargs)
        grads = torch.autograd.grad(out, leaves, d_out)
    return [out.detach()] + list(grads), _filled_shapes(prof)


@pytest.mark.parametrize("case", ["causal", "padding", "bias_sink"])
def test_torch_deterministic_mode_fills_nothing_and_gives_the_same_bits(case):
    plain, _ = _step(case)
    with deterministic_algorithms(True):
        assert torch.utils.deterministic.fill_uninitialized_memory
        flagged, fills = _step(case)
    assert fills == [], f"memsets besides the kernels' writes: {fills}"
    for a, b in zip(plain, flagged):
        assert torch.equal(a, b)


def test_no_gradient_is_zero_filled_for_the_log_sum_exp():
    _, fills = _step("causal")
    assert (2, H, S) not in fills, fills


def test_packed_outputs_keep_their_zeros_between_sequences():
    lengths, gap = [S // 2, S // 3], 3
    starts = [0, lengths[0] + gap]
    total = starts[-1] + lengths[-1] + gap
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(total, H, D, generator=g).to(DEVICE, DTYPE).requires_grad_() for _ in range(3))
    cu = cu_from_lengths(lengths)
    padded = torch.tensor(starts + [total], dtype=torch.int32, device=DEVICE)
    with deterministic_algorithms(True):
        out = fused_attn_func(q, k, v, "thd", "padding_causal", (-1, 0), D ** -0.5, cu_seqlens_q=cu,
                              cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                              max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths), deterministic=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    outside = torch.ones(total, dtype=torch.bool)
    for start, n in zip(starts, lengths):
        outside[start:start + n] = False
    for t in (out, dq, dk, dv):
        assert torch.equal(t[outside.to(t.device)], torch.zeros_like(t[outside.to(t.device)]))


@pytest.mark.parametrize("shape", [(3, 5, 2), (0, 4), (7,), (2, 0, 3), ()])
@pytest.mark.parametrize("flag", [False, True])
def test_unfilled_is_torch_empty_without_the_fill(shape, flag):
    with deterministic_algorithms(flag):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t = buffers.unfilled(shape, torch.float32, DEVICE)
        ref = torch.empty(shape, dtype=torch.float32, device=DEVICE)
    assert (t.shape, t.stride(), t.dtype, t.device) == (ref.shape, ref.stride(), ref.dtype, ref.device)
    assert t.is_contiguous() and t.untyped_storage().nbytes() >= t.numel() * 4
    assert _filled_shapes(prof) == []


@pytest.mark.parametrize("flag", [False, True])
def test_unfilled_with_strides_reaches_every_element_of_the_view(flag):
    """A delta buffer takes the strides of an lse view (a narrow of a wider buffer, or a permutation)."""
    for shape, strides in (((2, 3, 5), (24, 8, 1)), ((2, 3, 5), (1, 2, 6)), ((2, 0, 5), (5, 5, 1))):
        with deterministic_algorithms(flag):
            t = buffers.unfilled(shape, torch.float32, DEVICE, strides)
        assert (tuple(t.shape), t.stride()) == (shape, strides)
        t.fill_(1.0)  # writes through every element: within the storage
        ref = torch.empty_strided(shape, strides, dtype=torch.float32, device=DEVICE)
        assert t.untyped_storage().nbytes() >= ref.untyped_storage().nbytes()


@pytest.mark.parametrize("flag", [False, True])
def test_host_values_read_a_device_tensor_without_a_fill(flag):
    """``tolist`` of a device tensor copies it into a new host tensor, which torch's flag fills first."""
    t = cu_from_lengths([5, 0, 9])
    with deterministic_algorithms(flag):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            values = buffers.host_values(t)
            values_of_a_slice = buffers.host_values(t[1:] - t[:-1])
    assert values == [0, 5, 5, 14] and values_of_a_slice == [5, 0, 9]
    assert all(isinstance(x, int) for x in values)
    assert _filled_shapes(prof) == []
