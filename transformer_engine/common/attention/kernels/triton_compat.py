"""Every Triton API that differs between the Triton releases the package supports, and every private
Triton API it touches, in one place.

Supported: the releases current CUDA torch builds pin, Triton 3.6 (torch 2.10/2.11), 3.7 (2.12/2.13),
3.8 (2.14) and 3.9 (2.15). Code elsewhere imports what differs from here and asks no version: where a
public name exists in a release it is used, else the older spelling.

What differs (resolved once, at import):

- Gluon's TMA bulk load (Hopper): ``tma.async_load`` from 3.8; ``tma.async_copy_global_to_shared`` in 3.6
  and 3.7 (3.9 keeps the old name only as a stub that raises at compile time).
- Gluon's cp.async load (Ampere and later): ``async_copy.async_load`` from 3.8;
  ``async_copy.async_copy_global_to_shared`` before (a raising stub in 3.9).
- Aggregates (compile-time structs shared by Gluon partitions): ``triton.aggregate`` from 3.8;
  ``triton.language.core._aggregate`` before.
- The Gluon AST source that compiles a Gluon kernel ahead of time: ``gluon.GluonASTSource`` from 3.9;
  ``triton.experimental.gluon._runtime.GluonASTSource`` before.
- Options JITFunction.run derives from Triton's knobs before it binds a call (3.9 adds
  ``fpsan_homomorphic_casts``): :func:`jit_run_options`, so that an ahead-of-time compile is the JIT's.
- A JIT function's cache key: before 3.9 a caller's key takes in the constexpr globals of a callee only if
  the callee's key was computed earlier in the process, so the same kernel gets another key (and compiles
  again, in another cache entry) depending on which kernel a process compiled first.
  :func:`settle_cache_keys` computes every key callees first, the order 3.9 follows itself.

Private APIs used (PRIVATE_APIS lists each with its user; tests/common/test_triton_compat.py asserts
that each exists in the installed Triton, so a release that drops one fails a test named after it rather
than a kernel compile or a launch deep inside a frontend).

:func:`gluon_unavailable_reason` says why the Gluon kernels cannot be built with the installed Triton (None
when they can): the plan then keeps the Triton kernels and logs the reason, never crashes.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Dict, Optional, Tuple

__all__ = [
    "SUPPORTED_RELEASES", "PRIVATE_APIS", "GLUON_APIS", "triton_version", "resolve", "missing_apis",
    "gluon_unavailable_reason", "tma_async_load", "cp_async_load", "aggregate", "gluon_ast_source",
    "jit_run_options", "jit_specialize", "cuobjdump_path", "allocator_is_set", "current_device_and_stream",
    "launch_hooks", "runtime_debug", "has_compiled_launcher", "is_jit_function", "settle_cache_keys",
    "interpret_dot_in_fixed_order",
]

SUPPORTED_RELEASES = ((3, 6), (3, 7), (3, 8), (3, 9))

# Private (or unstable) Triton APIs the package relies on: dotted path -> where and why. A path
# "module:attr.attr" names an attribute of a module's object (a class's method, a knob); "module:Class#attr"
# an attribute of an instance (JITFunction's, of a one-parameter kernel).
PRIVATE_APIS: Dict[str, str] = {
    # Ahead-of-time compiles (kernels/aot.py; the JAX CUDA lowering and the compile tests use them).
    "triton.compiler:ASTSource": "aot.py: the source of a Triton kernel for triton.compile",
    "triton.compiler:make_backend": "aot.py: the backend of a GPUTarget (option parsing, binder)",
    "triton.runtime.jit:create_function_from_signature": "aot.py: Triton's own argument binder (specialization)",
    "triton.runtime.jit:JITFunction._pack_args": "aot.py: options, signature, constexprs and attributes of a call",
    "triton.runtime.jit:JITFunction.is_gluon": "aot.py: whether a kernel compiles through the Gluon source",
    "triton.knobs:runtime.debug": "aot.py, launch_cache.py: Triton's debug mode",
    "triton.knobs:compilation.instrumentation_mode": "aot.py: an option JITFunction.run adds",
    "triton.backends.compiler:GPUTarget": "resources.py, jax/primitives/gpu.py: a compile target without a GPU",
    # The compiled-kernel launcher the PyTorch frontend calls directly (pytorch/attention/launch_cache.py).
    "triton.runtime:driver": "launch_cache.py: the current device and stream",
    "triton.knobs:runtime.launch_enter_hook": "launch_cache.py: profilers' launch hooks",
    "triton.knobs:runtime.launch_exit_hook": "launch_cache.py: profilers' launch hooks",
    "triton.compiler.compiler:CompiledKernel._init_handles": "launch_cache.py: load a compiled kernel",
    "triton.compiler.compiler:CompiledKernel.run": "launch_cache.py: the compiled kernel's launcher",
    "triton.compiler.compiler:CompiledKernel.launch_metadata": "launch_cache.py: Triton's launch with hooks",
    # The interpreter's dot, replaced by a fixed-order sum (interpret_dot_in_fixed_order).
    "triton.runtime.interpreter:InterpreterBuilder.create_dot": "triton_compat.py: the interpreter's tl.dot",
    "triton.runtime.interpreter:TensorHandle": "triton_compat.py: the interpreter's operand type",
    "triton.runtime.interpreter:_convert_float": "triton_compat.py: FP8 dot operands as the interpreter reads them",
    # Global scratch for the Gluon kernels' on-device TMA descriptors (pytorch/attention/launch.py).
    "triton.runtime._allocation:_allocator": "launch.py: the allocator of this thread (a context variable)",
    "triton.runtime._allocation:NullAllocator": "launch.py: what _allocator holds when none is set",
    "triton:set_allocator": "launch.py: set the scratch allocator",
    # Kernels and launch descriptions.
    "triton.runtime.jit:JITFunction": "jax/primitives/gpu.py: a JIT kernel, not the interpreter's",
    "triton.runtime.jit:JITFunction#arg_names": "launch_description.py, aot.py: a kernel's parameters, in order",
    "triton.runtime.jit:JITFunction.parse": "settle_cache_keys: the functions a kernel calls",
    "triton.runtime.jit:JITFunction#fn": "settle_cache_keys: a kernel's Python function (its closure)",
    "triton.runtime.jit:JITFunction.cache_key": "settle_cache_keys: computed callees first",
    "triton.runtime.jit:JITFunction#params": "aot.py: the binder's parameter descriptions",
    "triton.runtime.jit:JITFunction#signature": "aot.py: the binder's signature",
    "triton.language.random:philox": "kernels/scores.py: the dropout RNG's counter-based generator",
    "triton.language.random:uint_to_uniform_float": "kernels/scores.py: the dropout RNG's uniform floats",
    # Gluon (experimental in every supported release): kernels/hopper_ws.py.
    "triton.experimental.gluon:jit": "hopper_ws.py",
    "triton.experimental.gluon:constexpr_function": "hopper_ws.py",
    "triton.experimental.gluon.language:warp_specialize": "hopper_ws.py",
    "triton.experimental.gluon.language:NVMMADistributedLayout": "hopper_ws.py",
    "triton.experimental.gluon.language:NVMMASharedLayout.get_default_for": "hopper_ws.py",
    "triton.experimental.gluon.language:allocate_shared_memory": "hopper_ws.py",
    "triton.experimental.gluon.language.nvidia.hopper:mbarrier.MBarrierLayout": "hopper_ws.py",
    "triton.experimental.gluon.language.nvidia.hopper:tma.make_tensor_descriptor": "hopper_ws.py",
    "triton.experimental.gluon.language.nvidia.hopper:warpgroup_mma": "hopper_ws.py",
    "triton.experimental.gluon.language.nvidia.hopper:warpgroup_mma_wait": "hopper_ws.py",
    "triton.experimental.gluon.language.nvidia.hopper:fence_async_shared": "hopper_ws.py",
    "triton.experimental.gluon.language.nvidia.ampere:async_copy.mbarrier_arrive": "hopper_ws.py",
}

# Names that differ by release: what this module resolves, newest spelling first.
_ALTERNATIVES: Dict[str, Tuple[str, ...]] = {
    "tma_async_load": ("triton.experimental.gluon.language.nvidia.hopper.tma:async_load",
                       "triton.experimental.gluon.language.nvidia.hopper.tma:async_copy_global_to_shared"),
    "cp_async_load": ("triton.experimental.gluon.language.nvidia.ampere.async_copy:async_load",
                      "triton.experimental.gluon.language.nvidia.ampere.async_copy:async_copy_global_to_shared"),
    "aggregate": ("triton:aggregate", "triton.language.core:_aggregate"),
    "gluon_ast_source": ("triton.experimental.gluon:GluonASTSource",
                         "triton.experimental.gluon._runtime:GluonASTSource"),
}
# What the Gluon kernels need beyond PRIVATE_APIS' Gluon entries (gluon_unavailable_reason).
GLUON_APIS = ("tma_async_load", "cp_async_load", "aggregate", "gluon_ast_source")


def triton_version() -> Tuple[int, int]:
    """(major, minor) of the installed Triton."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def resolve(path: str):
    """The object at ``path`` ("module:attr.attr" or "module:Class#attr"); raises ImportError or
    AttributeError when absent."""
    module, _, attrs = path.partition(":")
    attrs, _, instance_attr = attrs.partition("#")
    obj = importlib.import_module(module)
    for name in attrs.split(".") if attrs else ():
        obj = getattr(obj, name)
    if instance_attr:
        obj = getattr(obj(_probe_kernel), instance_attr)
    return obj


