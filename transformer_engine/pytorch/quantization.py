"""FP8 quantization and GEMMs for the PyTorch modules: quantized operands, scaled GEMMs, delayed-scaling state.

A quantized operand (:class:`Quantized`) is a value: FP8 data, the inverse scale(s) that dequantize it
and the tile its scales cover (the whole tensor, 1x128 or 128x128). Scales come from
``transformer_engine.common.quantization`` (the formulas shared with JAX); this module applies them with
torch ops. Quantizing multiplies by the scale in float32 and casts with saturation to the format's
largest finite value (as TransformerEngine's casts do); NaN stays NaN.

Determinism: amaxes are max-reductions (order-free), the casts are elementwise, the amax all-reduce is
a MAX, and the GEMMs are torch's (fixed per shape and device), so every quantity is bitwise
reproducible run to run.

One quantizer path: :class:`Quantizer` is a role's quantizer built from its
``common.quantizer_roles.QuantizerSpec`` (the recipe's specs, made once by ``quantizers_for``); it
dispatches on the spec's scaling kind, never on the recipe's type. :func:`scaled_gemm` is the one GEMM
dispatch of quantized operands.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import torch

from transformer_engine.common import quantization as q
from transformer_engine.common import quantizer_roles as roles
from transformer_engine.common import recipe as _recipe
from transformer_engine.pytorch.batch_invariance import bi_matmul, is_batch_invariant

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# --- delayed scaling state ----------------------------------------------------------------------

class DelayedScalingMeta:
    """One direction's delayed-scaling state of a module: ``scale`` [n] and ``amax_history`` [len, n].

    Row 0 of the history accumulates (max) the amaxes recorded since the last update; the update
    (``reduce_and_update_delayed_metas``) computes the new scale from the history and rolls it, as
    TransformerEngine's ``FP8TensorMeta`` is updated. ``fmt`` is the FP8 format of the direction.
    """

    def __init__(self, num_tensors: int, recipe: _recipe.DelayedScaling, forward: bool, device: torch.device) -> None:
        self.forward = forward
        self.recipe = recipe
        self.group: Optional[Any] = None
        fwd_fmt, bwd_fmt = q.format_dtypes(recipe.fp8_format)
        self.fmt = fwd_fmt if forward else bwd_fmt
        self.scale = torch.ones(num_tensors, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_tensors, dtype=torch.float32, device=device)

    def set_recipe(self, recipe: _recipe.DelayedScaling) -> None:
        """Follow a new autocast's recipe; a changed history length keeps the newest entries (as TransformerEngine)."""
        fwd_fmt, bwd_fmt = q.format_dtypes(recipe.fp8_format)
        fmt = fwd_fmt if self.forward else bwd_fmt
        if fmt != self.fmt:
            raise ValueError(f"`fp8_format` must stay the same across steps for a module's delayed-scaling state, "
                             f"got {recipe.fp8_format} after a {self.fmt} state")
        length = recipe.amax_history_len
        if length != self.amax_history.shape[0]:
            old = self.amax_history
            new = torch.zeros(length, old.shape[1], dtype=old.dtype, device=old.device)
            keep = min(length, old.shape[0])
            new[:keep] = old[:keep]
            self.amax_history = new
        self.recipe = recipe

    def record_amax(self, index: int, amax: torch.Tensor) -> None:
        """Fold a quantized tensor's amax into this step's row (max over the calls since the last update)."""
        row = self.amax_history[0]
        row[index] = roles.record_amax(torch, row[index], amax.to(torch.float32))


def reduce_and_update_delayed_metas(metas: Sequence[DelayedScalingMeta]) -> None:
    """All-reduce (MAX) this step's amaxes over each meta's group, then update every scale and history.

    Metas sharing a group are reduced in one all-reduce of their concatenated rows, in registration
    order. A MAX is exact and order-free, so the reduction is deterministic.
    """
    by_group: dict = {}
    for meta in metas:
        by_group.setdefault((id(meta.group), bool(meta.recipe.reduce_amax)), []).append(meta)
    for (_, reduce_amax), group_metas in by_group.items():
        group = group_metas[0].group
        reduce = (reduce_amax and torch.distributed.is_available()
                  and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1)
        if reduce:
            rows = torch.cat([m.amax_history[0] for m in group_metas])
            torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.MAX, group=group)
            offset = 0
            for m in group_metas:
                n = m.amax_history.shape[1]
                m.amax_history[0].copy_(rows[offset:offset + n])
                offset += n
        for m in group_metas:
            update_delayed_meta(m)


