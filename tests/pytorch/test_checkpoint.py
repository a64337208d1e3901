"""transformer_engine.pytorch.checkpoint (TransformerEngine's te_checkpoint): a recomputed step is bitwise the
step without recompute.

A small block (LayerNormMLP, dropout drawn from the RNG tracker and from torch's generator, a Linear and a
residual) trained a few steps with and without the checkpoint, reentrant and not: losses, outputs, input and
parameter gradients, the RNG states after the step and (FP8) the delayed-scaling scales and amax histories
are equal bitwise, in high precision and under each FP8 recipe. Controls show what each saved state is for:
without the tracker the recompute draws other dropout masks, and without the first forward's FP8 plans it
quantizes with the updated scales. LayerNormMLP(checkpoint=True) is the same module bitwise, and FP8 attention
(fp8_dpa, which updates its delayed scales at each call) keeps its first call's scales. The distributed
form (distribute_saved_activations over 2 gloo ranks) runs in tests/pytorch/distributed/layernorm_mlp_tp.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import distributed as te_distributed
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

# The tracker forks CUDA's generator where CUDA is available (as TransformerEngine's does): the model runs there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, FFN, SEQ, BATCH = 64, 96, 16, 2
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
MODES = ["plain", "reentrant", "non_reentrant"]


@pytest.fixture(autouse=True)
def _fresh_fp8_state():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


class Block(torch.nn.Module):
    """LayerNormMLP, dropout from the tracker's stream then from torch's, a Linear, a residual."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker
        self.mlp = te.LayerNormMLP(HIDDEN, FFN, activation="swiglu", params_dtype=torch.float32, device=DEVICE)
        self.proj = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device=DEVICE)

    def forward(self, x):
        h = self.mlp(x)
        with self.tracker.fork():
            h = torch.nn.functional.dropout(h, 0.25, self.training)
        h = torch.nn.functional.dropout(h, 0.1, self.training)
        return x + self.proj(h)


def _model():
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    block = Block(tracker)
    head = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device=DEVICE)
    return tracker, block, head


def _train(mode, rec=None, steps=3, tracker_in_checkpoint=True):
    """Steps of checkpoint(block) -> head (the block holds the first FP8 module); returns what each step gave,
    the final RNG states, and (delayed scaling) every scale and amax history."""
    FP8GlobalStateManager.reset()
    tracker, block, head = _model()
    params = list(block.parameters()) + list(head.parameters())
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(42)
    results = []
    for _ in range(steps):
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(DEVICE).requires_grad_(True)
        for p in params:
            p.grad = None
        with te.autocast(enabled=rec is not None, recipe=rec):
            if mode == "plain":
                h = block(x)
            else:
                h = te.checkpoint(block, x, use_reentrant=mode == "reentrant",
                                  get_rng_state_tracker=(lambda: tracker) if tracker_in_checkpoint else None)
            y = head(h)
        loss = y.square().mean()
        loss.backward()
        results.append([loss.detach(), y.detach(), x.grad] + [p.grad.clone() for p in params])
        with torch.no_grad():
            for p in params:
                p.sub_(0.5 * p.grad)
    rng = [torch.get_rng_state()] + list(tracker.get_states().values())
    if DEVICE == "cuda":
        rng.append(torch.cuda.get_rng_state())
    metas = []
    for module in (block.mlp, block.proj, head):
        for attr in ("_fp8_state", "_fp8_state_fc1", "_fp8_state_fc2"):
            state = module.__dict__.get(attr)
            if state is not None and state.fwd_meta is not None:
                metas += [state.fwd_meta.scale, state.fwd_meta.amax_history, state.bwd_meta.scale,
                          state.bwd_meta.amax_history]
    return results, rng, [m.clone() for m in metas]


def _assert_same(got, want, what):
    got_steps, got_rng, got_metas = got
    want_steps, want_rng, want_metas = want
    for step, (a, b) in enumerate(zip(got_steps, want_steps)):
        diff = [i for i, (u, v) in enumerate(zip(a, b)) if not torch.equal(u, v)]
        assert not diff, f"{what}, step {step}: tensors {diff} differ (0 loss, 1 output, 2 input grad, then params)"
    assert all(torch.equal(a, b) for a, b in zip(got_rng, want_rng)), f"{what}: RNG states after the steps differ"
    assert len(got_metas) == len(want_metas)
    diff = [i for i, (a, b) in enumerate(zip(got_metas, want_metas)) if not torch.equal(a, b)]
    assert not diff, f"{what}: delayed-scaling scales / amax histories {diff} differ"


