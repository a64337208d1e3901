#!/usr/bin/env bash
# L1 (CPU): every CPU level with the whole of each test grid: the L0 levels (what CI runs) plus the grids'
# `wide` cases (tests/case_grid.py; among them every (target, case) pair of the compile matrix, with each
# Triton release), and in the newest environment every JAX file and three more PyTorch files. About twice
# L0_all's time; run it before a release and after changing kernels, plans or launch code.
export QA_WIDE=1
exec bash "$(dirname "${BASH_SOURCE[0]}")/../L0_all/test.sh" "$@"
