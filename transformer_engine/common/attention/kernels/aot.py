"""Compiling the kernels ahead of time, without a GPU or a framework, exactly as Triton's JIT
specialises them for the same arguments.

Targets: NVIDIA (Triton's ``GPUTarget("cuda", 90, 32)``: a cubin, through the ptxas in Triton's
wheel) and AMD (``GPUTarget("hip", "gfx942", 64)``: a hsaco, through the LLVM AMDGPU backend in
Triton's wheel); both compile on the CPU. The JAX CUDA lowering (``transformer_engine.jax.primitives.gpu``)
compiles its cubins with this at lowering time and launches only those;
``kernels/resources.py`` and the compile tests use it for every target.
Arguments are given by name: :class:`Pointer` for a buffer, ints, floats and constexpr values as a
launch would pass them.
"""

from __future__ import annotations

import functools
import re
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


# What compile_kernel builds for each Triton backend: the binary's format and Triton's name for it.
_BINARY_FORMATS = {"cuda": "cubin", "hip": "hsaco"}
# Resource counts the AMDGPU backend writes into the kernel's metadata (amdgcn text), by name.
_HIP_RESOURCE_KEYS = ("vgpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count",
                      "private_segment_fixed_size")


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    binary: bytes  # a cubin (CUDA targets) or a hsaco (HIP targets): see binary_format
    binary_format: str  # "cubin" or "hsaco"
    arch: str  # the target's architecture: "sm_90", "gfx942"
    hash: int  # 64 bits of Triton's compilation hash
    shared: int  # shared memory (LDS on AMD) per program, bytes
    num_warps: int
    params: Tuple[Tuple[str, str], ...]  # (name, Triton type) of each launch parameter, in order
    global_scratch_size: int
    profile_scratch_size: int
    # HIP targets: the AMDGPU backend's resource counts (registers, spills, private scratch bytes
    # per work-item) by name; empty for CUDA targets, whose counts cuobjdump reads from the cubin.
    hip_resources: Tuple[Tuple[str, int], ...] = ()

    @property
    def cubin(self) -> bytes:
        """The CUDA binary; a HIP target's kernel has none (the JAX FFI launcher loads cubins only)."""
        if self.binary_format != "cubin":
            raise ValueError(f"`kernel` must be compiled for a CUDA target to have a cubin, got {self.name} compiled "
                             f"for {self.arch} (a {self.binary_format}); the JAX FFI launcher loads CUDA cubins only")
        return self.binary


def compile_kernel(fn, args: Dict[str, object], launch_options: Dict[str, int], target) -> CompiledKernel:
    """Compile Triton ``fn`` for ``args`` (Pointer, int, float or constexpr values by name) with
    ``launch_options`` (num_warps, num_stages as a launch passes them) for ``target``: Triton's
    ``GPUTarget`` of a CUDA architecture (a cubin) or a HIP one (a hsaco)."""
    backend = getattr(target, "backend", None)
    if backend not in _BINARY_FORMATS:
        raise NotImplementedError(
            "`target` must be a Triton GPUTarget of backend 'cuda' (e.g. GPUTarget('cuda', 90, 32)) or 'hip' "
            f"(e.g. GPUTarget('hip', 'gfx942', 64)), got {target!r}")
    return _compile_cached(fn, tuple(args.items()), tuple(sorted(launch_options.items())), target)


@functools.lru_cache(maxsize=256)
def _compile_cached(fn, args, launch_options, target) -> CompiledKernel:
    import triton

    from transformer_engine.common.attention.kernels import triton_compat

    bound = dict(args)
    missing = [name for name in fn.arg_names if name not in bound]
    if missing:
        raise ValueError(f"{fn.__name__}: arguments {missing} are missing")
    # The same steps as JITFunction.run, minus the device queries (triton_compat.jit_specialize), so the
    # cubin is the one the PyTorch launch of the same call compiles.
    source, options, signature = triton_compat.jit_specialize(fn, bound, dict(launch_options), target)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    md = compiled.metadata
    params = tuple((name, ty) for name, ty in signature.items() if ty != "constexpr")
    binary_format = _BINARY_FORMATS[target.backend]
    hip_resources = ()
    if target.backend == "hip":
        found = dict(re.findall(r"^\s*\.(" + "|".join(_HIP_RESOURCE_KEYS) + r"):\s*(\d+)", compiled.asm["amdgcn"],
                                re.MULTILINE))
        hip_resources = tuple((key, int(found[key])) for key in _HIP_RESOURCE_KEYS if key in found)
    return CompiledKernel(
        name=md.name,
        binary=bytes(compiled.asm[binary_format]),
        binary_format=binary_format,
        arch=f"sm_{target.arch}" if target.backend == "cuda" else str(target.arch),
        hash=int(compiled.hash[:16], 16),
        shared=int(md.shared),
        num_warps=int(md.num_warps),
        params=params,
        global_scratch_size=int(getattr(md, "global_scratch_size", 0) or 0),
        profile_scratch_size=int(getattr(md, "profile_scratch_size", 0) or 0),
        hip_resources=hip_resources,
    )
