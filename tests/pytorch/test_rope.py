"""transformer_engine.pytorch.attention.rope: RoPE forward and backward against an fp64 reference in
every format (sbhd, bshd, thd; interleaved or not; partial rotary dim; start_positions), context
parallel ranks (sbhd and thd with cu_seqlens) against the unsplit sequence bitwise, packed against
padded bitwise, fused against unfused and repeated runs bitwise, and the refusals by name.

The fused kernel (common/attention/kernels/rope.py) runs where ``requires_fused`` allows: on the GPU, and
on the CPU with TRITON_INTERPRET=1 set before triton is imported (qa/L0_pytorch_unittest sets it); the
``requires_gpu`` cases are the GPU run's (qa/L1_pytorch_gpu)."""

from __future__ import annotations

import pytest
import torch

from dpa_helpers import DEVICE, requires_fused, requires_gpu
from te_torch_testing import rope_kernel_launches
from transformer_engine.common.attention.kernels import rope as rope_kernels
from transformer_engine.pytorch.attention import rope as rope_module
from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

H, D = 3, 10
SEQLENS = [5, 8, 1, 6]


def _freqs(d2, interleaved, length=64):
    return RotaryPositionEmbedding(d2, interleaved=interleaved, rotary_base=500.0).to("cpu")(length)


