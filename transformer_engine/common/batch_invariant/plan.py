"""Tiles of the batch-invariant kernels: pure functions of (N, K, dtype, device), never of the row count M.

A row's bits depend on the instruction shape of its products and the order of its sums; both follow from the
tiles chosen here. M only sets the grid, so a row computed alone, in a batch of 7 or in a batch of 1024 gets
the same bits. Under Triton's interpreter (CPU) the tiles are small to keep the interpreter quick; its dot is
a fixed-order sum (kernels/triton_compat.interpret_dot_in_fixed_order), so the same argument holds there.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class NormTiles:
    BLOCK_R: int  # rows per program, each reduced alone
    BLOCK_H: int  # chunk of the hidden dim one loop step reads
    num_warps: int


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def gemm_tiles(n: int, k: int, dtype: str, device_type: str) -> GemmTiles:
    """Tiles for ``C[M, N] = A[M, K] @ B[K, N]``: chosen by (N, K, dtype, device) alone."""
    if n < 1 or k < 1:
        raise ValueError(f"`n` and `k` must be positive, got n={n}, k={k}")
    if device_type != "cuda":  # Triton's interpreter
        return GemmTiles(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1, num_stages=1)
    if dtype == "float32":
        return GemmTiles(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
    block_n = 128 if n >= 128 else 64
    return GemmTiles(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64, num_warps=8 if block_n == 128 else 4, num_stages=3)


def norm_tiles(hidden: int, device_type: str) -> NormTiles:
    """Tiles of the row-norm kernels: BLOCK_R rows per program, each row's sums over the hidden dim in fixed
    chunks of BLOCK_H (a row's reduction never mixes with another row's)."""
    if hidden < 1:
        raise ValueError(f"`hidden` must be positive, got {hidden}")
    if device_type != "cuda":
        return NormTiles(BLOCK_R=32, BLOCK_H=min(_pow2_at_least(hidden), 64), num_warps=1)
    block = min(_pow2_at_least(hidden), 4096)
    return NormTiles(BLOCK_R=max(1, 4096 // block) if block < 4096 else 1, BLOCK_H=block,
                     num_warps=8 if block >= 2048 else 4)


def col_sum_tiles(hidden: int, device_type: str) -> NormTiles:
    """Tiles of the column-sum kernel (a norm's weight and bias gradients, a bias gradient): BLOCK_H columns per
    program, BLOCK_R rows per step (the row order of the sums follows from BLOCK_R and the row count only)."""
    if hidden < 1:
        raise ValueError(f"`hidden` must be positive, got {hidden}")
    if device_type != "cuda":
        return NormTiles(BLOCK_R=16, BLOCK_H=min(_pow2_at_least(hidden), 64), num_warps=1)
    # Narrow column blocks: one program per 32 columns keeps a GPU's SMs busy at hidden sizes of a few thousand.
    return NormTiles(BLOCK_R=64, BLOCK_H=min(_pow2_at_least(hidden), 32), num_warps=4)


@dataclasses.dataclass(frozen=True)
class ActivationArgs:
    """The activation kernels' arguments for one of ``LayerNormMLP``'s activations (common/modules.py's table):
    the gate function ``FN``, whether FC1 is gated (``[R, 2F]`` in, the activated half first) and clamped."""

    FN: str
    GATED: bool
    CLAMPED: bool
    alpha: float
    limit: float
    offset: float


_GATES = {"gelu": "gelu", "geglu": "gelu", "qgelu": "qgelu", "qgeglu": "qgelu", "silu": "qgelu", "swiglu": "qgelu",
          "relu": "relu", "reglu": "relu", "srelu": "srelu", "sreglu": "srelu", "glu": "sigmoid",
          "clamped_swiglu": "qgelu"}


def activation_args(name: str, params=None) -> ActivationArgs:
    """The kernel arguments of activation ``name`` (checked by common.modules.activation)."""
    from transformer_engine.common import modules

    act = modules.activation(name, params)
    params = dict(params or {})
    alpha = {"qgelu": 1.702, "qgeglu": 1.702, "clamped_swiglu": float(params.get("alpha", 1.702))}.get(name, 1.0)
    clamped = name == "clamped_swiglu"
    return ActivationArgs(FN=_GATES[name], GATED=act.gated, CLAMPED=clamped, alpha=alpha,
                          limit=float(params["limit"]) if clamped else 0.0,
                          offset=float(params.get("glu_linear_offset", 1.0)) if clamped else 0.0)


def activation_tiles(width: int, device_type: str) -> NormTiles:
    """Tiles of the elementwise activation kernels: BLOCK_R rows by BLOCK_H columns per program."""
    if width < 1:
        raise ValueError(f"`width` must be positive, got {width}")
    if device_type != "cuda":
        return NormTiles(BLOCK_R=16, BLOCK_H=min(_pow2_at_least(width), 64), num_warps=1)
    return NormTiles(BLOCK_R=16, BLOCK_H=min(_pow2_at_least(width), 256), num_warps=4)
