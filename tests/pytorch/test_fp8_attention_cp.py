"""FP8 attention under context parallelism: cp_comm_type="a2a" under Float8CurrentScaling(fp8_dpa=True) on two
gloo ranks gives each rank's tokens bitwise the cp=1 output and gradients, with per-sequence scales
(``DotProductAttention.fp8_dpa_scaling = "per_sequence"``: every kv head scaled from its own amax) and with
per-tensor ones (the amaxes all-reduced over the a2a group); DelayedScaling under CP is refused by name. CPU under
Triton's interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="two gloo ranks on the CPU under Triton's interpreter")

_WORKER = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
    rank, cp = int(sys.argv[1]), 2
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=cp)
    B, S, H, D = 2, 16, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g) * (1 + 3 * i) for i in range(3))
    dout = torch.randn(B, S, H * D, generator=g)
    chunk = S // (2 * cp)  # the load-balanced split: chunks rank and 2cp-1-rank
    own = [c * chunk + i for c in (rank, 2 * cp - 1 - rank) for i in range(chunk)]
    def run(dpa, q, k, v, dout, recipe=Float8CurrentScaling(fp8_dpa=True)):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        with te.autocast(enabled=True, recipe=recipe):
            out = dpa(q, k, v)
        out.backward(dout)
        assert dpa.last_backend == "FusedAttention(FP8)"
        return [out.detach(), q.grad, k.grad, v.grad]

    single = te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format="bshd")
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format="bshd", cp_group=dist.group.WORLD,
                                 cp_comm_type="a2a")
    for scaling in ("per_sequence", "per_tensor"):
        single.fp8_dpa_scaling = dpa.fp8_dpa_scaling = scaling
        ref = [t[:, own] for t in run(single, q, k, v, dout)]
        got = run(dpa, q[:, own], k[:, own], v[:, own], dout[:, own])
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert torch.equal(a, b), (scaling, name, (a - b).abs().max())
    try:
        run(dpa, q[:, own], k[:, own], v[:, own], dout[:, own], DelayedScaling(fp8_dpa=True))
        raise AssertionError("delayed FP8 under CP ran")
    except NotImplementedError as err:
        assert "cp_comm_type='a2a' under Float8CurrentScaling" in str(err), err
    dist.barrier()
    print("PASS", rank, flush=True)
    os._exit(0)  # as test_fp8_linear's worker: no gloo teardown at exit
""")


def test_a2a_cp2_equals_cp1_bitwise_under_current_scaling(tmp_path):
    store = str(tmp_path / "store")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS {rank}" in out, err[-3000:]