def _probe_kernel(X):  # what resolve() wraps to read a JITFunction's instance attributes
    pass


def _first(name: str):
    """The first of ``name``'s alternatives that exists and is not a raising stub; None if none is."""
    for path in _ALTERNATIVES[name]:
        try:
            obj = resolve(path)
        except (ImportError, AttributeError):
            continue
        if not _removed_stub(obj):
            return obj
    return None


def _removed_stub(obj) -> bool:
    # Triton keeps a removed Gluon builtin as a function of (*args, **kwargs) that raises "has been removed";
    # its code names no parameter.
    code = getattr(getattr(obj, "__wrapped__", obj), "__code__", None)
    return code is not None and code.co_argcount == 0 and "removed" in " ".join(
        str(c) for c in code.co_consts if isinstance(c, str))


def missing_apis() -> Tuple[str, ...]:
    """PRIVATE_APIS paths and release-dependent names (GLUON_APIS) the installed Triton lacks."""
    missing = []
    for path in PRIVATE_APIS:
        try:
            resolve(path)
        except (ImportError, AttributeError):
            missing.append(path)
    missing.extend(name for name in _ALTERNATIVES if _first(name) is None)
    return tuple(missing)


@functools.lru_cache(maxsize=1)
def gluon_unavailable_reason() -> Optional[str]:
    """Why the Gluon kernels (kernels/hopper_ws.py) cannot be built with the installed Triton, or None.

    A fact of the installed package, computed once per process."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    missing = [p for p in PRIVATE_APIS if p.startswith("triton.experimental.gluon") and not _exists(p)]
    missing += [" or ".join(_ALTERNATIVES[name]) for name in GLUON_APIS if _first(name) is None]
    if missing:
        return f"triton {triton.__version__} lacks the Gluon APIs {', '.join(missing)}"
    try:
        importlib.import_module("transformer_engine.common.attention.kernels.hopper_ws")
    except Exception as err:  # a Gluon API that changed shape: the kernels do not even define
        return f"the Gluon kernels do not load with triton {triton.__version__}: {type(err).__name__}: {err}"
    return None


def _exists(path: str) -> bool:
    try:
        resolve(path)
    except (ImportError, AttributeError):
        return False
    return True


def _unavailable(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"{name}: this Triton has none of {', '.join(_ALTERNATIVES[name])}")
    return stub


def _or_stub(name: str):
    found = _first(name)
    return found if found is not None else _unavailable(name)


# ------------------------------------------------------------------------------------------------
# Kernel language (imported by the kernels; Gluon builtins are looked up by Gluon's code generator as
# globals of the kernel's module, so they are plain module attributes here).
# ------------------------------------------------------------------------------------------------

tma_async_load = _or_stub("tma_async_load")  # (tensor_desc, coord, barrier, result, pred=True)
cp_async_load = _or_stub("cp_async_load")  # (smem, pointer, mask=None, ...)
aggregate = _or_stub("aggregate")  # class decorator


def gluon_ast_source():
    """The class that turns a Gluon kernel into triton.compile's source."""
    found = _first("gluon_ast_source")
    if found is None:
        raise NotImplementedError("`fn` is a Gluon kernel and this Triton has no GluonASTSource to compile it with")
    return found


