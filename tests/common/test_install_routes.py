"""Every install route, each in a fresh virtual environment, from one wheel built from this tree.

The routes are the distribution's own: ``pip install .`` (core: numpy and triton, no framework)
and the framework extras ``.[pytorch]``, ``.[jax]`` and ``.[all]``. One ``py3-none-any`` wheel
serves them all (tests/common/test_build.py checks that every NVTE_FRAMEWORK flavour builds the
same wheel), so it is built once, with ``NVTE_FRAMEWORK=all`` and no CUDA toolkit, from a copy of
the tree, by test_build's helpers.

* Core: a venv *without* system site packages gets the wheel (``--no-deps``) plus exactly the
  distributions the wheel declares (numpy, triton), linked in from this interpreter's site.
  ``import transformer_engine`` works there; each frontend, and its determinism check, fails with
  an ImportError that names the missing framework and the extra that installs it; ``pip check``
  finds nothing broken.
* Framework routes: installing torch or jax from PyPI into every venv is too heavy for CI (a
  2-core machine), so these venvs are made with ``--system-site-packages``: the frameworks come
  from the interpreter running the tests. The wheel itself is installed into the venv with
  ``pip install --no-index "<wheel>[extra]"``, so pip's resolver must satisfy the extra's
  requirements from what is present, and the package imported is the venv's copy (checked through
  ``transformer_engine.__file__`` and the distribution's location, from a temporary working
  directory and without PYTHONPATH, so neither this tree nor an editable install can stand in).
  Each venv then runs its route's determinism check on CPU at its smallest settings and must
  print PASS.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_build's wheel helpers
from test_build import _pip_wheel, _requires, _source_copy, _without_cuda  # noqa: E402

pytestmark = pytest.mark.slow

#: route -> (the extra, the frameworks whose frontends and checks it must run)
ROUTES = {
    "pytorch": ("pytorch", ("pytorch",)),
    "jax": ("jax", ("jax",)),
    "all": ("all", ("pytorch", "jax")),
}
FRAMEWORK_MODULE = {"pytorch": "torch", "jax": "jax"}
FRAMEWORK_WORD = {"pytorch": "PyTorch", "jax": "JAX"}

#: The smallest run each determinism check accepts: one step, one layer, 8 tokens, two heads.
SMALLEST_CHECK = ("--steps", "1", "--layers", "1", "--seq-len", "8", "--batch-size", "1", "--hidden-size", "16",
                  "--num-heads", "2", "--device", "cpu", "--no-reference", "--quiet")

# Runs inside a venv: where the package and its distribution were found, what it requires, and
# every distribution visible there (first on sys.path wins, as for importlib.metadata).
_PROBE = textwrap.dedent(
    """
    import importlib.metadata as md, json, sys
    import transformer_engine, transformer_engine.common
    dist = md.distribution("deterministic-attention")
    seen = {}
    for d in md.distributions():
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        seen.setdefault(name, d.version)
    print(json.dumps({
        "prefix": sys.prefix,
        "file": transformer_engine.__file__,
        "version": transformer_engine.package_version,
        "dist_location": str(dist.locate_file("")),
        "requires": dist.requires or [],
        "installed": seen,
    }))
    """
)

_TRY_IMPORT = textwrap.dedent(
    """
    import importlib, sys
    try:
        importlib.import_module(sys.argv[1])
    except ImportError as err:
        print("IMPORT-ERROR:", err)
        sys.exit(3)
    print("IMPORTED")
    """
)


def _clean_env() -> dict:
    """This environment without anything that would put another copy of the package first or
    change what the checks run (PYTHONPATH, an active venv, NVTE_* settings, Triton's interpreter)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "TRITON_INTERPRET", "XLA_FLAGS"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("NVTE_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=str(cwd), env=_clean_env(),
                          timeout=timeout)


