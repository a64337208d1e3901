"""Every Python code block of the FP8 pages (docs/fp8.rst, docs/fp8_jax.rst, docs/fp8_attention.rst) runs as
written, each in a fresh interpreter, on this machine (the CPU in CI: TRITON_INTERPRET=1 for the attention
kernels, as the page says)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("fp8.rst", "fp8_jax.rst", "fp8_attention.rst")


def code_blocks(page: str):
    """The ``.. code-block:: python`` blocks of a page, dedented."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if re.match(r"\.\. code-block:: python\s*$", lines[i]):
            i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                body.append(lines[i])
                i += 1
            blocks.append(textwrap.dedent("\n".join(body)).strip() + "\n")
        else:
            i += 1
    return blocks


CASES = [(page, n) for page in PAGES for n in range(len(code_blocks(page)))]


def test_each_page_has_a_block():
    assert {page for page, _ in CASES} == set(PAGES)


@pytest.mark.parametrize("page,index", CASES, ids=[f"{p}[{n}]" for p, n in CASES])
def test_fp8_doc_block_runs_as_written(page, index):
    code = code_blocks(page)[index]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"docs/{page} block {index}:\n{code}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
