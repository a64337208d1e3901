"""KV cache (InferenceParams): prefill, chunked prefill and decode rows are bitwise the training forward's rows.

For random sequences the training forward (DotProductAttention over whole sequences, causal) gives each token's
output row; a simulated serving loop then feeds the same sequences through ``inference_params`` in steps (token
by token, chunks of 7, the whole prompt at once; sequences arriving while others decode, a finished sequence's
slot or pages reused by a later one) and every row must be ``torch.equal`` to the training row: paged caches with
shuffled pages and non-paged ones, bshd/sbhd/thd step inputs, GQA/MQA, causal and sliding-window masks, sink
softmax. The fused kernels run under Triton's interpreter here (and compiled on a GPU, where decode steps launch
the forward kernel's ``length_generic`` twin); the unfused backend runs on CPU without it.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from dpa_helpers import DEVICE, ON_GPU, assert_close_to_reference, reference, requires_fused
from transformer_engine.pytorch import DotProductAttention
from te_torch_testing import recorded_launches
from transformer_engine.pytorch.attention.inference import InferenceParams, active_step_runner, step_runner

LAYER = 3
# Token counts: more than one interpreter tile (16) for the long one, one shorter than a chunk; on a GPU long
# enough to span several 64/128-token key blocks.
LENGTHS = (29, 18, 5, 11) if not ON_GPU else (300, 141, 5, 77)
MAX_SEQLEN = 32 if not ON_GPU else 320


def _sequences(lengths, h, hk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, heads, d, generator=g).to(DEVICE, dtype) for heads in (h, hk, hk)) for n in lengths]


def _training_rows(dpa, seqs):
    """Each sequence's output rows from the training forward: alone (bshd, causal), and packed all together
    (thd, padding_causal); the two must agree (batch and packing invariance), and are returned."""
    alone = [dpa(*(t.unsqueeze(0) for t in s), qkv_format="bshd", attn_mask_type="causal")[0] for s in seqs]
    lens = [s[0].shape[0] for s in seqs]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=DEVICE)
    packed = dpa(*(torch.cat([s[j] for s in seqs]) for j in range(3)), qkv_format="thd",
                 attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                 max_seqlen_kv=max(lens))
    for i, rows in enumerate(alone):
        assert torch.equal(packed[cu[i]:cu[i + 1]], rows), f"training rows of sequence {i} depend on the batch"
    return alone


def _step_tensors(seqs, step, pos, fmt, dtype):
    """The step's new q, k, v in ``fmt``: thd packed in step order; bshd/sbhd padded with NaN (never read)."""
    if fmt == "thd":
        return [torch.cat([seqs[i][j][pos[i]:pos[i] + n] for i, n in step.items()]) for j in range(3)]
    width = max(step.values())
    out = []
    for j in range(3):
        x = torch.full((len(step), width) + tuple(seqs[0][j].shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
        for b, (i, n) in enumerate(step.items()):
            x[b, :n] = seqs[i][j][pos[i]:pos[i] + n]
        out.append(x.transpose(0, 1).contiguous() if fmt == "sbhd" else x)
    return out


def _serve(dpa, params, seqs, chunks, arrivals, fmt, dtype):
    """Run the sequences through the cache: sequence i joins at step ``arrivals[i]`` and brings ``chunks[i]``
    tokens per step (its prompt in chunks, then one token each step is decoding's pattern when chunk = 1).
    Steps list sequences newest first, so the step order differs from the cache's slot order. Returns each
    sequence's output rows and the number of steps."""
    lens = [s[0].shape[0] for s in seqs]
    pos, rows, t = [0] * len(seqs), [[] for _ in seqs], 0
    while any(p < n for p, n in zip(pos, lens)):
        step = OrderedDict((i, min(chunks[i], lens[i] - pos[i])) for i in reversed(range(len(seqs)))
                           if arrivals[i] <= t and pos[i] < lens[i])
        t += 1
        if not step:
            continue
        params.pre_step(step)
        out = dpa(*_step_tensors(seqs, step, pos, fmt, dtype), qkv_format=fmt, inference_params=params)
        first = 0
        for b, (i, n) in enumerate(step.items()):
            if fmt == "thd":
                got = out[first:first + n]
                first += n
            else:
                got = out[b, :n] if fmt == "bshd" else out[:n, b]
                width = out.shape[1] if fmt == "bshd" else out.shape[0]
                pad = out[b, n:] if fmt == "bshd" else out[n:, b]
                assert pad.shape[0] == width - n and not pad.any(), "rows past a sequence's new tokens must be zero"
            rows[i].append(got)
            pos[i] += n
    return [torch.cat(r) for r in rows], t


def _params(hk, d, dtype, paged, batch=3, seed=0):
    params = InferenceParams(batch, MAX_SEQLEN, hk, d, dtype, is_paged=paged, page_size=8 if paged else None,
                             total_num_pages=batch * MAX_SEQLEN // 8 if paged else None)
    if paged:  # pages handed out in a random order: a sequence's pages are scattered over the cache
        random.Random(seed).shuffle(params.cache_manager.free_pages)
    params.allocate_memory(LAYER)
    return params


# (dtype, heads, kv heads, window, softmax, paged, step format, chunk per sequence, arrival step per sequence)
# Three sequences fill the cache (max_batch_size=3); the fourth arrives after the shortest finished and takes
# its slot or pages, whose stale tokens must not leak in.
SCENARIOS = {
    "fp16_gqa_paged_thd": (torch.float16, 4, 2, None, "vanilla", True, "thd", (1, 7, 100, 1), (0, 2, 1, 8)),
    "fp32_mqa_window_bshd": (torch.float32, 2, 1, (5, 0), "vanilla", False, "bshd", (100, 1, 7, 7), (0, 0, 3, 7)),
    "fp16_sink_window_paged_sbhd": (torch.float16, 2, 2, (19, 0), "learnable", True, "sbhd", (7, 100, 1, 1),
                                    (1, 0, 0, 6)),
}


@requires_fused
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fused_prefill_and_decode_rows_equal_training_rows(name, monkeypatch):
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")  # our kernels (flash-attn-4 makes no such promise)
    dtype, h, hk, window, softmax, paged, fmt, chunks, arrivals = SCENARIOS[name]
    d = 16 if not ON_GPU else 128
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd", attn_mask_type="causal",
                              window_size=window, softmax_type=softmax, layer_number=LAYER).to(DEVICE).eval()
    if softmax == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.linspace(-1.0, 1.5, h))
    seqs = _sequences(LENGTHS, h, hk, d, dtype, seed=len(name))
    expected = _training_rows(dpa, seqs)
    assert dpa.last_backend == "FusedAttention"
    got, steps = _serve(dpa, _params(hk, d, dtype, paged), seqs, chunks, arrivals, fmt, dtype)
    # The loop decoded token by token for a while: at least as many steps as the longest one-token sequence.
    assert steps >= max(n for n, c in zip(LENGTHS, chunks) if c == 1)
    for i, (g, e) in enumerate(zip(got, expected)):
        bad = (g != e).flatten(1).any(1).nonzero().flatten().tolist()
        assert not bad, f"sequence {i}: rows {bad} differ from the training rows, by up to " \
                        f"{(g.float() - e.float()).abs().max().item()}"
    if softmax == "vanilla":  # accuracy of what both compute (sink softmax: tests/pytorch/test_sink_softmax.py)
        q, k, v = (t.unsqueeze(0) for t in seqs[0])
        ref, lowp = (reference(q, k, v, "causal", window if window is not None else (-1, 0), dtype=dt)[0].flatten(-2)
                     for dt in (torch.float64, dtype))
        assert_close_to_reference("sequence 0", got[0], ref, lowp)


@requires_fused
def test_decode_launches_the_length_generic_forward(monkeypatch):
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    """A decode step (one new token per sequence) launches the forward kernel's ``length_generic`` twin, a
    prefill the length-specialized kernel; both give the training rows (the test above, compiled on a GPU)."""
    from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel

    dtype, h, hk, d = torch.float32, 2, 1, 16  # fp32: the Triton kernel also on Hopper (no Gluon fp32 kernel)
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="thd", layer_number=LAYER).to(DEVICE).eval()
    q, k, v = _sequences([9], h, hk, d, dtype, seed=1)[0]
    params = _params(hk, d, dtype, paged=False)
    with recorded_launches() as recorded:
        params.pre_step(OrderedDict([(0, 8)]))
        prefill = dpa(q[:8], k[:8], v[:8], inference_params=params)
        params.pre_step(OrderedDict([(0, 1)]))
        decode = dpa(q[8:], k[8:], v[8:], inference_params=params)
    assert [[x.kernel for x in described] for described in recorded] == [[attn_fwd_kernel],
                                                                          [attn_fwd_kernel.length_generic]]
    cu = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    training = dpa(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert torch.equal(torch.cat([prefill, decode]), training)


@requires_fused
@pytest.mark.parametrize("mask", ["padding_causal", "padding"])
def test_alibi_and_non_causal_steps_equal_training_rows(mask, monkeypatch):
    """ALiBi's distances are between absolute positions, which the step's bottom-right alignment keeps: causal
    chunks give the training rows. Without a causal mask a step's queries see every cached key, so the rows of
    a step that ends a sequence (a whole-prompt prefill, a last decoded token) are its training rows."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    dtype, h, n = torch.float32, 2, 21
    dpa = DotProductAttention(h, 16, qkv_format="thd", attn_mask_type=mask, layer_number=LAYER).to(DEVICE).eval()
    q, k, v = _sequences([n], h, h, 16, dtype, seed=3)[0]
    bias = dict(core_attention_bias_type="alibi")

    def training(length):
        cu = torch.tensor([0, length], dtype=torch.int32, device=DEVICE)
        return dpa(q[:length], k[:length], v[:length], cu_seqlens_q=cu, cu_seqlens_kv=cu, **bias)

    params, pos, rows = _params(h, 16, dtype, paged=True), 0, []
    for size in ((7, 7, 6, 1) if mask == "padding_causal" else (n - 1, 1)):
        params.pre_step(OrderedDict([(5, size)]))
        rows.append(dpa(q[pos:pos + size], k[pos:pos + size], v[pos:pos + size], inference_params=params, **bias))
        pos += size
    if mask == "padding_causal":
        got, want = torch.cat(rows), training(n)
        assert torch.equal(got, want), f"rows {(got != want).any(1).nonzero().flatten().tolist()} differ"
    else:
        assert torch.equal(rows[0], training(n - 1)) and torch.equal(rows[1], training(n)[-1:])
        assert not torch.equal(rows[0][-1], training(n)[-2])  # the prompt's rows did not see the last key


def test_unfused_prefill_and_decode_rows_equal_its_training_rows(monkeypatch):
    """The unfused backend (CPU's default without the interpreter) keeps the invariance too: its fixed block
    products and trailing-zero-invariant sums give each row the bits of its own training forward."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    for dtype, hk, window, paged, fmt in ((torch.float32, 1, None, True, "bshd"), (torch.float16, 2, (5, 0), False,
                                                                                    "thd")):
        dpa = DotProductAttention(4, 16, num_gqa_groups=hk, qkv_format="bshd", attn_mask_type="padding_causal",
                                  window_size=window, layer_number=LAYER).to(DEVICE).eval()
        seqs = _sequences((29, 18, 5, 11), 4, hk, 16, dtype, seed=7)
        expected = _training_rows(dpa, seqs)
        assert dpa.last_backend == "UnfusedDotProductAttention"
        got, _ = _serve(dpa, _params(hk, 16, dtype, paged), seqs, (1, 7, 100, 1), (0, 1, 0, 6), fmt, dtype)
        assert dpa.last_backend == "UnfusedDotProductAttention"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert torch.equal(g, e), f"{dtype} sequence {i}: {(g.float() - e.float()).abs().max().item()} off"


