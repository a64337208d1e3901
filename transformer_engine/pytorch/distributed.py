"""RNG-state tracking and activation recompute, as TransformerEngine's ``pytorch.distributed`` names them.

``CudaRNGStatesTracker`` keeps named RNG states so that tensor-parallel ranks draw dropout masks
and initial weights from streams they choose (the same stream on every rank for replicated
work, a per-rank stream for sharded work). It tracks the CUDA generator of the current device
when CUDA is available, else torch's CPU generator, so the same code runs in CPU tests.

``checkpoint`` (TransformerEngine's ``te_checkpoint``) recomputes a region in the backward pass with
the RNG, AMP and FP8 state of its first forward, bitwise (see its docstring).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from transformer_engine.pytorch.recompute_frames import (  # noqa: F401 (re-exported)
    FRAMES, in_checkpointed_training_forward, in_fp8_activation_recompute_phase)

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



# --- activation recompute -----------------------------------------------------------------------
#
# A checkpointed region's first forward fixes, in a frame, everything its recompute must see again: the
# torch CPU and CUDA RNG states and the tracker's states (the same dropout masks), torch's AMP autocast and
# the FP8 autocast state, and each FP8 plan its modules made, in call order, with the delayed scales they
# read. The recompute replays the frame: each module gets back its plan with those scales, which records
# no amax (the first forward did), and no FP8 autocast exit updates the scales. So the recomputed step is
# bitwise the stored one, under every recipe and over any number of delayed-scaling steps.

_FRAMES = FRAMES  # the open frames, innermost last (recompute_frames.py: FP8's bookkeeping reads them)
# What replayed_fp8_plan answers outside a recompute.
NOT_REPLAYING = object()


class _RecomputeFrame:
    """One checkpointed call: the states its first forward saw, and the FP8 plans its modules made."""

    def __init__(self, get_rng_state_tracker: Optional[Callable]) -> None:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng = self._rng_states()
        self.fp8_state = FP8GlobalStateManager.get_autocast_state()
        self.fp8_depth = FP8GlobalStateManager.AUTOCAST_DEPTH
        # A training forward (gradients on at the call) even though the reentrant one runs without gradients.
        self.training = torch.is_grad_enabled()
        self.amp = [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                    for dev in ("cpu", "cuda") if dev == "cpu" or torch.cuda.is_available()]
        self.amp_cache = torch.is_autocast_cache_enabled()
        self.plans: List[Tuple[Any, Optional[str], Any]] = []
        self.replaying = False
        self.cursor = 0

    def _rng_states(self):
        tracker = self.get_rng_state_tracker() if self.get_rng_state_tracker is not None else None
        return (torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                tracker.get_states() if tracker is not None else None)

    def _set_rng_states(self, states) -> None:
        cpu, cuda, tracked = states
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        if tracked is not None:
            self.get_rng_state_tracker().set_states(tracked)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Around the first forward: the frame records the FP8 plans made inside."""
        _FRAMES.append(self)
        try:
            yield
        finally:
            _FRAMES.remove(self)

    @contextlib.contextmanager
    def recompute_context(self) -> Iterator[None]:
        """Around the recompute: the first forward's RNG, AMP and FP8 states and plans; the backward's after."""
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        bwd_rng = self._rng_states()
        bwd_fp8 = FP8GlobalStateManager.get_autocast_state()
        bwd_depth = FP8GlobalStateManager.AUTOCAST_DEPTH
        self._set_rng_states(self.rng)
        FP8GlobalStateManager.set_autocast_state(self.fp8_state)
        FP8GlobalStateManager.AUTOCAST_DEPTH = self.fp8_depth
        self.replaying, self.cursor = True, 0
        _FRAMES.append(self)
        try:
            with contextlib.ExitStack() as stack:
                for dev, enabled, dtype in self.amp:
                    stack.enter_context(torch.amp.autocast(dev, enabled=enabled, dtype=dtype,
                                                           cache_enabled=self.amp_cache))
                yield
        finally:
            _FRAMES.remove(self)
            self.replaying = False
            FP8GlobalStateManager.set_autocast_state(bwd_fp8)
            FP8GlobalStateManager.AUTOCAST_DEPTH = bwd_depth
            self._set_rng_states(bwd_rng)

    def next_plan(self, module: Any, gemm: Optional[str]) -> Any:
        if self.cursor >= len(self.plans):
            raise RuntimeError(f"activation recompute: {type(module).__name__} asked for an FP8 plan the first "
                               "forward did not make; the checkpointed function must run the same modules in "
                               "the same order in its recompute")
        recorded_module, recorded_gemm, plan = self.plans[self.cursor]
        if recorded_module is not module or recorded_gemm != gemm:
            ran = f"{type(recorded_module).__name__} ({recorded_gemm or 'its GEMM'})"
            raise RuntimeError(f"activation recompute: {type(module).__name__} ({gemm or 'its GEMM'}) ran where "
                               f"the first forward ran {ran}; the checkpointed function must run the same "
                               "modules in the same order")
        self.cursor += 1
        return plan


