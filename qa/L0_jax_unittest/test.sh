#!/usr/bin/env bash
# L0 (CPU): JAX frontend tests, sharding over 8 host devices; Triton (where used) interpreted.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

qa_pytest_files jax "tests/jax/test_*.py" \
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 TRITON_INTERPRET=1

qa_finish