# -- the API's bookkeeping (no attention) ------------------------------------------------------------------


def test_steps_track_lengths_pages_and_te_return_values():
    params = InferenceParams(2, 16, 1, 4, torch.float32, is_paged=True, page_size=4, total_num_pages=6,
                             qkv_format="thd", device=DEVICE)
    params.allocate_memory(1)
    params.pre_step(OrderedDict([("a", 5), ("b", 2)]))
    assert params.sequences == OrderedDict([("a", 5), ("b", 2)]) and params.batch_size == 2
    assert params.get_seqlens_pre_step().tolist() == [0, 0]
    assert params.cu_seqlens_q.tolist() == [0, 5, 7] and params.cu_seqlens_kv.tolist() == [0, 5, 7]
    manager = params.cache_manager
    assert manager.get_page_list("a") == [0, 1] and manager.get_page_list("b") == [2]
    k = torch.arange(7 * 4, dtype=torch.float32, device=DEVICE).view(7, 1, 4)
    k_cache, v_cache, cu_q, cu_kv, max_len, out_fmt = params.step(1, k, -k, "thd")
    assert (k_cache.shape, max_len, out_fmt) == ((6, 4, 1, 4), 16, "thd_2bshd")
    dense_k, dense_v = params.convert_paged_to_nonpaged(1)
    assert torch.equal(dense_k[0, :5], k[:5]) and torch.equal(dense_k[1, :2], k[5:]) and torch.equal(dense_v, -dense_k)
    # "b" finishes (left out: its page goes to the back of the free list); "c" starts with two pages, then "a"
    # grows into a third; the page table lists the cached sequences, "a" first (cached before "c").
    params.pre_step(OrderedDict([("c", 5), ("a", 4)]))
    assert params.get_seqlens_pre_step().tolist() == [0, 5]
    assert params.cu_seqlens_q.tolist() == [0, 5, 9] and params.cu_seqlens_kv.tolist() == [0, 5, 14]
    assert manager.get_page_list("c") == [3, 4] and manager.get_page_list("a") == [0, 1, 5]
    assert manager.free_pages == [2]
    assert manager.page_table.tolist() == [[0, 1, 5, 0], [3, 4, 0, 0]]
    params.reset()
    assert not params.sequences and sorted(manager.free_pages) == list(range(6)) and not manager.page_table.any()


