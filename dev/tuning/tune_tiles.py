"""Measure candidate tiles per head dim for the forward, dK/dV and dQ kernels (H200).

The chosen tiles are frozen in transformer_engine/common/attention/plan.py: a function of
head dim, dtype, mask kind and architecture only (the determinism contract).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

import torch

# cases, common and bench_core are the user benchmark's modules (benchmarks/attention/).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "attention"))

from cases import attn_flops
from common import bench_ms
from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.common.attention.plan import Tiles, backward_plan, forward_plan, padded_head_dim
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call

# Candidates per padded head dim: forward tiles, dK/dV tiles (timed with the planned dQ tiles) and
# dQ tiles (timed with the planned dK/dV tiles), so each backward kernel is chosen on its own. The
# TMA loads and the single-loop form are swept as variants of the planned tiles (TUNE_VARIANTS="tma=0,1;
# single_loop=0,1"; NOTES.md entries 11-12).
T = Tiles


CANDIDATES = {
    64: (
        [T(128, 64, 8, 3), T(128, 64, 4, 3), T(128, 128, 8, 3), T(64, 64, 4, 3), T(128, 32, 4, 3), T(128, 64, 8, 4)],
        [T(32, 128, 4, 3), T(64, 128, 8, 3), T(64, 64, 4, 3), T(32, 64, 4, 3), T(64, 128, 4, 3), T(128, 128, 8, 3)],
        [T(128, 64, 8, 2), T(128, 64, 8, 3), T(64, 64, 4, 3), T(128, 128, 8, 3), T(64, 128, 4, 3), T(128, 32, 4, 3)],
    ),
    128: (
        # Session 6 (run 5): 4-stage pipelines against the planned 3 stages, each planned tile twice (the
        # spread of one run). Earlier session-6 rows (64x64 forwards, 32-row and TMA dK/dV tiles: within noise
        # or slower) in dev/results/tune_session6.json, NOTES.md entry 13.
        [T(128, 64, 8, 3, head_group=8), T(128, 64, 8, 4, head_group=8), T(128, 64, 8, 3, head_group=8)],
        [T(64, 128, 8, 3, head_group=8), T(64, 128, 8, 4, head_group=8), T(64, 128, 8, 3, head_group=8)],
        [T(128, 64, 8, 3, head_group=8), T(128, 64, 8, 4, head_group=8)],
    ),
    256: (
        [T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 32, 8, 2), T(64, 32, 4, 2), T(128, 64, 8, 3)],
        [T(64, 64, 8, 2), T(64, 32, 8, 2), T(32, 64, 4, 2), T(128, 64, 8, 1), T(64, 128, 8, 2)],
        [T(64, 64, 8, 2), T(128, 32, 8, 2), T(64, 32, 4, 2), T(128, 64, 8, 1), T(128, 64, 8, 2)],
    ),
    # d_qk padded to 256 with d_v to 128 ("192v128", ArchTables.narrow_v): the d=256 tiles against the
    # narrow-V winners of the d=256 candidates and their single-loop and deeper-pipeline forms.
    (256, 128): (
        [T(128, 64, 8, 2, single_loop=True), T(128, 64, 8, 3), T(128, 64, 8, 3, single_loop=True),
         T(128, 32, 8, 4)],
        [T(64, 64, 8, 2, single_loop=True), T(64, 128, 8, 2), T(64, 128, 8, 2, single_loop=True), T(64, 64, 8, 3),
         T(64, 64, 8, 3, single_loop=True), T(32, 128, 8, 2)],
        # dQ: 128x64 at 2 stages miscompiles split (ArchTables.narrow_v_split_dq): not timed.
        [T(128, 32, 8, 2), T(128, 64, 8, 1), T(128, 32, 8, 3), T(64, 64, 8, 2), T(64, 32, 4, 2)],
    ),
}


# dK and dV as two passes (BackwardPlan.dv; TUNE_DV=1 times these (dK tiles, dV tiles) pairs with the planned dQ,
# after the planned single pass): each pass keeps one [keys, d] accumulator, so wider key blocks fit at d=256.
DV_CANDIDATES = {
    # sm_90 compiles without stack (kernels.resources --kernel dk / dv): dK 32x128 (197 KiB of shared memory),
    # 32x64 and 16x128; dV 64x128 (197 KiB; 8 B of stack when causal) and 32x128. The one pass spills there.
    256: [(T(64, 64, 8, 2, single_loop=True), T(64, 128, 8, 2)),
          (T(32, 128, 8, 2), T(64, 128, 8, 2)),
          (T(32, 128, 8, 2), T(32, 128, 8, 2)),
          (T(32, 64, 8, 2), T(64, 128, 8, 2)),
          (T(16, 128, 8, 2), T(64, 128, 8, 2)),
          (T(32, 128, 8, 2, single_loop=True), T(64, 128, 8, 2, single_loop=True))],
}


def variant_candidates(planned, combos):
    """The planned tiles of each kernel with each combination of Tiles fields in ``combos`` (dicts)."""
    return tuple([dataclasses.replace(t, **combo) for combo in combos] for t in planned)


def parse_variants(spec):
    """Tiles-field combinations to sweep: 'head_group=1,2,4' -> [{'head_group': 1}, ...];
    'tma=0,1;single_loop=0,1' -> the four combinations of both fields (booleans as 0/1)."""
    fields = []
    for part in spec.split(";"):
        field, values = part.split("=")
        kind = type(getattr(Tiles(1, 1, 1, 1), field))
        fields.append([(field, kind(int(v))) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*fields)]


def main(dims=(128, 256), causal_kinds=(False, True), out=None, variants=None):
    """Time each kernel's candidates; with ``variants`` (parse_variants), the planned tiles with each
    combination of Tiles fields instead of the CANDIDATES table."""
    results = {}

    def save():  # after every measurement, so a run cut off by its time limit keeps what finished
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)

    shapes = [tuple(int(x) for x in shape.split(",")) for shape in os.environ.get("TUNE_SHAPES", "").split(";")
              if shape]  # "b,h,s;b,h,s": these shapes instead of one per head dim
    # "fwd": the forward candidates only; "dq": the dQ candidates only (with the planned dK/dV tiles)
    kernels = os.environ.get("TUNE_KERNELS", "fwd,bwd").split(",")
    masks = os.environ.get("TUNE_MASKS", "none,causal").split(",")  # "causal": causal masks only
    causal_kinds = [c for c in causal_kinds if ("causal" if c else "none") in masks]
    for dim, causal, shape in itertools.product(dims, causal_kinds, shapes or [None]):
        d, dv = (dim, dim) if isinstance(dim, int) else dim  # (d_qk, d_v): "192v128" on the command line
        b, h, s = (4, 16, 4096) if d >= 128 else (8, 32, 2048)
        if d > 128:
            b = 2
        if shape:
            b, h, s = shape
        hk = int(os.environ.get("TUNE_KV_HEADS", h))  # fewer KV heads: the GQA variants of the kernels
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, dv, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
        fmt = QKVFormat.BSHD
        mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
        call = fused_call(fmt, mask, None, d ** -0.5)
        cfg = kernel_runner.plan_key(q, k, v, call)
        base_f = forward_plan(cfg)
        base_b = backward_plan(cfg)
        o, lse = kernel_runner.forward(q, k, v, call)
        key = f"d{d}" + (f"v{dv}" if dv != d else "") + f"_{'causal' if causal else 'none'}" + \
            (f"_{b}x{h}x{s}" if shape else "") + (f"_kv{hk}" if hk != h else "")
        results[key] = {}
        fwd_cands, dkdv_cands, dq_cands = (
            variant_candidates((base_f.tiles, base_b.dkdv, base_b.dq), variants) if variants
            else CANDIDATES.get((padded_head_dim(d), padded_head_dim(dv)))
            or CANDIDATES[max(padded_head_dim(d), padded_head_dim(dv))])
        for t in fwd_cands if "fwd" in kernels else []:
            try:
                plan = dataclasses.replace(base_f, tiles=t, warp_specialized=None)  # the Triton kernel
                ms = bench_ms(lambda: kernel_runner.forward(q, k, v, call, plan))
                results[key][f"fwd {t}"] = round(attn_flops(b, h, s, s, d, causal, "fwd", dv) / ms / 1e9, 1)
            except Exception as err:
                results[key][f"fwd {t}"] = f"fail {type(err).__name__}"
            print(key, "fwd", t, results[key][f"fwd {t}"], flush=True)
            save()
        pairs = [(t, base_b.dq, None) for t in dkdv_cands if "dq" not in kernels] + [
            (base_b.dkdv, t, None) for t in dq_cands if t != base_b.dq or "dq" in kernels]
        if os.environ.get("TUNE_DV") == "1":  # the planned single pass, then the two-pass pairs
            pairs = [(base_b.dkdv, base_b.dq, None)] + [(t1, base_b.dq, t3)
                                                        for t1, t3 in DV_CANDIDATES.get(padded_head_dim(d), [])]
        if "bwd" not in kernels and "dq" not in kernels:
            pairs = []
        for t1, t2, t3 in pairs:
            name = f"bwd {t1} {t2}" + (f" dv {t3}" if t3 is not None else "")
            try:
                plan = dataclasses.replace(base_b, dkdv=t1, dq=t2, dv=t3, dq_warp_specialized=None,
                                           dkdv_warp_specialized=None)  # the Triton kernels
                ms = bench_ms(lambda: kernel_runner.backward(q, k, v, o, do, lse, call, plan))
                results[key][name] = round(attn_flops(b, h, s, s, d, causal, "bwd", dv) / ms / 1e9, 1)
            except Exception as err:
                results[key][name] = f"fail {type(err).__name__}"
            print(key, name, results[key][name], flush=True)
            save()
    return results


def parse_dim(text: str):
    """'128' -> 128; '192v128' -> (192, 128) (d_qk, d_v)."""
    if "v" in text:
        d, dv = text.split("v")
        return int(d), int(dv)
    return int(text)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tune.json"
    dims = tuple(parse_dim(d) for d in sys.argv[2].split(",")) if len(sys.argv) > 2 else (128, 256)
    main(dims, out=out, variants=parse_variants(sys.argv[3]) if len(sys.argv) > 3 else None)
