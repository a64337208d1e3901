#!/usr/bin/env bash
# All CPU levels (what CI runs): L0 common (+ docs), L0 PyTorch, L0 JAX on the oldest supported
# releases, and L0_newest on the newest (a Python 3.12 environment of its own). Every level runs even
# after another fails; the exit status is non-zero if any failed.
#
# The levels run in QA_LANES lanes at once (default 2: CI's machine has two cores and the interpreter's
# suites use one each). Lane i runs its levels in order; a lane's output is printed whole when the lane
# ends, so each level's log reads in one piece. QA_LANES=1 runs them one after another, as before.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

QA_LANES="${QA_LANES:-2}"
# Two lanes of about equal time on CI's machine: PyTorch's level is the longest.
LANES=("L0_pytorch_unittest" "L0_common_unittest L0_jax_unittest L0_newest")
if [ "$QA_LANES" -le 1 ]; then
  LANES=("L0_common_unittest L0_pytorch_unittest L0_jax_unittest L0_newest")
fi

COUNTS="$(mktemp "${TMPDIR:-/tmp}/te_qa_counts.XXXXXX")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/te_qa_lanes.XXXXXX")"

run_lane() {  # run_lane INDEX LEVELS: each level in turn; "level rc" lines in $WORK/rc.INDEX
  local i="$1" level rc
  for level in $2; do
    echo "[qa:L0_all lane $i] ##### $level (started at +$(( $(date +%s) - QA_START ))s)"
    XML_LOG_DIR="$XML_LOG_DIR" QA_COUNTS_FILE="$COUNTS" QA_RECORD= bash "qa/$level/test.sh"
    rc=$?
    echo "$level $rc" >>"$WORK/rc.$i"
  done
}

pids=()
for i in "${!LANES[@]}"; do
  qa_log "lane $i: ${LANES[$i]}"
  run_lane "$i" "${LANES[$i]}" >"$WORK/log.$i" 2>&1 &
  pids+=($!)
done
for i in "${!LANES[@]}"; do
  wait "${pids[$i]}"
  qa_log "lane $i ended; its output:"
  cat "$WORK/log.$i"
done
for i in "${!LANES[@]}"; do
  for level in ${LANES[$i]}; do
    QA_SUITES=$((QA_SUITES + 1))
    rc=$(awk -v l="$level" '$1 == l {print $2}' "$WORK/rc.$i" 2>/dev/null)
    [ "${rc:-missing}" = 0 ] || qa_fail "$level" "exit ${rc:-missing}"
  done
done
read -r QA_PASSED QA_FAILED_TESTS QA_SKIPPED < <(awk '{p+=$1; f+=$2; s+=$3} END {print p+0, f+0, s+0}' "$COUNTS")
rm -rf "$COUNTS" "$WORK"

qa_finish
