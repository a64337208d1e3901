#!/usr/bin/env bash
# Fetch (here, with internet) the wheels the attention benchmark's peers need on the GPU machine
# (Python 3.12, manylinux x86_64, no internet) into .whl/bench/ at the repo root. Never commit them:
# /.whl/ is ignored. Each device call that needs them names .whl/bench in `carry` (12 MB);
# dev/device/gpu_bench.sh installs whatever .whl/bench/ holds into /tmp/site_bench before it runs.
#
#   bash dev/device/fetch_bench_wheels.sh            # nvidia-cudnn-frontend (the cuDNN det peer)
#   CUDNN_FE_VERSION=1.32.0 bash dev/device/fetch_bench_wheels.sh
#
# nvidia-cudnn-frontend 1.32 declares nvidia-cutlass-dsl and apache-tvm-ffi as dependencies; its
# graph API (pygraph sdpa / sdpa_backward, what peers.py uses) imports neither, so they are not
# fetched (--no-deps). flash-attn-4 and its CuTe DSL are the FlashAttention backend's: .whl/fa4/ from
# dev/device/fetch_flash_attn4_wheels.sh, installed by dev/device/install_flash_attn4.sh (two
# calls). The machine already has cuDNN itself (nvidia-cudnn-cu13).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${CUDNN_FE_VERSION:-1.32.0}
mkdir -p .whl/bench
grep -qx '/.whl/' .gitignore 2>/dev/null || grep -qx '/.whl/' .git/info/exclude 2>/dev/null \
  || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl/bench "nvidia-cudnn-frontend==${VERSION}"
ls -la .whl/bench
du -sh .whl/bench  # a device call carries at most 64 MiB of working tree in all
