"""Launch plans: tile sizes, warps, stages and kernel variants as pure functions of a :class:`PlanKey`.

Determinism contract: in deterministic mode the tiles and loop orders
depend only on head dim, dtype, mask/window kind and GPU architecture — never on batch size,
sequence length or autotuning. Every plan function reads the call through its PlanKey (an AttnConfig is
taken as its ``plan_key``), which holds no batch size or sequence length, so nothing below can. Whether the
warp-specialized Gluon kernels serve a config also reads its bias/dropout and NVTE_FUSED_ATTN_WS (and, for a
paged KV cache's forward, the page size: gluon_page_reason), and whether Hopper's narrow-V tiles (and their Q/K head-dim split) do reads its bias/dropout, alike for both
frameworks.

Architectures (:data:`ARCHS`): one :class:`ArchTables` per GPU family holds every kernel variant's tiles
(Triton and, on Hopper, the warp-specialized Gluon kernels) and the shared memory (LDS on AMD) they must
fit; :func:`plan_arch` finds a config's from its vendor and compute capability or gfx target, or takes the
one NVTE_FUSED_ATTN_PLAN_ARCH forces. The Hopper tables and the Gluon kernels serve NVIDIA SM90 only.
Which row a plan took, and why, is :func:`transformer_engine.common.attention.explain.explain_plan`'s
answer (:func:`trace_forward` and :func:`trace_backward` record it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

from transformer_engine.common.attention.config import AttnConfig, PlanKey
from transformer_engine.common import settings
from transformer_engine.common.attention.enums import AttnBiasType

__all__ = ["Tiles", "ForwardPlan", "BackwardPlan", "ArchTables", "ARCHS", "forward_plan", "backward_plan",
           "plan_key", "plan_arch", "device_arch", "mask_flags", "window_mask_flags", "padded_head_dim",
           "split_head_dim", "block_grid", "tma_eligible", "PlanTrace", "trace_forward", "trace_backward", "row_name",
           "pages_keep_bits", "gluon_page_reason", "GLUON_MIN_PAGE"]


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    head_group: int = 1  # launch order: heads whose blocks interleave (kernels/masking.py, grid_program)
    single_loop: bool = False  # one pipelined block loop masking per block, not three loops (pays where registers bind)
    max_registers: Optional[int] = None  # per-thread register cap of the launch (maxnreg; None: the compiler's)

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
        """The Triton kernels' launch options: Triton pipelines their loops over num_stages."""
        return self._options(self.num_stages)

    @property
    def ws_launch_options(self) -> Dict[str, int]:
        """The warp-specialized Gluon kernels' launch options: their ring of num_stages buffers is their own
        pipeline (ws_constexprs), so Triton's is off."""
        return self._options(1)

    def _options(self, num_stages: int) -> Dict[str, int]:
        options = dict(num_warps=self.num_warps, num_stages=num_stages)
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options


@dataclass(frozen=True)
class ForwardPlan:
    tiles: Tiles
    block_dqk: int
    block_dv: int
    # Tiles of the warp-specialized Gluon forward (kernels/hopper_ws.py) where it serves the config; the
    # launches (launch_description.py) use it when the tensors also allow TMA (tma_eligible), else
    # attn_fwd_kernel with `tiles`.
    warp_specialized: Optional[Tiles] = None
    # Width of the second Q/K head-dim chunk (BLOCK_DQK2) where the Q/K head dim splits in two (block_dqk
    # is then the first chunk: split_head_dim); 0: one block_dqk-wide tile.
    block_dqk2: int = 0
    # Keys per chunk of the canonical sum (kernels/forward.py): a row's keys are summed chunk by chunk, each
    # chunk from scratch, and the chunks folded in order, so that split-KV decode (one program per chunk)
    # gives the training forward's bits. A multiple of tiles.block_n; 0: one chunk (no split-KV).
    kv_chunk: int = 0
    # Per-thread register cap (maxnreg) of the Triton forward's one-program chunked sum, or None: the compiler's
    # own count. Its second fp32 accumulator (the chunk's state beside the folded one) would cost an occupancy
    # step; capped, ptxas spills a few words outside the key loops instead. Register allocation changes no
    # arithmetic, so no bits.
    kv_chunk_registers: Optional[int] = None


@dataclass(frozen=True)
class BackwardPlan:
    preprocess: Tiles
    dkdv: Tiles
    dq: Tiles
    block_dqk: int
    block_dv: int
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


Config = Union[AttnConfig, PlanKey]


def plan_key(config: Config) -> PlanKey:
    """What plans read of ``config``: itself when a :class:`PlanKey`, else the AttnConfig's ``plan_key``."""
    return config if isinstance(config, PlanKey) else config.plan_key


