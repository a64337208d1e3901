"""Launch plans follow the determinism contract: tiles and kernel variants are a
function of head dim, dtype, mask/window kind and architecture only, and deterministic plans never
use atomics."""

import dataclasses
import itertools

import pytest

from transformer_engine.common.attention import AttnConfig, AttnMaskType, QKVLayout
from transformer_engine.common.attention.plan import backward_plan, forward_plan, padded_head_dim

BASE = AttnConfig.of(batch_size=2, num_heads_q=16, num_heads_kv=16, head_dim_qk=128, head_dim_v=128,
                  max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", deterministic=True,
                  device_type="cuda", compute_capability=(9, 0))


@pytest.mark.parametrize("arch", [(9, 0), (8, 0), (10, 0)])
@pytest.mark.parametrize("mask", [AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_MASK])
@pytest.mark.parametrize("dims", [(64, 64), (72, 72), (128, 128), (192, 128), (256, 256)])
def test_plans_ignore_batch_lengths_heads_and_layout(arch, mask, dims):
    base = BASE.replace(compute_capability=arch, attn_mask_type=mask, head_dim_qk=dims[0],
                               head_dim_v=dims[1])
    fwd, bwd = forward_plan(base), backward_plan(base)
    for batch, (sq, sk), (hq, hk), layout in itertools.product(
        (1, 3, 64), ((1, 1), (97, 1000), (131072, 131072)), ((16, 16), (32, 8), (8, 1)),
        (QKVLayout.BSHD_BSHD_BSHD, QKVLayout.SBHD_SB2HD, QKVLayout.THD_THD_THD),
    ):
        other = base.replace(batch_size=batch, max_seqlen_q=sq, max_seqlen_kv=sk, num_heads_q=hq,
                                    num_heads_kv=hk, qkv_layout=layout)
        assert forward_plan(other) == fwd
        assert backward_plan(other) == bwd


def test_plans_never_use_atomics_and_ignore_the_determinism_mode():
    """The backward runs a separate dQ pass in both modes (no atomic variant exists): one plan for both."""
    for dims, arch, mask in itertools.product(((64, 64), (128, 128), (256, 256)), ((9, 0), (8, 0)),
                                              (AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK)):
        cfg = BASE.replace(head_dim_qk=dims[0], head_dim_v=dims[1], compute_capability=arch,
                                  attn_mask_type=mask)
        plan = backward_plan(cfg)
        assert not any("atomic" in name for name in plan.kernels)
        for deterministic in (True, False):
            assert backward_plan(cfg.replace(deterministic=deterministic)) == plan


def test_padded_head_dim():
    assert [padded_head_dim(d) for d in (8, 16, 24, 64, 72, 96, 128, 160, 192, 256)] == \
        [16, 16, 32, 64, 128, 128, 128, 256, 256, 256]


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)])
def test_dbias_tiles_come_from_the_dq_plan(dims):
    """The launch description (common.attention.launch_description) takes the dBias kernel's tiles from the
    plan: square, at most 64 rows, the dQ pass's warps, one stage."""
    plan = backward_plan(BASE.replace(head_dim_qk=dims[0], head_dim_v=dims[1]))
    t = plan.dbias
    assert t.block_m == t.block_n == min(plan.dq.block_m, 64)
    assert (t.num_warps, t.num_stages) == (plan.dq.num_warps, 1)


