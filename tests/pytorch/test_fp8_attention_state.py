"""DotProductAttention's FP8 (fp8_dpa) delayed-scaling state is the modules' kind: DelayedScalingMeta registered in
FP8GlobalStateManager's buffer beside Linear's, amaxes all-reduced (MAX) over the autocast's group, and saved as the
module's ``_extra_state``, so a run checkpointed at step k and resumed in a fresh model continues bitwise. CPU under
Triton's interpreter."""

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling  # noqa: E402
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"  # qa/L1_pytorch_gpu runs these on CUDA (TRITON_INTERPRET=0)
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

B, S, H, D = 2, 16, 2, 16
RECIPE = DelayedScaling(amax_history_len=3, fp8_dpa=True)


class _Block(torch.nn.Module):
    """QKV projection, FP8 attention, output projection."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.qkv = te.Linear(H * D, 3 * H * D, params_dtype=torch.float32, device=DEVICE)
        self.attn = te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format="bshd").to(DEVICE)
        self.proj = te.Linear(H * D, H * D, params_dtype=torch.float32, device=DEVICE)

    def forward(self, x):
        q, k, v = self.qkv(x).reshape(B, S, 3, H, D).unbind(2)
        return self.proj(self.attn(q, k, v))


def _data(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(B, S, H * D, generator=g).to(DEVICE) * (1 + i) for i in range(n)]


def _train(model, data, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in steps:
        opt.zero_grad()
        with te.autocast(enabled=True, recipe=RECIPE):
            out = model(data[i])
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _attention_state(model):
    st = model.attn._fp8_attention_state
    return [t.clone() for m in (st.fwd_meta, st.bwd_meta) for t in (m.scale, m.amax_history)]


def test_attention_metas_are_registered_with_the_linear_metas():
    FP8GlobalStateManager.reset()
    model = _Block(0)
    _train(model, _data(1), [0])
    st = model.attn._fp8_attention_state
    for forward, meta in ((True, st.fwd_meta), (False, st.bwd_meta)):
        registered = list(FP8GlobalStateManager._DELAYED_METAS[forward].values())
        assert len(registered) == 3 and any(m is meta for m in registered)
    # updated at the step's end (forward at the autocast's exit, backward after the backward): rolled once
    assert st.fwd_meta.amax_history[-1].gt(0).all() and st.fwd_meta.amax_history[:-1].eq(0).all()
    assert st.bwd_meta.amax_history[-1, 0] > 0 and not torch.equal(st.bwd_meta.scale, torch.ones(5))


def test_checkpoint_at_step_k_resumed_in_a_fresh_model_is_bitwise_the_uninterrupted_run():
    n, k = 4, 2
    data = _data(n)
    FP8GlobalStateManager.reset()
    ref = _Block(0)
    ref_losses = _train(ref, data, range(n))
    FP8GlobalStateManager.reset()
    first = _Block(0)
    _train(first, data, range(k))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    assert first.state_dict()["attn._extra_state"].numel() > 0

    def resumed(keep_attention_state):
        FP8GlobalStateManager.reset()
        model = _Block(1)  # other weights: all of it comes from the checkpoint
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        if not keep_attention_state:
            state["attn._extra_state"] = torch.empty(0, dtype=torch.uint8)
        model.load_state_dict(state, strict=True)
        return model, _train(model, data, range(k, n))

    model, losses = resumed(True)
    assert torch.equal(losses, ref_losses[k:]), (losses, ref_losses[k:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(_attention_state(model), _attention_state(ref)))
    _, control = resumed(False)  # without the attention's FP8 state the run restarts its scales
    assert not torch.equal(control, ref_losses[k:])


_REDUCTION_WORKER = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 16, 1, 16, generator=g).mul(1 + 7 * rank).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 16, 16, generator=g) * (8 - 7 * rank)  # rank 0: the larger gradient
    dpa = te.DotProductAttention(1, 16, attn_mask_type="causal", qkv_format="bshd")
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=2, fp8_dpa=True),
                     amax_reduction_group=dist.group.WORLD):
        out = dpa(q, k, v)
    out.backward(dout)
    st = dpa._fp8_attention_state
    mine = torch.stack([q.detach().abs().max(), dout.abs().max()])
    got = torch.stack([st.fwd_meta.amax_history[-1, 0], st.bwd_meta.amax_history[-1, 0]])
    both, theirs = [torch.zeros(2) for _ in range(2)], [torch.zeros(2) for _ in range(2)]
    dist.all_gather(both, got)
    dist.all_gather(theirs, mine)
    want = torch.maximum(theirs[0], theirs[1])
    assert torch.equal(both[0], want) and torch.equal(both[1], want), (both, want)
    assert not torch.equal(theirs[0], theirs[1])
    dist.barrier()
    print("PASS", rank, flush=True)
    os._exit(0)  # as test_fp8_linear's worker: no gloo teardown at exit
""")


@pytest.mark.skipif(DEVICE != "cpu", reason="two gloo ranks on the CPU")
def test_attention_amaxes_are_all_reduced_max_over_the_group(tmp_path):
    store = str(tmp_path / "store")
    script = tmp_path / "worker.py"
    script.write_text(_REDUCTION_WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS {rank}" in out, err[-3000:]
