"""FP8 state in the state dict (the modules' ``_extra_state``): a model of Linear, LayerNormLinear and
LayerNormMLP trained N steps equals, bitwise (losses, parameters, FP8 states), the same model trained k steps,
saved with ``torch.save(model.state_dict())`` and the optimizer's state, loaded into a fresh model (in this
process, after a first FP8 forward, and in a fresh process) and trained on to N, for each recipe. A checkpoint
without extra state loads with strict=False; a model that never ran FP8 saves and loads; foreign entries are
refused by name."""

import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

RECIPES = {
    # A history shorter than the run, so resuming has to carry rolled histories.
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=3),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
HIDDEN, FFN, SEQ, BATCH = 32, 64, 8, 2
DEVICE = "cpu"  # a GPU run sets it before building (the CPU is what CI runs)
N, K = 6, 3


@pytest.fixture(autouse=True)
def _fresh_fp8_state():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = te.Linear(HIDDEN, HIDDEN, device=DEVICE)
        self.lnl = te.LayerNormLinear(HIDDEN, HIDDEN, device=DEVICE)
        self.mlp = te.LayerNormMLP(HIDDEN, FFN, device=DEVICE)

    def forward(self, x):
        return self.mlp(self.lnl(self.lin(x)))


def build(seed=0):
    torch.manual_seed(seed)
    model = Model()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step):
    # Growing inputs: the amaxes change from step to step, so the scales do.
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, SEQ, HIDDEN, generator=g) * (1.0 + step)).to(DEVICE)


def train(model, opt, name, steps):
    losses = []
    for step in steps:
        opt.zero_grad()
        if name is None:
            out = model(batch(step))
        else:
            with te.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
                out = model(batch(step))
        loss = out.float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def fp8_states(model):
    """Every delayed-scaling tensor of the model (empty for the stateless recipes)."""
    out = {}
    for mname, mod in model.named_children():
        for attr in mod._fp8_state_attrs():
            st = mod.__dict__.get(attr)
            if st is not None and st.fwd_meta is not None:
                for d, meta in (("fwd", st.fwd_meta), ("bwd", st.bwd_meta)):
                    out[f"{mname}.{attr}.{d}.scale"] = meta.scale
                    out[f"{mname}.{attr}.{d}.amax_history"] = meta.amax_history
    return out


