"""The host side of KV-cache steps (InferenceParams): what a decode step does besides its kernels.

A step's metadata is built on the host from ``step_dict`` and sent to the device in one non-blocking copy
(``buffers.to_device``); the step reads no tensor value back (no sync); DotProductAttention's and the kernel
runner's signature caches serve the steps (DotProductAttention sees the cache's capacity as max_seqlen_kv, the
fused backend the longest sequence rounded up within its key chunk, ``kernel_runner.max_seqlen_kv_bound``); the
paged cache's page table changes by the entries a step changes. Results are bitwise those of the steps with
every signature cache off, and the bounded calls launch what the exact ones launch but for ``seqlen_k``.

Host-read and cache counts are taken with the kernel launches stubbed (``testing.no_launches``) where the
kernels would run under Triton's interpreter (which reads tensors on the host itself); bits with the kernels.
"""

from __future__ import annotations

import contextlib
import random
from collections import OrderedDict

import pytest
import torch

from dpa_helpers import DEVICE, ON_GPU, requires_fused
from transformer_engine.common.attention import AttnBiasType
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import inference, kernel_runner, signature_cache
import te_torch_testing as testing
from transformer_engine.pytorch.attention.inference import InferenceParams

LAYER = 1
CHUNK = 64 if not ON_GPU else 4096  # the fused forward's key chunk (the interpreter's: 64)
H, HK, D = 4, 2, 16
DTYPE = torch.float16 if not ON_GPU else torch.bfloat16


def _cache(name: str) -> signature_cache.SignatureCache:
    (cache,) = [c for c in signature_cache.caches() if c.name == name]
    return cache


@pytest.fixture
def fresh_caches(monkeypatch):
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")  # our kernels
    signature_cache.clear_all()
    yield
    signature_cache.clear_all()


def _setup(paged: bool, batch: int, context: int, extra: int = 64, seed: int = 0, room: int = 0):
    """(params, module, step tensors): ``batch`` sequences of ``context`` tokens registered in the cache (their
    tokens never written: the host work does not read them), room for ``extra`` more each and for ``room`` more
    sequences."""
    max_len = -(-(context + extra) // 16) * 16
    params = InferenceParams(batch + room, max_len, HK, D, DTYPE, device=DEVICE, is_paged=paged,
                             page_size=16 if paged else None)
    if paged:
        random.Random(seed).shuffle(params.cache_manager.free_pages)
    params.allocate_memory(LAYER)
    dpa = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="thd", attn_mask_type="padding_causal",
                              layer_number=LAYER).to(DEVICE).eval()
    params.pre_step(OrderedDict((i, context) for i in range(batch)))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, D, generator=g).to(DEVICE, DTYPE) for heads in (H, HK, HK))
    return params, dpa, (q, k, v)


def _decode(params, dpa, qkv, batch: int):
    params.pre_step(OrderedDict((i, 1) for i in range(batch)))
    with torch.no_grad():
        return dpa(*qkv, inference_params=params)


@pytest.fixture
def plan_runs(monkeypatch):
    """The decode steps run from a kept kernel call: a list that each ``inference._DecodePlan.run`` returning the
    step's rows appends its ``InferenceParams`` to (None from it: the step takes the full path)."""
    runs = []
    run = inference._DecodePlan.run

    def counted(plan, params, *args):
        out = run(plan, params, *args)
        if out is not None:
            runs.append(params)
        return out

    monkeypatch.setattr(inference._DecodePlan, "run", counted)
    return runs


def _stubbed():
    """No launches where the kernels would run under the interpreter (it reads tensors on the host)."""
    return testing.no_launches() if not ON_GPU else contextlib.nullcontext()