# ------------------------------------------------------------------------------------------------
# Ahead-of-time compiles (kernels/aot.py).
# ------------------------------------------------------------------------------------------------

# Options JITFunction.run sets from knobs before binding: (option, knobs group, knob).
_JIT_RUN_KNOBS = (("instrumentation_mode", "compilation", "instrumentation_mode"),
                  ("fpsan_homomorphic_casts", "compilation", "fpsan_homomorphic_casts"))


def jit_run_options(fn, launch_options: Dict[str, object]) -> Dict[str, object]:
    """``launch_options`` with what JITFunction.run adds from Triton's knobs (debug, and each knob this
    release reads), so an ahead-of-time compile gets the JIT's options and hash."""
    from triton import knobs

    out = dict(launch_options)
    out["debug"] = out.get("debug", fn.debug) or knobs.runtime.debug
    for option, group, knob in _JIT_RUN_KNOBS:
        knobs_group = getattr(knobs, group)
        if hasattr(knobs_group, knob):
            out[option] = getattr(knobs_group, knob)
    return out


def jit_specialize(fn, bound: Dict[str, object], launch_options: Dict[str, object], target):
    """(source, options) that triton.compile takes for ``fn`` called with ``bound`` on ``target``: the steps
    of JITFunction.run minus the device queries (Triton's own binder: ints equal to 1 become constants,
    16-divisibility hints)."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    kwargs = jit_run_options(fn, launch_options)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, _ = binder(**bound, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, kwargs)
    source = gluon_ast_source() if fn.is_gluon() else ASTSource
    return source(fn, signature, constexprs, attrs), options, signature


def cuobjdump_path() -> str:
    """The cuobjdump in Triton's wheel (reads a cubin's registers and stack)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


