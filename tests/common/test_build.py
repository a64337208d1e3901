"""The build: the distribution's name and license, NVTE_FRAMEWORK resolution, package lists,
requirements, the optional JAX FFI extension, and real wheels built from a copy of the source tree."""

from __future__ import annotations

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
    assert "both frontends ship" in note
    assert ("JAX FFI extension" in note) == ("jax" in expected), note


@pytest.mark.parametrize("value, installed, missing", [("pytorch", ("jax",), "pytorch"), ("all", ("pytorch",), "jax"), ("jax", (), "jax")])
def test_a_framework_not_yet_installed_is_noted_not_fatal(value, installed, missing):
    """`pip install ".[pytorch]"` builds the wheel before it installs torch: that must work."""
    chosen, note = resolve_frameworks(value, installed)
    assert missing in chosen
    assert f"not installed in this Python yet: {missing}" in note, note


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

    assert te_version(ROOT) == transformer_engine.package_version
    assert transformer_engine.__version__ == f"{transformer_engine.te_api_level}+da{transformer_engine.package_version}"


def test_every_frontend_is_packaged():
    packages = metadata.packages(ROOT)
    assert {"transformer_engine", "transformer_engine.common", "transformer_engine.pytorch", "transformer_engine.jax",
            "transformer_engine.jax.flax"} <= set(packages), packages


def test_distribution_name_cannot_be_confused_with_nvidias():
    from packaging.utils import canonicalize_name

    ours = canonicalize_name(metadata.DISTRIBUTION_NAME)
    assert ours not in {canonicalize_name(n) for n in metadata.NVIDIA_DISTRIBUTIONS}
    assert not ours.startswith("transformer-engine"), ours
    assert "transformer_engine" in metadata.packages(ROOT)  # the import name stays


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert 'license="Apache-2.0"' in (ROOT / "setup.py").read_text(encoding="utf-8")


def test_every_source_directory_is_a_package():
    """find_packages skips a directory without __init__.py, and the wheel would silently lack it."""
    missing = sorted(
        str(d.relative_to(ROOT))
        for d in {p.parent for p in (ROOT / "transformer_engine").rglob("*.py")}
        if "__pycache__" not in d.parts and not (d / "__init__.py").exists()
    )
    assert not missing, f"directories with Python files but no __init__.py: {missing}"


def test_requirements_declare_numpy_and_leave_frameworks_to_extras():
    requires = metadata.install_requires()
    assert any(r.startswith("numpy") for r in requires), "numpy is imported, so it must be declared"
    (triton,) = [r for r in requires if r.startswith("triton")]
    assert triton.startswith("triton>=3.6;"), "no upper bound: torch's CUDA builds pin their own Triton"
    assert not any(r.startswith(("torch", "jax", "flax")) for r in requires), requires
    assert set(metadata.EXTRAS) >= {"pytorch", "jax", "all", "test", "docs", "flash", "hf"}
    assert set(metadata.EXTRAS["all"]) == set(metadata.EXTRAS["pytorch"]) | set(metadata.EXTRAS["jax"])


def test_framework_bounds_admit_every_supported_release():
    from packaging.requirements import Requirement

    (torch_req,) = [Requirement(r) for r in metadata.EXTRAS["pytorch"] if r.startswith("torch")]
    for release in metadata.CUDA_TORCH_TRITON:
        assert torch_req.specifier.contains(f"{release}.0"), (release, str(torch_req))
    assert not torch_req.specifier.contains("2.9.1")
    (triton_req,) = [Requirement(r) for r in metadata.COMMON_REQUIRES if r.startswith("triton")]
    for release in metadata.SUPPORTED_TRITON:
        assert triton_req.specifier.contains(f"{release}.0"), (release, str(triton_req))
    (jax_req,) = [Requirement(r) for r in metadata.EXTRAS["jax"] if r.startswith("jax")]
    assert all(jax_req.specifier.contains(v) for v in ("0.10.2", "0.11.2", "0.12.0.1")), str(jax_req)


def _pins(name: str) -> dict:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key = re.split(r"[<>=!~ ;\[]", line, maxsplit=1)[0].lower()
            pins[key] = line
    return pins


def test_requirements_files_name_combinations_that_exist():
    """requirements/pytorch.txt pins a torch with the Triton its CUDA build pins (a CPU build takes any);
    jax.txt agrees with the oldest test environment; test-newest.txt pairs the newest torch with its Triton."""
    pins, test_pins = _pins("pytorch.txt"), _pins("test.txt")
    for name in ("torch", "numpy", "setuptools", "wheel"):
        assert pins[name] == test_pins[name], ("pytorch.txt", pins[name], test_pins[name])
    for flavour in ("pytorch.txt", "test-newest.txt"):
        pins = _pins(flavour)
        torch_minor = ".".join(pins["torch"].split("==")[1].split(".")[:2])
        triton = pins["triton"].split("==")[1]
        assert triton.startswith(metadata.CUDA_TORCH_TRITON[torch_minor] + "."), (flavour, pins["torch"], triton)
    jax_pins = _pins("jax.txt")
    for name in ("jax", "jaxlib", "flax", "triton", "numpy", "setuptools", "wheel"):
        assert jax_pins[name] == test_pins[name], ("jax.txt", jax_pins[name], test_pins[name])
    oldest = test_pins["triton"].split("==")[1]
    assert oldest.startswith(metadata.SUPPORTED_TRITON[0] + "."), oldest
    assert _pins("test-newest.txt")["triton"].split("==")[1].startswith(metadata.SUPPORTED_TRITON[-1] + ".")


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

