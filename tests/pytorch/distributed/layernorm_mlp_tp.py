"""Tensor-parallel LayerNormMLP (set_parallel_mode=True) on N ranks equals the single-rank module.

Every rank builds the single-rank module (same seed, same weights) and runs it on the whole input, then
builds the tensor-parallel one, loads its shard of the same weights (FC1 split along its output, each
half separately for a gated activation, FC2 along its input) and runs it on its part of the input (its
sequence slice with sequence_parallel). Outputs, the input gradient and the parameter gradients match
the single-rank ones in fp64 to fp64 rounding (FC2's sum is split across ranks, so the match is close,
not bitwise); two tensor-parallel runs are bitwise equal. Last, ``te.checkpoint`` with
``distribute_saved_activations=True`` keeps 1/N of the input per rank and gives the plain run's
results bitwise.

Run: torchrun --nproc_per_node=2 tests/pytorch/distributed/layernorm_mlp_tp.py (gloo on CPU). Exit status
0 when every check passed; rank 0 prints one line per check.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch import distributed as te_distributed  # noqa: E402

SEQ, BATCH, HIDDEN, FFN = 8, 2, 12, 16
DTYPE = torch.float64
GATED = ("swiglu",)


def build(activation, group, sequence_parallel, return_bias):
    torch.manual_seed(123)
    return te.LayerNormMLP(HIDDEN, FFN, activation=activation, set_parallel_mode=group is not None,
                           sequence_parallel=sequence_parallel, tp_group=group, return_bias=return_bias,
                           return_layernorm_output=True, return_layernorm_output_gathered=sequence_parallel,
                           zero_centered_gamma=True, params_dtype=DTYPE, device="cpu")


def randomize(module):
    torch.manual_seed(7)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) / 2)


def shard(name, full, activation, rank, size):
    """This rank's piece of the single-rank parameter (or gradient) ``full``."""
    if name in ("fc1_weight", "fc1_bias"):
        if activation in GATED:
            return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)])
        return full.chunk(size, dim=0)[rank]
    if name == "fc2_weight":
        return full.chunk(size, dim=1)[rank]
    return full


def run(module, x, w_out, w_ln, checkpoint_group=None):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    if checkpoint_group is None:
        outs = module(x)
    else:
        outs = te.checkpoint(module, x, distribute_saved_activations=True, tp_group=checkpoint_group)
    out = outs[0] + outs[1] if module.return_bias else outs[0]  # the caller adds the returned bias
    ((out * w_out).sum() + (outs[-1] * w_ln).sum()).backward()
    return [o.detach() for o in outs], x.grad, {n: p.grad for n, p in module.named_parameters()}


def check(activation, sequence_parallel, return_bias, group, rank, size):
    torch.manual_seed(5)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    w_out = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    w_ln = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    full = build(activation, None, False, return_bias)
    randomize(full)
    ref_outs, ref_dx, ref_grads = run(full, x_full, w_out, w_ln)

    def seq(t):
        return t.chunk(size, dim=0)[rank] if sequence_parallel else t

    def tp_run():
        tp = build(activation, group, sequence_parallel, return_bias)
        with torch.no_grad():
            for name, param in tp.named_parameters():
                param.copy_(shard(name, dict(full.named_parameters())[name], activation, rank, size))
        # A gathered norm output is the whole sequence on every rank: each rank carries 1/size of its loss.
        return tp, run(tp, seq(x_full), seq(w_out), w_ln / size if sequence_parallel else w_ln)

    tp, (outs, dx, grads) = tp_run()
    _, (outs2, dx2, grads2) = tp_run()
    problems = []
    if not all(torch.equal(a, b) for a, b in zip(outs + [dx] + list(grads.values()),
                                                  outs2 + [dx2] + list(grads2.values()))):
        problems.append("two runs differ")
    exp_outs = [seq(ref_outs[0])] + ([ref_outs[1]] if return_bias else []) + [ref_outs[-1]]
    for i, (got, exp) in enumerate(zip(outs, exp_outs)):
        if got.shape != exp.shape or not torch.allclose(got, exp, rtol=1e-12, atol=1e-12):
            problems.append(f"output {i} differs")
    if dx.shape != seq(ref_dx).shape or not torch.allclose(dx, seq(ref_dx), rtol=1e-12, atol=1e-12):
        problems.append("input grad differs")
    for name, grad in grads.items():
        exp = shard(name, ref_grads[name], activation, rank, size)
        if sequence_parallel and getattr(dict(tp.named_parameters())[name], "sequence_parallel", False):
            # Megatron all-reduces these over the TP group after backward: check the sum.
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        if grad.shape != exp.shape or not torch.allclose(grad, exp, rtol=1e-12, atol=1e-12):
            problems.append(f"grad {name} differs")
    return problems


def check_distributed_checkpoint(group, rank, size):
    """te.checkpoint(distribute_saved_activations=True): 1/size of the input kept, the plain run's bits."""
    torch.manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    w_out = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    w_ln = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    tp = build("swiglu", group, False, False)
    randomize(tp)
    plain_outs, plain_dx, plain_grads = run(tp, x, w_out, w_ln)
    kept = []
    real = te_distributed._rank_slice

    def recording(tensor, grp):
        part = real(tensor, grp)
        kept.append(part.numel())
        return part

    te_distributed._rank_slice = recording
    try:
        outs, dx, grads = run(tp, x, w_out, w_ln, checkpoint_group=group)
    finally:
        te_distributed._rank_slice = real
    problems = []
    if kept != [x.numel() // size]:
        problems.append(f"kept {kept} elements of the input, not {x.numel() // size}")
    if not all(torch.equal(a, b) for a, b in zip(outs + [dx] + list(grads.values()),
                                                  plain_outs + [plain_dx] + list(plain_grads.values()))):
        problems.append("checkpointed run differs from the plain one")
    return problems


def report(label, problems, rank, size):
    gathered = [None] * size
    dist.all_gather_object(gathered, problems)
    flat = [f"rank {r}: {p}" for r, ps in enumerate(gathered) for p in ps]
    if rank == 0:
        print(("FAIL " if flat else "PASS ") + label + ("" if not flat else ": " + "; ".join(flat)), flush=True)
    return bool(flat)


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    failed = 0
    for activation in ("gelu", "swiglu"):
        for sequence_parallel in (False, True):
            for return_bias in (False, True):
                failed += report(f"{activation} sequence_parallel={sequence_parallel} return_bias={return_bias}",
                                 check(activation, sequence_parallel, return_bias, group, rank, size), rank, size)
    failed += report("checkpoint distribute_saved_activations", check_distributed_checkpoint(group, rank, size),
                     rank, size)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
