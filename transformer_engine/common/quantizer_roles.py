"""A recipe's quantizers, framework-free: recipe -> one quantizer spec per tensor role -> each frontend's quantizer.

TransformerEngine's shape: a recipe makes its recipe state, and the state hands each GEMM a quantizer per
tensor role (input, weight, grad_output). Here :func:`quantizers_for` turns a recipe into
:class:`RecipeQuantizers` once: per role the FP8 format, the scaling kind (delayed, current, block), the
tile a scale covers, the scale options, and per GEMM whether it accumulates without the fast FP8
accumulation. Every consumer (PyTorch's Linear, LayerNormLinear, LayerNormMLP through
``pytorch.quantization_linear``; JAX's ``dense`` and the Flax modules through ``jax.quantize``) reads
these specs; none of them looks at the recipe's type. Each frontend implements one quantizer per
:class:`Scaling` kind (``pytorch.quantization.Quantizer``, ``jax.quantize.QuantizerFactory``), one
operand type, one saturating cast, one block quantization and one GEMM dispatch.

Delayed scaling updates once per step in both frameworks: the quantization of a tensor folds its amax
into ``amax_history[0]`` (:func:`record_amax`, a max over the step's quantizations) and the update
(``common.quantization.delayed_update``) runs at the end of the step's direction: PyTorch at the
outermost autocast's exit (forward roles) and after the backward of the first FP8 module (grad_output),
after a MAX all-reduce over the amax group; JAX, being functional, takes the same update when the
state leaves the step (the quantizer's successor, returned as the gradient of the state variables
that the train step writes back), its amaxes already global (XLA reduces a sharded tensor's max). With
one quantization per role per step (JAX's only case: a state variable used twice in one step would
have its successors summed by autodiff) both give the same bits; the cross-framework test checks them.

Block scaling multiplies the exactly dequantized operands in one float32 GEMM in both frameworks
(FP8 value times a power-of-two scale is exact in float32); on CUDA devices where torch has a
block-scaled FP8 GEMM, PyTorch runs that instead (a tested tolerance, not bitwise).

Counts (issue 77), by ``grep -E "isinstance\\(.*(DelayedScaling|Float8CurrentScaling|Float8BlockScaling|
MXFP8BlockScaling|NVFP4BlockScaling|CustomRecipe)|\\.(delayed|float8_current_scaling|float8_block_scaling|mxfp8|
nvfp4|custom)\\(\\)"`` plus JAX's refusal table keyed on recipe names, outside ``common/recipe.py`` and this
module:

- before: 18 recipe-type branches in 5 files (pytorch/fp8.py 4, pytorch/quantization_linear.py 2,
  pytorch/attention/fp8_attention.py 2, jax/quantize.py 9, jax/flax/module.py 1; the issue's "about 24"
  also counted reads of recipe-specific fields by name and the split-accumulator defaults, written once
  per framework); a new recipe touched 7-8 files (recipe.py, pytorch/fp8.py, pytorch/quantization.py,
  pytorch/quantization_linear.py, jax/quantize.py, jax/dense.py, jax/flax/module.py, and FP8 attention);
- after: 0 outside ``common/recipe.py`` and this module: the linear modules and their plan, pytorch/fp8.py,
  Fp8Padding (:func:`row_alignment`), jax/quantize.py, jax/dense.py, the Flax modules, and FP8 attention
  (which reads its input role's scaling kind, ``fp8_attention.attention_scaling``). A new recipe is 2 files:
  its class in ``common/recipe.py`` and its builder here (:func:`register`); a new scaling kind adds its
  quantizer once per framework (``pytorch/quantization.py``, ``jax/quantize.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Dict, Optional, Tuple

from transformer_engine.common import quantization as _q
from transformer_engine.common import recipe as _recipe


class Role(enum.Enum):
    """The tensor a quantizer quantizes in a linear layer (TransformerEngine's names)."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


class Scaling(enum.Enum):
    """How a quantizer finds its scale: an amax history (delayed), the tensor itself (current), or per tile."""

    DELAYED = "delayed"
    CURRENT = "current"
    BLOCK = "block"


ROW_TILE = (1, _q.BLOCK_SIZE)
SQUARE_TILE = (_q.BLOCK_SIZE, _q.BLOCK_SIZE)
GEMMS = ("fprop", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True)
class QuantizerSpec:
    """What one role's quantizer does. ``tile``: None (one scale per tensor), ``(1, 128)`` (along the
    GEMM's contraction) or ``(128, 128)``. The delayed-scaling fields are those of its update."""

    role: Role
    fmt: str
    scaling: Scaling
    tile: Optional[Tuple[int, int]] = None
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    margin: float = 0.0
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    amax_history_len: int = 1
    reduce_amax: bool = True

    @property
    def fmt_max(self) -> float:
        return _q.fp8_max(self.fmt)

    @property
    def stateful(self) -> bool:
        return self.scaling is Scaling.DELAYED

    @property
    def second_layout(self) -> bool:
        """A 1x128-tiled operand is quantized again, tiled along its other axis, for the GEMM that
        contracts that axis (wgrad); one scale and square tiles serve both GEMMs."""
        return self.tile is not None and 1 in self.tile


@dataclasses.dataclass(frozen=True)
class RecipeQuantizers:
    """A recipe's quantizer specs per role, its GEMMs' accumulation, what its state and device need."""

    recipe: Any
    input: QuantizerSpec
    weight: QuantizerSpec
    grad_output: QuantizerSpec
    split_accumulator: Tuple[bool, bool, bool]  # fprop, dgrad, wgrad
    needs_block_gemm_device: bool = False  # block scaling: CPU or CUDA sm90+, as TransformerEngine

    @property
    def specs(self) -> Tuple[QuantizerSpec, QuantizerSpec, QuantizerSpec]:
        return self.input, self.weight, self.grad_output

    @property
    def stateful(self) -> bool:
        """Whether the recipe keeps state across steps (delayed scaling's amax histories and scales)."""
        return any(s.stateful for s in self.specs)

    @property
    def row_invariant(self) -> bool:
        """Whether a row's FP8 values depend on that row alone: the input and the output gradient scaled per
        1x128 tile of a row (Float8BlockScaling), no per-tensor amax over the batch (delayed and current
        scaling), so the batch-invariant mode can run the recipe. The weight is not batched."""
        return all(s.tile == ROW_TILE and s.scaling is Scaling.BLOCK for s in (self.input, self.grad_output))

    def spec(self, role: Role) -> QuantizerSpec:
        return {Role.INPUT: self.input, Role.WEIGHT: self.weight, Role.GRAD_OUTPUT: self.grad_output}[role]

    def use_split_accumulator(self, gemm: str) -> bool:
        if gemm not in GEMMS:
            raise ValueError(f"`gemm` must be one of {GEMMS}, got {gemm!r}")
        return self.split_accumulator[GEMMS.index(gemm)]


# --- refusals -----------------------------------------------------------------------------------

MXFP8_UNAVAILABLE_REASON = ("MXFP8 (MXFP8BlockScaling) needs Blackwell (sm100+) tensor cores and is not implemented "
                            "by the deterministic-attention package; use DelayedScaling, Float8CurrentScaling or "
                            "Float8BlockScaling")
NVFP4_UNAVAILABLE_REASON = ("NVFP4 (NVFP4BlockScaling) needs Blackwell (sm100+) tensor cores and is not implemented "
                            "by the deterministic-attention package; use DelayedScaling, Float8CurrentScaling or "
                            "Float8BlockScaling")
CUSTOM_RECIPE_REASON = ("CustomRecipe (user quantizer factories) is not implemented: quantizers here are the "
                        "recipes' own")

# Recipes declared for TransformerEngine's API that build no quantizers here, with why.
_REFUSED: Dict[type, str] = {
    _recipe.MXFP8BlockScaling: MXFP8_UNAVAILABLE_REASON,
    _recipe.NVFP4BlockScaling: NVFP4_UNAVAILABLE_REASON,
    _recipe.CustomRecipe: CUSTOM_RECIPE_REASON,
}


def refusal(recipe: Any) -> Optional[str]:
    """Why ``recipe`` builds no quantizers here ("<RecipeName>: <reason>"), or None when it does."""
    if not isinstance(recipe, _recipe.Recipe):
        return f"`recipe` must be a transformer_engine.common.recipe.Recipe, got {recipe!r}"
    for cls in type(recipe).__mro__:
        if cls in _REFUSED:
            return f"{type(recipe).__name__}: {_REFUSED[cls]}"
        if cls in _BUILDERS:
            return None
    return f"{type(recipe).__name__}: no quantizers are built for this recipe"


# --- recipe -> specs ----------------------------------------------------------------------------

_BUILDERS: Dict[type, Callable[[Any], RecipeQuantizers]] = {}


def register(recipe_cls: type) -> Callable:
    """Declare the spec builder of a recipe class (a new recipe: its class in recipe.py and one builder)."""

    def wrap(builder: Callable[[Any], RecipeQuantizers]) -> Callable[[Any], RecipeQuantizers]:
        _BUILDERS[recipe_cls] = builder
        return builder

    return wrap


def quantizers_for(recipe: Any) -> RecipeQuantizers:
    """The quantizer specs of ``recipe``; NotImplementedError naming the recipe when it has none here."""
    reason = refusal(recipe)
    if reason is not None:
        if not isinstance(recipe, _recipe.Recipe):
            raise ValueError(reason)
        raise NotImplementedError(reason)
    for cls in type(recipe).__mro__:
        if cls in _BUILDERS:
            return _BUILDERS[cls](recipe)
    raise NotImplementedError(f"{type(recipe).__name__}: no quantizers are built for this recipe")


def _split(recipe: Any, defaults: Tuple[bool, bool, bool]) -> Tuple[bool, bool, bool]:
    """The recipe's fp8_gemm_{fprop,dgrad,wgrad}.use_split_accumulator, TransformerEngine's defaults where
    the recipe declares none (DelayedScaling: fast accumulation in the forward GEMM only)."""
    return tuple(bool(getattr(getattr(recipe, f"fp8_gemm_{g}", None), "use_split_accumulator", d))
                 for g, d in zip(GEMMS, defaults))


def _qparams(recipe: Any, field: str) -> Dict[str, Any]:
    params = getattr(recipe, field)
    return dict(power_2_scale=bool(params.power_2_scale), amax_epsilon=float(params.amax_epsilon))


@register(_recipe.DelayedScaling)
def _delayed(recipe: _recipe.DelayedScaling) -> RecipeQuantizers:
    fwd, bwd = _q.format_dtypes(recipe.fp8_format)
    common = dict(scaling=Scaling.DELAYED, margin=recipe.margin, amax_compute_algo=recipe.amax_compute_algo,
                  scaling_factor_compute_algo=recipe.scaling_factor_compute_algo,
                  amax_history_len=recipe.amax_history_len, reduce_amax=bool(recipe.reduce_amax))
    return RecipeQuantizers(recipe, QuantizerSpec(Role.INPUT, fwd, **common),
                            QuantizerSpec(Role.WEIGHT, fwd, **common),
                            QuantizerSpec(Role.GRAD_OUTPUT, bwd, **common),
                            _split(recipe, (False, True, True)))


@register(_recipe.Float8CurrentScaling)
def _current(recipe: _recipe.Float8CurrentScaling) -> RecipeQuantizers:
    fwd, bwd = _q.format_dtypes(recipe.fp8_format)
    return RecipeQuantizers(
        recipe,
        QuantizerSpec(Role.INPUT, fwd, Scaling.CURRENT, **_qparams(recipe, "fp8_quant_fwd_inp")),
        QuantizerSpec(Role.WEIGHT, fwd, Scaling.CURRENT, **_qparams(recipe, "fp8_quant_fwd_weight")),
        QuantizerSpec(Role.GRAD_OUTPUT, bwd, Scaling.CURRENT, **_qparams(recipe, "fp8_quant_bwd_grad")),
        _split(recipe, (False, True, True)))


@register(_recipe.Float8BlockScaling)
def _block(recipe: _recipe.Float8BlockScaling) -> RecipeQuantizers:
    fwd, bwd = _q.format_dtypes(recipe.fp8_format)
    tiles = {1: ROW_TILE, 2: SQUARE_TILE}  # the recipe checked the dims (1x128 / 128x128 layouts built)
    return RecipeQuantizers(
        recipe,
        QuantizerSpec(Role.INPUT, fwd, Scaling.BLOCK, tiles[recipe.x_block_scaling_dim],
                      **_qparams(recipe, "fp8_quant_fwd_inp")),
        QuantizerSpec(Role.WEIGHT, fwd, Scaling.BLOCK, tiles[recipe.w_block_scaling_dim],
                      **_qparams(recipe, "fp8_quant_fwd_weight")),
        QuantizerSpec(Role.GRAD_OUTPUT, bwd, Scaling.BLOCK, tiles[recipe.grad_block_scaling_dim],
                      **_qparams(recipe, "fp8_quant_bwd_grad")),
        _split(recipe, (True, True, True)), needs_block_gemm_device=True)


# Row alignment of grouped FP8 GEMM inputs (TransformerEngine's values; Fp8Padding reads it), for the
# declared recipes too: padding is layout, not quantization. None: the recipe's ``quantization_alignment``.
_ROW_ALIGNMENT: Dict[type, Optional[int]] = {_recipe.MXFP8BlockScaling: 32, _recipe.NVFP4BlockScaling: 128,
                                             _recipe.CustomRecipe: None}


def row_alignment(recipe: Any) -> int:
    """The row alignment grouped FP8 GEMMs need under ``recipe``: 32 (MXFP8), 128 (NVFP4), a CustomRecipe's
    ``quantization_alignment``, 16 for the others."""
    for cls in type(recipe).__mro__:
        if cls in _ROW_ALIGNMENT:
            align = _ROW_ALIGNMENT[cls]
            if align is None:
                align = getattr(recipe, "quantization_alignment", None)
                if not isinstance(align, int) or isinstance(align, bool) or align < 1:
                    raise ValueError(f"a {type(recipe).__name__}'s `quantization_alignment` must be a positive int "
                                     f"for Fp8Padding, got {align!r}")
            return align
    return 16


def record_amax(xp: Any, row: Any, amax: Any) -> Any:
    """Delayed scaling's record: this step's amax row folded with a quantized tensor's amax (max)."""
    return xp.maximum(row, amax)


__all__ = ["Role", "Scaling", "ROW_TILE", "SQUARE_TILE", "GEMMS", "QuantizerSpec", "RecipeQuantizers",
           "MXFP8_UNAVAILABLE_REASON", "NVFP4_UNAVAILABLE_REASON", "CUSTOM_RECIPE_REASON", "refusal", "register",
           "quantizers_for", "row_alignment", "record_amax"]
