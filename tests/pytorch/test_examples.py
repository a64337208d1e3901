"""The PyTorch scripts in examples/ run (on CPU here, unfused and fast; on a GPU with the fused kernels)
and print their verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # seconds, not minutes, on CPU
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True, text=True,
                          env=env, cwd=str(REPO), timeout=600)


# On CPU nothing is captured or replayed, and the script must say so, not "replayed" (issue 69).
DECODE_GRAPH_VERDICT = (("one CUDA graph captured, replayed 12 times", "replayed steps equal eager steps bitwise: True")
                        if torch.cuda.is_available() else
                        ("CPU: no CUDA graph was captured or replayed", "static-buffer steps equal fresh eager steps "
                         "bitwise: True"))


@pytest.mark.parametrize("name, args, verdict", [
    ("pytorch_attention.py", ("--seq-len", "32"), "gradients bitwise equal: True"),
    ("pytorch_compile.py", (), "close: True"),
    ("pytorch_fsdp_checkpoint.py", (), "equals the single-process run bitwise: True"),
    ("pytorch_generate_logprobs.py", (), "log-probs of serving and training bitwise equal: True"),
    ("pytorch_generate_logprobs.py", ("--paged",), "log-probs of serving and training bitwise equal: True"),
    ("pytorch_decode_graph.py", (), DECODE_GRAPH_VERDICT),
    ("pytorch_decode_graph.py", ("--paged",), DECODE_GRAPH_VERDICT),
    pytest.param("huggingface_llama.py", ("--steps", "2", "--seq-len", "16"), "two runs bitwise equal: True",
                 marks=pytest.mark.skipif(
                     __import__("importlib").util.find_spec("transformers") is None, reason="needs transformers")),
])
def test_example_runs(name, args, verdict):
    proc = run_example(name, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in (verdict,) if isinstance(verdict, str) else verdict:
        assert line in proc.stdout, proc.stdout
    if name == "pytorch_decode_graph.py" and not torch.cuda.is_available():
        assert "replayed steps" not in proc.stdout, proc.stdout


def test_huggingface_example_without_transformers_prints_the_install_hint():
    """Without transformers the example says what to install (exit 2), as megatron_gpt.py does without
    megatron-core, instead of a bare ModuleNotFoundError (issue 69)."""
    script = REPO / "examples" / "huggingface_llama.py"
    hide = ("import runpy, sys; sys.modules['transformers'] = None; "  # None in sys.modules: the import fails
            f"sys.argv = [{str(script)!r}]; runpy.run_path(sys.argv[0], run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, env=env, cwd=str(REPO),
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == 'transformers is not installed: pip install "transformers>=4.56" (or ".[hf]" from ' \
        "the repository's root)", proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_pytorch_example_is_tested():
    # megatron_gpt.py and megatron_decode_graph.py are run by test_megatron_gpt.py, with the megatron-core tests
    # (Python 3.12); accelerate_fp8.py by test_accelerate.py, with the transformer-engine alias it needs;
    # te_quickstart_pytorch.py by test_transformer_layer.py.
    tested = {"pytorch_attention.py", "pytorch_compile.py", "pytorch_fsdp_checkpoint.py", "huggingface_llama.py",
              "pytorch_generate_logprobs.py", "pytorch_decode_graph.py", "megatron_gpt.py", "megatron_decode_graph.py",
              "accelerate_fp8.py", "te_quickstart_pytorch.py"}
    scripts = {p.name for p in (REPO / "examples").glob("*.py") if not p.name.startswith(("flax", "jax", "te_jax"))}
    assert scripts == tested, scripts
