"""The forward reading K/V through a paged KV cache's page table in place (kernels/forward.py, PAGE_SIZE).

A paged call (``AttnCall.page_table`` with ``params.kv_page_size``: k and v the cache's rows) must give the bits of
the same call on its pages gathered into contiguous rows: the kernel loads the same values into the same
arithmetic, only the rows' addresses differ. Checked bitwise for shuffled page tables, page sizes 1, 16, 64 and one
that is not a multiple of the key block, GQA, causal and bottom-right causal masks, sliding windows, chunked
prefill steps and single-token decode, with split-KV (keys over several kv_chunks: 64 keys under the interpreter)
forced on and off; then the InferenceParams path (no gather where the fused kernels run), the refusals and the
launch description's plan.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch

from dpa_helpers import DEVICE, ON_GPU, requires_fused
from transformer_engine.common.attention import launch_description
from transformer_engine.common.attention.explain import explain_plan
from transformer_engine.common.attention.plan import forward_plan
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.fused_attn import fused_attention
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.testing import fused_call, recorded_launches

DTYPES = [torch.float16, torch.float32] if not ON_GPU else [torch.bfloat16, torch.float16, torch.float32]
CHUNK = 64 if not ON_GPU else 4096  # the plan's kv_chunk where the Triton forward serves (interpreter: 64)


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def _paged_case(lens_q, lens_k, h, hk, d, dtype, page_size, seed=0, spare_pages=3):
    """(q thd, k_cache rows, v_cache rows, page_table, k gathered thd, v gathered thd): every sequence's pages
    at shuffled places of a cache whose unused rows hold NaN (a row read that should not be shows)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lens_k]
    num_pages = sum(pages) + spare_pages
    order = torch.randperm(num_pages, generator=g).tolist()
    k_cache = torch.full((num_pages, page_size, hk, d), float("nan"))
    v_cache = torch.full((num_pages, page_size, hk, d), float("nan"))
    table = torch.zeros(len(lens_k), max(pages) + 1, dtype=torch.int32)  # one unused column: zeros past the pages
    k_rows, v_rows = [], []
    taken = 0
    for i, n in enumerate(lens_k):
        k_seq = torch.randn(n, hk, d, generator=g)
        v_seq = torch.randn(n, hk, d, generator=g)
        k_rows.append(k_seq)
        v_rows.append(v_seq)
        for p in range(pages[i]):
            page = order[taken]
            taken += 1
            table[i, p] = page
            rows = slice(p * page_size, min((p + 1) * page_size, n))
            k_cache[page, :rows.stop - rows.start] = k_seq[rows]
            v_cache[page, :rows.stop - rows.start] = v_seq[rows]
    q = torch.randn(sum(lens_q), h, d, generator=g)
    to = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    return (to(q), to(k_cache).view(-1, hk, d), to(v_cache).view(-1, hk, d), table.to(DEVICE),
            to(torch.cat(k_rows)), to(torch.cat(v_rows)))


def _calls(mask, window, lens_q, lens_k, page_size, table, **kwargs):
    """(the paged call, the same call on gathered rows)."""
    contiguous = fused_call("thd", mask, window, 0.3, cu_seqlens_q=_cu(lens_q), cu_seqlens_kv=_cu(lens_k), **kwargs)
    paged = dataclasses.replace(contiguous, page_table=table,
                                params=dataclasses.replace(contiguous.params, kv_page_size=page_size))
    return paged, contiguous


def _assert_same(paged, gathered, lens_q, what):
    out_p, lse_p = paged[:2]
    out_g, lse_g = gathered[:2]
    assert torch.equal(out_p, out_g), f"{what}: out differs"
    assert not torch.isnan(out_p).any(), f"{what}: a NaN row of the cache was read"
    for i, n in enumerate(lens_q):  # thd writes lse rows inside sequences only
        assert torch.equal(lse_p[i, :, :n], lse_g[i, :, :n]), f"{what}: lse of sequence {i} differs"
    for a, b in zip(paged[2:], gathered[2:]):
        assert torch.equal(a, b), f"{what}: row max differs"


# name: (lens_q, lens_k in chunks or keys, h, hk, mask, window)
CASES = {
    "decode": ([1, 1, 1], [2.6, 0.3, 1.2], 4, 2, "padding_causal_bottom_right", None),
    "chunked_prefill": ([7, 20, 3], [2.2, 0.7, 3.1], 4, 1, "padding_causal_bottom_right", None),
    "prefill_causal": ([150, 40], [150, 40], 2, 2, "padding_causal", None),
    "window": ([5, 1], [3.3, 1.6], 2, 1, "padding_causal_bottom_right", (70, 0)),
    "cross_no_mask": ([4, 9], [2.5, 1.1], 4, 4, "padding", None),
}


