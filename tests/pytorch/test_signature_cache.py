"""The signature caches (``pytorch/attention/signature_cache.py``): a call whose signature was seen reuses the
decisions of the first (DotProductAttention's checks and backend selection, the kernel runner's prepared
launches); a changed shape, stride, dtype, alignment, argument, determinism request or setting misses; the
checks of tensor values still run on every call; results are bitwise those of the full path.

Behavioural only (hit and miss counts, errors, bits), never timing. Without a GPU or the interpreter the
module runs unfused: its cache is tested there too.
"""

from __future__ import annotations

import pytest
import torch

from dpa_helpers import DEVICE, requires_fused

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import signature_cache

_DTYPE = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _cache(name: str) -> signature_cache.SignatureCache:
    (cache,) = [c for c in signature_cache.caches() if c.name == name]
    return cache


@pytest.fixture
def counts():
    """Fresh caches; returns a function giving (hits, misses) of a cache by name."""
    signature_cache.clear_all()
    yield lambda name: (_cache(name).hits, _cache(name).misses)
    signature_cache.clear_all()


def _qkv(b=2, s=24, h=2, d=16, dtype=_DTYPE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(3)]


def _module(**kwargs):
    kwargs.setdefault("qkv_format", "bshd")
    kwargs.setdefault("attn_mask_type", "causal")
    return DotProductAttention(2, 16, **kwargs)


def test_a_repeated_call_hits(counts):
    dpa = _module()
    q, k, v = _qkv()
    dpa(q, k, v)
    assert counts("DotProductAttention") == (0, 1)
    dpa(q, k, v)
    dpa(*_qkv(seed=1))  # other values, same signature
    assert counts("DotProductAttention") == (2, 1)


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "alignment", "argument", "module", "training"])
def test_a_changed_signature_misses(counts, change):
    dpa = _module()
    q, k, v = _qkv()
    dpa(q, k, v)
    kwargs = {}
    if change == "shape":
        q, k, v = _qkv(s=32)
    elif change == "stride":  # the same values in a (b, h, s, d) buffer
        q = q.detach().transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "dtype":
        q, k, v = _qkv(dtype=torch.float32)
    elif change == "alignment":  # a view 2 bytes past a 16-byte boundary
        flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
        q = flat[1:].view(q.shape).copy_(q.detach())
    elif change == "argument":
        kwargs = dict(window_size=(4, 0))
    elif change == "module":
        dpa.softmax_scale = 0.5
    else:
        dpa.eval()
    dpa(q, k, v, **kwargs)
    assert counts("DotProductAttention") == (0, 2)


def test_a_changed_setting_or_determinism_misses(counts, monkeypatch):
    dpa = _module()
    q, k, v = _qkv()
    dpa(q, k, v)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    dpa(q, k, v)
    assert counts("DotProductAttention") == (0, 2)
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    dpa(q, k, v)
    assert dpa.last_backend == "UnfusedDotProductAttention"
    monkeypatch.delenv("NVTE_FUSED_ATTN_BACKEND")
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    dpa(q, k, v)  # the first signature again
    assert counts("DotProductAttention") == (1, 3)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        dpa(q, k, v)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert counts("DotProductAttention") == (1, 4)


def test_a_malformed_setting_still_raises_after_a_hit(counts, monkeypatch):
    dpa = _module()
    q, k, v = _qkv()
    dpa(q, k, v)
    dpa(q, k, v)
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fastest")
    with pytest.raises(ValueError, match="NVTE_FUSED_ATTN_BACKEND"):
        dpa(q, k, v)


def test_argument_types_are_part_of_the_signature(counts):
    """``1`` and ``True`` are equal keys in Python; the checks tell them apart, so the cache does too."""
    dpa = _module(attn_mask_type="no_mask")
    q, k, v = _qkv()
    dpa(q, k, v, bottom_right_diagonal=True)
    dpa(q, k, v, bottom_right_diagonal=True)
    assert counts("DotProductAttention") == (1, 1)
    with pytest.raises(ValueError, match="`bottom_right_diagonal` must be None or a bool, got 1"):
        dpa(q, k, v, bottom_right_diagonal=1)
    dpa(q, k, v, window_size=(4, 4))
    dpa(q, k, v, window_size=[4, 4])
    assert counts("DotProductAttention") == (1, 4)


