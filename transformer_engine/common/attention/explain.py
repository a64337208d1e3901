"""What the fused backend runs for a config, and why: :func:`explain_plan`.

The explanation is built by the same code as :func:`~transformer_engine.common.attention.plan.forward_plan`
and :func:`~transformer_engine.common.attention.plan.backward_plan` (their traces), so it names exactly the
tiles they return, the table row each came from, and, for every pass the Gluon kernels could serve, either
their tiles or why the Triton kernel runs instead. ``str()`` of the result prints it; with NVTE_DEBUG=1 the
launches log it once per distinct plan (:func:`log_plan`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from transformer_engine.common.attention.config import AttnConfig, PlanKey
from transformer_engine.common.attention.enums import AttnBiasType
from transformer_engine.common.log import get_logger
from transformer_engine.common.attention.plan import (
    BackwardPlan,
    ForwardPlan,
    PlanTrace,
    Tiles,
    device_arch,
    plan_key,
    trace_backward,
    trace_forward,
)

__all__ = ["PassChoice", "PlanExplanation", "explain_plan", "log_plan"]


@dataclass(frozen=True)
class PassChoice:
    """One kernel pass: its Triton kernel with its tiles and their table row, and the warp-specialized
    Gluon kernel where it serves (``gluon_kernel``, ``gluon_tiles``, ``gluon_row``: the launches take it when
    the tensors also allow TMA, else the Triton kernel) or why not (``gluon_fallback``; None for passes
    without a Gluon variant). ``when``: the condition under which the pass runs at all, if any."""

    name: str
    kernel: str
    tiles: Tiles
    row: str
    gluon_kernel: Optional[str] = None
    gluon_tiles: Optional[Tiles] = None
    gluon_row: Optional[str] = None
    gluon_fallback: Optional[str] = None
    when: Optional[str] = None

    @property
    def uses_gluon(self) -> bool:
        return self.gluon_tiles is not None

    def lines(self, fallback: bool = True) -> Tuple[str, ...]:
        """Printable lines; ``fallback=False`` leaves out why Gluon does not serve."""
        when = f" ({self.when})" if self.when else ""
        out = [f"{self.name}{when}: "]
        if self.uses_gluon:
            out[0] += f"{self.gluon_kernel} (Gluon, warp-specialized) {_tiles(self.gluon_tiles)} <- {self.gluon_row}"
            out.append(f"    tensors without TMA alignment: {self.kernel} {_tiles(self.tiles)} <- {self.row}")
        else:
            out[0] += f"{self.kernel} (Triton) {_tiles(self.tiles)} <- {self.row}"
            if fallback and self.gluon_fallback is not None:
                out.append(f"    not Gluon: {self.gluon_fallback}")
        return tuple(out)


@dataclass(frozen=True)
class PlanExplanation:
    """What runs for a config (:func:`explain_plan`): the tables (``arch``; "interpreter" on the CPU) and how
    they were found, the row key, the head-dim tiles, and the forward's and backward's passes in launch order."""

    arch: str
    arch_reason: str
    head_dims: Tuple[int, int]
    head_key: Tuple[int, bool]
    window_kind: str
    dtype: str
    block_dqk: int
    block_dqk2: int
    block_dv: int
    forward: Tuple[PassChoice, ...]
    backward: Tuple[PassChoice, ...]
    kv_page_size: int = 0  # keys per page of a paged KV cache the forward reads through its page table (0: none)
    kv_chunk: int = 0  # keys per chunk of the forward's canonical sum (ForwardPlan.kv_chunk; 0: one chunk)
    kv_chunk_row: str = ""  # where kv_chunk (and the chunked sum's register cap) came from

    @property
    def kernels(self) -> Tuple[str, ...]:
        """Every pass's kernel with TMA-eligible tensors (the Gluon one where it serves), forward first."""
        return tuple(p.gluon_kernel if p.uses_gluon else p.kernel for p in self.forward + self.backward)

    def __str__(self) -> str:
        dim, bounded = self.head_key
        qk = f"{self.block_dqk} + {self.block_dqk2} (Q/K split)" if self.block_dqk2 else f"{self.block_dqk}"
        lines = [
            f"plan {self.arch} ({self.arch_reason})",
            f"  row key [{dim}, {'bounded' if bounded else 'unbounded'}]: head dims {self.head_dims[0]}/"
            f"{self.head_dims[1]} pad to {dim}; window kind {self.window_kind}; dtype {self.dtype}",
            f"  head-dim tiles: BLOCK_DQK {qk}, BLOCK_DV {self.block_dv}",
        ]
        if self.kv_chunk:
            lines.append(f"  keys: summed in chunks of {self.kv_chunk} where a row sees more <- {self.kv_chunk_row}")
        else:
            lines.append(f"  keys: {self.kv_chunk_row}")
        if self.kv_page_size:
            lines.append(f"  K/V: a paged KV cache, pages of {self.kv_page_size} keys read through the page table "
                         "(the forward; a paged call has no backward)")
        # One reason for every pass (e.g. an architecture without Gluon kernels) prints once.
        reasons = {p.gluon_fallback for p in self.forward + self.backward if p.gluon_kernel is not None}
        shared = len(reasons) == 1 and None not in reasons
        if shared:
            lines.append(f"  Triton kernels only: {reasons.pop()}")
        for title, passes in (("forward", self.forward), ("backward", self.backward)):
            lines.append(f"  {title}:")
            for p in passes:
                lines.extend("    " + line for line in p.lines(fallback=not shared))
        return "\n".join(lines)


