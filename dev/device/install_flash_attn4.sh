#!/usr/bin/env bash
# Install flash-attn-4 on the GPU machine from wheels carried in two device calls.
# The wheels come from dev/device/fetch_flash_attn4_wheels.sh (run here first: it fills .whl/fa4/).
#
#   call 1 (carry .whl/fa4/small, .whl/fa4/part1):  bash dev/device/install_flash_attn4.sh phase1
#   call 2 (carry .whl/fa4/part2):                  bash dev/device/install_flash_attn4.sh phase2 && ...
#
# phase1 copies the small wheels and the first half of the libs-cu13 wheel to /tmp/fa4_wheels;
# phase2 adds the second half, reassembles the wheel, checks every wheel against SHA256SUMS, installs
# them all with pip into /tmp/site (--no-index --no-deps --target) and writes /tmp/site/fa4_env.sh,
# which puts /tmp/site and /tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH (pip --target does
# not process the .pth file that would add the latter). Call 2 must come while the machine from
# call 1 is still warm (the device tool keeps it about 30 s after a call): /tmp does not survive a
# new machine. `all` runs both phases in one call when everything is carried together.
# Without an argument (or `env`), and when sourced (`. dev/device/install_flash_attn4.sh`), it only
# exports that PYTHONPATH, if phase2 has installed flash-attn-4 on this machine.
# Environment: FA4_STAGE (default /tmp/fa4_wheels), FA4_TARGET (default /tmp/site).
SRC=.whl/fa4
STAGE=${FA4_STAGE:-/tmp/fa4_wheels}
TARGET=${FA4_TARGET:-/tmp/site}

phase1() {
  [ -d "$SRC/small" ] && [ -d "$SRC/part1" ] || { echo "phase1: carry .whl/fa4/small and .whl/fa4/part1"; return 2; }
  rm -rf "$STAGE" && mkdir -p "$STAGE" || return 1
  cp "$SRC"/small/* "$SRC"/part1/* "$STAGE"/ || return 1
  echo "phase1: staged in $STAGE:"; ls -l "$STAGE"
}

phase2() {
  [ -d "$SRC/part2" ] || { echo "phase2: carry .whl/fa4/part2"; return 2; }
  [ -d "$STAGE" ] || { echo "phase2: $STAGE is missing: run phase1 on this machine first (a new machine starts bare)"; return 2; }
  cp "$SRC"/part2/* "$STAGE"/ || return 1
  local big
  big=$(cat "$STAGE/BIG_WHEEL")
  [ -f "$STAGE/$big.part00" ] && [ -f "$STAGE/$big.part01" ] || { echo "phase2: halves of $big missing"; return 2; }
  cat "$STAGE/$big.part00" "$STAGE/$big.part01" > "$STAGE/$big" && rm "$STAGE/$big".part0[01]
  (cd "$STAGE" && sha256sum -c --quiet SHA256SUMS) || { echo "phase2: checksum mismatch"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" \
    "$STAGE"/*.whl || return 1
  cat > "$TARGET/fa4_env.sh" <<EOF
export PYTHONPATH=$TARGET:$TARGET/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}
EOF
  # shellcheck disable=SC1091
  source "$TARGET/fa4_env.sh"
  echo "phase2: installed in $TARGET; present on the machine:"
  python3 -m pip show torch einops cuda-bindings cuda-pathfinder protobuf typing-extensions 2>/dev/null \
    | grep -E '^(Name|Version):' | paste - - | sed 's/^/  /'
  python3 - <<'EOF'
import time
t = time.time()
import flash_attn.cute as fa
import importlib.metadata as md
print(f"phase2: import flash_attn.cute ok ({time.time() - t:.1f} s); flash-attn-4 {md.version('flash-attn-4')}, "
      f"nvidia-cutlass-dsl {md.version('nvidia-cutlass-dsl')}, quack-kernels {md.version('quack-kernels')}")
EOF
  # The JAX route (transformer_engine/jax/flash_backend.py) needs nothing more: say whether it can run.
  PYTHONPATH=$PWD:$PYTHONPATH python3 -c "from transformer_engine.jax import flash_backend as f; \
r = f.unavailable_reason(); print('phase2: JAX route ' + ('available' if r is None else 'unavailable: ' + r))" \
    || echo "phase2: JAX route not checked (transformer_engine.jax did not import)"
}

fa4_env() {
  if [ -f "$TARGET/fa4_env.sh" ]; then
    # shellcheck disable=SC1091
    source "$TARGET/fa4_env.sh"
  else
    echo "flash-attn-4 is not installed in $TARGET (install_flash_attn4.sh phase1, then phase2)" >&2
    return 1
  fi
}

case ${1:-env} in
  phase1) phase1 ;;
  phase2) phase2 ;;
  all) phase1 && phase2 ;;
  env) fa4_env ;;
  *) echo "usage: install_flash_attn4.sh [phase1|phase2|all|env]" >&2; false ;;
esac
