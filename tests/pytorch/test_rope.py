"""transformer_engine.pytorch.attention.rope: RoPE forward and backward against an fp64 reference in
every format (sbhd, bshd, thd; interleaved or not; partial rotary dim; start_positions), context
parallel ranks (sbhd and thd with cu_seqlens) against the unsplit sequence bitwise, packed against
padded bitwise, fused against unfused and repeated runs bitwise, and the refusals by name."""

from __future__ import annotations

import pytest
import torch

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
    ],
)
def test_refusals_name_the_argument(kwargs, name):
    args = dict(t=torch.zeros(6, 2, H, D), freqs=torch.zeros(16, 1, 1, D))
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"`{name}`"):
        apply_rotary_pos_emb(**args)
