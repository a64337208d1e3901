#!/usr/bin/env bash
# L1 (GPU): the JAX correctness grid (GPU lowering launching the Triton kernels).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

qa_pytest_files jax "tests/jax/test_*.py" TRITON_INTERPRET=0

qa_finish
