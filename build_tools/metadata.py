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

# The fused kernels are Triton programs (on CPU, run by Triton's interpreter, which also needs
# numpy < 2.4 with Triton 3.6: that bound is in the ``test`` extra, not here, so that GPU
# installations may use a newer numpy). numpy is imported by the determinism check and the JAX
# frontend.
COMMON_REQUIRES: List[str] = ["numpy>=1.24", "triton==3.6.*; platform_system == 'Linux'"]

FRAMEWORK_REQUIRES: Dict[str, List[str]] = {
    # torch 2.10, 2.11 and 2.13 accept triton 3.6; torch 2.12 requires another Triton.
    "pytorch": ["torch>=2.10,!=2.12.*"],
    "jax": ["jax>=0.5.0", "flax>=0.10.0"],  # public jax.ffi
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