def _reference(x, angles, interleaved):
    """fp64: out[c] = x[c] cos(a[c]) + sign(c) x[partner(c)] sin(a[c]) on the first d2 channels."""
    d2 = angles.shape[-1]
    x = x.double()
    out = x.clone()
    for c in range(d2):
        if interleaved:
            partner, sign = (c + 1, -1.0) if c % 2 == 0 else (c - 1, 1.0)
        else:
            partner, sign = (c + d2 // 2, -1.0) if c < d2 // 2 else (c - d2 // 2, 1.0)
        a = angles[..., c].double()
        out[..., c] = x[..., c] * torch.cos(a) + sign * x[..., partner] * torch.sin(a)
    return out


def _positions(tensor_format, b, s, start):
    """[b, s] positions (sbhd/bshd) or [t] (thd)."""
    if tensor_format == "thd":
        return torch.cat([torch.arange(n) + (0 if start is None else int(start[i])) for i, n in enumerate(SEQLENS)])
    pos = torch.arange(s)[None, :].expand(b, s)
    return pos if start is None else pos + start[:, None]


def _case(tensor_format, dtype, start_positions):
    g = torch.Generator().manual_seed(0)
    b, s = len(SEQLENS), max(SEQLENS)
    shape = {"sbhd": (s, b, H, D), "bshd": (b, s, H, D), "thd": (sum(SEQLENS), H, D)}[tensor_format]
    t = torch.randn(shape, generator=g).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    start = torch.tensor([3, 0, 7, 1]) if start_positions else None
    cu = torch.tensor([0] + SEQLENS).cumsum(0).to(torch.int32) if tensor_format == "thd" else None
    return t, grad, start, cu


@pytest.mark.parametrize("start_positions", [False, True])
@pytest.mark.parametrize("d2", [D, 6])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_forward_and_backward_match_fp64_reference(tensor_format, interleaved, d2, start_positions):
    freqs = _freqs(d2, interleaved)
    t, grad, start, cu = _case(tensor_format, torch.float32, start_positions)
    t.requires_grad_(True)
    out = apply_rotary_pos_emb(t, freqs, tensor_format, start_positions=start, interleaved=interleaved,
                               cu_seqlens=cu)
    out.backward(grad)
    pos = _positions(tensor_format, len(SEQLENS), max(SEQLENS), start)
    angles = freqs.reshape(freqs.shape[0], d2).double()[pos]  # [b, s, d2] or [t, d2]
    if tensor_format == "sbhd":
        angles = angles.transpose(0, 1)
    angles = angles.unsqueeze(-2)  # heads
    x64 = t.detach().double().requires_grad_(True)
    ref = _reference(x64, angles, interleaved)
    ref.backward(grad.double())
    assert out.dtype == t.dtype and out.shape == t.shape
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(t.grad.double(), x64.grad, rtol=0, atol=2e-6)
    assert torch.equal(out[..., d2:], t[..., d2:])


def test_bf16_errs_no_more_than_rounding_the_reference():
    freqs = _freqs(D, False)
    t, grad, _, _ = _case("sbhd", torch.bfloat16, False)
    out = apply_rotary_pos_emb(t, freqs)
    angles = freqs[: t.shape[0]].double()
    ref = _reference(t, angles, False)
    # One rounding of the exact result to bf16.
    assert torch.equal(out, ref.to(torch.bfloat16)) or (out.double() - ref).abs().max() <= (
        2 * (ref.to(torch.bfloat16).double() - ref).abs().max())


def _cp_split(x, cp_size, dim):
    """Rank r's part of each sequence along dim: chunks r and 2 cp_size - 1 - r of 2 cp_size."""
    chunks = x.chunk(2 * cp_size, dim=dim)
    return [torch.cat([chunks[r], chunks[2 * cp_size - 1 - r]], dim=dim) for r in range(cp_size)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_thd_cp_ranks_equal_the_unsplit_sequences_bitwise(cp_size, interleaved):
    lengths = [8, 16, 0, 24]  # divisible by 2 * cp_size (padded lengths)
    freqs = _freqs(D, interleaved)
    g = torch.Generator().manual_seed(1)
    full = torch.randn(sum(lengths), H, D, generator=g)
    dy = torch.randn(sum(lengths), H, D, generator=g)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = full.clone().requires_grad_(True)
    out = apply_rotary_pos_emb(x, freqs, "thd", cu_seqlens=cu, interleaved=interleaved, fused=True)
    out.backward(dy)
    seqs = lambda v: [p for p in v.split(lengths) if p.shape[0]]  # noqa: E731
    for rank in range(cp_size):
        local = torch.cat([_cp_split(p, cp_size, 0)[rank] for p in seqs(full)]).requires_grad_(True)
        local_dy = torch.cat([_cp_split(p, cp_size, 0)[rank] for p in seqs(dy)])
        got = apply_rotary_pos_emb(local, freqs, "thd", cu_seqlens=cu, cp_size=cp_size, cp_rank=rank,
                                   interleaved=interleaved, fused=True)
        got.backward(local_dy)
        want = torch.cat([_cp_split(p, cp_size, 0)[rank] for p in seqs(out.detach())])
        want_grad = torch.cat([_cp_split(p, cp_size, 0)[rank] for p in seqs(x.grad)])
        assert torch.equal(got, want) and torch.equal(local.grad, want_grad)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_sbhd_bshd_cp_ranks_equal_the_unsplit_sequence_bitwise(tensor_format):
    cp_size, seq_dim = 2, 0 if tensor_format == "sbhd" else 1
    freqs = _freqs(D, False)
    t, _, _, _ = _case(tensor_format, torch.float32, False)
    t = t.narrow(seq_dim, 0, 8)
    full = apply_rotary_pos_emb(t, freqs, tensor_format)
    for rank in range(cp_size):
        got = apply_rotary_pos_emb(_cp_split(t, cp_size, seq_dim)[rank], freqs, tensor_format, cp_size=cp_size,
                                   cp_rank=rank)
        assert torch.equal(got, _cp_split(full, cp_size, seq_dim)[rank])


def test_packed_equals_padded_fused_equals_unfused_and_repeats_bitwise():
    freqs = _freqs(D, True)
    t, _, start, cu = _case("thd", torch.float32, True)
    packed = apply_rotary_pos_emb(t, freqs, "thd", start_positions=start, cu_seqlens=cu, interleaved=True)
    padded_in = torch.zeros(len(SEQLENS), max(SEQLENS), H, D)
    for i, p in enumerate(t.split(SEQLENS)):
        padded_in[i, : p.shape[0]] = p
    padded = apply_rotary_pos_emb(padded_in, freqs, "bshd", start_positions=start, interleaved=True)
    assert torch.equal(packed, torch.cat([padded[i, :n] for i, n in enumerate(SEQLENS)]))
    fused = apply_rotary_pos_emb(t, freqs, "thd", start_positions=start, cu_seqlens=cu, interleaved=True, fused=True)
    assert torch.equal(packed, fused)
    sbhd = apply_rotary_pos_emb(padded_in.transpose(0, 1), freqs, "sbhd", start_positions=start, interleaved=True)
    assert torch.equal(sbhd.transpose(0, 1), padded)


def test_thd_rows_after_the_last_sequence_pass_through():
    freqs = _freqs(D, False)
    t = torch.randn(10, H, D)
    out = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    assert torch.equal(out[7:], t[7:]) and not torch.equal(out[1:7], t[1:7])


def test_rotary_position_embedding_layouts_and_interpolation():
    rope = RotaryPositionEmbedding(8, rotary_base=100.0)
    emb = rope(5, offset=2)
    inv = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    angles = torch.outer(torch.arange(5, dtype=torch.float32) + 2, inv)
    assert emb.shape == (5, 1, 1, 8) and emb.dtype == torch.float32
    assert torch.equal(emb[:, 0, 0], torch.cat([angles, angles], -1))
    inter = RotaryPositionEmbedding(8, rotary_base=100.0, interleaved=True)(5, offset=2)
    assert torch.equal(inter[:, 0, 0, 0::2], angles) and torch.equal(inter[:, 0, 0, 1::2], angles)
    assert RotaryPositionEmbedding(16, rotary_percent=0.5)(3).shape == (3, 1, 1, 8)
    scaled = RotaryPositionEmbedding(8, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=4)
    assert torch.equal(scaled(4)[:, 0, 0, 0], torch.arange(4.0) / 2)  # fixed scaling
    assert torch.equal(scaled(16)[:, 0, 0, 0], torch.arange(16.0) * (1 / (16 / 4)))  # dynamic scaling


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(tensor_format="bhsd"), "tensor_format"),
        (dict(tensor_format="thd", t=torch.zeros(6, H, D)), "cu_seqlens"),
        (dict(cp_size=0), "cp_size"),
        (dict(cp_size=2, cp_rank=2), "cp_rank"),
        (dict(freqs=torch.zeros(4, 2, 1, 4)), "freqs"),
        (dict(freqs=torch.zeros(4, 1, 1, 4)), "freqs"),  # too few positions
        (dict(freqs=torch.zeros(16, 1, 1, 12)), "freqs"),  # wider than the head
        (dict(freqs=torch.zeros(16, 1, 1, 5)), "freqs"),  # odd rotary dim
        (dict(freqs=torch.zeros(16, 1, 1, 0)), "freqs"),
        (dict(freqs=torch.zeros(16, 1, 1, D, dtype=torch.int64)), "freqs"),
        (dict(freqs=torch.zeros(16, D)), "freqs"),
        (dict(freqs=torch.zeros(16, 1, 1, D, device="meta")), "freqs"),  # not on t's device
        (dict(t=torch.zeros(6, 2, H, D, dtype=torch.float64)), "t"),
        (dict(t=torch.zeros(6, 2, H, D, dtype=torch.int32)), "t"),
        (dict(t=torch.zeros(6, H, D)), "t"),  # 3 dims in sbhd
        (dict(t=torch.zeros(5, 2, H, D), cp_size=2, cp_rank=1), "t"),  # odd length with CP
        (dict(cu_seqlens=torch.tensor([0, 6])), "cu_seqlens"),  # given outside thd
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([0.0, 6.0])), "cu_seqlens"),
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([0])), "cu_seqlens"),
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([[0, 6]])), "cu_seqlens"),
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([1, 6])), "cu_seqlens"),
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([0, 4, 2])), "cu_seqlens"),
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([0, 4, 7])), "cu_seqlens"),
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([0, 6, 12]), cp_size=2),
         "cu_seqlens"),  # lengths not divisible by 2 * cp_size
        (dict(tensor_format="thd", t=torch.zeros(6, H, D), cu_seqlens=torch.tensor([0, 6]),
              freqs=torch.zeros(5, 1, 1, D)), "freqs"),
        (dict(start_positions=torch.tensor([0, 1, 2])), "start_positions"),  # b = 2
        (dict(start_positions=torch.tensor([0.0, 1.0])), "start_positions"),
        (dict(start_positions=torch.tensor([0, -1])), "start_positions"),
        (dict(start_positions=torch.tensor([0, 11])), "freqs"),  # 11 + 5 >= 16 positions
    ],
)
def test_refusals_name_the_argument(kwargs, name, fused):
    args = dict(t=torch.zeros(6, 2, H, D), freqs=torch.zeros(16, 1, 1, D), fused=fused)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"`{name}` must"):
        apply_rotary_pos_emb(**args)


