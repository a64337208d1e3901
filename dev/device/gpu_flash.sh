#!/usr/bin/env bash
# FlashAttention (flash-attn-4) on the GPU machine, after install_flash_attn4.sh phase2 (same call, or
# a later one while that machine is still warm). Results land in $OUT (or ./device_out):
#   summary.txt              one line per section (what DESIGN.md asks every GPU run to record)
#   env.txt                  date, commit, GPU, package versions
#   pytest_flash.log         tests/pytorch/test_flash_backend.py (reference, repeated runs, invariance, selection)
#   flash_results.json       outcome per config (FLASH_TEST_RESULTS): what to flip in backends.py if
#                            deterministic mode is not invariant
#   flash_bench.{json,md}    bench section: DotProductAttention vs flash-attn-4 called directly
#   pytest_jax_flash.log     jax section: tests/jax/test_jax_flash_backend{,_gpu}.py (JAX == PyTorch bits,
#                            repeated runs, batch/packing invariance, accuracy, selection)
# Usage (repo root): bash dev/device/gpu_flash.sh [sections...]   sections: check tests jax bench
# (default: check tests jax). Limits: TEST_TIMEOUT (default 420 s), JAX_TEST_TIMEOUT (420 s), BENCH_TIMEOUT
# (300 s), BENCH_ARGS.
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
TARGET=${FA4_TARGET:-/tmp/site}
if [ -f "$TARGET/fa4_env.sh" ]; then
  # shellcheck disable=SC1091
  source "$TARGET/fa4_env.sh"
else
  echo "flash-attn-4 is not installed in $TARGET (run install_flash_attn4.sh phase1, then phase2)" | tee -a "$OUT/summary.txt"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests/pytorch:${PYTHONPATH:-}
sections=${*:-check tests jax}
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 - <<'EOF'
import importlib.metadata as md
for name in ("torch", "triton", "jax", "jax-cuda13-plugin", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels",
             "apache-tvm-ffi", "cuda-bindings"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
} > "$OUT/env.txt" 2>&1
echo "$(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null) sections: $sections" >> "$OUT/summary.txt"
for s in $sections; do
  case $s in
    check)
      python3 -c "from transformer_engine.pytorch.attention import flash_backend as f; r = f.unavailable_reason(); \
print('flash backend available' if r is None else 'flash backend unavailable: ' + r)" >> "$OUT/summary.txt" 2>&1
      python3 -c "from transformer_engine.jax import flash_backend as f; r = f.unavailable_reason(); \
print('JAX flash route available' if r is None else 'JAX flash route unavailable: ' + r)" >> "$OUT/summary.txt" 2>&1 ;;
    jax)
      # JAX and torch share the GPU: no preallocation by XLA.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${JAX_TEST_TIMEOUT:-420}" python3 -m pytest -q -rs \
        -p no:cacheprovider tests/jax/test_jax_flash_backend_gpu.py tests/jax/test_jax_flash_backend.py \
        > "$OUT/pytest_jax_flash.log" 2>&1
      echo "jax tests rc=$? $(tail -1 "$OUT/pytest_jax_flash.log")" >> "$OUT/summary.txt" ;;
    tests)
      FLASH_TEST_RESULTS="$OUT/flash_results.json" timeout "${TEST_TIMEOUT:-420}" \
        python3 -m pytest -q -rs -p no:cacheprovider tests/pytorch/test_flash_backend.py > "$OUT/pytest_flash.log" 2>&1
      echo "tests rc=$? $(tail -1 "$OUT/pytest_flash.log")" >> "$OUT/summary.txt"
      [ -f "$OUT/flash_results.json" ] && python3 - "$OUT/flash_results.json" >> "$OUT/summary.txt" <<'EOF'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
for r in results:
    if not r["ok"] or r["kind"] in ("batch", "packing", "selection"):
        print(f"  {r['kind']:9} {r['config']:45} {'ok' if r['ok'] else 'FAILED'} {r['detail'][:160]}")
print(f"  {sum(r['ok'] for r in results)}/{len(results)} recorded configs ok")
EOF
      ;;
    bench)
      if [ -f benchmarks/attention/bench_attention.py ]; then
        timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/attention/bench_attention.py --no-plot \
          ${BENCH_ARGS:---impls fa4_det,te_dpa_det,fa4,te_dpa} --out "$OUT/flash_bench" > "$OUT/bench_flash.log" 2>&1
        echo "bench rc=$? (flash_bench.md)" >> "$OUT/summary.txt"
      else
        echo "bench: benchmarks/attention/bench_attention.py not in this tree" >> "$OUT/summary.txt"
      fi ;;
    *) echo "unknown section $s" >> "$OUT/summary.txt" ;;
  esac
done
cat "$OUT/summary.txt"