def _differs(got, want):
    return any(not torch.equal(u, v) for a, b in zip(got[0], want[0]) for u, v in zip(a, b))


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_block_with_dropout_is_bitwise_the_plain_block(mode):
    plain = _train("plain")
    _assert_same(_train(mode), plain, mode)
    # Controls: dropout matters, and the tracker's saved state is what makes the recompute draw the same mask.
    _, block, _ = _model()
    x = torch.randn(SEQ, BATCH, HIDDEN).to(DEVICE)
    assert not torch.equal(block(x), block.eval()(x))
    assert _differs(_train(mode, tracker_in_checkpoint=False), plain)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_checkpointed_steps_are_bitwise_the_plain_steps(name, mode):
    """Three FP8 training steps: every result bitwise, and the delayed-scaling state after them equal (the
    recompute records no second amax and triggers no update)."""
    ok, reason = (te.check_fp8_block_scaling_support if name == "block" else te.check_fp8_support)(DEVICE)
    if not ok:
        pytest.skip(reason)
    plain = _train("plain", RECIPES[name]())
    got = _train(mode, RECIPES[name]())
    _assert_same(got, plain, f"{name}, {mode}")
    if name == "delayed":
        assert len(plain[2]) == 4 * 4  # fc1, fc2, proj and head: forward and backward scales and histories
        assert not torch.equal(plain[2][0], torch.ones(3, device=DEVICE))  # the scales moved over the steps


def test_without_the_first_forwards_plans_the_recompute_would_differ(monkeypatch):
    """Control for the FP8 replay: recomputing with the scales current at the backward (updated when the
    autocast exited) changes the gradients under delayed scaling."""
    plain = _train("plain", RECIPES["delayed"]())
    monkeypatch.setattr(te_distributed, "replayed_fp8_plan", lambda module, gemm: te_distributed.NOT_REPLAYING)
    assert _differs(_train("reentrant", RECIPES["delayed"]()), plain)


@pytest.mark.parametrize("rec", [None, "delayed"])
def test_layernorm_mlp_checkpoint_argument_is_the_same_module_bitwise(rec):
    runs = []
    for checkpoint in (False, True):
        FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        mod = te.LayerNormMLP(HIDDEN, FFN, activation="gelu", return_layernorm_output=True, checkpoint=checkpoint,
                              params_dtype=torch.float32, device=DEVICE)
        gen = torch.Generator().manual_seed(3)
        out = []
        for _ in range(2):
            # No input gradient: the parameters still get theirs.
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(DEVICE)
            mod.zero_grad(set_to_none=True)
            with te.autocast(enabled=rec is not None, recipe=RECIPES[rec]() if rec else None):
                y, ln = mod(x)
            (y.square().sum() + ln.sum()).backward()
            out += [y.detach(), ln.detach()] + [p.grad for p in mod.parameters()]
        runs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_autocast_inside_the_checkpointed_function(mode):
    """The function opens the FP8 autocast itself: the update at its exit happens once, in the first forward."""
    def run(checkpointed):
        FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        mlp = te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.float32, device=DEVICE)
        rec = RECIPES["delayed"]()

        def fn(t):
            with te.autocast(enabled=True, recipe=rec):
                return mlp(t)

        gen = torch.Generator().manual_seed(3)
        out = []
        for _ in range(3):
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(DEVICE).requires_grad_(True)
            mlp.zero_grad(set_to_none=True)
            y = te.checkpoint(fn, x, use_reentrant=mode == "reentrant") if checkpointed else fn(x)
            y.square().sum().backward()
            out += [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]
        for gemm in ("fc1", "fc2"):
            state = getattr(mlp, f"_fp8_state_{gemm}")
            out += [state.fwd_meta.scale.clone(), state.fwd_meta.amax_history.clone(),
                    state.bwd_meta.amax_history.clone()]
        return out

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_nested_checkpoints_under_fp8():
    def run(nested):
        FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        inner = te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.float32, device=DEVICE)
        outer = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.float32, device=DEVICE)

        def fn(t):
            h = te.checkpoint(inner, t, use_reentrant=False) if nested else inner(t)
            return outer(h)

        gen = torch.Generator().manual_seed(3)
        out = []
        for _ in range(2):
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(DEVICE).requires_grad_(True)
            with te.autocast(enabled=True, recipe=RECIPES["delayed"]()):
                y = te.checkpoint(fn, x) if nested else fn(x)
            y.square().sum().backward()
            out += [y.detach(), x.grad] + [p.grad.clone() for p in list(inner.parameters()) + list(outer.parameters())]
            inner.zero_grad(set_to_none=True)
            outer.zero_grad(set_to_none=True)
        return out

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


