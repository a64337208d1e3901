"""explain_plan names what forward_plan and backward_plan return: every pass's kernel, its tiles and a table
row that holds exactly those tiles, the Gluon kernels where they serve and the reason where they do not;
NVTE_DEBUG logs it once per distinct plan."""

import dataclasses
import itertools
import logging
import re

import pytest

from transformer_engine.common import log, settings
from transformer_engine.common.attention import AttnBiasType, AttnConfig, AttnMaskType, AttnSoftmaxType, explain_plan
from transformer_engine.common.attention import explain as explain_module
from transformer_engine.common.attention.kernels import triton_compat
from transformer_engine.common.attention.plan import ARCHS, backward_plan, forward_plan, padded_head_dim

DEVICES = {"sm80": dict(compute_capability=(8, 0)), "sm90": dict(compute_capability=(9, 0)),
           "sm100": dict(compute_capability=(10, 0)), "gfx942": dict(vendor="amd", gfx_arch="gfx942")}
DIMS = [(64, 64), (128, 128), (256, 256), (192, 128)]
MASKS = {"none": (AttnMaskType.NO_MASK, (-1, -1)), "causal": (AttnMaskType.CAUSAL_MASK, (-1, -1)),
         "window": (AttnMaskType.PADDING_MASK, (128, 0))}
_ROW = re.compile(r"^(\w+)\.(\w+)\[(\d+), (bounded|unbounded)\]( \((dK|dV) pass\))?$")


def _config(arch, dims, mask="causal", dtype="bfloat16", **fields):
    mask_type, window = MASKS[mask]
    return AttnConfig.of(batch_size=2, num_heads_q=16, num_heads_kv=4, head_dim_qk=dims[0], head_dim_v=dims[1],
                      max_seqlen_q=2048, max_seqlen_kv=2048, dtype=dtype, attn_mask_type=mask_type,
                      window_size=window, deterministic=True, device_type="cuda", **DEVICES[arch], **fields)


def _row_tiles(row):
    """The tiles a row name stands for, looked up in ARCHS: ``sm90.fwd[128, bounded]``,
    ``sm90.dk_dv[256, unbounded] (dV pass)``, ``sm90.narrow_v[dq]``, ``sm90.fwd_ws_split[bounded]``."""
    match = _ROW.match(row)
    if match:
        arch, table, dim, bounded, _, which = match.groups()
        value = getattr(ARCHS[arch], table)[(int(dim), bounded == "bounded")]
        return value[which == "dV"] if table == "dk_dv" else value
    arch, rest = row.split(".", 1)
    table, _, index = rest.rstrip("]").partition("[")
    value = getattr(ARCHS[arch], table)
    if index in ("bounded", "unbounded"):
        return value[index == "bounded"]
    if index:
        return value[("fwd", "dkdv", "dq").index(index)]
    return value


def _check_pass(choice, tiles, ws):
    """The pass names the plan's tiles, from a row that holds them, and the Gluon tiles exactly where the plan
    has them (else a reason)."""
    assert choice.tiles == tiles, choice
    if "clamped for fp32" not in choice.row:
        assert _row_tiles(choice.row) == tiles, choice.row
    assert choice.gluon_tiles == ws, choice
    if ws is None:
        assert choice.gluon_fallback, choice
    else:
        assert choice.gluon_fallback is None and _row_tiles(choice.gluon_row) == ws, choice.gluon_row


@pytest.mark.parametrize("arch,dims,mask,dtype", list(itertools.product(DEVICES, DIMS, MASKS, ["bfloat16", "float32"])))
def test_explanation_names_the_planned_kernels_tiles_and_rows(arch, dims, mask, dtype):
    cfg = _config(arch, dims, mask, dtype)
    fwd, bwd = forward_plan(cfg), backward_plan(cfg)
    ex = explain_plan(cfg)
    assert ex.arch == arch and ex.dtype == dtype and ex.window_kind == cfg.window_kind
    assert ex.head_key == (max(padded_head_dim(dims[0]), padded_head_dim(dims[1])), mask != "none")
    assert (ex.block_dqk, ex.block_dqk2, ex.block_dv) == (fwd.block_dqk, fwd.block_dqk2, fwd.block_dv)
    assert (ex.block_dqk, ex.block_dqk2) == (bwd.block_dqk, bwd.block_dqk2)

    (forward,) = ex.forward
    assert forward.kernel == "attn_fwd_kernel"
    _check_pass(forward, fwd.tiles, fwd.warp_specialized)

    passes = {p.name: p for p in ex.backward}
    assert tuple(p.kernel for p in ex.backward) == bwd.kernels  # no bias or sink here: the plan's own passes
    assert passes["preprocess"].tiles == bwd.preprocess and passes["preprocess"].gluon_kernel is None
    if bwd.dv is None:
        assert [p.name for p in ex.backward] == ["preprocess", "dK/dV", "dQ"]
        _check_pass(passes["dK/dV"], bwd.dkdv, bwd.dkdv_warp_specialized)
    else:
        assert [p.name for p in ex.backward] == ["preprocess", "dK", "dV", "dQ"]
        _check_pass(passes["dK"], bwd.dkdv, bwd.dkdv_warp_specialized)
        _check_pass(passes["dV"], bwd.dv, bwd.dv_warp_specialized)
    _check_pass(passes["dQ"], bwd.dq, bwd.dq_warp_specialized)

    gluon = {"attn_fwd_ws_kernel": fwd.warp_specialized, "attn_bwd_dq_ws_kernel": bwd.dq_warp_specialized}
    assert all((name in ex.kernels) == (tiles is not None) for name, tiles in gluon.items()), ex.kernels
    text = str(ex)
    assert f"plan {arch}" in text and forward.row in text and passes["dQ"].row in text
    for p in ex.forward + ex.backward:
        assert (p.gluon_kernel if p.uses_gluon else p.kernel) in text


