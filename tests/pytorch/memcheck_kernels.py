"""Every planned kernel variant once, at small shapes, for a memory checker (compute-sanitizer).

Forward and backward through fused_attn_func for each head-dim bucket (and through the launch layer on
the segment-row grid of packed rows), at s_q = 1, s_q below one tile and s_q != s_kv, with bias, ALiBi,
dropout, sliding windows, padding and thd packing (with gaps and empty sequences), GQA, in bf16 (fp16 at
the smallest and largest head dims). Each result is checked finite; under ``compute-sanitizer --tool
memcheck --error-exitcode 1`` any out-of-bounds or misaligned access fails the run.

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/pytorch/memcheck_kernels.py [192/128 ...]

Head dims given as ``d_qk/d_v`` arguments restrict the run to them (every shape in bf16, GQA and MHA): a
quicker check of one bucket's kernels after a change there.
"""

from __future__ import annotations

import itertools
import sys

import torch

from transformer_engine.pytorch.attention.fused_attn import fused_attn_func, new_rng_state

HEAD_DIMS = [(64, 64), (72, 72), (128, 128), (192, 128), (256, 256)]
# (s_q, s_kv, mask, window, extra): extra names a score modifier or layout
SHAPES = [
    (1, 67, "no_mask", (-1, -1), None),
    (5, 67, "causal_bottom_right", (-1, -1), None),
    (130, 130, "causal", (-1, -1), None),
    (67, 200, "no_mask", (17, 5), None),
    (130, 97, "causal", (-1, -1), "bias"),
    (97, 97, "no_mask", (-1, -1), "alibi"),
    (97, 130, "no_mask", (-1, -1), "dropout"),
    (97, 97, "padding_causal", (-1, -1), "padding"),
    (97, 130, "padding_causal_bottom_right", (-1, -1), "thd"),
    (131, 131, "padding_causal", (-1, -1), "thd_gaps"),
]


def run(dims, shape, dtype, heads=(4, 2)):
    (dqk, dv), (sq, skv, mask, window, extra) = dims, shape
    h, hk = heads
    b = 2
    g = torch.Generator(device="cpu").manual_seed(0)
    kw = {}
    if extra == "thd":
        lens_q, lens_kv = [sq, max(sq // 3, 1)], [skv, max(skv // 2, 1)]
        cu_q = torch.tensor([0, lens_q[0], sum(lens_q)], dtype=torch.int32, device="cuda")
        cu_kv = torch.tensor([0, lens_kv[0], sum(lens_kv)], dtype=torch.int32, device="cuda")
        shapes = [(sum(lens_q), h, dqk), (sum(lens_kv), hk, dqk), (sum(lens_kv), hk, dv)]
        fmt = "thd"
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv))
    elif extra == "thd_gaps":  # an empty and a one-token sequence, three unused rows after each sequence
        lens, starts = [sq, 1, 0, 17], [0]
        for n in lens:
            starts.append(starts[-1] + n + 3)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
        cu_padded = torch.tensor(starts, dtype=torch.int32, device="cuda")
        shapes = [(starts[-1], h, dqk), (starts[-1], hk, dqk), (starts[-1], hk, dv)]
        fmt = "thd"
        kw.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                  max_seqlen_q=sq, max_seqlen_kv=sq)
    else:
        shapes = [(b, sq, h, dqk), (b, skv, hk, dqk), (b, skv, hk, dv)]
        fmt = "bshd"
    q, k, v = (torch.randn(s, generator=g).to("cuda", dtype).requires_grad_() for s in shapes)
    if extra == "padding":
        kw.update(cu_seqlens_q=torch.tensor([0, sq - 3, 2 * sq - 10], dtype=torch.int32, device="cuda"),
                  cu_seqlens_kv=torch.tensor([0, skv - 3, 2 * skv - 10], dtype=torch.int32, device="cuda"))
    if extra == "bias":
        kw["core_attention_bias"] = torch.randn(1, h, sq, skv, generator=g).to("cuda", dtype).requires_grad_()
    if extra == "alibi":
        kw["alibi_slopes"] = torch.rand(h, generator=g).to("cuda", torch.float32)
    if extra == "dropout":
        kw.update(dropout_p=0.1, rng_state=new_rng_state(torch.device("cuda")))
    out = fused_attn_func(q, k, v, fmt, mask, window, dqk ** -0.5, deterministic=True, **kw)
    leaves = [q, k, v] + ([kw["core_attention_bias"]] if extra == "bias" else [])
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    torch.cuda.synchronize()
    for t in (out,) + grads:
        if not torch.isfinite(t).all():
            raise AssertionError(f"non-finite result at {dims} {shape} {dtype}")