def update_delayed_meta(meta: DelayedScalingMeta) -> None:
    """One delayed-scaling update of ``meta`` in place (TransformerEngine's formula, in float32)."""
    recipe = meta.recipe
    history, scale = q.delayed_update(torch, meta.amax_history, meta.scale, q.fp8_max(meta.fmt), recipe.margin,
                                      recipe.amax_compute_algo, recipe.scaling_factor_compute_algo, recipe)
    meta.amax_history.copy_(history)
    meta.scale.copy_(scale)


# --- quantized operands -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Quantized:
    """A 2-D operand in FP8: ``data`` [rows, cols], ``scale_inv`` that dequantizes it, the tile its scales cover.

    ``tile=None``: one scale for the tensor (``scale_inv`` is a 0-d float32 tensor). ``tile=(1, 128)`` or
    ``(128, 128)``: one scale per tile (``scale_inv`` is [ceil(rows/th), ceil(cols/tw)]), edge tiles partial.
    GEMMs contract over ``cols``: a 1x128 tile lies along the contraction.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: str
    tile: Optional[Tuple[int, int]] = None

    def t(self) -> "Quantized":
        """The transpose. Exact for one scale and for square tiles (the same values and scales, transposed)."""
        if self.tile not in (None, (q.BLOCK_SIZE, q.BLOCK_SIZE)):
            raise ValueError(f"`tile` must be None or square to transpose a quantized operand, got {self.tile}")
        scale_inv = self.scale_inv if self.tile is None else self.scale_inv.t().contiguous()
        return Quantized(self.data.t().contiguous(), scale_inv, self.fmt, self.tile)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale_inv per tile, in ``dtype`` (exact in float64; in float32 for power-of-two scales)."""
        values = self.data.to(dtype)
        if self.tile is None:
            return values * self.scale_inv.to(dtype)
        th, tw = self.tile
        rows, cols = values.shape
        scale = self.scale_inv.to(dtype).repeat_interleave(th, 0)[:rows].repeat_interleave(tw, 1)[:, :cols]
        return values * scale


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| in float32 (0 for an empty tensor); NaN if x holds one."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().to(torch.float32)


