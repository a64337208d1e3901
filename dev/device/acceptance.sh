#!/usr/bin/env bash
# The GPU acceptance run: every qa GPU level's test files, the client tests, the opt-in features and the
# memory checker, in two device calls on one H200, risk first (what is on by default before what is opt-in).
#
#   bash dev/device/acceptance.sh 1      # first call
#   bash dev/device/acceptance.sh 2      # second call
#   ACC_UNITS="l3 jax" bash dev/device/acceptance.sh 2   # only these units (e.g. re-runs after a fix)
#
# Carry: .kernel_cache (Triton's cache for sm_90, built on the CPU machine by dev/device/kernel_cache.py from
# sm90_kernels.jsonl.gz and packed as sm90_cache.tar.xz by `kernel_cache.py pack`: the call then compiles only what
# the records lack) and .whl/clients (megatron-core).
# Units run ACC_SLOTS at a time (default 4), each one pytest over its files with ACC_WORKERS xdist workers
# sharing the GPU; each ends by SIGINT at the call's deadline (ACC_DEADLINE seconds after the start, default
# 545), so pytest still writes the JUnit XML of what finished. $OUT gets summary.md (unit, file, passed,
# failed, skipped, seconds; the failures; the compile share of the call), logs.tgz, records.tgz (every
# compile of the call: `python dev/device/kernel_cache.py merge` adds them to the records) and the call's
# own kernel cache (sm90_cache.tgz.NN) for the next call.
set -u
ROOT=$PWD
PART=${1:-1}
OUT=${OUT:-/tmp/acc_out}; mkdir -p "$OUT"
A=/tmp/acc; rm -rf "$A"; mkdir -p "$A/logs" "$A/xml" "$A/record"
T0=$(date +%s.%N); T0S=${T0%.*}
DEADLINE=${ACC_DEADLINE:-545}
SLOTS=${ACC_SLOTS:-4}
W=${ACC_WORKERS:-4}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=/tmp/te_sm90_cache
log() { echo "[$(( $(date +%s) - T0S ))s] $*" | tee -a "$A/logs/driver.log"; }

# The whole CPU-built cache as one xz tar (kernel_cache.py pack: fits one carry), or a call's own tgz parts.
if ls "$ROOT"/.kernel_cache/sm90_cache.tar.xz > /dev/null 2>&1; then
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall('/')" "$ROOT/.kernel_cache/sm90_cache.tar.xz"
fi
if ls "$ROOT"/.kernel_cache/sm90_cache.tgz* > /dev/null 2>&1; then
  cat "$ROOT"/.kernel_cache/sm90_cache.tgz* | tar -C / -xzf -
fi
[ -d "$TRITON_CACHE_DIR" ] && log "kernel cache: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) cubins carried"
mkdir -p "$TRITON_CACHE_DIR"
log "triton_key $(python3 dev/device/kernel_cache.py triton_key) triton $(python3 -c 'import triton; print(triton.__version__)')"