@requires_fused
@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_decode_steps_read_no_tensor_values_and_upload_once(fresh_caches, paged, monkeypatch):
    """After the first step, a decode step reads no tensor value on the host (each would be a sync on a GPU)
    and sends its metadata in one copy."""
    batch = 3
    params, dpa, qkv = _setup(paged, batch, context=40)
    uploads = []
    real, real_upload = inference.to_device, inference._upload
    monkeypatch.setattr(inference, "to_device", lambda arrays, device: uploads.append(len(arrays)) or
                        real(arrays, device))
    monkeypatch.setattr(inference, "_upload", lambda buffer, host: uploads.append(1) or real_upload(buffer, host))
    with _stubbed():
        _decode(params, dpa, qkv, batch)  # decisions made, kernels compiled
        uploads.clear()
        with testing.counted_host_reads() as reads:
            for _ in range(20):
                _decode(params, dpa, qkv, batch)
    assert not reads, f"host reads of tensor values in decode steps: {dict(reads)}"
    assert len(uploads) == 20, f"{len(uploads)} uploads in 20 decode steps (one a step expected)"


def test_counted_host_reads_counts_reads():
    """The counter the test above relies on sees .item(), bool(), torch.equal and .tolist() (and stops counting
    after)."""
    t = torch.arange(3, device=DEVICE)
    with testing.counted_host_reads() as reads:
        t[0].item()
        bool(t[1])
        torch.equal(t, t)
        t.tolist()
        if ON_GPU:
            t.cpu()
    t.tolist()
    want = {"_local_scalar_dense": 2, "equal": 1, "tolist": 1}
    assert dict(reads) == (dict(want, **{"device-to-host copy": 1}) if ON_GPU else want)


