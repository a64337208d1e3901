"""A decode step traced once per batch size: torch.compile(fullgraph=True) without a graph break or a recompile
over many steps (non-paged and paged caches, growing lengths, sequences finishing and others joining), and the
rows bitwise the eager step's and the training forward's.

A decode step (every sequence one new token) reads its metadata from the step buffers' views
(``inference._DecodeViews``): the same tensors at every step of a batch size, lengths on the device. The static
form of the call (``max_seqlen_kv`` = the cache's capacity, a gather of every page of the step table's rows) is
what a traced or captured step runs; ``inference._capturing`` is patched here to run it eagerly on the CPU.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from dpa_helpers import DEVICE, LOWP_DTYPES, gen, requires_fused
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import inference
from transformer_engine.pytorch.attention.inference import InferenceParams

H, HK, D = 4, 2, 16
MAX_SEQLEN, PAGE = 64, 8


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    for name in ("NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _schedule(steps: int, batch: int, lengths):
    """``steps`` decode steps of ``batch`` sequences: sequence i decodes ``lengths[i % len(lengths)]`` tokens, then
    finishes and the next sequence joins in its place (with its first token: a decode step too). Returns the
    steps' step_dicts (a step lists its sequences in a rotating order, not the cache's) and every sequence's
    length."""
    live, done, total, out = list(range(batch)), {}, {}, []
    nxt = batch
    for t in range(steps):
        for j, seq in enumerate(live):
            if total.get(seq, 0) == lengths[seq % len(lengths)]:
                done[seq] = total.pop(seq)
                live[j] = nxt
                nxt += 1
        r = t % batch
        order = live[r:] + live[:r]
        out.append(OrderedDict((seq, 1) for seq in order))
        for seq in order:
            total[seq] = total.get(seq, 0) + 1
    done.update(total)
    return out, done


def _tokens(lengths, dtype, seed):
    g = gen(seed)
    return {seq: [torch.randn(n, heads, D, generator=g).to(DEVICE, dtype) for heads in (H, HK, HK)]
            for seq, n in lengths.items()}


def _decode(fn, params, steps, tokens, fmt):
    """Run the steps through ``fn`` (the module, compiled or not); returns each sequence's output rows."""
    pos, rows = {}, {seq: [] for seq in tokens}
    with torch.no_grad():
        for step in steps:
            params.pre_step(step)
            qkv = [torch.stack([tokens[seq][j][pos.get(seq, 0)] for seq in step]) for j in range(3)]
            qkv = [t.unsqueeze(1) if fmt == "bshd" else t for t in qkv]  # [b, 1, h, d] or thd [b, h, d]
            out = fn(*qkv, qkv_format=fmt, inference_params=params)
            out = out.reshape(len(step), -1)
            for i, seq in enumerate(step):
                rows[seq].append(out[i])
                pos[seq] = pos.get(seq, 0) + 1
    return {seq: torch.stack(r) for seq, r in rows.items() if r}


def _params(paged, dtype, batch=4):
    params = InferenceParams(batch, MAX_SEQLEN, HK, D, dtype, device=DEVICE, is_paged=paged,
                             page_size=PAGE if paged else None)
    params.allocate_memory(1)
    return params


def _training(dpa, tokens, seqs):
    """Each sequence's rows from the training forward (bshd, causal, the whole sequence at once)."""
    with torch.no_grad():
        return {seq: dpa(*(t[:n].unsqueeze(0) for t in tokens[seq]), qkv_format="bshd",
                         attn_mask_type="causal")[0] for seq, n in seqs.items()}


@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_decode_steps_compile_once_and_equal_eager_and_training(monkeypatch, paged):
    """100 decode steps of 3 sequences (finishing after 9-40 tokens, others joining in their slots or pages) compile
    once, fullgraph, with no recompile; every row equals the eager step's and the training forward's bitwise."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    dtype = torch.float32
    steps, lengths = _schedule(100, 3, (40, 9, 23, 14))
    tokens = _tokens(lengths, dtype, seed=0)
    dpa = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="bshd", attn_mask_type="causal",
                              layer_number=1).to(DEVICE).eval()
    counter = CompileCounter()
    compiled = torch.compile(dpa, fullgraph=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _decode(compiled, _params(paged, dtype), steps, tokens, "bshd")
    assert counter.frame_count == 1
    eager = _decode(dpa, _params(paged, dtype), steps, tokens, "bshd")
    train = _training(dpa, tokens, {seq: r.shape[0] for seq, r in got.items()})
    for seq in got:
        assert torch.equal(got[seq], eager[seq]), f"sequence {seq}: compiled rows differ from eager's"
        assert torch.equal(got[seq], train[seq]), f"sequence {seq}: compiled rows differ from the training forward's"


def test_decode_step_buffers_keep_their_addresses():
    """Every decode step of a batch size reads the same metadata tensors (a captured step's addresses), and
    pre_step rewrites them in place."""
    params = _params(True, torch.float32)
    seen = []
    for step in _schedule(12, 3, (5, 7))[0]:
        params.pre_step(step)
        views = params._step.decode
        seen.append(tuple(t.data_ptr() for t in (views.cu_seqlens_q, views.cu_seqlens_kv, views.rows, views.table)))
        lens = [params.cache_manager.sequences[seq] for seq in step]
        assert views.cu_seqlens_kv.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
        pages = [params.cache_manager.get_page_list(seq) for seq in step]
        assert [row[:len(p)] for row, p in zip(views.table.tolist(), pages)] == pages
    assert len(set(seen)) == 1


@requires_fused
@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_fused_static_decode_equals_eager_and_training(monkeypatch, paged):
    """The fused backend's static decode call (what a captured or traced step runs: max_seqlen_kv the cache's
    capacity, paged through the step's page table), eager and compiled, gives the eager step's rows and the
    training forward's, bitwise."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    dtype = LOWP_DTYPES[0]
    steps, lengths = _schedule(6, 2, (4, 3))
    tokens = _tokens(lengths, dtype, seed=1)
    dpa = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="thd", attn_mask_type="padding_causal",
                              layer_number=1).to(DEVICE).eval()
    eager = _decode(dpa, _params(paged, dtype), steps, tokens, "thd")
    monkeypatch.setattr(inference, "_capturing", lambda: True)
    static = _decode(dpa, _params(paged, dtype), steps, tokens, "thd")
    counter = CompileCounter()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _decode(torch.compile(dpa, fullgraph=True, backend=counter), _params(paged, dtype), steps,
                           tokens, "thd")
    assert counter.frame_count == 1
    train = _training(dpa, tokens, {seq: r.shape[0] for seq, r in eager.items()})
    for seq in eager:
        assert torch.equal(static[seq], eager[seq]), f"sequence {seq}: the static call's rows differ from eager's"
        assert torch.equal(compiled[seq], eager[seq]), f"sequence {seq}: compiled rows differ from eager's"
        assert torch.equal(eager[seq], train[seq]), f"sequence {seq}: rows differ from the training forward's"
