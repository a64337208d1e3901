#!/usr/bin/env bash
# L0 (CPU): framework-free tests (settings, env-var docs, imports, build) and the docs build.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

qa_pytest_files common "tests/common/test_*.py"
DOCS_OUT="$(mktemp -d "${TMPDIR:-/tmp}/te_docs.XXXXXX")"
qa_run docs/sphinx-W "$PYTHON" -m sphinx -W --keep-going -q -b html docs "$DOCS_OUT"

qa_finish