# ------------------------------------------------------------------------------------------------
# Launching (pytorch/attention/kernel_runner.py, launch_cache.py; jax/primitives/gpu.py).
# ------------------------------------------------------------------------------------------------


def allocator_is_set() -> bool:
    """Whether this thread has a Triton allocator (global scratch for on-device TMA descriptors)."""
    from triton.runtime import _allocation

    return not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)


def current_device_and_stream() -> Tuple[int, int]:
    """The current device and its current stream, as Triton's JIT reads them."""
    from triton.runtime import driver

    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


@functools.lru_cache(maxsize=None)
def _runtime_knobs():
    """triton.knobs.runtime, found once (read on every launch)."""
    from triton import knobs

    return knobs.runtime


def launch_hooks():
    """Triton's launch enter and exit hooks (either may be None)."""
    runtime = _runtime_knobs()
    return runtime.launch_enter_hook, runtime.launch_exit_hook


def runtime_debug() -> bool:
    """Triton's debug mode (TRITON_DEBUG)."""
    return bool(_runtime_knobs().debug)


_LAUNCHER_ATTRS = ("_init_handles", "run", "function", "packed_metadata")


def has_compiled_launcher(compiled) -> bool:
    """Whether a compiled kernel has the launcher attributes launch_cache.py calls directly."""
    return all(hasattr(compiled, a) for a in _LAUNCHER_ATTRS)


