"""The FP8 state of a module in its state dict: TransformerEngine's ``_extra_state`` entry, our serialization.

What is saved is what a run needs to continue bitwise: the delayed-scaling scales and amax histories of
each FP8 GEMM. The other recipes (current and block scaling) keep no state across steps; their entry is an
empty uint8 tensor, as TransformerEngine saves it. The cached FP8 weight is not saved (it is quantized
again from the loaded weight).

Layout (TransformerEngine's keys and column order; LayerNormMLP's two GEMMs side by side, fc1 first)::

    {"format": "transformer_engine.fp8_extra_state", "version": 1,
     "recipe": {"type": "DelayedScaling", "fp8_format": "HYBRID", "margin": 0, "amax_history_len": ..., ...},
     "scale_fwd": float32 [3 * num_gemms],          # per GEMM: input, weight, output
     "amax_history_fwd": float32 [len, 3 * num_gemms],
     "scale_bwd": float32 [2 * num_gemms],          # per GEMM: grad output, grad input
     "amax_history_bwd": float32 [len, 2 * num_gemms],
     "extra_fp8_variables": {"num_gemms": num_gemms}}

DotProductAttention's FP8 attention state is one such "GEMM" of 5 forward tensors (q, k, v, o, s) and 5
backward tensors (dO, dP, dQ, dK, dV): ``load(..., widths=(5, 5))``, ``fp8_attention.FWD_SLOTS`` /
``BWD_SLOTS``. The entry is serialized with ``torch.save`` into bytes and stored as a CPU uint8 tensor (torch remaps tensors, not
extra-state objects, to devices on load). The recipe is kept as plain fields (its format by name; a
callable ``amax_compute_algo`` or ``scaling_factor_compute_algo`` is not saved: the next autocast's recipe
sets them). Loading reads it back with ``torch.load(weights_only=True)``: no arbitrary objects are unpickled,
so TransformerEngine's own pickled entries are refused by name.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from transformer_engine.common import recipe as _recipe

FORMAT = "transformer_engine.fp8_extra_state"
VERSION = 1
_FWD, _BWD = 3, 2  # tensors per GEMM in each direction


def _recipe_fields(recipe: _recipe.Recipe) -> dict:
    # A client's subclass (Megatron's TEDelayedScaling) is saved as the recipe it derives from.
    base = next(c for c in type(recipe).__mro__ if c.__module__ == _recipe.__name__)
    out = {"type": base.__name__}
    for name in recipe._DEFAULTS:
        value = getattr(recipe, name)
        if isinstance(value, _recipe.Format):
            out[name] = value.name
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value):
            out[name] = list(value)
        # Callables and option objects are left out: the recipe is rebuilt with their defaults.
    return out


def _recipe_from_fields(fields: dict) -> _recipe.DelayedScaling:
    if fields.get("type") != "DelayedScaling":
        raise ValueError(f"FP8 extra state: `recipe` must be a DelayedScaling's fields, got {fields.get('type')!r}")
    kwargs = {k: v for k, v in fields.items() if k in _recipe.DelayedScaling._DEFAULTS}
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = _recipe.Format[kwargs["fp8_format"]]
    if "override_linear_precision" in kwargs:
        kwargs["override_linear_precision"] = tuple(kwargs["override_linear_precision"])
    return _recipe.DelayedScaling(**kwargs)


def save(states: Sequence[Any]) -> torch.Tensor:
    """The extra-state tensor of a module whose GEMMs keep ``states`` (LinearFP8State or None, in GEMM order)."""
    metas = [(s.fwd_meta, s.bwd_meta) if s is not None else (None, None) for s in states]
    if any(fwd is None for fwd, _ in metas):
        # No delayed-scaling state (FP8 never ran, or ran a stateless recipe).
        return torch.empty(0, dtype=torch.uint8)
    fwd = [m[0] for m in metas]
    bwd = [m[1] for m in metas]
    state = {
        "format": FORMAT, "version": VERSION,
        "recipe": _recipe_fields(fwd[0].recipe),
        "scale_fwd": torch.cat([m.scale for m in fwd]).cpu(),
        "amax_history_fwd": torch.cat([m.amax_history for m in fwd], dim=1).cpu(),
        "scale_bwd": torch.cat([m.scale for m in bwd]).cpu(),
        "amax_history_bwd": torch.cat([m.amax_history for m in bwd], dim=1).cpu(),
        "extra_fp8_variables": {"num_gemms": len(states)},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _decode(state: Any, owner: str) -> Optional[dict]:
    if isinstance(state, io.BytesIO):  # TransformerEngine 1.x's entries
        data = state.getvalue()
    elif isinstance(state, torch.Tensor):
        if state.numel() == 0:
            return None
        if state.dtype != torch.uint8 or state.dim() != 1:
            raise ValueError(f"{owner}: the FP8 extra state must be a 1-D uint8 tensor, got {state.dtype} "
                             f"{tuple(state.shape)}")
        data = state.detach().cpu().numpy().tobytes()
    else:
        raise ValueError(f"{owner}: the FP8 extra state must be a uint8 tensor, None or an io.BytesIO, "
                         f"got {type(state).__name__}")
    if not data.startswith(b"PK"):  # torch.save's zip archive; TransformerEngine 2.x pickles its entry
        raise NotImplementedError(
            f"{owner}: loading TransformerEngine's pickled FP8 extra state is not implemented (this package "
            "does not unpickle arbitrary objects); load such a checkpoint with strict=False and drop its "
            "`_extra_state` entries, or save it again with this package")
    try:
        out = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (torch raises several types for foreign archives)
        raise NotImplementedError(f"{owner}: an FP8 extra state not written by this package cannot be loaded "
                                  f"({type(err).__name__}: {err})") from err
    if not isinstance(out, dict) or out.get("format") != FORMAT or out.get("version") != VERSION:
        raise NotImplementedError(f"{owner}: an FP8 extra state not written by this package (format "
                                  f"{FORMAT!r} version {VERSION}) cannot be loaded")
    return out


def _fill(meta, scale: torch.Tensor, history: torch.Tensor, recipe, forward: bool, device) -> Any:
    """``meta`` holding (scale, history): copied in place when the shapes and format agree, else a new meta."""
    from transformer_engine.common.quantization import format_dtypes
    from transformer_engine.pytorch.quantization import DelayedScalingMeta

    fmt = format_dtypes(recipe.fp8_format)[0 if forward else 1]
    if (meta is None or meta.fmt != fmt or meta.scale.shape != scale.shape
            or meta.amax_history.shape != history.shape):
        meta = DelayedScalingMeta(scale.numel(), recipe, forward, device)
        meta.amax_history = torch.zeros(history.shape, dtype=torch.float32, device=device)
    meta.scale.copy_(scale)
    meta.amax_history.copy_(history)
    return meta


def load(module: torch.nn.Module, state: Any, attrs: Sequence[str], device: torch.device,
         widths: Tuple[int, int] = (_FWD, _BWD), state_cls: Optional[Callable[[], Any]] = None) -> None:
    """Set ``module``'s FP8 states (attributes ``attrs``, in GEMM order) from its extra-state entry; a missing
    state is made by ``state_cls`` (default LinearFP8State)."""
    from transformer_engine.pytorch.quantization_linear import LinearFP8State

    fw, bw = widths
    state_cls = LinearFP8State if state_cls is None else state_cls
    owner = type(module).__name__
    if state is None:
        return
    decoded = _decode(state, owner)
    if decoded is None:  # saved without delayed-scaling state: nothing to restore (as TransformerEngine)
        return
    n = len(attrs)
    saved_n = decoded.get("extra_fp8_variables", {}).get("num_gemms")
    if saved_n != n:
        raise ValueError(f"{owner}: the FP8 extra state must hold {n} GEMM(s), got {saved_n}")
    recipe = _recipe_from_fields(decoded["recipe"])
    scale_fwd, hist_fwd = decoded["scale_fwd"], decoded["amax_history_fwd"]
    scale_bwd, hist_bwd = decoded["scale_bwd"], decoded["amax_history_bwd"]
    length = hist_fwd.shape[0]
    expected = {"scale_fwd": (fw * n,), "amax_history_fwd": (length, fw * n),
                "scale_bwd": (bw * n,), "amax_history_bwd": (length, bw * n)}
    for key, shape in expected.items():
        t = decoded[key]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"{owner}: FP8 extra state `{key}` must be a float32 tensor of shape {shape}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    for i, attr in enumerate(attrs):
        st = module.__dict__.get(attr)
        if st is None:
            st = module.__dict__[attr] = state_cls()
        dev = st.fwd_meta.scale.device if st.fwd_meta is not None else device
        st.fwd_meta = _fill(st.fwd_meta, scale_fwd[fw * i:fw * (i + 1)], hist_fwd[:, fw * i:fw * (i + 1)], recipe,
                            True, dev)
        st.bwd_meta = _fill(st.bwd_meta, scale_bwd[bw * i:bw * (i + 1)], hist_bwd[:, bw * i:bw * (i + 1)], recipe,
                            False, dev)
        st._weight_cache = None  # the weight is loaded too: quantize it again
