"""torch.compile over modules using DotProductAttention: no graph breaks, eager's results.

The attention call traces whole: backend selection runs while tracing (dynamo guards on
``torch.use_deterministic_algorithms``), the unfused path is plain PyTorch, and the fused path is
a pair of torch.library custom ops with fake implementations. Fused cases need a GPU or
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import sys

import pytest
from case_grid import grid
import torch

from dpa_helpers import (DEVICE, INTERPRET, LOWP_DTYPES, SelectionSpy, cu_seqlens, deterministic_algorithms, gen,
                         requires_fused)
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLM


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    for name in ("NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(torch.nn.Module):
    """Projection -> DotProductAttention (GQA, causal) -> projection."""

    def __init__(self, fmt="bshd", heads=4, groups=2, d=16, mask="causal", softmax_type="vanilla"):
        super().__init__()
        self.h, self.g, self.d, self.fmt = heads, groups, d, fmt
        self.qkv = torch.nn.Linear(heads * d, (heads + 2 * groups) * d)
        self.attn = DotProductAttention(heads, d, num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask,
                                        softmax_type=softmax_type)
        self.out = torch.nn.Linear(heads * d, heads * d)

    def forward(self, x, **attn_kwargs):
        q, k, v = self.qkv(x).split([self.h * self.d, self.g * self.d, self.g * self.d], dim=-1)
        q = q.unflatten(-1, (self.h, self.d))
        k = k.unflatten(-1, (self.g, self.d))
        v = v.unflatten(-1, (self.g, self.d))
        return self.out(self.attn(q, k, v, **attn_kwargs))


def _eager_and_compiled(module, inputs, backend="inductor", dynamic=None, **kwargs):
    """(out, grads) eager, then compiled with fullgraph=True, from the same parameters and inputs."""
    results = []
    for fn in (module, torch.compile(module, fullgraph=True, backend=backend, dynamic=dynamic)):
        x = inputs.detach().clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        out = fn(x, **kwargs)
        out.float().square().sum().backward()
        grads = [x.grad] + [p.grad for p in module.parameters()]
        results.append((out.detach(), [g.detach().clone() for g in grads]))
    return results


def _assert_same(eager, compiled, exact=False, atol=1e-5, rtol=1e-4):
    (out_e, grads_e), (out_c, grads_c) = eager, compiled
    check = torch.equal if exact else (lambda a, b: torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol))
    assert check(out_e, out_c), (out_e - out_c).abs().max()
    for a, b in zip(grads_e, grads_c):
        assert check(a, b), (a.float() - b.float()).abs().max()


def test_no_graph_breaks_in_attention(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    block = Block().to(DEVICE)
    x = torch.randn(2, 12, 64, generator=gen(0)).to(DEVICE)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_compiled_unfused_matches_eager(monkeypatch, fmt):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    torch.manual_seed(0)
    block = Block(fmt).to(DEVICE)
    x = torch.randn(2, 12, 64, generator=gen(1)).to(DEVICE)
    if fmt == "sbhd":
        x = x.transpose(0, 1).contiguous()
    eager, compiled = _eager_and_compiled(block, x)
    _assert_same(eager, compiled)
    assert block.attn.last_backend == "UnfusedDotProductAttention"


def test_compiled_padding_thd_and_dynamic_shapes(monkeypatch):
    """Padding masks (attention_mask and cu_seqlens), thd with max_seqlen, and two lengths with dynamic=True."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    torch.manual_seed(0)
    block = Block(mask="padding_causal").to(DEVICE)
    x = torch.randn(2, 10, 64, generator=gen(2)).to(DEVICE)
    pad = torch.arange(10, device=DEVICE)[None, :] >= torch.tensor([10, 6], device=DEVICE)[:, None]
    eager, compiled = _eager_and_compiled(block, x, backend="aot_eager", attention_mask=pad.view(2, 1, 1, 10))
    _assert_same(eager, compiled)

    thd = Block("thd", mask="padding_causal").to(DEVICE)
    cu = cu_seqlens([7, 3, 5])
    x = torch.randn(15, 64, generator=gen(3)).to(DEVICE)
    eager, compiled = _eager_and_compiled(thd, x, backend="aot_eager", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                          max_seqlen_q=7, max_seqlen_kv=7)
    _assert_same(eager, compiled)

    compiled_block = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    for s in (9, 13):
        y = torch.randn(2, s, 64, generator=gen(s)).to(DEVICE)
        torch.testing.assert_close(compiled_block(y), block(y), atol=1e-5, rtol=1e-4)


