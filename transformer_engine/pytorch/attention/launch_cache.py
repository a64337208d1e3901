"""The launch cache: Triton and Gluon kernels launched through their compiled launchers, looked up by what
Triton specializes on, without Triton's per-call binding (the kernel runner's last step).

Calling a JIT kernel (``kernel[grid](**args)``) binds every argument and recomputes its specialization on each
call before it looks the compiled kernel up, several times the host time of the compiled kernel's own
launcher; an attention step launches up to four kernels, so for small calls the GPU waits for the host. Here
the compiled kernel is looked up by what Triton specializes on instead: each tensor's dtype and 16-byte
alignment, every other argument's exact value (a finer key than Triton's, so a hit is always the kernel Triton
would pick), the launch options and the device. The first launch of a key goes through Triton's JIT with
``warmup=True``, which compiles (or loads from Triton's cache) without launching.

Triton's JIT call stays in use where this would change behaviour: under the interpreter, with
``NVTE_FUSED_ATTN_CACHED_LAUNCH=0``, in Triton's debug mode, for kernels with pre-run hooks, and for
a kernel whose compiled form lacks the launcher attributes this relies on (another Triton version).
Launch hooks (profilers such as proton) still see every launch.

:func:`prepare` goes one step further for the kernel runner's signature cache: one described launch with
its compiled kernel and every argument but the tensors fixed (:class:`PreparedLaunch`), so a call whose
signature was seen launches without building a key at all.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Mapping, Sequence, Tuple

import torch

from transformer_engine.common import settings
from transformer_engine.common.attention.kernels import triton_compat
from transformer_engine.pytorch.attention.config import triton_interpreting

__all__ = ["launch", "prepare", "PreparedLaunch", "cached_kernels", "clear"]

_MAX_ENTRIES = 4096  # distinct (kernel, shapes, strides) keys kept; the least recently used go first
_compiled: "OrderedDict[tuple, object]" = OrderedDict()
_unsupported = set()  # kernels whose compiled form lacks a launcher attribute: Triton's JIT call for them
_NOT_READY = object()  # _compile's answer while Triton compiles in the background


def cached_kernels() -> int:
    """How many compiled kernels the cache holds (one per distinct key)."""
    return len(_compiled)


def clear() -> None:
    """Empty the cache, and the signature caches whose entries hold its kernels (the compiled kernels stay
    in Triton's own caches)."""
    from transformer_engine.pytorch.attention import signature_cache

    _compiled.clear()
    _unsupported.clear()
    signature_cache.clear_all()


def _device_and_stream() -> Tuple[int, int]:
    """The current device and its current stream, as Triton's JIT reads them."""
    return triton_compat.current_device_and_stream()


def _hooks():
    """Triton's launch enter and exit hooks, or (None, None) when neither has anything to call."""
    enter, exit_ = triton_compat.launch_hooks()
    active = [h for h in (enter, exit_) if h is not None and getattr(h, "calls", True)]
    return (enter, exit_) if active else (None, None)


def _jit_only(kernel) -> bool:
    """Whether this launch goes through Triton's JIT call (see the module's docstring)."""
    if triton_interpreting() or not settings.get("NVTE_FUSED_ATTN_CACHED_LAUNCH"):
        return True
    return triton_compat.runtime_debug() or bool(getattr(kernel, "pre_run_hooks", None)) or kernel in _unsupported


def _key(kernel, device: int, values: Sequence[object], options: Mapping[str, int]) -> tuple:
    # The types too (one C pass): True == 1 == 1.0 as keys, but Triton types them i1, i32 and fp32.
    parts = [kernel, device, tuple(options.items()), tuple(map(type, values))]
    for v in values:
        if isinstance(v, torch.Tensor):
            parts.append(v.dtype)
            parts.append(v.data_ptr() % 16 == 0)
        else:
            parts.append(v)
    return tuple(parts)


def _compile(kernel, grid: Tuple[int, int, int], args: Dict[str, object], options: Mapping[str, int]):
    """The compiled kernel Triton's JIT picks for these arguments, loaded; None where its form lacks what
    :func:`launch` calls; ``_NOT_READY`` while Triton compiles it in the background."""
    compiled = kernel.run(grid=grid, warmup=True, **args, **options)
    if compiled is None:  # Triton's asynchronous compile mode: not ready yet, so not cached
        return _NOT_READY
    if hasattr(compiled, "result"):  # an asynchronous compile's future
        compiled = compiled.result()
    if not triton_compat.has_compiled_launcher(compiled):
        return None
    compiled._init_handles()
    return compiled


def _lookup(kernel, device: int, grid, args: Dict[str, object], values: tuple, options: Mapping[str, int]):
    """The compiled kernel of these arguments, from the cache or compiled now (and cached); None for a kernel
    whose compiled form lacks the launcher (remembered), ``_NOT_READY`` while Triton compiles it."""
    key = _key(kernel, device, values, options)
    compiled = _compiled.get(key)
    if compiled is not None:
        _compiled.move_to_end(key)
        return compiled
    compiled = _compile(kernel, grid, args, options)
    if compiled is _NOT_READY:
        return compiled
    if compiled is None:
        _unsupported.add(kernel)
        return None
    _compiled[key] = compiled
    if len(_compiled) > _MAX_ENTRIES:
        _compiled.popitem(last=False)
    return compiled


def launch(kernel, grid: Tuple[int, int, int], args: Dict[str, object], options: Mapping[str, int]) -> None:
    """Launch ``kernel`` on ``grid`` (three dims) with ``args`` (every parameter by name, in the kernel's
    order) and ``options`` (num_warps, num_stages, maxnreg) on the current device and stream."""
    if _jit_only(kernel):
        kernel[grid](**args, **options)
        return
    device, stream = _device_and_stream()
    values = tuple(args.values())
    compiled = _lookup(kernel, device, grid, args, values, options)
    if compiled is None or compiled is _NOT_READY:
        # Not cached: this kernel's form lacks the launcher, or Triton's JIT call waits for its background
        # compile this once (the next launch asks again).
        kernel[grid](**args, **options)
        return
    _launch_compiled(compiled, grid, stream, values)


def _launch_compiled(compiled, grid, stream: int, values) -> None:
    """Launch a compiled kernel through its launcher, or, while a profiler's hooks listen, through Triton's own
    launch path of the compiled kernel (which builds what the hooks read)."""
    enter, _ = _hooks()
    if enter is None:
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *values)
    else:
        compiled[grid](*values, stream=stream)


