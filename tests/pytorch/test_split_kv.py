"""Split-KV and the forward's canonical sum over key chunks (kernels/forward.py, ForwardPlan.kv_chunk).

A row's keys are summed in fixed chunks of ``kv_chunk`` keys, each from scratch, folded in order. The training
forward folds inside one program; a split-KV forward (a decode step, a short chunk, a small batch) runs one
program per chunk and a combine kernel. Both must give the same bits for every output (out, lse, row max), for
every mask, window, GQA, packing and score modifier; rows whose keys lie in one chunk keep the bits of a
one-chunk sum; and the result stays as accurate as before against fp64. The interpreter's chunk is 64 keys,
the GPU's 4096 (where the Triton forward serves: fp32 here, and any config without a Gluon forward).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
from case_grid import grid
import torch

from dpa_helpers import DEVICE, ON_GPU, assert_close_to_reference, reference, requires_fused
from transformer_engine.common.attention import launch_description
from transformer_engine.common.attention.plan import forward_plan
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.call import fused_call
from te_torch_testing import recorded_launches

DTYPES = [torch.float16, torch.float32] if not ON_GPU else [torch.bfloat16, torch.float32]


def _chunk(q, k, v, call) -> int:
    return forward_plan(kernel_runner.plan_key(q, k, v, call)).kv_chunk


def _tensors(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, heads, d, generator=g).to(DEVICE, dtype) for s, heads in ((sq, h), (sk, hk), (sk, hk))]


CASES = {
    # name: (sq, keys in chunks, h, hk, mask, window, extra fused_call arguments)
    "decode_causal": (1, 3.4, 4, 2, "causal_bottom_right", None, {}),
    "chunk_causal": (7, 2.6, 4, 4, "causal_bottom_right", None, {}),
    "cross_no_mask": (5, 2.2, 2, 1, "no_mask", None, {}),
    "self_causal": (2.5, 2.5, 2, 2, "causal", None, {}),
    "window": (3, 3.1, 2, 2, "causal_bottom_right", (70, 0), {}),
    "window_both": (40, 3.0, 2, 1, "no_mask", (50, 30), {}),
    "alibi": (4, 2.3, 2, 2, "causal_bottom_right", None, {"alibi": True}),
    "sink": (4, 2.3, 2, 2, "causal_bottom_right", None, {"softmax_type": "learnable"}),
}


def _call(name, q, k, h):
    sq, _, _, _, mask, window, extra = CASES[name]
    kwargs = {}
    if extra.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(h, device=DEVICE, dtype=torch.float32)
    if "softmax_type" in extra:
        kwargs.update(softmax_type=extra["softmax_type"],
                      softmax_offset=torch.randn(h, device=DEVICE, dtype=torch.float32))
    return fused_call("bshd", mask, window, 0.3, **kwargs)


def _shapes(name, chunk):
    sq, kchunks, h, hk = CASES[name][:4]
    sk = int(kchunks * chunk)
    sq = int(sq * chunk) if isinstance(sq, float) else sq
    return sq, sk, h, hk


@requires_fused
@pytest.mark.parametrize("name,dtype", grid("name,dtype", list(CASES), {str(t).split(".")[-1]: t for t in DTYPES}))
def test_split_kv_equals_the_one_program_sum(name, dtype):
    """Split-KV (one program per chunk + combine) == the chunked forward in one program, bitwise: out, lse and
    the row max. Both sum several chunks (the keys span more than one)."""
    probe = _tensors(1, 1, 1, 2, 2, 16, dtype)
    chunk = _chunk(*probe, fused_call("bshd", "causal_bottom_right", None, 0.3))
    assert chunk > 0
    sq, sk, h, hk = _shapes(name, chunk)
    q, k, v = _tensors(2, sq, sk, h, hk, 32, dtype, seed=1)
    call = _call(name, q, k, h)
    call = dataclasses.replace(call, params=dataclasses.replace(call.params, return_max_logit=True))
    with recorded_launches() as launches:
        split = kernel_runner.forward(q, k, v, call, split_kv=True)
        whole = kernel_runner.forward(q, k, v, call, split_kv=False)
    assert [len(x) for x in launches] == [2, 1]  # the split forward and its combine; one launch
    assert launches[0][0].grid[2] == -(-sk // chunk)  # one program per chunk
    for what, a, b in zip(("out", "lse", "row_max"), split, whole):
        assert torch.equal(a, b), f"{what}: split-KV differs from the one-program sum"


@requires_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_in_one_chunk_keep_the_one_chunk_bits_and_all_rows_stay_accurate(dtype):
    """Causal self-attention over 2.5 chunks: rows of the first chunk see keys of one chunk only, so their bits
    are the one-chunk sum's (plan kv_chunk 0); every row is as close to fp64 as torch's own math in dtype."""
    probe = _tensors(1, 1, 1, 2, 2, 16, dtype)
    chunk = _chunk(*probe, fused_call("bshd", "causal", None, 0.3))
    s = int(2.5 * chunk)
    q, k, v = _tensors(1, s, s, 2, 2, 32, dtype, seed=2)
    call = fused_call("bshd", "causal", None, 0.3)
    chunked, _ = kernel_runner.forward(q, k, v, call, split_kv=False)
    one_chunk_plan = dataclasses.replace(forward_plan(kernel_runner.plan_key(q, k, v, call)), kv_chunk=0)
    with recorded_launches() as launches:
        one_chunk, _ = kernel_runner.forward(q, k, v, call, one_chunk_plan)
    assert launches[0][0].args["KV_CHUNK"] == 0
    assert torch.equal(chunked[:, :chunk], one_chunk[:, :chunk])
    ref = reference(q, k, v, "causal", scale=0.3)
    lowp = reference(q, k, v, "causal", scale=0.3, dtype=dtype)
    assert_close_to_reference("chunked rows", chunked, ref, lowp)


@requires_fused
def test_packed_rows_split_equals_one_program():
    """THD: sequences of several lengths (some within one chunk, some over several) packed in one row."""
    dtype = DTYPES[0]
    probe = _tensors(1, 1, 1, 2, 2, 16, dtype)
    chunk = _chunk(*probe, fused_call("bshd", "causal_bottom_right", None, 0.3))
    lens_k = [int(2.7 * chunk), 9, chunk + 1, int(1.5 * chunk)]
    lens_q = [3, 1, 1, 2]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens_q), 4, 32, generator=g).to(DEVICE, dtype)
    k = torch.randn(sum(lens_k), 2, 32, generator=g).to(DEVICE, dtype)
    v = torch.randn(sum(lens_k), 2, 32, generator=g).to(DEVICE, dtype)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,  # noqa: E731
                                   device=DEVICE)
    call = fused_call("thd", "padding_causal_bottom_right", None, 0.3, cu_seqlens_q=cu(lens_q),
                      cu_seqlens_kv=cu(lens_k))
    split = kernel_runner.forward(q, k, v, call, split_kv=True)
    whole = kernel_runner.forward(q, k, v, call, split_kv=False)
    assert torch.equal(split[0], whole[0])
    for i, n in enumerate(lens_q):  # thd writes lse rows inside sequences only
        assert torch.equal(split[1][i, :, :n], whole[1][i, :, :n])


def test_split_choice_and_workspace():
    """split_kv splits only where the keys span two chunks or more and the grid is small; its workspace holds
    one state per chunk and row. Plans without chunks never split."""
    call = fused_call("bshd", "causal_bottom_right", None, 0.3)
    views = {n: launch_description.View((64 * 4 * 32, 4 * 32, 32, 1)) for n in ("q", "k", "v", "out")}

    def described(max_q, max_k, num_seqs=2, device=None):
        return launch_description.Call(call.params, 4, 2, 32, 32, "float16", num_seqs, max_q, max_k, False, False,
                                       views, (4 * max_q, max_q), device or dict(device_type="cpu"))

    chunk = forward_plan(described(1, 1).plan_key).kv_chunk
    assert launch_description.split_kv(described(1, chunk)) is None  # one chunk
    ws = launch_description.split_kv(described(1, chunk + 1))
    assert (ws.chunks, ws.rows, ws.part_o_size, ws.part_ml_size) == (2, 2 * 4 * 1, 2 * 8 * 32, 2 * 2 * 8)
    assert launch_description.split_kv(described(1, 3 * chunk, num_seqs=4096)) is None  # a grid big enough
    assert launch_description.split_kv(described(1, 3 * chunk, num_seqs=4096), force=True).chunks == 3
    assert launch_description.split_kv(described(1, 3 * chunk), force=False) is None
    hopper = dict(device_type="cuda", vendor="nvidia", compute_capability=(9, 0), gfx_arch=None)
    plan = forward_plan(described(1, 1, device=hopper).plan_key)
    if plan.warp_specialized is not None:  # the Gluon forward serves: one chunk, never split
        assert plan.kv_chunk == 0 and launch_description.split_kv(described(1, 10**6, device=hopper)) is None


@requires_fused
def test_kv_cache_decode_over_many_chunks_equals_training_rows(monkeypatch):
    """Token-by-token decode after a prompt, contexts over several chunks (so the decode steps split), equals
    the training forward's rows bitwise (the packed training call folds in one program where its grid is big
    enough, else splits too: the same bits either way, tested above)."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    dtype, h, hk, d = torch.float32, 2, 1, 16  # fp32: the Triton forward on every GPU (no Gluon fp32 kernel)
    probe = _tensors(1, 1, 1, h, hk, d, dtype)
    chunk = _chunk(*probe, fused_call("bshd", "causal_bottom_right", None, 0.3))
    n = int(2.5 * chunk) + 3
    prompt = n - 6
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="thd", layer_number=1).to(DEVICE).eval()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, heads, d, generator=g).to(DEVICE, dtype) for heads in (h, hk, hk))
    params = InferenceParams(1, n + 8, num_heads_kv=hk, head_dim_k=d, dtype=dtype, device=DEVICE,
                             qkv_format="thd")
    params.allocate_memory(1)
    params.pre_step(OrderedDict([(0, prompt)]))
    rows = [dpa(q[:prompt], k[:prompt], v[:prompt], inference_params=params)]
    with recorded_launches() as launches:
        for i in range(prompt, n):
            params.pre_step(OrderedDict([(0, 1)]))
            rows.append(dpa(q[i:i + 1], k[i:i + 1], v[i:i + 1], inference_params=params))
    assert all(len(x) == 2 for x in launches)  # every decode step split its keys
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    training = dpa(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert torch.equal(torch.cat(rows), training)


HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
GLUON_CASES = ["decode_causal", "chunk_causal", "cross_no_mask", "self_causal", "window", "window_both"]


@pytest.mark.skipif(not HOPPER, reason="the warp-specialized Gluon forward runs on Hopper (sm_90) only")
@pytest.mark.parametrize("name", GLUON_CASES)
def test_gluon_forward_chunks_split_and_stays_accurate(name):
    """bf16 at d=128 on Hopper: the Gluon forward folds chunks in one program (the loader streams every block,
    the consumers regroup their sums) and, split, one program per chunk + the same combine: bitwise equal; rows
    whose keys lie in the first chunk keep the one-chunk kernel's bits; all rows as close to fp64 as torch's
    own bf16 math."""
    dtype, d = torch.bfloat16, 128
    probe = _tensors(1, 1, 1, 2, 2, d, dtype)
    plan = forward_plan(kernel_runner.plan_key(*probe, fused_call("bshd", "causal_bottom_right", None, 0.3)))
    assert plan.warp_specialized is not None and plan.kv_chunk > 0
    chunk = plan.kv_chunk
    sq, sk, h, hk = _shapes(name, chunk)
    q, k, v = _tensors(2, sq, sk, h, hk, d, dtype, seed=5)
    call = _call(name, q, k, h)
    with recorded_launches() as launches:
        split = kernel_runner.forward(q, k, v, call, split_kv=True)
        whole = kernel_runner.forward(q, k, v, call, split_kv=False)
    assert [x.name for x in launches[0]] == ["attn_fwd_ws_kernel", "attn_fwd_combine_kernel"]
    assert [x.name for x in launches[1]] == ["attn_fwd_ws_kernel"]
    assert launches[1][0].args["KV_CHUNK"] == chunk and launches[0][0].grid[2] == -(-sk // chunk)
    for what, a, b in zip(("out", "lse"), split, whole):
        assert torch.equal(a, b), f"{what}: the Gluon split differs from its one-program sum"
    one_chunk_plan = dataclasses.replace(forward_plan(kernel_runner.plan_key(q, k, v, call)), kv_chunk=0)
    with recorded_launches() as launches:
        one_chunk, _ = kernel_runner.forward(q, k, v, call, one_chunk_plan)
    assert launches[0][0].name == "attn_fwd_ws_kernel" and launches[0][0].args["KV_CHUNK"] == 0
    mask, window = CASES[name][4], CASES[name][5] or (-1, -1)
    if mask != "no_mask" and window == (-1, -1):  # causal rows that see only the first chunk's keys
        first = chunk - (sk - sq) if mask == "causal_bottom_right" else chunk
        if first > 0:
            assert torch.equal(whole[0][:, :first], one_chunk[:, :first])
    ref = reference(q, k, v, mask, window=window, scale=0.3)
    lowp = reference(q, k, v, mask, window=window, scale=0.3, dtype=dtype)
    assert_close_to_reference("Gluon chunked rows", whole[0], ref, lowp)
