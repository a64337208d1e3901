"""Launch plans: tile sizes, warps, stages and kernel variants as pure functions of AttnConfig.

Determinism contract (DESIGN.md, rule 3): in deterministic mode the tiles and loop orders
depend only on head dim, dtype, mask/window kind and GPU architecture — never on batch size,
sequence length or autotuning. Nothing below reads a shape other than the head dims. Whether the
warp-specialized Gluon kernels serve a config also reads its bias/dropout and NVTE_FUSED_ATTN_WS,
alike for both frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common import settings
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType

__all__ = ["Tiles", "ForwardPlan", "BackwardPlan", "forward_plan", "backward_plan", "mask_flags", "padded_head_dim",
           "block_grid", "tma_eligible"]


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    head_group: int = 1  # launch order: heads whose blocks interleave (kernels/masking.py, grid_program)
    single_loop: bool = False  # one pipelined block loop masking per block, not three loops (NOTES.md entry 11)
    tma: bool = False  # block-loop loads through tensor descriptors where the launcher can (aligned, d contiguous)
    pingpong: bool = False  # warp-specialized forward: consumers take turns issuing Q K^T (hopper_ws.py)
    overlap: bool = False  # warp-specialized forward: block j's Q K^T issued with block j-1's P V
    max_registers: Optional[int] = None  # per-thread register cap of the launch (warp-specialized kernels)

    @property
    def loop_constexprs(self) -> Dict[str, object]:
        """What the block-loop kernels (forward, dK/dV, dQ) take from these tiles, by parameter name
        (TMA too is theirs, but each launcher decides it from the tensors' alignment)."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, HEAD_GROUP=self.head_group,
                    SINGLE_LOOP=self.single_loop)

    @property
    def ws_constexprs(self) -> Dict[str, object]:
        """What the warp-specialized Gluon kernels (hopper_ws.py) take from these tiles: their ring has
        num_stages buffers."""
        return dict(self.loop_constexprs, NUM_STAGES=self.num_stages, PINGPONG=self.pingpong, OVERLAP=self.overlap)

    @property
    def launch_options(self) -> Dict[str, int]:
        if self.max_registers is not None:
            return dict(num_warps=self.num_warps, num_stages=1, maxnreg=self.max_registers)
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class ForwardPlan:
    tiles: Tiles
    block_dqk: int
    block_dv: int
    dot_precision: str
    # Tiles of the warp-specialized Gluon forward (kernels/hopper_ws.py) where it serves the config;
    # launchers use it when the tensors also allow TMA (tma_eligible), else attn_fwd_kernel with `tiles`.
    warp_specialized: Optional[Tiles] = None


