#!/usr/bin/env bash
# L0 (CPU): PyTorch frontend tests; the Triton kernels run under Triton's interpreter.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

qa_pytest_files pytorch "tests/pytorch/test_*.py" TRITON_INTERPRET=1

qa_finish
