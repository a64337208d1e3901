"""Native extensions: CUDA toolkit discovery, the JAX FFI extension, and a ninja-driven build_ext.

The only native code is the JAX frontend's XLA FFI launcher,
``transformer_engine.jax.transformer_engine_jax_ffi``, built from
``transformer_engine/jax/csrc/*.cpp`` with pybind11. It is built only when all of these hold:

- the wheel is built for jax;
- ``transformer_engine/jax/csrc`` holds ``*.cpp`` sources;
- a CUDA toolkit is found (``CUDA_HOME``/``CUDA_PATH``, ``nvcc`` on ``PATH``, or
  ``/usr/local/cuda``) with ``include/cuda.h``, and a ``libcuda`` to link the driver API against.

Otherwise the build goes on without it and prints why. Everything else is pure Python.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from setuptools.command.build_ext import build_ext

__all__ = [
    "JAX_FFI_EXTENSION",
    "CudaToolkit",
    "find_cuda_toolkit",
    "jax_ffi_extensions",
    "NinjaBuildExt",
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
            "installed: `pip install pybind11 ninja` (or build with isolation, which installs them)"
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


def _ninja_path(text: str) -> str:
    """Escape a path for a ninja build line."""
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _find_ninja() -> Optional[str]:
    try:
        import ninja  # the PyPI package ships the binary

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.exists():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    return shutil.which("ninja")


class NinjaBuildExt(build_ext):
    """``build_ext`` that compiles each extension's sources with one ninja invocation (parallel,
    incremental, with header dependencies), then links as setuptools does. Falls back to
    setuptools' own compile loop when ninja is missing or the compiler is not Unix-like."""

    def build_extensions(self):
        ninja = _find_ninja()
        if ninja is None:
            _note("ninja not found; compiling with setuptools (serial). `pip install ninja` to speed this up")
        elif self.compiler.compiler_type != "unix" or sys.platform == "darwin":
            _note(f"compiler {self.compiler.compiler_type!r}: compiling with setuptools, not ninja")
        else:
            self.compiler.compile = self._make_ninja_compile(ninja)
        super().build_extensions()

    def _make_ninja_compile(self, ninja: str):
        compiler = self.compiler
        jobs = max(1, os.cpu_count() or 1)

        def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                    extra_preargs=None, extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs
            )
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
            cxx = getattr(compiler, "compiler_so_cxx", None) or compiler.compiler_so
            build_dir = Path(output_dir or self.build_temp).resolve()
            build_dir.mkdir(parents=True, exist_ok=True)
            lines = ["ninja_required_version = 1.3", ""]
            for index, tool in enumerate((compiler.compiler_so, cxx)):
                flags = " ".join(shlex.quote(a) for a in [*tool, *cc_args]).replace("$", "$$")
                post = " ".join(shlex.quote(a) for a in extra_postargs or []).replace("$", "$$")
                lines += [
                    f"rule compile_{'cxx' if index else 'c'}",
                    f"  command = {flags} -MMD -MF $out.d $in -o $out {post}",
                    "  depfile = $out.d",
                    "  deps = gcc",
                    "  description = compiling $in",
                    "",
                ]
            for obj in objects:
                src, ext = build[obj]
                rule = "compile_cxx" if compiler.detect_language(src) == "c++" else "compile_c"
                Path(obj).parent.mkdir(parents=True, exist_ok=True)
                lines.append(
                    f"build {_ninja_path(str(Path(obj).resolve()))}: {rule} {_ninja_path(str(Path(src).resolve()))}"
                )
            ninja_file = build_dir / "build.ninja"
            ninja_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
            _note(f"compiling {len(objects)} source(s) with ninja -j {jobs} ({ninja_file})")
            result = subprocess.run([ninja, "-f", str(ninja_file), "-j", str(jobs)], cwd=str(build_dir))
            if result.returncode != 0:
                from setuptools.errors import CompileError

                raise CompileError(f"ninja failed (exit {result.returncode}); see the compiler output above")
            return objects

        return compile