def test_mask_flags_and_top_left_causal():
    """One rule for both launchers: causal masks close the right side; BOTTOM_RIGHT is the config's
    resolved diagonal alignment."""
    from transformer_engine.common.attention.plan import mask_flags

    top_left = {m for m in AttnMaskType if m.is_top_left_causal()}
    assert top_left == {AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK}

    def flags(mask, window, **kw):
        return mask_flags(BASE.replace(attn_mask_type=mask, window_size=window, **kw))

    assert flags(AttnMaskType.CAUSAL_MASK, (-1, 0)) == (dict(HAS_LEFT=False, HAS_RIGHT=True, BOTTOM_RIGHT=False), 0, 0)
    assert flags(AttnMaskType.NO_MASK, (64, 16)) == (dict(HAS_LEFT=True, HAS_RIGHT=True, BOTTOM_RIGHT=True), 64, 16)
    assert flags(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, (8, 0))[0]["BOTTOM_RIGHT"]
    # The switch moves the diagonal of the non-causal masks only; the causal masks fix it.
    assert not flags(AttnMaskType.NO_MASK, (64, 16), bottom_right_diagonal=False)[0]["BOTTOM_RIGHT"]
    assert not flags(AttnMaskType.PADDING_MASK, (4, 4), bottom_right_diagonal=False)[0]["BOTTOM_RIGHT"]
    assert not flags(AttnMaskType.CAUSAL_MASK, (4, 0), bottom_right_diagonal=True)[0]["BOTTOM_RIGHT"]
    assert flags(AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, (4, 0), bottom_right_diagonal=False)[0]["BOTTOM_RIGHT"]
    # Framework defaults: TransformerEngine-PyTorch bottom-right, TransformerEngine-JAX top-left.
    assert not flags(AttnMaskType.PADDING_MASK, (4, 4), framework="jax")[0]["BOTTOM_RIGHT"]
    assert flags(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, (4, 0), framework="jax")[0]["BOTTOM_RIGHT"]
    assert flags(AttnMaskType.PADDING_MASK, (4, 4), framework="jax", bottom_right_diagonal=True)[0]["BOTTOM_RIGHT"]


def test_resolve_bottom_right_diagonal_rejects_non_bools():
    from transformer_engine.common.attention.config import resolve_bottom_right_diagonal

    with pytest.raises(ValueError, match="`bottom_right_diagonal` must be None or a bool, got 1"):
        resolve_bottom_right_diagonal(AttnMaskType.NO_MASK, 1)


def test_warp_specialized_kernels_where_they_serve():
    """The Gluon forward, dK/dV and dQ (kernels/hopper_ws.py) serve Hopper, d_qk = d_v = 128, fp16/bf16, no bias
    or dropout, any mask or window, MHA or GQA; NVTE_FUSED_ATTN_WS=0 keeps the Triton kernels."""
    from transformer_engine.common import settings
    from transformer_engine.common.attention import AttnBiasType

    for dtype, mask, window, hk in itertools.product(("bfloat16", "float16"),
                                                     (AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK),
                                                     ((-1, -1), (64, 0)), (16, 2)):
        cfg = BASE.replace(dtype=dtype, attn_mask_type=mask, window_size=window, num_heads_kv=hk)
        fwd, bwd = forward_plan(cfg), backward_plan(cfg)
        assert fwd.warp_specialized is not None and fwd.warp_specialized.max_registers is not None
        assert bwd.dq_warp_specialized is not None and bwd.dq_warp_specialized.block_m == 128
        assert bwd.dkdv_warp_specialized is not None and bwd.dkdv_warp_specialized.block_n == 128
    for other in (dict(dtype="float32"), dict(head_dim_qk=64, head_dim_v=64), dict(head_dim_v=64),
                  dict(compute_capability=(8, 0)), dict(compute_capability=(10, 0)), dict(device_type="cpu"),
                  dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS, bias_shape="1hss"), dict(dropout_probability=0.1),
                  dict(attn_bias_type=AttnBiasType.ALIBI)):
        cfg = BASE.replace(**other)
        assert forward_plan(cfg).warp_specialized is None, other
        assert backward_plan(cfg).dq_warp_specialized is None, other
        assert backward_plan(cfg).dkdv_warp_specialized is None, other
    with settings.environment(NVTE_FUSED_ATTN_WS="0"):
        assert forward_plan(BASE).warp_specialized is None
        assert backward_plan(BASE).dq_warp_specialized is None
        assert backward_plan(BASE).dkdv_warp_specialized is None
    nondet = BASE.replace(deterministic=False)
    assert backward_plan(nondet).dq_warp_specialized is not None  # the separate dQ pass serves both modes
    assert backward_plan(nondet).dkdv_warp_specialized is not None


