"""The build: NVTE_FRAMEWORK resolution, package lists, requirements, the optional JAX FFI
extension, and real wheels built from a copy of the source tree."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # build_tools/ is not installed

from build_tools import frameworks, metadata, native  # noqa: E402
from build_tools.commands import LEFT_OUT_MARKER  # noqa: E402
from build_tools.frameworks import FrameworkError, parse_framework_request, resolve_frameworks  # noqa: E402
from build_tools.version import te_version  # noqa: E402

BOTH = ("pytorch", "jax")


# --- NVTE_FRAMEWORK ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("", None),
        ("  ", None),
        ("pytorch", ("pytorch",)),
        ("torch", ("pytorch",)),
        ("JAX", ("jax",)),
        ("all", BOTH),
        ("none", ()),
        ("jax,pytorch", BOTH),  # canonical order
        ("pytorch, jax,pytorch", BOTH),  # duplicates collapse
        ("all,jax", BOTH),
    ],
)
def test_parse_framework_request(value, expected):
    assert parse_framework_request(value) == expected


@pytest.mark.parametrize("value", ["tensorflow", "pytorch,mxnet", "none,jax"])
def test_malformed_framework_request(value):
    with pytest.raises(FrameworkError, match="NVTE_FRAMEWORK"):
        parse_framework_request(value)


@pytest.mark.parametrize(
    "value, installed, expected",
    [
        (None, BOTH, BOTH),
        (None, ("jax",), ("jax",)),
        (None, (), ()),
        ("pytorch", BOTH, ("pytorch",)),
        ("jax", ("jax",), ("jax",)),
        ("all", BOTH, BOTH),
        ("none", (), ()),
    ],
)
def test_resolve_frameworks(value, installed, expected):
    chosen, note = resolve_frameworks(value, installed)
    assert chosen == expected
    assert "building common" in note


@pytest.mark.parametrize("value, installed, missing", [("pytorch", ("jax",), "pytorch"), ("all", ("pytorch",), "jax"), ("jax", (), "jax")])
def test_requesting_an_uninstalled_framework_fails_clearly(value, installed, missing):
    with pytest.raises(FrameworkError) as info:
        resolve_frameworks(value, installed)
    message = str(info.value)
    assert f"NVTE_FRAMEWORK={value!r}" in message
    assert f"build for {missing}, which is not installed" in message
    assert "pip install" in message


def test_installed_frameworks_uses_the_probe():
    assert frameworks.installed_frameworks(lambda module: module == "jax") == ("jax",)
    assert frameworks.installed_frameworks(lambda module: True) == BOTH


def test_build_reads_nvte_framework_through_settings(monkeypatch):
    settings = frameworks.load_settings(ROOT)
    monkeypatch.setenv("NVTE_FRAMEWORK", "jax")
    assert settings.get("NVTE_FRAMEWORK") == "jax"
    assert "NVTE_FRAMEWORK" in settings.VARIABLES


# --- version, packages, requirements ----------------------------------------------------------

def test_version_matches_the_package():
    import transformer_engine

    assert te_version(ROOT) == transformer_engine.__version__


@pytest.mark.parametrize("chosen", [(), ("pytorch",), ("jax",), BOTH])
def test_packages_follow_frameworks(chosen):
    packages = metadata.packages_for(ROOT, chosen)
    assert "transformer_engine" in packages and "transformer_engine.common" in packages
    for name in BOTH:
        has_frontend = any(p == f"transformer_engine.{name}" or p.startswith(f"transformer_engine.{name}.") for p in packages)
        frontend_exists = (ROOT / "transformer_engine" / name / "__init__.py").exists()
        assert has_frontend == (name in chosen and frontend_exists), (name, packages)


def test_every_source_directory_is_a_package():
    """find_packages skips a directory without __init__.py, and the wheel would silently lack it."""
    missing = sorted(
        str(d.relative_to(ROOT))
        for d in {p.parent for p in (ROOT / "transformer_engine").rglob("*.py")}
        if "__pycache__" not in d.parts and not (d / "__init__.py").exists()
    )
    assert not missing, f"directories with Python files but no __init__.py: {missing}"


def test_requirements_follow_frameworks():
    assert metadata.install_requires_for(()) == metadata.COMMON_REQUIRES
    assert any(r.startswith("triton==3.6") for r in metadata.COMMON_REQUIRES)
    assert any(r.startswith("torch") for r in metadata.install_requires_for(("pytorch",)))
    jax_requires = metadata.install_requires_for(("jax",))
    assert any(r.startswith("jax") for r in jax_requires) and not any(r.startswith("torch") for r in jax_requires)
    assert set(metadata.EXTRAS) >= {"pytorch", "jax", "test", "docs", "flash"}


# --- the JAX FFI extension --------------------------------------------------------------------

def _fake_cuda(tmp_path: Path, with_libcuda: bool = True) -> Path:
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda.h").write_text(
        '#pragma once\n#ifdef __cplusplus\nextern "C" {\n#endif\nint cuInit(unsigned int flags);\n'
        "#ifdef __cplusplus\n}\n#endif\n"
    )
    if with_libcuda:
        stubs = home / "lib64" / "stubs"
        stubs.mkdir(parents=True)
        (tmp_path / "stub.c").write_text("int cuInit(unsigned int flags) { return (int)flags; }\n")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(tmp_path / "stub.c"), "-o", str(stubs / "libcuda.so")],
            check=True,
        )
    return home


def test_extension_skipped_without_jax(tmp_path, capsys):
    assert native.jax_ffi_extensions(tmp_path, ("pytorch",)) == []


def test_extension_skipped_without_sources(tmp_path, capsys):
    assert native.jax_ffi_extensions(tmp_path, ("jax",)) == []
    assert "no sources" in capsys.readouterr().out


def test_extension_skipped_without_cuda(tmp_path, capsys):
    csrc = tmp_path / "transformer_engine" / "jax" / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "ffi.cpp").write_text("// launcher\n")
    assert native.jax_ffi_extensions(tmp_path, ("jax",), cuda=None) == []
    assert "no CUDA toolkit found" in capsys.readouterr().out
    unusable = native.CudaToolkit(tmp_path, tmp_path, problems=("no libcuda.so",))
    assert native.jax_ffi_extensions(tmp_path, ("jax",), cuda=unusable) == []
    assert "cannot link the driver API" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to make a stub libcuda")
def test_find_cuda_toolkit_from_cuda_home(tmp_path, monkeypatch):
    home = _fake_cuda(tmp_path)
    monkeypatch.setenv("CUDA_HOME", str(home))
    cuda = native.find_cuda_toolkit()
    assert cuda is not None and cuda.usable
    assert cuda.home == home and cuda.include_dir == home / "include"
    assert cuda.libraries == ("cuda",) and cuda.library_dirs == (str(home / "lib64" / "stubs"),)


def test_find_cuda_toolkit_reports_missing_libcuda(tmp_path, monkeypatch):
    home = _fake_cuda(tmp_path, with_libcuda=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(native, "_system_libcuda", lambda: None)
    cuda = native.find_cuda_toolkit()
    assert cuda is not None and cuda.home == home and not cuda.usable


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_extension_declared_with_cuda_and_sources(tmp_path, monkeypatch):
    pytest.importorskip("pybind11")
    pytest.importorskip("jax")
    home = _fake_cuda(tmp_path)
    monkeypatch.setenv("CUDA_HOME", str(home))
    csrc = tmp_path / "src" / "transformer_engine" / "jax" / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "b.cpp").write_text("")
    (csrc / "a.cpp").write_text("")
    (ext,) = native.jax_ffi_extensions(tmp_path / "src", ("jax",))
    assert ext.name == "transformer_engine.jax.transformer_engine_jax_ffi"
    assert ext.sources == ["transformer_engine/jax/csrc/a.cpp", "transformer_engine/jax/csrc/b.cpp"]
    assert str(home / "include") in ext.include_dirs
    assert ext.libraries == ["cuda"]


# --- real wheels from a copy of the tree ------------------------------------------------------

_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "_build", ".pytest_cache", "*.so", ".venv", ".whl")


def _source_copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_IGNORE, symlinks=True)
    return src


def _pip_wheel(src: Path, out: Path, framework: str, env=None) -> Path:
    env = dict(os.environ if env is None else env)
    env["NVTE_FRAMEWORK"] = framework
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "-w", str(out), "--no-deps", "--no-build-isolation", "-v"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, f"pip wheel failed for NVTE_FRAMEWORK={framework}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    (wheel,) = out.glob("*.whl")
    return wheel


def _wheel_packages(wheel: Path) -> set:
    """Packages in the wheel, without the placeholders written for frontends left out."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name.rsplit("/", 1)[0].replace("/", ".")
            for name in archive.namelist()
            if name.endswith("__init__.py") and LEFT_OUT_MARKER not in archive.read(name).decode()
        }


