"""The forward reading K/V through a paged KV cache's page table in place (PAGE_SIZE: kernels/forward.py row by row,
kernels/hopper_ws.py by its loader's TMA loads of whole blocks or pages).

A paged call (``AttnCall.page_table`` with ``params.kv_page_size``: k and v the cache's rows) must give the bits of
the same call on its pages gathered into contiguous rows: the kernel loads the same values into the same
arithmetic, only the rows' addresses differ. Checked bitwise for shuffled page tables, page sizes 1, 16, 64 and one
that is not a multiple of the key block, GQA, causal and bottom-right causal masks, sliding windows, chunked
prefill steps and single-token decode, with split-KV (keys over several kv_chunks: 64 keys under the interpreter)
forced on and off; then the InferenceParams path (no gather where the fused kernels run), the refusals and the
launch description's plan. On Hopper (GPU only) the same for the Gluon forward, paged against contiguous, at page
sizes 16 to 256, its three head-dim cases, a context past 32k keys with split-KV, and decode rows against training
rows; a page size its loader cannot follow gathers.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch
from case_grid import grid

from dpa_helpers import DEVICE, ON_GPU, requires_fused
from transformer_engine.common.attention import launch_description
from transformer_engine.common.attention.explain import explain_plan
from transformer_engine.common.attention.plan import forward_plan
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.fused_attn import fused_attention
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.call import fused_call
from te_torch_testing import recorded_launches


@pytest.fixture(autouse=True)
def _gluon_paged(monkeypatch):
    """This file tests the Gluon forward's paged loads, which NVTE_FUSED_ATTN_GLUON_PAGED turns on (off by default:
    those configs gather, test_explain_plan.py::test_gluon_paged_loads_are_off_by_default)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_GLUON_PAGED", "1")

