"""FP8 attention's plan and its checks (framework-free): the dtype axis of the fused kernels.

FP8 attention runs kernels/fp8.py, the Triton kernels' FP8 variants (same grids, visibility rule, block
bounds and loop orders as the bf16 kernels). Its tiles are functions of head dim and architecture only, as
the determinism contract asks (never of batch or sequence length): bitwise run to run, and a sequence gets
the same bits in any batch and packed or padded. The warp-specialized Gluon kernels have no FP8 variant yet:
on sm_90 the Triton kernels' ``tl.dot`` on float8 operands compiles to Hopper's FP8 wgmma.

:func:`fp8_reasons` says why a call cannot run in FP8 (each reason names the argument): the caller refuses
such a call with ``NotImplementedError`` rather than running it in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType

__all__ = ["P_SCALE", "FP8_DTYPES", "Fp8Tiles", "Fp8Plan", "fp8_plan", "fp8_reasons", "explain_fp8",
           "backward_dtype_name"]

# The fixed scale of the softmax probabilities P in [0, 1] before their E4M3 cast (kernels/fp8.py): a power of
# two, so scaling and descaling are exact, with P = 1 at 256 below E4M3's largest value 448.
P_SCALE = 256.0
# The FP8 storage dtypes by format name (common/quantization.py's names).
FP8_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
MAX_HEAD_DIM = 256


def backward_dtype_name(fp8_format) -> str:
    """dO's FP8 dtype name under a recipe's format: E5M2 under HYBRID, E4M3 under E4M3."""
    from transformer_engine.common.quantization import format_dtypes

    fwd, bwd = format_dtypes(fp8_format)
    if fwd != "e4m3":
        raise NotImplementedError(f"`fp8_format` must give E4M3 forward operands for FP8 attention "
                                  f"(Format.HYBRID or Format.E4M3), got {fp8_format!r}")
    return FP8_DTYPES[bwd]


@dataclass(frozen=True)
class Fp8Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Fp8Plan:
    """Tiles of the four FP8 launches and the padded head dims. ``exact_cast``: round to the FP8 grid in fp32
    before the cast (kernels/fp8.py: Triton's interpreter), else the hardware conversion."""

    arch: str
    block_dqk: int
    block_dv: int
    forward: Fp8Tiles
    preprocess: Fp8Tiles
    dkdv: Fp8Tiles
    dq: Fp8Tiles
    exact_cast: bool

    def lines(self) -> Tuple[str, ...]:
        def t(x: Fp8Tiles) -> str:
            return f"BLOCK_M={x.block_m} BLOCK_N={x.block_n} warps={x.num_warps} stages={x.num_stages}"

        return (f"FP8 attention plan ({self.arch}), head dims padded to {self.block_dqk}/{self.block_dv}:",
                f"  forward: attn_fp8_fwd_kernel {t(self.forward)}",
                f"  backward: attn_fp8_bwd_preprocess_kernel {t(self.preprocess)}, attn_fp8_bwd_dkdv_kernel "
                f"{t(self.dkdv)}, attn_fp8_bwd_dq_kernel {t(self.dq)}",
                "  Triton kernels (tl.dot on float8 operands: Hopper's FP8 wgmma on sm_90); the Gluon "
                "warp-specialized kernels have no FP8 variant yet",
                f"  P quantized to E4M3 with the fixed scale {P_SCALE:g}; "
                + ("FP8 rounding in fp32 before the cast (interpreter)" if self.exact_cast
                   else "hardware FP8 conversion"))

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _pad(d: int) -> int:
    # FP8 MMAs take K in steps of 32: head dims pad to a power of two of at least 32.
    return max(32, 1 << (int(d) - 1).bit_length())


def fp8_plan(head_dim_qk: int, head_dim_v: int, arch: str) -> Fp8Plan:
    """The FP8 plan of a head-dim pair on ``arch`` ("interpreter", "sm90", or another "smXY" / "gfxNNN"):
    tiles depend on nothing else (the determinism contract's invariance)."""
    dqk, dv = _pad(head_dim_qk), _pad(head_dim_v)
    if arch == "interpreter":  # small tiles: the interpreter's cost grows with the tile
        small = Fp8Tiles(32, 32, 4, 1)
        return Fp8Plan(arch, dqk, dv, small, small, small, small, True)
    wide = max(dqk, dv) > 128
    fwd = Fp8Tiles(128, 64 if wide else 128, 8, 2 if wide else 3)
    # dK/dV: 64 x 64 at 8 warps is the largest tile that compiles without spills at d=128 on sm_90
    # (128-key blocks spill: two fp32 accumulators plus the FP8 operands' transposes).
    bwd = Fp8Tiles(64, 64, 8, 2)
    dq = Fp8Tiles(64 if wide else 128, 64, 8, 2)
    return Fp8Plan(arch, dqk, dv, fwd, Fp8Tiles(64, 64, 4, 1), bwd, dq, False)


def fp8_reasons(*, attn_mask_type: AttnMaskType, attn_bias_type: AttnBiasType, dropout: float,
                softmax_type: AttnSoftmaxType, head_dim_qk: int, head_dim_v: int, paged: bool = False,
                context_parallel: bool = False, return_max_logit: bool = False) -> List[str]:
    """Why a call cannot run on the FP8 kernels (empty when it can). Masks, windows, GQA and the bshd, sbhd
    and thd formats are supported."""
    reasons = []
    if attn_mask_type == AttnMaskType.ARBITRARY_MASK:
        reasons.append("attn_mask_type='arbitrary' (FP8 attention takes the structured masks only)")
    if attn_bias_type != AttnBiasType.NO_BIAS:
        reasons.append(f"core_attention_bias_type={attn_bias_type.value!r} (FP8 attention takes no bias or ALiBi)")
    if dropout > 0:
        reasons.append(f"attention_dropout={dropout} (FP8 attention has no dropout)")
    if softmax_type != AttnSoftmaxType.VANILLA_SOFTMAX:
        reasons.append(f"softmax_type={softmax_type.value!r} (FP8 attention takes the vanilla softmax only)")
    if max(head_dim_qk, head_dim_v) > MAX_HEAD_DIM:
        reasons.append(f"head_dim={max(head_dim_qk, head_dim_v)} (FP8 attention takes head dims up to "
                       f"{MAX_HEAD_DIM})")
    if paged:
        reasons.append("a paged KV cache (FP8 attention reads contiguous keys only)")
    if context_parallel:
        reasons.append("context parallelism other than cp_comm_type='a2a' under Float8CurrentScaling (FP8 "
                       "attention under CP runs whole sequences of the rank's heads with the single-device current "
                       "scales; delayed scales and sequences split across ranks are not built)")
    if return_max_logit:
        reasons.append("return_max_logit=True (the FP8 kernels record amaxes, not per-head max logits)")
    return reasons


def explain_fp8(head_dim_qk: int, head_dim_v: int, arch: str, reasons: Optional[List[str]] = None) -> str:
    """Why FP8 attention runs (its plan) or not (its reasons), as explain_plan prints for the bf16 kernels."""
    if reasons:
        return "FP8 attention not used: " + "; ".join(reasons)
    return "FP8 attention (fp8_dpa) selected: the recipe asks for it and the call is supported\n" + str(
        fp8_plan(head_dim_qk, head_dim_v, arch))