def _venv(path: Path, system_site: bool) -> Path:
    """A fresh venv without its own pip (this interpreter's pip installs into it: ``pip --python``).

    ``system_site``: it also sees what this interpreter sees. ``--system-site-packages`` gives the
    base interpreter's site; when the tests themselves run in a venv, that venv's site is added too
    (``site.addsitedir`` from a .pth file, which processes its .pth files as a system site's are)."""
    args = [sys.executable, "-m", "venv", "--without-pip", str(path)]
    if system_site:
        args.insert(4, "--system-site-packages")
    result = _run(args, cwd=path.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    python = path / "bin" / "python"
    if system_site and sys.prefix != sys.base_prefix:
        outer = [p for p in site.getsitepackages() if Path(p).is_relative_to(sys.prefix)]
        (_site_packages(path) / "outer_site.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
    return python


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python*/site-packages"))


def _pip(python: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pip", "--python", python, *args], cwd=cwd, timeout=600)


def _probe(python: Path, cwd: Path) -> dict:
    result = _run([python, "-c", _PROBE], cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_the_venv_copy_is_imported(info: dict, venv: Path, wheel: Path):
    prefix = Path(info["prefix"]).resolve()
    assert prefix == venv.resolve(), info["prefix"]
    assert Path(info["file"]).resolve().is_relative_to(prefix), f"transformer_engine came from {info['file']}, not {venv}"
    assert Path(info["dist_location"]).resolve().is_relative_to(prefix), info["dist_location"]
    assert wheel.name.startswith(f"deterministic_attention-{info['version']}-"), (wheel.name, info["version"])


def _unresolved(info: dict, extra: str) -> list:
    """Requirements of the installed distribution (with ``extra``, or none) that what is present
    does not satisfy: the check ``pip check`` makes, for one distribution and one extra."""
    installed = {canonicalize_name(name): version for name, version in info["installed"].items()}
    problems = []
    for text in info["requires"]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        have = installed.get(canonicalize_name(req.name))
        if have is None:
            problems.append(f"{text}: not installed")
        elif not req.specifier.contains(have, prereleases=True):
            problems.append(f"{text}: {have} is installed")
    return problems


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The one wheel every route installs."""
    tmp = tmp_path_factory.mktemp("route_wheel")
    built = _pip_wheel(_source_copy(tmp), tmp / "wheel", "all", env=_without_cuda())
    assert built.name.endswith("-py3-none-any.whl"), built.name
    return built


def _link_distribution(name: str, into: Path):
    """Make distribution ``name`` (files and metadata) importable from ``into``, by symlinks to
    this interpreter's copy: the venv then has it, and nothing else from this site."""
    dist = importlib.metadata.distribution(name)
    site_dir = Path(dist.locate_file("")).resolve()
    tops = {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}
    assert tops, f"{name} lists no files"
    for top in tops:
        target = into / top
        if not target.exists():
            target.symlink_to(site_dir / top)


def test_core_route_imports_and_names_the_missing_framework(wheel, tmp_path):
    """``pip install .``: no framework. The package imports; each frontend (and its check) fails
    with an ImportError naming the framework and the extra that brings it."""
    venv = tmp_path / "core"
    python = _venv(venv, system_site=False)
    result = _pip(python, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr

    # What the wheel declares for every installation (numpy, triton), and only that.
    declared = [Requirement(r) for r in _requires(wheel)]
    site_dir = _site_packages(venv)
    deps = venv / "declared"
    deps.mkdir()
    linked = []
    for req in declared:
        if req.marker is None or req.marker.evaluate():
            _link_distribution(req.name, deps)
            linked.append(req.name)
    assert "numpy" in linked, linked
    (site_dir / "declared.pth").write_text(f"{deps}\n")

    info = _probe(python, cwd=tmp_path)
    _assert_the_venv_copy_is_imported(info, venv, wheel)
    assert not _unresolved(info, extra=""), _unresolved(info, extra="")
    present = {canonicalize_name(n) for n in info["installed"]}
    assert not present & {"torch", "jax", "jaxlib", "flax"}, f"a framework leaked into the core venv: {sorted(present)}"
    check = _pip(python, "check", cwd=tmp_path)
    assert check.returncode == 0 and "No broken requirements" in check.stdout, check.stdout + check.stderr

    for framework in ("pytorch", "jax"):
        word, hint = FRAMEWORK_WORD[framework], f"deterministic-attention[{framework}]"
        frontend = _run([python, "-c", _TRY_IMPORT, f"transformer_engine.{framework}"], cwd=tmp_path)
        assert frontend.returncode == 3, frontend.stdout + frontend.stderr
        assert word in frontend.stdout and hint in frontend.stdout, frontend.stdout
        check = _run([python, "-m", f"transformer_engine.{framework}.determinism_check", "--help"], cwd=tmp_path)
        assert check.returncode != 0, check.stdout
        assert f"transformer_engine.{framework} needs {word}, which is not installed" in check.stderr, check.stderr
        assert hint in check.stderr, check.stderr


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_framework_route_installs_and_passes_its_determinism_check(route, wheel, tmp_path):
    extra, frameworks = ROUTES[route]
    for framework in frameworks:
        if importlib.util.find_spec(FRAMEWORK_MODULE[framework]) is None:
            pytest.skip(f"{FRAMEWORK_MODULE[framework]} is not installed here, and the venv takes it from this site")
    venv = tmp_path / route
    python = _venv(venv, system_site=True)
    # --no-index: the extra's requirements must already be satisfied by what is present.
    result = _pip(python, "install", "--no-index", "-q", f"{wheel}[{extra}]", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr

    info = _probe(python, cwd=tmp_path)
    _assert_the_venv_copy_is_imported(info, venv, wheel)
    assert not _unresolved(info, extra=extra), _unresolved(info, extra=extra)

    for framework in frameworks:
        check = _run([python, "-m", f"transformer_engine.{framework}.determinism_check", *SMALLEST_CHECK],
                     cwd=tmp_path, timeout=600)
        output = check.stdout + check.stderr
        assert check.returncode == 0, f"{route}: the {framework} check failed:\n{output[-4000:]}"
        assert "RESULT: PASS" in check.stdout, output[-4000:]