# Not the tree's: builds, caches, and the environments and wheels the QA levels make in it (.venv-newest is made by
# qa/L0_newest, which CI may run while this copies).
_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "_build", ".pytest_cache", "*.so",
                                 ".venv*", ".whl", ".kernel_cache")


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
    """Packages in the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        return {name.rsplit("/", 1)[0].replace("/", ".") for name in archive.namelist() if name.endswith("__init__.py")}


def _requires(wheel: Path) -> list:
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]


def _wheel_files(wheel: Path) -> dict:
    """Name -> bytes of every file but the dist-info RECORD (which holds the same hashes)."""
    with zipfile.ZipFile(wheel) as archive:
        return {n: archive.read(n) for n in archive.namelist() if not n.endswith(".dist-info/RECORD")}


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()


@pytest.mark.slow
def test_one_pure_wheel_for_every_flavour_installs_and_imports(tmp_path):
    """Without a CUDA toolkit every NVTE_FRAMEWORK gives the same py3-none-any wheel: both
    frontends, numpy and triton required, the frameworks as extras, the LICENSE inside."""
    src = _source_copy(tmp_path)
    wheels = {framework: _pip_wheel(src, tmp_path / f"wheel-{framework}", framework, env=_without_cuda())
              for framework in ("none", "pytorch", "all")}
    names = {w.name for w in wheels.values()}
    assert names == {f"deterministic_attention-{te_version(ROOT)}-py3-none-any.whl"}, names
    files = {framework: _wheel_files(w) for framework, w in wheels.items()}
    assert files["none"] == files["pytorch"] == files["all"], "the flavours' wheels differ in content"
    wheel = wheels["all"]
    packages = _wheel_packages(wheel)
    assert {"transformer_engine", "transformer_engine.common.attention", "transformer_engine.pytorch",
            "transformer_engine.jax", "transformer_engine.jax.flax"} <= packages, sorted(packages)
    requires = _requires(wheel)
    assert any(r.startswith("numpy") for r in requires) and any(r.startswith("triton") for r in requires), requires
    assert not any(r.startswith(("torch", "jax", "flax")) for r in requires), requires
    text = _metadata(wheel)
    assert "Name: deterministic-attention" in text
    assert "Provides-Extra: pytorch" in text and "Provides-Extra: jax" in text
    assert any(n.endswith("LICENSE") and ".dist-info/" in n for n in files["all"]), "LICENSE is not in the wheel"

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True)
    installed = frameworks.installed_frameworks()
    probe = "import transformer_engine, transformer_engine.common.attention as a; print(transformer_engine.__file__)"
    probe += "".join(f"; import transformer_engine.{name}" for name in installed)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(tmp_path),
                            env={**os.environ, "PYTHONPATH": str(target)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target)), result.stdout


def _without_cuda() -> dict:
    """The environment with no CUDA toolkit to find (the pure-wheel case, on any machine)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "nvcc").exists())
    return env


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
def test_jax_extension_builds_with_pybind11_against_cuda(tmp_path):
    """The whole native route on a stub CUDA: pybind11 + XLA FFI headers + cuda.h, compiled by
    pybind11's build_ext, linked to libcuda, packaged in a platform wheel."""
    pytest.importorskip("pybind11")
    pytest.importorskip("jax")
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
    assert wheel.name.startswith("deterministic_attention-"), wheel.name
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


JAX_RECIPE = ('pip install -r requirements/jax.txt && NVTE_FRAMEWORK=jax pip install --no-build-isolation ".[jax]" '
              "&& python -m transformer_engine.jax.determinism_check")


def test_install_recipes_agree():
    """One JAX install recipe, word for word, in README, requirements/jax.txt and docs/installation.rst; the
    PyTorch one there is README's command 1."""
    for path in ("README.md", "requirements/jax.txt", "docs/installation.rst"):
        assert JAX_RECIPE in (ROOT / path).read_text(encoding="utf-8"), f"{path} must give the JAX recipe {JAX_RECIPE!r}"
    assert _readme_commands()[0] in (ROOT / "docs" / "installation.rst").read_text(encoding="utf-8")


def test_no_install_line_fetches_the_package_from_an_index():
    """The package is on no package index: every ``pip install`` the README, docs and examples give installs it
    from the checkout (``"."``, ``".[jax]"``, ``-e .``), never by its distribution name."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.rst")), *sorted((ROOT / "examples").rglob("*.py")),
             *sorted((ROOT / "requirements").glob("*.txt"))]
    bad = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in files
           for line in path.read_text(encoding="utf-8").splitlines()
           if re.search(r"pip install\b.*deterministic[-_]attention", line)]
    assert not bad, bad


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _readme_commands()[1] in ci.splitlines(), ".ci/run must run the README's test command verbatim"
    assert os.access(ROOT / ".ci" / "run", os.X_OK), ".ci/run must be executable"
