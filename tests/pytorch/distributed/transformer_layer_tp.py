"""Tensor-parallel TransformerLayer (heads split over the ranks, TransformerEngine's way) equals the single-rank layer.

Every rank builds the single-rank layer (same seed, same weights) and runs it on the whole input, then builds the
``set_parallel_mode=True`` layer on the TP group, loads its shard of every parameter (the tensor-parallel ones
split along ``partition_dim``: each of the query/key/value parts, whole GQA groups of a fused interleaved QKV
weight, FC1's rows, the row-parallel input columns of proj and FC2) and runs it on its input (its sequence slice
with ``sequence_parallel``). Output, input gradient and parameter gradients must match the single-rank ones to
float32 rounding (a row-parallel sum is split over the ranks, so its order differs from one GEMM's), and two
tensor-parallel runs must be bitwise equal.

Run: torchrun --nproc_per_node=2 tests/pytorch/distributed/transformer_layer_tp.py (gloo on CPU). Exit status 0
when every check passed; rank 0 prints one line per check.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from transformer_engine.pytorch import TransformerLayer  # noqa: E402

SEQ, BATCH, HIDDEN, FFN, HEADS = 8, 2, 32, 48, 4
DTYPE = torch.float32  # the attention backends take 16- and 32-bit floats
TOL = dict(rtol=1e-5, atol=1e-5)

CONFIGS = {
    "encoder gqa split-qkv": dict(num_gqa_groups=2),
    "encoder gqa split-qkv sequence_parallel": dict(num_gqa_groups=2, sequence_parallel=True),
    "encoder fused-interleaved-qkv post-layernorm rms sequence_parallel": dict(
        fuse_qkv_params=True, apply_residual_connection_post_layernorm=True, normalization="RMSNorm",
        sequence_parallel=True),
    "encoder parallel_attention_mlp qk-norm": dict(parallel_attention_mlp=True, qk_norm_type="RMSNorm"),
    "decoder fused-interleaved-qkv": dict(layer_type="decoder", fuse_qkv_params=True, num_gqa_groups=2),
}


def build(config, tp_group):
    torch.manual_seed(123)
    kw = dict(config)
    sequence_parallel = kw.pop("sequence_parallel", False) and tp_group is not None
    layer = TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DTYPE,
                             device="cpu", set_parallel_mode=tp_group is not None, tp_group=tp_group,
                             sequence_parallel=sequence_parallel, **kw)
    return layer


def randomize(layer):
    torch.manual_seed(7)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(0.3 * torch.randn_like(param))


def shard_from(full, tp, rank, size):
    src = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in tp.named_parameters():
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            param.copy_(src[name] if dim is None else src[name].chunk(size, dim=dim)[rank])


def run(layer, x, enc, weight):
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, encoder_output=enc)
    (out * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def check(config, group, rank, size):
    sequence_parallel = config.get("sequence_parallel", False)
    torch.manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    enc = torch.randn(SEQ - 2, BATCH, HIDDEN, dtype=DTYPE) if config.get("layer_type") == "decoder" else None
    weight = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE)
    full = build(config, None)
    randomize(full)
    ref_out, ref_dx, ref_grads = run(full, x, enc, weight)
    local = (lambda t: t.chunk(size, dim=0)[rank]) if sequence_parallel else (lambda t: t)

    def tp_run():
        tp = build(config, group)
        shard_from(full, tp, rank, size)
        return tp, run(tp, local(x), enc, local(weight))

    tp, (out, dx, grads) = tp_run()
    _, (out2, dx2, grads2) = tp_run()
    problems = []
    if not (torch.equal(out, out2) and torch.equal(dx, dx2) and all(torch.equal(grads[n], grads2[n]) for n in grads)):
        problems.append("two runs differ")
    if not torch.allclose(out, local(ref_out), **TOL):
        problems.append(f"output differs by {(out - local(ref_out)).abs().max().item():.3g}")
    if not torch.allclose(dx, local(ref_dx), **TOL):
        problems.append("input grad differs")
    params = dict(tp.named_parameters())
    for name, grad in grads.items():
        exp, param = ref_grads[name], params[name]
        if getattr(param, "tensor_model_parallel", False):
            exp = exp.chunk(size, dim=param.partition_dim)[rank]
        elif (getattr(param, "sequence_parallel", False) and sequence_parallel) or ".q_norm." in name \
                or ".k_norm." in name:
            # Partial on each rank: sequence-parallel norms see this rank's tokens, QK norms this rank's heads.
            # Megatron all-reduces such gradients over the TP group after backward; check the sum.
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        if grad.shape != exp.shape or not torch.allclose(grad, exp, **TOL):
            problems.append(f"grad {name} differs" + (f" by {(grad - exp).abs().max().item():.3g} (max "
                                                      f"{exp.abs().max().item():.3g})" if grad.shape == exp.shape else ""))
    return problems


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    failed = 0
    for label, config in CONFIGS.items():
        problems = check(config, group, rank, size)
        gathered = [None] * size
        dist.all_gather_object(gathered, problems)
        flat = [f"rank {r}: {p}" for r, ps in enumerate(gathered) for p in ps]
        failed += bool(flat)
        if rank == 0:
            print(("FAIL " if flat else "PASS ") + label + ("" if not flat else ": " + "; ".join(flat)), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