def run_segment_rows(dims, heads=(4, 2)):
    """Packed sequences three to a row (JAX's max_segments_per_seq layout) on the segment-row grid, through the
    launch layer (the PyTorch frontend itself never asks for that grid): an empty and a one-token sequence,
    a gap, causal."""
    from transformer_engine.common.attention import AttnMaskType, QKVFormat
    from transformer_engine.pytorch.attention import kernel_runner
    from transformer_engine.pytorch.attention.call import fused_call

    (dqk, dv), (h, hk) = dims, heads
    rows, s, lengths = 2, 160, [[70, 0, 81], [1, 130, 29]]
    starts, lens = [], []
    for r, row in enumerate(lengths):
        pos = r * s
        for n in row:
            starts.append(pos)
            lens.append(n)
            pos += n
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    seqs = kernel_runner.Sequences(len(lens), s, s, as_tensor(lens), as_tensor(lens), as_tensor(starts),
                                   as_tensor(starts), segments_per_row=3)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(rows * s, hh, dd, generator=g).to("cuda", torch.bfloat16)
                   for hh, dd in ((h, dqk), (hk, dqk), (hk, dv), (h, dv)))
    mask = AttnMaskType.PADDING_CAUSAL_MASK
    call = fused_call(QKVFormat.THD, mask, (-1, 0), dqk ** -0.5)
    out, lse = kernel_runner.forward(q, k, v, call, seqs=seqs)
    grads = kernel_runner.backward(q, k, v, out, do, lse, call, seqs=seqs)[:3]
    torch.cuda.synchronize()
    for t in (out,) + tuple(grads):
        if not torch.isfinite(t).all():
            raise AssertionError(f"non-finite result on the segment-row grid at {dims}")


def _parse_dims(arg: str):
    dqk, _, dv = arg.partition("/")
    if not (dqk.isdigit() and dv.isdigit()):
        raise SystemExit(f"head dims must be given as d_qk/d_v (e.g. 192/128), got {arg!r}")
    return int(dqk), int(dv)


def main(argv) -> int:
    count = 0
    if argv:  # only these head dims: every shape with GQA, the causal one without
        for dims in (_parse_dims(a) for a in argv):
            for shape in SHAPES:
                run(dims, shape, torch.bfloat16)
                count += 1
            run(dims, SHAPES[2], torch.bfloat16, (4, 4))
            run_segment_rows(dims)
            count += 2
        print(f"memcheck_kernels: {count} configurations ran", flush=True)
        return 0
    # bf16 everywhere; fp16 (other dot precision and store types) at the smallest and largest bucket.
    runs = [(dims, shape, torch.bfloat16) for dims, shape in itertools.product(HEAD_DIMS, SHAPES)]
    runs += [(dims, shape, torch.float16) for dims in (HEAD_DIMS[0], HEAD_DIMS[-1]) for shape in SHAPES[:3]]
    for dims, shape, dtype in runs:
        run(dims, shape, dtype)
        count += 1
    for heads in ((4, 4), (4, 1)):
        run((128, 128), SHAPES[2], torch.bfloat16, heads)
        count += 1
    for dims in ((64, 64), (128, 128)):  # the Triton and (on Hopper) the Gluon kernels' segment-row grid
        run_segment_rows(dims)
        count += 1
    print(f"memcheck_kernels: {count} configurations ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