class PreparedLaunch:
    """One described launch (``described``: a ``launch_description.Launch``) with everything but its tensors
    fixed: the grid, the arguments in the kernel's order with the tensor slots' positions, the options, and,
    from its first run on, the compiled kernel :func:`launch` finds for them (or the note that every run goes
    through :func:`launch`: under the interpreter, with ``NVTE_FUSED_ATTN_CACHED_LAUNCH=0``, for a kernel
    without the launcher attributes).

    Valid for calls of one signature (``signature_cache``): the same scalars, and tensors of the same
    dtypes and alignment in the slots, which is all :func:`launch`'s key reads besides the device and the
    options. The caller's tensors are in the signature; the buffers the kernel runner allocates per call
    are new allocations, which torch aligns to at least 64 bytes."""

    __slots__ = ("described", "kernel", "grid", "names", "values", "slots", "options", "is_gluon", "compiled",
                 "device")

    def __init__(self, described, slots: Sequence[Tuple[int, str]]):
        self.described = described
        self.kernel, self.grid, self.options = described.kernel, tuple(described.grid), described.options
        self.names = tuple(described.args)
        positions = {i for i, _ in slots}
        self.values = tuple(None if i in positions else v for i, v in enumerate(described.args.values()))
        self.slots = tuple(slots)
        self.is_gluon = described.is_gluon
        self.compiled = None  # None: not looked up yet; _VIA_LAUNCH: every run through launch()
        self.device = None

    def args(self, buffers: Mapping[str, object]) -> list:
        """The kernel's arguments in order, each slot bound to its buffer."""
        values = list(self.values)
        for i, name in self.slots:
            values[i] = buffers[name]
        return values

    def run(self, buffers: Mapping[str, object]) -> None:
        """Launch on ``buffers`` (the slots' tensors by name) on the current stream."""
        values = self.args(buffers)
        compiled = self.compiled
        if compiled is None:
            compiled = self._look_up(values)
        if compiled is not _VIA_LAUNCH:
            device, stream = _device_and_stream()
            if device == self.device and not triton_compat.runtime_debug():
                _launch_compiled(compiled, self.grid, stream, values)
                return
        launch(self.kernel, self.grid, dict(zip(self.names, values)), self.options)

    def _look_up(self, values: list):
        """The compiled kernel of the first run's arguments, kept; ``_VIA_LAUNCH`` where launch() decides."""
        if _jit_only(self.kernel):
            self.compiled = _VIA_LAUNCH
            return _VIA_LAUNCH
        device, _ = _device_and_stream()
        compiled = _lookup(self.kernel, device, self.grid, dict(zip(self.names, values)), tuple(values),
                           self.options)
        if compiled is _NOT_READY:  # Triton compiles it in the background: launch() this time, ask again next
            return _VIA_LAUNCH
        self.compiled = _VIA_LAUNCH if compiled is None else compiled
        self.device = device
        return self.compiled


_VIA_LAUNCH = object()


def prepare(described, slots: Sequence[Tuple[int, str]]) -> PreparedLaunch:
    """The :class:`PreparedLaunch` of ``described`` (a ``launch_description.Launch``) whose tensor arguments
    are the slots at ``slots`` ((position, buffer name) pairs). Nothing is compiled before its first run."""
    return PreparedLaunch(described, slots)
