"""Plans by vendor and architecture (plan.ARCHS): each GPU plans with its own tables, the Hopper plans are
what they were, the Gluon kernels serve NVIDIA SM90 only, and NVTE_FUSED_ATTN_PLAN_ARCH forces another
architecture's tiles at call time without leaving what the device can run."""

import itertools
import json
import os
import sys

import pytest

from transformer_engine.common import settings
from transformer_engine.common.attention import AttnBiasType, AttnConfig, AttnMaskType
from transformer_engine.common.attention.backends import FlashAttention, FusedAttention
from transformer_engine.common.attention.config import gfx_target
from transformer_engine.common.attention.plan import (
    AMD_ARCHS, ARCHS, backward_plan, device_arch, forward_plan, padded_head_dim, plan_arch, split_head_dim,
)

sys.path.insert(0, os.path.dirname(__file__))
import sm90_plan_grid  # noqa: E402

BASE = AttnConfig.of(batch_size=2, num_heads_q=16, num_heads_kv=16, head_dim_qk=128, head_dim_v=128,
                  max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", deterministic=True,
                  device_type="cuda", compute_capability=(9, 0))

# The GPU each architecture's plan is for, as the frontends describe it.
DEVICES = {
    "sm80": dict(compute_capability=(8, 0)), "sm89": dict(compute_capability=(8, 9)),
    "sm90": dict(compute_capability=(9, 0)), "sm100": dict(compute_capability=(10, 0)),
    "sm120": dict(compute_capability=(12, 0)),
    "gfx90a": dict(vendor="amd", compute_capability=None, gfx_arch="gfx90a"),
    "gfx942": dict(vendor="amd", compute_capability=None, gfx_arch="gfx942"),
    "gfx950": dict(vendor="amd", compute_capability=None, gfx_arch="gfx950"),
}
DIMS = [(16, 16), (64, 64), (72, 72), (128, 128), (128, 64), (192, 128), (256, 256)]
WINDOWS = [(AttnMaskType.NO_MASK, (-1, -1)), (AttnMaskType.CAUSAL_MASK, (-1, -1)), (AttnMaskType.NO_MASK, (32, 32))]


def _config(arch, dims=(128, 128), mask=AttnMaskType.NO_MASK, window=(-1, -1), **fields):
    return BASE.replace(head_dim_qk=dims[0], head_dim_v=dims[1], attn_mask_type=mask,
                               window_size=window, **DEVICES[arch], **fields)


def test_sm90_plans_are_the_recorded_ones():
    """Every Hopper plan of the recorded grid (tiles, warp-specialized tiles and kernels, 3840 configs)
    is what it was before the per-architecture tables."""
    with open(sm90_plan_grid.RECORD) as f:
        recorded = json.load(f)
    cases = list(sm90_plan_grid.grid())
    assert len(cases) == len(recorded["cases"]) == 3840
    for (key, cfg, ws), index in zip(cases, recorded["cases"]):
        assert json.loads(sm90_plan_grid.record(cfg, ws)) == recorded["plans"][index], key


def test_every_plan_and_setting_names_the_same_architectures():
    assert set(settings.VARIABLES["NVTE_FUSED_ATTN_PLAN_ARCH"].choices) == {""} | set(ARCHS)
    assert set(FusedAttention.SUPPORTED_AMD_ARCHS) == set(AMD_ARCHS)
    for name, tables in ARCHS.items():
        assert tables.name == name
        assert tables.warp_size == (64 if tables.vendor == "amd" else 32)
        for table in (tables.fwd, tables.dkdv, tables.dq):
            assert set(table) == {(d, w) for d in (16, 32, 64, 128, 256) for w in (False, True)}, name


