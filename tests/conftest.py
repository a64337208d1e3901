"""Root pytest configuration: shared markers only (suites keep their own conftest.py)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (qa/L1_*, qa/L3_determinism)")
    config.addinivalue_line("markers", "determinism: bitwise reproducibility checks (qa/L3_determinism)")
    config.addinivalue_line("markers", "slow: builds wheels or compiles code; minutes rather than seconds")