def _tiles(t: Tiles) -> str:
    text = f"{t.block_m}x{t.block_n}" if t.block_n else f"{t.block_m} rows"
    text += f", {t.num_warps} warp{'s' * (t.num_warps != 1)}, {t.num_stages} stage{'s' * (t.num_stages != 1)}"
    if t.head_group > 1:
        text += f", head group {t.head_group}"
    if t.single_loop:
        text += ", single loop"
    if t.max_registers is not None:
        text += f", {t.max_registers} registers"
    return text


def _arch_reason(config: PlanKey, trace: PlanTrace) -> Tuple[str, str]:
    if trace.arch is None:
        return "interpreter", f"device_type {config.device_type!r}: Triton's interpreter, small tiles"
    device = device_arch(config)
    if trace.arch.name != device.name:
        return trace.arch.name, f"forced by NVTE_FUSED_ATTN_PLAN_ARCH on {device.name}"
    if config.vendor == "amd":
        return trace.arch.name, f"AMD {config.gfx_arch}"
    cc = config.compute_capability
    return trace.arch.name, f"NVIDIA compute capability {cc[0]}.{cc[1]}" if cc else "NVIDIA, no compute capability"


def _pass(name: str, kernel: str, gluon_kernel: Optional[str], tiles: Tiles, ws: Optional[Tiles],
          trace: PlanTrace, field: str, ws_field: Optional[str], when: Optional[str] = None) -> PassChoice:
    if ws_field is None:
        return PassChoice(name, kernel, tiles, trace.rows[field], when=when)
    if ws is None:
        return PassChoice(name, kernel, tiles, trace.rows[field], gluon_kernel,
                          gluon_fallback=trace.gluon_off[ws_field], when=when)
    return PassChoice(name, kernel, tiles, trace.rows[field], gluon_kernel, ws, trace.rows[ws_field], when=when)


def _forward_passes(fwd: ForwardPlan, trace: PlanTrace) -> Tuple[PassChoice, ...]:
    return (_pass("forward", "attn_fwd_kernel", "attn_fwd_ws_kernel", fwd.tiles, fwd.warp_specialized, trace,
                  "tiles", "warp_specialized"),)


