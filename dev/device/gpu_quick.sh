#!/usr/bin/env bash
# A short single-GPU check: the KV-cache suites (PyTorch, JAX), the max logit, the score-modifier (bias/ALiBi)
# cases of the kernel suites, the NVTE_DEBUG plan log. PyTorch runs from the tree; JAX's fused path needs the
# native FFI extension, built first (~30 s). Results in $OUT.
#   bash dev/device/gpu_quick.sh [extra pytest paths...]
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests/pytorch:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton_cache
python - <<'PY' > "$OUT/env.txt" 2>&1
import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
PY
[ -f dev/device/kv_probe.py ] && timeout ${PROBE_TIMEOUT:-120} python dev/device/kv_probe.py > "$OUT/kv_probe.txt" 2>&1
PYTEST_N=""
python -c "import xdist" 2>/dev/null && PYTEST_N="-n 4"
# QUICK_FILES replaces the PyTorch files; QUICK_K="" selects every test of them.
QUICK_FILES=${QUICK_FILES:-"tests/pytorch/test_kv_cache.py tests/pytorch/test_max_logit.py tests/pytorch/test_fused_attn.py
  tests/pytorch/test_dot_product_attention.py tests/pytorch/test_dpa_te_compat.py"}
K=${QUICK_K-kv_cache or alibi or bias or prefill or decode or max_logit}
timeout ${QUICK_TIMEOUT:-240} python -m pytest -q -p no:cacheprovider $PYTEST_N --junitxml="$OUT/quick.xml" \
  $QUICK_FILES ${K:+-k "$K"} "$@" > "$OUT/quick.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed" "$OUT/quick.log" | tail -n 1
grep -E "^FAILED" "$OUT/quick.log" | head -n 20
# The JAX KV cache and max logit on the GPU kernels, PyTorch == JAX for a step and a max logit (its own
# process: JAX and torch share the GPU).
NVTE_FRAMEWORK=all pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || echo "build failed"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${JAX_TIMEOUT:-150} python -m pytest -q -p no:cacheprovider \
  --junitxml="$OUT/quick_jax.xml" tests/jax/test_jax_kv_cache.py tests/jax/test_jax_max_logit.py \
  > "$OUT/quick_jax.log" 2>&1
echo "jax pytest rc=$?"
grep -E "passed|failed" "$OUT/quick_jax.log" | tail -n 1
grep -E "^FAILED" "$OUT/quick_jax.log" | head -n 10
NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1 timeout 60 python - <<'PY' 2>&1 | grep -m 2 -E "fused attention plan|Error"
import torch
from transformer_engine.pytorch import DotProductAttention
q = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
DotProductAttention(4, 64, qkv_format="bshd")(q, q, q)
PY
