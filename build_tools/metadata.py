"""What a wheel contains and declares, as a function of the frameworks it is built for."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List

from setuptools import find_packages

__all__ = ["COMMON_REQUIRES", "FRAMEWORK_REQUIRES", "EXTRAS", "packages_for", "install_requires_for"]

# The fused kernels are Triton programs (on CPU, run by Triton's interpreter).
COMMON_REQUIRES: List[str] = ["triton==3.6.*; platform_system == 'Linux'"]

FRAMEWORK_REQUIRES: Dict[str, List[str]] = {
    "pytorch": ["torch>=2.4"],  # torch.library.custom_op
    "jax": ["jax>=0.5.0", "flax>=0.10.0"],  # public jax.ffi
}

EXTRAS: Dict[str, List[str]] = {
    "pytorch": FRAMEWORK_REQUIRES["pytorch"],
    "jax": FRAMEWORK_REQUIRES["jax"],
    # numpy < 2.4: Triton 3.6's interpreter breaks on numpy 2.4 (range() over tensors).
    "test": ["pytest>=7", "numpy<2.4"],
    "docs": ["sphinx>=7"],
    # flash-attn-4 is published as pre-releases; the bound lets pip take them.
    "flash": ["flash-attn-4>=4.0.0b1"],
}


def packages_for(root: Path, frameworks: Iterable[str]) -> List[str]:
    """``transformer_engine`` and ``transformer_engine.common*`` always; each framework's frontend
    (``transformer_engine.pytorch*``, ``transformer_engine.jax*``) only when built for it."""
    include = ["transformer_engine", "transformer_engine.common", "transformer_engine.common.*"]
    for name in frameworks:
        include += [f"transformer_engine.{name}", f"transformer_engine.{name}.*"]
    return sorted(find_packages(where=str(root), include=include))


def install_requires_for(frameworks: Iterable[str]) -> List[str]:
    requires = list(COMMON_REQUIRES)
    for name in frameworks:
        requires += FRAMEWORK_REQUIRES[name]
    return requires
