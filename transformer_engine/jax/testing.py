"""Test and benchmark scaffolding for the JAX frontend: ``fused_attn`` on a named backend, and a
record of the backends ``fused_attn`` selects.

Not part of ``fused_attn``'s API: tests, benchmarks and the determinism check
(:mod:`transformer_engine.jax.determinism_check`) use these to force or observe the backend.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import jax

from transformer_engine.common.attention.backends import backend_named
from transformer_engine.jax import attention as _attention
from transformer_engine.jax.enums import AttnSoftmaxType

__all__ = ["fused_attn_with_backend", "recording_backend_selections"]

# The positional order of fused_attn_with_backend: fused_attn's without softmax_type (the tests' own order).
_BACKEND_POSITIONAL = ("qkv", "bias", "sequence_descriptor", "seed", "attn_bias_type", "attn_mask_type", "qkv_layout",
                       "scaling_factor", "dropout_probability", "is_training", "max_segments_per_seq", "window_size")


def fused_attn_with_backend(backend: str, *args, **kwargs) -> jax.Array:
    """``fused_attn`` on a named backend ('fused' or 'unfused'), skipping selection; on CPU 'fused'
    runs the fused primitives' jnp lowering. Positional arguments follow ``_BACKEND_POSITIONAL``
    (``fused_attn``'s order without ``softmax_type``); pass the rest by keyword."""
    bound = dict(zip(_BACKEND_POSITIONAL, args))
    bound.update(kwargs)
    bound.setdefault("softmax_type", AttnSoftmaxType.VANILLA_SOFTMAX)
    call = _attention._parse_call(_attention._FusedAttnArgs(**bound))
    return _attention._run(call, backend_named(backend, _attention._CANDIDATES))


@contextlib.contextmanager
def recording_backend_selections() -> Iterator[List[str]]:
    """Collect the name of the backend each ``fused_attn`` trace selects inside the block (selection
    happens at trace time, so a cached jit trace records nothing)."""
    names: List[str] = []

    def record(selection) -> None:
        names.append(selection.name)

    _attention._selection_listeners.append(record)
    try:
        yield names
    finally:
        _attention._selection_listeners.remove(record)