# --- arguments and refusals --------------------------------------------------------------------

def test_keyword_arguments_context_fn_and_deprecated_positional_form():
    torch.manual_seed(0)
    lin = te.Linear(8, 8, device=DEVICE)
    x = torch.randn(4, 8).to(DEVICE).requires_grad_(True)
    entered = []

    class Mark:
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            entered.append(self.what)

        def __exit__(self, *exc):
            return False

    def context_fn():
        return Mark("forward"), Mark("recompute")

    def scaled(t, scale=1.0):
        return lin(t) * scale

    for reentrant in (True, False):
        entered.clear()
        y = te.checkpoint(scaled, x, use_reentrant=reentrant, context_fn=context_fn, scale=2.0)
        assert torch.equal(y, lin(x) * 2.0)
        y.sum().backward()
        assert entered == ["forward", "recompute"]
    with pytest.warns(DeprecationWarning, match="keyword arguments"):
        y = te.checkpoint(lin, False, None, None, x)
    assert torch.equal(y, lin(x))


def test_bad_uses_are_refused():
    lin = te.Linear(8, 8, device=DEVICE)
    x = torch.randn(4, 8).to(DEVICE).requires_grad_(True)
    with pytest.raises(ValueError, match="`function`"):
        te.checkpoint("lin", x)
    with pytest.raises(ValueError, match="`use_reentrant`"):
        te.checkpoint(lin, x, use_reentrant="yes")
    with pytest.raises(NotImplementedError, match="determinism_check"):
        te.checkpoint(lin, x, determinism_check="none")
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed"):
            te.checkpoint(lin, x, distribute_saved_activations=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="no effect"):
            te.checkpoint(lin, x, distribute_saved_activations=True, use_reentrant=False)
    y = te.checkpoint(lin, x)
    with pytest.raises(RuntimeError, match="autograd.grad"):
        torch.autograd.grad(y.sum(), x)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_recompute_running_other_fp8_modules_is_an_error(mode):
    a = te.Linear(HIDDEN, HIDDEN, device=DEVICE)
    b = te.Linear(HIDDEN, HIDDEN, device=DEVICE)
    calls = []

    def fn(t):
        calls.append(None)
        return (a if len(calls) == 1 else b)(t)

    x = torch.randn(4, HIDDEN).to(DEVICE).requires_grad_(True)
    with te.autocast(enabled=True, recipe=RECIPES["current"]()):
        y = te.checkpoint(fn, x, use_reentrant=mode == "reentrant")
    with pytest.raises(RuntimeError, match="same modules in the same order"):
        y.sum().backward()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="FP8 attention runs on Triton kernels: needs TRITON_INTERPRET=1 or a CUDA GPU")
def test_fp8_attention_under_checkpoint_keeps_its_delayed_scales(monkeypatch):
    """DotProductAttention with fp8_dpa=True updates its delayed scales at the autocast's exit: the recompute
    reuses the first call's scales and records nothing, so two steps equal the plain ones bitwise."""
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    rec = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4, fp8_dpa=True)

    def run(mode):
        FP8GlobalStateManager.reset()
        dpa = te.DotProductAttention(2, 32, attn_mask_type="causal", qkv_format="bshd").to(device)
        out = []
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            q, k, v = (torch.randn(1, 16, 2, 32, generator=g).to(device).mul(1 + step).requires_grad_()
                       for _ in range(3))
            with te.autocast(enabled=True, recipe=rec):
                o = dpa(q, k, v) if mode == "plain" else te.checkpoint(dpa, q, k, v,
                                                                        use_reentrant=mode == "reentrant")
            o.backward(torch.randn(o.shape, generator=g).to(device) * 1e-2)
            out += [o.detach(), q.grad, k.grad, v.grad]
        state = dpa._fp8_attention_state
        return out + [m.clone() for meta in (state.fwd_meta, state.bwd_meta) for m in (meta.scale, meta.amax_history)]

    plain = run("plain")
    for mode in ("reentrant", "non_reentrant"):
        got = run(mode)
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), mode
    monkeypatch.setattr(te_distributed, "replayed_fp8_plan", lambda module, gemm: te_distributed.NOT_REPLAYING)
    assert not all(torch.equal(a, b) for a, b in zip(run("reentrant"), plain))
