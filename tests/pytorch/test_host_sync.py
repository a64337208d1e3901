"""Which DotProductAttention calls read tensor values on the host (a device-to-host sync on a
GPU, which a CUDA graph cannot contain), checked on CPU.

docs/integrations.rst (CUDA graphs) states: a bool padding ``attention_mask`` and thd without
``max_seqlen_q/kv`` read the host; with ``cu_seqlens_q/kv`` and ``max_seqlen_q/kv`` no call does
while a graph is captured. A CPU run cannot capture a graph, so the capture state is simulated at
the library's one seam for it (``config.can_sync``, itself checked against torch.cuda's capture
query), and host reads are counted: every aten op that returns a tensor's value to Python
(``.item()``, ``bool()``, ``torch.equal``) and ``Tensor.tolist``, through forward and backward.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpa_helpers import DEVICE, INTERPRET, ON_GPU

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import config as attn_config

BACKENDS = [
    pytest.param("fused", marks=pytest.mark.skipif(
        not ON_GPU and not INTERPRET, reason="fused kernels need a GPU, or TRITON_INTERPRET=1 (CPU interpreter)")),
    "unfused",
]
FORCE = {
    "fused": {"NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0"},
    "unfused": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"},
}
BACKEND_NAME = {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}
DTYPE = torch.float16 if ON_GPU else torch.float32

_VALUE_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
              torch.ops.aten.is_nonzero.default}

B, S, H, D = 2, 16, 2, 16
LENGTHS = [16, 9]


class HostReads(TorchDispatchMode):
    """Records the aten ops that hand a tensor's value to Python."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _VALUE_OPS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads(capturing: bool):
    reads = HostReads()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        reads.reads.append("Tensor.tolist")
        return tolist(self)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.Tensor, "tolist", counted_tolist))
        if capturing:
            stack.enter_context(mock.patch.object(attn_config, "can_sync", lambda: False))
        stack.enter_context(reads)
        yield reads.reads


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    for name, value in FORCE[request.param].items():
        monkeypatch.setenv(name, value)
    return request.param


def _cu_seqlens():
    return torch.nn.functional.pad(torch.tensor(LENGTHS, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                                   (1, 0)).to(DEVICE)


def _call(route: str):
    """(DotProductAttention, q, k, v, keyword arguments) for one way of describing the sequences."""
    g = torch.Generator().manual_seed(0)
    cu = _cu_seqlens()
    if route.startswith("thd"):
        shape = (sum(LENGTHS), H, D)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        if route == "thd+cu_seqlens+max_seqlen":
            kwargs.update(max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
        fmt = "thd"
    else:
        shape = (B, S, H, D)
        if route == "bshd+padding_mask":
            lengths = torch.tensor(LENGTHS, device=DEVICE)
            kwargs = dict(attention_mask=(torch.arange(S, device=DEVICE)[None, :] >= lengths[:, None])[:, None, None])
        else:  # the padded length is the tensor's: no max_seqlen needed
            kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        fmt = "bshd"
    q, k, v = (torch.randn(*shape, generator=g).to(DEVICE, DTYPE).requires_grad_() for _ in range(3))
    return DotProductAttention(H, D, qkv_format=fmt, attn_mask_type="padding_causal"), q, k, v, kwargs


def _forward_backward(route: str, capturing: bool, backend: str):
    dpa, q, k, v, kwargs = _call(route)
    with count_host_reads(capturing) as reads:
        out = dpa(q, k, v, **kwargs)
        out.float().sum().backward()
    assert dpa.last_backend == BACKEND_NAME[backend]
    return reads


def test_capture_state_is_what_can_sync_reports():
    assert attn_config.can_sync() == (not (ON_GPU and torch.cuda.is_current_stream_capturing()))
    with mock.patch("torch.cuda.is_available", lambda: True), \
            mock.patch("torch.cuda.is_current_stream_capturing", lambda: True):
        assert not attn_config.can_sync()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("route", ["bshd+cu_seqlens", "thd+cu_seqlens+max_seqlen"])
def test_cu_seqlens_with_max_seqlen_read_nothing_on_the_host_while_capturing(backend, route):
    """The documented capture route: forward and backward hand no tensor value to Python."""
    reads = _forward_backward(route, capturing=True, backend=backend)
    assert reads == [], f"{route} read the host while a CUDA graph would be captured: {reads}"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("route", ["bshd+cu_seqlens", "thd+cu_seqlens+max_seqlen"])
def test_outside_capture_cu_seqlens_values_are_checked_on_the_host(backend, route):
    """Eager calls validate the cu_seqlens values (one read per side); capture skips the check."""
    reads = _forward_backward(route, capturing=False, backend=backend)
    assert reads and set(reads) == {"Tensor.tolist"}, reads


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("route, read", [("bshd+padding_mask", "aten.equal.default"),
                                         ("thd+cu_seqlens", "aten._local_scalar_dense.default")])
def test_the_documented_syncing_routes_still_read_the_host(backend, route, read):
    """A padding mask (its layout is checked) and thd without max_seqlen (the longest length is read)
    sync even while capturing, as the CUDA graphs section says; if one stops, update that section."""
    reads = _forward_backward(route, capturing=True, backend=backend)
    assert read in reads, reads
