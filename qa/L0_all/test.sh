#!/usr/bin/env bash
# All CPU levels (what CI runs): L0 common (+ docs), L0 PyTorch, L0 JAX on the oldest supported
# releases, and L0_newest on the newest (a Python 3.12 environment of its own). Every level runs even
# after another fails; the exit status is non-zero if any failed.
#
# The work is a queue of units (a level, or part of one), taken by QA_LANES lanes (default 2, CI's cores): a lane
# takes the next unit when its last one ends. The interpreter's suites keep one core busy each, so one lane
# leaves the other core idle; each lane's processes get one OpenMP thread (OMP_NUM_THREADS, unless set), so that
# two lanes do not oversubscribe two cores. A unit's output is printed whole when it ends, so each reads in one
# piece.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

# PyTorch's level and JAX's in two units each of about equal time, split by file: the first unit runs these files
# (QA_SELECT), the second the others (QA_SKIP).
PYTORCH_FIRST="test_paged_kv test_packed_rows test_compile test_context_parallel test_dot_product_attention
  test_fused_attn_determinism test_fused_attn"
JAX_FIRST="test_jax_unfused_invariance test_jax_kv_cache test_jax_paged_kv test_jax_fused_attn"
# The units, the longest first and the shortest last, so that the lanes end together; L0_newest builds its
# environment before its suites. A unit: LEVEL [QA_SELECT|QA_SKIP FILES].
UNITS=("L0_newest" "L0_pytorch_unittest QA_SKIP PYTORCH_FIRST" "L0_pytorch_unittest QA_SELECT PYTORCH_FIRST"
       "L0_jax_unittest QA_SKIP JAX_FIRST" "L0_jax_unittest QA_SELECT JAX_FIRST" "L0_common_unittest")

if [ "${1:-}" = "--unit" ]; then  # one unit: qa/L0_all/test.sh --unit INDEX WORKDIR
  read -r level split files <<<"${UNITS[$2]}"
  log="$3/log.$2"
  start=$(date +%s)
  {
    echo "[qa:L0_all unit $2] ##### ${UNITS[$2]} (started at +$(( start - ${QA_ALL_START:-$QA_START} ))s)"
    if [ -n "$split" ]; then
      env "$split=$(echo ${!files})" bash "qa/$level/test.sh"
    else
      bash "qa/$level/test.sh"
    fi
    echo "$?" >"$3/rc.$2"
  } >"$log" 2>&1
  # The units ended so far, each with its time, after every unit's log: a run cut off by a time limit still
  # shows them at the end of its output.
  echo "unit $2 [${UNITS[$2]}]: exit $(cat "$3/rc.$2"), $(( $(date +%s) - start ))s" >>"$3/times"
  {
    if command -v flock >/dev/null 2>&1; then flock 9; fi  # one unit's output at a time, when two end together
    cat "$log"
    echo "[qa:L0_all +$(( $(date +%s) - ${QA_ALL_START:-$QA_START} ))s] units ended:"
    cat "$3/times"
  } 9>"$3/print.lock"
  exit 0
fi

QA_LANES="${QA_LANES:-2}"
[ "$QA_LANES" -gt 1 ] && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
COUNTS="$(mktemp "${TMPDIR:-/tmp}/te_qa_counts.XXXXXX")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/te_qa_units.XXXXXX")"

qa_log "${#UNITS[@]} units in $QA_LANES lanes: $(printf '[%s] ' "${UNITS[@]}")"
export XML_LOG_DIR QA_COUNTS_FILE="$COUNTS" QA_RECORD= QA_ALL_START="$QA_START"
# xargs is the queue: each lane runs `--unit I` for the next index as soon as its last unit ends.
seq 0 $(( ${#UNITS[@]} - 1 )) | xargs -P "$QA_LANES" -I{} bash "qa/L0_all/test.sh" --unit {} "$WORK"
for i in "${!UNITS[@]}"; do
  QA_SUITES=$((QA_SUITES + 1))
  rc=$(cat "$WORK/rc.$i" 2>/dev/null)
  [ "${rc:-missing}" = 0 ] || qa_fail "${UNITS[$i]}" "exit ${rc:-missing}"
done
read -r QA_PASSED QA_FAILED_TESTS QA_SKIPPED < <(awk '{p+=$1; f+=$2; s+=$3} END {print p+0, f+0, s+0}' "$COUNTS")
rm -rf "$COUNTS" "$WORK"

qa_finish
