"""fuse_wgrad_accumulation=True in Linear and LayerNormLinear: the weight gradient is added to
weight.main_grad (fp32) by the backward, bitwise equal to the unfused accumulation (autograd's
weight gradient added to main_grad, as Megatron's gradient hook does), over several micro-batches;
is_first_microbatch and overwrite_main_grad overwrite; Megatron's grad_added_to_main_grad protocol."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te

MICRO = 3


def _module(cls, fused, seed=0, **kw):
    torch.manual_seed(seed)
    mod = cls(24, 18, device="cpu", fuse_wgrad_accumulation=fused, **kw)
    mod.weight.main_grad = torch.zeros_like(mod.weight, dtype=torch.float32)
    return mod


def _inputs(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(5, 3, 24, generator=g), torch.randn(5, 3, 18, generator=g)


def _micro_batches(mod, fused, first_flags=(None,) * MICRO):
    for step, first in zip(range(MICRO), first_flags):
        x, dy = _inputs(step)
        x.requires_grad_(True)
        out = mod(x, is_first_microbatch=first)
        out.backward(dy)
        if not fused:  # Megatron's hook without the fusion
            mod.weight.main_grad.add_(mod.weight.grad)
            mod.weight.grad = None
        yield x.grad


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear])
def test_main_grad_equals_the_unfused_accumulation_bitwise(cls):
    fused, unfused = _module(cls, True), _module(cls, False)
    dx_f = list(_micro_batches(fused, True))
    dx_u = list(_micro_batches(unfused, False))
    assert fused.weight.grad is None
    assert torch.equal(fused.weight.main_grad, unfused.weight.main_grad)
    assert torch.count_nonzero(fused.weight.main_grad) > 0
    for a, b in zip(dx_f, dx_u):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # Everything else gets its gradient as usual.
    for (name, p), q in zip(fused.named_parameters(), unfused.parameters()):
        if name != "weight":
            assert torch.equal(p.grad, q.grad), name
    again = _module(cls, True)
    list(_micro_batches(again, True))
    assert torch.equal(again.weight.main_grad, fused.weight.main_grad)


def test_first_microbatch_and_overwrite_main_grad_overwrite():
    mod = _module(te.Linear, True)
    list(_micro_batches(mod, True, first_flags=(True, False, True)))
    ref = _module(te.Linear, False)
    x, dy = _inputs(2)
    ref(x).backward(dy)
    assert torch.equal(mod.weight.main_grad, ref.weight.grad)
    mod.weight.overwrite_main_grad = True
    list(_micro_batches(mod, True))
    assert torch.equal(mod.weight.main_grad, ref.weight.grad)


def test_megatron_flag_gets_a_zero_gradient_and_is_set():
    mod = _module(te.Linear, True, bias=False)
    mod.weight.grad_added_to_main_grad = False
    seen = []
    mod.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x, dy = _inputs(0)
    mod(x).backward(dy)
    assert mod.weight.grad_added_to_main_grad is True
    assert len(seen) == 1 and torch.count_nonzero(seen[0]) == 0 and seen[0].shape == mod.weight.shape


def test_missing_main_grad_is_named():
    mod = te.Linear(8, 4, device="cpu", fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="`weight.main_grad` must be"):
        mod(torch.randn(2, 8)).sum().backward()


def test_bf16_main_grad_stays_fp32_and_errs_no_more_than_bf16_grads():
    fused = _module(te.Linear, True, params_dtype=torch.bfloat16)
    exact = _module(te.Linear, False, params_dtype=torch.float64)
    exact.weight.main_grad = exact.weight.main_grad.double()
    bf16_grads = _module(te.Linear, False, params_dtype=torch.bfloat16)
    for step in range(MICRO):
        x, dy = _inputs(step)
        fused(x.bfloat16()).backward(dy.bfloat16())
        bf16_grads(x.bfloat16()).backward(dy.bfloat16())
        exact(x.double()).backward(dy.double())
    assert fused.weight.main_grad.dtype == torch.float32
    err_fused = (fused.weight.main_grad.double() - exact.weight.grad).abs().max()
    err_bf16 = (bf16_grads.weight.grad.double() - exact.weight.grad).abs().max()
    assert err_fused <= err_bf16
