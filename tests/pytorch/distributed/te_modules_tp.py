"""Tensor-parallel Linear and LayerNormLinear on N ranks equal the single-rank modules.

Every rank builds the single-rank module (same seed, same weights), runs it on the whole input,
then builds the tensor-parallel module, loads its shard of the same weights, and runs it on its
part of the input (its sequence slice with sequence_parallel, its hidden slice for a row layer
without it). Outputs, input gradients and parameter gradients must match the single-rank ones:
in fp64, to fp64 rounding (the row-parallel sum is split across ranks, so the order of the
reduction differs from one GEMM's and the match is close, not bitwise). Two tensor-parallel runs
must be bitwise equal.

Run: torchrun --nproc_per_node=2 tests/pytorch/distributed/te_modules_tp.py (gloo on CPU; NCCL on
GPUs with --device cuda). Exit status 0 when every check passed; rank 0 prints one line per check.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from transformer_engine.pytorch import LayerNormLinear, Linear  # noqa: E402

SEQ, BATCH, HIDDEN, OUT = 8, 3, 12, 20
DTYPE = torch.float64


def build(kind, tp_group, sequence_parallel, device, return_bias, normalization="LayerNorm"):
    common = dict(bias=True, params_dtype=DTYPE, device=device, sequence_parallel=sequence_parallel,
                  return_bias=return_bias, tp_group=tp_group)
    torch.manual_seed(123)
    if kind == "column":
        return Linear(HIDDEN, OUT, parallel_mode="column" if tp_group else None, **common)
    if kind == "row":
        return Linear(OUT, HIDDEN, parallel_mode="row" if tp_group else None, **common)
    return LayerNormLinear(HIDDEN, OUT, parallel_mode="column" if tp_group else None, normalization=normalization,
                           return_layernorm_output=True, zero_centered_gamma=True, **common)


def randomize(module):
    torch.manual_seed(7)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param))


def shard_from(full, tp, rank, size):
    """Copy this rank's shard of every parameter of ``full`` into ``tp``."""
    with torch.no_grad():
        for name, param in tp.named_parameters():
            src = dict(full.named_parameters())[name]
            dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
            param.copy_(src if dim is None else src.chunk(size, dim=dim)[rank])


def run(module, x, weights=None):
    """Forward, then backward of sum(out_i * weights_i); weights drawn here when not given."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    if weights is None:
        torch.manual_seed(11)
        weights = [torch.randn_like(o) for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, weights) if o.numel())
    loss.backward()
    return [o.detach() for o in outs], x.grad, {n: p.grad for n, p in module.named_parameters()}


def check(kind, sequence_parallel, return_bias, normalization, device, group, rank, size):
    in_dim = OUT if kind == "row" else HIDDEN
    torch.manual_seed(5)
    x_full = torch.randn(SEQ, BATCH, in_dim, dtype=DTYPE, device=device)
    full = build(kind, None, False, device, return_bias, normalization)
    randomize(full)
    torch.manual_seed(11)
    ref_weights = [torch.randn_like(o) for o in (lambda o: o if isinstance(o, tuple) else (o,))(full(x_full))]
    ref_outs, ref_dx, ref_grads = run(full, x_full, ref_weights)

    # This rank's pieces of the single-rank outputs (and of the loss weights, laid out the same).
    def local(outputs):
        outputs = list(outputs)
        if kind == "row":
            if sequence_parallel:
                outputs[0] = outputs[0].chunk(size, dim=0)[rank]
            return outputs
        outputs[0] = outputs[0].chunk(size, dim=-1)[rank]
        if return_bias:
            outputs[1] = outputs[1].chunk(size, dim=-1)[rank]
        if kind == "lnlinear" and sequence_parallel:
            outputs[-1] = outputs[-1].chunk(size, dim=0)[rank]  # this rank's norm output
        return outputs

    def tp_run():
        tp = build(kind, group, sequence_parallel, device, return_bias, normalization)
        shard_from(full, tp, rank, size)
        if kind == "row":
            x = x_full.chunk(size, dim=-1)[rank]
        else:
            x = x_full.chunk(size, dim=0)[rank] if sequence_parallel else x_full
        weights = local(ref_weights)
        if kind == "row" and sequence_parallel and return_bias:
            # The returned (replicated) bias is added by each rank to its own sequence slice, so
            # each rank carries 1/size of its use; Megatron sums the ranks' bias gradients.
            weights[1] = weights[1] / size
        return tp, run(tp, x, weights)

    tp, (outs, dx, grads) = tp_run()
    _, (outs2, dx2, grads2) = tp_run()
    bitwise = all(torch.equal(a, b) for a, b in zip(outs + [dx] + list(grads.values()),
                                                      outs2 + [dx2] + list(grads2.values())))
    problems = [] if bitwise else ["two runs differ"]

    exp_outs = local(ref_outs)
    if kind == "row":
        exp_dx = ref_dx.chunk(size, dim=-1)[rank]
    else:
        exp_dx = ref_dx.chunk(size, dim=0)[rank] if sequence_parallel else ref_dx
    for i, (got, exp) in enumerate(zip(outs, exp_outs)):
        if got.shape != exp.shape or not torch.allclose(got, exp, rtol=1e-12, atol=1e-12):
            problems.append(f"output {i} differs")
    if dx.shape != exp_dx.shape or not torch.allclose(dx, exp_dx, rtol=1e-12, atol=1e-12):
        problems.append("input grad differs")
    for name, grad in grads.items():
        exp = ref_grads[name]
        param = dict(tp.named_parameters())[name]
        if getattr(param, "tensor_model_parallel", False):
            exp = exp.chunk(size, dim=param.partition_dim)[rank]
        elif getattr(param, "sequence_parallel", False) and sequence_parallel:
            # Megatron all-reduces these over the TP group after backward: check the sum.
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        if grad.shape != exp.shape or not torch.allclose(grad, exp, rtol=1e-12, atol=1e-12):
            problems.append(f"grad {name} differs" + (f" by {(grad - exp).abs().max().item():.3g} (ref max {exp.abs().max().item():.3g}, ratio {(grad / exp).flatten()[:3].tolist()})" if grad.shape == exp.shape else ""))
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(size)))
    failed = 0
    for kind, normalization in (("column", None), ("row", None), ("lnlinear", "LayerNorm"), ("lnlinear", "RMSNorm")):
        for sequence_parallel in (False, True):
            for return_bias in (False, True):
                problems = check(kind, sequence_parallel, return_bias, normalization or "LayerNorm", device,
                                 group, rank, size)
                all_problems = [None] * size
                dist.all_gather_object(all_problems, problems)
                flat = [f"rank {r}: {p}" for r, ps in enumerate(all_problems) for p in ps]
                failed += bool(flat)
                if rank == 0:
                    label = f"{kind}{'/' + normalization if normalization else ''} sequence_parallel={sequence_parallel} return_bias={return_bias}"
                    print(("FAIL " if flat else "PASS ") + label + ("" if not flat else ": " + "; ".join(flat)), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
