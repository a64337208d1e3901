"""The math of TransformerEngine's composite modules, shared by the PyTorch and JAX frontends.

Pure functions over an array namespace ``xp`` (``torch``, ``jax.numpy`` or ``numpy``), as in
``common/quantization.py``: each frontend passes its own module and arrays, so the activations of
``LayerNormMLP`` and the order of norms and residuals in ``TransformerLayer`` are written once. Only names
the three namespaces share with the same positional signature are used (``tanh``, ``exp``, ``where``,
``clip``, ``minimum``).

Activations are TransformerEngine's (its CUDA formulas, computed by the caller in float32):

- ``gelu``: the tanh approximation, ``x * (0.5 + 0.5 * tanh(x * (0.79788456 + 0.03567741 * x^2)))``;
- ``qgelu`` ("quick GELU"): ``x * sigmoid(1.702 x)``;  ``silu``: ``x * sigmoid(x)``;
- ``relu``: ``max(x, 0)``;  ``srelu`` (squared ReLU): ``max(x, 0)^2``;
- gated forms (``geglu``, ``qgeglu``, ``reglu``, ``sreglu``, ``swiglu``, ``glu``): FC1 produces twice the
  width; the first half goes through the activation (``sigmoid`` for ``glu``) and multiplies the second half;
- ``clamped_swiglu`` (``activation_params``: ``limit``, ``alpha`` default 1.702, ``glu_linear_offset`` default
  1): ``min(a, limit) * sigmoid(alpha * min(a, limit)) * (clip(b, -limit, limit) + glu_linear_offset)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple


def _sigmoid(xp: Any, x: Any) -> Any:
    return 1.0 / (1.0 + xp.exp(-x))


def _gelu(xp: Any, x: Any) -> Any:
    return x * (0.5 + 0.5 * xp.tanh(x * (0.79788456 + 0.03567741 * x * x)))


def _qgelu(xp: Any, x: Any, alpha: float = 1.702) -> Any:
    return x * _sigmoid(xp, alpha * x)


def _silu(xp: Any, x: Any) -> Any:
    return x * _sigmoid(xp, x)


def _relu(xp: Any, x: Any) -> Any:
    return xp.where(x > 0, x, 0.0 * x)


def _srelu(xp: Any, x: Any) -> Any:
    r = _relu(xp, x)
    return r * r


@dataclasses.dataclass(frozen=True)
class Activation:
    """One activation of ``LayerNormMLP``: its name, whether FC1 is gated (twice the width), and its
    elementwise function ``fn(xp, x)`` (the gate's function for a gated activation)."""

    name: str
    gated: bool
    fn: Callable[[Any, Any], Any]
    params: Tuple[str, ...] = ()  # names accepted in ``activation_params``


ACTIVATIONS: Dict[str, Activation] = {a.name: a for a in (
    Activation("gelu", False, _gelu),
    Activation("qgelu", False, _qgelu),
    Activation("relu", False, _relu),
    Activation("srelu", False, _srelu),
    Activation("silu", False, _silu),
    Activation("geglu", True, _gelu),
    Activation("qgeglu", True, _qgelu),
    Activation("reglu", True, _relu),
    Activation("sreglu", True, _srelu),
    Activation("swiglu", True, _silu),
    Activation("glu", True, _sigmoid),
    Activation("clamped_swiglu", True, _silu, params=("limit", "alpha", "glu_linear_offset")),
)}


def activation(name: str, params: Optional[Mapping[str, float]] = None) -> Activation:
    """The table entry of ``activation`` (checked), with ``activation_params`` checked against it."""
    if name not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    act = ACTIVATIONS[name]
    params = dict(params or {})
    unknown = sorted(set(params) - set(act.params))
    if unknown:
        allowed = ", ".join(act.params) if act.params else "none"
        raise ValueError(f"`activation_params` of {name!r} must only hold {allowed}, got {unknown}")
    if act.name == "clamped_swiglu" and "limit" not in params:
        raise ValueError("`activation_params` must give 'limit' for 'clamped_swiglu', got "
                         f"{params or None!r}")
    return act


def fc1_width(ffn_hidden_size: int, name: str) -> int:
    """FC1's output width: twice ``ffn_hidden_size`` for a gated activation."""
    if name not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return 2 * ffn_hidden_size if ACTIVATIONS[name].gated else ffn_hidden_size


def apply_activation(xp: Any, name: str, x: Any, params: Optional[Mapping[str, float]] = None) -> Any:
    """The activation of FC1's output ``x`` (last dim: FC1's width). Call it on float32 values."""
    act = activation(name, params)
    if not act.gated:
        return act.fn(xp, x)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    if act.name == "clamped_swiglu":
        limit = float(params["limit"])
        alpha = float(params.get("alpha", 1.702))
        offset = float(params.get("glu_linear_offset", 1.0))
        a = xp.minimum(a, limit + 0.0 * a)
        return _qgelu(xp, a, alpha) * (xp.clip(b, -limit, limit) + offset)
    return act.fn(xp, a) * b


# ---------------------------------------------------------------------------------------------------------
# TransformerLayer: the order of its sublayers, norms and residual additions.


@dataclasses.dataclass(frozen=True)
class LayerStructure:
    """How a ``TransformerLayer`` composes its sublayers (TransformerEngine's semantics, both frameworks).

    The sublayers run in order: self attention, cross attention (decoder only), MLP. Each normalizes its own
    input (``LayerNormLinear`` / ``LayerNormMLP``), except self attention under ``output_layernorm`` (BERT's
    post-norm: one norm then follows the whole layer). A sublayer's output is added to a residual: its input,
    or, with ``apply_residual_connection_post_layernorm``, its normalized input (self attention's only when it
    normalizes). With ``parallel_attention_mlp`` (encoder only) attention and MLP both read the layer's input
    and their outputs are added to it together.
    """

    layer_type: str = "encoder"
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    parallel_attention_mlp: bool = False

    def __post_init__(self) -> None:
        if self.layer_type not in ("encoder", "decoder"):
            raise ValueError(f"`layer_type` must be 'encoder' or 'decoder', got {self.layer_type!r}")
        if self.parallel_attention_mlp:
            if self.layer_type != "encoder":
                raise ValueError("`parallel_attention_mlp=True` needs `layer_type='encoder'`, got "
                                 f"{self.layer_type!r}")
            for flag in ("apply_residual_connection_post_layernorm", "output_layernorm"):
                if getattr(self, flag):
                    raise ValueError(f"`parallel_attention_mlp=True` cannot be combined with `{flag}=True`")

    @property
    def sublayers(self) -> Tuple[str, ...]:
        """The sublayers in order: "self_attention", then "cross_attention" for a decoder, then "mlp"."""
        return ("self_attention", "cross_attention", "mlp") if self.layer_type == "decoder" \
            else ("self_attention", "mlp")

    def normalizes_input(self, sublayer: str) -> bool:
        """Whether ``sublayer`` applies its own input norm."""
        return not (sublayer == "self_attention" and self.output_layernorm)

    def returns_norm_output(self, sublayer: str) -> bool:
        """Whether ``sublayer`` also returns its norm's output (the residual under post-layernorm)."""
        return self.apply_residual_connection_post_layernorm and self.normalizes_input(sublayer)

    def run(self, x: Any, sublayer: Callable[[str, Any], Tuple[Any, Any]], add: Callable[[Any, Any, str], Any],
            output_norm: Optional[Callable[[Any], Any]] = None) -> Any:
        """Run the layer on ``x``. ``sublayer(name, inp)`` returns (output, norm output or None): the norm
        output where :meth:`returns_norm_output`. ``add(residual, out, name)`` adds a sublayer's output to its
        residual (the frontend applies bias, dropout and drop-path there; ``name`` is "parallel" for the sum
        of attention and MLP). ``output_norm`` is applied last under ``output_layernorm``."""
        if self.parallel_attention_mlp:
            attn, _ = sublayer("self_attention", x)
            mlp, _ = sublayer("mlp", x)
            out = add(x, attn + mlp, "parallel")
        else:
            out = x
            for name in self.sublayers:
                y, ln = sublayer(name, out)
                out = add(ln if self.returns_norm_output(name) else out, y, name)
        if self.output_layernorm:
            out = output_norm(out)
        return out