def _requires(wheel: Path) -> list:
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]


@pytest.mark.slow
def test_wheels_per_framework_install_and_import(tmp_path):
    src = _source_copy(tmp_path)
    installed = frameworks.installed_frameworks()
    for framework in ("none", "pytorch", "jax", "all"):
        chosen = parse_framework_request(framework)
        if set(chosen) - set(installed):
            continue
        wheel = _pip_wheel(src, tmp_path / f"wheel-{framework}", framework)
        packages = _wheel_packages(wheel)
        assert {"transformer_engine", "transformer_engine.common", "transformer_engine.common.attention"} <= packages
        for name in BOTH:
            wanted = name in chosen and (src / "transformer_engine" / name / "__init__.py").exists()
            assert (f"transformer_engine.{name}" in packages) == wanted, (framework, sorted(packages))
        requires = _requires(wheel)
        assert any(r.startswith("torch") for r in requires) == ("pytorch" in chosen), requires
        assert any(r.startswith("jax") for r in requires) == ("jax" in chosen), requires

        target = tmp_path / f"site-{framework}"
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True)
        probe = "import transformer_engine, transformer_engine.common.attention as a; print(transformer_engine.__file__)"
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(target)})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().startswith(str(target)), result.stdout
        for name in set(BOTH) - set(chosen):  # a frontend left out says how to build for it
            result = subprocess.run(
                [sys.executable, "-c", f"import transformer_engine.{name}"],
                capture_output=True, text=True, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(target)},
            )
            assert result.returncode != 0
            assert LEFT_OUT_MARKER in result.stderr and f"NVTE_FRAMEWORK={name} pip install" in result.stderr, result.stderr


