"""transformer_engine.pytorch.optimizers: FusedAdam and FusedSGD against torch's own fused optimizers
(bitwise), repeatability, master weights, decoupled gradients, states made by the caller, the refusals,
and the multi-tensor ops Megatron-core calls."""

from __future__ import annotations

import copy as copy_module

import pytest
import torch

from transformer_engine.pytorch.optimizers import (
    FusedAdam,
    FusedSGD,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_scale_tensor,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STEPS = 4


def _params(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]


def _grads(params, step, dtype=None):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.device, dtype or p.dtype) for p in params]


def _train(make_opt, params, steps=STEPS, attr="grad", grad_dtype=None):
    opt = make_opt(params)
    for step in range(steps):
        for p, grad in zip(params, _grads(params, step, grad_dtype)):
            setattr(p, attr, grad)
        opt.step()
    return [p.detach().clone() for p in params], opt


def _bitwise(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_equals_torch_fused_adam_bitwise(adam_w_mode, device):
    kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours, opt = _train(lambda ps: FusedAdam(ps, adam_w_mode=adam_w_mode, **kw), _params(device))
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    theirs, _ = _train(lambda ps: torch_cls(ps, fused=True, **kw), _params(device))
    _bitwise(ours, theirs)
    again, _ = _train(lambda ps: FusedAdam(ps, adam_w_mode=adam_w_mode, **kw), _params(device))
    _bitwise(ours, again)
    assert not torch.equal(ours[0], _params(device)[0])
    assert float(opt.state[opt.param_groups[0]["params"][0]]["step"]) == STEPS


def test_fused_adam_param_groups_and_state_dict_round_trip():
    params = _params("cpu")
    opt = FusedAdam([{"params": params[:1], "lr": 0.1}, {"params": params[1:]}], lr=0.01)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()
    copy = _params("cpu")
    for c, p in zip(copy, params):
        c.data.copy_(p.data)
    opt2 = FusedAdam([{"params": copy[:1], "lr": 0.1}, {"params": copy[1:]}], lr=0.01)
    opt2.load_state_dict(copy_module.deepcopy(opt.state_dict()))  # torch shares the tensors otherwise
    for ps, o in ((params, opt), (copy, opt2)):
        for p, g in zip(ps, _grads(ps, 1)):
            p.grad = g
        o.step()
    _bitwise(params, copy)


def test_fused_adam_master_weights_keep_fp32_and_round_to_bf16():
    kw = dict(lr=0.01, weight_decay=0.1)
    params = _params("cpu", torch.bfloat16)
    ours, opt = _train(lambda ps: FusedAdam(ps, master_weights=True, **kw), params)
    masters = [opt.state[p]["master_param"] for p in params]
    assert all(m.dtype == torch.float32 for m in masters)
    _bitwise(ours, [m.to(torch.bfloat16) for m in masters])
    # The same as torch's AdamW on fp32 copies with the bf16 gradients cast to fp32.
    ref = [torch.nn.Parameter(p.float()) for p in _params("cpu", torch.bfloat16)]
    ropt = torch.optim.AdamW(ref, fused=True, **kw)
    for step in range(STEPS):
        for r, g in zip(ref, _grads(ref, step, torch.bfloat16)):
            r.grad = g.float()
        ropt.step()
    _bitwise(masters, ref)


def test_fused_adam_decoupled_grad_and_zero_grad():
    ours, opt = _train(lambda ps: FusedAdam(ps, use_decoupled_grad=True), _params("cpu"), attr="decoupled_grad")
    theirs, _ = _train(lambda ps: FusedAdam(ps), _params("cpu"))
    _bitwise(ours, theirs)
    p = opt.param_groups[0]["params"][0]
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(p.decoupled_grad) == 0
    opt.zero_grad()
    assert p.decoupled_grad is None


def test_fused_adam_steps_from_moments_the_caller_made():
    """Megatron-core's init_state_fn fills exp_avg and exp_avg_sq only (no step)."""
    params = _params("cpu")
    opt = FusedAdam(params, lr=0.01)
    for p in params:
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)
    for step in range(STEPS):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    theirs, _ = _train(lambda ps: FusedAdam(ps, lr=0.01), _params("cpu"))
    _bitwise(params, theirs)


