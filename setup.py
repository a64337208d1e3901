"""Build the ``deterministic-attention`` distribution (import name ``transformer_engine``).

Both frontends are pure Python and always in the wheel; the frameworks are extras
(``pip install ".[pytorch]"``, ``".[jax]"``, ``".[all]"``). NVTE_FRAMEWORK (``pytorch``, ``jax``,
``all``, ``none``, a comma list, or unset for whatever is installed) decides only whether the
native JAX FFI extension is built. The logic lives in build_tools/; this file only assembles it.
See docs/installation.rst.
"""

import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # build_tools/ is not installed; setuptools' backend may not add it

from build_tools.commands import FreshBuildPy  # noqa: E402
from build_tools.frameworks import FrameworkError, frameworks_to_build  # noqa: E402
from build_tools.metadata import DISTRIBUTION_NAME, EXTRAS, install_requires, packages  # noqa: E402
from build_tools.native import build_ext_command, jax_ffi_extensions  # noqa: E402
from build_tools.version import te_version  # noqa: E402

try:
    FRAMEWORKS = frameworks_to_build(ROOT)
except FrameworkError as err:
    sys.exit(f"error: {err}")

setup(
    name=DISTRIBUTION_NAME,
    version=te_version(ROOT),
    description="Deterministic fused attention for PyTorch and JAX (Triton kernels) behind TransformerEngine-style APIs",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.11",
    packages=packages(ROOT),
    install_requires=install_requires(),
    extras_require=EXTRAS,
    ext_modules=jax_ffi_extensions(ROOT, FRAMEWORKS),
    cmdclass={"build_py": FreshBuildPy, "build_ext": build_ext_command()},
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
