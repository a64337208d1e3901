"""What the distribution is called, what it contains and what it declares.

One wheel serves every framework: the frontends (``transformer_engine.pytorch``,
``transformer_engine.jax``) are pure Python and always shipped; each raises an ImportError that
names the missing framework when it is imported without it. The frameworks themselves are
extras (``pip install "deterministic-attention[pytorch]"``). ``NVTE_FRAMEWORK`` governs only the
native JAX FFI extension (build_tools/native.py): a wheel that carries it is a platform wheel
(``...-cp312-cp312-linux_x86_64.whl``), every other build is the same ``py3-none-any`` wheel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from setuptools import find_packages

__all__ = [
    "DISTRIBUTION_NAME",
    "NVIDIA_DISTRIBUTIONS",
    "SUPPORTED_TRITON",
    "CUDA_TORCH_TRITON",
    "COMMON_REQUIRES",
    "FRAMEWORK_REQUIRES",
    "EXTRAS",
    "packages",
    "install_requires",
]

#: The name pip knows the project by. The import name stays ``transformer_engine``; the
#: distribution name differs from every one NVIDIA publishes (below), so that ``pip install -U``
#: never swaps one for the other.
DISTRIBUTION_NAME = "deterministic-attention"

#: NVIDIA's distributions that install the same ``transformer_engine`` import package.
NVIDIA_DISTRIBUTIONS = (
    "transformer-engine",
    "transformer-engine-cu12",
    "transformer-engine-cu13",
    "transformer-engine-torch",
    "transformer-engine-jax",
)

#: Triton releases the kernels are tested with: the ones CUDA builds of torch 2.10-2.15 pin (see
#: CUDA_TORCH_TRITON). CI compiles every planned launch and runs the interpreter suites with the
#: oldest and the newest; the GPU runs are listed in docs/installation.rst. Where a release lacks
#: an API the Hopper Gluon kernels use, the plan falls back to the Triton kernels with a reason
#: (transformer_engine/common/attention/kernels/triton_compat.py).
SUPPORTED_TRITON = ("3.6", "3.7", "3.8", "3.9")

#: The Triton release each CUDA build of torch pins (``torch==X`` requires ``triton==Y.*``); the CPU
#: builds declare no Triton. tests/common/test_wheel_resolution.py resolves our wheel with each.
CUDA_TORCH_TRITON: Dict[str, str] = {
    "2.10": "3.6", "2.11": "3.6", "2.12": "3.7", "2.13": "3.7", "2.14": "3.8", "2.15": "3.9",
}

# The fused kernels are Triton programs. Triton has no upper bound: torch's CUDA builds pin their
# own release, and a bound here would make pip downgrade the user's torch to one that accepts it
# (or refuse to install) instead of installing beside it; a release newer than SUPPORTED_TRITON
# runs what its API allows (the Gluon kernels fall back with a reason). numpy is imported by the
# determinism check and the JAX frontend. Triton 3.6's interpreter (CPU testing only) needs
# numpy < 2.4: that bound is in the ``test`` extra, not here.
COMMON_REQUIRES: List[str] = ["numpy>=1.24", "triton>=3.6; platform_system == 'Linux'"]

FRAMEWORK_REQUIRES: Dict[str, List[str]] = {
    # Every release from 2.10 on: each CUDA build brings the Triton it pins, all within triton>=3.6.
    "pytorch": ["torch>=2.10"],
    # The releases the JAX suites run on in CI (0.10 on Python 3.11, 0.12 on 3.12).
    "jax": ["jax>=0.10", "flax>=0.12"],
}

EXTRAS: Dict[str, List[str]] = {
    "pytorch": FRAMEWORK_REQUIRES["pytorch"],
    "jax": FRAMEWORK_REQUIRES["jax"],
    "all": FRAMEWORK_REQUIRES["pytorch"] + FRAMEWORK_REQUIRES["jax"],
    # numpy < 2.4: Triton 3.6's interpreter breaks on numpy 2.4 (range() over tensors).
    "test": ["pytest>=7", "numpy<2.4"],
    "docs": ["sphinx>=7", "furo"],
    "hf": ["transformers>=4.56"],
    # flash-attn-4 is published as pre-releases; the bound lets pip take them.
    "flash": ["flash-attn-4>=4.0.0b1"],
}


def packages(root: Path) -> List[str]:
    """Every package under ``transformer_engine``: both frontends, whatever is installed."""
    return sorted(find_packages(where=str(root), include=["transformer_engine", "transformer_engine.*"]))


def install_requires() -> List[str]:
    """What every installation needs; frameworks come with the extras."""
    return list(COMMON_REQUIRES)
