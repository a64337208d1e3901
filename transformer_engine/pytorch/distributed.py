"""RNG-state tracking and recompute markers, as TransformerEngine's ``pytorch.distributed`` names them.

``CudaRNGStatesTracker`` keeps named RNG states so that tensor-parallel ranks draw dropout masks
and initial weights from streams they choose (the same stream on every rank for replicated
work, a per-rank stream for sharded work). It tracks the CUDA generator of the current device
when CUDA is available, else torch's CPU generator, so the same code runs in CPU tests.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch

# Every state any tracker holds, by name: what ``get_all_rng_states`` returns (TransformerEngine
# keeps one such table so that checkpointing can save and restore every tracked stream).
_ALL_ACTIVE_RNG_STATES: Dict[str, torch.Tensor] = {}


def _use_cuda() -> bool:
    return torch.cuda.is_available()


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named RNG states; ``fork(name)`` runs a block on that state and saves where it ended.

    ``add(name, seed)`` creates a state seeded with ``seed`` without disturbing the current one;
    ``get_states``/``set_states`` copy the table out and in (checkpointing); ``reset`` empties it.
    """

    def __init__(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        for name in self.states_:
            _ALL_ACTIVE_RNG_STATES.pop(name, None)
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        if not isinstance(states, dict):
            raise ValueError(f"`states` must be a dict of name -> RNG state tensor, got {type(states).__name__}")
        self.states_ = {name: state.clone() for name, state in states.items()}
        _ALL_ACTIVE_RNG_STATES.update(self.states_)

    def add(self, name: str, seed: int) -> None:
        if not isinstance(seed, int):
            raise ValueError(f"`seed` must be an int, got {seed!r}")
        if seed in self.seeds_:
            raise ValueError(f"`seed` {seed} is already tracked (each state needs its own seed)")
        if name in self.states_:
            raise ValueError(f"`name` {name!r} is already tracked")
        self.seeds_.add(seed)
        saved = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(saved)
        _ALL_ACTIVE_RNG_STATES[name] = self.states_[name]

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"`name` {name!r} is not a tracked RNG state; tracked: {sorted(self.states_)}")
        saved = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _ALL_ACTIVE_RNG_STATES[name] = self.states_[name]
            _set_rng_state(saved)


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """Every state a tracker holds, by name."""
    return dict(_ALL_ACTIVE_RNG_STATES)


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False):
    """Marks a forward run for activation recompute. A no-op here: an FP8 module's forward re-run
    outside its autocast is refused (it would recompute in high precision), so no FP8 state has to be
    carried from the first forward to its recompute."""
    yield


def is_fp8_activation_recompute_enabled() -> bool:
    """Always False: FP8 activation recompute is not implemented (the recompute is refused)."""
    return False


__all__ = ["CudaRNGStatesTracker", "get_all_rng_states", "activation_recompute_forward",
           "is_fp8_activation_recompute_enabled"]
