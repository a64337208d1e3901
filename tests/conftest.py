"""Root pytest configuration: shared markers, and case_grid importable from every suite (suites keep their own
conftest.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (qa/L1_*, qa/L3_determinism)")
    config.addinivalue_line("markers", "determinism: bitwise reproducibility checks (qa/L3_determinism)")
    config.addinivalue_line("markers", "slow: builds wheels or compiles code; minutes rather than seconds")
    config.addinivalue_line("markers", "wide: a grid case beyond its core (case_grid.grid); the L0 levels (CI) leave "
                                       "it out, qa/L1_cpu_wide runs it")