def mask_flags(config: Config) -> Tuple[Dict[str, bool], int, int]:
    """The kernels' mask constexprs (HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT) and the (left, right) window
    they take, for a config's mask type, normalized window (-1: unbounded) and diagonal alignment
    (``AttnConfig.bottom_right``); causal masks close the right."""
    config = plan_key(config)
    return window_mask_flags(config.attn_mask_type, config.window_size, config.bottom_right)


def window_mask_flags(attn_mask_type, window_size: Tuple[int, int],
                      bottom_right: bool) -> Tuple[Dict[str, bool], int, int]:
    """:func:`mask_flags` of a mask type, normalized window and resolved diagonal alignment (the FP8 kernels'
    launches, which have no PlanKey, read it from their AttnParams)."""
    left, right = window_size
    if attn_mask_type.is_causal():
        right = 0
    flags = dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, BOTTOM_RIGHT=bool(bottom_right))
    return flags, max(left, 0), max(right, 0)


def block_grid(num_blocks: int, num_seq_heads: int) -> Tuple[int, int, int]:
    """Launch grid of the forward and backward kernels: (block, sequence * head, 1).

    The block index is the fast grid axis, so programs running together mostly share one head's
    K/V (or Q/dO) in L2, which the block-major order (every head's heaviest causal block first) does not.
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


# Interpreter (CPU tests), every pass: small tiles so tiny test shapes still span several blocks.
_INTERPRET = Tiles(16, 16, 1, 1)
_INTERPRET_KV_CHUNK = 64  # small, so that CPU tests sum most rows over several chunks

Table = Dict[Tuple[int, bool], Tiles]


@dataclass(frozen=True)
class ArchTables:
    """One GPU architecture's launch plan: the resources its tiles must fit and every kernel variant's
    tiles, keyed by (padded head dim, diagonal-bounded mask) (:func:`forward_plan`, :func:`backward_plan`;
    :func:`transformer_engine.common.attention.explain.explain_plan` names the row a plan takes)."""

    name: str  # what NVTE_FUSED_ATTN_PLAN_ARCH calls it: "sm90", "gfx942"
    vendor: str  # "nvidia" or "amd"
    warp_size: int
    shared_memory: int  # bytes one program may use: opt-in shared memory per block; LDS per workgroup on AMD
    fwd: Table
    dkdv: Table
    dq: Table
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
    warp_specialized: bool = False  # the Gluon kernels of hopper_ws.py where they serve (NVIDIA SM90 only)
    # The Gluon kernels' tiles by _head_key (keys not here: the Triton kernels); the dK/dV row is the dK pass
    # where dk_dv splits the backward in two, dv_ws that of the dV pass.
    fwd_ws: Table = dataclasses.field(default_factory=dict)
    dq_ws: Table = dataclasses.field(default_factory=dict)
    dkdv_ws: Table = dataclasses.field(default_factory=dict)
    dv_ws: Table = dataclasses.field(default_factory=dict)
    # The Gluon forward's and dQ's tiles where the Q/K head dim splits (splits_qk), by diagonal-bounded mask.
    fwd_ws_split: Dict[bool, Tiles] = dataclasses.field(default_factory=dict)
    dq_ws_split: Dict[bool, Tiles] = dataclasses.field(default_factory=dict)
    # Keys per chunk of the forward's canonical sum (ForwardPlan.kv_chunk) where the Triton forward serves.
    kv_chunk: int = 4096
    # ForwardPlan.kv_chunk_registers of 16-bit configs by _head_key (keys not here: no cap).
    kv_chunk_registers: Dict[Tuple[int, bool], int] = dataclasses.field(default_factory=dict)

    def serves_narrow_v(self, config: PlanKey) -> bool:
        """Whether the narrow-V tiles serve ``config`` (before the fp32 clamp)."""
        return (self.narrow_v is not None and padded_head_dim(config.head_dim_qk) == 256
                and padded_head_dim(config.head_dim_v) == 128
                and config.attn_bias_type == AttnBiasType.NO_BIAS and config.kernel_dropout == 0)

    def tiles(self, config: PlanKey, key: Tuple[int, bool]) -> Tuple[Tiles, Tiles, Tiles]:
        """The (fwd, dK/dV, dQ) table tiles of ``config`` at ``key`` (_head_key), before the fp32 clamp."""
        if self.serves_narrow_v(config):
            return self.narrow_v
        return self.fwd[key], self.dkdv[key], self.dq[key]

    def dk_dv_tiles(self, config: PlanKey, key: Tuple[int, bool]) -> Optional[Tuple[Tiles, Tiles]]:
        """(dK tiles, dV tiles) of a two-pass dK/dV backward for ``config``, or None: one pass."""
        if (self.dk_dv is None or key not in self.dk_dv or config.dtype not in ("float16", "bfloat16")
                or config.attn_bias_type != AttnBiasType.NO_BIAS or config.kernel_dropout > 0
                or self.serves_narrow_v(config)):
            return None
        return self.dk_dv[key]

    def splits_qk(self, config: PlanKey) -> bool:
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
_DIMS = (16, 32, 64, 128, 256)


def _rows(rows: Dict[int, Tuple[Tiles, Tiles]]) -> Table:
    """A table from {padded head dim: (unbounded-mask tiles, diagonal-bounded-mask tiles)}."""
    return {(dim, bounded): pair[bounded] for dim, pair in rows.items() for bounded in (False, True)}


def _by_dim(small: Tiles, mid: Tiles, large: Tiles) -> Table:
    """A table with ``small`` for padded head dims up to 64, ``mid`` at 128, ``large`` at 256, whatever
    the mask."""
    return _rows({dim: ((small if dim <= 64 else mid if dim == 128 else large),) * 2 for dim in _DIMS})


def _hopper() -> ArchTables:
    """Hopper (sm_90): the fastest tiles measured by padded head dim and mask kind.
    Head groups (launch order) and the single-loop form only where they were faster; the single loop only
    at d=256, where registers bind. The Triton kernels load through pointers (TMA descriptors were no
    faster for them)."""
    return ArchTables(
        "sm90", "nvidia", 32, 227 * _KIB,
        fwd=_rows({
            16: (Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3)),
            32: (Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3)),
            64: (Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3)),
            128: (Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3, head_group=8)),
            256: (Tiles(128, 64, 8, 2, single_loop=True), Tiles(128, 64, 8, 2, single_loop=True)),
        }),
        dkdv=_rows({
            16: (Tiles(32, 128, 4, 3), Tiles(64, 64, 4, 3)),
            32: (Tiles(32, 128, 4, 3), Tiles(64, 64, 4, 3)),
            64: (Tiles(32, 128, 4, 3), Tiles(64, 64, 4, 3)),
            128: (Tiles(64, 128, 8, 3), Tiles(64, 128, 8, 3, head_group=8)),
            256: (Tiles(64, 64, 8, 2, single_loop=True), Tiles(64, 64, 8, 2, single_loop=True)),
        }),
        dq=_rows({
            16: (Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 3)),
            32: (Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 3)),
            64: (Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3, head_group=4)),
            128: (Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3, head_group=8)),
            256: (Tiles(64, 64, 8, 2), Tiles(64, 64, 8, 2)),
        }),
        # d_qk padded to 256 with d_v padded to 128 (192/128, the MLA head dims), without bias or dropout: the
        # narrower V and dO tiles leave shared memory for larger tiles than the d=256 rows.
        narrow_v=(Tiles(128, 64, 8, 3), Tiles(64, 128, 8, 2, single_loop=True), Tiles(128, 64, 8, 2)),
        # d_qk = 192 as chunks of 128 and 64 (BLOCK_DQK, BLOCK_DQK2) instead of a 256-wide tile whose last
        # quarter is zeros: the QK^T, dS^T Q and dS K products skip that quarter, and every pass takes less
        # shared memory.
        narrow_v_split=(192,),
        narrow_v_split_dq=Tiles(128, 32, 8, 3),  # ptxas miscompiles the narrow-V dQ tiles split
        # Padded head dim 256, fp16/bf16, without bias or dropout (outside the narrow-V case): dK and dV as two
        # passes (BackwardPlan.dv), each with one accumulator, so 128-key tiles fit: (dK tiles, dV tiles).
        dk_dv={key: (Tiles(32, 128, 8, 2, single_loop=True), Tiles(64, 128, 8, 2, single_loop=True))
               for key in ((256, False), (256, True))},
        # The warp-specialized Gluon kernels (kernels/hopper_ws.py): 128 rows as two consumer warpgroups of 64
        # plus a loader warp. They serve d_qk = d_v = 128 or 256, fp16/bf16, no bias, ALiBi, dropout or sink
        # softmax; at d=64 and below the Triton kernels are faster.
        warp_specialized=True,
        # Forward: K/V blocks of 128 in a 2-buffer ring; at d=256 blocks of 64.
        fwd_ws=_rows({
            128: (Tiles(128, 128, 4, 2, max_registers=168), Tiles(128, 128, 4, 2, head_group=8, max_registers=168)),
            256: (Tiles(128, 64, 4, 2, max_registers=168),) * 2,
        }),
        # dQ: K/V blocks of 64 in a 3-buffer ring; at d=256 blocks of 32 in two buffers.
        dq_ws=_rows({
            128: (Tiles(128, 64, 4, 3, max_registers=168), Tiles(128, 64, 4, 3, head_group=8, max_registers=168)),
            256: (Tiles(128, 32, 4, 2, max_registers=168),) * 2,
        }),
        # dK/dV: key blocks of 128 (64 per consumer), query blocks of 64 in a 3-buffer ring. At d=256 a consumer
        # cannot hold both fp32 accumulators: this is the dK pass of two (dk_dv) and dv_ws the dV pass.
        dkdv_ws=_rows({
            128: (Tiles(64, 128, 4, 3, max_registers=168), Tiles(64, 128, 4, 3, head_group=8, max_registers=168)),
            256: (Tiles(32, 128, 4, 2, max_registers=168),) * 2,
        }),
        dv_ws=_rows({256: (Tiles(64, 128, 4, 2, max_registers=168),) * 2}),
        # Q/K head dim 192 as 128 + 64 with d_v 128 (splits_qk): the forward and dQ kernels take the second chunk
        # in buffers of its own; dK/dV stays on the Triton kernel.
        fwd_ws_split={False: Tiles(128, 128, 4, 2, max_registers=168), True: Tiles(128, 128, 4, 2, max_registers=168)},
        dq_ws_split={False: Tiles(128, 64, 4, 3, max_registers=168), True: Tiles(128, 64, 4, 3, max_registers=168)},
        # At d=64 the chunked sum's second accumulator would cost an occupancy step: capped at the unchunked
        # forward's register count.
        kv_chunk_registers={(64, False): 128, (64, True): 168},
    )


def _blackwell(hopper: ArchTables) -> ArchTables:
    """Datacenter Blackwell (sm_100, sm_103) and Thor (sm_110): Hopper's 227 KiB, so Hopper's Triton tiles
    (its Gluon kernels are written for Hopper's wgmma and TMA), with one stage for the d=256 backward: two
    exceed the shared memory there with a bias, dropout and GQA."""
    def one_stage_at_256(table: Table) -> Table:
        return {key: dataclasses.replace(t, num_stages=1) if key[0] == 256 else t for key, t in table.items()}

    return ArchTables("sm100", "nvidia", 32, hopper.shared_memory, hopper.fwd, one_stage_at_256(hopper.dkdv),
                      one_stage_at_256(hopper.dq))


def _small_nvidia(name: str, shared_memory: int) -> ArchTables:
    """Conservative tiles that fit 99 KiB of shared memory per block: Ada and Ampere's GA10x (sm_86, sm_89),
    consumer Blackwell (sm_120, sm_121) and GPUs not listed. A100 (sm_80) and Orin (sm_87), 163 KiB, take
    them too for now: Hopper's tiles fit there but spill on sm_80 (mma.sync keeps more per thread than wgmma),
    so larger tiles wait for a measurement on an A100."""
    bwd = _by_dim(Tiles(64, 64, 4, 1), Tiles(64, 64, 4, 1), Tiles(32, 32, 4, 1))
    return ArchTables(name, "nvidia", 32, shared_memory, _by_dim(Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2),
                                                                  Tiles(32, 32, 4, 1)), bwd, bwd)


def _cdna(name: str, lds: int) -> ArchTables:
    """AMD CDNA (wave64): CDNA2 (gfx90a) and CDNA3 (gfx942) with 64 KiB of LDS per workgroup, CDNA4 (gfx950)
    with 160 KiB; all 512 registers per lane of a wave. Four waves per program (one per SIMD) and no
    software pipelining: with two stages, or 128x64 forward tiles at d=128, the bias and dropout variants
    spill. Chosen so that every planned variant compiles without scratch and fits the LDS
    (tests/common/test_kernel_compile_archs.py), not for speed. fp32 at d=256 takes smaller tiles of its
    own: the clamped ones spill with a bias and dropout."""
    return ArchTables(
        name, "amd", 64, lds,
        fwd=_by_dim(Tiles(128, 64, 4, 1), Tiles(128, 32, 4, 1), Tiles(64, 32, 4, 1)),
        dkdv=_by_dim(Tiles(64, 64, 4, 1), Tiles(32, 64, 4, 1), Tiles(16, 64, 4, 1)),
        dq=_by_dim(Tiles(64, 64, 4, 1), Tiles(128, 32, 4, 1), Tiles(64, 32, 4, 1)),
        fp32_large=(Tiles(32, 32, 4, 1), Tiles(16, 32, 4, 1), Tiles(16, 32, 4, 1)),
    )


ARCHS: Dict[str, ArchTables] = {t.name: t for t in (
    _small_nvidia("sm80", 163 * _KIB),
    _small_nvidia("sm89", 99 * _KIB),
    _hopper(),
    _blackwell(_hopper()),
    _small_nvidia("sm120", 99 * _KIB),
    _cdna("gfx90a", 64 * _KIB),
    _cdna("gfx942", 64 * _KIB),
    _cdna("gfx950", 160 * _KIB),
)}
# Compute capabilities whose tables differ from their major's (below); AMD targets by gfx name.
_NVIDIA_EXACT = {(8, 0): "sm80", (8, 7): "sm80"}
_NVIDIA_MAJOR = {8: "sm89", 9: "sm90", 10: "sm100", 11: "sm100", 12: "sm120"}
_NVIDIA_OTHER = "sm89"  # the smallest shared memory of the NVIDIA tables: fits any GPU the backend accepts
AMD_ARCHS = {"gfx90a": "gfx90a", "gfx940": "gfx942", "gfx941": "gfx942", "gfx942": "gfx942", "gfx950": "gfx950"}


def device_arch(config: Config) -> ArchTables:
    """The tables of the config's own GPU (``vendor`` with ``compute_capability`` or ``gfx_arch``)."""
    config = plan_key(config)
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


def plan_arch(config: Config) -> ArchTables:
    """The tables a GPU config plans with: its device's, or those NVTE_FUSED_ATTN_PLAN_ARCH forces (read now).

    A forced plan keeps to what the device can run: only its Triton tiles (the Gluon kernels and register caps
    stay with a real SM90), and only an architecture with at most the device's shared memory, so its tiles fit.
    Warps keep the device's width (a wave64 plan on NVIDIA runs its warp counts as 32-thread warps).
    """
    device = device_arch(plan_key(config))
    forced = settings.get("NVTE_FUSED_ATTN_PLAN_ARCH")
    if not forced or forced == device.name:
        return device
    tables = ARCHS[forced]
    if tables.shared_memory > device.shared_memory:
        raise ValueError(
            f"NVTE_FUSED_ATTN_PLAN_ARCH must name an architecture with at most this GPU's shared memory "
            f"({device.name}: {device.shared_memory // _KIB} KiB), got {forced!r} ({tables.shared_memory // _KIB} "
            f"KiB): its tiles may not fit here")
    # Register caps are tuned to their own GPU's register file and compiler target: not carried to another.
    return dataclasses.replace(tables, warp_specialized=False, kv_chunk_registers={})


def _head_key(config: PlanKey) -> Tuple[int, bool]:
    """What the tables' rows are keyed by: padded head dim and whether the mask is diagonal-bounded."""
    dim = max(padded_head_dim(config.head_dim_qk), padded_head_dim(config.head_dim_v))
    return dim, config.window_kind != "none"


def row_name(arch: str, table: str, key: Tuple[int, bool]) -> str:
    """How plans name a table row: ``sm90.fwd[128, bounded]`` (a diagonal-bounded mask) or ``[128, unbounded]``."""
    return f"{arch}.{table}[{key[0]}, {'bounded' if key[1] else 'unbounded'}]"


@dataclass
class PlanTrace:
    """How a plan was found (explain.py): the tables (None: interpreter or a tile override), the row key, the
    row each of the plan's tile fields came from, and why each warp-specialized field is None."""

    arch: Optional[ArchTables]
    key: Tuple[int, bool]
    rows: Dict[str, str] = dataclasses.field(default_factory=dict)
    gluon_off: Dict[str, str] = dataclasses.field(default_factory=dict)


def _fp32_clamp(tiles: Tiles, block_m: int, block_n: int) -> Tiles:
    return Tiles(min(tiles.block_m, block_m), min(tiles.block_n, block_n), tiles.num_warps, 1)


def trace_forward(config: Config, override: Optional[Tiles] = None) -> Tuple[ForwardPlan, PlanTrace]:
    """:func:`forward_plan` with the rows it took (:class:`PlanTrace`)."""
    config = plan_key(config)
    key = _head_key(config)
    arch = plan_arch(config) if config.device_type != "cpu" and override is None else None
    trace = PlanTrace(arch, key)
    if override is not None:
        tiles, row = override, "the tile override"
    elif arch is None:
        tiles, row = _INTERPRET, "the interpreter's tiles"
    else:
        tiles = arch.tiles(config, key)[0]
        row = f"{arch.name}.narrow_v[fwd]" if arch.serves_narrow_v(config) else row_name(arch.name, "fwd", key)
    if config.dtype == "float32" and arch is not None:
        if key[0] == 256 and arch.fp32_large is not None:
            tiles, row = arch.fp32_large[0], f"{arch.name}.fp32_large[fwd]"
        else:
            tiles, row = _fp32_clamp(tiles, 64, 32), row + ", clamped for fp32 (at most 64x32, one stage)"
    trace.rows["tiles"] = row
    if override is not None:  # an explicit Triton tile override measures the Triton kernel
        ws, trace.gluon_off["warp_specialized"] = None, "a Triton tile override"
    else:
        ws = _warp_specialized(config, arch, key, "fwd", trace, "warp_specialized")
    block_dqk, block_dqk2 = _qk_blocks(config, arch)
    gluon_serves = ws is not None
    if gluon_serves and config.kv_page_size:
        # The Gluon forward's loader follows the page table where a key block is whole pages or lies in one; then
        # the consumers get the same tiles as from contiguous rows, so the contiguous calls' bits. Other page sizes
        # run the Triton forward, whose products are blocked unlike the Gluon forward's: the frontends gather such
        # a config's pages instead (pages_keep_bits) and this plan serves direct kernel calls only.
        why = gluon_page_reason(config.kv_page_size, ws.block_n)
        if why is None and not settings.get("NVTE_FUSED_ATTN_GLUON_PAGED"):
            why = ("NVTE_FUSED_ATTN_GLUON_PAGED=0: its loader does not follow the page table, the Triton forward "
                   "does")
        if why is None:
            loads = _page_loads(config.kv_page_size, ws.block_n)
            trace.rows["warp_specialized"] += (f"; pages of {config.kv_page_size} keys read in place by its loader "
                                               f"({loads} TMA load{'s' * (loads > 1)} per K/V block of {ws.block_n})")
        else:
            ws, trace.gluon_off["warp_specialized"] = None, f"a paged KV cache: {why}"
    if config.kv_page_size and ws is None and arch is not None and arch.vendor == "nvidia" and tiles.num_stages > 2:
        # Triton 3.6's ptxas crashes (SIGSEGV) on the three-stage pipeline of the page-table loads (sm_90, d=32,
        # packed sequences); stages only schedule the loads, so the sum, and the bits, are the same.
        tiles = dataclasses.replace(tiles, num_stages=2)
        trace.rows["tiles"] += ", at most two stages for a paged cache"
    if gluon_serves and max(config.head_dim_qk, config.head_dim_v) > 128:
        # Both kernels must sum a config's rows alike (the Gluon one serves only where the tensors allow TMA).
        # The Gluon forward's chunked sum keeps a second fp32 accumulator, which spills beyond d=128.
        kv_chunk, trace.rows["kv_chunk"] = 0, "one chunk: the warp-specialized forward serves this config"
    elif config.device_type == "cpu":
        kv_chunk, trace.rows["kv_chunk"] = _INTERPRET_KV_CHUNK, "the interpreter's chunk"
    else:
        chunk_arch = arch or plan_arch(config)  # a tile override keeps the architecture's sum
        kv_chunk, trace.rows["kv_chunk"] = chunk_arch.kv_chunk, f"{chunk_arch.name}.kv_chunk"
    if kv_chunk % tiles.block_n:
        raise ValueError(f"kv_chunk={kv_chunk} must be a multiple of the forward's block_n={tiles.block_n}")
    registers = None
    if (kv_chunk and arch is not None and key in arch.kv_chunk_registers and config.dtype != "float32"
            and not arch.serves_narrow_v(config)):
        registers = arch.kv_chunk_registers[key]
        trace.rows["kv_chunk"] += (f"; the Triton forward's chunked sum capped at {registers} registers "
                                   f"({arch.name}.kv_chunk_registers)")
    return ForwardPlan(tiles, block_dqk, padded_head_dim(config.head_dim_v), ws, block_dqk2, kv_chunk,
                       registers), trace


def forward_plan(config: Config, override: Optional[Tiles] = None) -> ForwardPlan:
    """The forward's tiles for ``config`` (an AttnConfig or its PlanKey); ``override``: these Triton tiles
    instead (measurements)."""
    return trace_forward(config, override)[0]


# The smallest page the Gluon forward's loader reads in place where pages are smaller than its key block: a block
# then takes one TMA load per page and tensor (8 at most for blocks of 128), each into a row slice of the block's
# shared-memory buffer, which must start on the buffer's 8-row swizzle period.
GLUON_MIN_PAGE = 16


def gluon_page_reason(page_size: int, block_n: int) -> Optional[str]:
    """Why the Gluon forward with key blocks of ``block_n`` cannot read a paged KV cache with pages of
    ``page_size`` keys through its page table in place, or None where it can: a page size that is a multiple of
    the key block (one TMA load per block), or one of at least GLUON_MIN_PAGE keys dividing it (one per page)."""
    if page_size % block_n == 0:
        return None
    if block_n % page_size == 0:
        if page_size >= GLUON_MIN_PAGE:
            return None
        return (f"pages of {page_size} keys: its loader reads pages of at least {GLUON_MIN_PAGE} keys (a TMA load "
                "per page), the Triton forward follows the page table")
    return (f"pages of {page_size} keys neither hold whole K/V blocks of {block_n} keys nor divide them (the Gluon "
            "loader's TMA loads take whole pages or whole blocks), the Triton forward follows the page table")


def _page_loads(page_size: int, block_n: int) -> int:
    return 1 if page_size % block_n == 0 else block_n // page_size


def pages_keep_bits(config: Config, page_size: int) -> bool:
    """Whether the forward reading a paged KV cache with pages of ``page_size`` keys through its page table gives
    ``config``'s bits (those of the same call on the pages gathered into rows): where its plan is the contiguous
    call's. The Triton forward and the Gluon one both follow a page table with the contiguous call's arithmetic,
    but the Gluon forward only pages that whole key blocks fill or lie in (gluon_page_reason): with other page
    sizes on Hopper's fp16/bf16 plain configs the paged plan runs the Triton forward, whose products are blocked
    differently. Both frontends gather such a config's pages instead."""
    key = plan_key(config)
    paged = forward_plan(dataclasses.replace(key, kv_page_size=page_size))
    contiguous = forward_plan(dataclasses.replace(key, kv_page_size=0))
    # Pipeline stages schedule the loads, not the sum: the paged Triton forward keeps at most two (trace_forward).
    stages = dataclasses.replace(paged.tiles, num_stages=contiguous.tiles.num_stages)
    return dataclasses.replace(paged, tiles=stages) == contiguous


def _qk_blocks(config: PlanKey, arch: Optional[ArchTables]) -> Tuple[int, int]:
    """(BLOCK_DQK, BLOCK_DQK2) of the Triton kernels: the two chunks of split_head_dim where the
    architecture splits Q/K (ArchTables.splits_qk; under the interpreter, where
    NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK asks), else the padded head dim and 0. A tile override (arch None
    on a GPU) keeps one tile."""
    split = split_head_dim(config.head_dim_qk)
    if arch is not None:
        use = arch.splits_qk(config)
    else:
        use = config.device_type == "cpu" and settings.get("NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK")
    if use and split is not None:
        return split
    return padded_head_dim(config.head_dim_qk), 0


def _warp_specialized(config: PlanKey, arch: Optional[ArchTables], key: Tuple[int, bool], kernel: str,
                      trace: PlanTrace, field_name: str) -> Optional[Tiles]:
    """The Gluon ``kernel``'s ("fwd", "dq", "dkdv" or "dv") tiles for ``config`` from the architecture's
    ``<kernel>_ws`` table (``<kernel>_ws_split`` where the Q/K head dim splits in two chunks), where they
    serve it (module docstring of kernels/hopper_ws.py: NVIDIA SM90 planning with its own tables) and
    NVTE_FUSED_ATTN_WS does not turn them off; else None, with the reason in ``trace.gluon_off``."""
    tiles, why = _gluon_tiles(config, arch, key, kernel)
    if tiles is None:
        trace.gluon_off[field_name] = why
    else:
        trace.rows[field_name] = why
    return tiles


def _gluon_tiles(config: PlanKey, arch: Optional[ArchTables], key: Tuple[int, bool],
                 kernel: str) -> Tuple[Optional[Tiles], str]:
    """(tiles, their row) where the Gluon ``kernel`` serves, else (None, why not)."""
    if config.device_type != "cuda" or arch is None:
        return None, f"device_type {config.device_type!r}: the Gluon kernels run on CUDA GPUs only"
    if not arch.warp_specialized:
        if arch.fwd_ws:
            return None, f"NVTE_FUSED_ATTN_PLAN_ARCH forces {arch.name}: a forced plan runs Triton kernels only"
        return None, f"{arch.name} has no warp-specialized kernels (NVIDIA SM90 only)"
    if config.dtype not in ("float16", "bfloat16"):
        return None, f"dtype {config.dtype}: the Gluon kernels take fp16/bf16 only"
    if config.attn_bias_type != AttnBiasType.NO_BIAS or config.kernel_dropout > 0:
        return None, "a bias, ALiBi or dropout: the Gluon kernels have none"
    # Sink softmax (off-by-one, learnable) is in the Triton forward only.
    if config.softmax_type.has_sink:
        return None, "sink softmax: in the Triton kernels only"
    if not settings.get("NVTE_FUSED_ATTN_WS"):
        return None, "NVTE_FUSED_ATTN_WS=0"
    reason = _gluon_unavailable_reason()
    if reason is not None:
        return None, f"the installed Triton cannot build them: {reason}"
    # The head dims must fill their tiles: the Gluon kernels mask no head-dim columns. A Q/K head dim
    # that splits fills two chunks (split_head_dim); d_v must then fill one.
    if arch.splits_qk(config):
        split_table = getattr(arch, f"{kernel}_ws_split", None)
        if split_table is None or key[1] not in split_table:
            return None, f"no Gluon {kernel} kernel for a split Q/K head dim ({arch.name}.{kernel}_ws_split)"
        if config.head_dim_v != padded_head_dim(config.head_dim_v):
            return None, f"d_v {config.head_dim_v} does not fill its tile (the Gluon kernels mask no head-dim columns)"
        return split_table[key[1]], f"{arch.name}.{kernel}_ws_split[{'bounded' if key[1] else 'unbounded'}]"
    if config.head_dim_qk != config.head_dim_v or config.head_dim_qk != key[0]:
        return None, (f"head dims {config.head_dim_qk}/{config.head_dim_v} do not fill one {key[0]}-wide tile (the "
                      "Gluon kernels mask no head-dim columns)")
    table = getattr(arch, f"{kernel}_ws")
    if key not in table:
        return None, f"no row {row_name(arch.name, kernel + '_ws', key)}"
    return table[key], row_name(arch.name, kernel + "_ws", key)


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


def trace_backward(config: Config, override: Optional[Tuple[Tiles, Tiles]] = None
                   ) -> Tuple[BackwardPlan, PlanTrace]:
    """:func:`backward_plan` with the rows it took (:class:`PlanTrace`)."""
    config = plan_key(config)
    key = _head_key(config)
    arch = plan_arch(config) if config.device_type != "cpu" and override is None else None
    trace = PlanTrace(arch, key)
    if override is not None:
        (dkdv, dq), rows = override, ["the tile override"] * 2
    elif arch is None:
        dkdv = dq = _INTERPRET
        rows = ["the interpreter's tiles"] * 2
    else:
        dkdv, dq = arch.tiles(config, key)[1:]
        if arch.serves_narrow_v(config):
            rows = [f"{arch.name}.narrow_v[dkdv]", f"{arch.name}.narrow_v[dq]"]
        else:
            rows = [row_name(arch.name, "dkdv", key), row_name(arch.name, "dq", key)]
        if arch.narrow_v_split_dq is not None and arch.splits_qk(config):
            dq, rows[1] = arch.narrow_v_split_dq, f"{arch.name}.narrow_v_split_dq"
    if config.dtype == "float32" and arch is not None:
        if key[0] == 256 and arch.fp32_large is not None:
            dkdv, dq = arch.fp32_large[1:]
            rows = [f"{arch.name}.fp32_large[dkdv]", f"{arch.name}.fp32_large[dq]"]
        else:
            dkdv, dq = _fp32_clamp(dkdv, 32, 64), _fp32_clamp(dq, 64, 32)
            rows = [rows[0] + ", clamped for fp32 (at most 32x64, one stage)",
                    rows[1] + ", clamped for fp32 (at most 64x32, one stage)"]
    dv = None
    two_pass = arch.dk_dv_tiles(config, key) if arch is not None else None
    if two_pass is not None:
        dkdv, dv = two_pass
        rows[0] = row_name(arch.name, "dk_dv", key) + " (dK pass)"
        trace.rows["dv"] = row_name(arch.name, "dk_dv", key) + " (dV pass)"
    trace.rows["dkdv"], trace.rows["dq"] = rows
    preprocess = Tiles(64 if config.device_type != "cpu" else 16, 0, 4, 1)
    trace.rows["preprocess"] = "fixed: not a table row"
    # Both modes run the separate dQ pass, faster than an atomic dQ inside the dK/dV pass.
    ws_fields = ("dq_warp_specialized", "dkdv_warp_specialized", "dv_warp_specialized")
    if override is not None:  # an explicit Triton tile override measures the Triton kernels
        ws_dq = ws_dkdv = ws_dv = None
        trace.gluon_off.update(dict.fromkeys(ws_fields, "a Triton tile override"))
    else:
        ws_dq = _warp_specialized(config, arch, key, "dq", trace, ws_fields[0])
        ws_dkdv = _warp_specialized(config, arch, key, "dkdv", trace, ws_fields[1])
        ws_dv = _warp_specialized(config, arch, key, "dv", trace, ws_fields[2])
    # The Gluon dK/dV rows make as many passes as the Triton plan: one (no dV row) or two.
    if (dv is None) != (ws_dv is None):
        for name, tiles in zip(ws_fields[1:], (ws_dkdv, ws_dv)):
            if tiles is not None:
                trace.rows.pop(name)
                trace.gluon_off[name] = ("the Gluon dK/dV rows would make a different number of passes than the "
                                         "Triton plan")
        ws_dkdv = ws_dv = None
    # The dBias kernel holds Q, K, V and dO tiles at once: fp32 at padded d > 128 halves its tile.
    dbias_block = 32 if config.dtype == "float32" and key[0] > 128 else 64
    block_dqk, block_dqk2 = _qk_blocks(config, arch)
    plan = BackwardPlan(preprocess, dkdv, dq, block_dqk, padded_head_dim(config.head_dim_v), ws_dq, ws_dkdv,
                        dbias_block, dv=dv, dv_warp_specialized=ws_dv, block_dqk2=block_dqk2)
    return plan, trace


def backward_plan(config: Config, override: Optional[Tuple[Tiles, Tiles]] = None) -> BackwardPlan:
    """The backward's tiles for ``config`` (an AttnConfig or its PlanKey); ``override``: these (dK/dV, dQ)
    Triton tiles instead."""
    return trace_backward(config, override)[0]