def test_hopper_explanations_where_gluon_serves():
    """The rows Hopper's Gluon kernels come from, by case: d=128 all three, d=256 the dK and dV passes,
    192/128 the forward and dQ on the Q/K split (dK/dV on Triton, with the reason)."""
    ex = explain_plan(_config("sm90", (128, 128)))
    assert ex.kernels == ("attn_fwd_ws_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_ws_kernel",
                          "attn_bwd_dq_ws_kernel")
    assert ex.forward[0].gluon_row == "sm90.fwd_ws[128, bounded]"
    ex = explain_plan(_config("sm90", (256, 256), "none"))
    assert [(p.name, p.row, p.gluon_row) for p in ex.backward[1:3]] == [
        ("dK", "sm90.dk_dv[256, unbounded] (dK pass)", "sm90.dkdv_ws[256, unbounded]"),
        ("dV", "sm90.dk_dv[256, unbounded] (dV pass)", "sm90.dv_ws[256, unbounded]")]
    ex = explain_plan(_config("sm90", (192, 128)))
    assert (ex.block_dqk, ex.block_dqk2) == (128, 64)
    assert ex.forward[0].row == "sm90.narrow_v[fwd]" and ex.forward[0].gluon_row == "sm90.fwd_ws_split[bounded]"
    dkdv, dq = ex.backward[1:]
    assert dkdv.gluon_tiles is None and "split Q/K" in dkdv.gluon_fallback
    assert dq.row == "sm90.narrow_v_split_dq" and dq.gluon_row == "sm90.dq_ws_split[bounded]"
    assert "Q/K split" in str(ex)


@pytest.mark.parametrize("case,fields,env,reason", [
    ("ws off", {}, dict(NVTE_FUSED_ATTN_WS="0"), "NVTE_FUSED_ATTN_WS=0"),
    ("fp32", dict(dtype="float32"), {}, "fp16/bf16 only"),
    ("bias", dict(attn_bias_type=AttnBiasType.POST_SCALE_BIAS, bias_shape="1hss"), {}, "bias"),
    ("dropout", dict(dropout_probability=0.1), {}, "dropout"),
    ("sink", dict(softmax_type=AttnSoftmaxType.OFF_BY_ONE_SOFTMAX), {}, "sink softmax"),
    ("narrow d_v", dict(head_dim_v=64), {}, "do not fill"),
    ("forced", dict(compute_capability=(10, 0)), dict(NVTE_FUSED_ATTN_PLAN_ARCH="sm90"), "forces sm90"),
    ("other arch", dict(compute_capability=(10, 0)), {}, "sm100 has no warp-specialized kernels"),
])
def test_gluon_fallback_reason_is_named(case, fields, env, reason):
    cfg = _config("sm90", (128, 128)).replace(**fields)
    with settings.environment(**env):
        ex = explain_plan(cfg)
        assert forward_plan(cfg).warp_specialized is None and backward_plan(cfg).dq_warp_specialized is None
    gluon_passes = [p for p in ex.forward + ex.backward if p.gluon_kernel is not None]
    assert len(gluon_passes) == 3 and not any(p.uses_gluon for p in gluon_passes), case
    assert all(reason in p.gluon_fallback for p in gluon_passes), [p.gluon_fallback for p in gluon_passes]
    assert reason in str(ex)
    if case == "forced":
        assert ex.arch == "sm90" and "forced by NVTE_FUSED_ATTN_PLAN_ARCH on sm100" in ex.arch_reason