def test_cu_seqlens_values_are_checked_on_every_call(counts):
    """The values of cu_seqlens are not in the signature: a bad one raises after the signature was cached."""
    dpa = _module(attn_mask_type="padding")
    q, k, v = _qkv()
    good = torch.tensor([0, 20, 44], dtype=torch.int32, device=DEVICE)
    dpa(q, k, v, cu_seqlens_q=good, cu_seqlens_kv=good)
    dpa(q, k, v, cu_seqlens_q=good, cu_seqlens_kv=good)
    assert counts("DotProductAttention") == (1, 1)
    bad = torch.tensor([0, 30, 44], dtype=torch.int32, device=DEVICE)  # a sequence longer than s = 24
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        dpa(q, k, v, cu_seqlens_q=bad, cu_seqlens_kv=bad)
    wrong_dtype = good.to(torch.int64)  # another signature: the full path's check
    with pytest.raises(ValueError, match="`cu_seqlens_q` must be int32"):
        dpa(q, k, v, cu_seqlens_q=wrong_dtype, cu_seqlens_kv=wrong_dtype)


def test_an_attention_mask_call_is_not_cached(counts):
    dpa = _module(attn_mask_type="padding")
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 1, 24, dtype=torch.bool, device=DEVICE)
    mask[0, ..., 20:] = True
    dpa(q, k, v, attention_mask=mask)
    dpa(q, k, v, attention_mask=mask)
    assert counts("DotProductAttention") == (0, 0)


def _fwd_bwd(dpa, q, k, v, **kwargs):
    out = dpa(q, k, v, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return [out.detach(), *grads]


@pytest.mark.parametrize("mask", ["causal", "padding_causal"])
def test_a_hit_is_bitwise_the_full_path(counts, mask):
    dpa = _module(attn_mask_type=mask)
    q, k, v = _qkv()
    kwargs = {}
    if mask.startswith("padding"):
        cu = torch.tensor([0, 17, 41], dtype=torch.int32, device=DEVICE)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    first = _fwd_bwd(dpa, q, k, v, **kwargs)
    again = _fwd_bwd(dpa, q, k, v, **kwargs)
    assert counts("DotProductAttention")[0] == 1
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@requires_fused
def test_the_kernel_runner_prepares_once_per_signature(counts, monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    dpa = _module()
    q, k, v = _qkv(dtype=torch.float16)
    first = _fwd_bwd(dpa, q, k, v)
    assert counts("kernel_runner.forward") == (0, 1) and counts("kernel_runner.backward") == (0, 1)
    again = _fwd_bwd(dpa, q, k, v)
    assert counts("kernel_runner.forward") == (1, 1) and counts("kernel_runner.backward") == (1, 1)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # a setting the plans read: a new signature at both layers
    monkeypatch.setenv("NVTE_FUSED_ATTN_WS", "0")
    _fwd_bwd(dpa, q, k, v)
    assert counts("kernel_runner.forward") == (1, 2) and counts("kernel_runner.backward") == (1, 2)
    # another shape
    _fwd_bwd(dpa, *_qkv(s=40, dtype=torch.float16))
    assert counts("kernel_runner.forward") == (1, 3)


def test_arguments_that_make_no_key_get_the_full_paths_errors(counts):
    dpa = _module(attn_mask_type="padding")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="`cu_seqlens_q` must be an int32 tensor"):
        dpa(q, k, v, cu_seqlens_q=[0, 20, 44], cu_seqlens_kv=[0, 20, 44])
    with pytest.raises(ValueError, match="`window_size` must be a pair of ints"):
        dpa(q, k, v, window_size=5)
    assert counts("DotProductAttention") == (0, 0)


def test_the_oldest_signature_leaves_a_full_cache():
    cache = signature_cache.SignatureCache("test", max_entries=2)
    try:
        cache.put("a", 1)
        cache.put("b", 2)
        cache.put("c", 3)
        assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, 2, 3) and len(cache) == 2
        cache.enabled = False
        assert cache.get("b") is None
        cache.put("d", 4)
        cache.enabled = True
        assert cache.get("d") is None and cache.get("b") == 2
    finally:
        signature_cache._registry.remove(cache)