@pytest.mark.skipif(not ON_GPU, reason="CUDA's sync debug mode needs a GPU")
@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_decode_steps_do_not_sync_on_a_gpu(fresh_caches, paged):
    """torch.cuda.set_sync_debug_mode("error") raises at any synchronizing CUDA call (a device-to-host copy, a
    pageable host-to-device copy): decode steps past the first make none."""
    batch = 4
    params, dpa, qkv = _setup(paged, batch, context=300)
    for _ in range(2):
        _decode(params, dpa, qkv, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(40):  # over page boundaries (16 tokens): page table updates included
            _decode(params, dpa, qkv, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@requires_fused
@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_decode_steps_hit_the_signature_caches(fresh_caches, plan_runs, paged):
    """DotProductAttention decides once for every decode step of a batch; the kernel runner prepares once per
    key chunk the longest sequence enters (its bound changes there, kernel_runner.max_seqlen_kv_bound); the
    steps in between launch the kept kernel call (inference._DecodePlan) without either; a step of another
    batch misses."""
    batch, context = 2, CHUNK - 3
    steps = 2 * CHUNK if not ON_GPU else 20
    params, dpa, qkv = _setup(paged, batch, context, extra=steps + 8, room=1)
    dpa_cache, runner = _cache("DotProductAttention"), _cache("kernel_runner.forward")
    with _stubbed():
        for _ in range(steps):
            _decode(params, dpa, qkv, batch)
        lengths = range(context + 1, context + steps + 1)
        chunks = len({-(-n // CHUNK) for n in lengths})
        # The full path runs at the first step of each chunk only.
        assert (dpa_cache.hits, dpa_cache.misses) == (chunks - 1, 1)
        assert (runner.hits, runner.misses) == (0, chunks)
        assert len(plan_runs) == steps - chunks and all(p is params for p in plan_runs)
        # A sequence joins: a batch of three is another signature.
        params.pre_step(OrderedDict([(0, 1), (1, 1), (2, 1)]))
        with torch.no_grad():
            dpa(*(torch.cat([t, t[:1]]) for t in qkv), inference_params=params)
        assert dpa_cache.misses == 2


@requires_fused
@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_cached_decode_steps_are_bitwise_the_uncached_ones(fresh_caches, plan_runs, paged):
    """The steps' outputs with every signature cache on equal those with every cache off (each call decided
    afresh), bitwise: prefill chunks, then decode steps in which the longest sequence enters its second key
    chunk, sequences in a step order that is not the cache's."""
    g = torch.Generator().manual_seed(3)
    n = CHUNK + 4
    toks = {s: [torch.randn(n, heads, D, generator=g).to(DEVICE, DTYPE) for heads in (H, HK, HK)] for s in "ab"}
    plan = [{"a": CHUNK - 20, "b": 7}, {"b": CHUNK - 20, "a": 14}] + [{"b": 1, "a": 1}] * 10
    outs, runs = [], []
    for enabled in (True, False):
        for cache in signature_cache.caches():
            cache.enabled = enabled
        try:
            params = InferenceParams(2, -(-(n + 16) // 16) * 16, HK, D, DTYPE, device=DEVICE, is_paged=paged,
                                     page_size=16 if paged else None)
            if paged:
                random.Random(1).shuffle(params.cache_manager.free_pages)
            params.allocate_memory(LAYER)
            dpa = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="thd", attn_mask_type="causal",
                                      layer_number=LAYER).to(DEVICE).eval()
            pos, rows = {"a": 0, "b": 0}, []
            with torch.no_grad():
                for step in plan:
                    params.pre_step(OrderedDict(step))
                    q, k, v = (torch.cat([toks[s][j][pos[s]:pos[s] + c] for s, c in step.items()]) for j in range(3))
                    rows.append(dpa(q, k, v, inference_params=params))
                    for s, c in step.items():
                        pos[s] += c
            outs.append(rows)
            runs.append(sum(p is params for p in plan_runs))
        finally:
            for cache in signature_cache.caches():
                cache.enabled = True
    # The first pass ran most decode steps from their kept kernel call (all but the first and the one entering
    # the second key chunk), the second none.
    assert runs == [8, 0]
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a, b), f"step {i}: the cached step's rows differ from the uncached step's"


@pytest.mark.parametrize("lengths", [[100, 30], [40, 7], [1, 1], [CHUNK + 1, CHUNK]])
def test_bounded_max_seqlen_kv_launches_the_exact_calls_kernels(lengths):
    """kernel_runner.max_seqlen_kv_bound: the forward of a thd call with the bound as max_seqlen_kv launches the
    kernels, grids, constexprs and scalars of the call with the exact longest length, but ``seqlen_k``
    (read by no kernel where lengths are given): the same chunk count, KV_CHUNK and split-KV workspace."""
    q = torch.zeros(len(lengths), H, D, dtype=DTYPE, device=DEVICE)
    k = torch.zeros(sum(lengths) + 2 * CHUNK, HK, D, dtype=DTYPE, device=DEVICE)
    cu_q = torch.arange(len(lengths) + 1, dtype=torch.int32, device=DEVICE)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    cu_kv = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    limit = k.shape[0]
    described = []
    for exact in (True, False):
        call = testing.fused_call("thd", "padding_causal_bottom_right", None, 0.25, cu_seqlens_q=cu_q,
                                  cu_seqlens_kv=cu_kv, max_seqlen_q=1, max_seqlen_kv=max(lengths))
        chunk = kernel_runner.key_chunk(call.params, q, k, AttnBiasType.NO_BIAS, 0)
        bound = kernel_runner.max_seqlen_kv_bound(max(lengths), chunk, limit)
        if not exact:
            assert bound >= max(lengths)
            assert bound == limit if not chunk else (bound % chunk == 0 or bound in (1, limit))
            call = testing.fused_call("thd", "padding_causal_bottom_right", None, 0.25, cu_seqlens_q=cu_q,
                                      cu_seqlens_kv=cu_kv, max_seqlen_q=1, max_seqlen_kv=bound)
        with testing.recorded_launches(run=False) as recorded:
            kernel_runner.forward(q, k, k, call)
        described.append([launch.describe() for launch in recorded[0]])
    if max(lengths) > 1:
        assert max(lengths) != bound
    exact, bounded = ([(name, grid, tuple(a for a in args if a[0] != "seqlen_k"), options)
                       for name, grid, args, options in launches] for launches in described)
    assert exact == bounded
    assert [launch[0] for launch in described[0]] == [launch[0] for launch in described[1]]


def test_bound_rounds_within_the_chunk_and_keeps_one():
    assert kernel_runner.max_seqlen_kv_bound(1, 64, 512) == 1
    assert kernel_runner.max_seqlen_kv_bound(65, 64, 512) == 128
    assert kernel_runner.max_seqlen_kv_bound(128, 64, 512) == 128
    assert kernel_runner.max_seqlen_kv_bound(500, 64, 510) == 510  # at most the limit
    assert kernel_runner.max_seqlen_kv_bound(40, 0, 512) == 512  # one chunk: any bound launches alike


def _table_from_scratch(manager):
    table = torch.zeros_like(manager.page_table, device="cpu")
    for i, seq in enumerate(manager.sequences):
        pages = manager.allocated_pages[seq]
        table[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table


def test_page_table_updates_equal_the_table_built_from_scratch():
    """The page table changes on the device by the entries a step changes (new pages, rows that now list
    another sequence, rows left empty); after each step it equals the table built from the pages, and the
    step's table lists the step's sequences' pages in step order."""
    params = InferenceParams(4, 64, 1, 8, torch.float32, is_paged=True, page_size=4, total_num_pages=40,
                             device=DEVICE)
    random.Random(2).shuffle(params.cache_manager.free_pages)
    manager = params.cache_manager
    steps = [{"a": 5, "b": 2}, {"a": 1, "b": 1}, {"b": 3, "a": 1, "c": 9}, {"c": 1, "a": 4}, {"d": 2, "c": 3},
             {"c": 1, "d": 1, "e": 13, "f": 1}, {"f": 1, "e": 1}, {"g": 1}]
    for step in steps:
        params.pre_step(OrderedDict(step))
        assert torch.equal(manager.page_table.cpu(), _table_from_scratch(manager)), step
        layout = params._current().layout
        want = torch.zeros(len(step), manager.max_pages_per_seq, dtype=torch.int32)
        for i, seq in enumerate(step):
            pages = manager.allocated_pages[seq]
            want[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        assert torch.equal(manager.step_page_table(layout).cpu(), want), step
    params.reset()
    assert not manager.page_table.any()
    params.pre_step(OrderedDict([("h", 6)]))
    assert torch.equal(manager.page_table.cpu(), _table_from_scratch(manager))


def test_gathered_pages_are_packed_and_their_count_changes_rarely():
    """The gather's page index (made on the device from the step's table): the step's sequences' pages packed in
    step order, then page 0 up to a size that is at most 1/8 more and one of 8 per doubling."""
    params = InferenceParams(3, 64, 1, 8, torch.float32, is_paged=True, page_size=4, total_num_pages=48,
                             device=DEVICE)
    random.Random(4).shuffle(params.cache_manager.free_pages)
    manager = params.cache_manager
    for step in [{"a": 9, "b": 30}, {"b": 1, "a": 1}, {"c": 17, "a": 3}, {"a": 1, "c": 1}]:
        params.pre_step(OrderedDict(step))
        layout = params._current().layout
        index, starts = manager.gather_index(layout)
        packed = [p for seq in step for p in manager.allocated_pages[seq]]
        assert index.tolist() == packed + [0] * (len(index) - len(packed)), step
        assert len(index) == inference._gather_size(len(packed))
        assert starts == [4 * sum(len(manager.allocated_pages[s]) for s in list(step)[:i]) for i in range(len(step))]
    sizes = [inference._gather_size(n) for n in range(1, 4097)]
    assert all(n <= size <= max(n, n * 9 // 8) for n, size in zip(range(1, 4097), sizes))
    assert len(set(sizes)) <= 8 * 12 + 16


def test_step_tensors_are_te_s_after_each_step():
    """cu_seqlens_q / cu_seqlens_kv / the pre-step lengths keep TransformerEngine's meaning (max_batch_size
    + 1 entries, the last value repeated), one buffer updated per step."""
    params = InferenceParams(3, 32, 1, 8, torch.float32, device=DEVICE)
    params.allocate_memory(LAYER)
    held = params.cu_seqlens_kv
    params.pre_step(OrderedDict([(7, 4), (2, 3)]))
    params.pre_step(OrderedDict([(2, 1), (7, 2), (5, 6)]))
    assert params.cu_seqlens_q.tolist() == [0, 1, 3, 9]
    assert params.cu_seqlens_kv.tolist() == [0, 4, 10, 16] and held.tolist() == [0, 4, 10, 16]
    assert params.get_seqlens_pre_step().tolist() == [3, 4, 0]
    params.pre_step(OrderedDict([(5, 1)]))
    assert params.cu_seqlens_q.tolist() == [0, 1, 1, 1] and params.pre_step_seqlens.tolist() == [6, 0, 0]


def _host_state(params):
    """Everything a step leaves for the layers and the next step, as plain values."""
    step, manager = params._current(), params.cache_manager
    layout = step.layout
    state = dict(sequences=list(params.sequences.items()), seq_ids=layout.seq_ids, step_lens=layout.step_lens,
                 cached_lens=layout.cached_lens, total_lens=layout.total_lens, max_total_len=layout.max_total_len,
                 rows=step.rows.tolist(), cu_q=step.cu_seqlens_q.tolist(), cu_kv=step.cu_seqlens_kv.tolist(),
                 te=(params.cu_seqlens_q.tolist(), params.cu_seqlens_kv.tolist(), params.pre_step_seqlens.tolist()))
    if step.decode is not None:
        views = step.decode
        state.update(decode_lens=views.lens_kv.tolist(), decode_rows=views.rows.tolist())
    if params.is_paged:
        state.update(free=list(manager.free_pages), pages={s: list(p) for s, p in manager.allocated_pages.items()},
                     table=manager.page_table.tolist(), step_table=manager.step_page_table(layout).tolist())
    else:
        state.update(slots=dict(manager.slots), starts=list(manager._host_starts(layout)))
    return state


@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_continued_decode_steps_leave_the_state_of_steps_decided_afresh(paged):
    """pre_step continues a decode step of the last decode step's sequences (same order, one int 1 each) from
    that step's arrays instead of deciding it afresh; after every step (pages taken as sequences fill theirs,
    sequences finishing and joining, the free list reordered in place, a reordered OrderedDict, a plain dict,
    refused counts) the state equals that of a second cache whose every step is decided afresh."""
    def make():
        params = InferenceParams(4, 96, 1, 8, torch.float32, is_paged=paged, page_size=4 if paged else None,
                                 total_num_pages=80 if paged else None, device=DEVICE)
        if paged:
            random.Random(3).shuffle(params.cache_manager.free_pages)
        params.allocate_memory(LAYER)
        return params

    continued, afresh = make(), make()
    decode = lambda *seqs: OrderedDict((s, 1) for s in seqs)  # noqa: E731
    steps = ([OrderedDict([(0, 5), (1, 3), (2, 8)])] + [decode(0, 1, 2)] * 11 + [decode(0, 2)] * 6
             + [OrderedDict([(0, 1), (2, 1), (3, 2)])] + [decode(0, 2, 3)] * 9 + ["shuffle"] + [decode(0, 2, 3)] * 5
             + [decode(2, 0, 3)] * 3 + [dict(decode(2, 0, 3))] * 3 + ["move"] + [decode(3, 2, 0)] * 2)
    for i, step in enumerate(steps):
        if step == "shuffle":  # the free list, reordered in place through the attribute
            if paged:
                for params in (continued, afresh):
                    random.Random(i).shuffle(params.cache_manager.free_pages)
            continue
        if step == "move":  # an OrderedDict whose order changed by move_to_end after it was built
            step = decode(2, 3, 0)
            step.move_to_end(2)
            assert list(step) == [3, 0, 2]
        continued.pre_step(step)
        afresh._chain = None  # decided afresh
        afresh.pre_step(step)
        assert _host_state(continued) == _host_state(afresh), (i, step)
        if i in (14, 30):  # counts that are 1 but not the int 1: refused like any step's, changing nothing
            before = _host_state(continued)
            for bad in (True, 1.0):
                with pytest.raises(ValueError, match="positive int token counts"):
                    continued.pre_step(OrderedDict((s, bad) for s in continued.sequences))
            assert _host_state(continued) == before
    assert continued._chain is not None  # the last steps were continued