def cast_to_fp8(x32: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating cast of already-scaled float32 values (torch's cast alone turns overflow into NaN)."""
    limit = q.fp8_max(fmt)
    return x32.clamp(-limit, limit).to(FP8_DTYPES[fmt])


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> Quantized:
    """One scale for the tensor (delayed scaling's, or a current scale computed before)."""
    scale = scale.to(torch.float32)
    data = cast_to_fp8(x.to(torch.float32) * scale, fmt)
    return Quantized(data, torch.reciprocal(scale), fmt, None)


def quantize_current(x: torch.Tensor, fmt: str, qparams: Any) -> Tuple[Quantized, torch.Tensor]:
    """Current scaling: the scale from this tensor's amax. Returns (operand, amax)."""
    amax = amax_of(x)
    scale = q.scale_from_current_amax(torch, amax, q.fp8_max(fmt), float(qparams.amax_epsilon),
                                      bool(qparams.power_2_scale))
    return quantize_with_scale(x, scale, fmt), amax


def quantize_blocks(x: torch.Tensor, tile: Tuple[int, int], fmt: str, qparams: Any) -> Quantized:
    """Block scaling of a 2-D tensor: current scaling per ``tile`` (edge tiles partial)."""
    rows, cols = x.shape
    th, tw = tile
    x32 = x.to(torch.float32)
    pad_r, pad_c = -rows % th, -cols % tw
    if pad_r or pad_c:
        # Zeros change no tile's amax.
        x32 = torch.nn.functional.pad(x32, (0, pad_c, 0, pad_r))
    blocks = x32.reshape((rows + pad_r) // th, th, (cols + pad_c) // tw, tw)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = q.scale_from_current_amax(torch, amax, q.fp8_max(fmt), float(qparams.amax_epsilon),
                                      bool(qparams.power_2_scale))
    data = cast_to_fp8(blocks * scale[:, None, :, None], fmt).reshape(rows + pad_r, cols + pad_c)
    return Quantized(data[:rows, :cols].contiguous(), torch.reciprocal(scale), fmt, tile)


# --- quantizers -----------------------------------------------------------------------------------

class Quantizer:
    """One role's quantizer (input, weight or grad_output) under a recipe: its spec and, for delayed
    scaling, the meta (and column) whose scale it applies and into whose history row 0 it records.

    :meth:`quantize` returns the operand tiled along the GEMM's contraction (the 2-D tensor's columns) and,
    when the spec's tiles are not square, the tensor quantized again tiled along its rows for the GEMM that
    contracts them (wgrad); None where the transpose of the first serves (one scale, 128x128 tiles).
    """

    def __init__(self, spec: roles.QuantizerSpec, meta: Optional[Any] = None, index: int = 0) -> None:
        if spec.stateful and meta is None:
            raise ValueError(f"a {spec.scaling.value}-scaling quantizer needs its state (`meta`), got None")
        self.spec, self.meta, self.index = spec, meta, index

    @property
    def fmt(self) -> str:
        return self.spec.fmt

    def quantize(self, x: torch.Tensor) -> Tuple[Quantized, Optional[Quantized]]:
        return _QUANTIZE[self.spec.scaling](self, x)

    def record(self, x: torch.Tensor) -> None:
        """Calibration (a high-precision run): record the amax a stateful quantizer would record."""
        if self.spec.stateful:
            with torch.no_grad():
                self.meta.record_amax(self.index, amax_of(x))

    def _delayed(self, x: torch.Tensor) -> Tuple[Quantized, None]:
        self.meta.record_amax(self.index, amax_of(x))
        return quantize_with_scale(x, self.meta.scale[self.index], self.fmt), None

    def _current(self, x: torch.Tensor) -> Tuple[Quantized, None]:
        return quantize_current(x, self.fmt, self.spec)[0], None

    def _block(self, x: torch.Tensor) -> Tuple[Quantized, Optional[Quantized]]:
        tile = self.spec.tile
        second = quantize_blocks(x.t(), tile, self.fmt, self.spec) if self.spec.second_layout else None
        return quantize_blocks(x, tile, self.fmt, self.spec), second


_QUANTIZE = {roles.Scaling.DELAYED: Quantizer._delayed, roles.Scaling.CURRENT: Quantizer._current,
             roles.Scaling.BLOCK: Quantizer._block}


# --- GEMMs ----------------------------------------------------------------------------------------

def _pad_to(data: torch.Tensor, rows: int, cols: int, fill: float = 0.0) -> torch.Tensor:
    """``data`` in the top-left corner of a [rows, cols] tensor of ``fill``: zeros pad an operand (they change no
    product), ones pad its block scales (they multiply zeros)."""
    if data.shape == (rows, cols):
        return data
    out = torch.full((rows, cols), fill, dtype=data.dtype, device=data.device)
    out[:data.shape[0], :data.shape[1]] = data
    return out


def _torch_block_scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` through torch's block-scaled FP8 GEMM (cuBLASLt's 1x128 / 128x128 kernels on Hopper).

    Its layout rules (torch's checks): a [M, K] row-major with scales [M, K/128] M-major; b as a
    column-major [K, N] with 1x128 scales [N, K/128] N-major, or 128x128 scales [round_up(K/128, 4),
    N/128] K-major. Operands are zero-padded to M, N multiples of 128 and K of 512 (so K/128 is a
    multiple of 4), which changes no product.
    """
    functional = torch.nn.functional
    block = q.BLOCK_SIZE
    m, k = a.data.shape
    n = b.data.shape[0]
    mp, np_, kp = m + (-m % block), n + (-n % block), k + (-k % (4 * block))
    a_data, b_data = _pad_to(a.data, mp, kp), _pad_to(b.data, np_, kp)
    a_scale = _pad_to(a.scale_inv, mp, kp // block, fill=1.0).t().contiguous().t()
    if b.tile == roles.SQUARE_TILE:
        b_scale = _pad_to(b.scale_inv, np_ // block, kp // block, fill=1.0).contiguous().t()
        b_recipe = functional.ScalingType.BlockWise128x128
    else:
        b_scale = _pad_to(b.scale_inv, np_, kp // block, fill=1.0).t().contiguous().t()
        b_recipe = functional.ScalingType.BlockWise1x128
    out = functional.scaled_mm(a_data, b_data.t(), a_scale, functional.ScalingType.BlockWise1x128, b_scale, b_recipe,
                               output_dtype=out_dtype)
    # Not a view: callers add to a custom Function's output in place.
    return out if (mp, np_) == (m, n) else out[:m, :n].clone()


# (device, tile of b) -> whether torch's block-scaled GEMM runs there (probed once).
_BLOCK_GEMM_AVAILABLE: dict = {}


def block_scaled_gemm_available(device: torch.device, b_tile: Tuple[int, int] = roles.SQUARE_TILE) -> bool:
    """Whether torch's block-scaled FP8 GEMM runs on ``device`` for a 1x128-tiled left operand and a right
    operand tiled ``b_tile``: a CUDA device, a torch with ``torch.nn.functional.scaled_mm`` and its
    ``ScalingType.BlockWise*`` scales, and a probe GEMM that runs (torch refuses the layouts on CPU and on
    GPUs without the cuBLASLt kernels)."""
    device = torch.device(device)
    functional = torch.nn.functional
    if device.type != "cuda" or not hasattr(functional, "scaled_mm") or not hasattr(functional, "ScalingType"):
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, tuple(b_tile))
    if key not in _BLOCK_GEMM_AVAILABLE:
        block = q.BLOCK_SIZE
        zeros = torch.zeros(block, 4 * block, dtype=torch.float8_e4m3fn, device=device)
        a = Quantized(zeros, torch.ones(block, 4, device=device), "e4m3", roles.ROW_TILE)
        b_scale = torch.ones(*((1, 4) if tuple(b_tile) == roles.SQUARE_TILE else (block, 4)), device=device)
        b = Quantized(zeros, b_scale, "e4m3", tuple(b_tile))
        try:
            _torch_block_scaled_mm(a, b, torch.float32)
            _BLOCK_GEMM_AVAILABLE[key] = True
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            _BLOCK_GEMM_AVAILABLE[key] = False
    return _BLOCK_GEMM_AVAILABLE[key]


def scaled_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype, use_split_accumulator: bool = True,
                dequantized: bool = False) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` for a [M, K] and b [N, K], both quantized along K: [M, N] in ``out_dtype``.

    - One scale per operand: ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM on CUDA; it needs M, N, K multiples
      of 16 there, so operands are zero-padded, which changes no product).
    - Tiles (Float8BlockScaling): on CUDA devices where torch has the block-scaled FP8 GEMM
      (:func:`block_scaled_gemm_available`), that GEMM (split accumulation, as the recipe requires).
      Elsewhere (CPU: torch 2.13 and 2.15 raise "Invalid scaling configuration" for ``BlockWise1x128``
      there), or with ``dequantized=True``, the product of the exactly dequantized operands (FP8 value
      times a power-of-two scale, exact in float32) in one float32 GEMM: the same quantized math,
      accumulated in float32, at float32 GEMM speed. JAX's ``dense`` computes block scaling this way.
      In batch-invariant mode that float32 GEMM runs on the batch-invariant kernel.
    """
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"operands must share the contraction dim, got {tuple(a.data.shape)} and {tuple(b.data.shape)}")
    if a.tile is None and b.tile is None:
        m, k = a.data.shape
        n = b.data.shape[0]
        if a.data.device.type == "cuda" and (m % 16 or n % 16 or k % 16):
            mp, np_, kp = m + (-m % 16), n + (-n % 16), k + (-k % 16)
            out = torch._scaled_mm(_pad_to(a.data, mp, kp), _pad_to(b.data, np_, kp).t(), scale_a=a.scale_inv,
                                   scale_b=b.scale_inv, out_dtype=out_dtype, use_fast_accum=not use_split_accumulator)
            return out if (mp, np_) == (m, n) else out[:m, :n].clone()  # not a view (see above)
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype,
                                use_fast_accum=not use_split_accumulator)
    if (a.tile is None) != (b.tile is None):
        raise ValueError(f"a tensor-scaled operand cannot meet a block-scaled one, got tiles {a.tile} and {b.tile}")
    if is_batch_invariant():  # a row's product on the batch-invariant kernel, whatever the row count
        return bi_matmul(a.dequantize(torch.float32), b.dequantize(torch.float32).t(), out_dtype)
    if (not dequantized and a.tile == roles.ROW_TILE and b.tile in (roles.ROW_TILE, roles.SQUARE_TILE)
            and out_dtype in (torch.float32, torch.bfloat16, torch.float16)
            and block_scaled_gemm_available(a.data.device, b.tile)):
        return _torch_block_scaled_mm(a, b, out_dtype)
    out = torch.mm(a.dequantize(torch.float32), b.dequantize(torch.float32).t())
    return out if out_dtype == torch.float32 else out.to(out_dtype)


__all__ = ["FP8_DTYPES", "DelayedScalingMeta", "reduce_and_update_delayed_metas", "update_delayed_meta",
           "Quantized", "Quantizer", "amax_of", "cast_to_fp8", "quantize_with_scale", "quantize_current",
           "quantize_blocks", "block_scaled_gemm_available", "scaled_gemm"]