def replayed_fp8_plan(module: Any, gemm: Optional[str]) -> Any:
    """Inside a recompute: the plan ``module``'s ``gemm`` made in the first forward (None when that forward
    ran outside FP8), with the scales it read. ``NOT_REPLAYING`` elsewhere."""
    for frame in reversed(_FRAMES):
        if frame.replaying:
            plan = frame.next_plan(module, gemm)
            record_fp8_plan(module, gemm, plan)  # for a checkpoint nested in the recomputed function
            return plan
    return NOT_REPLAYING


def record_fp8_plan(module: Any, gemm: Optional[str], plan: Any) -> None:
    """Inside checkpointed first forwards: keep ``plan`` (or None), frozen at the scales it reads now."""
    for frame in _FRAMES:
        if not frame.replaying:
            frame.plans.append((module, gemm, None if plan is None else plan.frozen()))


def is_fp8_activation_recompute_enabled() -> bool:
    """Whether FP8 is enabled inside a checkpointed region (first forward or recompute)."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    return bool(_FRAMES) and FP8GlobalStateManager.is_fp8_enabled()


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False):
    """TransformerEngine's marker of a checkpointed forward. A no-op here: :func:`checkpoint` carries the
    first forward's state to its recompute in its own frame, so the modules need no marker."""
    yield


def _as_tuple(outputs: Any) -> Tuple[Any, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


class _CheckpointFunction(torch.autograd.Function):
    """Reentrant recompute: the forward runs without gradients and keeps the inputs; the backward reruns it
    with gradients (in the frame's recompute context) and backpropagates through the rerun."""

    @staticmethod
    def forward(ctx, run_function, frame, contexts, split, kwargs, *args):
        forward_ctx, recompute_ctx = contexts
        with torch.no_grad(), frame.forward_context(), forward_ctx:
            outputs = run_function(*args, **kwargs)
        ctx.run_function, ctx.frame, ctx.recompute_ctx, ctx.kwargs, ctx.split = (run_function, frame, recompute_ctx,
                                                                                  kwargs, split)
        ctx.inputs = [None if torch.is_tensor(arg) else arg for arg in args]
        tensors = [arg if torch.is_tensor(arg) else None for arg in args]
        if split is not None:
            # Keep only this rank's 1-D slice of the first input; the backward gathers it again.
            ctx.first_shape = args[0].shape
            tensors[0] = _rank_slice(args[0].detach(), split)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint(use_reentrant=True) does not support torch.autograd.grad(); use "
                               ".backward(), or use_reentrant=False")
        tensors = list(ctx.saved_tensors)
        if ctx.split is not None:
            tensors[0] = _gather_slices(tensors[0], ctx.split).view(ctx.first_shape)
        inputs = []
        # needs_input_grad covers forward's five leading non-tensor arguments, then args.
        for tensor, other, needs_grad in zip(tensors, ctx.inputs, ctx.needs_input_grad[5:]):
            if tensor is None:
                inputs.append(other)
            else:
                inputs.append(tensor.detach().requires_grad_(needs_grad))
        with torch.enable_grad(), ctx.frame.recompute_context(), ctx.recompute_ctx:
            outputs = _as_tuple(ctx.run_function(*inputs, **ctx.kwargs))
        pairs = [(out, grad) for out, grad in zip(outputs, grads)
                 if torch.is_tensor(out) and out.requires_grad and grad is not None]
        if not pairs:
            raise RuntimeError("checkpoint: no output of the function requires a gradient; the checkpoint is not "
                               "needed")
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        input_grads = tuple(inp.grad if torch.is_tensor(inp) else None for inp in inputs)
        return (None, None, None, None, None) + input_grads