def test_gluon_fallback_reason_when_triton_cannot_build_them(monkeypatch):
    """A Triton without the Gluon APIs: the explanation passes on triton_compat's reason."""
    cfg = _config("sm90", (128, 128))
    monkeypatch.setattr(triton_compat, "gluon_unavailable_reason", lambda: "triton 0.0 lacks the Gluon APIs x")
    try:
        ex = explain_plan(cfg)
        assert forward_plan(cfg).warp_specialized is None
    finally:
        log._warned_once.discard("plan:gluon_unavailable")
    assert ex.kernels == ("attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")
    assert "the installed Triton cannot build them: triton 0.0 lacks the Gluon APIs x" in str(ex)


def test_interpreter_and_optional_passes():
    """On the CPU the interpreter's tiles, split where NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK asks; a post-scale bias
    adds the dBias pass, learnable sink softmax the dSink pass (with the tiles the plan gives them)."""
    cfg = AttnConfig.of(batch_size=1, num_heads_q=2, num_heads_kv=2, head_dim_qk=48, head_dim_v=32, max_seqlen_q=64,
                     max_seqlen_kv=64, dtype="float32", device_type="cpu",
                     attn_bias_type=AttnBiasType.POST_SCALE_BIAS, bias_shape="1hss",
                     softmax_type=AttnSoftmaxType.LEARNABLE_SOFTMAX)
    ex = explain_plan(cfg)
    assert ex.arch == "interpreter" and (ex.block_dqk, ex.block_dqk2) == (64, 0)
    bwd = backward_plan(cfg)
    assert [p.name for p in ex.backward] == ["preprocess", "dSink", "dK/dV", "dBias", "dQ"]
    assert ex.backward[1].tiles == bwd.dsink and ex.backward[3].tiles == bwd.dbias
    assert "device_type 'cpu'" in str(ex)
    with settings.environment(NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK="1"):
        assert (explain_plan(cfg).block_dqk, explain_plan(cfg).block_dqk2) == (32, 16) == (
            forward_plan(cfg).block_dqk, forward_plan(cfg).block_dqk2)


def test_explain_plan_rejects_other_arguments():
    with pytest.raises(TypeError, match="`config` must be an AttnConfig, got dict"):
        explain_plan({})


def test_nvte_debug_logs_each_plan_once(caplog, monkeypatch):
    cfg = _config("sm90", (128, 128))
    monkeypatch.setattr(explain_module, "_logged", set())
    with caplog.at_level(logging.INFO, logger="transformer_engine"), settings.environment(NVTE_DEBUG="1",
                                                                                          NVTE_DEBUG_LEVEL="1"):
        explain_module.log_plan(cfg)
        explain_module.log_plan(cfg.replace(batch_size=7, max_seqlen_q=99))  # the same plan
        explain_module.log_plan(cfg.replace(dtype="float32"))
    records = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fused attention plan:")]
    assert len(records) == 2, records
    assert str(explain_plan(cfg)) in records[0] and "fp16/bf16 only" in records[1]
    caplog.clear()
    logging.getLogger("transformer_engine").setLevel(logging.NOTSET)
    with settings.environment(NVTE_DEBUG="0"):
        explain_module.log_plan(cfg.replace(head_dim_qk=64, head_dim_v=64))
    assert not [r for r in caplog.records if r.getMessage().startswith("fused attention plan:")]


