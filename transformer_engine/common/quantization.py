"""FP8 scaling math shared by the PyTorch and JAX frontends: formats, scales, amax histories.

Pure functions over an array namespace ``xp`` (``torch``, ``jax.numpy`` or ``numpy``): each frontend
passes its own module and arrays, so both compute the same formulas in the same order and the tests
check them once against an fp64 recomputation. Only names that the three namespaces share with the
same positional signature are used (``where``, ``isfinite``, ``isinf``, ``amax``, ``roll``,
``concatenate``, ``zeros_like``, ``frexp``, ``ldexp``, ``ones_like``).

The formulas are TransformerEngine's:

- delayed scaling: ``amax_history[0]`` holds the amax recorded by this step's quantization; the update
  takes the amax to scale by (the history's max, or its newest entry), rolls the history by one
  (the oldest entry leaves, row 0 is cleared for the next step) and sets
  ``scale = fp8_max / 2**margin / amax`` where amax is finite and positive (the old scale otherwise),
  with an overflowing scale clipped to the largest float32;
- current scaling: ``scale = fp8_max / max(amax, epsilon)``, 1 where that amax is 0 or infinite,
  the largest float32 where it overflows, optionally rounded down to a power of two;
- block scaling: current scaling per block (1x128 tiles of activations and gradients, 128x128 tiles
  of weights), power-of-two scales by default.

Quantizing multiplies by ``scale`` and casts with saturation to +-fp8_max; ``scale_inv = 1 / scale``
dequantizes. All max-reductions are order-free, so every quantity here is deterministic.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple, Union

# Largest finite value of each FP8 format (E4M3 as the "fn" variant: no infinities).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
# What an infinite scale becomes (the largest finite float32).
FLOAT32_MAX = 3.4028234663852886e38
# Tile edge of block scaling (TransformerEngine's Float8BlockScaling).
BLOCK_SIZE = 128


def format_dtypes(fp8_format: Any) -> Tuple[str, str]:
    """(forward, backward) FP8 format names of a recipe's ``fp8_format``: E4M3 / E5M2 / HYBRID."""
    # A recipe.Format member (by its name) or the name itself.
    name = fp8_format.name if hasattr(fp8_format, "name") else fp8_format
    if name == "E4M3":
        return "e4m3", "e4m3"
    if name == "E5M2":
        return "e5m2", "e5m2"
    if name == "HYBRID":
        return "e4m3", "e5m2"
    raise ValueError(f"`fp8_format` must be Format.E4M3, Format.E5M2 or Format.HYBRID, got {fp8_format!r}")


def fp8_max(fmt: str) -> float:
    if fmt not in FP8_MAX:
        raise ValueError(f"`fmt` must be one of {sorted(FP8_MAX)}, got {fmt!r}")
    return FP8_MAX[fmt]


def delayed_amax(xp: Any, amax_history: Any, amax_compute_algo: Union[str, Callable]) -> Any:
    """The amax a delayed-scaling update scales by: per column of the [history_len, n] history."""
    if callable(amax_compute_algo):
        return amax_compute_algo(amax_history)
    if amax_compute_algo == "max":
        return xp.amax(amax_history, 0)
    if amax_compute_algo == "most_recent":
        return amax_history[0]
    raise ValueError(f"`amax_compute_algo` must be 'max', 'most_recent' or a callable, got {amax_compute_algo!r}")


def roll_amax_history(xp: Any, amax_history: Any) -> Any:
    """The history after an update: every entry one step older, the oldest gone, row 0 cleared."""
    rolled = xp.roll(amax_history, -1, 0)
    return xp.concatenate([xp.zeros_like(rolled[:1]), rolled[1:]], 0)


def _divide(xp: Any, numerator: float, denominator: Any) -> Any:
    """``numerator / denominator`` as one correctly rounded division in the array's dtype. (A Python
    number divided by a torch tensor is computed as a reciprocal times the number: two roundings.)"""
    return (xp.ones_like(denominator) * numerator) / denominator


def scale_from_delayed_amax(xp: Any, amax: Any, scale: Any, fmt_max: float, margin: float) -> Any:
    """``fmt_max / 2**margin / amax`` where amax is finite and positive, else the old ``scale``."""
    scaled_max = fmt_max * 2.0 ** (-float(margin))
    usable = xp.isfinite(amax) & (amax > 0)
    new = xp.where(usable, _divide(xp, scaled_max, xp.where(usable, amax, xp.ones_like(amax))), scale)
    return xp.where(xp.isinf(new), FLOAT32_MAX, new)


def delayed_update(xp: Any, amax_history: Any, scale: Any, fmt_max: float, margin: float,
                   amax_compute_algo: Union[str, Callable] = "max",
                   scaling_factor_compute_algo: Callable = None, recipe: Any = None) -> Tuple[Any, Any]:
    """One delayed-scaling update: (rolled history, new scale) of [history_len, n] and [n] arrays.

    ``scaling_factor_compute_algo(amax, scale, fp8_max, recipe)``, when given, replaces the default
    scale formula, as in TransformerEngine.
    """
    amax = delayed_amax(xp, amax_history, amax_compute_algo)
    if scaling_factor_compute_algo is not None:
        new_scale = scaling_factor_compute_algo(amax, scale, fmt_max, recipe)
    else:
        new_scale = scale_from_delayed_amax(xp, amax, scale, fmt_max, margin)
    return roll_amax_history(xp, amax_history), new_scale


def power_of_two_floor(xp: Any, scale: Any) -> Any:
    """The largest power of two not above ``scale`` (exact: read off the float's exponent)."""
    _, exponent = xp.frexp(scale)
    return xp.ldexp(xp.ones_like(scale), exponent - 1)


def scale_from_current_amax(xp: Any, amax: Any, fmt_max: float, epsilon: float = 0.0,
                            power_2_scale: bool = False) -> Any:
    """Current scaling of a tensor (or of each block) from its own amax."""
    clamped = xp.where(amax < epsilon, epsilon, amax) if epsilon > 0 else amax
    degenerate = (clamped == 0) | xp.isinf(clamped)
    scale = _divide(xp, fmt_max, xp.where(degenerate, xp.ones_like(clamped), clamped))
    scale = xp.where(xp.isinf(scale), FLOAT32_MAX, scale)
    if power_2_scale:
        scale = power_of_two_floor(xp, scale)
    return xp.where(degenerate, xp.ones_like(scale), scale)


__all__ = ["FP8_MAX", "FLOAT32_MAX", "BLOCK_SIZE", "format_dtypes", "fp8_max", "delayed_amax",
           "roll_amax_history", "scale_from_delayed_amax", "delayed_update", "power_of_two_floor",
           "scale_from_current_amax"]