def _rank_slice(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.numel() % size:
        raise ValueError(f"`distribute_saved_activations=True`: the first argument's size ({tensor.numel()}) must "
                         f"be divisible by the tensor-parallel size {size}")
    part = tensor.numel() // size
    return tensor.reshape(-1)[rank * part:(rank + 1) * part].clone()


def _gather_slices(part: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts)


def _is_process_group(value: Any) -> bool:
    return torch.distributed.is_available() and isinstance(value, torch.distributed.ProcessGroup)


def _noop_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


def checkpoint(function: Callable, *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group: Optional[Any] = None,
               use_reentrant: bool = True, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs, and recompute it in the backward pass.

    The recompute runs with the first forward's torch CPU and CUDA RNG states, the states of
    ``get_rng_state_tracker()`` (a :class:`CudaRNGStatesTracker`), torch's AMP autocast and the FP8 autocast
    (enabled, recipe, group) of the call, and each FP8 module gets back the plan it made in the first forward:
    the same delayed scales (not the ones the autocast exit updated since), no second amax record, no
    scale update when an autocast inside the function exits (FP8 attention, ``fp8_dpa``, reuses its call's
    delayed scales and skips its per-call update). So dropout masks, FP8 operands, outputs and
    gradients are bitwise those of the same step run without recompute, and delayed-scaling histories
    evolve as they do without it. The function must run the same modules in the same order both times.

    ``use_reentrant=True`` (TransformerEngine's default): an autograd Function that runs the forward
    without gradients and backpropagates through the rerun (``torch.autograd.grad`` is not supported; at
    least one input or output must require a gradient for the parameters to get theirs).
    ``use_reentrant=False``: torch's non-reentrant checkpoint (saved-tensor hooks) with this recompute
    context. ``distribute_saved_activations=True`` (reentrant only) keeps this rank's 1-D slice of the
    first argument instead of all of it, and all-gathers it over ``tp_group`` (default: the world group)
    before the recompute. ``context_fn`` (a callable returning the forward and recompute context
    managers) is honoured in both modes; ``determinism_check`` and ``debug`` go to torch's non-reentrant
    checkpoint. TransformerEngine's older positional form ``checkpoint(function,
    distribute_saved_activations, get_rng_state_tracker, tp_group, *args)`` is accepted with a
    DeprecationWarning.
    """
    if not callable(function):
        raise ValueError(f"`function` must be callable, got {function!r}")
    if (len(args) > 3 and isinstance(args[0], bool) and (args[1] is None or callable(args[1]))
            and (args[2] is None or _is_process_group(args[2]))):
        warnings.warn("checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args) "
                      "is deprecated: pass those three as keyword arguments", DeprecationWarning, stacklevel=2)
        distribute_saved_activations, get_rng_state_tracker, tp_group = args[:3]
        args = args[3:]
    if not isinstance(use_reentrant, bool):
        raise ValueError(f"`use_reentrant` must be a bool, got {use_reentrant!r}")
    if not isinstance(distribute_saved_activations, bool):
        raise ValueError(f"`distribute_saved_activations` must be a bool, got {distribute_saved_activations!r}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise ValueError(f"`get_rng_state_tracker` must be a callable returning a CudaRNGStatesTracker, got "
                         f"{get_rng_state_tracker!r}")
    context_fn = kwargs.pop("context_fn", None) or _noop_contexts
    determinism_check = kwargs.pop("determinism_check", "default")
    debug = kwargs.pop("debug", False)
    frame = _RecomputeFrame(get_rng_state_tracker)

    if use_reentrant:
        if determinism_check != "default" or debug:
            raise NotImplementedError("checkpoint: `determinism_check` and `debug` are torch's non-reentrant "
                                      "checkpoint's options; pass use_reentrant=False to use them")
        split = None
        if distribute_saved_activations:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("checkpoint: `distribute_saved_activations=True` needs torch.distributed "
                                   "initialized (init_process_group) to split the saved input over `tp_group`")
            if not args or not torch.is_tensor(args[0]):
                raise ValueError("`distribute_saved_activations=True` splits the first argument, which must be "
                                 f"a tensor, got {type(args[0]).__name__ if args else 'no argument'}")
            group = tp_group if tp_group is not None else dist.group.WORLD
            split = group if dist.get_world_size(group) > 1 else None
        return _CheckpointFunction.apply(function, frame, context_fn(), split, kwargs, *args)

    if distribute_saved_activations:
        warnings.warn("checkpoint: `distribute_saved_activations=True` has no effect with use_reentrant=False "
                      "(the saved tensors are those autograd's hooks keep)", stacklevel=2)

    def contexts():
        user_forward, user_recompute = context_fn()
        return _Chain(frame.forward_context, user_forward), _Chain(frame.recompute_context, user_recompute)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts,
                                             determinism_check=determinism_check, debug=debug,
                                             preserve_rng_state=False, **kwargs)


class _Chain:
    """A frame context then a user context, entered together (torch's checkpoint takes one of each)."""

    def __init__(self, frame_context: Callable, user_context: Any) -> None:
        self._frame_context, self._user_context = frame_context, user_context
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self._frame_context())
        stack.enter_context(self._user_context)
        self._stack = stack

    def __exit__(self, *exc) -> bool:
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


__all__ = ["CudaRNGStatesTracker", "get_all_rng_states", "checkpoint", "activation_recompute_forward",
           "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase"]
