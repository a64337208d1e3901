"""The benchmark grid as data: shapes, FLOP counts, named parts for a run in pieces.

Imports neither torch nor jax: the PyTorch harness, the JAX subprocess and the target
evaluation all read the same cases from here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

THD_SEED = 20261130  # fixed: the THD lengths are the same in every run and framework


def thd_lengths(n: int = 16, lo: int = 512, hi: int = 4096, seed: int = THD_SEED) -> Tuple[int, ...]:
    """``n`` mixed sequence lengths in ``[lo, hi]``: both extremes, the rest drawn with a fixed seed."""
    rng = random.Random(seed)
    rest = [rng.randint(lo, hi) for _ in range(n - 2)]
    return tuple([lo, hi] + rest)


def attn_flops(b, h, sq, sk, d, causal, mode, d_v=None):
    """FlashAttention counting: forward 2*b*h*sq*sk*(d + d_v) (QK^T and PV; 4*b*h*sq*sk*d when
    d_v = d), halved when causal, backward 2.5x forward, fwd+bwd 3.5x. ``d`` is the head dim of q
    and k, ``d_v`` of v (default ``d``). Query heads count (GQA shares K/V, not the work)."""
    d_v = d if d_v is None else d_v
    f = 2.0 * b * h * sq * sk * (d + d_v) * (0.5 if causal else 1.0)
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


@dataclass(frozen=True)
class Case:
    """One grid point. ``s`` is the (max) sequence length; for ``layout == "thd"`` the batch is
    ``len(seqlens)`` packed sequences and ``b`` is that count. ``d`` is the head dim of q and k,
    ``d_v`` that of v and the output (``None``: ``d``); shapes write a different one as ``d/d_v``."""

    name: str
    group: str  # one of GROUPS: the targets and the parts refer to groups
    b: int
    hq: int
    hkv: int
    s: int
    d: int
    causal: bool
    layout: str = "bshd"
    seqlens: Tuple[int, ...] = field(default=())
    d_v: Optional[int] = None

    def __post_init__(self):
        if self.d_v is None:
            object.__setattr__(self, "d_v", self.d)  # frozen; equal cases compare equal either way
        if self.d_v <= 0:
            raise ValueError(f"`d_v` must be a positive head dim, got {self.d_v}")

    @property
    def dims(self) -> str:
        return f"{self.d}" if self.d_v == self.d else f"{self.d}/{self.d_v}"

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "none"

    @property
    def shape(self) -> str:
        heads = f"{self.hq}" if self.hq == self.hkv else f"{self.hq}q/{self.hkv}kv"
        if self.layout == "thd":
            return f"thd {len(self.seqlens)} seqs {min(self.seqlens)}..{max(self.seqlens)},{heads},{self.dims}"
        return f"{self.b},{heads},{self.s},{self.dims}"

    @property
    def label(self) -> str:
        return f"{self.shape} {self.mask}"

    @property
    def tokens(self) -> int:
        return sum(self.seqlens) if self.layout == "thd" else self.b * self.s

    def flops(self, mode: str) -> float:
        """attn_flops summed over the sequences (each thd sequence attends within itself)."""
        lengths = self.seqlens if self.layout == "thd" else (self.s,) * self.b
        return sum(attn_flops(1, self.hq, n, n, self.d, self.causal, mode, self.d_v) for n in lengths)

    def to_dict(self) -> dict:
        return {"name": self.name, "group": self.group, "b": self.b, "hq": self.hq, "hkv": self.hkv, "s": self.s,
                "d": self.d, "d_v": self.d_v, "causal": self.causal, "layout": self.layout,
                "seqlens": list(self.seqlens)}

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        """Also reads rows written before ``d_v`` existed (then ``d_v = d``)."""
        return cls(d["name"], d["group"], d["b"], d["hq"], d["hkv"], d["s"], d["d"], d["causal"], d["layout"],
                   tuple(d.get("seqlens", ())), d.get("d_v"))


def _dense(group, b, h, s, d, causal, hkv=None, d_v=None) -> Case:
    hkv = h if hkv is None else hkv
    heads = f"{h}" if hkv == h else f"{h}q{hkv}kv"
    dims = f"{d}" if d_v in (None, d) else f"{d}v{d_v}"  # names without d_v stay as they were
    return Case(f"{b}x{heads}x{s}x{dims}-{'causal' if causal else 'none'}", group, b, h, hkv, s, d, causal,
                d_v=d_v)


def _thd(group, seqlens, h, d, causal=True) -> Case:
    return Case(f"thd{len(seqlens)}x{h}x{d}-{'causal' if causal else 'none'}", group, len(seqlens), h, h,
                max(seqlens), d, causal, "thd", tuple(seqlens))


# The standard grid, bf16: head dims 64, 128, 192 (v 128) and 256; case names are the keys that
# merge results across runs, so an existing case keeps its name.
GRID: List[Case] = [
    _dense("std", 4, 16, 4096, 128, False), _dense("std", 4, 16, 4096, 128, True),
    _dense("std", 1, 16, 16384, 128, False), _dense("std", 1, 16, 16384, 128, True),
    _dense("std", 8, 32, 2048, 64, False), _dense("std", 8, 32, 2048, 64, True),
    _dense("gqa", 2, 32, 8192, 128, True, hkv=8),
    _thd("thd", thd_lengths(), 16, 128),
    _dense("long", 1, 8, 65536, 128, True),
    _dense("long", 1, 8, 131072, 128, True),
    _dense("d256", 2, 16, 4096, 256, True),
    _dense("d192", 2, 16, 4096, 192, False, d_v=128), _dense("d192", 2, 16, 4096, 192, True, d_v=128),
]

# --dry-run: the same groups at sizes the Triton interpreter and a 2-core CPU get through in minutes.
DRY_GRID: List[Case] = [
    _dense("std", 1, 2, 64, 32, False), _dense("std", 1, 2, 64, 32, True),
    _dense("gqa", 1, 4, 64, 32, True, hkv=2),
    _thd("thd", (16, 64, 40), 2, 32),
    _dense("long", 1, 2, 96, 32, True),
    _dense("d256", 1, 2, 64, 64, True),
    _dense("d192", 1, 2, 64, 48, True, d_v=32),  # d_v < d_qk and a head dim that is not a power of two
]

GROUPS = ("std", "gqa", "thd", "long", "d256", "d192")

TORCH_IMPLS = ("te_fused_det", "te_fused", "te_dpa_det", "te_dpa", "fa4_det", "fa4", "cudnn_fe_det",
               "torch_flash_det", "torch_flash", "torch_cudnn")
JAX_IMPLS = ("jax_te_det", "jax_te", "jax_cudnn_det", "jax_cudnn", "jax_xla")
# The deterministic fused kernels from both frameworks in one process, timed by the profiler's device clock
# (kernel_time.py): how JAX's launch path compares with PyTorch's on the GPU, apart from host work.
KERNEL_TIME_IMPLS = ("te_fused_det_kt", "jax_te_det_kt")
OPTIONAL_IMPLS = ("cudnn_fe",)  # measured only when named in --impls
ALL_IMPLS = TORCH_IMPLS + JAX_IMPLS + KERNEL_TIME_IMPLS

# Named subsets so that the full grid can run in pieces of at most 10 minutes each.
PARTS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "torch-std": (("std",), TORCH_IMPLS),
    "torch-ext": (("gqa", "thd", "long", "d256", "d192"), TORCH_IMPLS),
    "jax": (GROUPS, JAX_IMPLS),
    "kernel-time": (GROUPS, KERNEL_TIME_IMPLS),
    "all": (GROUPS, ALL_IMPLS),
}


def select_cases(grid: Sequence[Case], names: Sequence[str]) -> List[Case]:
    """Cases named by case name or by group, in grid order; unknown names raise."""
    known = {c.name for c in grid} | set(GROUPS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown case or group {unknown}; cases: {[c.name for c in grid]}, groups: {list(GROUPS)}")
    return [c for c in grid if c.name in names or c.group in names]
