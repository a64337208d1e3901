"""DotProductAttention under PyTorch's training wrappers, in deterministic mode: activation
checkpointing (``torch.utils.checkpoint``, reentrant and not, and ``checkpoint_core_attention``),
DDP and FSDP2 (``fully_shard``), on CPU.

Checkpointing recomputes the forward in the backward; a deterministic forward recomputes the same
activations (and, with dropout, the same mask: checkpointing restores torch's RNG state), so the
gradients equal the plain run's bitwise. DDP and FSDP2 run in two gloo processes
(tests/pytorch/distributed/data_parallel.py): with the same data on both ranks the averaged
gradient is g / 2 + g / 2 = g exactly, so training equals the single-process run bitwise; with the
batch split over the ranks two runs are bitwise equal and close to the single process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dpa_helpers import DEVICE, INTERPRET, ON_GPU

from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLayer

HERE = os.path.dirname(__file__)
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

FUSED_AVAILABLE = ON_GPU or INTERPRET
BACKENDS = [
    pytest.param("fused", marks=pytest.mark.skipif(
        not FUSED_AVAILABLE, reason="fused kernels need a GPU, or TRITON_INTERPRET=1 (CPU interpreter)")),
    "unfused",
]
BACKEND_NAME = {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}
# Forcing one backend: the others are disabled, and a forced backend never falls back silently.
FORCE = {
    "fused": {"NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0"},
    "unfused": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"},
}
CFG = TinyConfig(hidden_size=32, num_layers=1, num_attention_heads=2, num_gqa_groups=1)
DTYPE = torch.bfloat16 if ON_GPU else torch.float32


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    for name, value in FORCE[request.param].items():
        monkeypatch.setenv(name, value)
    return request.param


def _block(seed: int = 0) -> TinyTransformerLayer:
    torch.manual_seed(seed)
    return TinyTransformerLayer(CFG, layer_number=1).to(DEVICE, DTYPE)


def _inputs(b: int = 2, s: int = 16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, CFG.hidden_size, generator=g).to(DEVICE, DTYPE)
    d_out = torch.randn(b, s, CFG.hidden_size, generator=g).to(DEVICE, DTYPE)
    return x, d_out


def _grads(module: torch.nn.Module, forward, x: torch.Tensor, d_out: torch.Tensor):
    """Output, input gradient and every parameter gradient of ``forward(x)``."""
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = forward(x)
    out.backward(d_out)
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


def _assert_bitwise(got, want, what: str):
    assert len(got) == len(want)
    diff = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not diff, f"{what}: tensors {diff} differ (0 = output, 1 = input grad, then parameters)"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_block_equals_plain_block_bitwise(backend, use_reentrant):
    block = _block()
    x, d_out = _inputs()
    plain = _grads(block, block, x, d_out)
    assert block.attention.last_backend == BACKEND_NAME[backend]
    recomputed = _grads(block, lambda t: checkpoint(block, t, use_reentrant=use_reentrant), x, d_out)
    assert block.attention.last_backend == BACKEND_NAME[backend]
    _assert_bitwise(recomputed, plain, f"checkpoint(use_reentrant={use_reentrant})")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_checkpoint_core_attention_equals_plain_attention_bitwise(backend):
    b, s, h, hk, d = 2, 16, 2, 1, 16
    g = torch.Generator().manual_seed(2)
    q, k, v, d_out = (torch.randn(*shape, generator=g).to(DEVICE, DTYPE)
                      for shape in ((b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h * d)))
    dpa = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd", attn_mask_type="causal")

    def run(**kwargs):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dpa(*leaves, **kwargs)
        out.backward(d_out)
        assert dpa.last_backend == BACKEND_NAME[backend]
        return [out.detach()] + [t.grad for t in leaves]

    _assert_bitwise(run(checkpoint_core_attention=True), run(), "checkpoint_core_attention=True")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recomputes_the_same_dropout_mask(backend, use_reentrant):
    """Attention dropout under checkpointing: the recomputed forward draws the same mask."""
    torch.manual_seed(0)
    block = TinyTransformerLayer(CFG, layer_number=1)
    block.attention.attention_dropout = 0.25
    block = block.to(DEVICE, DTYPE).train()
    x, d_out = _inputs()

    def seeded(forward):
        def run(t):
            torch.manual_seed(7)
            return forward(t)
        return run

    plain = _grads(block, seeded(block), x, d_out)
    assert block.attention.last_backend == BACKEND_NAME[backend]
    block.attention.attention_dropout = 0.0
    undropped = _grads(block, seeded(block), x, d_out)
    assert not torch.equal(plain[0], undropped[0]), "dropout had no effect: the test would prove nothing"
    block.attention.attention_dropout = 0.25
    recomputed = _grads(block, seeded(lambda t: checkpoint(block, t, use_reentrant=use_reentrant)), x, d_out)
    _assert_bitwise(recomputed, plain, f"dropout under checkpoint(use_reentrant={use_reentrant})")


# --- DDP and FSDP2, two gloo processes --------------------------------------------------------

# Every check with the unfused backend (seconds); with the fused kernels under Triton's
# interpreter (tens of seconds per check on CPU) one DDP and one FSDP2 check.
FUSED_CASES = ["fused:ddp:none", "fused:fsdp2:non-reentrant"]
UNFUSED_CHECKS = 2 + 2 * 4  # single x 2 checkpointings; ddp, fsdp2 x (3 checkpointings + split batch)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_ddp_and_fsdp2_match_the_single_process_run():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    fused = INTERPRET and not ON_GPU  # the script runs on CPU; on CPU fused needs the interpreter
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "distributed", "data_parallel.py"), "--backends", "unfused"]
    if fused:
        cmd += ["--cases", ",".join(FUSED_CASES)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and all(line.startswith("PASS") for line in lines), report
    assert len(lines) == UNFUSED_CHECKS + (len(FUSED_CASES) if fused else 0), report
    for kind in ("ddp", "fsdp2"):
        assert sum(line.startswith(f"PASS {kind} ") for line in lines) >= 4, report
    if fused:
        assert sum("backend=FusedAttention" in line for line in lines) == len(FUSED_CASES), report
