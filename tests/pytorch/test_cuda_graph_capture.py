"""DotProductAttention's forward and backward captured in one CUDA graph (GPU only).

After warm-up calls on a side stream (which compile the kernels and fill the signature caches), a training
step (forward and backward) is captured; a replay on new values copied into the captured inputs must give
bitwise what eager calls on those values give: the captured path has no host synchronisation, no .item(),
and allocates only in the graph's pool. thd needs ``max_seqlen_*`` for capture (docs/integrations.rst).
"""

from __future__ import annotations

import pytest
import torch

from dpa_helpers import ON_GPU

from transformer_engine.pytorch import DotProductAttention

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")

H = 4


def _inputs(fmt: str, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (2 * 96, H, d) if fmt == "thd" else (2, 96, H, d)
    out_shape = shape[:-2] + (H * d,)  # the module's output merges the heads
    return [torch.randn(s, generator=g).to("cuda", torch.bfloat16) for s in (shape, shape, shape, out_shape)]


def _kwargs(fmt: str):
    if fmt != "thd":
        return {}
    cu = torch.tensor([0, 70, 2 * 96], dtype=torch.int32, device="cuda")
    return dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=122, max_seqlen_kv=122)


def _step(dpa, q, k, v, d_out, kwargs):
    out = dpa(q, k, v, **kwargs)
    out.backward(d_out)
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondet", "det"])
@pytest.mark.parametrize("fmt,mask,d", [("bshd", "causal", 128), ("bshd", "no_mask", 64), ("thd", "padding_causal", 128)])
def test_forward_backward_replays_bitwise_equal_to_eager(monkeypatch, fmt, mask, d, deterministic):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")  # our kernels (flash-attn-4 would come first at d=128)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0" if deterministic else "1")
    dpa = DotProductAttention(H, d, qkv_format=fmt, attn_mask_type=mask)
    kwargs = _kwargs(fmt)
    static = [t.requires_grad_(i < 3) for i, t in enumerate(_inputs(fmt, d, seed=0))]
    q, k, v, d_out = static

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compiles, fills the signature caches
            _step(dpa, q, k, v, d_out, kwargs)
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None  # the capture allocates the gradients in the graph's pool

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(dpa, q, k, v, d_out, kwargs)

    for dst, src in zip(static, _inputs(fmt, d, seed=1)):
        with torch.no_grad():
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [out.detach().clone()] + [t.grad.detach().clone() for t in (q, k, v)]

    eager_inputs = [t.detach().clone().requires_grad_(i < 3) for i, t in enumerate(static)]
    eager_out = _step(dpa, *eager_inputs, kwargs)
    eager = [eager_out.detach()] + [t.grad for t in eager_inputs[:3]]
    assert dpa.last_backend == "FusedAttention"
    for name, a, b in zip(("out", "dq", "dk", "dv"), replayed, eager):
        assert torch.equal(a, b), f"{name}: the replay differs from the eager step"