@pytest.mark.parametrize("device,arch", [
    (dict(compute_capability=(8, 0)), "sm80"), (dict(compute_capability=(8, 7)), "sm80"),
    (dict(compute_capability=(8, 6)), "sm89"), (dict(compute_capability=(8, 9)), "sm89"),
    (dict(compute_capability=(9, 0)), "sm90"), (dict(compute_capability=(10, 0)), "sm100"),
    (dict(compute_capability=(10, 3)), "sm100"), (dict(compute_capability=(12, 0)), "sm120"),
    (dict(compute_capability=(12, 1)), "sm120"), (dict(compute_capability=(13, 0)), "sm89"),
    (dict(compute_capability=None), "sm89"),
    (dict(vendor="amd", compute_capability=None, gfx_arch="gfx90a"), "gfx90a"),
    (dict(vendor="amd", compute_capability=None, gfx_arch="gfx940"), "gfx942"),
    (dict(vendor="amd", compute_capability=None, gfx_arch="gfx942"), "gfx942"),
    (dict(vendor="amd", compute_capability=None, gfx_arch="gfx950"), "gfx950"),
    # ROCm PyTorch reports CDNA GPUs as compute capability 9.x: the vendor decides, not that number.
    (dict(vendor="amd", compute_capability=(9, 4), gfx_arch="gfx942"), "gfx942"),
])
def test_each_gpu_plans_with_its_architecture(device, arch):
    assert device_arch(BASE.replace(**device)).name == arch


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("mask,window", WINDOWS)
def test_plan_is_what_the_table_says(arch, dims, mask, window):
    """16-bit plans take their tiles from the architecture's table at (padded head dim, diagonal-bounded),
    or its narrow-V tiles where d_qk pads to 256 and d_v to 128; the Gluon kernels only on SM90; fp32 plans
    clamp those tiles and run one stage (AMD: their own at d=256)."""
    cfg = _config(arch, dims, mask, window)
    key = (max(padded_head_dim(dims[0]), padded_head_dim(dims[1])), cfg.window_kind != "none")
    tables = ARCHS[arch]
    fwd, bwd = forward_plan(cfg), backward_plan(cfg)
    narrow = tables.narrow_v is not None and (padded_head_dim(dims[0]), padded_head_dim(dims[1])) == (256, 128) \
        and cfg.attn_bias_type == AttnBiasType.NO_BIAS and cfg.dropout_probability == 0
    planned = tables.narrow_v if narrow else (tables.fwd[key], tables.dkdv[key], tables.dq[key])
    if narrow and tables.splits_qk(cfg):  # d_qk 192 as 128 + 64: dQ tiles of its own
        planned = planned[:2] + (tables.narrow_v_split_dq,)
    two_pass = None if narrow or tables.dk_dv is None else tables.dk_dv.get(key)
    if two_pass is not None:  # dK then dV (BackwardPlan.dv) with their own tiles
        assert (fwd.tiles, (bwd.dkdv, bwd.dv), bwd.dq) == (planned[0], two_pass, planned[2])
    else:
        assert (fwd.tiles, bwd.dkdv, bwd.dq, bwd.dv) == planned + (None,)
    assert bwd.preprocess.block_m == 64
    ws = arch == "sm90" and dims in ((128, 128), (256, 256))
    split_ws = arch == "sm90" and tables.splits_qk(cfg)  # the Gluon forward and dQ take the Q/K split
    assert (fwd.warp_specialized is not None, bwd.dq_warp_specialized is not None,
            bwd.dkdv_warp_specialized is not None) == (ws or split_ws, ws or split_ws, ws)
    assert (bwd.dv_warp_specialized is not None) == (ws and two_pass is not None)
    fp32 = cfg.replace(dtype="float32")
    f32, b32 = forward_plan(fp32), backward_plan(fp32)
    assert f32.warp_specialized is None and b32.dv is None
    if key[0] == 256 and tables.fp32_large is not None:  # AMD: its own fp32 tiles at d=256
        assert (f32.tiles, b32.dkdv, b32.dq) == tables.fp32_large
        return
    t_fwd, t_dkdv, t_dq = planned
    assert (f32.tiles.block_m, f32.tiles.block_n, f32.tiles.num_stages) == (
        min(t_fwd.block_m, 64), min(t_fwd.block_n, 32), 1)
    assert (b32.dkdv.block_m, b32.dkdv.block_n, b32.dq.block_m, b32.dq.block_n) == (
        min(t_dkdv.block_m, 32), min(t_dkdv.block_n, 64), min(t_dq.block_m, 64), min(t_dq.block_n, 32))


@pytest.mark.parametrize("dims,narrow", [((192, 128), True), ((256, 128), True), ((160, 96), True),
                                         ((192, 192), False), ((128, 256), False), ((192, 64), False),
                                         ((128, 128), False)])
def test_narrow_v_tiles_serve_only_d_qk_256_with_d_v_128(dims, narrow):
    """Hopper's narrow-V tiles: 16-bit, padded d_qk 256 with padded d_v 128, either mask kind, no bias or
    dropout; fp32 keeps the clamp of the d=256 tiles (the same tiles either way)."""
    for mask in (AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK):
        cfg = _config("sm90", dims, mask)
        bwd = backward_plan(cfg)
        tables = ARCHS["sm90"]
        # A split Q/K head dim (192: 128 + 64) has dQ tiles of its own.
        narrow_tiles = tables.narrow_v[:2] + (
            tables.narrow_v_split_dq if tables.splits_qk(cfg) else tables.narrow_v[2],)
        assert ((forward_plan(cfg).tiles, bwd.dkdv, bwd.dq) == narrow_tiles) == narrow, (dims, mask)
        for mod in (dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS, bias_shape="1hss"),
                    dict(attn_bias_type=AttnBiasType.ALIBI), dict(dropout_probability=0.1)) if narrow else ():
            other = cfg.replace(**mod)
            assert forward_plan(other).tiles == ARCHS["sm90"].fwd[(256, mask.is_causal())], mod
            assert (backward_plan(other).dkdv, backward_plan(other).dq) == \
                (ARCHS["sm90"].dkdv[(256, mask.is_causal())], ARCHS["sm90"].dq[(256, mask.is_causal())]), mod
        if narrow:
            a, b = (_config("sm90", d, mask).replace(dtype="float32") for d in (dims, (dims[0], 256)))
            assert (forward_plan(a).tiles, backward_plan(a).dkdv, backward_plan(a).dq) == \
                (forward_plan(b).tiles, backward_plan(b).dkdv, backward_plan(b).dq)


