# Shared by the qa/<LEVEL>/test.sh scripts (source it; do not run it).
#
# A level runs every suite it has, even after a failure, then prints one summary and exits
# non-zero if any suite failed. pytest's exit code 5 ("no tests collected") is a failure, and a
# level that finds no test files at all fails too: a suite that ran nothing has not passed.
#
# Environment (all optional):
#   PYTHON           interpreter to use (default: python, else python3)
#   XML_LOG_DIR      where pytest writes one JUnit XML per suite (default: a temporary folder)
#   QA_PYTEST_ARGS   extra pytest arguments for every suite, e.g. "-x -k causal"
#                    (a test file with a line "# qa: no xdist workers" gets "-n 0" after "-n N")
#   QA_WIDE          1: the L0 levels run the test grids' wide cases too (pytest marker `wide`, tests/case_grid.py);
#                    by default an L0 level (what CI runs) leaves them out, and every other level runs them
#   QA_RECORD        a file to which the final summary line is appended (e.g. for GPU runs)
#   QA_COUNTS_FILE   a file to which "passed failed skipped" is appended (used by qa/L0_all)
#   QA_SELECT        test file names (without .py, space-separated) to run, in that order, of those a level finds;
#   QA_SKIP          test file names to leave out: together they split one level over runs
#                    or GPUs (e.g. QA_SKIP="test_fused_attn" on one, QA_SELECT="test_fused_attn" on the other)

QA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$QA_ROOT" || exit 1

if [ -z "${PYTHON:-}" ]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
if [ -z "${XML_LOG_DIR:-}" ]; then
  XML_LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/te_qa_xml.XXXXXX")"
fi
mkdir -p "$XML_LOG_DIR"

QA_LEVEL="${QA_LEVEL:-$(basename "$(cd "$(dirname "${BASH_SOURCE[1]:-$0}")" && pwd)")}"
QA_FAILED=()
QA_PASSED=0
QA_FAILED_TESTS=0
QA_SKIPPED=0
QA_SUITES=0
QA_START=$(date +%s)

QA_PROGRESS=""  # "[i/N] " while qa_pytest_files runs its suites

qa_log() { echo "[qa:${QA_LEVEL} +$(( $(date +%s) - QA_START ))s] $*"; }

# qa_fail NAME WHY: record a failed suite.
qa_fail() {
  QA_FAILED+=("$1 ($2)")
  qa_log "FAILED: $1 ($2)"
}

# qa_run NAME COMMAND...: a suite that is not pytest (counts as one test).
qa_run() {
  local name="$1"; shift
  QA_SUITES=$((QA_SUITES + 1))
  qa_log "=== $name: $*"
  local start=$(date +%s)
  "$@"
  local rc=$?
  qa_log "--- $name: exit $rc in $(( $(date +%s) - start ))s"
  if [ "$rc" -eq 0 ]; then
    QA_PASSED=$((QA_PASSED + 1))
  else
    QA_FAILED_TESTS=$((QA_FAILED_TESTS + 1))
    qa_fail "$name" "exit $rc"
  fi
}

# qa_pytest NAME [VAR=value ...] -- PYTEST_ARGS...: one pytest suite, with its environment.
qa_pytest() {
  local name="$1"; shift
  local envs=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  QA_SUITES=$((QA_SUITES + 1))
  local xml="$XML_LOG_DIR/${QA_LEVEL}__$(echo "$name" | tr -c 'A-Za-z0-9_.-' '_').xml"
  rm -f "$xml"
  qa_log "=== ${QA_PROGRESS}$name: ${envs[*]} pytest $*"
  local start=$(date +%s)
  local marks=()
  if [[ "$QA_LEVEL" == L0_* ]] && [ "${QA_WIDE:-0}" != 1 ]; then marks=(-m "not wide"); fi
  # shellcheck disable=SC2086
  env "${envs[@]}" "$PYTHON" -m pytest -p no:cacheprovider --junitxml="$xml" "${marks[@]}" ${QA_PYTEST_ARGS:-} "$@"
  local rc=$?
  qa_log "--- ${QA_PROGRESS}$name: exit $rc in $(( $(date +%s) - start ))s"
  local counts
  counts=$("$PYTHON" - "$xml" <<'PY' 2>/dev/null
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
total = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(total - failed - skipped, failed, skipped)
PY
  ) || counts="0 0 0"
  local passed failed skipped
  read -r passed failed skipped <<<"$counts"
  QA_PASSED=$((QA_PASSED + passed))
  QA_FAILED_TESTS=$((QA_FAILED_TESTS + failed))
  QA_SKIPPED=$((QA_SKIPPED + skipped))
  case "$rc" in
    0) ;;
    5)  # nothing collected: a file skipped as a whole (module-level skip; pytest-xdist reports that
        # as exit 5) counts as skipped, a file with no tests at all as a failure
        if [ "$skipped" -eq 0 ]; then
          QA_FAILED_TESTS=$((QA_FAILED_TESTS + 1)); qa_fail "$name" "pytest exit 5: no tests collected"
        fi ;;
    *) [ "$failed" -eq 0 ] && QA_FAILED_TESTS=$((QA_FAILED_TESTS + 1)); qa_fail "$name" "pytest exit $rc" ;;
  esac
}