def _lens(lens_k):
    return [n if isinstance(n, int) else max(1, int(n * CHUNK)) for n in lens_k]


@requires_fused
@pytest.mark.parametrize("page_size", [1, 16, 64, 24])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_paged_forward_equals_gathered_rows(name, dtype, page_size):
    """out, lse (and the row max) of a paged call == the gathered call's, bitwise, with split-KV forced on and
    off (24: a page size that is not a multiple of the key block; 1: a page per key)."""
    lens_q, lens_k, h, hk, mask, window = CASES[name]
    lens_k = _lens(lens_k)
    if page_size == 1 and sum(lens_k) > 200:  # a page per key: keep the interpreter's work small
        lens_k = [min(n, 130) for n in lens_k]
        lens_q = [min(q, n) for q, n in zip(lens_q, lens_k)]
    q, k_cache, v_cache, table, k, v = _paged_case(lens_q, lens_k, h, hk, 32, dtype, page_size)
    paged, contiguous = _calls(mask, window, lens_q, lens_k, page_size, table)
    paged = dataclasses.replace(paged, params=dataclasses.replace(paged.params, return_max_logit=True))
    contiguous = dataclasses.replace(contiguous, params=dataclasses.replace(contiguous.params, return_max_logit=True))
    for split in (True, False):
        with recorded_launches() as launches:
            got = kernel_runner.forward(q, k_cache, v_cache, paged, split_kv=split)
        want = kernel_runner.forward(q, k, v, contiguous, split_kv=split)
        assert launches[0][0].args["PAGE_SIZE"] == page_size
        _assert_same(got, want, lens_q, f"split_kv={split}")
    if max(lens_k) > CHUNK:
        assert len(launches[0]) == 1  # split off: one launch (split on was two: the chunks and the combine)