def checkpoint(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def resume(data, name, warm_forward=False):
    """A fresh model (another seed: everything it trains with comes from the checkpoint), loaded, trained to N."""
    model, opt = build(seed=1)
    if warm_forward:  # an FP8 forward before the load: the states exist and are overwritten in place
        with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
            model(batch(99))
    ckpt = torch.load(io.BytesIO(data), weights_only=True, map_location=DEVICE)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    return model, train(model, opt, name, range(K, N))


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def runs():
    """Per recipe: the uninterrupted run (losses, parameters, FP8 states) and the checkpoint at step K."""
    out = {}
    for name in RECIPES:
        FP8GlobalStateManager.reset()
        model, opt = build()
        losses = train(model, opt, name, range(N))
        FP8GlobalStateManager.reset()
        model_k, opt_k = build()
        train(model_k, opt_k, name, range(K))
        out[name] = dict(losses=losses, params={k: v.detach().clone() for k, v in model.named_parameters()},
                         fp8={k: v.clone() for k, v in fp8_states(model).items()},
                         extra={k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")},
                         ckpt=checkpoint(model_k, opt_k))
    FP8GlobalStateManager.reset()
    return out


@pytest.mark.parametrize("warm_forward", [False, True], ids=["load_first", "load_after_fp8_forward"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_resume_is_bitwise_the_uninterrupted_run(runs, name, warm_forward):
    ref = runs[name]
    model, losses = resume(ref["ckpt"], name, warm_forward)
    assert torch.equal(losses, ref["losses"][K:])
    assert_same({k: v.detach() for k, v in model.named_parameters()}, ref["params"])
    assert_same(fp8_states(model), ref["fp8"])
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    assert extra.keys() == {"lin._extra_state", "lnl._extra_state", "mlp._extra_state"}
    assert_same(extra, ref["extra"])
    if name == "delayed":
        assert len(ref["fp8"]) == 16 and all(v.numel() > 0 for v in extra.values())
        # The histories rolled past their length, and are not the fresh state a restart would have.
        assert all(v.abs().sum() > 0 for k, v in ref["fp8"].items() if "amax_history" in k)
    else:  # stateless recipes save an empty entry, as TransformerEngine does
        assert not ref["fp8"] and all(v.numel() == 0 and v.dtype == torch.uint8 for v in extra.values())


def test_load_after_forward_copies_in_place(runs):
    model, _ = build(seed=1)
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=RECIPES["delayed"]()):
        model(batch(0))
    metas = [(model.mlp._fp8_state_fc2.fwd_meta, model.mlp._fp8_state_fc2.fwd_meta.scale.data_ptr()),
             (model.lin._fp8_state.bwd_meta, model.lin._fp8_state.bwd_meta.amax_history.data_ptr())]
    model.load_state_dict(torch.load(io.BytesIO(runs["delayed"]["ckpt"]), weights_only=True)["model"])
    assert model.mlp._fp8_state_fc2.fwd_meta is metas[0][0]
    assert model.mlp._fp8_state_fc2.fwd_meta.scale.data_ptr() == metas[0][1]
    assert model.lin._fp8_state.bwd_meta is metas[1][0]
    assert model.lin._fp8_state.bwd_meta.amax_history.data_ptr() == metas[1][1]


def test_resume_in_a_fresh_process(runs, tmp_path):
    """The checkpoint at step K continued in another Python process: bitwise the uninterrupted run."""
    ckpt, result = tmp_path / "ckpt.pt", tmp_path / "result.pt"
    ckpt.write_bytes(runs["delayed"]["ckpt"])
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_fp8_state_dict as t
        model, losses = t.resume(open({str(ckpt)!r}, "rb").read(), "delayed")
        torch.save(dict(losses=losses, params={{k: v.detach() for k, v in model.named_parameters()}},
                        fp8=t.fp8_states(model)), {str(result)!r})
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(result, weights_only=True)
    ref = runs["delayed"]
    assert torch.equal(got["losses"], ref["losses"][K:])
    assert_same(got["params"], ref["params"])
    assert_same(got["fp8"], ref["fp8"])


def test_layout_is_transformer_engines(runs):
    """TransformerEngine's keys; LayerNormMLP's GEMMs side by side (fc1's input, weight, output, then fc2's)."""
    model, opt = build()
    train(model, opt, "delayed", range(2))
    state = torch.load(io.BytesIO(model.mlp.get_extra_state().numpy().tobytes()), weights_only=True)
    assert state["recipe"]["type"] == "DelayedScaling" and state["recipe"]["amax_history_len"] == 3
    assert state["recipe"]["fp8_format"] == "HYBRID"
    assert state["extra_fp8_variables"] == {"num_gemms": 2}
    fc1, fc2 = model.mlp._fp8_state_fc1, model.mlp._fp8_state_fc2
    assert torch.equal(state["amax_history_fwd"], torch.cat([fc1.fwd_meta.amax_history, fc2.fwd_meta.amax_history], 1))
    assert torch.equal(state["scale_fwd"], torch.cat([fc1.fwd_meta.scale, fc2.fwd_meta.scale]))
    assert torch.equal(state["amax_history_bwd"], torch.cat([fc1.bwd_meta.amax_history, fc2.bwd_meta.amax_history], 1))
    assert torch.equal(state["scale_bwd"], torch.cat([fc1.bwd_meta.scale, fc2.bwd_meta.scale]))
    assert state["scale_fwd"].shape == (6,) and state["amax_history_bwd"].shape == (3, 4)
    lin = torch.load(io.BytesIO(model.lin.get_extra_state().numpy().tobytes()), weights_only=True)
    assert lin["scale_fwd"].shape == (3,) and lin["extra_fp8_variables"] == {"num_gemms": 1}


def test_checkpoint_without_extra_state_loads_with_strict_false(runs):
    ref = runs["delayed"]
    state = torch.load(io.BytesIO(ref["ckpt"]), weights_only=True)["model"]
    old = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    model, opt = build(seed=1)
    missing, unexpected = model.load_state_dict(old, strict=False)
    assert sorted(missing) == ["lin._extra_state", "lnl._extra_state", "mlp._extra_state"] and not unexpected
    with pytest.raises(RuntimeError, match="_extra_state"):
        build(seed=1)[0].load_state_dict(old)  # strict: the missing entries are named, as in TransformerEngine
    assert not fp8_states(model)  # nothing loaded: FP8 starts afresh
    train(model, opt, "delayed", range(K, K + 1))
    assert len(fp8_states(model)) == 16
    # None (TransformerEngine's entry for modules without state) loads as nothing.
    model.lin.set_extra_state(None)


def test_model_that_never_ran_fp8_saves_and_loads():
    model, opt = build()
    train(model, opt, None, range(2))
    state = model.state_dict()
    assert all(state[k].numel() == 0 for k in ("lin._extra_state", "lnl._extra_state", "mlp._extra_state"))
    data = io.BytesIO()
    torch.save(state, data)
    fresh, _ = build(seed=1)
    fresh.load_state_dict(torch.load(io.BytesIO(data.getvalue()), weights_only=True))
    assert not fp8_states(fresh)
    assert_same(dict(fresh.named_parameters()), dict(model.named_parameters()))
    with torch.no_grad():
        assert torch.equal(fresh(batch(5)), model(batch(5)))


def test_foreign_entries_are_refused_by_name(runs):
    model, _ = build()
    pickled = torch.frombuffer(bytearray(pickle.dumps({"recipe": None, "extra_fp8_variables": {}})),
                               dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="pickled FP8 extra state"):
        model.lin.set_extra_state(pickled)
    with pytest.raises(ValueError, match="1-D uint8"):
        model.lin.set_extra_state(torch.zeros(4))
    mlp_state = torch.load(io.BytesIO(runs["delayed"]["ckpt"]), weights_only=True)["model"]["mlp._extra_state"]
    with pytest.raises(ValueError, match="must hold 1 GEMM"):
        model.lin.set_extra_state(mlp_state)  # LayerNormMLP's two GEMMs into a Linear
    # TransformerEngine 1.x's io.BytesIO entries are read when they hold our layout.
    model.mlp.set_extra_state(io.BytesIO(mlp_state.numpy().tobytes()))
    assert torch.equal(model.mlp.get_extra_state(), mlp_state)


def test_state_follows_the_module_to_another_device(runs):
    """A state loaded (or made) on one device moves with the module to the device of its next forward instead
    of starting afresh (the meta device stands in for a GPU here)."""
    model, _ = build(seed=1)
    model.load_state_dict(torch.load(io.BytesIO(runs["delayed"]["ckpt"]), weights_only=True)["model"])
    st = model.mlp._fp8_state_fc1
    fwd, history = st.fwd_meta, st.fwd_meta.amax_history.clone()
    st.plan(RECIPES["delayed"](), None, torch.device("meta"), enabled=False)
    assert st.fwd_meta is fwd and fwd.amax_history.device.type == "meta" and fwd.scale.device.type == "meta"
    assert st.bwd_meta.amax_history.device.type == "meta" and fwd.amax_history.shape == history.shape