NVTE_FRAMEWORK=all python3 -m pip install --no-build-isolation --no-deps -e . > "$A/logs/install.log" 2>&1
log "install rc=$? $(python3 -c 'import transformer_engine.jax.primitives.gpu, transformer_engine.pytorch; print("ok")' 2>&1 | tail -1)"
if ls .whl/clients/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_clients .whl/clients/*.whl \
    > "$A/logs/clients_install.log" 2>&1
  CLIENTS=/tmp/site_clients
  log "clients: $(ls .whl/clients)"
fi
# The recorder (dev/device/record/sitecustomize.py) in every Python process from here on.
export TE_KERNEL_RECORD=$A/record
export PYTHONPATH=$ROOT/dev/device/record:$ROOT:$ROOT/tests/pytorch${CLIENTS:+:$CLIENTS}:${PYTHONPATH:-}

PT=tests/pytorch; JX=tests/jax
# Unit table: name|environment|pytest arguments (workers -n N where a file allows it).
unit_spec() {
  case "$1" in
    # On by default and never run on a GPU before: the d=64 capped chunked forward, the module refactor, the
    # unfused path's pair-tree sums, the decode host path and its captured steps, the KV cache and paged rows.
    pt_default) echo "|-n $W $PT/test_split_kv.py $PT/test_te_modules.py $PT/test_unfused_invariance.py $PT/test_kv_cache.py $PT/test_kv_cache_host.py $PT/test_paged_kv.py $PT/test_cuda_graph_capture.py $PT/test_signature_cache.py $PT/test_launch_cache.py $PT/test_host_sync.py $PT/test_max_logit.py $PT/test_decode_capture.py" ;;
    # THD + Striped context parallelism on one GPU (the file asks for no xdist workers).
    cp_one_gpu) echo "|$PT/test_context_parallel_one_gpu.py" ;;
    l3) echo "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0|-n $W $(ls tests/*/test_*determinism*.py | tr '\n' ' ')" ;;
    jax) echo "|-n $W $(ls $JX/test_*.py | grep -v -E 'determinism|test_jax_fp8' | tr '\n' ' ')" ;;
    # FP8: the modules' GEMMs (torch scaled GEMM), the FP8 attention kernels, JAX's dense, the clients in FP8.
    fp8) echo "|-n $W $(ls $PT/test_fp8_*.py $PT/test_megatron_fp8*.py $JX/test_jax_fp8*.py | tr '\n' ' ')" ;;
    pt_rest) echo "|-n $W $(ls $PT/test_*.py | grep -v -E 'determinism|test_split_kv|test_te_modules|test_unfused_invariance|test_kv_cache|test_paged_kv|test_cuda_graph_capture|test_signature_cache|test_launch_cache|test_host_sync|test_max_logit|test_decode_capture|test_context_parallel_one_gpu|megatron|test_fp8_' | tr '\n' ' ')" ;;
    clients) echo "|$PT/test_megatron_inference.py $PT/test_megatron_inference_graphs.py $PT/test_megatron_gpt.py $PT/test_dpa_megatron.py" ;;
    l3_sm80) echo "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 NVTE_FUSED_ATTN_PLAN_ARCH=sm80|-n $W tests/pytorch/test_fused_attn_determinism.py tests/jax/test_jax_determinism.py" ;;
    l3_gfx942) echo "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 NVTE_FUSED_ATTN_PLAN_ARCH=gfx942|-n $W tests/pytorch/test_fused_attn_determinism.py tests/jax/test_jax_determinism.py" ;;
    # Opt-in: the Gluon forward reading pages in place.
    gluon_paged) echo "NVTE_FUSED_ATTN_GLUON_PAGED=1|-n $W $PT/test_paged_kv.py $JX/test_jax_paged_kv.py $PT/test_split_kv.py" ;;
    jax_flash) echo "|$JX/test_jax_flash_backend_gpu.py" ;;
    *) return 1 ;;
  esac
}
case "$PART" in
  1) UNITS=${ACC_UNITS:-"pt_default l3 jax cp_one_gpu pt_rest clients check"} ;;
  2) UNITS=${ACC_UNITS:-"l3_sm80 l3_gfx942 gluon_paged memcheck memcheck_decode"} ;;
  *) UNITS=${ACC_UNITS:-$PART} ;;
esac

run_unit() {
  local name=$1 left=$(( DEADLINE - ($(date +%s) - T0S) ))
  [ "$left" -lt 20 ] && { log "unit $name: not started (deadline)"; echo "$name notstarted" >> "$A/units.txt"; return; }
  local start=$(date +%s) rc
  export TE_KERNEL_RECORD=$A/record/$name  # each unit's compiles apart: its own compile share
  case "$name" in
    memcheck)  # compute-sanitizer over the kernel variants (MEMCHECK_DIMS: head dims d_qk/d_v)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -s INT -k 15 "$left" compute-sanitizer --tool memcheck \
        --error-exitcode 1 --kernel-name kns=attn_ \
        python3 tests/pytorch/memcheck_kernels.py ${MEMCHECK_DIMS:-64/64 128/128} > "$A/logs/$name.log" 2>&1
      rc=$? ;;
    memcheck_decode)  # the decode variants changed since the last memcheck: split-KV and the capped chunked
      # forward, paged caches with the Gluon page loads on
      NVTE_FUSED_ATTN_GLUON_PAGED=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 TRITON_INTERPRET=0 timeout -s INT -k 15 "$left" \
        compute-sanitizer --tool memcheck --error-exitcode 1 --kernel-name kns=attn_ \
        python3 -m pytest -p no:cacheprovider -q -x --junitxml="$A/xml/$name.xml" tests/pytorch/test_split_kv.py \
        tests/pytorch/test_paged_kv.py > "$A/logs/$name.log" 2>&1
      rc=$? ;;
    bench)  # the benchmarks the open issues owe, each JSON into $OUT (FP8 Linear and attention, batch-invariant
      # GEMM and model step, GroupedLinear), one after another; alone on the GPU: ACC_SLOTS=1 ACC_UNITS="bench fp8"
      for b in "fp8_linear benchmarks/fp8_linear.py" "fp8_attention benchmarks/attention/bench_fp8_attention.py" \
               "batch_invariant benchmarks/batch_invariant.py --sweep" "grouped_linear benchmarks/grouped_linear.py"; do
        set -- $b
        local bn=$1; shift
        left=$(( DEADLINE - ($(date +%s) - T0S) )); [ "$left" -lt 30 ] && break
        timeout -s INT -k 10 "$(( left < 150 ? left : 150 ))" python3 "$@" --out "$OUT/$bn.json" \
          > "$A/logs/bench_$bn.log" 2>&1
        echo "bench $bn: rc=$?" >> "$A/logs/$name.log"
      done
      rc=0 ;;
    check)  # the determinism checks of both frameworks (README's first command and its JAX counterpart), then
      # their whole-model batch-invariance reports
      { NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 timeout -s INT -k 15 "$left" python3 -m transformer_engine.pytorch.determinism_check &&
        NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 timeout -s INT -k 15 "$left" python3 -m transformer_engine.jax.determinism_check &&
        timeout -s INT -k 15 "$left" python3 -m transformer_engine.pytorch.determinism_check --batch-invariant &&
        timeout -s INT -k 15 "$left" python3 -m transformer_engine.jax.determinism_check --batch-invariant; } \
        > "$A/logs/$name.log" 2>&1
      rc=$? ;;
    *)
      local spec envs args
      spec=$(unit_spec "$name") || { log "unit $name: unknown"; return; }
      envs=${spec%%|*}; args=${spec#*|}
      # shellcheck disable=SC2086
      env $envs TRITON_INTERPRET=0 timeout -s INT -k 20 "$left" python3 -m pytest -p no:cacheprovider -q -rfE \
        --junitxml="$A/xml/$name.xml" $args > "$A/logs/$name.log" 2>&1
      rc=$? ;;
  esac
  log "unit $name: rc=$rc in $(( $(date +%s) - start ))s: $(tail -1 "$A/logs/$name.log")"
  echo "$name $rc $(( $(date +%s) - start ))" >> "$A/units.txt"
}