# ---- the fused kernel --------------------------------------------------------------------------------------

FUSED_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def kernel_launches():
    """The fused kernel's launches during the test (True for a backward)."""
    with rope_kernel_launches() as calls:
        yield calls


def _ulp(v, dtype):
    """The spacing of ``dtype``'s values at |v| (subnormal spacing below the smallest normal)."""
    fi = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(fi.smallest_normal)))) * fi.eps


def _assert_rounds_the_reference(got, ref, dtype, scale):
    """fp32: within the unfused tests' 2e-6. fp16/bf16: one rounding of the fp32 result, so at most one ulp of
    the dtype at the reference, plus the fp32 computation's own error (a few fp32 eps of the terms, ``scale``
    bounding their size; it matters only where the two products cancel)."""
    err = (got.double() - ref).abs()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6)
        return
    bound = _ulp(ref, dtype) + 8 * torch.finfo(torch.float32).eps * scale
    assert bool((err <= bound).all()), f"max error {err.max().item()} beyond one {dtype} rounding"


def _fused_case(tensor_format, dtype, start_positions, d2, interleaved):
    freqs = _freqs(d2, interleaved).to(DEVICE)
    t, grad, start, cu = _case(tensor_format, dtype, start_positions)
    move = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return freqs, t.to(DEVICE), grad.to(DEVICE), move(start), move(cu)


