#!/usr/bin/env bash
# L1 (GPU): every planned kernel variant at small shapes under compute-sanitizer's memcheck
# (tests/pytorch/memcheck_kernels.py): out-of-bounds and misaligned accesses fail the level. Only the
# attention kernels are instrumented (torch's own are not ours, and slow the run down).
# Without compute-sanitizer on the machine the level fails and says so. MEMCHECK_DIMS (e.g. "128/128 192/128")
# checks only those head dims' kernels.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
if [ ! -x "$SANITIZER" ]; then
  qa_fail memcheck "compute-sanitizer not found (set COMPUTE_SANITIZER)"
else
  qa_run memcheck env TRITON_INTERPRET=0 "$SANITIZER" --tool memcheck --error-exitcode 1 --kernel-name kns=attn_ \
    "$PYTHON" tests/pytorch/memcheck_kernels.py ${MEMCHECK_DIMS:-}
fi

qa_finish