def _dpa(**kwargs):
    return DotProductAttention(2, 8, num_gqa_groups=1, qkv_format="thd", **kwargs).to(DEVICE).eval()


def _tokens(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, heads, 8, generator=g).to(DEVICE, dtype) for heads in (2, 1, 1)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batch_size=0), "`max_batch_size` must be a positive int"),
    (dict(num_heads_kv=None), "`num_heads_kv` must be a positive int"),
    (dict(dtype="float16"), "`dtype` must be a floating-point torch.dtype"),
    (dict(is_paged=True), "`page_size` must be a positive int"),
    (dict(is_paged=True, page_size=3), "`page_size` must divide max_sequence_length=8"),
    (dict(max_ctx_len=9), "`max_ctx_len` must be at most max_sequence_length=8"),
    (dict(qkv_format="bhsd"), "`qkv_format` must be one of"),
    (dict(custom_cache_manager=dict), "`custom_cache_manager` must be a KVCacheManager subclass"),
])
def test_bad_constructor_arguments_name_the_argument(kwargs, match):
    base = dict(max_batch_size=2, max_sequence_length=8, num_heads_kv=1, head_dim_k=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        InferenceParams(**{**base, **kwargs})


def test_bad_steps_name_the_argument_and_change_nothing():
    params = InferenceParams(2, 8, 1, 8, torch.float32, is_paged=True, page_size=4, total_num_pages=3,
                             max_ctx_len=6, device=DEVICE)
    params.allocate_memory(LAYER)
    with pytest.raises(ValueError, match="`step_dict` must be a non-empty mapping"):
        params.pre_step([(0, 1)])
    with pytest.raises(ValueError, match="`step_dict` must map sequence ids to positive int token counts"):
        params.pre_step(OrderedDict([(0, 0)]))
    with pytest.raises(ValueError, match="at most max_batch_size=2"):
        params.pre_step(OrderedDict([(0, 1), (1, 1), (2, 1)]))
    with pytest.raises(ValueError, match="more than max_ctx_len=6"):
        params.pre_step(OrderedDict([(0, 7)]))
    params.pre_step(OrderedDict([(0, 6)]))
    with pytest.raises(ValueError, match="would grow sequence 0 to 9 tokens, more than max_sequence_length=8"):
        params.pre_step(OrderedDict([(0, 3)]))
    with pytest.raises(ValueError, match=r"`step_dict` needs 2 more pages .* 1 of `total_num_pages`=3 are free"):
        params.pre_step(OrderedDict([(0, 1), (1, 5)]))
    assert params.sequences == OrderedDict([(0, 6)])  # the refused steps changed nothing
    assert params.cache_manager.get_page_list(0) == [0, 1] and params.cache_manager.free_pages == [2]
    params.pre_step(OrderedDict([(0, 1), (1, 4)]))  # fits: sequence 0 stays in its two pages
    assert params.sequences == OrderedDict([(0, 7), (1, 4)])


def test_bad_forward_inputs_name_the_argument():
    params = InferenceParams(2, 16, 1, 8, torch.float32, device=DEVICE)
    q, k, v = _tokens(3)
    params.allocate_memory(LAYER)
    with pytest.raises(ValueError, match="call pre_step"):
        _dpa(layer_number=LAYER)(q, k, v, inference_params=params)
    params.pre_step(OrderedDict([(0, 2), (1, 1)]))
    with pytest.raises(ValueError, match="`layer_number` must be set on DotProductAttention"):
        _dpa()(q, k, v, inference_params=params)
    with pytest.raises(ValueError, match=r"`layer_number` 4 has no KV cache \(allocated: \[3\]\)"):
        _dpa(layer_number=4)(q, k, v, inference_params=params)
    with pytest.raises(ValueError, match="`key_layer` must have the KV cache's dtype torch.float32"):
        _dpa(layer_number=LAYER)(*_tokens(3, torch.float16), inference_params=params)
    with pytest.raises(ValueError, match=r"`query_layer` must hold the step's 3 new tokens"):
        _dpa(layer_number=LAYER)(q[:2], k[:2], v[:2], inference_params=params)
    with pytest.raises(ValueError, match=r"`key_layer` must hold the step's 3 new tokens"):
        _dpa(layer_number=LAYER)(q, k[:2], v[:2], inference_params=params)
    with pytest.raises(ValueError, match=r"`query_layer` must be \[b, s, h, d\] \(bshd\) with b = 2 sequences"):
        # tokens of three sequences where pre_step declared two
        _dpa(layer_number=LAYER)(*(t.view(3, 1, *t.shape[1:]) for t in (q, k, v)), qkv_format="bshd",
                                 inference_params=params)
    with pytest.raises(ValueError, match=r"`cu_seqlens_q` must give the step's new token counts \(step_dict\)"):
        cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
        _dpa(layer_number=LAYER)(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, inference_params=params)
    with pytest.raises(ValueError, match="`inference_params` must be an InferenceParams"):
        _dpa(layer_number=LAYER)(q, k, v, inference_params=object())
    with pytest.raises(NotImplementedError, match="attn_mask_type='arbitrary' with `inference_params`"):
        _dpa(layer_number=LAYER, attn_mask_type="arbitrary")(q, k, v, inference_params=params)
    # None of the refused calls appended tokens; a good one does, once per step.
    assert not params._current().stepped
    cu = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    _dpa(layer_number=LAYER, attn_mask_type="padding_causal")(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                              inference_params=params)
    with pytest.raises(ValueError, match="`layer_number` 3 already appended this step's tokens"):
        _dpa(layer_number=LAYER)(q, k, v, inference_params=params)


# -- how a step reaches its backend ---------------------------------------------------------------------------


class _CountingRunner:
    """A step runner (inference.step_runner) that records the backends it runs and runs them as a plain call."""

    def __init__(self):
        self.backends = []

    def run(self, backend, q, k, v, call):
        self.backends.append(backend.NAME)
        return backend.run(q, k, v, call)


def test_step_runner_runs_each_call_inside_its_block():
    """Inside ``step_runner(r)`` a DotProductAttention call runs its selected backend through ``r.run``, on the
    full path and on its signature's prepared path alike (a checkpointed call's recomputation in the backward,
    outside the block, too); outside the block, and after a call in it raised, the backend runs as built."""
    from transformer_engine.pytorch.attention import signature_cache

    signature_cache.clear_all()
    (prepared,) = [c for c in signature_cache.caches() if c.name == "DotProductAttention"]
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal").to(DEVICE)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g).to(DEVICE) for _ in range(3))
    runner = _CountingRunner()
    with step_runner(runner):
        assert active_step_runner() is runner
        with torch.no_grad():
            first, second = dpa(q, k, v), dpa(q, k, v)
    assert (prepared.misses, prepared.hits) == (1, 1) and active_step_runner() is None
    assert runner.backends == [dpa.last_backend] * 2
    with torch.no_grad():
        plain = dpa(q, k, v)
    assert len(runner.backends) == 2
    assert torch.equal(first, plain) and torch.equal(second, plain)

    q.requires_grad_(True)
    with step_runner(runner):
        out = dpa(q, k, v, checkpoint_core_attention=True)
    out.sum().backward()  # the recomputation runs through the runner read by the forward
    assert len(runner.backends) == 4 and q.grad is not None
    with pytest.raises(ValueError, match="`query_layer` must have 2 heads"):
        with step_runner(runner):
            dpa(q[:, :, :1], k, v)
    assert active_step_runner() is None


class _WrappedAttention(DotProductAttention):
    """A subclass whose forward has another signature and calls the base class's (as Megatron's
    TEDotProductAttention does)."""

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, inference_params=None):
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               inference_params=inference_params)