def _run(t, grad, freqs, tensor_format, fused, **kwargs):
    x = t.detach().clone().requires_grad_(True)
    out = apply_rotary_pos_emb(x, freqs, tensor_format, fused=fused, **kwargs)
    out.backward(grad)
    return out.detach(), x.grad


@requires_fused
@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("start_positions", [False, True])
@pytest.mark.parametrize("d2", [D, 6])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_fused_kernel_matches_fp64_and_the_unfused_path_bitwise(tensor_format, interleaved, d2, start_positions,
                                                                dtype, kernel_launches):
    """The kernel, forward and backward, in every format and dtype: within one rounding of the fp64 reference,
    and the unfused path's bits (the same fp32 tables, the same two products and sum, no FMA contraction)."""
    freqs, t, grad, start, cu = _fused_case(tensor_format, dtype, start_positions, d2, interleaved)
    kwargs = dict(start_positions=start, interleaved=interleaved, cu_seqlens=cu)
    out, dx = _run(t, grad, freqs, tensor_format, True, **kwargs)
    assert kernel_launches == [False, True]  # forward, then backward
    want_out, want_dx = _run(t, grad, freqs, tensor_format, False, **kwargs)
    assert out.dtype == dtype and dx.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx)
    assert torch.equal(out[..., d2:], t[..., d2:]) and torch.equal(dx[..., d2:], grad[..., d2:])

    pos = _positions(tensor_format, len(SEQLENS), max(SEQLENS), None if start is None else start.cpu())
    angles = freqs.cpu().reshape(freqs.shape[0], d2).double()[pos]
    if tensor_format == "sbhd":
        angles = angles.transpose(0, 1)
    angles = angles.unsqueeze(-2)
    x64 = t.detach().cpu().double().requires_grad_(True)
    ref = _reference(x64, angles, interleaved)
    ref.backward(grad.cpu().double())
    _assert_rounds_the_reference(out.cpu(), ref.detach(), dtype, t.abs().max().item())
    _assert_rounds_the_reference(dx.cpu(), x64.grad, dtype, grad.abs().max().item())


