"""The grid of configs whose SM90 (Hopper) plans are recorded in data/sm90_plans.json, and how a plan is
recorded: tiles, warp-specialized tiles and kernels.

The record holds the distinct plans and, for each case of :func:`grid` in order, its plan's index.
It was made from the plans before the per-architecture tables existed; the per-architecture work
must leave every SM90 plan as it was (tests/common/test_plan_archs.py). Regenerate it only on purpose, when
an SM90 plan changes after measurement: ``python tests/common/sm90_plan_grid.py``.
"""

import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from transformer_engine.common import settings  # noqa: E402
from transformer_engine.common.attention import AttnBiasType, AttnConfig, AttnMaskType  # noqa: E402
from transformer_engine.common.attention.plan import backward_plan, forward_plan  # noqa: E402

RECORD = os.path.join(os.path.dirname(__file__), "data", "sm90_plans.json")

DIMS = [(16, 16), (32, 32), (40, 40), (64, 64), (72, 72), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256)]
MASKS = [(AttnMaskType.NO_MASK, (-1, -1)), (AttnMaskType.CAUSAL_MASK, (-1, -1)),
         (AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, (64, 0)), (AttnMaskType.PADDING_MASK, (32, 32))]
DTYPES = ["float16", "bfloat16", "float32"]
MODS = {"none": dict(), "bias": dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS, bias_shape="1hss"),
        "alibi": dict(attn_bias_type=AttnBiasType.ALIBI), "dropout": dict(dropout_probability=0.1)}


def grid():
    """(key, config, NVTE_FUSED_ATTN_WS value) for every recorded case."""
    for dims, (mask, window), dtype, mod, det, hk, ws in itertools.product(
            DIMS, MASKS, DTYPES, MODS, (True, False), (16, 4), ("1", "0")):
        cfg = AttnConfig.of(batch_size=2, num_heads_q=16, num_heads_kv=hk, head_dim_qk=dims[0], head_dim_v=dims[1],
                         max_seqlen_q=1024, max_seqlen_kv=1024, dtype=dtype, attn_mask_type=mask, window_size=window,
                         deterministic=det, device_type="cuda", compute_capability=(9, 0), **MODS[mod])
        key = f"d={dims[0]}/{dims[1]} {mask.value} {window} {dtype} {mod} det={int(det)} h_kv={hk} ws={ws}"
        yield key, cfg, ws


def record(cfg, ws):
    """The plan of ``cfg`` under NVTE_FUSED_ATTN_WS=ws as plain data (the separate dV pass or second Q/K
    tile width left out where there is none)."""
    with settings.environment(NVTE_FUSED_ATTN_WS=ws):
        fwd, bwd = dataclasses.asdict(forward_plan(cfg)), backward_plan(cfg)
    kernels = bwd.kernels
    bwd = dataclasses.asdict(bwd)
    # The record predates the separate dV pass and the Q/K split: a plan without them records as it did.
    if bwd["dv"] is None and bwd["dv_warp_specialized"] is None:
        bwd.pop("dv")
        bwd.pop("dv_warp_specialized")
    for plan in (fwd, bwd):
        if plan["block_dqk2"] == 0:
            plan.pop("block_dqk2")
    if fwd["kv_chunk_registers"] is None:  # likewise the chunked forward's register cap (d=64 only)
        fwd.pop("kv_chunk_registers")
    return json.dumps(dict(fwd=fwd, bwd=bwd, kernels=kernels), sort_keys=True)


def main():
    plans, cases = [], []
    for key, cfg, ws in grid():
        text = record(cfg, ws)
        if text not in plans:
            plans.append(text)
        cases.append(plans.index(text))
    # One plan per line, then each case's plan index in grid() order.
    with open(RECORD, "w") as f:
        f.write('{"plans": [\n' + ",\n".join(plans) + '\n],\n"cases": ' + json.dumps(cases) + "}\n")
    print(f"{len(cases)} cases, {len(plans)} distinct plans -> {RECORD}")


if __name__ == "__main__":
    main()
