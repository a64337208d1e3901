"""The wheel installs beside every supported CUDA torch release and current JAX, as pip resolves it.

One wheel is built from this tree and handed to ``pip install --dry-run --report`` together with
each torch release of ``CUDA_TORCH_TRITON`` (build_tools/metadata.py), resolved from the package
index as a user on a Linux GPU machine would (``--ignore-installed``: what this environment holds
does not matter). Each must resolve without a conflict, keep the requested torch and take the
Triton that torch's CUDA build pins. Without a pin, adding our wheel must not change which torch,
Triton, JAX or flax pip picks: the wheel never makes pip downgrade a framework.

This needs the package index and Python >= 3.12 (the newest JAX has no wheels for 3.11); it runs
in the newest test environment (qa/L0_newest) and skips elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_build's wheel helpers
from test_build import ROOT, _pip_wheel, _source_copy, _without_cuda  # noqa: E402

sys.path.insert(0, str(ROOT))
from build_tools.metadata import CUDA_TORCH_TRITON, DISTRIBUTION_NAME, SUPPORTED_TRITON  # noqa: E402
from case_grid import WIDE  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.version_info < (3, 12), reason="resolves JAX >= 0.11 and torch 2.15 wheels: needs Python >= 3.12 (qa/L0_newest)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resolves Linux wheels"),
]

FRAMEWORKS = ("torch", "triton", "jax", "jaxlib", "flax")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("resolution")
    return _pip_wheel(_source_copy(tmp), tmp / "dist", "all", _without_cuda())


def _resolve(*requirements: str, tmp: Path) -> dict:
    """What ``pip install`` would install for REQUIREMENTS from the index: {name: version}."""
    report = tmp / "report.json"
    env = dict(os.environ)
    # The index as a user sees it: no machine-wide pip configuration (constraints, local wheel
    # folders) may decide the resolution.
    env["PIP_CONFIG_FILE"] = os.devnull
    for key in ("PIP_CONSTRAINT", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
           "--only-binary=:all:", "--report", str(report), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"pip could not resolve {requirements}:\n{proc.stdout}\n{proc.stderr}"
    installed = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"] for item in installed}


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _ours(wheel: Path, extra: str) -> str:
    return f"{DISTRIBUTION_NAME}[{extra}] @ {wheel.resolve().as_uri()}"


def test_the_table_covers_the_supported_triton_releases():
    assert sorted(set(CUDA_TORCH_TRITON.values())) == list(SUPPORTED_TRITON)


def _oldest_and_newest_in_ci(releases):
    """The oldest and newest releases run in CI; those between are `wide` (qa/L1_cpu_wide)."""
    return [pytest.param(r, marks=() if i in (0, len(releases) - 1) else WIDE) for i, r in enumerate(releases)]


@pytest.mark.parametrize("torch_release", _oldest_and_newest_in_ci(
    sorted(CUDA_TORCH_TRITON, key=lambda v: tuple(map(int, v.split("."))))))
def test_wheel_resolves_beside_each_cuda_torch_release(wheel, torch_release, tmp_path):
    got = _resolve(_ours(wheel, "pytorch"), f"torch=={torch_release}.*", tmp=tmp_path)
    assert DISTRIBUTION_NAME in got, got
    assert _minor(got["torch"]) == torch_release, got
    # The Triton of torch's own pin, not one our metadata forced.
    assert _minor(got["triton"]) == CUDA_TORCH_TRITON[torch_release], got


@pytest.mark.parametrize("extra, alone", [  # "all" (both frameworks) in CI
    pytest.param("pytorch", ("torch",), marks=WIDE),
    pytest.param("jax", ("jax", "flax"), marks=WIDE),
    ("all", ("torch", "jax", "flax")),
])
def test_wheel_changes_no_framework_pip_would_pick(wheel, extra, alone, tmp_path):
    baseline = _resolve(*alone, tmp=tmp_path)
    with_us = _resolve(_ours(wheel, extra), *alone, tmp=tmp_path)
    assert DISTRIBUTION_NAME in with_us, with_us
    for name in FRAMEWORKS:
        if name in baseline:
            assert with_us.get(name) == baseline[name], (name, baseline[name], with_us.get(name))
    if "torch" in baseline:  # the newest torch pins a Triton we support
        assert _minor(with_us["triton"]) in SUPPORTED_TRITON, with_us