def test_split_head_dim():
    """Two different powers of two, each at least 16: the wider chunk first."""
    assert {d: split_head_dim(d) for d in (16, 24, 32, 40, 48, 64, 72, 80, 96, 128, 160, 192, 200, 256, 384)} == {
        16: None, 24: None, 32: None, 40: None, 48: (32, 16), 64: None, 72: None, 80: (64, 16), 96: (64, 32),
        128: None, 160: (128, 32), 192: (128, 64), 200: None, 256: None, 384: (256, 128)}


SPLIT_DIMS = [(192, 128), (192, 96), (192, 192), (192, 64), (192, 256), (160, 128), (96, 96), (80, 64), (48, 48),
              (256, 128), (128, 128)]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dims", SPLIT_DIMS, ids=str)
def test_qk_splits_only_for_hoppers_narrow_v_192(arch, dims):
    """The Q/K tiles split (128 + 64) exactly where Hopper's narrow-V tiles serve d_qk = 192: 16-bit,
    d_v padding to 128, no bias or dropout, any mask; every other plan keeps one padded tile (BLOCK_DQK2 = 0)."""
    for (mask, window), dtype, mod in itertools.product(
            WINDOWS, ("float16", "bfloat16", "float32"),
            (dict(), dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS, bias_shape="1hss"),
             dict(attn_bias_type=AttnBiasType.ALIBI), dict(dropout_probability=0.1))):
        cfg = _config(arch, dims, mask, window, dtype=dtype, **mod)
        split = (arch == "sm90" and dims[0] == 192 and padded_head_dim(dims[1]) == 128 and dtype != "float32"
                 and not mod)
        want = (128, 64) if split else (padded_head_dim(dims[0]), 0)
        for plan in (forward_plan(cfg), backward_plan(cfg)):
            assert (plan.block_dqk, plan.block_dqk2) == want, (arch, dims, mask, window, dtype, mod)
            assert plan.block_dv == padded_head_dim(dims[1])


def test_qk_split_under_the_interpreter_only_where_asked():
    """CPU (interpreter) plans split only with NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK=1, then wherever
    split_head_dim allows; a GPU plan with a tile override keeps one tile (and ignores the variable)."""
    cpu = BASE.replace(device_type="cpu", compute_capability=None, dtype="float32")
    dims = {d: cpu.replace(head_dim_qk=d, head_dim_v=32) for d in (24, 40, 48, 64, 96, 192)}
    assert {d: forward_plan(c).block_dqk2 for d, c in dims.items()} == dict.fromkeys(dims, 0)
    with settings.environment(NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK="1"):
        for d, c in dims.items():
            want = split_head_dim(d) or (padded_head_dim(d), 0)
            for plan in (forward_plan(c), backward_plan(c)):
                assert (plan.block_dqk, plan.block_dqk2) == want, d
        gpu = _config("sm90", (192, 128))
        assert forward_plan(gpu).block_dqk2 == 64
        override = forward_plan(gpu, override=ARCHS["sm90"].narrow_v[0])
        assert (override.block_dqk, override.block_dqk2) == (256, 0)
        assert forward_plan(_config("sm90", (48, 32))).block_dqk2 == 0  # GPU plans: their tables decide


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_plans_ignore_batch_and_lengths_on_every_architecture(arch):
    for dims, (mask, window) in itertools.product(DIMS, WINDOWS):
        cfg = _config(arch, dims, mask, window)
        fwd, bwd = forward_plan(cfg), backward_plan(cfg)
        for batch, (sq, sk), hk in itertools.product((1, 7), ((1, 1), (97, 4096), (131072, 131072)), (16, 2)):
            other = cfg.replace(batch_size=batch, max_seqlen_q=sq, max_seqlen_kv=sk, num_heads_kv=hk)
            assert (forward_plan(other), backward_plan(other)) == (fwd, bwd)


