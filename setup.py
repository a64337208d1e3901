"""Build Transformer Engine (deterministic fused attention edition).

NVTE_FRAMEWORK picks the frontends that go into the wheel: ``pytorch``, ``jax``, ``all``,
``none`` (common only), a comma list, or unset (whatever is installed). The logic lives in
build_tools/; this file only assembles it. See docs/installation.rst.
"""

import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # build_tools/ is not installed; setuptools' backend may not add it

from build_tools.commands import FreshBuildPy  # noqa: E402
from build_tools.frameworks import FrameworkError, frameworks_to_build  # noqa: E402
from build_tools.metadata import EXTRAS, install_requires_for, packages_for  # noqa: E402
from build_tools.native import NinjaBuildExt, jax_ffi_extensions  # noqa: E402
from build_tools.version import te_version  # noqa: E402

try:
    FRAMEWORKS = frameworks_to_build(ROOT)
except FrameworkError as err:
    sys.exit(f"error: {err}")
FreshBuildPy.frameworks = FRAMEWORKS

setup(
    name="transformer_engine",
    version=te_version(ROOT),
    description="Transformer Engine-style attention for PyTorch and JAX with deterministic fused Triton kernels",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=packages_for(ROOT, FRAMEWORKS),
    install_requires=install_requires_for(FRAMEWORKS),
    extras_require=EXTRAS,
    ext_modules=jax_ffi_extensions(ROOT, FRAMEWORKS),
    cmdclass={"build_py": FreshBuildPy, "build_ext": NinjaBuildExt},
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
