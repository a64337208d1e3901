"""Launch plans: tile sizes, warps, stages and kernel variants as pure functions of AttnConfig.

Determinism contract: in deterministic mode the tiles and loop orders
depend only on head dim, dtype, mask/window kind and GPU architecture — never on batch size,
sequence length or autotuning. Nothing below reads a shape other than the head dims. Whether the
warp-specialized Gluon kernels serve a config also reads its bias/dropout and NVTE_FUSED_ATTN_WS, and
whether Hopper's narrow-V tiles (and their Q/K head-dim split) do reads its bias/dropout, alike for both
frameworks.

Architectures (:data:`ARCHS`): each GPU family has its tile tables and the shared memory (LDS on AMD) its
tiles must fit; :func:`plan_arch` finds a config's from its vendor and compute capability or gfx target,
or takes the one NVTE_FUSED_ATTN_PLAN_ARCH forces. The Hopper tables and the Gluon kernels serve NVIDIA
SM90 only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common import settings
from transformer_engine.common.attention.enums import AttnBiasType

__all__ = ["Tiles", "ForwardPlan", "BackwardPlan", "ArchTables", "ARCHS", "forward_plan", "backward_plan",
           "plan_arch", "device_arch", "mask_flags", "padded_head_dim", "split_head_dim", "block_grid",
           "tma_eligible"]


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    head_group: int = 1  # launch order: heads whose blocks interleave (kernels/masking.py, grid_program)
    single_loop: bool = False  # one pipelined block loop masking per block, not three loops (pays where registers bind)
    max_registers: Optional[int] = None  # per-thread register cap of the launch (warp-specialized kernels)

    @property
    def loop_constexprs(self) -> Dict[str, object]:
        """What the block-loop kernels (forward, dK/dV, dQ) take from these tiles, by parameter name."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, HEAD_GROUP=self.head_group,
                    SINGLE_LOOP=self.single_loop)

    @property
    def ws_constexprs(self) -> Dict[str, object]:
        """What the warp-specialized Gluon kernels (hopper_ws.py) take from these tiles: their ring has
        num_stages buffers."""
        return dict(self.loop_constexprs, NUM_STAGES=self.num_stages)

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
    # the launches (launches.py) use it when the tensors also allow TMA (tma_eligible), else attn_fwd_kernel
    # with `tiles`.
    warp_specialized: Optional[Tiles] = None
    # Width of the second Q/K head-dim chunk (BLOCK_DQK2) where the Q/K head dim splits in two (block_dqk
    # is then the first chunk: split_head_dim); 0: one block_dqk-wide tile.
    block_dqk2: int = 0