def test_the_documented_example_is_what_explain_plan_prints():
    """docs/portability.rst shows explain_plan's output for Hopper at 192/128, causal: it must stay true."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "portability.rst").read_text()
    block = text.split(">>> print(explain_plan(cfg))\n", 1)[1].split("\n\n", 1)[0]
    shown = "\n".join(line[4:] for line in block.splitlines())
    cfg = AttnConfig.of(batch_size=2, num_heads_q=16, num_heads_kv=16, head_dim_qk=192, head_dim_v=128,
                     max_seqlen_q=4096, max_seqlen_kv=4096, dtype="bfloat16", attn_mask_type=AttnMaskType.CAUSAL_MASK,
                     device_type="cuda", compute_capability=(9, 0))
    assert shown == str(explain_plan(cfg))


# Hopper's Gluon forward reading a paged KV cache: TMA loads per K/V block by page size (None: the Triton forward),
# for its key blocks of 128 (d=128, 192/128) and 64 (d=256).
PAGE_LOADS = {128: {1: None, 16: 8, 24: None, 64: 2, 128: 1, 256: 1},
              64: {1: None, 16: 4, 24: None, 64: 1, 128: 1, 256: 1}}


@pytest.mark.parametrize("page_size", [1, 16, 24, 64, 128, 256])
@pytest.mark.parametrize("dims", [(128, 128), (256, 256), (192, 128)])
def test_paged_plans_say_what_runs_and_why(dims, page_size, monkeypatch):
    """A paged KV cache's forward on Hopper (bf16, no modifier): the Gluon forward with the contiguous call's tiles
    where its loader can follow pages of that size (whole blocks in a page, or pages of at least 16 keys dividing a
    block: the loads per block named), else the Triton forward with the reason; the rest of the plan (Triton tiles,
    head-dim tiles, the canonical sum's chunk) is the contiguous call's either way, and the pages keep the
    contiguous bits exactly where the kernel is the same."""
    from transformer_engine.common.attention.plan import pages_keep_bits

    monkeypatch.setenv("NVTE_FUSED_ATTN_GLUON_PAGED", "1")
    cfg = _config("sm90", dims)
    contiguous = forward_plan(cfg)
    block_n = contiguous.warp_specialized.block_n
    loads = PAGE_LOADS[block_n][page_size]
    paged = forward_plan(dataclasses.replace(cfg.plan_key, kv_page_size=page_size))
    # The Triton forward reading pages keeps at most two pipeline stages (they schedule loads, not the sum).
    triton = dataclasses.replace(contiguous.tiles, num_stages=min(2, contiguous.tiles.num_stages))
    assert paged == (contiguous if loads else dataclasses.replace(contiguous, warp_specialized=None, tiles=triton))
    assert pages_keep_bits(cfg, page_size) == (loads is not None)
    ex = explain_plan(cfg, kv_page_size=page_size)
    assert str(ex) == str(explain_plan(dataclasses.replace(cfg.plan_key, kv_page_size=page_size)))
    assert f"K/V: a paged KV cache, pages of {page_size} keys read through the page table" in str(ex)
    (fwd,) = ex.forward
    if loads:
        assert fwd.uses_gluon and fwd.gluon_tiles == contiguous.warp_specialized
        assert fwd.gluon_row.endswith(f"; pages of {page_size} keys read in place by its loader ({loads} TMA "
                                      f"load{'s' * (loads > 1)} per K/V block of {block_n})"), fwd.gluon_row
        assert ex.kernels[0] == "attn_fwd_ws_kernel"
    else:
        assert not fwd.uses_gluon and ex.kernels[0] == "attn_fwd_kernel"
        why = ("pages of at least 16 keys" if page_size < block_n and block_n % page_size == 0
               else f"neither hold whole K/V blocks of {block_n} keys nor divide them")
        assert fwd.gluon_fallback.startswith(f"a paged KV cache: pages of {page_size} keys") and why in \
            fwd.gluon_fallback, fwd.gluon_fallback
        assert why in str(ex)
    # The backward's passes are the contiguous call's (a paged call has none; what a gathered step runs).
    assert ex.backward == explain_plan(cfg).backward


@pytest.mark.parametrize("page_size", [1, 16, 24, 64, 128, 256])
def test_paged_plans_without_gluon_keep_the_triton_forward(page_size):
    """Where the contiguous call runs the Triton forward (Ampere, fp32 on Hopper, the interpreter), a paged call's
    plan is the contiguous one for every page size: the Triton forward follows any page table with the same bits."""
    from transformer_engine.common.attention.plan import pages_keep_bits

    for cfg in (_config("sm80", (128, 128)), _config("sm90", (128, 128), dtype="float32"),
                _config("sm90", (128, 128)).replace(device_type="cpu", compute_capability=None)):
        paged = dataclasses.replace(cfg.plan_key, kv_page_size=page_size)
        assert forward_plan(paged) == forward_plan(cfg) and forward_plan(cfg).warp_specialized is None
        assert pages_keep_bits(cfg, page_size)
        assert explain_plan(paged).kernels[0] == "attn_fwd_kernel"


def test_explain_plan_rejects_a_bad_page_size():
    cfg = _config("sm90", (128, 128))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"`kv_page_size` must be a non-negative int \(0: no paged KV cache\), "
                                             rf"got {bad!r}"):
            explain_plan(cfg, kv_page_size=bad)
    assert str(explain_plan(cfg, kv_page_size=0)) == str(explain_plan(cfg))


def test_gluon_paged_loads_are_off_by_default():
    """Without NVTE_FUSED_ATTN_GLUON_PAGED=1 a paged call the Gluon forward serves takes the Triton forward, with
    the variable named as the reason, and the frontends gather its pages (pages_keep_bits is False)."""
    from transformer_engine.common.attention.plan import pages_keep_bits

    cfg = _config("sm90", (128, 128))
    paged = dataclasses.replace(cfg.plan_key, kv_page_size=128)
    assert forward_plan(cfg).warp_specialized is not None and forward_plan(paged).warp_specialized is None
    assert not pages_keep_bits(cfg, 128)
    assert "NVTE_FUSED_ATTN_GLUON_PAGED=0" in str(explain_plan(paged))