DTYPES = [torch.float16, torch.float32] if not ON_GPU else [torch.bfloat16, torch.float16, torch.float32]
CHUNK = 64 if not ON_GPU else 4096  # the plan's kv_chunk where the Triton forward serves (interpreter: 64)


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def _paged_case(lens_q, lens_k, h, hk, d, dtype, page_size, seed=0, spare_pages=3, d_v=None):
    """(q thd, k_cache rows, v_cache rows, page_table, k gathered thd, v gathered thd): every sequence's pages
    at shuffled places of a cache whose unused rows hold NaN (a row read that should not be shows); ``d_v``: V's
    head dim where it is not ``d``."""
    d_v = d if d_v is None else d_v
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lens_k]
    num_pages = sum(pages) + spare_pages
    order = torch.randperm(num_pages, generator=g).tolist()
    k_cache = torch.full((num_pages, page_size, hk, d), float("nan"))
    v_cache = torch.full((num_pages, page_size, hk, d_v), float("nan"))
    table = torch.zeros(len(lens_k), max(pages) + 1, dtype=torch.int32)  # one unused column: zeros past the pages
    k_rows, v_rows = [], []
    taken = 0
    for i, n in enumerate(lens_k):
        k_seq = torch.randn(n, hk, d, generator=g)
        v_seq = torch.randn(n, hk, d_v, generator=g)
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
    return (to(q), to(k_cache).view(-1, hk, d), to(v_cache).view(-1, hk, d_v), table.to(DEVICE),
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
@pytest.mark.parametrize("name,dtype,page_size", grid("name,dtype,page_size", list(CASES),
                                                      {str(t).split(".")[-1]: t for t in DTYPES}, [16, 1, 64, 24]))
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


_HOPPER = dict(device_type="cuda", vendor="nvidia", compute_capability=(9, 0), gfx_arch=None)


def _hopper_call(page_size, page_rows=6144):
    """The launch description's view of a thd call at d=128, bf16, on Hopper: contiguous rows (page_size 0) or a
    paged cache of ``page_rows`` rows."""
    call = fused_call("thd", "padding_causal_bottom_right", None, 0.3)
    views = {n: launch_description.View((0, 8 * 128, 128, 1)) for n in ("q", "k", "v", "out")}
    paging = dict(page_size=page_size, page_table_stride=40, page_rows=page_rows) if page_size else {}
    return launch_description.Call(call.params, 8, 8, 128, 128, "bfloat16", 2, 1, 9000, True, True, views,
                                   (8 * 1, 1), _HOPPER, **paging)


def test_paged_launches_take_the_gluon_forward_where_pages_fit():
    """Where the Gluon forward serves (Hopper, bf16, d=128), a paged call whose page size fits its key blocks of 128
    launches it with the contiguous launch's grid and arguments plus the page table's (slot, row stride, page size
    and the pools' rows), split-KV alike; a page size that does not fit launches the Triton forward, with the
    contiguous call's chunk, even with the Gluon tiles given explicitly; the backward of a paged call is
    refused."""
    paging = {"PAGE_TABLE", "stride_pt", "PAGE_SIZE", "page_rows"}
    contiguous_plan = forward_plan(_hopper_call(0).plan_key)
    for split in (False, True):
        contiguous = launch_description.forward_launches(_hopper_call(0), split=split)
        for page_size in (16, 64, 128, 256):
            paged = launch_description.forward_launches(_hopper_call(page_size), split=split)
            assert [x.name for x in paged] == [x.name for x in contiguous]
            assert paged[0].name == "attn_fwd_ws_kernel" and paged[0].args["SPLIT_KV"] == split
            assert (paged[0].args["PAGE_SIZE"], paged[0].args["page_rows"], paged[0].args["stride_pt"]) == (
                page_size, 6144, 40)
            assert paged[0].args["PAGE_TABLE"] == launch_description.Slot("page_table")
            assert contiguous[0].args["PAGE_SIZE"] == 0 and contiguous[0].args["page_rows"] == 0
            for x, y in zip(paged, contiguous):
                assert x.grid == y.grid and x.options == y.options
                assert {k: v for k, v in x.args.items() if k not in paging} == \
                    {k: v for k, v in y.args.items() if k not in paging}
        for page_size in (1, 24, 48):
            (first, *rest) = launch_description.forward_launches(_hopper_call(page_size), split=split)
            assert first.name == "attn_fwd_kernel" and first.args["PAGE_SIZE"] == page_size
            assert first.args["KV_CHUNK"] == contiguous[0].args["KV_CHUNK"] and len(rest) == split
            # A plan given explicitly with the Gluon tiles is held to what the loader can follow too.
            held = launch_description.forward_launches(_hopper_call(page_size), contiguous_plan, split)
            assert held[0].name == "attn_fwd_kernel"
    triton_paged = forward_plan(_hopper_call(24).plan_key)
    assert triton_paged.warp_specialized is None
    # The Triton forward's tiles, at most two pipeline stages (plan.trace_forward: stages schedule loads, not the sum).
    assert triton_paged.tiles.num_stages <= 2 < contiguous_plan.tiles.num_stages
    assert dataclasses.replace(triton_paged.tiles, num_stages=contiguous_plan.tiles.num_stages) == contiguous_plan.tiles
    assert "pages of 24 keys" in str(explain_plan(_hopper_call(24).plan_key))
    with pytest.raises(ValueError, match="`page_rows` must be the pools' rows, a positive multiple of page_size=64, "
                                         "got 0"):
        _hopper_call(64, page_rows=0)
    with pytest.raises(NotImplementedError, match="at most 2\\*\\*31 - 1 rows of the pools, got page_rows=2147483648"):
        launch_description.forward_launches(_hopper_call(64, page_rows=2 ** 31))
    with pytest.raises(NotImplementedError, match="inference only"):
        launch_description.backward_launches(_hopper_call(64))


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


requires_hopper = pytest.mark.skipif(not (ON_GPU and torch.cuda.get_device_capability() == (9, 0)),
                                     reason="the warp-specialized Gluon forward runs on Hopper (sm_90) only")

# Head dims and dtype of the Gluon forward's cases: key blocks of 128 (d=128; 192/128, the Q/K split) and 64 (d=256).
GLUON_DIMS = {"d128_bf16": ((128, 128), torch.bfloat16), "d128_fp16": ((128, 128), torch.float16),
              "d256_bf16": ((256, 256), torch.bfloat16), "d192x128_bf16": ((192, 128), torch.bfloat16)}


def _forward_launch(launches):
    """The forward launch of each recorded call (the first: split-KV's combine follows it)."""
    return [step[0] for step in launches]


@requires_hopper
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
@pytest.mark.parametrize("dims", list(GLUON_DIMS))
@pytest.mark.parametrize("name", list(CASES))
def test_gluon_paged_forward_equals_contiguous_gluon_forward(name, dims, page_size):
    """The Gluon forward on a paged cache (shuffled pages, NaN in every row outside the sequences) gives the
    contiguous Gluon forward's out, lse and row max bitwise, with split-KV forced on and off (at d=128: keys over
    two and three chunks of 4096)."""
    (d, d_v), dtype = GLUON_DIMS[dims]
    lens_q, lens_k, h, hk, mask, window = CASES[name]
    lens_k = _lens(lens_k)
    q, k_cache, v_cache, table, k, v = _paged_case(lens_q, lens_k, h, hk, d, dtype, page_size, seed=page_size, d_v=d_v)
    paged, contiguous = _calls(mask, window, lens_q, lens_k, page_size, table)
    paged = dataclasses.replace(paged, params=dataclasses.replace(paged.params, return_max_logit=True))
    contiguous = dataclasses.replace(contiguous, params=dataclasses.replace(contiguous.params, return_max_logit=True))
    for split in (True, False):
        with recorded_launches() as launches:
            got = kernel_runner.forward(q, k_cache, v_cache, paged, split_kv=split)
            want = kernel_runner.forward(q, k, v, contiguous, split_kv=split)
        (paged_fwd, contiguous_fwd) = _forward_launch(launches)
        assert (paged_fwd.name, paged_fwd.args["PAGE_SIZE"]) == ("attn_fwd_ws_kernel", page_size)
        assert (contiguous_fwd.name, contiguous_fwd.args["PAGE_SIZE"]) == ("attn_fwd_ws_kernel", 0)
        assert paged_fwd.args["SPLIT_KV"] == contiguous_fwd.args["SPLIT_KV"]
        _assert_same(got, want, lens_q, f"split_kv={split}")


@requires_hopper
@pytest.mark.parametrize("page_size", [16, 256])
def test_gluon_paged_long_context_split_kv_rows_equal_training_rows(page_size):
    """Contexts past 32k keys (GQA, bf16, d=128) read through the page table by the Gluon forward: decode (one and
    three queries) and a chunked-prefill step of 700 queries, split-KV planned, forced on and forced off, give
    the contiguous call's bits and the training forward's rows (each whole sequence, causal) at their positions."""
    lens_k, steps = [33000 + 17, 40961, 35000], [1, 3, 700]
    h, hk, d, dtype = 8, 2, 128, torch.bfloat16
    # q for every position (the training forward's); the step's queries are each sequence's last ones.
    q_all, k_cache, v_cache, table, k, v = _paged_case(lens_k, lens_k, h, hk, d, dtype, page_size, seed=3)
    train = kernel_runner.forward(q_all, k, v, fused_call("thd", "padding_causal", None, 0.3, cu_seqlens_q=_cu(lens_k),
                                                          cu_seqlens_kv=_cu(lens_k)))[0]
    ends = _cu(lens_k).tolist()[1:]
    q = torch.cat([q_all[end - t:end] for end, t in zip(ends, steps)])
    want_rows = torch.cat([train[end - t:end] for end, t in zip(ends, steps)])
    paged, contiguous = _calls("padding_causal_bottom_right", None, steps, lens_k, page_size, table)
    for split in (None, True, False):
        with recorded_launches() as launches:
            got = kernel_runner.forward(q, k_cache, v_cache, paged, split_kv=split)
            want = kernel_runner.forward(q, k, v, contiguous, split_kv=split)
        paged_fwd = _forward_launch(launches)[0]
        assert paged_fwd.name == "attn_fwd_ws_kernel" and paged_fwd.args["PAGE_SIZE"] == page_size
        assert paged_fwd.args["KV_CHUNK"] == 4096 and paged_fwd.args["SPLIT_KV"] == (split is not False)
        _assert_same(got, want, steps, f"split_kv={split}")
        assert torch.equal(got[0], want_rows), f"split_kv={split}: decode rows differ from the training rows"


def _serve_steps(params, dpa, seqs, steps):
    """Each sequence's rows from ``steps`` (OrderedDicts: sequence -> new tokens) through ``params``."""
    pos = {i: 0 for i in seqs}
    rows = {i: [] for i in seqs}
    for step in steps:
        params.pre_step(OrderedDict(step))
        parts = [torch.cat([seqs[i][j][pos[i]:pos[i] + n] for i, n in step.items()]) for j in range(3)]
        out = dpa(*parts, inference_params=params)
        first = 0
        for i, n in step.items():
            rows[i].append(out[first:first + n])
            first += n
            pos[i] += n
    return {i: torch.cat(r) for i, r in rows.items()}


@requires_hopper
@pytest.mark.parametrize("page_size", [16, 64, 128, 256, 24])
def test_inference_params_paged_gluon_rows_equal_training_rows(page_size, monkeypatch):
    """bf16 at d=128 on Hopper (GQA): steps on a paged cache (shuffled pages; chunked prefill of a 4500-token
    prompt over two chunks of keys, then decode, sequences joining and leaving) launch the Gluon forward on the
    cache's rows through the step's page table, and every row equals the non-paged cache's and the training
    forward's; with pages of 24 keys (which its loader cannot follow) the steps gather, with the same rows."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    dtype, h, hk, d = torch.bfloat16, 8, 2, 128
    g = torch.Generator().manual_seed(page_size)
    lens = {"a": 4500, "b": 300, "c": 40}
    seqs = {i: tuple(torch.randn(n, heads, d, generator=g).to(DEVICE, dtype) for heads in (h, hk, hk))
            for i, n in lens.items()}
    # a: 4500 = 1500 + 1500 + 1498 + 1 + 1; b: 300 = 7 + 290 + 1 + 1 + 1; c joins when a and b have left.
    steps = ([{"a": 1500, "b": 7}, {"a": 1500, "b": 290}, {"a": 1498, "b": 1}] + [{"a": 1, "b": 1}] * 2
             + [{"c": 38}] + [{"c": 1}] * 2)
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="thd", attn_mask_type="causal",
                              layer_number=1).to(DEVICE).eval()
    kwargs = dict(num_heads_kv=hk, head_dim_k=d, dtype=dtype, device=DEVICE, qkv_format="thd")
    flat = InferenceParams(3, 4608, **kwargs)
    paged = InferenceParams(3, 4608, is_paged=True, page_size=page_size, **kwargs)
    for params in (flat, paged):
        params.allocate_memory(1)
    with torch.no_grad():
        want = _serve_steps(flat, dpa, seqs, steps)
        paged.cache_manager.free_pages = torch.randperm(paged.cache_manager.total_num_pages, generator=g).tolist()
        with recorded_launches() as launches:
            got = _serve_steps(paged, dpa, seqs, steps)
        training = {}
        for i, (q, k, v) in seqs.items():
            cu = _cu([lens[i]])
            training[i] = dpa(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=lens[i], max_seqlen_kv=lens[i])
    reads_pages = page_size != 24
    for fwd in _forward_launch(launches):
        assert fwd.name == "attn_fwd_ws_kernel"
        assert fwd.args["PAGE_SIZE"] == (page_size if reads_pages else 0)
    assert any(fwd.args["KV_CHUNK"] for fwd in _forward_launch(launches))  # prompt steps past 4096 keys
    for i in seqs:
        assert torch.equal(got[i], want[i]), f"sequence {i}: the paged cache's rows differ from the non-paged cache's"
        n = got[i].shape[0]
        assert torch.equal(got[i], training[i][:n]), f"sequence {i}: the paged cache's rows differ from training"
