#!/usr/bin/env bash
# L0 (CPU) on the newest supported releases: Python 3.12 with requirements/test-newest.txt (the
# current torch, its Triton, the current JAX and flax, Megatron-core) in a virtual environment of its
# own, made on first use. The other L0 levels run the oldest supported releases (requirements/test.txt
# in the interpreter that runs them). Here run: the framework-free suites (the compile matrix, the wheel's
# resolution beside the CUDA torch releases), the PyTorch files that
# exercise what changes between releases (kernels under the interpreter, torch.compile, the launcher)
# and TransformerEngine's clients (Megatron-core, MaxText's calls), and the JAX files but the KV-cache and
# max-logit ones (numerics through calls the others make). QA_WIDE=1 adds those and three PyTorch files.
#
# Environment (optional): PYTHON_NEWEST (a Python 3.12 interpreter; default: python3.12, else the
# newest 3.12 that pyenv has), NEWEST_VENV (default .venv-newest in the repository root),
# NEWEST_COMMON / NEWEST_PYTORCH (test file names without .py, overriding the lists below), QA_WIDE=1 (every
# JAX file, three more PyTorch files, and the test grids' wide cases: what qa/L1_cpu_wide runs).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

find_python312() {
  local cand
  for cand in "${PYTHON_NEWEST:-}" python3.12; do
    [ -n "$cand" ] && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo "$cand"; return 0; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    for cand in $(ls -d "$(pyenv root)"/versions/3.12*/bin/python 2>/dev/null | sort -V -r); do
      "$cand" -c 'import sys' 2>/dev/null && { echo "$cand"; return 0; }
    done
  fi
  return 1
}

VENV="${NEWEST_VENV:-$QA_ROOT/.venv-newest}"
if ! BASE=$(find_python312); then
  QA_SUITES=$((QA_SUITES + 1)); QA_FAILED_TESTS=$((QA_FAILED_TESTS + 1))
  qa_fail "python3.12" "no Python 3.12 found: set PYTHON_NEWEST"
  qa_finish
fi

install_newest() {
  [ -x "$VENV/bin/python" ] || "$BASE" -m venv "$VENV" || return 1
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q -U pip || return 1
  # The package index as a user sees it: a machine-wide pip configuration (a constraint on torch for
  # local wheels of another Python) must not decide what this environment gets.
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q -r requirements/test-newest.txt || return 1
  NVTE_FRAMEWORK=all PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e . || return 1
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("newest environment:", ", ".join(f"{n} {md.version(n)}" for n in ("torch", "triton", "jax", "jaxlib", "flax", "numpy", "megatron-core")))
PY
}
qa_run install-newest install_newest
PYTHON="$VENV/bin/python"

select_files() {  # select_files DIR NAMES...: the paths of those test files that exist
  local dir="$1" name; shift
  for name in "$@"; do [ -f "$dir/$name.py" ] && echo "$dir/$name.py"; done
}

# The compile matrix, the plan and launch tables, the import rules, and the wheel's resolution.
# (test_build and test_install_routes check this tree's packaging, which the release does not change.)
COMMON=(${NEWEST_COMMON:-test_kernel_compile test_kernel_compile_archs test_triton_compat test_plan test_plan_archs
  test_explain_plan test_context_parallel_plan test_launches test_block_bounds test_backends test_imports
  test_import_graph test_settings test_wheel_resolution})
PYTORCH_DEFAULT="test_megatron_gpt test_megatron_fp8 test_megatron_inference test_dpa_megatron test_megatron_fp8_attention test_te_modules test_fused_attn
  test_launch_cache test_compile test_unfused_invariance test_interpreter_dot test_moe_megatron_fused test_megatron_te_flags
  test_moe_megatron_grouped test_moe_megatron_op_fuser"
[ "${QA_WIDE:-0}" = 1 ] && PYTORCH_DEFAULT+=" test_dot_product_attention test_dpa_te_compat test_sink_softmax"
PYTORCH=(${NEWEST_PYTORCH:-$PYTORCH_DEFAULT})
# Every JAX file but these (the oldest environment runs them; QA_WIDE=1 runs them here too).
JAX_LEFT_OUT="test_jax_kv_cache test_jax_paged_kv test_jax_max_logit"
[ "${QA_WIDE:-0}" = 1 ] && JAX_LEFT_OUT=""

for file in $(select_files tests/common "${COMMON[@]}"); do
  qa_pytest "newest-common/$(basename "$file" .py)" -- "$file"
done
for file in $(select_files tests/pytorch "${PYTORCH[@]}"); do
  qa_pytest "newest-pytorch/$(basename "$file" .py)" TRITON_INTERPRET=1 -- "$file"
done
QA_SELECT="" QA_SKIP="$JAX_LEFT_OUT" qa_pytest_files newest-jax "tests/jax/test_*.py" \
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 TRITON_INTERPRET=1

qa_finish