def _backward_passes(config: PlanKey, bwd: BackwardPlan, trace: PlanTrace) -> Tuple[PassChoice, ...]:
    passes = [_pass("preprocess", "attn_bwd_preprocess_kernel", None, bwd.preprocess, None, trace, "preprocess",
                    None)]
    if config.softmax_type.is_learnable:
        passes.append(PassChoice("dSink", "attn_bwd_dsink_kernel", bwd.dsink, "the preprocess's rows"))
    dkdv = "dK/dV" if bwd.dv is None else "dK"
    passes.append(_pass(dkdv, "attn_bwd_dkdv_kernel", "attn_bwd_dkdv_ws_kernel", bwd.dkdv, bwd.dkdv_warp_specialized,
                        trace, "dkdv", "dkdv_warp_specialized"))
    if bwd.dv is not None:
        passes.append(_pass("dV", "attn_bwd_dkdv_kernel", "attn_bwd_dkdv_ws_kernel", bwd.dv, bwd.dv_warp_specialized,
                            trace, "dv", "dv_warp_specialized"))
    if config.attn_bias_type == AttnBiasType.POST_SCALE_BIAS:
        passes.append(PassChoice("dBias", "attn_bwd_dbias_kernel", bwd.dbias,
                                 f"the dQ rows, at most {bwd.dbias_block} square", when="a bias that needs a gradient"))
    passes.append(_pass("dQ", "attn_bwd_dq_kernel", "attn_bwd_dq_ws_kernel", bwd.dq, bwd.dq_warp_specialized, trace,
                        "dq", "dq_warp_specialized"))
    return tuple(passes)


def explain_plan(config: Union[AttnConfig, PlanKey], kv_page_size: Optional[int] = None) -> PlanExplanation:
    """What the fused backend runs for ``config`` (an AttnConfig, or the PlanKey of one) and why: the
    architecture's tables and how they were chosen, each pass's kernel (warp-specialized Gluon or Triton,
    with the reason where Gluon does not serve), its tiles and the table row they came from. ``kv_page_size``:
    the plan of the forward reading a paged KV cache with pages of that many keys (0: rows in place; None: the
    config's own, PlanKey.kv_page_size). Reads the environment as a launch does (NVTE_FUSED_ATTN_WS,
    NVTE_FUSED_ATTN_PLAN_ARCH, NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK)."""
    if not isinstance(config, (AttnConfig, PlanKey)):
        raise TypeError(f"`config` must be an AttnConfig, got {type(config).__name__}")
    config = plan_key(config)
    if kv_page_size is not None:
        if isinstance(kv_page_size, bool) or not isinstance(kv_page_size, int) or kv_page_size < 0:
            raise ValueError(f"`kv_page_size` must be a non-negative int (0: no paged KV cache), got {kv_page_size!r}")
        config = dataclasses.replace(config, kv_page_size=kv_page_size)
    fwd, ftrace = trace_forward(config)
    bwd, btrace = trace_backward(config)
    arch, reason = _arch_reason(config, ftrace)
    return PlanExplanation(
        arch=arch, arch_reason=reason, head_dims=(config.head_dim_qk, config.head_dim_v), head_key=ftrace.key,
        window_kind=config.window_kind, dtype=config.dtype, block_dqk=fwd.block_dqk, block_dqk2=fwd.block_dqk2,
        block_dv=fwd.block_dv, forward=_forward_passes(fwd, ftrace), backward=_backward_passes(config, bwd, btrace),
        kv_page_size=config.kv_page_size, kv_chunk=fwd.kv_chunk, kv_chunk_row=ftrace.rows["kv_chunk"],
    )


_logged: set = set()


def log_plan(config: Union[AttnConfig, PlanKey]) -> None:
    """With NVTE_DEBUG=1 and NVTE_DEBUG_LEVEL >= 1 (the logger at INFO), log ``config``'s plan explanation
    the first time this process meets that plan; otherwise only the logger's level is read."""
    logger = get_logger()
    if not logger.isEnabledFor(logging.INFO):
        return
    text = str(explain_plan(config))
    if text not in _logged:
        _logged.add(text)
        logger.info("fused attention plan:\n%s", text)