def test_warp_specialized_forward_and_dq_take_the_qk_split():
    """At d_qk 192 / d_v 128 (Hopper splits Q/K as 128 + 64) the Gluon forward and dQ serve fp16/bf16 without
    bias or dropout, with the split's chunks; dK/dV stays on the Triton kernel. A d_v that does not fill its
    tile, fp32, a bias, dropout and NVTE_FUSED_ATTN_WS=0 keep the Triton kernels."""
    from transformer_engine.common import settings
    from transformer_engine.common.attention import AttnBiasType

    split = BASE.replace(head_dim_qk=192, head_dim_v=128)
    for dtype, mask, hk in itertools.product(("bfloat16", "float16"),
                                             (AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK), (16, 2)):
        cfg = split.replace(dtype=dtype, attn_mask_type=mask, num_heads_kv=hk)
        fwd, bwd = forward_plan(cfg), backward_plan(cfg)
        assert (fwd.block_dqk, fwd.block_dqk2, bwd.block_dqk, bwd.block_dqk2) == (128, 64, 128, 64)
        assert fwd.warp_specialized is not None and bwd.dq_warp_specialized is not None
        assert bwd.dkdv_warp_specialized is None and bwd.dv_warp_specialized is None
    for other in (dict(head_dim_v=96), dict(dtype="float32"), dict(dropout_probability=0.1),
                  dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS, bias_shape="1hss")):
        cfg = split.replace(**other)
        assert forward_plan(cfg).warp_specialized is None, other
        assert backward_plan(cfg).dq_warp_specialized is None, other
    with settings.environment(NVTE_FUSED_ATTN_WS="0"):
        assert forward_plan(split).warp_specialized is None
        assert backward_plan(split).dq_warp_specialized is None


@pytest.mark.parametrize("mask", [AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK])
def test_plans_read_a_key_without_batch_or_lengths(mask):
    """Every plan function reads a config through its PlanKey, which holds no batch size, sequence length or
    determinism mode; the launch description's Call gives the same key as the AttnConfig it describes."""
    from transformer_engine.common.attention.config import PlanKey
    from transformer_engine.common.attention.kernels.resources import contiguous_call

    cfg = BASE.replace(attn_mask_type=mask, window_size=(64, 0))
    key = cfg.plan_key
    assert not {f.name for f in dataclasses.fields(PlanKey)} & {"batch_size", "max_seqlen_q", "max_seqlen_kv",
                                                                 "num_heads_q", "deterministic", "qkv_layout"}
    assert (forward_plan(key), backward_plan(key)) == (forward_plan(cfg), backward_plan(cfg))
    assert contiguous_call(cfg, batch=3, seqlen=97).plan_key == key


def test_the_chunked_forwards_register_cap_is_hoppers_16_bit_d64_only():
    """ArchTables.kv_chunk_registers: Hopper's 16-bit d=64 forward caps its chunked sum at the unchunked occupancy
    step (two programs of 8 warps per SM unbounded, three of 4 warps bounded); every other plan has no cap."""
    for (dim, mask), arch, dtype in itertools.product(
            ((40, AttnMaskType.NO_MASK), (64, AttnMaskType.NO_MASK), (64, AttnMaskType.CAUSAL_MASK),
             (64, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK), (32, AttnMaskType.NO_MASK),
             (128, AttnMaskType.NO_MASK), (256, AttnMaskType.CAUSAL_MASK)),
            ((9, 0), (8, 0), (10, 0)), ("bfloat16", "float16", "float32")):
        cfg = BASE.replace(head_dim_qk=dim, head_dim_v=dim, attn_mask_type=mask, compute_capability=arch,
                                  dtype=dtype)
        cap = forward_plan(cfg).kv_chunk_registers
        if arch == (9, 0) and padded_head_dim(dim) == 64 and dtype != "float32":
            assert cap == (168 if mask.is_causal() else 128), (dim, mask, dtype)
        else:
            assert cap is None, (dim, mask, arch, dtype)
    assert forward_plan(BASE.replace(head_dim_qk=64, head_dim_v=64, device_type="cpu",
                                            compute_capability=None)).kv_chunk_registers is None


def test_a_forced_plan_carries_no_register_cap(monkeypatch):
    """NVTE_FUSED_ATTN_PLAN_ARCH=sm90 on another GPU plans sm90's Triton tiles without the register cap tuned to
    sm_90's compile (as without its Gluon kernels)."""
    cfg = BASE.replace(head_dim_qk=64, head_dim_v=64, compute_capability=(10, 0))
    monkeypatch.setenv("NVTE_FUSED_ATTN_PLAN_ARCH", "sm90")
    forced = forward_plan(cfg)
    assert forced.tiles == forward_plan(cfg.replace(compute_capability=(9, 0))).tiles
    assert forced.kv_chunk_registers is None