@pytest.mark.slow
def test_wheel_build_fails_for_unknown_framework(tmp_path):
    src = _source_copy(tmp_path)
    env = dict(os.environ, NVTE_FRAMEWORK="tensorflow")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "-w", str(tmp_path / "w"), "--no-deps", "--no-build-isolation"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode != 0
    assert "NVTE_FRAMEWORK must be one of pytorch, jax, all, none" in result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None, reason="needs gcc and g++")
def test_jax_extension_builds_with_ninja_against_cuda(tmp_path):
    """The whole native route on a stub CUDA: pybind11 + XLA FFI headers + cuda.h, compiled by
    ninja, linked to libcuda, packaged in a platform wheel."""
    pytest.importorskip("pybind11")
    pytest.importorskip("jax")
    if importlib.util.find_spec("ninja") is None and shutil.which("ninja") is None:
        pytest.skip("needs ninja")
    home = _fake_cuda(tmp_path)
    src = _source_copy(tmp_path)
    csrc = src / "transformer_engine" / "jax" / "csrc"
    shutil.rmtree(csrc, ignore_errors=True)
    csrc.mkdir(parents=True)
    (csrc / "probe.cpp").write_text(
        "#include <cuda.h>\n#include <pybind11/pybind11.h>\n#include \"xla/ffi/api/ffi.h\"\n"
        "static int init() { return cuInit(7); }\n"
        "PYBIND11_MODULE(transformer_engine_jax_ffi, m) { m.def(\"init\", &init); }\n"
    )
    wheel = _pip_wheel(src, tmp_path / "wheel", "jax", env=dict(os.environ, CUDA_HOME=str(home)))
    assert re.search(r"-cp\d+-cp\d+-linux_", wheel.name), wheel.name  # a platform wheel now
    with zipfile.ZipFile(wheel) as archive:
        (so,) = [n for n in archive.namelist() if n.endswith(".so")]
    assert so.startswith("transformer_engine/jax/transformer_engine_jax_ffi")
    assert list(src.glob("build/temp*/build.ninja")), "ninja did not drive the compile"
    (built,) = src.glob("build/lib*/transformer_engine/jax/transformer_engine_jax_ffi*.so")
    (home / "lib64" / "stubs" / "libcuda.so.1").symlink_to("libcuda.so")
    probe = "import importlib; print(importlib.import_module('transformer_engine.jax.transformer_engine_jax_ffi').init())"
    env = dict(os.environ, LD_LIBRARY_PATH=str(home / "lib64" / "stubs"), PYTHONPATH=str(built.parents[2]))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert result.returncode == 0 and result.stdout.strip() == "7", result.stdout + result.stderr


# --- README and CI agree ----------------------------------------------------------------------

def _readme_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
    assert block, "README.md has no code block with the two commands"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_readme_has_exactly_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert "determinism_check" in commands[0]
    assert "qa/" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _readme_commands()[1] in ci.splitlines(), ".ci/run must run the README's test command verbatim"
    assert os.access(ROOT / ".ci" / "run", os.X_OK), ".ci/run must be executable"