@requires_fused
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_fused_kernel_reads_strided_views_and_repeats_bitwise(tensor_format, interleaved, kernel_launches):
    """Megatron hands over query and key as views of one projection (strided heads and tokens) and a gradient
    that may be strided too: the kernel reads them through their strides, the same bits as contiguous copies,
    and the same bits on a second run."""
    freqs, t, grad, start, cu = _fused_case(tensor_format, torch.float16, True, 6, interleaved)
    wide = torch.cat([t, t.flip(-2)], dim=-1)  # [.., h, 2d]: t is wide[..., :D], not contiguous
    view = wide[..., :D]
    g_wide = torch.cat([grad.flip(-2), grad], dim=-1)
    g_view = g_wide[..., D:]
    assert not view.is_contiguous() and not g_view.is_contiguous()
    kwargs = dict(start_positions=start, interleaved=interleaved, cu_seqlens=cu)
    out, dx = _run(view, g_view, freqs, tensor_format, True, **kwargs)
    again = _run(view, g_view, freqs, tensor_format, True, **kwargs)
    want_out, want_dx = _run(t.contiguous(), grad.contiguous(), freqs, tensor_format, True, **kwargs)
    assert len(kernel_launches) == 6
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx)
    assert torch.equal(out, again[0]) and torch.equal(dx, again[1])


@requires_fused
@pytest.mark.parametrize("cp_size", [2, 4])
def test_fused_sbhd_bshd_cp_ranks_equal_the_unsplit_sequence_bitwise(cp_size, kernel_launches):
    for tensor_format, seq_dim in (("sbhd", 0), ("bshd", 1)):
        freqs = _freqs(D, False).to(DEVICE)
        t, grad, start, _ = _case(tensor_format, torch.float32, True)
        t, grad, start = t.narrow(seq_dim, 0, 8).to(DEVICE), grad.narrow(seq_dim, 0, 8).to(DEVICE), start.to(DEVICE)
        full, full_dx = _run(t, grad, freqs, tensor_format, True, start_positions=start)
        for rank in range(cp_size):
            got, got_dx = _run(_cp_split(t, cp_size, seq_dim)[rank], _cp_split(grad, cp_size, seq_dim)[rank], freqs,
                               tensor_format, True, start_positions=start, cp_size=cp_size, cp_rank=rank)
            assert torch.equal(got, _cp_split(full, cp_size, seq_dim)[rank])
            assert torch.equal(got_dx, _cp_split(full_dx, cp_size, seq_dim)[rank])
    assert len(kernel_launches) == 2 * 2 * (1 + cp_size)