@requires_fused
def test_paged_forward_splits_q_k_head_dim_and_alibi_and_sink(monkeypatch):
    """A Q/K head dim in two chunks (48 = 32 + 16: BLOCK_DQK2, the second chunk's loads through the table too),
    ALiBi and a learnable sink: the gathered call's bits."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK", "1")
    lens_q, lens_k = [3, 1], [int(2.3 * CHUNK), 17]
    q, k_cache, v_cache, table, k, v = _paged_case(lens_q, lens_k, 2, 1, 48, DTYPES[0], 16, seed=5)
    slopes = torch.rand(2, device=DEVICE, dtype=torch.float32)
    paged, contiguous = _calls("padding_causal_bottom_right", None, lens_q, lens_k, 16, table, alibi_slopes=slopes,
                               softmax_type="learnable",
                               softmax_offset=torch.randn(2, device=DEVICE, dtype=torch.float32))
    with recorded_launches() as launches:
        got = kernel_runner.forward(q, k_cache, v_cache, paged)
    assert launches[0][0].args["BLOCK_DQK2"] > 0 or ON_GPU
    _assert_same(got, kernel_runner.forward(q, k, v, contiguous), lens_q, "split Q/K head dim")


def test_paged_plan_never_takes_the_gluon_forward_and_keeps_its_sum():
    """Where the Gluon forward would serve (Hopper, bf16, d=128), a paged call's plan takes the Triton forward,
    with the reason in the plan, and the chunk of the config's contiguous calls (its bits are not the Gluon
    forward's, so InferenceParams gathers such configs: test_inference_params_paged_gluon_config_gathers); the
    backward of a paged call is refused."""
    call = fused_call("thd", "padding_causal_bottom_right", None, 0.3)
    hopper = dict(device_type="cuda", vendor="nvidia", compute_capability=(9, 0), gfx_arch=None)
    views = {n: launch_description.View((0, 8 * 128, 128, 1)) for n in ("q", "k", "v", "out")}

    def described(page_size):
        return launch_description.Call(call.params, 8, 8, 128, 128, "bfloat16", 2, 1, 9000, True, True, views,
                                       (8 * 1, 1), hopper, page_size=page_size, page_table_stride=40)

    contiguous, paged = forward_plan(described(0).plan_key), forward_plan(described(64).plan_key)
    assert paged.warp_specialized is None and paged.kv_chunk == contiguous.kv_chunk
    # The same tiles, at most two pipeline stages (plan.trace_forward: the stages schedule loads, not the sum).
    assert dataclasses.replace(paged.tiles, num_stages=contiguous.tiles.num_stages) == contiguous.tiles
    assert paged.tiles.num_stages <= 2 < contiguous.tiles.num_stages
    text = str(explain_plan(described(64).plan_key))
    assert "paged KV cache" in text
    (launch,) = launch_description.forward_launches(described(64), split=False)
    assert launch.name == "attn_fwd_kernel" and launch.args["PAGE_SIZE"] == 64 and launch.args["stride_pt"] == 40
    split, combine = launch_description.forward_launches(described(64), split=True)
    assert split.name == "attn_fwd_kernel" and split.args["PAGE_SIZE"] == 64
    # A plan given explicitly with Gluon tiles is held to the Triton forward too.
    for split in (False, True):
        assert launch_description.forward_launches(described(64), contiguous, split)[0].name == "attn_fwd_kernel"
    with pytest.raises(NotImplementedError, match="inference only"):
        launch_description.backward_launches(described(64))


@requires_fused
def test_paged_call_refuses_grad_and_bad_tables():
    """fused_attention refuses a paged call that needs gradients, and a bad page table by name."""
    dtype = DTYPES[0]
    lens_q, lens_k = [2, 1], [40, 9]
    q, k_cache, v_cache, table, _, _ = _paged_case(lens_q, lens_k, 2, 2, 16, dtype, 16)
    paged, _ = _calls("padding_causal_bottom_right", None, lens_q, lens_k, 16, table)
    with torch.no_grad():
        fused_attention(q, k_cache, v_cache, paged)  # valid
    with pytest.raises(NotImplementedError, match="inference only"):
        fused_attention(q.clone().requires_grad_(True), k_cache, v_cache, paged)

    def bad(match, **changes):
        params = dataclasses.replace(paged.params, **changes.pop("params", {}))
        with torch.no_grad(), pytest.raises(ValueError, match=match):
            fused_attention(q, k_cache, v_cache, dataclasses.replace(paged, params=params, **changes))

    bad("`page_table` must be an int32", page_table=table.to(torch.int64))
    bad("`page_table` must be an int32", page_table=table[0])
    bad("`page_table` must have a row for each", page_table=table[:1])
    bad("`page_table` must list pages for max_seqlen_kv", page_table=table[:, :2])
    out_of_range = table.clone()
    out_of_range[1, 0] = k_cache.shape[0] // 16
    bad(r"`page_table` entries must be pages of the cache, in \[0, ", page_table=out_of_range)
    negative = table.clone()
    negative[0, 2] = -1
    bad("`page_table` entries must be pages", page_table=negative)
    unused = table.clone()
    unused[1, 2] = 10**6  # past sequence 1's pages: never read, so accepted
    with torch.no_grad():
        fused_attention(q, k_cache, v_cache, dataclasses.replace(paged, page_table=unused))
    bad("`kv_page_size` must be a positive int", params=dict(kv_page_size=0))
    bad("`key_layer` must be the paged cache's rows", params=dict(kv_page_size=48))
    bad("`page_table` and `kv_page_size` must be given together", params=dict(kv_page_size=None))


def _generate(params, dpa, steps, q, k, v):
    """Run ``steps`` (a list of step_dicts) through ``dpa`` with ``params``; q, k, v [seq][token, h, d]."""
    done = {}
    outs = []
    for step in steps:
        params.pre_step(OrderedDict(step))
        rows = []
        for seq, n in step.items():
            rows.append(slice(done.get(seq, 0), done.get(seq, 0) + n))
            done[seq] = done.get(seq, 0) + n
        pick = lambda t: torch.cat([t[seq][r] for seq, r in zip(step, rows)])  # noqa: E731
        outs.append(dpa(pick(q), pick(k), pick(v), inference_params=params))
    return outs


@requires_fused
@pytest.mark.parametrize("page_size", [16, 24])
def test_inference_params_paged_reads_pages_in_place(page_size, monkeypatch):
    """InferenceParams with a paged cache: the fused kernels get the cache's rows and the step's page table (no
    gather, no permutation), and every step's output equals the non-paged cache's bitwise (prefill in chunks,
    then decode over several chunks, sequences joining and leaving)."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    dtype, h, hk, d = DTYPES[0], 4, 2, 16
    g = torch.Generator().manual_seed(7)
    n = int(2.2 * CHUNK)
    q, k, v = ({s: torch.randn(n, heads, d, generator=g).to(DEVICE, dtype) for s in "abc"} for heads in (h, hk, hk))
    steps = [{"a": 30, "b": 5}, {"a": 40, "b": 1}, {"b": 60, "c": 3}] + [{"b": 1, "c": 1}] * 4 + [{"a": 1, "c": 2}]
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="thd", attn_mask_type="causal",
                              layer_number=1).to(DEVICE).eval()
    kwargs = dict(num_heads_kv=hk, head_dim_k=d, dtype=dtype, device=DEVICE, qkv_format="thd")
    flat = InferenceParams(3, 2 * page_size * -(-n // page_size), **kwargs)
    paged = InferenceParams(3, 2 * page_size * -(-n // page_size), is_paged=True, page_size=page_size, **kwargs)
    for params in (flat, paged):
        params.allocate_memory(1)
    with torch.no_grad():
        want = _generate(flat, dpa, steps, q, k, v)
        # Pages handed out in a shuffled order: a sequence's pages are not in cache order.
        manager = paged.cache_manager
        manager.free_pages = torch.randperm(manager.total_num_pages, generator=g).tolist()
        with recorded_launches() as launches:
            got = _generate(paged, dpa, steps, q, k, v)
    assert dpa.last_backend is not None and "Fused" in dpa.last_backend
    k_cache = manager.cache[1][0]
    for step in launches:
        assert step[0].args["PAGE_SIZE"] == page_size
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: the paged cache's rows differ from the non-paged cache's"
    assert k_cache.shape[1] == page_size


@requires_fused
def test_inference_params_paged_with_grad_falls_back_to_the_gather(monkeypatch):
    """A step whose query requires grad (grad enabled) runs on gathered rows (the fused backward never sees a
    paged call), with the same bits."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    dtype, h, d = DTYPES[0], 2, 16
    g = torch.Generator().manual_seed(8)
    q, k, v = ({0: torch.randn(20, h, d, generator=g).to(DEVICE, dtype)} for _ in range(3))
    q[0].requires_grad_(True)
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="causal", layer_number=1).to(DEVICE)
    outs = []
    for grad in (True, False):
        params = InferenceParams(1, 32, num_heads_kv=h, head_dim_k=d, dtype=dtype, device=DEVICE, qkv_format="thd",
                                 is_paged=True, page_size=16)
        params.allocate_memory(1)
        with torch.set_grad_enabled(grad), recorded_launches() as launches:
            outs.append(_generate(params, dpa, [{0: 12}, {0: 1}], q, k, v))
        assert all(x[0].args["PAGE_SIZE"] == (0 if grad else 16) for x in launches)
    assert outs[0][0].requires_grad
    outs[0][0].sum().backward()
    assert q[0].grad is not None
    for a, b in zip(*outs):
        assert torch.equal(a.detach(), b)


@requires_fused
def test_inference_params_paged_unfused_backend_keeps_the_gather(monkeypatch):
    """With the fused backend off, the unfused backend runs on gathered rows: the non-paged cache's output."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    dtype, h, d = torch.float32, 2, 16
    g = torch.Generator().manual_seed(9)
    q, k, v = ({0: torch.randn(40, h, d, generator=g).to(DEVICE, dtype), 1: torch.randn(40, h, d, generator=g)
                .to(DEVICE, dtype)} for _ in range(3))
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="causal", layer_number=1).to(DEVICE).eval()
    steps = [{0: 17, 1: 5}, {0: 1, 1: 20}, {1: 1}]
    outs = []
    for is_paged in (False, True):
        params = InferenceParams(2, 48, num_heads_kv=h, head_dim_k=d, dtype=dtype, device=DEVICE, qkv_format="thd",
                                 is_paged=is_paged, page_size=16 if is_paged else None)
        params.allocate_memory(1)
        with torch.no_grad(), recorded_launches() as launches:
            outs.append(_generate(params, dpa, steps, q, k, v))
        assert not launches and "Unfused" in dpa.last_backend
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not (ON_GPU and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the warp-specialized Gluon forward runs on Hopper (sm_90) only")
def test_inference_params_paged_gluon_config_gathers(monkeypatch):
    """bf16 at d=128 on Hopper: the contiguous call runs the Gluon forward, which follows no page table and whose
    products are blocked unlike the Triton forward's, so the paged cache's steps gather their pages into the Gluon
    forward: rows bitwise those of the non-paged cache (and so of training)."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    dtype, h, hk, d, page_size = torch.bfloat16, 4, 2, 128, 64
    g = torch.Generator().manual_seed(11)
    n = 300
    q, k, v = ({s: torch.randn(n, heads, d, generator=g).to(DEVICE, dtype) for s in "ab"} for heads in (h, hk, hk))
    steps = [{"a": 130, "b": 7}, {"a": 1, "b": 150}, {"a": 1, "b": 1}, {"b": 1}]
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="thd", attn_mask_type="causal",
                              layer_number=1).to(DEVICE).eval()
    kwargs = dict(num_heads_kv=hk, head_dim_k=d, dtype=dtype, device=DEVICE, qkv_format="thd")
    flat = InferenceParams(2, 320, **kwargs)
    paged = InferenceParams(2, 320, is_paged=True, page_size=page_size, **kwargs)
    for params in (flat, paged):
        params.allocate_memory(1)
    with torch.no_grad():
        want = _generate(flat, dpa, steps, q, k, v)
        paged.cache_manager.free_pages = torch.randperm(paged.cache_manager.total_num_pages, generator=g).tolist()
        with recorded_launches() as launches:
            got = _generate(paged, dpa, steps, q, k, v)
    assert all(step[0].name == "attn_fwd_ws_kernel" and "PAGE_SIZE" not in step[0].args for step in launches)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: the paged cache's rows differ from the non-paged cache's"