def test_amd_tables_are_wave64_tiles_that_keep_to_four_waves():
    """CDNA programs are four waves (one per SIMD) without software pipelining: measured to spill otherwise."""
    for name in ("gfx90a", "gfx942", "gfx950"):
        for table in (ARCHS[name].fwd, ARCHS[name].dkdv, ARCHS[name].dq):
            assert {(t.num_warps, t.num_stages) for t in table.values()} == {(4, 1)}, name
        assert not ARCHS[name].warp_specialized
    assert [n for n, t in ARCHS.items() if t.warp_specialized] == ["sm90"]
    assert ARCHS["gfx942"].shared_memory == ARCHS["gfx90a"].shared_memory == 64 * 1024
    assert ARCHS["gfx950"].shared_memory == 160 * 1024


def test_gfx_target_drops_rocm_features():
    assert gfx_target("gfx942:sramecc+:xnack-") == "gfx942"
    assert gfx_target("GFX90A") == "gfx90a"
    with pytest.raises(ValueError, match="`name` must be an AMD gfx target"):
        gfx_target("9.0")


def test_backends_by_vendor():
    """The fused kernels run on CDNA2-4 and say why not elsewhere; flash-attn-4 is NVIDIA's."""
    amd = _config("gfx942")
    assert FusedAttention.not_supported_reasons(amd) == []
    assert any("vendor=amd" in r for r in FlashAttention.not_supported_reasons(amd))
    rdna = amd.replace(gfx_arch="gfx1100")
    assert any("gfx_arch=gfx1100" in r for r in FusedAttention.not_supported_reasons(rdna))
    with pytest.raises(NotImplementedError, match="`gfx_arch` must be one of"):
        forward_plan(rdna)
    assert "arch=gfx942" in amd.describe() and "arch=sm90" in BASE.describe()


# ------------------------------------------------------------------------------------------------
# NVTE_FUSED_ATTN_PLAN_ARCH
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("forced", ["sm80", "sm89", "sm100", "sm120", "gfx90a", "gfx942", "gfx950"])
def test_forced_plan_on_hopper_takes_that_architectures_tiles(forced):
    """On the H200 (sm90) each other plan can be forced: its Triton tiles, never the Gluon kernels."""
    for dims, (mask, window) in itertools.product(DIMS, WINDOWS):
        cfg = _config("sm90", dims, mask, window)
        own = _config(forced, dims, mask, window)
        with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH=forced):
            fwd, bwd = forward_plan(cfg), backward_plan(cfg)
            assert plan_arch(cfg).name == forced
        want_fwd, want_bwd = forward_plan(own), backward_plan(own)
        assert fwd == want_fwd and bwd == want_bwd, (forced, dims, mask, window)
        assert fwd.warp_specialized is None and bwd.dq_warp_specialized is None and bwd.dkdv_warp_specialized is None


def test_forced_plan_is_read_at_call_time():
    cfg = _config("sm90", (256, 256))
    own = forward_plan(cfg)
    with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH="gfx942"):
        forced = forward_plan(cfg)
    assert forced.tiles == ARCHS["gfx942"].fwd[(256, False)] != own.tiles
    assert forward_plan(cfg) == own
    with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH="sm90"):  # the device's own: its plan, Gluon included
        assert forward_plan(_config("sm90")) == forward_plan(BASE) and forward_plan(BASE).warp_specialized
    with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH=""):
        assert forward_plan(cfg) == own


def test_forced_plan_never_leaves_what_the_device_can_run():
    """A plan for more shared memory than the device has is refused with the reason; Hopper's tiles on
    Blackwell come without the Gluon kernels; the interpreter keeps its tiles; bad names are rejected."""
    with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH="sm90"):
        with pytest.raises(ValueError, match="NVTE_FUSED_ATTN_PLAN_ARCH must name an architecture with at most"):
            forward_plan(_config("sm80"))
        with pytest.raises(ValueError, match=r"gfx942: 64 KiB\), got 'sm90'"):
            backward_plan(_config("gfx942"))
        blackwell = forward_plan(_config("sm100"))
        assert blackwell.tiles == ARCHS["sm90"].fwd[(128, False)] and blackwell.warp_specialized is None
        cpu = BASE.replace(device_type="cpu", compute_capability=None)
        assert forward_plan(cpu).tiles.block_m == 16
    with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH="gfx950"):
        with pytest.raises(ValueError, match="160 KiB"):
            forward_plan(_config("gfx942"))
        assert forward_plan(_config("sm100")).tiles == ARCHS["gfx950"].fwd[(128, False)]
    with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH="gfx90a"):
        assert forward_plan(_config("gfx942")).tiles == ARCHS["gfx90a"].fwd[(128, False)]
    with settings.environment(NVTE_FUSED_ATTN_PLAN_ARCH="sm70"):
        with pytest.raises(ValueError, match="NVTE_FUSED_ATTN_PLAN_ARCH must be one of"):
            forward_plan(BASE)