@requires_fused
def test_fused_thd_rows_after_the_last_sequence_and_empty_sequences_pass_through(kernel_launches):
    freqs = _freqs(D, False).to(DEVICE)
    t = torch.randn(12, H, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cu = torch.tensor([0, 3, 3, 7, 7], dtype=torch.int64, device=DEVICE)
    out, dx = _run(t, t, freqs, "thd", True, cu_seqlens=cu)
    want, want_dx = _run(t, t, freqs, "thd", False, cu_seqlens=cu)
    assert kernel_launches == [False, True]
    assert torch.equal(out, want) and torch.equal(dx, want_dx)
    assert torch.equal(out[7:], t[7:]) and torch.equal(dx[7:], t[7:]) and not torch.equal(out[1:7], t[1:7])
    assert torch.equal(out[3], t[3])  # position 0 of the third sequence: the identity rotation


@requires_fused
def test_kernel_writes_nan_for_a_position_outside_freqs():
    """A start position the host did not check (a GPU tensor; here the launcher called directly) must not
    read past the tables: that token's rotated channels are NaN, its other channels and tokens unchanged."""
    cos, sin = rope_module._tables(_freqs(6, False, length=8).to(DEVICE))
    t = torch.randn(4, 2, H, D, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = rope_kernels.rope(t, torch.empty_like(t), cos, sin, "sbhd",
                            start_positions=torch.tensor([0, 6], device=DEVICE))
    assert bool(out[:2, 1, :, :6].isfinite().all()) and bool(out[2:, 1, :, :6].isnan().all())
    assert torch.equal(out[..., 6:], t[..., 6:]) and bool(out[:, 0].isfinite().all())


def test_fused_on_the_cpu_without_the_interpreter_takes_the_torch_path(monkeypatch, kernel_launches):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    freqs = _freqs(D, True)
    t, grad, start, cu = _case("thd", torch.float32, True)
    kwargs = dict(start_positions=start, interleaved=True, cu_seqlens=cu)
    assert [torch.equal(a, b) for a, b in zip(_run(t, grad, freqs, "thd", True, **kwargs),
                                             _run(t, grad, freqs, "thd", False, **kwargs))] == [True, True]
    assert kernel_launches == []


def test_kernel_launch_states_no_fp_contraction(monkeypatch):
    """The kernel's bits equal the unfused path's only without FMA contraction: every launch states
    enable_fp_fusion=False rather than relying on Triton's default (on through Triton 3.9)."""
    seen = []

    class _Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, kwargs))

    monkeypatch.setattr(rope_kernels, "rope_kernel", _Kernel())
    cos, sin = rope_module._tables(_freqs(D, False))
    for fmt, shape, cu in (("sbhd", (4, 2, H, D), None), ("thd", (9, H, D), torch.tensor([0, 4, 9]))):
        t = torch.zeros(shape)
        rope_kernels.rope(t, t, cos, sin, fmt, cu_seqlens=cu)
        rope_kernels.rope(t, t, cos, sin, fmt, cu_seqlens=cu, backward=True)
    assert [grid for grid, _ in seen] == [(8,), (8,), (9,), (9,)]
    assert all(kwargs["enable_fp_fusion"] is False for _, kwargs in seen)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tensor_format", ["sbhd", "thd"])
def test_gpu_fused_kernel_at_megatron_sizes_equals_unfused_bitwise(tensor_format, dtype, kernel_launches):
    """GPU only: head dim 128 with 32 heads (several head blocks per token), interleaved and not, a partial
    rotary dim, CP rank 1 of 2; the kernel's bits are the unfused path's, forward and backward."""
    g = torch.Generator().manual_seed(5)
    lengths = [256, 1024, 64, 0, 704]
    shape = (1024, 4, 32, 128) if tensor_format == "sbhd" else (sum(lengths) // 2, 32, 128)
    t = torch.randn(shape, generator=g).to("cuda", dtype)
    grad = torch.randn(shape, generator=g).to("cuda", dtype)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32) if tensor_format == "thd" else None
    for interleaved, d2 in ((False, 128), (True, 64)):
        freqs = RotaryPositionEmbedding(d2, interleaved=interleaved)(2048)
        kwargs = dict(interleaved=interleaved, cu_seqlens=cu, cp_size=2, cp_rank=1)
        fused = _run(t, grad, freqs, tensor_format, True, **kwargs)
        unfused = _run(t, grad, freqs, tensor_format, False, **kwargs)
        assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    assert kernel_launches == [False, True] * 2


@requires_fused
@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
def test_fused_non_finite_inputs_give_the_unfused_results(dtype):
    """inf and NaN in t: NaN where the unfused path has NaN, the unfused bits
    elsewhere (bf16 under the interpreter rounds by bits, NaN included)."""
    freqs = _freqs(D, False).to(DEVICE)
    t = torch.randn(4, 2, H, D, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    t[1, 0, 0, 2], t[2, 1, 2, 7], t[3, 1, 1, 9] = float("inf"), float("nan"), float("-inf")
    got = apply_rotary_pos_emb(t, freqs, fused=True)
    want = apply_rotary_pos_emb(t, freqs, fused=False)
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) >= 2 and bool(got.isinf().any())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
