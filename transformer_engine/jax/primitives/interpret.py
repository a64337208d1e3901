"""CPU lowering of the fused attention primitives as the Triton kernels under Triton's interpreter.

With ``NVTE_JAX_TRITON_INTERPRET=1``, and ``TRITON_INTERPRET=1`` set before the kernels were first imported, the
fused primitives lower on CPU to the same launches as on a CUDA GPU (``primitives.gpu``: the framework-free launch
description, buffer fills, then launches in order), run by one host callback that hands the buffers to the
interpreted kernels. Triton's interpreter reads tensors through torch's storage API, so the buffers are torch CPU
tensors and torch must be installed. Slow: for tests and the determinism check's ``--fused-interpreter``.
Otherwise the CPU lowering is the primitives' jnp math (``primitives.attention``).
"""

from __future__ import annotations

import functools
import threading
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np
from jax.interpreters import mlir

from transformer_engine.common import settings
from transformer_engine.jax.primitives import gpu

__all__ = ["interpreting", "unavailable_reason", "fwd_lowering", "bwd_lowering"]

# The device facts of a launch under the interpreter (the plan's interpreter tiles), as PyTorch's on CPU.
CPU_DEVICE = dict(device_type="cpu", vendor="nvidia", compute_capability=None, gfx_arch=None)

# One host callback at a time: Triton's interpreter is not known to be thread-safe.
_LOCK = threading.Lock()


def interpreting() -> bool:
    """Whether JAX's fused primitives run the Triton kernels under the interpreter on CPU (NVTE_JAX_TRITON_INTERPRET)."""
    return bool(settings.get("NVTE_JAX_TRITON_INTERPRET"))


def unavailable_reason() -> Optional[str]:
    """Why the interpreted kernels cannot run (with NVTE_JAX_TRITON_INTERPRET=1), or None when they can."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "NVTE_JAX_TRITON_INTERPRET=1 needs torch (Triton's interpreter reads torch CPU tensors)"
    from transformer_engine.common.attention.kernels import triton_compat
    from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel

    if triton_compat.is_jit_function(attn_fwd_kernel):
        return "NVTE_JAX_TRITON_INTERPRET=1 needs TRITON_INTERPRET=1 set before the kernels were first imported"
    return None


class InterpretedProgram(gpu.Program):
    """The fills and launches of one call, run by a host callback on CPU (the interpreted kernels, uncompiled)."""

    def __init__(self, operands):
        super().__init__(operands)
        self._described: List[Tuple[object, Tuple[int, int, int], Dict[str, object], Dict[str, object]]] = []

    def add_launches(self, described, buffers) -> None:
        for launch in described:
            self._described.append((launch.kernel, tuple(launch.grid), launch.bind(buffers), dict(launch.options)))

    def call(self, *operands):
        return jax.pure_callback(functools.partial(_run_on_host, self), tuple(self.results), *operands,
                                 vmap_method="sequential")


def _run_on_host(prog: InterpretedProgram, *arrays):
    import torch

    buffers = [torch.from_numpy(np.array(a)) for a in arrays]  # copies: the kernels may write only results
    buffers += [torch.empty(r.shape, dtype=getattr(torch, np.dtype(r.dtype).name)) for r in prog.results]
    for index, value, width in prog._fills:
        flat = buffers[index].reshape(-1)
        if width == 1:
            flat.view(torch.uint8).fill_(value)
        else:  # a 32-bit word (the fp32 +-inf fills)
            flat.view(torch.int32).fill_(int(np.array(value, np.uint32).view(np.int32)))
    with _LOCK:
        for kernel, grid, values, options in prog._described:
            args = {name: buffers[v.index] if isinstance(v, gpu.Buf) else v for name, v in values.items()}
            kernel[grid](**args, **options)
    return tuple(t.numpy() for t in buffers[len(arrays):])


def _check() -> None:
    reason = unavailable_reason()
    if reason:
        raise NotImplementedError(f"fused attention on CPU: {reason}")


def fwd_lowering(ctx, *args, static):
    _check()
    impl = functools.partial(gpu._fwd_impl, static=static, program=InterpretedProgram, device=CPU_DEVICE)
    return mlir.lower_fun(impl, multiple_results=True)(ctx, *args)


def bwd_lowering(ctx, *args, static):
    _check()
    impl = functools.partial(gpu._bwd_impl, static=static, program=InterpretedProgram, device=CPU_DEVICE)
    return mlir.lower_fun(impl, multiple_results=True)(ctx, *args)
