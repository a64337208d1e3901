#!/usr/bin/env bash
# One device call of the attention benchmark (issue 7): installs the carried wheels, runs
# benchmarks/attention/bench_attention.py on the named parts, merges them with any parts carried in
# from earlier calls (benchmarks/results/parts/*.json) and writes into $OUT at most 6 files:
#   attention.json  attention.md  attention.png   (merged: everything measured so far)
#   bench.log  env.txt                             (+ attention_<part>.json only if a part was cut off)
#
# Usage on the device machine, repo root (carry .whl/bench; timeout_s 600), after flash-attn-4's
# install_flash_attn4.sh phase1 / phase2 on the same warm machine (benchmarks/README.md):
#   GIT_COMMIT=<sha> bash dev/device/gpu_bench.sh torch-std torch-ext jax
# Parts (benchmarks/attention/cases.py PARTS): torch-std, torch-ext, jax, all.
# Env: BENCH_BUDGET seconds for all parts together (default 530: the call's 600 s minus setup and
#      merge), BENCH_ARGS extra arguments for bench_attention.py (e.g. "--rep-ms 50"),
#      BENCH_BUILD=1 to `pip install -e .` first (native extensions), GIT_COMMIT for the tables.
# Between calls: copy the returned attention.json to benchmarks/results/parts/ (untracked files
# travel with the tree). The next call then skips every (case, implementation) pair measured there
# (ok or failed; --skip-done), measures the rest (cut off by the time budget, skipped) and merges.
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
BUDGET=${BENCH_BUDGET:-530}
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
parts=${*:-all}
log="$OUT/bench.log"  # appended to: a later bench section of the same lane keeps the earlier one's log
echo "== gpu_bench.sh $parts ($(date -u))" >> "$log"

# Carried wheels of dev/device/fetch_bench_wheels.sh (nvidia-cudnn-frontend), in their own target.
if ls .whl/bench/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_bench \
    .whl/bench/*.whl >> "$log" 2>&1 && export PYTHONPATH=/tmp/site_bench:$PYTHONPATH \
    || echo "wheel install failed (see bench.log)" | tee -a "$log"
fi
# flash-attn-4, if `install_flash_attn4.sh phase2` installed it on this (warm) machine: its env
# (PYTHONPATH with /tmp/site and the CuTe DSL packages), taken from a subshell so that its exit
# status cannot stop this script. Without it the fa4 rows are skipped with the import error.
if [ -f dev/device/install_flash_attn4.sh ]; then
  PYTHONPATH=$( . dev/device/install_flash_attn4.sh env >> "$log" 2>&1; echo "$PYTHONPATH" )
  export PYTHONPATH
fi

{ date -u; echo "commit ${GIT_COMMIT:-unknown}; parts: $parts; budget ${BUDGET}s"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  timeout 90 python3 - <<'EOF'
import importlib, importlib.metadata as md
for name in ("torch", "triton", "jax", "jaxlib", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend",
             "nvidia-cudnn-cu13", "matplotlib"):
    try:
        print(name, md.version(name))
    except Exception:
        print(name, "-")
for mod in ("flash_attn.cute", "cudnn"):
    try:
        importlib.import_module(mod)
        print("import", mod, "ok")
    except Exception as err:
        print("import", mod, "FAILED:", type(err).__name__, str(err)[:200])
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${BENCH_BUILD:-0}" = 1 ]; then  # e.g. once the JAX FFI extension must be compiled
  timeout 180 python3 -m pip install --no-build-isolation --no-deps -e . >> "$log" 2>&1; echo "build rc=$?" | tee -a "$log"
fi

carried=$(ls benchmarks/results/parts/*.json 2>/dev/null)
for part in $parts; do
  # A process that dies in a row (a peer's CUDA fault poisons it) leaves <out>.pending: the part runs
  # again in a fresh process, skipping what the dead one measured; that row is recorded as an error.
  for try in 1 2 3 4; do
    left=$(( BUDGET - ($(date +%s) - start) ))
    if [ "$left" -lt 60 ]; then echo "budget spent before part $part" | tee -a "$log"; break; fi
    echo "== part $part, try $try (${left}s left)" | tee -a "$log"
    # The harness stops starting rows at --time-budget; `timeout` is the hard stop. Rows are
    # written after each measurement, so a cut-off part still returns what finished.
    earlier=$(ls "$OUT"/attention_"$part".try*.json 2>/dev/null)
    skip=$(echo $carried $earlier)
    timeout -k 10 "$left" python3 benchmarks/attention/bench_attention.py --part "$part" \
      --out "$OUT/attention_$part" --time-budget $(( left - 45 )) --no-plot ${skip:+--skip-done $skip} \
      ${BENCH_ARGS:-} >> "$log" 2>&1
    rc=$?
    echo "part $part rc=$rc" | tee -a "$log"
    rm -f "$OUT/attention_$part.md"
    [ -f "$OUT/attention_$part.pending" ] || break
    [ -f "$OUT/attention_$part.json" ] && mv "$OUT/attention_$part.json" "$OUT/attention_$part.try$try.json"
  done
done

# An attention.json already in $OUT is an earlier bench section's merge in this lane: keep its rows.
inputs="$carried $(ls "$OUT"/attention.json "$OUT"/attention_*.json 2>/dev/null)"
inputs=$(echo $inputs)
if [ -n "$inputs" ]; then
  timeout 60 python3 benchmarks/attention/bench_attention.py --merge $inputs --out "$OUT/attention" >> "$log" 2>&1
  rc=$?
  echo "merge rc=$rc" | tee -a "$log"
  # Merged: the part files are inside attention.json now (keep them only if the merge failed).
  [ "$rc" = 0 ] && rm -f "$OUT"/attention_*.json
fi
grep -E "^\| .*\*\*(met|missed|incomplete|not measured)\*\*" "$OUT/attention.md" 2>/dev/null | cut -c1-160
echo "total $(( $(date +%s) - start ))s"
ls "$OUT"
