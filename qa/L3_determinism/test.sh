#!/usr/bin/env bash
# L3 (GPU): determinism suites with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: repeated-run bitwise
# checks, batch/packing invariance, cross-framework equality, long context. It runs every test
# file named *determinism* under tests/pytorch and tests/jax.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

qa_pytest_files determinism "tests/*/test_*determinism*.py" NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 TRITON_INTERPRET=0

qa_finish
