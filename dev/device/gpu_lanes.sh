#!/usr/bin/env bash
# One device call on the 2-GPU kind (nvidia-h200-x2): two lanes of sections in parallel, one per
# GPU, then sections that need both GPUs. Everything a section writes goes to /tmp/lanes/<lane>/;
# at the end it is packed into $OUT/lanes.tgz (the device tool returns at most 8 files) and every
# summary line is printed.
#
#   bash dev/device/gpu_lanes.sh "<GPU 0 sections>" "<GPU 1 sections>" "<2-GPU sections>"
#   e.g. GIT_COMMIT=abc1234 bash dev/device/gpu_lanes.sh "tune" "build qa:L1_jax_gpu" "tp jaxmesh"
# On a one-GPU machine give the second lane nothing (""), or set GPU1=0 to run it on the same GPU.
#
# Sections: qa:<level>[:files] (a qa level, optionally only some of its test files, e.g.
# qa:L1_pytorch_gpu:test_fused_attn,test_compile: how a level too long for one call is split),
# build (pip install -e ., PyTorch and JAX, native JAX FFI extension), check (the determinism
# check, both frameworks; CHECK_ARGS e.g. "--dtype bfloat16"), jaxsmoke (tests/jax/gpu_smoke.py), tune
# (dev/tuning/tune_tiles.py; TUNE_DIMS, e.g. 128,64 or 192v128 (d_qk 192, d_v 128); TUNE_SHAPES="4,16,4096;1,16,16384" times those shapes;
# TUNE_KERNELS=fwd the forward only; TUNE_MASKS=causal; TUNE_DV=1 dK and dV as two passes (tune_tiles.DV_CANDIDATES); TUNE_VARIANTS=head_group=1,2,4 or "tma=0,1;single_loop=0,1"
# sweeps Tiles fields of the planned tiles instead of the tile table), core (benchmarks/attention/bench_core.py), timeline
# (dev/tuning/step_timeline.py; TIMELINE_ARGS), ws (dev/tuning/ws_kernels.py: the Gluon kernels' errors and speed; WS_DIMS=256 at d=256), ncu (Nsight Compute over dev/tuning/ncu_step.py; NCU_ARGS), fa4 / fa4tests
# (install_flash_attn4.sh phase1 / phase2 + gpu_flash.sh tests), fa4phase2 (phase2 alone), bench (gpu_bench.sh parts in
# BENCH_PARTS), tetables (qa/L1_pytorch_te_tables; TE_TABLES_WORKERS, TE_TABLES_EXTRA e.g. "--tables softmax"), memcheck (qa/L1_memcheck), cpbench (benchmarks/attention/bench_context_parallel.py; CPBENCH_ARGS), cpprof
# (dev/tuning/cp_step_profile.py: device time per kernel, single call / thd / CP steps; CPPROF_ARGS), jtprof
# (dev/tuning/jax_torch_profile.py: device time per kernel of one fwd+bwd from PyTorch and from JAX; JTPROF_ARGS), hosttime
# (dev/tuning/host_time.py: host time per PyTorch call by layer: real launches, through the custom ops, stubbed), ordereddq
# (dev/tuning/ordered_dq.py: the one-pass backward with ordered dQ against the product's), ordereddqws (its Gluon
# warp-specialized form, ordered_dq_ws.py); 2-GPU: tp (torchrun tensor-parallel heads), jaxmesh (tests/jax/test_jax_two_device_mesh.py); several GPUs: qa:L1_distributed
# (context parallelism at CP 2/4/8 up to the GPU count and TP 2 over NCCL; QA_CP_SIZES, QA_CP_SUITES), cpscale
# (benchmarks/attention/bench_cp_scaling.py over every GPU: CP against one GPU at equal tokens, traces; CPSCALE_ARGS),
# cpscalejax (the same for JAX: bench_cp_scaling_jax.py), kvbench (bench_kv_chunk.py and bench_decode.py; DECODE_ARGS),
# hostbench (bench_host_time.py --compile), clients (megatron-core's tests, its wheel carried in .whl/clients;
# CLIENT_TESTS), stage (a part of another Triton release: install_triton.sh stage, and install once all three are there).
# Limits per section come from <SECTION>_TIMEOUT (seconds); the defaults suit a 600 s call. CORE_ARGS: extra
# bench_core.py arguments; GPU1: the second lane's GPU (default 1; 0 on a one-GPU machine); sleep:N waits;
# env:NAME=VALUE exports a variable for the lane's later sections (a forced plan: env:NVTE_FUSED_ATTN_PLAN_ARCH=sm80);
# triton:DIR puts the Triton release installed in DIR (install_triton.sh) first for the lane's later sections.
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
ROOT=$PWD
LANES=/tmp/lanes; rm -rf "$LANES"; mkdir -p "$LANES"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:$ROOT/tests/pytorch:${PYTHONPATH:-}
# NVLink multicast stays off on the shared GPU hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# JAX takes GPU memory as it needs it, so a JAX and a PyTorch process can share a lane.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
# Compiled kernels from an earlier call of the session: its $OUT/kernel_cache.tgz.* parts, copied here into
# .kernel_cache/ (ignored) and named in carry. Triton keys every entry by source, options and target, so a
# stale entry is never used; the call then skips the compiles (most of a cold fused-attention suite's time).
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if ls "$ROOT"/.kernel_cache/kernel_cache.tgz.* > /dev/null 2>&1; then
  cat "$ROOT"/.kernel_cache/kernel_cache.tgz.* | tar -C "$TRITON_CACHE_DIR" -xzf - 2>/dev/null