@dataclass(frozen=True)
class BackwardPlan:
    preprocess: Tiles
    dkdv: Tiles
    dq: Tiles
    block_dqk: int
    block_dv: int
    dot_precision: str
    atomic_dq: bool  # fold dQ into the dK/dV pass with atomics: never in deterministic mode
    # Tiles of the warp-specialized Gluon dQ pass (kernels/hopper_ws.py) where it serves the config;
    # launchers use it when the tensors also allow TMA, else attn_bwd_dq_kernel with `dq`.
    dq_warp_specialized: Optional[Tiles] = None
    # The same for the Gluon dK/dV pass (attn_bwd_dkdv_kernel with `dkdv` otherwise).
    dkdv_warp_specialized: Optional[Tiles] = None

    @property
    def dbias(self) -> Tiles:
        """Square tiles of the dBias kernel (bias present only): the dQ pass's rows, at most 64, with
        its warps, no pipelining."""
        tile = min(self.dq.block_m, 64)
        return Tiles(tile, tile, self.dq.num_warps, 1)

    def dbias_grid(self, seqlen_q: int, seqlen_kv: int, bias_batch: int, bias_heads: int) -> Tuple[int, int, int]:
        """Launch grid of the dBias kernel: one program per [s_q, s_kv] tile of each bias slice."""
        t = self.dbias
        return (-(-seqlen_q // t.block_m), -(-seqlen_kv // t.block_n), bias_batch * bias_heads)

    @property
    def kernels(self) -> Tuple[str, ...]:
        """Kernel names this plan launches, in order (tests check determinism uses no atomics)."""
        if self.atomic_dq:
            return ("attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel[atomic_dq]")
        return ("attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")


def mask_flags(mask: AttnMaskType, window: Tuple[int, int]) -> Tuple[Dict[str, bool], int, int]:
    """The kernels' mask constexprs (HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT) and the (left, right) window
    they take, for a mask type and a normalized window (-1: unbounded); causal masks close the right."""
    left, right = window
    if mask.is_causal:
        right = 0
    flags = dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, BOTTOM_RIGHT=not mask.is_top_left_causal)
    return flags, max(left, 0), max(right, 0)


def block_grid(num_blocks: int, num_seq_heads: int) -> Tuple[int, int, int]:
    """Launch grid of the forward and backward kernels: (block, sequence * head, 1).

    The block index is the fast grid axis, so programs running together mostly share one head's
    K/V (or Q/dO) in L2. Measured (benchmarks/attention/NOTES.md, entry 9): the block-major order
    (every head's heaviest causal block first) lost 2-18% to this order on the H200.
    """
    return (num_blocks, num_seq_heads, 1)


def tma_eligible(element_size: int, base_address: int, strides: Tuple[int, ...]) -> bool:
    """Whether a (b, s, h, d)-strided view can be read through TMA descriptors: the head dim
    contiguous, the base and every other stride 16-byte aligned."""
    if strides[-1] != 1 or base_address % 16:
        return False
    return all(st * element_size % 16 == 0 for st in strides[:-1])


def padded_head_dim(d: int) -> int:
    """Kernel tile width for a head dim: next power of two, at least 16 (tl.dot's minimum)."""
    p = 16
    while p < d:
        p *= 2
    return p


# Interpreter (CPU tests): small tiles so tiny test shapes still span several blocks.
_INTERPRET_FWD = Tiles(16, 16, 1, 1)
_INTERPRET_BWD = Tiles(16, 16, 1, 1)

# Hopper (sm_90) tiles by padded head dim (and mask kind where it pays), measured on the H200
# with benchmarks/attention/tune_tiles.py (2026-11-30; see benchmarks/attention/NOTES.md). Head groups
# (launch order) and the single-loop form only where NOTES.md entry 11 measured them faster. TMA loads
# (Tiles.tma) are nowhere: no plan measured faster with them over repeated runs (entry 12).
_SM90_FWD: Dict[Tuple[int, bool], Tiles] = {
    (16, False): Tiles(128, 64, 8, 3), (16, True): Tiles(64, 64, 4, 3),
    (32, False): Tiles(128, 64, 8, 3), (32, True): Tiles(64, 64, 4, 3),
    (64, False): Tiles(128, 64, 8, 3), (64, True): Tiles(64, 64, 4, 3),
    (128, False): Tiles(128, 64, 8, 3), (128, True): Tiles(128, 64, 8, 3, head_group=8),
    (256, False): Tiles(128, 64, 8, 2, single_loop=True), (256, True): Tiles(128, 64, 8, 2, single_loop=True),
}
_SM90_DKDV: Dict[Tuple[int, bool], Tiles] = {
    (16, False): Tiles(32, 128, 4, 3), (16, True): Tiles(64, 64, 4, 3),
    (32, False): Tiles(32, 128, 4, 3), (32, True): Tiles(64, 64, 4, 3),
    (64, False): Tiles(32, 128, 4, 3), (64, True): Tiles(64, 64, 4, 3),
    (128, False): Tiles(64, 128, 8, 3), (128, True): Tiles(64, 128, 8, 3, head_group=8),
    (256, False): Tiles(64, 64, 8, 2, single_loop=True), (256, True): Tiles(64, 64, 8, 2, single_loop=True),
}
_SM90_DQ: Dict[Tuple[int, bool], Tiles] = {
    (16, False): Tiles(128, 64, 8, 2), (16, True): Tiles(64, 64, 4, 3),
    (32, False): Tiles(128, 64, 8, 2), (32, True): Tiles(64, 64, 4, 3),
    (64, False): Tiles(128, 64, 8, 3), (64, True): Tiles(64, 64, 4, 3, head_group=4),
    (128, False): Tiles(128, 64, 8, 3), (128, True): Tiles(128, 64, 8, 3, head_group=8),
    (256, False): Tiles(64, 64, 8, 2), (256, True): Tiles(64, 64, 8, 2),
}
# Warp-specialized Gluon kernels on Hopper (kernels/hopper_ws.py): 128 rows (query rows; keys for dK/dV)
# as two consumer warpgroups of 64 plus a loader warp (12 warps allocated: 168 registers each on average).
# Forward: K/V blocks of 128 in a 2-buffer ring. Where they serve: d_qk = d_v = 128, fp16/bf16, no bias,
# ALiBi or dropout.
_SM90_FWD_WS = {
    (128, False): Tiles(128, 128, 4, 2, max_registers=168),
    (128, True): Tiles(128, 128, 4, 2, head_group=8, max_registers=168),
}
# dQ: K/V blocks of 64 (blocks of 128 spill in the causal consumer) in a 3-buffer ring (NOTES.md entry 14).
_SM90_DQ_WS = {
    (128, False): Tiles(128, 64, 4, 3, max_registers=168),
    (128, True): Tiles(128, 64, 4, 3, head_group=8, max_registers=168),
}
# dK/dV: key blocks of 128 (64 per consumer), query blocks of 64 in a 3-buffer ring with their LSE and
# delta rows (NOTES.md entry 15). At d=64 all three Gluon kernels measured slower than the Triton ones.
_SM90_DKDV_WS = {
    (128, False): Tiles(64, 128, 4, 3, max_registers=168),
    (128, True): Tiles(64, 128, 4, 3, head_group=8, max_registers=168),
}
# Other GPUs (Ampere and newer non-Hopper): conservative tiles that fit 100 KB of shared memory.
_GENERIC_FWD = Tiles(64, 64, 4, 2)
_GENERIC_BWD = Tiles(64, 64, 4, 1)
_GENERIC_FWD_256 = Tiles(32, 32, 4, 1)
_GENERIC_BWD_256 = Tiles(32, 32, 4, 1)


def _dot_precision(config: AttnConfig) -> str:
    # fp32 inputs get true fp32 products (no TF32) so fp32 results match the reference.
    return "ieee" if config.dtype == "float32" else "tf32"


def _head_key(config: AttnConfig) -> Tuple[int, bool]:
    """What Hopper tiles may depend on: padded head dim and whether the mask is diagonal-bounded."""
    dim = max(padded_head_dim(config.head_dim_qk), padded_head_dim(config.head_dim_v))
    return dim, config.window_kind != "none"


def forward_plan(config: AttnConfig, override: Optional[Tiles] = None) -> ForwardPlan:
    key = _head_key(config)
    if override is not None:
        tiles = override
    elif config.device_type == "cpu":
        tiles = _INTERPRET_FWD
    elif config.compute_capability is not None and config.compute_capability[0] == 9:
        tiles = _SM90_FWD[key]
    else:
        tiles = _GENERIC_FWD_256 if key[0] > 128 else _GENERIC_FWD
    if config.dtype == "float32" and override is None and config.device_type != "cpu":
        tiles = Tiles(min(tiles.block_m, 64), min(tiles.block_n, 32), tiles.num_warps, 1)
    # An explicit Triton tile override measures the Triton kernel.
    ws = None if override is not None else _warp_specialized(config, key, _SM90_FWD_WS)
    return ForwardPlan(tiles, padded_head_dim(config.head_dim_qk), padded_head_dim(config.head_dim_v),
                       _dot_precision(config), ws)


def _warp_specialized(config: AttnConfig, key: Tuple[int, bool], table: Dict[Tuple[int, bool], Tiles]) -> Optional[Tiles]:
    """The Gluon kernels' tiles for ``config`` from ``table``, where they serve it (module docstring of
    kernels/hopper_ws.py) and NVTE_FUSED_ATTN_WS does not turn them off."""
    if config.device_type != "cuda" or config.compute_capability is None or config.compute_capability[0] != 9:
        return None
    if config.dtype not in ("float16", "bfloat16") or config.head_dim_qk != config.head_dim_v:
        return None
    if config.attn_bias_type != AttnBiasType.NO_BIAS or config.dropout > 0:
        return None
    # The head dim must fill its tile: the Gluon kernels mask no head-dim columns.
    if config.head_dim_qk != key[0] or not settings.get("NVTE_FUSED_ATTN_WS"):
        return None
    return table.get(key)


def backward_plan(config: AttnConfig, override: Optional[Tuple[Tiles, Tiles]] = None) -> BackwardPlan:
    key = _head_key(config)
    if override is not None:
        dkdv, dq = override
    elif config.device_type == "cpu":
        dkdv = dq = _INTERPRET_BWD
    elif config.compute_capability is not None and config.compute_capability[0] == 9:
        dkdv, dq = _SM90_DKDV[key], _SM90_DQ[key]
    else:
        dkdv = dq = _GENERIC_BWD_256 if key[0] > 128 else _GENERIC_BWD
    if config.dtype == "float32" and override is None and config.device_type != "cpu":
        dkdv = Tiles(min(dkdv.block_m, 32), min(dkdv.block_n, 64), dkdv.num_warps, 1)
        dq = Tiles(min(dq.block_m, 64), min(dq.block_n, 32), dq.num_warps, 1)
    preprocess = Tiles(64 if config.device_type != "cpu" else 16, 0, 4, 1)
    # Separate dQ pass measured faster than atomic dQ on the H200 (ANCHORS.md), so even the
    # non-deterministic mode uses it unless it is explicitly measured otherwise.
    atomic_dq = (not config.deterministic) and _NONDETERMINISTIC_ATOMIC_DQ
    # An explicit Triton tile override measures the Triton kernels; atomic dQ has no dQ pass.
    served = override is None and not atomic_dq
    ws_dq = _warp_specialized(config, key, _SM90_DQ_WS) if served else None
    ws_dkdv = _warp_specialized(config, key, _SM90_DKDV_WS) if served else None
    return BackwardPlan(preprocess, dkdv, dq, padded_head_dim(config.head_dim_qk),
                        padded_head_dim(config.head_dim_v), _dot_precision(config), atomic_dq, ws_dq, ws_dkdv)


# Policy for the non-deterministic backward; a module-level constant so benchmarks can flip it.
_NONDETERMINISTIC_ATOMIC_DQ = False