@dataclass(frozen=True)
class BackwardPlan:
    preprocess: Tiles
    dkdv: Tiles
    dq: Tiles
    block_dqk: int
    block_dv: int
    dot_precision: str
    # Tiles of the warp-specialized Gluon dQ pass (kernels/hopper_ws.py) where it serves the config;
    # launchers use it when the tensors also allow TMA, else attn_bwd_dq_kernel with `dq`.
    dq_warp_specialized: Optional[Tiles] = None
    # The same for the Gluon dK/dV pass (attn_bwd_dkdv_kernel with `dkdv` otherwise).
    dkdv_warp_specialized: Optional[Tiles] = None
    dbias_block: int = 64  # largest dBias tile side (32 for fp32 at padded d > 128: 64 needs 256 KiB)
    # Tiles of a separate dV pass, or None: dK and dV in one pass. With them, attn_bwd_dkdv_kernel runs twice:
    # dK with `dkdv` (it computes dP = V dO^T) and dV with these (P^T dO only). Each recomputes the scores; in
    # exchange each keeps one accumulator, so wider key blocks fit where the head dim is large.
    dv: Optional[Tiles] = None
    # The Gluon kernel's tiles for the dV pass, as dkdv_warp_specialized for the dK pass (there: dK only).
    dv_warp_specialized: Optional[Tiles] = None
    block_dqk2: int = 0  # as ForwardPlan's: the dK/dV and dQ passes split Q/K (dBias keeps one tile)

    @property
    def dbias(self) -> Tiles:
        """Square tiles of the dBias kernel (bias present only): the dQ pass's rows, at most
        ``dbias_block``, with its warps, no pipelining."""
        tile = min(self.dq.block_m, self.dbias_block)
        return Tiles(tile, tile, self.dq.num_warps, 1)

    @property
    def dsink(self) -> Tiles:
        """Row tiles of the sink-gradient reduction (learnable softmax only): the preprocess's rows."""
        return Tiles(self.preprocess.block_m, 0, self.preprocess.num_warps, 1)

    @staticmethod
    def dsink_grid(num_seqs: int, num_heads: int) -> Tuple[int, int, int]:
        """Launch grid of the sink-gradient kernel: one program per (sequence, query head)."""
        return (num_seqs, num_heads, 1)

    def dbias_grid(self, seqlen_q: int, seqlen_kv: int, bias_batch: int, bias_heads: int) -> Tuple[int, int, int]:
        """Launch grid of the dBias kernel: one program per [s_q, s_kv] tile of each bias slice."""
        t = self.dbias
        return (-(-seqlen_q // t.block_m), -(-seqlen_kv // t.block_n), bias_batch * bias_heads)

    @property
    def kernels(self) -> Tuple[str, ...]:
        """Kernel names of the passes this plan launches, in order (a separate dQ pass: no atomics; the dK/dV
        kernel twice with a separate dV pass)."""
        dkdv = ("attn_bwd_dkdv_kernel",) * (1 if self.dv is None else 2)
        return ("attn_bwd_preprocess_kernel",) + dkdv + ("attn_bwd_dq_kernel",)


def mask_flags(config: AttnConfig) -> Tuple[Dict[str, bool], int, int]:
    """The kernels' mask constexprs (HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT) and the (left, right) window
    they take, for a config's mask type, normalized window (-1: unbounded) and diagonal alignment
    (``AttnConfig.bottom_right``); causal masks close the right."""
    left, right = config.window_size
    if config.attn_mask_type.is_causal:
        right = 0
    flags = dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, BOTTOM_RIGHT=config.bottom_right)
    return flags, max(left, 0), max(right, 0)


def block_grid(num_blocks: int, num_seq_heads: int) -> Tuple[int, int, int]:
    """Launch grid of the forward and backward kernels: (block, sequence * head, 1).

    The block index is the fast grid axis, so programs running together mostly share one head's
    K/V (or Q/dO) in L2. The block-major order (every head's heaviest causal block first) measured
    2-18% slower than this order on the H200.
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


def split_head_dim(d: int) -> Optional[Tuple[int, int]]:
    """(first, second) chunk widths of a head dim that is the sum of two different powers of two, each
    at least 16 (tl.dot's minimum): 192 -> (128, 64), 48 -> (32, 16); None for any other head dim (a power
    of two fills its tile; 24 = 16 + 8 has a chunk too narrow)."""
    second = d & -d  # the lowest set bit
    if bin(d).count("1") != 2 or second < 16:
        return None
    return d - second, second


# CPU tests set this to plan the Q/K split under the interpreter wherever split_head_dim allows: the
# interpreter plans (device_type "cpu") never split otherwise.
INTERPRET_SPLIT_QK = False


# Interpreter (CPU tests): small tiles so tiny test shapes still span several blocks.
_INTERPRET_FWD = Tiles(16, 16, 1, 1)
_INTERPRET_BWD = Tiles(16, 16, 1, 1)

# Hopper (sm_90) tiles by padded head dim (and mask kind where it pays), the fastest measured on the
# H200. Head groups (launch order: +1.6-2.5% on causal d=128, causal d=64 dQ) and the single-loop form
# (faster at d=256 only, where registers bind) only where they measured faster. The Triton kernels load
# through pointers: TMA descriptors measured no faster over repeated runs.
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
# d_qk padded to 256 with d_v padded to 128 (192/128, the MLA head dims), either mask kind, without bias or
# dropout: the narrower V and dO tiles leave shared memory for a third forward stage and for 128-key dK/dV
# and 128-query dQ tiles, which the d=256 tables cannot fit (fwd, dK/dV, dQ). With a bias tile the forward
# exceeds shared memory and with dropout the dK/dV spills: those variants keep the d=256 tiles. Measured on
# the H200 (bf16, 2x16x4096): fwd+bwd 311 / 260 TFLOP/s (no mask / causal) against 189 / 175 with the d=256
# tiles. The single-loop dK/dV pass kept 184-208 bytes of stack with 256-wide Q/K tiles (measured fastest so);
# with d_qk = 192 split below, 96-112, and with GQA, packed sequences and sink softmax 592 (704 unsplit;
# tests/common/data/known_spills.json). With GQA (4 KV heads) the unsplit pass measured 289 / 183 backward
# TFLOP/s (no mask / causal) against 269 / 204 for the plain loop: one tile for both, as the tables have no GQA key.
_SM90_NARROW_V = (Tiles(128, 64, 8, 3), Tiles(64, 128, 8, 2, single_loop=True), Tiles(128, 64, 8, 2))
# Padded head dim 256, fp16/bf16, without bias or dropout (and not the narrow-V case): dK and dV as two
# passes (BackwardPlan.dv), each with one accumulator, so 128-key tiles fit: (dK tiles, dV tiles). Measured
# on the H200 (bf16, 2x16x4096x256, backward): 223 / 208 TFLOP/s (no mask / causal) against 184 / 174 for
# the one pass of 64x64.
_SM90_DK_DV = {
    (256, False): (Tiles(32, 128, 8, 2, single_loop=True), Tiles(64, 128, 8, 2, single_loop=True)),
    (256, True): (Tiles(32, 128, 8, 2, single_loop=True), Tiles(64, 128, 8, 2, single_loop=True)),
}
# With the narrow-V tiles, d_qk = 192 splits Q/K into chunks of 128 and 64 (BLOCK_DQK, BLOCK_DQK2) instead
# of a 256-wide tile whose last quarter is zeros: the QK^T, dS^T Q and dS K products skip that quarter, and
# the sm_90 compiles take 32-40 KiB less shared memory per pass. H200 (bf16, 2x16x4096, device time): fwd+bwd
# 364 / 319 TFLOP/s (no mask / causal) against 312 / 258 padded to 256.
_SM90_NARROW_V_SPLIT = (192,)
# The split dQ pass's tiles: the narrow-V dQ tiles (128x64, 2 stages) split make an illegal access on the H200
# that memcheck never sees and that builds with CUDA's own ptxas or at -O0 do not make (a miscompile of the
# ptxas in Triton 3.6's bundle); key blocks of 32 compile right.
_SM90_NARROW_V_SPLIT_DQ = Tiles(128, 32, 8, 3)
# Warp-specialized Gluon kernels on Hopper (kernels/hopper_ws.py): 128 rows (query rows; keys for dK/dV)
# as two consumer warpgroups of 64 plus a loader warp (12 warps allocated: 168 registers each on average).
# Forward: K/V blocks of 128 in a 2-buffer ring. Where they serve: d_qk = d_v = 128, fp16/bf16, no bias,
# ALiBi, dropout or sink softmax.
_SM90_FWD_WS = {
    (128, False): Tiles(128, 128, 4, 2, max_registers=168),
    (128, True): Tiles(128, 128, 4, 2, head_group=8, max_registers=168),
    # d=256: K/V blocks of 64 (197 KiB of shared memory); 574 / 489 TFLOP/s (no mask / causal) against
    # 538 / 433 for the Triton forward.
    (256, False): Tiles(128, 64, 4, 2, max_registers=168),
    (256, True): Tiles(128, 64, 4, 2, max_registers=168),
}
# dQ: K/V blocks of 64 (blocks of 128 spill in the causal consumer) in a 3-buffer ring.
_SM90_DQ_WS = {
    (128, False): Tiles(128, 64, 4, 3, max_registers=168),
    (128, True): Tiles(128, 64, 4, 3, head_group=8, max_registers=168),
    (256, False): Tiles(128, 32, 4, 2, max_registers=168),  # d=256: K/V blocks of 32, two buffers
    (256, True): Tiles(128, 32, 4, 2, max_registers=168),
}
# dK/dV: key blocks of 128 (64 per consumer), query blocks of 64 in a 3-buffer ring with their LSE and
# delta rows (query blocks of 32 make products too small). At d=64 all three Gluon kernels measured
# slower than the Triton ones (softmax, not the tensor cores, sets the pace there).
_SM90_DKDV_WS = {
    (128, False): Tiles(64, 128, 4, 3, max_registers=168),
    (128, True): Tiles(64, 128, 4, 3, head_group=8, max_registers=168),
    # d=256: a consumer cannot hold both [64, 256] fp32 accumulators, so this is the dK pass of two
    # (_SM90_DK_DV; query blocks of 32) and _SM90_DV_WS the dV pass (query blocks of 64), two buffers each.
    # Backward with the Gluon dQ: 347 / 298 TFLOP/s (no mask / causal) against 184 / 174 for the Triton one pass.
    (256, False): Tiles(32, 128, 4, 2, max_registers=168),
    (256, True): Tiles(32, 128, 4, 2, max_registers=168),
}
# Q/K head dim 192 as 128 + 64 with d_v 128 (ArchTables.splits_qk), by diagonal-bounded mask: the forward and
# dQ kernels take the second chunk in buffers of its own; dK/dV stays on the Triton kernel. H200, 2x16x4096 bf16
# (causal / no mask): forward 491 / 563 TFLOP/s against 403 / 490 for the Triton one (K/V blocks of 64: 421 / 524),
# backward with this dQ 319 / 369 against 299 / 341 (dQ at 2 stages the same, key blocks of 32 slower).
# A Gluon dK/dV on the split (as a dK pass and a dV pass, as at d=256) made that backward 0.91 / 0.95 as fast.
_SM90_FWD_WS_SPLIT = {False: Tiles(128, 128, 4, 2, max_registers=168), True: Tiles(128, 128, 4, 2, max_registers=168)}
_SM90_DQ_WS_SPLIT = {False: Tiles(128, 64, 4, 3, max_registers=168), True: Tiles(128, 64, 4, 3, max_registers=168)}
_SM90_DV_WS = {
    (256, False): Tiles(64, 128, 4, 2, max_registers=168),
    (256, True): Tiles(64, 128, 4, 2, max_registers=168),
}


def _by_dim(small: Tiles, mid: Tiles, large: Tiles, windowed: Optional[Tuple[Tiles, Tiles, Tiles]] = None
            ) -> Dict[Tuple[int, bool], Tiles]:
    """A table keyed as the Hopper ones: ``small`` for padded head dims up to 64, ``mid`` at 128,
    ``large`` at 256; ``windowed`` the same three for diagonal-bounded masks (default: the same)."""
    plain = (small, mid, large)
    windowed = windowed or plain
    table = {}
    for dim in (16, 32, 64, 128, 256):
        index = 0 if dim <= 64 else (1 if dim == 128 else 2)
        table[(dim, False)], table[(dim, True)] = plain[index], windowed[index]
    return table


# Ada and Ampere's GA10x (sm_86, sm_89), consumer Blackwell (sm_120, sm_121) and GPUs not listed below:
# conservative tiles that fit their 99 KiB of shared memory per block (the plan every non-Hopper NVIDIA
# GPU had before the per-architecture tables).
_SM89_FWD = _by_dim(Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2), Tiles(32, 32, 4, 1))
_SM89_BWD = _by_dim(Tiles(64, 64, 4, 1), Tiles(64, 64, 4, 1), Tiles(32, 32, 4, 1))
# A100 (sm_80) and Orin (sm_87), 163 KiB per block: the same tiles for now. Hopper's tiles fit there but
# spill on sm_80 (mma.sync keeps more per thread than wgmma: 280-2352 bytes of stack for the d=64 bias and
# dropout variants with 4 warps), so larger tiles wait for a measurement on an A100.
_SM80_FWD, _SM80_DKDV, _SM80_DQ = _SM89_FWD, _SM89_BWD, _SM89_BWD
# AMD CDNA (wave64). CDNA2 (gfx90a, MI200) and CDNA3 (gfx942, MI300) have 64 KiB of LDS per workgroup,
# CDNA4 (gfx950, MI350) 160 KiB; all three 512 registers per lane of a wave. Four waves per program (one per
# SIMD) and no software pipelining: with two stages, or 128x64 forward tiles at d=128, the bias and dropout
# variants spill. Chosen so that every planned variant compiles without scratch and fits the LDS
# (tests/common/test_kernel_compile_archs.py); not yet measured for speed.
_CDNA3_FWD = _by_dim(Tiles(128, 64, 4, 1), Tiles(128, 32, 4, 1), Tiles(64, 32, 4, 1))
_CDNA3_DKDV = _by_dim(Tiles(64, 64, 4, 1), Tiles(32, 64, 4, 1), Tiles(16, 64, 4, 1))
_CDNA3_DQ = _by_dim(Tiles(64, 64, 4, 1), Tiles(128, 32, 4, 1), Tiles(64, 32, 4, 1))
_CDNA4_FWD = _CDNA3_FWD
_CDNA4_DKDV = _CDNA3_DKDV
_CDNA4_DQ = _CDNA3_DQ
# fp32 at d=256: the clamped tiles (64x32 forward) spill 80-950 bytes of scratch with a bias and dropout,
# 32-row dQ tiles 120-152 bytes.
_CDNA_FP32_256 = (Tiles(32, 32, 4, 1), Tiles(16, 32, 4, 1), Tiles(16, 32, 4, 1))


# Blackwell datacenter parts compile Hopper's d=256 backward tiles with more shared memory (2 stages with a
# bias, dropout and GQA: 233-265 KiB); one stage there.
_SM100_DKDV = {key: (Tiles(t.block_m, t.block_n, t.num_warps, 1, t.head_group, t.single_loop) if key[0] == 256 else t)
               for key, t in _SM90_DKDV.items()}
_SM100_DQ = {key: (Tiles(t.block_m, t.block_n, t.num_warps, 1, t.head_group, t.single_loop) if key[0] == 256 else t)
             for key, t in _SM90_DQ.items()}


@dataclass(frozen=True)
class ArchTables:
    """One GPU architecture's launch plan: the resources its tiles must fit and its tile tables, keyed
    by (padded head dim, diagonal-bounded mask) as the Hopper ones."""

    name: str  # what NVTE_FUSED_ATTN_PLAN_ARCH calls it: "sm90", "gfx942"
    vendor: str  # "nvidia" or "amd"
    warp_size: int
    shared_memory: int  # bytes one program may use: opt-in shared memory per block; LDS per workgroup on AMD
    fwd: Dict[Tuple[int, bool], Tiles]
    dkdv: Dict[Tuple[int, bool], Tiles]
    dq: Dict[Tuple[int, bool], Tiles]
    warp_specialized: bool = False  # the Gluon kernels of hopper_ws.py where they serve (NVIDIA SM90 only)
    # fp32 tiles (fwd, dK/dV, dQ) at padded head dim 256 where the clamped 16-bit tiles would spill;
    # None: the clamp everywhere (forward_plan, backward_plan).
    fp32_large: Optional[Tuple[Tiles, Tiles, Tiles]] = None
    # Tiles (fwd, dK/dV, dQ) where d_qk pads to 256 and d_v to 128, without bias or dropout; None: the
    # padded-256 tables.
    narrow_v: Optional[Tuple[Tiles, Tiles, Tiles]] = None
    # (dK tiles, dV tiles) of a two-pass dK/dV backward by _head_key, for fp16/bf16 without bias or dropout
    # outside the narrow-V case; keys not here run one pass with the dK/dV table's tiles.
    dk_dv: Optional[Dict[Tuple[int, bool], Tuple[Tiles, Tiles]]] = None
    # Q/K head dims whose tiles split in two power-of-two chunks (split_head_dim) where the narrow-V
    # tiles serve a 16-bit config, rather than padding to 256.
    narrow_v_split: Tuple[int, ...] = ()
    narrow_v_split_dq: Optional[Tiles] = None  # the dQ tiles where Q/K splits; None: the narrow-V ones

    def serves_narrow_v(self, config: AttnConfig) -> bool:
        """Whether the narrow-V tiles serve ``config`` (before the fp32 clamp)."""
        return (self.narrow_v is not None and padded_head_dim(config.head_dim_qk) == 256
                and padded_head_dim(config.head_dim_v) == 128
                and config.attn_bias_type == AttnBiasType.NO_BIAS and config.dropout == 0)

    def tiles(self, config: AttnConfig, key: Tuple[int, bool]) -> Tuple[Tiles, Tiles, Tiles]:
        """The (fwd, dK/dV, dQ) table tiles of ``config`` at ``key`` (_head_key), before the fp32 clamp."""
        if self.serves_narrow_v(config):
            return self.narrow_v
        return self.fwd[key], self.dkdv[key], self.dq[key]

    def dk_dv_tiles(self, config: AttnConfig, key: Tuple[int, bool]) -> Optional[Tuple[Tiles, Tiles]]:
        """(dK tiles, dV tiles) of a two-pass dK/dV backward for ``config``, or None: one pass."""
        if (self.dk_dv is None or key not in self.dk_dv or config.dtype not in ("float16", "bfloat16")
                or config.attn_bias_type != AttnBiasType.NO_BIAS or config.dropout > 0
                or self.serves_narrow_v(config)):
            return None
        return self.dk_dv[key]

    def splits_qk(self, config: AttnConfig) -> bool:
        """Whether ``config``'s Q/K head dim splits in two chunks (narrow_v_split) on this architecture."""
        return (config.head_dim_qk in self.narrow_v_split and self.serves_narrow_v(config)
                and config.dtype in ("float16", "bfloat16") and split_head_dim(config.head_dim_qk) is not None)

    @property
    def triton_target(self) -> Tuple[str, object, int]:
        """(backend, arch, warp size) of Triton's GPUTarget for this architecture's first GPU."""
        if self.vendor == "amd":
            return ("hip", self.name, self.warp_size)
        return ("cuda", int(self.name[2:]), self.warp_size)


_KIB = 1024
ARCHS: Dict[str, ArchTables] = {t.name: t for t in (
    ArchTables("sm80", "nvidia", 32, 163 * _KIB, _SM80_FWD, _SM80_DKDV, _SM80_DQ),
    ArchTables("sm89", "nvidia", 32, 99 * _KIB, _SM89_FWD, _SM89_BWD, _SM89_BWD),
    ArchTables("sm90", "nvidia", 32, 227 * _KIB, _SM90_FWD, _SM90_DKDV, _SM90_DQ, warp_specialized=True,
               narrow_v=_SM90_NARROW_V, narrow_v_split=_SM90_NARROW_V_SPLIT, narrow_v_split_dq=_SM90_NARROW_V_SPLIT_DQ,
               dk_dv=_SM90_DK_DV),
    # Datacenter Blackwell (sm_100, sm_103) and Thor (sm_110): Hopper's 227 KiB, so Hopper's Triton tiles
    # (its Gluon kernels are written for Hopper's wgmma and TMA).
    ArchTables("sm100", "nvidia", 32, 227 * _KIB, _SM90_FWD, _SM100_DKDV, _SM100_DQ),
    ArchTables("sm120", "nvidia", 32, 99 * _KIB, _SM89_FWD, _SM89_BWD, _SM89_BWD),
    ArchTables("gfx90a", "amd", 64, 64 * _KIB, _CDNA3_FWD, _CDNA3_DKDV, _CDNA3_DQ, fp32_large=_CDNA_FP32_256),
    ArchTables("gfx942", "amd", 64, 64 * _KIB, _CDNA3_FWD, _CDNA3_DKDV, _CDNA3_DQ, fp32_large=_CDNA_FP32_256),
    ArchTables("gfx950", "amd", 64, 160 * _KIB, _CDNA4_FWD, _CDNA4_DKDV, _CDNA4_DQ, fp32_large=_CDNA_FP32_256),
)}
# Compute capabilities whose tables differ from their major's (below); AMD targets by gfx name.
_NVIDIA_EXACT = {(8, 0): "sm80", (8, 7): "sm80"}
_NVIDIA_MAJOR = {8: "sm89", 9: "sm90", 10: "sm100", 11: "sm100", 12: "sm120"}
_NVIDIA_OTHER = "sm89"  # the smallest shared memory of the NVIDIA tables: fits any GPU the backend accepts
AMD_ARCHS = {"gfx90a": "gfx90a", "gfx940": "gfx942", "gfx941": "gfx942", "gfx942": "gfx942", "gfx950": "gfx950"}


def device_arch(config: AttnConfig) -> ArchTables:
    """The tables of the config's own GPU (``vendor`` with ``compute_capability`` or ``gfx_arch``)."""
    if config.vendor == "amd":
        if config.gfx_arch not in AMD_ARCHS:
            raise NotImplementedError(f"`gfx_arch` must be one of {', '.join(sorted(AMD_ARCHS))} for the fused "
                                      f"kernels' plans, got {config.gfx_arch!r}")
        return ARCHS[AMD_ARCHS[config.gfx_arch]]
    if config.vendor != "nvidia":
        raise ValueError(f"`vendor` must be 'nvidia' or 'amd', got {config.vendor!r}")
    cc = config.compute_capability
    if cc is None:
        return ARCHS[_NVIDIA_OTHER]
    return ARCHS[_NVIDIA_EXACT.get(tuple(cc)) or _NVIDIA_MAJOR.get(cc[0], _NVIDIA_OTHER)]


def plan_arch(config: AttnConfig) -> ArchTables:
    """The tables a GPU config plans with: its device's, or those NVTE_FUSED_ATTN_PLAN_ARCH forces (read now).

    A forced plan keeps to what the device can run: only its Triton tiles (the Gluon kernels stay with
    a real SM90), and only an architecture with at most the device's shared memory, so its tiles fit.
    Warps keep the device's width (a wave64 plan on NVIDIA runs its warp counts as 32-thread warps).
    """
    device = device_arch(config)
    forced = settings.get("NVTE_FUSED_ATTN_PLAN_ARCH")
    if not forced or forced == device.name:
        return device
    tables = ARCHS[forced]
    if tables.shared_memory > device.shared_memory:
        raise ValueError(
            f"NVTE_FUSED_ATTN_PLAN_ARCH must name an architecture with at most this GPU's shared memory "
            f"({device.name}: {device.shared_memory // _KIB} KiB), got {forced!r} ({tables.shared_memory // _KIB} "
            f"KiB): its tiles may not fit here")
    return dataclasses.replace(tables, warp_specialized=False)


def _dot_precision(config: AttnConfig) -> str:
    # fp32 inputs get true fp32 products (no TF32) so fp32 results match the reference. For fp16/bf16
    # operands the setting changes no instruction on NVIDIA (TF32 concerns fp32 operands only: the sm_90
    # binaries are the same either way, tests/common/test_kernel_compile.py), and "ieee" is the value
    # every Triton target accepts (gfx90a and gfx950 reject "tf32").
    return "ieee"


def _head_key(config: AttnConfig) -> Tuple[int, bool]:
    """What Hopper tiles may depend on: padded head dim and whether the mask is diagonal-bounded."""
    dim = max(padded_head_dim(config.head_dim_qk), padded_head_dim(config.head_dim_v))
    return dim, config.window_kind != "none"


def forward_plan(config: AttnConfig, override: Optional[Tiles] = None) -> ForwardPlan:
    key = _head_key(config)
    arch = plan_arch(config) if config.device_type != "cpu" and override is None else None
    if override is not None:
        tiles = override
    elif arch is None:
        tiles = _INTERPRET_FWD
    else:
        tiles = arch.tiles(config, key)[0]
    if config.dtype == "float32" and override is None and arch is not None:
        if key[0] == 256 and arch.fp32_large is not None:
            tiles = arch.fp32_large[0]
        else:
            tiles = Tiles(min(tiles.block_m, 64), min(tiles.block_n, 32), tiles.num_warps, 1)
    # An explicit Triton tile override measures the Triton kernel.
    ws = None if override is not None else _warp_specialized(config, arch, key, _SM90_FWD_WS, _SM90_FWD_WS_SPLIT)
    block_dqk, block_dqk2 = _qk_blocks(config, arch)
    return ForwardPlan(tiles, block_dqk, padded_head_dim(config.head_dim_v), _dot_precision(config), ws, block_dqk2)


def _qk_blocks(config: AttnConfig, arch: Optional[ArchTables]) -> Tuple[int, int]:
    """(BLOCK_DQK, BLOCK_DQK2) of the Triton kernels: the two chunks of split_head_dim where the
    architecture splits Q/K (ArchTables.splits_qk; under the interpreter, where INTERPRET_SPLIT_QK asks),
    else the padded head dim and 0. A tile override (arch None on a GPU) keeps one tile."""
    split = split_head_dim(config.head_dim_qk)
    if arch is not None:
        use = arch.splits_qk(config)
    else:
        use = config.device_type == "cpu" and INTERPRET_SPLIT_QK
    if use and split is not None:
        return split
    return padded_head_dim(config.head_dim_qk), 0


def _warp_specialized(config: AttnConfig, arch: Optional[ArchTables], key: Tuple[int, bool],
                      table: Dict[Tuple[int, bool], Tiles],
                      split_table: Optional[Dict[bool, Tiles]] = None) -> Optional[Tiles]:
    """The Gluon kernels' tiles for ``config`` from ``table`` (``split_table`` where the Q/K head dim
    splits in two chunks), where they serve it (module docstring of kernels/hopper_ws.py: NVIDIA SM90
    planning with its own tables) and NVTE_FUSED_ATTN_WS does not turn them off."""
    if config.device_type != "cuda" or arch is None or not arch.warp_specialized:
        return None
    if config.dtype not in ("float16", "bfloat16"):
        return None
    if config.attn_bias_type != AttnBiasType.NO_BIAS or config.dropout > 0:
        return None
    # Sink softmax (off-by-one, learnable) is in the Triton forward only.
    if config.softmax_type.has_sink:
        return None
    if not settings.get("NVTE_FUSED_ATTN_WS"):
        return None
    if _gluon_unavailable_reason() is not None:
        return None
    # The head dims must fill their tiles: the Gluon kernels mask no head-dim columns. A Q/K head dim
    # that splits fills two chunks (split_head_dim); d_v must then fill one.
    if arch.splits_qk(config):
        if split_table is None or config.head_dim_v != padded_head_dim(config.head_dim_v):
            return None
        return split_table.get(key[1])
    if config.head_dim_qk != config.head_dim_v or config.head_dim_qk != key[0]:
        return None
    return table.get(key)


def _gluon_unavailable_reason() -> Optional[str]:
    """Why the installed Triton cannot build the Gluon kernels (kernels/triton_compat.py), or None; the reason
    is logged at WARNING once, and the plan keeps the Triton kernels, which every supported release builds."""
    from transformer_engine.common.attention.kernels.triton_compat import gluon_unavailable_reason

    reason = gluon_unavailable_reason()
    if reason is not None:
        from transformer_engine.common.log import warn_once

        warn_once("plan:gluon_unavailable", "fused attention runs its Triton kernels where the plan would run the "
                  f"warp-specialized Gluon ones (Hopper): {reason}")
    return reason


def backward_plan(config: AttnConfig, override: Optional[Tuple[Tiles, Tiles]] = None) -> BackwardPlan:
    key = _head_key(config)
    arch = plan_arch(config) if config.device_type != "cpu" and override is None else None
    if override is not None:
        dkdv, dq = override
    elif arch is None:
        dkdv = dq = _INTERPRET_BWD
    else:
        dkdv, dq = arch.tiles(config, key)[1:]
        if arch.narrow_v_split_dq is not None and arch.splits_qk(config):
            dq = arch.narrow_v_split_dq
    if config.dtype == "float32" and override is None and arch is not None:
        if key[0] == 256 and arch.fp32_large is not None:
            dkdv, dq = arch.fp32_large[1:]
        else:
            dkdv = Tiles(min(dkdv.block_m, 32), min(dkdv.block_n, 64), dkdv.num_warps, 1)
            dq = Tiles(min(dq.block_m, 64), min(dq.block_n, 32), dq.num_warps, 1)
    dv = None
    two_pass = arch.dk_dv_tiles(config, key) if arch is not None else None
    if two_pass is not None:
        dkdv, dv = two_pass
    preprocess = Tiles(64 if config.device_type != "cpu" else 16, 0, 4, 1)
    # Both modes run the separate dQ pass: it measured 2-3x faster than an atomic dQ on the H200.
    # An explicit Triton tile override measures the Triton kernels.
    served = override is None
    ws_dq = _warp_specialized(config, arch, key, _SM90_DQ_WS, _SM90_DQ_WS_SPLIT) if served else None
    ws_dkdv = _warp_specialized(config, arch, key, _SM90_DKDV_WS) if served else None
    ws_dv = _warp_specialized(config, arch, key, _SM90_DV_WS) if served else None
    # The Gluon dK/dV rows make as many passes as the Triton plan: one (no dV row) or two.
    if (dv is None) != (ws_dv is None):
        ws_dkdv = ws_dv = None
    # The dBias kernel holds Q, K, V and dO tiles at once: fp32 at padded d > 128 halves its tile.
    dbias_block = 32 if config.dtype == "float32" and key[0] > 128 else 64
    block_dqk, block_dqk2 = _qk_blocks(config, arch)
    return BackwardPlan(preprocess, dkdv, dq, block_dqk, padded_head_dim(config.head_dim_v), _dot_precision(config),
                        ws_dq, ws_dkdv, dbias_block, dv=dv, dv_warp_specialized=ws_dv, block_dqk2=block_dqk2)