fi
# Most of a GPU suite's time is Triton compiling kernel variants on one CPU core: pytest-xdist
# workers (PYTEST_WORKERS, default 4 per lane; 0 = off) compile in parallel and share the GPU, for
# the qa levels. Not for the flash-attn-4 tests, which collect their per-config outcomes in one process.
if [ "${PYTEST_WORKERS:-4}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  export QA_PYTEST_ARGS="${QA_PYTEST_ARGS:-} -n ${PYTEST_WORKERS:-4}"
fi

note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LANES/$LANE/summary.txt"; }
# A section's limit: <SECTION>_TIMEOUT (else its default), cut to what is left before DEADLINE
# (seconds after start, default 560), so that the logs are packed before the call's 600 s run out.
limit() {
  local v="${1}_TIMEOUT" left
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  [ "$left" -lt 5 ] && left=5
  local want=${!v:-$2}
  echo $(( want < left ? want : left ))
}

section() {
  local s=$1 d=$LANES/$LANE
  case $s in
    build)
      NVTE_FRAMEWORK=all timeout "$(limit BUILD 240)" python3 -m pip install --no-build-isolation --no-deps -e . \
        > "$d/build.log" 2>&1
      note "build rc=$? $(python3 -c 'import transformer_engine.jax.primitives.gpu as g; print("jax ffi:", g.__name__)' 2>&1 | tail -1)" ;;
    check)
      NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 timeout "$(limit CHECK 120)" python3 -m transformer_engine.pytorch.determinism_check ${CHECK_ARGS:-} \
        > "$d/check_pytorch.txt" 2>&1
      note "determinism check (pytorch) rc=$? $(grep -m1 -E 'PASS|FAIL' "$d/check_pytorch.txt")"
      NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 timeout "$(limit CHECK 120)" python3 -m transformer_engine.jax.determinism_check ${CHECK_ARGS:-} \
        > "$d/check_jax.txt" 2>&1
      note "determinism check (jax) rc=$? $(grep -m1 -E 'PASS|FAIL' "$d/check_jax.txt")" ;;
    qa:*)  # qa:<level>[:file,file,...] runs qa/<level>/test.sh, optionally on those test files only
      local spec=${s#qa:} level files
      level=${spec%%:*}; files=""; [ "$spec" != "$level" ] && files=${spec#*:}
      QA_SELECT="${files//,/ }" XML_LOG_DIR=$d/xml_$level timeout "$(limit QA 400)" bash "qa/$level/test.sh" \
        > "$d/qa_$level.log" 2>&1
      note "qa $level${files:+ ($files)} rc=$? $(tail -1 "$d/qa_$level.log")" ;;
    jaxsmoke)
      timeout "$(limit JAXSMOKE 150)" python3 tests/jax/gpu_smoke.py > "$d/jaxsmoke.log" 2>&1
      note "jax smoke rc=$? $(tail -1 "$d/jaxsmoke.log")" ;;
    tune)
      timeout "$(limit TUNE 450)" python3 dev/tuning/tune_tiles.py "$d/tune.json" "${TUNE_DIMS:-128,64,256}" ${TUNE_VARIANTS:+"$TUNE_VARIANTS"} \
        > "$d/tune.log" 2>&1
      note "tune rc=$? $(wc -l < "$d/tune.log") lines" ;;
    core)
      # A repeated core section writes core2, core3, ...; CORE_ARGS e.g. "--peers ours_det".
      local n=""; while [ -e "$d/core$n.log" ]; do n=$(( ${n:-1} + 1 )); done
      (cd benchmarks/attention && timeout "$(limit CORE 150)" python3 bench_core.py --out "$d/core$n" ${CORE_ARGS:-}) \
        > "$d/core$n.log" 2>&1
      note "core$n bench rc=$? $(grep -h '4,16,4096,128 | causal | ours_det' "$d/core$n.md" 2>/dev/null)" ;;
    ws)  # the warp-specialized Gluon kernels against the Triton ones (dev/tuning/ws_kernels.py)
      timeout "$(limit WS 300)" python3 dev/tuning/ws_kernels.py --out "$d/ws_kernels${WS_DIMS:-}" \
        > "$d/ws_kernels${WS_DIMS:-}.log" 2>&1
      note "ws_kernels${WS_DIMS:-} rc=$? $(grep -c '^{' "$d/ws_kernels${WS_DIMS:-}.log") cases" ;;
    ordereddq)  # dev/tuning/ordered_dq.py: the one-pass backward with ordered dQ against the product's (a hang is a deadlock)
      timeout "$(limit ORDEREDDQ 420)" python3 dev/tuning/ordered_dq.py --out "$d/ordered_dq.json" \
        > "$d/ordered_dq.log" 2>&1
      note "ordered_dq rc=$? $(grep -c '^{' "$d/ordered_dq.log") rows" ;;
    ordereddqws)  # dev/tuning/ordered_dq_ws.py: the same, warp-specialized in Gluon at d=128 (a hang is a deadlock)
      # the unordered pass first and apart: a hang of the ordered one then keeps its rows
      for order in unordered highest-first rotated; do
        timeout "$(limit ORDEREDDQWS 200)" python3 dev/tuning/ordered_dq_ws.py --orders $order \
          --out "$d/ordered_dq_ws_$order.json" > "$d/ordered_dq_ws_$order.log" 2>&1
        note "ordered_dq_ws $order rc=$? $(grep -c '^{' "$d/ordered_dq_ws_$order.log") rows"
      done ;;
    timeline)  # step_timeline.py: a timed step's kernels and idle gaps; TIMELINE_ARGS e.g. "--preprocess 64x4,128x8"
      nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv > "$d/clocks.txt" 2>&1
      timeout "$(limit TIMELINE 120)" python3 dev/tuning/step_timeline.py --out "$d/timeline" \
        ${TIMELINE_ARGS:-} > "$d/timeline.log" 2>&1
      note "timeline rc=$? $(grep -h 'causal | ours_det' "$d/timeline.md" 2>/dev/null | cut -c1-160)" ;;
    ncu)  # Nsight Compute over the second step's forward, dK/dV and dQ (dev/tuning/ncu_step.py)
      timeout "$(limit NCU 200)" ncu --clock-control none \
        --kernel-name regex:"attn_(fwd|bwd_dkdv|bwd_dq)(_ws)?_kernel" --launch-skip 3 --launch-count 3 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section InstructionStats python3 dev/tuning/ncu_step.py ${NCU_ARGS:---causal} > "$d/ncu.txt" 2>&1
      note "ncu rc=$? $(grep -c 'attn_' "$d/ncu.txt") kernel lines" ;;
    fa4)
      bash dev/device/install_flash_attn4.sh phase1 > "$d/fa4.log" 2>&1; note "fa4 phase1 rc=$?" ;;
    fa4phase2)  # flash-attn-4's second phase without its tests (e.g. before a bench section in the same lane)
      bash dev/device/install_flash_attn4.sh phase2 >> "$d/fa4.log" 2>&1; note "fa4 phase2 rc=$? $(tail -1 "$d/fa4.log")" ;;
    fa4tests)
      bash dev/device/install_flash_attn4.sh phase2 >> "$d/fa4.log" 2>&1; note "fa4 phase2 rc=$? $(tail -1 "$d/fa4.log")"
      OUT=$d TEST_TIMEOUT=$(limit FA4TESTS 360) bash dev/device/gpu_flash.sh check tests > /dev/null 2>&1
      note "flash tests done (gpu_flash.sh lines above)" ;;
    bench|bench:*)  # bench:<part>,<part> names the parts (default: BENCH_PARTS, else all)
      local parts=${s#bench}; parts=${parts#:}; parts=${parts//,/ }
      # flash-attn-4 rows need phase2 (fa4tests, the other lane) to have installed it: wait for it.
      for _ in $(seq 1 "${FA4_WAIT:-0}"); do [ -f /tmp/site/fa4_env.sh ] && break; sleep 1; done
      OUT=$d BENCH_BUDGET=$(limit BENCH 520) bash dev/device/gpu_bench.sh ${parts:-${BENCH_PARTS:-all}} > "$d/bench_driver.log" 2>&1
      note "bench rc=$? $(tail -2 "$d/bench_driver.log" | head -1)" ;;
    tp)
      CUDA_VISIBLE_DEVICES=0,1 timeout "$(limit TP 120)" torchrun --standalone --nproc_per_node=2 \
        tests/pytorch/distributed/tp_attention.py > "$d/tp.log" 2>&1
      note "torchrun tp=2 rc=$? $(grep -c -i ' ok' "$d/tp.log") ok lines"; cat "$d/tp.log" | tail -8 >> "$d/summary.txt" ;;
    jaxmesh)
      CUDA_VISIBLE_DEVICES=0,1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 timeout "$(limit JAXMESH 180)" python3 -m pytest -q \
        -p no:cacheprovider tests/jax/test_jax_two_device_mesh.py > "$d/jaxmesh.log" 2>&1
      note "jax 2-GPU mesh rc=$? $(tail -1 "$d/jaxmesh.log")" ;;
    tetables)  # TransformerEngine's test tables through DotProductAttention (qa/L1_pytorch_te_tables)
      TE_TABLES_OUT=$d/te_tables TE_TABLES_ARGS="--workers ${TE_TABLES_WORKERS:-6} ${TE_TABLES_EXTRA:-}" timeout "$(limit TETABLES 400)" \
        bash qa/L1_pytorch_te_tables/test.sh > "$d/te_tables.log" 2>&1
      note "te tables rc=$? $(grep -m1 '^te_tables:' "$d/te_tables.log")" ;;
    memcheck)  # compute-sanitizer memcheck over every kernel variant (qa/L1_memcheck)
      timeout "$(limit MEMCHECK 300)" bash qa/L1_memcheck/test.sh > "$d/memcheck.log" 2>&1
      note "memcheck rc=$? $(grep -m1 -E 'ERROR SUMMARY|memcheck_kernels:' "$d/memcheck.log") $(tail -1 "$d/memcheck.log")" ;;
    cpbench)  # benchmarks/attention/bench_context_parallel.py: the one-process CP steps against the single call; CPBENCH_ARGS
      timeout "$(limit CPBENCH 240)" python3 benchmarks/attention/bench_context_parallel.py ${CPBENCH_ARGS:-} \
        > "$d/cpbench.md" 2>&1
      note "cp bench rc=$? $(grep -c '^| [0-9]' "$d/cpbench.md") rows" ;;
    cpscale)  # benchmarks/attention/bench_cp_scaling.py over every GPU of the machine (torchrun); CPSCALE_ARGS
      local n; n=$(nvidia-smi -L | grep -c "^GPU")
      timeout "$(limit CPSCALE 300)" python3 -m torch.distributed.run --standalone --nproc_per_node="$n" \
        benchmarks/attention/bench_cp_scaling.py --out "$d/cp_scaling.json" --trace "$d/cp_trace" ${CPSCALE_ARGS:-} \
        > "$d/cp_scaling.md" 2>&1
      note "cp scaling (${n} GPUs) rc=$? $(grep -c '^| [0-9]' "$d/cp_scaling.md") rows" ;;
    cpscalejax)  # benchmarks/attention/bench_cp_scaling_jax.py: JAX fused_attn on a cp mesh axis of every GPU
      timeout "$(limit CPSCALEJAX 300)" python3 benchmarks/attention/bench_cp_scaling_jax.py \
        --out "$d/cp_scaling_jax.json" --trace "$d/cp_trace_jax" ${CPSCALE_ARGS:-} > "$d/cp_scaling_jax.md" 2>&1
      note "cp scaling jax rc=$? $(grep -c '^| [0-9]' "$d/cp_scaling_jax.md") rows" ;;
    cpprof)  # dev/tuning/cp_step_profile.py: device time per kernel of the single call, thd, CP steps; CPPROF_ARGS
      timeout "$(limit CPPROF 200)" python3 dev/tuning/cp_step_profile.py ${CPPROF_ARGS:-} > "$d/cpprof.md" 2>&1
      note "cp profile rc=$? $(tail -4 "$d/cpprof.md" | tr '\n' ' ')" ;;
    jtprof)  # dev/tuning/jax_torch_profile.py: device time per kernel, PyTorch and JAX, one process; JTPROF_ARGS
      timeout "$(limit JTPROF 200)" python3 dev/tuning/jax_torch_profile.py ${JTPROF_ARGS:-} > "$d/jtprof.md" 2>&1
      note "jax/torch profile rc=$? $(tail -1 "$d/jtprof.md")" ;;
    hosttime)  # dev/tuning/host_time.py: host microseconds per call by layer, real launches, stubbed, via the ops
      for flags in "" "--op-dispatch" "--stub"; do
        timeout "$(limit HOSTTIME 60)" python3 dev/tuning/host_time.py $flags >> "$d/hosttime.log" 2>&1
      done
      # where the step's host time goes: functions by own time, and a trace of the threads
      timeout "$(limit HOSTTIME 90)" python3 dev/tuning/host_time.py --calls 100 --launch --profile --trace "$d/host_trace.json" \
        > "$d/hostprofile.log" 2>&1
      note "host time rc=$? $(grep -c 'fwd+bwd' "$d/hosttime.log") step lines" ;;
    kvbench)  # the inference benchmarks: bench_kv_chunk.py (the chunked sum's cost) and bench_decode.py; DECODE_ARGS
      (cd benchmarks/attention && timeout "$(limit KVCHUNK 120)" python3 bench_kv_chunk.py --out "$d/kv_chunk") \
        > "$d/kv_chunk.log" 2>&1
      note "kv_chunk bench rc=$? $(tail -1 "$d/kv_chunk.log")"
      (cd benchmarks/attention && timeout "$(limit DECODE 200)" python3 bench_decode.py --out "$d/decode" \
        ${DECODE_ARGS:---grid 1:8192,1:32768,1:131072,16:32768,64:8192 --page-size 16}) > "$d/decode.log" 2>&1
      note "decode bench rc=$? $(tail -1 "$d/decode.log")" ;;
    hostbench)  # benchmarks/attention/bench_host_time.py (eager and torch.compile), side by side with the peers
      (cd benchmarks/attention && timeout "$(limit HOSTBENCH 150)" python3 bench_host_time.py --compile) \
        > "$d/host_time.log" 2>&1
      note "host time bench rc=$? $(grep -c . "$d/host_time.log") lines" ;;
    clients)  # the TE clients' tests with their wheels carried in .whl/clients (megatron-core): CLIENT_TESTS
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_clients .whl/clients/*.whl \
        > "$d/clients_install.log" 2>&1
      PYTHONPATH=/tmp/site_clients:$PYTHONPATH timeout "$(limit CLIENTS 200)" python3 -m pytest -q -p no:cacheprovider \
        ${CLIENT_TESTS:-tests/pytorch/test_megatron_inference.py tests/pytorch/test_megatron_gpt.py} > "$d/clients.log" 2>&1
      note "clients rc=$? $(tail -1 "$d/clients.log")" ;;
    stage)  # a carried part of another Triton release (install_triton.sh stage; the last part also installs)
      bash dev/device/install_triton.sh stage > "$d/stage.log" 2>&1
      [ "$(ls /tmp/triton_parts/triton.tar.xz.part* 2>/dev/null | wc -l)" = 3 ] && bash dev/device/install_triton.sh install >> "$d/stage.log" 2>&1
      note "stage $(tail -1 "$d/stage.log")" ;;
    env:*) export "${s#env:}"; note "export ${s#env:}" ;;
    triton:*)  # triton:/tmp/site_triton: another Triton release first on the path for the lane's later sections
      export PYTHONPATH="${s#triton:}:$PYTHONPATH"
      note "triton $(python3 -c 'import triton; print(triton.__version__, triton.__file__)' 2>&1 | tail -1)" ;;  # e.g. env:NVTE_FUSED_ATTN_PLAN_ARCH=sm80 for the lane's later sections
    sleep:*) sleep "${s#sleep:}" ;;  # e.g. keep a shared GPU quiet while the other lane benchmarks
    *) note "unknown section $s" ;;
  esac
}

lane() {  # lane NAME GPU SECTIONS
  LANE=$1; mkdir -p "$LANES/$LANE"
  export CUDA_VISIBLE_DEVICES=$2
  for s in $3; do section "$s"; done
}

# The device copy's git metadata can be stale (it read the session's first commit in every call of
# session 2): pass GIT_COMMIT=<sha> in the command; the benchmark tables take it too.
{ date -u; echo "commit ${GIT_COMMIT:-unknown (set GIT_COMMIT)}; git there says $(git rev-parse --short HEAD 2>/dev/null)"; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__, 'jax', jax.__version__)"
} > "$LANES/env.txt" 2>&1
# A build listed in either lane runs first, alone: the other lane's tests need what it builds. JAX
# sections (and L3, which holds JAX tests) need the native FFI extension: build it when it is missing
# even if no lane lists build (a fresh machine has none; session 5 lost a run to that).
L0=" ${1:-} " L1=" ${2:-} "
if [[ "$L0$L1" =~ (L1_jax_gpu|L3_determinism|jaxsmoke|jaxmesh|" check ") ]] && [[ "$L0$L1" != *" build "* ]] \
   && ! python3 -c "import transformer_engine.jax.transformer_engine_jax_ffi" 2>/dev/null; then
  L0="${L0}build "
fi
if [[ "$L0$L1" == *" build "* ]]; then
  lane setup 0 build
  L0=${L0// build / } L1=${L1// build / }
fi
(lane gpu0 0 "$L0") &
(lane gpu1 "${GPU1:-1}" "$L1") &  # GPU1=0 shares the one GPU of nvidia-h200 (tests only, or sleep:N)
wait
[ -n "${3:-}" ] && lane both 0,1 "$3"

cat "$LANES/env.txt"; for f in "$LANES"/*/summary.txt; do echo "== $f"; cat "$f"; done | tee "$OUT/summary.txt"
tar -C "$LANES" -czf "$OUT/lanes.tgz" .
# The kernel cache back, in 15 MiB parts (the tool returns 8 files of 16 MiB, 64 MiB together), unless
# KERNEL_CACHE=0 or it is over 45 MiB packed.
if [ "${KERNEL_CACHE:-1}" != 0 ]; then
  tar -C "$TRITON_CACHE_DIR" -czf /tmp/kernel_cache.tgz . 2>/dev/null
  if [ "$(stat -c %s /tmp/kernel_cache.tgz)" -le $((45 * 1024 * 1024)) ]; then
    split -b 15M -d /tmp/kernel_cache.tgz "$OUT/kernel_cache.tgz."
  else
    echo "kernel cache over 45 MiB packed: not returned" | tee -a "$OUT/summary.txt"
  fi
fi
ls -la "$OUT"
