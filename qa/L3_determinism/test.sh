#!/usr/bin/env bash
# L3 (GPU): determinism suites with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: repeated-run bitwise
# checks, batch/packing invariance, cross-framework equality, long context. It runs every test
# file named *determinism* under tests/pytorch and tests/jax, then the fused-kernel ones under forced plans.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

qa_pytest_files determinism "tests/*/test_*determinism*.py" NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 TRITON_INTERPRET=0

# Other architectures' plans on this GPU (NVTE_FUSED_ATTN_PLAN_ARCH: their tile tables, Triton kernels only)
# keep the same bitwise contract: the fused-kernel suites of both frameworks again under each. QA_FORCED_PLANS
# names the plans (default "sm80 gfx942"; empty: none); a QA_SELECT naming neither suite leaves them out.
forced=""
for name in test_fused_attn_determinism test_jax_determinism; do
  if [ -z "${QA_SELECT:-}" ] || [[ " $QA_SELECT " == *" $name "* ]]; then forced+="$name "; fi
done
if [ -n "$forced" ]; then
  for arch in ${QA_FORCED_PLANS-sm80 gfx942}; do
    QA_SELECT="$forced" qa_pytest_files "determinism-$arch" "tests/*/test_*determinism*.py" \
      NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 NVTE_FUSED_ATTN_PLAN_ARCH="$arch" TRITON_INTERPRET=0
  done
fi

qa_finish
