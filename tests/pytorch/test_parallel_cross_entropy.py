"""transformer_engine.pytorch.cross_entropy.parallel_cross_entropy against
torch.nn.functional.cross_entropy in float64 (label smoothing, ignore index, mean over the
non-ignored tokens), forward and gradient; bitwise run to run; two gloo ranks splitting the
vocabulary (tests/pytorch/distributed/cross_entropy_vocab_parallel.py)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
B, SQ, V = 2, 8, 40


def data(dtype=torch.float32, ignore_idx=-100):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, SQ, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (B, SQ), generator=g)
    target[0, 2] = ignore_idx
    target[1, 5] = ignore_idx
    return logits, target, torch.randn(B, SQ, generator=g)


def reference(logits, target, ls, reduce, ignore_idx):
    x = logits.double().reshape(-1, V).requires_grad_()
    loss = F.cross_entropy(x, target.reshape(-1), ignore_index=ignore_idx, label_smoothing=ls,
                           reduction="mean" if reduce else "none")
    return (loss if reduce else loss.reshape(B, SQ)), x


@pytest.mark.parametrize("ls", [0.0, 0.2])
@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("ignore_idx", [-100, 7])
def test_matches_torch_cross_entropy(ls, reduce, ignore_idx):
    logits, target, grad = data(ignore_idx=ignore_idx)
    x = logits.clone().requires_grad_()
    loss = parallel_cross_entropy(x, target, ls, reduce, None, ignore_idx)
    ref, xr = reference(logits, target, ls, reduce, ignore_idx)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    w = 1.0 if reduce else grad
    (loss * w).sum().backward()
    (ref * (1.0 if reduce else grad.double())).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad.reshape(B, SQ, V), rtol=1e-6, atol=1e-7)
    ignored = target == ignore_idx
    assert ignored.any() and torch.all(x.grad[ignored] == 0)


def test_bf16_input_gives_fp32_loss_and_bf16_grad_bitwise_twice():
    outs = []
    for _ in range(2):
        logits, target, grad = data(torch.bfloat16)
        x = logits.clone().requires_grad_()
        loss = parallel_cross_entropy(x, target, 0.1)
        (loss * grad).sum().backward()
        outs.append((loss.detach(), x.grad))
    assert outs[0][0].dtype == torch.float32 and outs[0][1].dtype == torch.bfloat16
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref, _ = reference(logits.float(), target, 0.1, False, -100)
    torch.testing.assert_close(outs[0][0].double(), ref.detach(), rtol=1e-6, atol=1e-6)


def test_megatron_call_forms():
    """Megatron's te_parallel_cross_entropy passes (logits, labels, 0.0, False, tp_group[, -100,
    is_cg_capturable]) positionally; the (SQ, B, V) layout is accepted as well."""
    logits, target, _ = data()
    a = parallel_cross_entropy(logits, target, 0.0, False, None, -100, True)
    b = parallel_cross_entropy(logits, target, 0.0, False, None)
    c = parallel_cross_entropy(logits.transpose(0, 1), target.t())
    assert torch.equal(a, b) and torch.equal(c, a.t())


def test_bad_arguments_are_named():
    logits, target, _ = data()
    with pytest.raises(ValueError, match="`target`"):
        parallel_cross_entropy(logits, target[:, :-1])
    with pytest.raises(ValueError, match="`label_smoothing`"):
        parallel_cross_entropy(logits, target, 1.5)
    with pytest.raises(ValueError, match="`inp`"):
        parallel_cross_entropy(target, target)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_two_gloo_ranks_match_one(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, os.path.join(HERE, "distributed", "cross_entropy_vocab_parallel.py"),
                           str(tmp_path / "store")], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and len(lines) == 4 and all(l.startswith("PASS") for l in lines), report
