#!/usr/bin/env bash
# L1 (GPU): the PyTorch correctness grid in the default configuration, compiled Triton kernels.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

qa_pytest_files pytorch "tests/pytorch/test_*.py" TRITON_INTERPRET=0

qa_finish