def test_compiled_model_trains_like_eager(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    cfg = TinyConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_gqa_groups=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen(4)).to(DEVICE)
    losses = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        model = TinyTransformerLM(cfg).to(DEVICE)
        fn = torch.compile(model.loss, fullgraph=True, backend="aot_eager") if compile_it else model.loss
        loss = fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    _assert_same(*losses)


def test_deterministic_flag_change_retraces(monkeypatch):
    """Dynamo guards on torch.use_deterministic_algorithms: toggling it reaches selection again."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    spy = SelectionSpy(monkeypatch)
    block = Block().to(DEVICE)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 8, 64, generator=gen(5)).to(DEVICE)
    with deterministic_algorithms(False):
        compiled(x)
        compiled(x)
        with deterministic_algorithms(True):
            compiled(x)
    assert [c.deterministic for c in spy.configs] == [False, True]


@requires_fused
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_compiled_fused_ops_trace_without_breaks(monkeypatch, fmt):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    dtype = LOWP_DTYPES[0]
    torch.manual_seed(0)
    mask = "causal" if fmt == "bshd" else "padding_causal"
    block = Block(fmt, mask=mask).to(DEVICE, dtype)
    kwargs = {}
    if fmt == "bshd":
        x = torch.randn(2, 16, 64, generator=gen(6)).to(DEVICE, dtype)
    else:
        cu = cu_seqlens([9, 4, 11])
        x = torch.randn(24, 64, generator=gen(6)).to(DEVICE, dtype)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=11, max_seqlen_kv=11)
    explanation = torch._dynamo.explain(block)(x, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager, compiled = _eager_and_compiled(block, x, backend="aot_eager", **kwargs)
    assert block.attn.last_backend == "FusedAttention"
    # The same kernels run in both: with aot_eager the surrounding ops are the same too.
    _assert_same(eager, compiled, exact=True)


@requires_fused
def test_compiled_fused_with_inductor(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    dtype = LOWP_DTYPES[0]
    torch.manual_seed(0)
    block = Block().to(DEVICE, dtype)
    x = torch.randn(2, 16, 64, generator=gen(7)).to(DEVICE, dtype)
    eager, compiled = _eager_and_compiled(block, x)
    _assert_same(eager, compiled, atol=2e-2, rtol=2e-2)


@requires_fused
def test_compiled_fused_same_cu_seqlens_for_q_and_kv(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    block = Block("thd", mask="padding_causal").to(DEVICE, LOWP_DTYPES[0])
    cu = cu_seqlens([9, 4, 11])
    x = torch.randn(24, 64, generator=gen(8)).to(DEVICE, LOWP_DTYPES[0])
    explanation = torch._dynamo.explain(block)(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11,
                                               max_seqlen_kv=11)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_sink_softmax_unfused_traces_whole(monkeypatch, softmax_type):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    torch.manual_seed(0)
    block = Block(softmax_type=softmax_type).to(DEVICE)
    if softmax_type == "learnable":  # off-by-one keeps its zero sink logit
        with torch.no_grad():
            block.attn.softmax_offset.copy_(torch.empty(block.attn.softmax_offset.shape).uniform_(-1, 1, generator=gen(9)))
    x = torch.randn(2, 12, 64, generator=gen(10)).to(DEVICE)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager, compiled = _eager_and_compiled(block, x, backend="aot_eager")
    _assert_same(eager, compiled)


@requires_fused
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_compiled_fused_learnable_sink_traces_without_breaks(monkeypatch, fmt):
    """The learnable sink's gradient comes out of the backward custom op: no breaks, eager's bits."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    dtype = LOWP_DTYPES[0]
    torch.manual_seed(0)
    block = Block(fmt, mask="causal" if fmt == "bshd" else "padding_causal", softmax_type="learnable").to(DEVICE, dtype)
    with torch.no_grad():
        block.attn.softmax_offset.copy_(torch.empty(block.attn.softmax_offset.shape).uniform_(-1, 1, generator=gen(11)))
    kwargs = {}
    if fmt == "bshd":
        x = torch.randn(2, 16, 64, generator=gen(12)).to(DEVICE, dtype)
    else:
        cu = cu_seqlens([9, 4, 11])
        x = torch.randn(24, 64, generator=gen(12)).to(DEVICE, dtype)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=11, max_seqlen_kv=11)
    explanation = torch._dynamo.explain(block)(x, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager, compiled = _eager_and_compiled(block, x, backend="aot_eager", **kwargs)
    assert block.attn.last_backend == "FusedAttention"
    assert eager[1][-3].abs().sum() > 0  # d softmax_offset (parameters: qkv, attn, out) is not zero
    _assert_same(eager, compiled, exact=True)


@requires_fused
def test_eager_calls_skip_the_op_dispatch_traced_ones_use_it(monkeypatch):
    """Eager fused calls run the ops' implementations directly (the op dispatch costs more host time than
    the launches); a compiled call runs the custom ops (which hold their own reference to the
    implementations), and both give the same bits."""
    from transformer_engine.pytorch.attention import ops

    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    calls = []  # (implementation, whether the custom op called it)
    for name in ("_forward", "_backward"):
        impl = getattr(ops, name)

        def spy(*args, _impl=impl, _name=name):
            calls.append((_name, sys._getframe(1).f_code.co_name in ("_forward_op", "_backward_op")))
            return _impl(*args)
        monkeypatch.setattr(ops, name, spy)
    torch.manual_seed(0)
    block = Block().to(DEVICE, LOWP_DTYPES[0])
    x = torch.randn(2, 16, 64, generator=gen(8)).to(DEVICE, LOWP_DTYPES[0])
    eager, compiled = _eager_and_compiled(block, x, backend="aot_eager")
    assert block.attn.last_backend == "FusedAttention"
    # The eager step's calls come directly, the compiled step's through the ops.
    assert calls == [("_forward", False), ("_backward", False), ("_forward", True), ("_backward", True)], calls
    _assert_same(eager, compiled, exact=True)


def test_fake_tensors_take_the_op_and_launch_nothing():
    """Fake tensors (tracing outside torch.compile) must reach the ops' fake implementations."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from transformer_engine.pytorch.attention import ops
    from transformer_engine.pytorch.attention.call import fused_call

    call = fused_call("bshd", "causal", (-1, 0), 0.25)
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 32, 4, 16, dtype=torch.float16, device=DEVICE) for _ in range(3))
        assert not ops._eager(q, k, v)
        out, lse, max_logit = ops.forward(q, k, v, call)
        assert tuple(out.shape) == (2, 32, 4, 16) and tuple(lse.shape) == (2, 4, 32) and max_logit.numel() == 0
        grads = ops.backward(q, k, v, out, out, lse, call)
        assert [tuple(g.shape) for g in grads[:3]] == [(2, 32, 4, 16)] * 3
    assert ops._eager(torch.empty(1), None)


@pytest.mark.parametrize("backend,paged", grid("backend,paged", ["fused", "unfused"],
                                              {"non_paged": False, "paged": True}))
def test_compiled_kv_cache_steps_equal_eager(monkeypatch, backend, paged):
    """A compiled module running KV-cache steps (two prefill chunks, then decode steps: sizes that change, so
    dynamo recompiles with dynamic sizes) gives eager's rows bitwise. The fused op then meets a symbolic
    max_seqlen among its parameters (the decoded-parameters cache takes no such key: it decodes them)."""
    from collections import OrderedDict

    from transformer_engine.pytorch.attention.inference import InferenceParams

    if backend == "fused" and not (DEVICE == "cuda" or INTERPRET):
        pytest.skip("fused kernels need a GPU, or TRITON_INTERPRET=1 set before triton is imported")
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dtype = LOWP_DTYPES[0] if backend == "fused" else torch.float32
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal",
                              layer_number=1).to(DEVICE).eval()
    steps = [OrderedDict([(0, 5), (1, 3)]), OrderedDict([(1, 4), (0, 2)])] + [OrderedDict([(0, 1), (1, 1)])] * 3
    g = gen(11)
    inputs = [[torch.randn(sum(s.values()), heads, 16, generator=g).to(DEVICE, dtype) for heads in (4, 2, 2)]
              for s in steps]
    outs = []
    for fn in (dpa, torch.compile(dpa, backend="eager")):
        params = InferenceParams(2, 32, 2, 16, dtype, device=DEVICE, is_paged=paged, page_size=8 if paged else None)
        params.allocate_memory(1)
        with torch.no_grad():
            rows = []
            for step, qkv in zip(steps, inputs):
                params.pre_step(step)
                rows.append(fn(*qkv, inference_params=params))
        outs.append(rows)
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a, b), f"step {i}: compiled rows differ from eager's"
