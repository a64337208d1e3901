#!/usr/bin/env bash
# L3 (GPU): determinism suites with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: repeated-run bitwise
# checks, batch/packing invariance, cross-framework equality, long context. It runs every test
# file named *determinism* under tests/pytorch and tests/jax, then the fused-kernel ones under forced plans.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

qa_pytest_files determinism "tests/*/test_*determinism*.py" NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 TRITON_INTERPRET=0

# Other architectures' plans on this GPU (NVTE_FUSED_ATTN_PLAN_ARCH: their tile tables, Triton kernels only)
# keep the same bitwise contract: the fused-kernel suites of both frameworks again under each. QA_FORCED_PLANS
# names the plans (default "sm80 gfx942"; empty: none); with QA_SELECT they run when it names those files.
for arch in ${QA_FORCED_PLANS-sm80 gfx942}; do
  for file in tests/pytorch/test_fused_attn_determinism.py tests/jax/test_jax_determinism.py; do
    name=$(basename "$file" .py)
    if [ -n "${QA_SELECT:-}" ] && [[ " $QA_SELECT " != *" $name "* ]]; then continue; fi
    QA_SELECT="" qa_pytest_files "determinism-$arch" "$file" NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 \
      NVTE_FUSED_ATTN_PLAN_ARCH="$arch" TRITON_INTERPRET=0
  done
done

qa_finish
