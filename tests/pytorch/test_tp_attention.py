"""Tensor-parallel heads (two processes) equal the single-process run bitwise (deterministic mode).

On two GPUs the same script runs with NCCL (``torchrun --nproc_per_node=2``); on the CPU it runs with gloo
and the fused kernels under the Triton interpreter.
"""

import os
import subprocess
import sys

import pytest
import torch

from fused_helpers import requires_fused

HERE = os.path.dirname(__file__)


@requires_fused
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="one GPU visible: NCCL needs a GPU per rank (two GPUs run it through torchrun)")
def test_tensor_parallel_heads_match_single_process_bitwise():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(os.path.join(HERE, "..", "..")), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "distributed", "tp_attention.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("PASS", "FAIL"))]
    assert proc.returncode == 0 and lines and all(l.startswith("PASS") for l in lines), proc.stdout + proc.stderr[-3000:]
    assert all("backend=FusedAttention" in l for l in lines), lines