@pytest.mark.parametrize(
    "kwargs, name, error",
    [
        (dict(bias_correction=False), "bias_correction", NotImplementedError),
        (dict(exp_avg_dtype=torch.bfloat16), "exp_avg_dtype", NotImplementedError),
        (dict(exp_avg_sq_dtype=torch.uint8), "exp_avg_sq_dtype", NotImplementedError),
        (dict(master_weights=True, master_weight_dtype=torch.float16), "master_weight_dtype", NotImplementedError),
        (dict(lr=-1.0), "lr", ValueError),
        (dict(betas=(0.9, 1.5)), "betas", ValueError),
    ],
)
def test_fused_adam_refuses_by_name(kwargs, name, error):
    with pytest.raises(error, match=f"`{name}` must"):
        FusedAdam(_params("cpu"), **kwargs)


def test_fused_adam_refuses_a_grad_scaler_by_name():
    opt = FusedAdam(_params("cpu"))
    with pytest.raises(NotImplementedError, match="`grad_scaler` must be None"):
        opt.step(grad_scaler=object())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kw",
    [dict(lr=0.1), dict(lr=0.1, momentum=0.9, weight_decay=0.01), dict(lr=0.1, momentum=0.9, nesterov=True),
     dict(lr=0.1, momentum=0.5, dampening=0.2)],
    ids=["plain", "momentum_wd", "nesterov", "dampening"],
)
def test_fused_sgd_equals_torch_fused_sgd_bitwise(kw, device):
    ours, _ = _train(lambda ps: FusedSGD(ps, **kw), _params(device))
    theirs, _ = _train(lambda ps: torch.optim.SGD(ps, fused=True, **kw), _params(device))
    _bitwise(ours, theirs)
    again, _ = _train(lambda ps: FusedSGD(ps, **kw), _params(device))
    _bitwise(ours, again)


def test_fused_sgd_refuses_by_name():
    with pytest.raises(NotImplementedError, match="`wd_after_momentum` must be False"):
        FusedSGD(_params("cpu"), lr=0.1, wd_after_momentum=True)
    with pytest.raises(ValueError, match="`nesterov` must"):
        FusedSGD(_params("cpu"), lr=0.1, nesterov=True)


def test_multi_tensor_scale_and_overflow_flag():
    srcs = [torch.randn(5), torch.randn(3, 2)]
    dsts = [torch.empty(5, dtype=torch.bfloat16), torch.empty(3, 2)]
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts], 0.5)
    _bitwise(dsts, [(s * 0.5).to(d.dtype) for s, d in zip(srcs, dsts)])
    assert int(flag) == 0
    multi_tensor_applier(multi_tensor_scale_tensor, flag, [dsts, dsts], torch.tensor([2.0]))
    assert torch.equal(dsts[1], srcs[1])
    multi_tensor_applier(multi_tensor_scale, flag, [[torch.tensor([float("inf")])], [torch.empty(1)]], 1.0)
    assert int(flag) == 1


def test_multi_tensor_l2norm_matches_torch_and_skips_empty_tensors():
    tensors = [torch.randn(7), torch.empty(0), torch.randn(2, 3, dtype=torch.float64)]
    total, per = multi_tensor_applier(multi_tensor_l2norm, torch.zeros(1, dtype=torch.int), [tensors], True)
    ref = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors]))
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total.double(), ref.reshape(1), rtol=1e-6, atol=0)
    assert per.shape == (2,)
    _, none = multi_tensor_applier(multi_tensor_l2norm, torch.zeros(1, dtype=torch.int), [tensors], False)
    assert none.numel() == 0
    with pytest.raises(ValueError, match="`tensor_lists` must"):
        multi_tensor_applier(multi_tensor_scale, None, [tensors, tensors[:1]], 1.0)
