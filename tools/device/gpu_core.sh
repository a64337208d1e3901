#!/usr/bin/env bash
# One device call: build/import check, GPU fused-attention tests, core benchmark, tile sweep.
# Usage on the device machine (repo root): bash tools/device/gpu_core.sh [sections...]
# Sections: build tests module bench tune (default: all). Results land in $OUT (or ./device_out).
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests/pytorch:${PYTHONPATH:-}
sections=${*:-build tests module bench tune}
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
for s in $sections; do
  case $s in
    build)
      timeout 120 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; echo "build rc=$?" >> "$OUT/summary.txt"
      python3 -c "import transformer_engine, transformer_engine.pytorch; print('import ok', transformer_engine.__version__)" >> "$OUT/summary.txt" 2>&1 ;;
    tests)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/pytorch/test_fused_attn.py tests/pytorch/test_fused_attn_determinism.py tests/pytorch/test_fused_attn_surface.py ${PYTEST_ARGS:-} > "$OUT/pytest_fused.log" 2>&1
      echo "tests rc=$? $(tail -1 "$OUT/pytest_fused.log")" >> "$OUT/summary.txt" ;;
    module)
      timeout ${MODULE_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/pytorch --ignore=tests/pytorch/test_fused_attn.py --ignore=tests/pytorch/test_fused_attn_determinism.py --ignore=tests/pytorch/test_fused_attn_surface.py > "$OUT/pytest_module.log" 2>&1
      echo "module tests rc=$? $(tail -1 "$OUT/pytest_module.log")" >> "$OUT/summary.txt"
      NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 timeout 60 python3 -m transformer_engine.pytorch.determinism_check > "$OUT/determinism_check.txt" 2>&1
      echo "determinism check rc=$?" >> "$OUT/summary.txt" ;;
    bench)
      (cd benchmarks/attention && timeout ${BENCH_TIMEOUT:-150} python3 bench_core.py --out "$OUT/core") > /tmp/bench.log 2>&1
      echo "bench rc=$?" >> "$OUT/summary.txt" ;;
    tune)
      (cd benchmarks/attention && timeout ${TUNE_TIMEOUT:-150} python3 tune_tiles.py "$OUT/tune.json" ${TUNE_DIMS:-}) > /tmp/tune.log 2>&1; tail -5 /tmp/tune.log
      echo "tune rc=$?" >> "$OUT/summary.txt" ;;
  esac
done
cat "$OUT/summary.txt"
