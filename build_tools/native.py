"""Native extensions: CUDA toolkit discovery and the JAX FFI extension, built with pybind11's setup helpers.

The only native code is the JAX frontend's XLA FFI launcher,
``transformer_engine.jax.transformer_engine_jax_ffi``, built from
``transformer_engine/jax/csrc/*.cpp`` with pybind11. It is built only when all of these hold:

- the wheel is built for jax;
- ``transformer_engine/jax/csrc`` holds ``*.cpp`` sources;
- a CUDA toolkit is found (``CUDA_HOME``/``CUDA_PATH``, ``nvcc`` on ``PATH``, or
  ``/usr/local/cuda``) with ``include/cuda.h``, and a ``libcuda`` to link the driver API against.

Otherwise the build goes on without it and prints why. Everything else is pure Python.

The extension is a :class:`pybind11.setup_helpers.Pybind11Extension` compiled by pybind11's
``build_ext`` (the supported setuptools route, which picks the C++ standard and visibility
flags); with one source file there is nothing for a parallel or incremental build to gain.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from setuptools.command.build_ext import build_ext as _setuptools_build_ext

__all__ = [
    "JAX_FFI_EXTENSION",
    "CudaToolkit",
    "find_cuda_toolkit",
    "jax_ffi_extensions",
    "build_ext_command",
]

JAX_FFI_EXTENSION = "transformer_engine.jax.transformer_engine_jax_ffi"
JAX_CSRC = Path("transformer_engine") / "jax" / "csrc"


def _note(message: str) -> None:
    print(f"[transformer_engine build] {message}", flush=True)


@dataclass(frozen=True)
class CudaToolkit:
    """Where the CUDA headers are and how to link the driver library (libcuda)."""

    home: Path
    include_dir: Path
    library_dirs: Tuple[str, ...] = ()
    libraries: Tuple[str, ...] = ()
    extra_link_args: Tuple[str, ...] = ()
    problems: Tuple[str, ...] = field(default=())  # non-empty: found, but unusable for linking

    @property
    def usable(self) -> bool:
        return not self.problems


def _cuda_home_candidates() -> List[Path]:
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    return candidates


def _system_libcuda() -> Optional[Path]:
    """A libcuda from the driver installation, via ldconfig's cache or the usual directories."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    found = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith(("libcuda.so ", "libcuda.so.1 ")) and "=>" in line:
            found.setdefault(line.split()[0], Path(line.split("=>")[-1].strip()))
    for name in ("libcuda.so", "libcuda.so.1"):
        if name in found:
            return found[name]
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib"):
        for name in ("libcuda.so", "libcuda.so.1"):
            if (Path(directory) / name).exists():
                return Path(directory) / name
    return None


def _link_libcuda(home: Path) -> Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]:
    """(library_dirs, libraries, extra_link_args) that link libcuda, or three empty tuples."""
    for pattern in ("lib64/stubs", "lib/stubs", "targets/*/lib/stubs", "lib64", "lib"):
        for directory in sorted(home.glob(pattern)):
            if (directory / "libcuda.so").exists():
                return (str(directory),), ("cuda",), ()
    system = _system_libcuda()
    if system is None:
        return (), (), ()
    if system.name == "libcuda.so":
        return (str(system.parent),), ("cuda",), ()
    return (), (), (str(system),)  # only the versioned name exists: link the file itself


def find_cuda_toolkit() -> Optional[CudaToolkit]:
    """The first CUDA installation with ``include/cuda.h``, or None."""
    for home in _cuda_home_candidates():
        include_dir = home / "include"
        if not (include_dir / "cuda.h").is_file():
            continue
        library_dirs, libraries, extra_link_args = _link_libcuda(home)
        problems = ()
        if not (libraries or extra_link_args):
            problems = (f"no libcuda.so under {home} (lib64/stubs) or from the driver (ldconfig)",)
        return CudaToolkit(home, include_dir, library_dirs, libraries, extra_link_args, problems)
    return None


def _jax_ffi_include_dir() -> str:
    """XLA's FFI headers, shipped by jaxlib (``jax.ffi.include_dir()``)."""
    code = "import jax; print(jax.ffi.include_dir())"
    try:
        import jax  # noqa: F401  (only when the extension is built)

        return str(jax.ffi.include_dir())
    except ImportError:
        pass
    # Under pip's build isolation jax is installed, but outside the isolated environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise SystemExit(
            f"error: building {JAX_FFI_EXTENSION} needs jax's FFI headers, but `import jax` fails: {last_line}"
        )
    return result.stdout.strip()


def jax_ffi_extensions(root: Path, frameworks: Sequence[str], cuda: Optional[CudaToolkit] = ...) -> list:
    """The JAX FFI extension as a list of zero or one setuptools Extension, with a note on why
    when it is skipped. ``cuda`` defaults to :func:`find_cuda_toolkit` (tests pass their own)."""
    if "jax" not in frameworks:
        return []
    root = Path(root)
    sources = sorted((root / JAX_CSRC).glob("*.cpp"))
    if not sources:
        _note(f"skipping {JAX_FFI_EXTENSION}: no sources in {JAX_CSRC}/*.cpp")
        return []
    if cuda is ...:
        cuda = find_cuda_toolkit()
    if cuda is None:
        _note(
            f"skipping {JAX_FFI_EXTENSION}: no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH; "
            "include/cuda.h must exist)"
        )
        return []
    if not cuda.usable:
        _note(f"skipping {JAX_FFI_EXTENSION}: CUDA at {cuda.home} cannot link the driver API: {'; '.join(cuda.problems)}")
        return []
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        raise SystemExit(
            f"error: {JAX_FFI_EXTENSION} has sources and CUDA is at {cuda.home}, but pybind11 is not "
            "installed: `pip install pybind11` (or build with isolation, which installs it)"
        ) from None
    extension = Pybind11Extension(
        JAX_FFI_EXTENSION,
        [source.relative_to(root).as_posix() for source in sources],
        include_dirs=[_jax_ffi_include_dir(), str(cuda.include_dir), str(root / JAX_CSRC)],
        library_dirs=list(cuda.library_dirs),
        libraries=list(cuda.libraries),
        extra_link_args=list(cuda.extra_link_args),
        extra_compile_args=["-O3"],
        cxx_std=17,
    )
    _note(f"building {JAX_FFI_EXTENSION} from {len(sources)} source(s) against CUDA at {cuda.home}")
    return [extension]


def build_ext_command() -> type:
    """pybind11's ``build_ext`` when pybind11 is installed, else setuptools' own (then no
    extension is declared that needs pybind11: :func:`jax_ffi_extensions` stops with a message first)."""
    try:
        from pybind11.setup_helpers import build_ext
    except ImportError:
        return _setuptools_build_ext
    return build_ext
