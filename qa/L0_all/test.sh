#!/usr/bin/env bash
# All CPU levels (what CI runs): L0 common (+ docs), L0 PyTorch, L0 JAX on the oldest supported
# releases, then L0_newest on the newest (a Python 3.12 environment of its own). Every level runs even
# after another fails; the exit status is non-zero if any failed.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

COUNTS="$(mktemp "${TMPDIR:-/tmp}/te_qa_counts.XXXXXX")"
for level in L0_common_unittest L0_pytorch_unittest L0_jax_unittest L0_newest; do
  QA_SUITES=$((QA_SUITES + 1))
  qa_log "##### $level"
  XML_LOG_DIR="$XML_LOG_DIR" QA_COUNTS_FILE="$COUNTS" QA_RECORD= bash "qa/$level/test.sh"
  rc=$?
  [ "$rc" -eq 0 ] || qa_fail "$level" "exit $rc"
done
read -r QA_PASSED QA_FAILED_TESTS QA_SKIPPED < <(awk '{p+=$1; f+=$2; s+=$3} END {print p+0, f+0, s+0}' "$COUNTS")
rm -f "$COUNTS"

qa_finish
