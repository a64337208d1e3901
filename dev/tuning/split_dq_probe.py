"""Which inputs, tiles or compiler settings make the split 192/128 dQ kernel fault on the GPU.

With dQ tiles of 128x64 at 2 stages, test_fused_attn_split's packed case with gaps (padding_causal, gap 3)
hit an illegal address in attn_bwd_dq_kernel in plain runs, and ran clean under compute-sanitizer memcheck,
with CUDA's own ptxas and at -O0 (a miscompile: ArchTables.narrow_v_split_dq). "base" is the plan as it is,
"dq_128x64x2" the tiles that faulted. Each variant runs in a process of its own (a fault poisons the process)
and prints one line:

    python dev/tuning/split_dq_probe.py            # every variant
    python dev/tuning/split_dq_probe.py base       # one
"""
import dataclasses
import os
import subprocess
import sys

CUDA_PTXAS = "/usr/local/cuda/bin/ptxas"
FAULTED_DQ = [128, 64, 8, 2]
VARIANTS = {
    "base": {},
    "no_empty": {"lengths": [131, 1, 256, 17]},
    "no_one": {"lengths": [131, 0, 256, 17]},
    "gap0": {"gap": 0},
    "only256": {"lengths": [256]},
    "mha": {"hk": 4},
    "dq_128x64x2": {},
    "dq_stages1": {"dq": [128, 64, 8, 1]},
    "dq_n32": {"dq": [128, 32, 8, 2]},
    "dq_unsplit": {"dq_unsplit": 1},
    "nosplit": {"nosplit": 1},
    "cuda_ptxas": {"env": {"TRITON_PTXAS_PATH": CUDA_PTXAS}},
    "ptxas_O0": {"env": {"DISABLE_PTXAS_OPT": "1", "TRITON_DISABLE_PTXAS_OPT": "1"}},
}


def one(name):
    v = VARIANTS[name]
    import torch
    from transformer_engine.common.attention import launch_description, plan
    t = plan.ARCHS["sm90"]
    # Every variant but "base" changes one thing on top of the tiles that faulted.
    dq = v.get("dq", None if name == "base" else FAULTED_DQ)
    if dq is not None:
        t = dataclasses.replace(t, narrow_v_split_dq=plan.Tiles(*dq))
    if "nosplit" in v:
        t = dataclasses.replace(t, narrow_v_split=())
    plan.ARCHS["sm90"] = t
    if "dq_unsplit" in v:  # the dQ pass on one 256-wide Q/K tile, the others split
        original = launch_description.backward_launches

        def backward_launches(*args, **kwargs):
            out = []
            for launch in original(*args, **kwargs):
                if launch.name == "attn_bwd_dq_kernel":
                    launch = dataclasses.replace(launch, args=dict(launch.args, BLOCK_DQK=256, BLOCK_DQK2=0))
                out.append(launch)
            return tuple(out)
        launch_description.backward_launches = backward_launches  # the kernel runner reads it per call
    from transformer_engine.pytorch.attention.fused_attn import fused_attn_func
    lengths, gap = v.get("lengths", [131, 1, 0, 256, 17]), v.get("gap", 3)
    h, hk, d, dv = 4, v.get("hk", 2), 192, 128
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    starts.append(pos)
    g = torch.Generator().manual_seed(5)
    q, k, vv = (torch.randn(pos, hh, dd, generator=g).to("cuda", torch.bfloat16).requires_grad_()
                for hh, dd in ((h, d), (hk, d), (hk, dv)))
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
    cp = torch.tensor(starts, dtype=torch.int32, device="cuda") if gap else None
    out = fused_attn_func(q, k, vv, "thd", "padding_causal", (-1, -1), d ** -0.5, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          cu_seqlens_q_padded=cp, cu_seqlens_kv_padded=cp, max_seqlen_q=max(lengths),
                          max_seqlen_kv=max(lengths), deterministic=True)
    torch.cuda.synchronize()
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, vv), do)
    torch.cuda.synchronize()
    print("ok, finite:", all(bool(torch.isfinite(x).all()) for x in grads), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
        sys.exit(0)
    for name, v in VARIANTS.items():
        env = dict(os.environ, **v.get("env", {}))
        try:
            r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=60, env=env)
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:]
            print(f"{name}: rc={r.returncode} {tail}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{name}: timeout", flush=True)