@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_a_subclass_wrapping_forward_runs_steps_as_the_base_class(paged, monkeypatch):
    """A step runs its packed call through ``DotProductAttention.forward``, not the instance's override: a
    subclass with another forward signature gives the base class's rows bitwise (prefill, then decode steps,
    which keep and reuse their kernel call on the fused backend)."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    seqs = _sequences((6, 5), 2, 1, 8, torch.float16, seed=5)
    rows = []
    for cls in (DotProductAttention, _WrappedAttention):
        torch.manual_seed(0)
        dpa = cls(2, 8, num_gqa_groups=1, qkv_format="bshd", attn_mask_type="causal",
                  layer_number=LAYER).to(DEVICE).eval()
        params = _params(1, 8, torch.float16, paged, batch=2)
        pos, out = [0, 0], []
        with torch.no_grad():
            for step in [OrderedDict([(0, 3), (1, 2)])] + [OrderedDict([(0, 1), (1, 1)])] * 3:
                params.pre_step(step)
                q, k, v = _step_tensors(seqs, step, pos, "bshd", torch.float16)
                out.append(dpa(q, k, v, inference_params=params))
                for i, n in step.items():
                    pos[i] += n
        rows.append(out)
    for i, (a, b) in enumerate(zip(*rows)):
        assert torch.equal(a, b), f"step {i}: the subclass's rows differ from the base class's"