log "units: $UNITS (slots $SLOTS, workers $W, deadline ${DEADLINE}s)"
for u in $UNITS; do
  while [ "$(jobs -rp | wc -l)" -ge "$SLOTS" ]; do wait -n; done
  run_unit "$u" &
  sleep 2
done
wait
T1=$(date +%s.%N)

{
  echo "call: $(python3 dev/device/kernel_cache.py share "$A"/record/* --t0 "$T0" --t1 "$T1" 2>&1)"
  for d in "$A"/record/*/; do
    echo "$(basename "$d"): $(python3 dev/device/kernel_cache.py share "$d" --t0 "$T0" --t1 "$T1" 2>&1)"
  done
} > "$A/share.json"
python3 - "$A" "$PART" > "$OUT/summary.md" <<'PY'
import collections, glob, json, os, sys, xml.etree.ElementTree as ET
a, part = sys.argv[1], sys.argv[2]
units = {l.split()[0]: l.split()[1:] for l in open(os.path.join(a, "units.txt"))} if os.path.exists(os.path.join(a, "units.txt")) else {}
print(f"# GPU acceptance, part {part}\n")
print("| unit | file | passed | failed | skipped | seconds |\n|---|---|---|---|---|---|")
failures = []
for xml in sorted(glob.glob(os.path.join(a, "xml", "*.xml"))):
    unit = os.path.basename(xml)[:-4]
    rows = collections.defaultdict(lambda: [0, 0, 0, 0.0])
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError as e:
        print(f"| {unit} | (unreadable XML: {e}) | | | | |"); continue
    for tc in root.iter("testcase"):
        f = tc.get("classname", "").split(".")
        f = "/".join(x for x in f if x.startswith("test_") and not x[0].isupper())[:60] or tc.get("classname") or "?"
        r = rows[f]; r[3] += float(tc.get("time", 0))
        bad = [c for c in tc if c.tag in ("failure", "error")]
        if bad:
            r[1] += 1; failures.append(f"{unit}: {tc.get('classname')}::{tc.get('name')}: {(bad[0].get('message') or '')[:200]}")
        elif any(c.tag == "skipped" for c in tc):
            r[2] += 1
        else:
            r[0] += 1
    for f, (p, fl, s, t) in sorted(rows.items()):
        print(f"| {unit} | {f} | {p} | {fl} | {s} | {t:.0f} |")
print("\n| unit | exit | seconds |\n|---|---|---|")
for u, v in units.items():
    print(f"| {u} | {' | '.join(v + [''] * (2 - len(v)))} |")
print("\nExit 124: stopped at the deadline (SIGINT, then pytest wrote what finished: the rows above count it).\n")
print("## Failures\n")
for f in failures[:200]:
    print("-", f.replace("\n", " "))
print("\n## Compile share\n")
print(open(os.path.join(a, "share.json")).read())
PY
cat "$A/logs/driver.log" >> "$OUT/summary.md"
tar -C "$A" -czf "$OUT/logs.tgz" logs xml units.txt share.json 2>/dev/null
tar -C "$A" -czf "$OUT/records.tgz" record
# The call's own cache back, pruned to what launches load, for the next call of the session (carry it as
# .kernel_cache/sm90_cache.tgz.*): it hits even where the CPU-built one cannot (another Triton build there).
python3 dev/device/kernel_cache.py prune --cache "$TRITON_CACHE_DIR" > /dev/null
tar -C / -czf /tmp/sm90_cache.tgz "${TRITON_CACHE_DIR#/}"
if [ "$(stat -c %s /tmp/sm90_cache.tgz)" -le $((60 * 1024 * 1024)) ]; then
  split -b 15M -d /tmp/sm90_cache.tgz "$OUT/sm90_cache.tgz."
else
  echo "kernel cache $(stat -c %s /tmp/sm90_cache.tgz) bytes: not returned" >> "$OUT/summary.md"
fi
cat "$OUT/summary.md"