# qa_serial_args: "-n 0" when QA_PYTEST_ARGS ask for pytest-xdist workers (-n N), else nothing: pytest
# arguments for a suite that must run in one process.
qa_serial_args() {
  if [[ " ${QA_PYTEST_ARGS:-} " == *" -n "* ]]; then echo "-n 0"; fi
}

# qa_pytest_files NAME_PREFIX GLOB [VAR=value ...]: one suite per test file matching GLOB.
# No matching file is a failure.
qa_pytest_files() {
  local prefix="$1" pattern="$2"; shift 2
  local files=()
  # shellcheck disable=SC2206
  files=($(compgen -G "$pattern" | sort))
  if [ "${#files[@]}" -eq 0 ]; then
    QA_SUITES=$((QA_SUITES + 1))
    QA_FAILED_TESTS=$((QA_FAILED_TESTS + 1))
    qa_fail "$prefix" "no test files match $pattern"
    return
  fi
  local file name ran=0 chosen=()
  local ordered=("${files[@]}") want
  if [ -n "${QA_SELECT:-}" ]; then  # QA_SELECT's order, so that a split can put slow files last
    ordered=()
    for want in $QA_SELECT; do
      for file in "${files[@]}"; do [ "$(basename "$file" .py)" = "$want" ] && ordered+=("$file"); done
    done
  fi
  for file in "${ordered[@]}"; do
    name=$(basename "$file" .py)
    if [ -n "${QA_SKIP:-}" ] && [[ " $QA_SKIP " == *" $name "* ]]; then continue; fi
    chosen+=("$file")
  done
  local serial
  for file in "${chosen[@]}"; do
    ran=$((ran + 1))
    QA_PROGRESS="[$ran/${#chosen[@]}] "
    # A file that says "# qa: no xdist workers" runs in one process: its cases each fill one GPU, and
    # workers sharing it stall them.
    serial=()
    # shellcheck disable=SC2207
    if grep -q "^# qa: no xdist workers" "$file"; then serial=($(qa_serial_args)); fi
    qa_pytest "$prefix/$(basename "$file" .py)" "$@" -- "${serial[@]}" "$file"
  done
  QA_PROGRESS=""
  if [ "$ran" -eq 0 ]; then  # everything filtered out: nothing ran, so nothing passed
    QA_SUITES=$((QA_SUITES + 1))
    QA_FAILED_TESTS=$((QA_FAILED_TESTS + 1))
    qa_fail "$prefix" "QA_SELECT/QA_SKIP left no file of $pattern"
  fi
}

# qa_have_gpu: true when a CUDA GPU is visible (nvidia-smi, else torch), without needing torch.
qa_have_gpu() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    return 0
  fi
  "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1
}

# qa_require_gpu: GPU levels call this first; without a GPU they say so and exit 0.
qa_require_gpu() {
  if ! qa_have_gpu; then
    echo "SKIPPED: no GPU: ${QA_LEVEL} needs a CUDA GPU (nvidia-smi lists none and torch.cuda.is_available() is False); nothing was run"
    exit 0
  fi
  qa_log "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
}

# qa_finish: summary, optional record, exit status.
qa_finish() {
  local commit
  commit=$(git -C "$QA_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
  local line="${QA_LEVEL} $(date -u +%Y-%m-%dT%H:%M:%SZ) commit=${commit} suites=${QA_SUITES} time=$(( $(date +%s) - QA_START ))s"
  echo
  qa_log "summary: $line (JUnit XML in $XML_LOG_DIR)"
  if [ "${#QA_FAILED[@]}" -gt 0 ]; then
    qa_log "failed suites:"
    local f
    for f in "${QA_FAILED[@]}"; do echo "  - $f"; done
  fi
  if [ -n "${QA_COUNTS_FILE:-}" ]; then
    echo "$QA_PASSED $QA_FAILED_TESTS $QA_SKIPPED" >>"$QA_COUNTS_FILE"
  fi
  if [ -n "${QA_RECORD:-}" ]; then
    echo "$line: $QA_PASSED passed, $QA_FAILED_TESTS failed, $QA_SKIPPED skipped" >>"$QA_RECORD"
  fi
  # The plain closing line: what the level ran, in tests.
  echo "${QA_LEVEL}: ${QA_PASSED} passed, ${QA_FAILED_TESTS} failed, ${QA_SKIPPED} skipped"
  [ "${#QA_FAILED[@]}" -eq 0 ]
  exit $?
}
