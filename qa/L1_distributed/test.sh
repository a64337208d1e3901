#!/usr/bin/env bash
# L1 (several GPUs): DotProductAttention across GPUs over NCCL, one process per GPU. Context parallelism
# (tests/pytorch/distributed/cp_attention.py) at each CP size of QA_CP_SIZES (default "2 4 8", those the
# GPUs allow): bf16 training shapes, every cp_comm_type and format, bitwise against the one-GPU call and over a
# repeat, and the bad-input errors (QA_CP_SUITES, default "gpu errors"; "gpu128k" adds a 131072-token
# sequence). Tensor-parallel heads (tests/pytorch/distributed/tp_attention.py) on 2 GPUs. With 8 GPUs, JAX's
# context-parallel suite (tests/jax/test_jax_context_parallel.py: cp 2/4/8 and dp x cp meshes) on them. GPUs are
# counted with nvidia-smi, so a CUDA_VISIBLE_DEVICES of the caller does not hide them.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "$gpus" -lt 2 ]; then
  echo "SKIPPED: ${QA_LEVEL} needs 2 or more GPUs, this machine has ${gpus}; nothing was run"
  exit 0
fi

for n in ${QA_CP_SIZES:-2 4 8}; do
  if [ "$n" -gt "$gpus" ]; then
    qa_log "cp=$n: not run (${gpus} GPUs)"
    continue
  fi
  qa_run "cp_attention cp=$n" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$n" tests/pytorch/distributed/cp_attention.py \
    ${QA_CP_SUITES:-gpu errors}
done
qa_run "tp_attention tp=2" env CUDA_VISIBLE_DEVICES=0,1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 \
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 tests/pytorch/distributed/tp_attention.py
if [ "$gpus" -ge 8 ]; then
  # One process holds all eight GPUs: no xdist workers, and JAX allocates as it goes.
  # shellcheck disable=SC2207
  serial=($(qa_serial_args))
  qa_pytest "jax/test_jax_context_parallel (8 GPUs)" CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
    XLA_PYTHON_CLIENT_PREALLOCATE=false -- "${serial[@]}" tests/jax/test_jax_context_parallel.py
else
  qa_log "jax/test_jax_context_parallel: not run (${gpus} GPUs, it needs 8)"
fi

qa_finish
