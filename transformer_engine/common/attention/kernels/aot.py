"""Compiling the kernels ahead of time, without a GPU or a framework, exactly as Triton's JIT
specialises them for the same arguments.

The JAX CUDA lowering (``transformer_engine.jax.primitives.gpu``) compiles its cubins with this at
lowering time; ``benchmarks/attention/kernel_resources.py`` and the sm_90 compile test use it on
the CPU (Triton's wheel carries ptxas). Arguments are given by name: :class:`Pointer` for a buffer,
ints, floats and constexpr values as a launch would pass them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Tuple

__all__ = ["Pointer", "CompiledKernel", "compile_kernel"]


@dataclass(frozen=True)
class Pointer:
    """Stands for a device buffer during specialization: an element dtype name ("bfloat16",
    "float32", "int32", ...) and a 16-byte aligned address (framework buffers are aligned at
    least that much; the JAX FFI handler checks it at launch)."""

    dtype: str

    def __post_init__(self):
        if not isinstance(self.dtype, str):
            raise TypeError(f"`dtype` must be a dtype name such as 'bfloat16', got {self.dtype!r}")

    @staticmethod
    def data_ptr() -> int:
        return 1 << 20


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    cubin: bytes
    hash: int  # 64 bits of Triton's compilation hash
    shared: int
    num_warps: int
    params: Tuple[Tuple[str, str], ...]  # (name, Triton type) of each launch parameter, in order
    global_scratch_size: int
    profile_scratch_size: int


def compile_kernel(fn, args: Dict[str, object], launch_options: Dict[str, int], target) -> CompiledKernel:
    """Compile Triton ``fn`` for ``args`` (Pointer, int, float or constexpr values by name) with
    ``launch_options`` (num_warps, num_stages as a launch passes them) for ``target`` (Triton's
    GPUTarget)."""
    return _compile_cached(fn, tuple(args.items()), tuple(sorted(launch_options.items())), target)


@functools.lru_cache(maxsize=256)
def _compile_cached(fn, args, launch_options, target) -> CompiledKernel:
    import triton
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    bound = dict(args)
    missing = [name for name in fn.arg_names if name not in bound]
    if missing:
        raise ValueError(f"{fn.__name__}: arguments {missing} are missing")
    backend = make_backend(target)
    # The same steps as JITFunction.run, minus the device queries: Triton's own binder gives the
    # specialization (ints equal to 1 become constants, 16-divisibility hints), so the cubin is
    # the one the PyTorch launch of the same call compiles.
    kwargs = dict(launch_options)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, _ = binder(**bound, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, kwargs)
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    compiled = triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    md = compiled.metadata
    params = tuple((name, ty) for name, ty in signature.items() if ty != "constexpr")
    return CompiledKernel(
        name=md.name,
        cubin=bytes(compiled.asm["cubin"]),
        hash=int(compiled.hash[:16], 16),
        shared=int(md.shared),
        num_warps=int(md.num_warps),
        params=params,
        global_scratch_size=int(getattr(md, "global_scratch_size", 0) or 0),
        profile_scratch_size=int(getattr(md, "profile_scratch_size", 0) or 0),
    )
