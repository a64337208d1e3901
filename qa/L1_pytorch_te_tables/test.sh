#!/usr/bin/env bash
# L1 (GPU): TransformerEngine's PyTorch attention test tables through DotProductAttention, every case
# in a worker process that is replaced when a case kills it (tests/pytorch/run_te_tables.py). Fails on
# any numerical failure, unexpected error or crash; refused cases are listed with their reason.
# TE_TABLES_OUT: where results.jsonl and summary.md go (default: next to the JUnit XML).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
qa_require_gpu

qa_run te_tables env TRITON_INTERPRET=0 "$PYTHON" tests/pytorch/run_te_tables.py \
  --out "${TE_TABLES_OUT:-$XML_LOG_DIR/te_tables}" ${TE_TABLES_ARGS:-}

qa_finish