def is_jit_function(obj) -> bool:
    """Whether ``obj`` is a JIT kernel (not the interpreter's stand-in)."""
    from triton.runtime.jit import JITFunction

    return isinstance(obj, JITFunction)


def _callees(fn):
    """The JIT functions ``fn``'s body names (globals, closures, and attributes of modules it names), or None
    where it names an interpreter stand-in (a kernel module imported under TRITON_INTERPRET=1: such a kernel
    cannot be keyed, nor compiled, and computing its key would leave Triton's placeholder as the key)."""
    import ast
    import inspect

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    scope = {**fn.__globals__, **inspect.getclosurevars(fn.fn).nonlocals}
    found = []
    for node in ast.walk(fn.parse()):
        value = None
        if isinstance(node, ast.Name):
            value = scope.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            value = getattr(scope.get(node.value.id), node.attr, None)
        if isinstance(value, InterpretedFunction):
            return None
        if isinstance(value, JITFunction) and value is not fn and value not in found:
            found.append(value)
    return found


def settle_cache_keys(namespace: Dict[str, object]) -> None:
    """Compute the cache key of every JIT function in ``namespace`` (a kernel module's globals) after those of
    the functions it calls, so that each key is the same in every process whatever it compiles first. A
    no-op for the interpreter's stand-ins and harmless where Triton already keys callees first."""
    settled: Dict[int, bool] = {}

    def settle(fn) -> bool:
        if id(fn) not in settled:
            settled[id(fn)] = True  # a recursive call is keyed by Triton's own placeholder, as without us
            callees = _callees(fn)
            ok = callees is not None and all([settle(callee) for callee in callees])
            settled[id(fn)] = ok
            if ok:
                fn.cache_key  # noqa: B018 (computing it is the point)
        return settled[id(fn)]

    for value in list(namespace.values()):
        if is_jit_function(value):
            settle(value)


def interpret_dot_in_fixed_order() -> bool:
    """Make the Triton interpreter's ``tl.dot`` give each output element bits that depend only on its own row
    and column of the operands: not on the row count, the host BLAS or its threads.

    The interpreter computes ``tl.dot`` with numpy's matmul, i.e. the host BLAS, and some BLAS builds (seen on
    AMD EPYC hosts) change a row's summation order with the shape of the product: a query row's bits then
    differed between a decode tile and a training tile, and a bitwise claim proven under the interpreter held
    only on the host it ran on. Here a dot is a sum over the contraction index in a fixed order, one
    elementwise multiply-add of whole tiles per index, in the accumulator's dtype (``acc + a[:, k] b[k, :]``
    for k = 0, 1, ...; FP8 operands through fp16, as the interpreter's matmul reads them), never the host BLAS.
    Installed when ``TRITON_INTERPRET=1`` (the kernel package calls it at import; only interpreted kernels are affected).
    Returns whether it is installed.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    if getattr(InterpreterBuilder.create_dot, "_fixed_order", False):
        return True

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        dtype = d.data.dtype
        a_data = _dot_operand(a).astype(dtype)
        b_data = _dot_operand(b).astype(dtype)
        acc = a_data[..., :, :1] * b_data[..., :1, :]
        for k in range(1, a_data.shape[-1]):
            acc = acc + a_data[..., :, k:k + 1] * b_data[..., k:k + 1, :]
        return TensorHandle(acc + d.data, d.dtype.scalar)

    create_dot._fixed_order = True
    InterpreterBuilder.create_dot = create_dot
    return True


def _dot_operand(t):
    """An interpreter operand as the interpreter's dot reads it (FP8 through fp16, as its matmul does)."""
    from triton.runtime import interpreter
    import triton.language as tl

    if t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating():
        return interpreter._convert_float(t.data, t.dtype, tl.float16, None).view("float16")
    return t.data
