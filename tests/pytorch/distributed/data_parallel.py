"""Data parallelism around DotProductAttention: DDP and FSDP2 (``fully_shard``), each also with
activation checkpointing, train the small transformer (transformer_engine.pytorch.models) as the
single-process run does. CPU processes with gloo; deterministic mode.

* Same data on both ranks: averaging a gradient over two ranks gives g / 2 + g / 2 = g exactly,
  so losses, gradients and parameters after each optimizer step must equal the single-process
  run bitwise. (With more ranks the sum of n equal terms can round, so the script takes two.)
* The batch split across ranks (real data parallelism): two runs must be bitwise equal, and close
  to the single-process run on the whole batch (the gradient sums run in another order).

Run: torchrun --nproc_per_node=2 tests/pytorch/distributed/data_parallel.py [--backends unfused]
[--cases fused:ddp:none,...]. ``fused`` needs TRITON_INTERPRET=1 on CPU, where it is slow: pick
its cases. Exit status 0 when every check passed; rank 0 prints one line per check.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "1")  # two processes on a small CPU machine

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from transformer_engine.pytorch import DotProductAttention  # noqa: E402
from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLM  # noqa: E402

CFG = TinyConfig(vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=2, num_gqa_groups=1)
BATCH, SEQ, STEPS, LR = 2, 16, 2, 0.5

# Only the named backend may run (a forced backend never falls back: a wrong one is an error).
FORCE = {
    "fused": {"NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0"},
    "unfused": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"},
}


class Checkpointed(torch.nn.Module):
    """One layer under torch.utils.checkpoint: its activations are recomputed in the backward."""

    def __init__(self, layer: torch.nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.layer, self.use_reentrant = layer, use_reentrant

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=self.use_reentrant)


class Loss(torch.nn.Module):
    """The LM with its loss as ``forward``: DDP and FSDP2 hook the root module's forward."""

    def __init__(self, lm: TinyTransformerLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens, targets):
        return self.lm.loss(tokens, targets)


def build(checkpointing: str) -> Loss:
    torch.manual_seed(0)  # the same initial parameters on every rank and in every run
    lm = TinyTransformerLM(CFG)
    if checkpointing != "none":
        for i, layer in enumerate(lm.layers):
            lm.layers[i] = Checkpointed(layer, use_reentrant=checkpointing == "reentrant")
    return Loss(lm)


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(model: torch.nn.Module, data) -> dict:
    """SGD steps; losses, every step's full gradients, the final full parameters, the backends."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"loss": [], "grads": [], "backends": set()}
    for tokens in data:
        opt.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        out["loss"].append(loss.detach().clone())
        out["grads"].append([_full(p.grad) for p in model.parameters()])
        opt.step()
        out["backends"].update(m.last_backend for m in model.modules() if isinstance(m, DotProductAttention))
    out["params"] = [_full(p) for p in model.parameters()]
    return out


def compare(a: dict, b: dict, bitwise: bool, keys=("loss", "grads", "params")) -> dict:
    def same(x, y):
        return torch.equal(x, y) if bitwise else torch.allclose(x, y, rtol=1e-4, atol=1e-6)

    pairs = {
        "loss": zip(a["loss"], b["loss"]),
        "grads": ((x, y) for gx, gy in zip(a["grads"], b["grads"]) for x, y in zip(gx, gy)),
        "params": zip(a["params"], b["params"]),
    }
    return {k: all(same(x, y) for x, y in pairs[k]) for k in keys}


def wrap(kind: str, model: Loss, mesh) -> torch.nn.Module:
    if kind == "ddp":
        return DistributedDataParallel(model)
    for layer in model.lm.layers:  # one FSDP2 unit per block, then the root (embedding, head)
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


CHECKPOINTING = ("none", "non-reentrant", "reentrant")


def all_cases(backend: str) -> list:
    """Every check for one backend, as ``backend:wrapper:mode`` (mode: a checkpointing, or split)."""
    cases = [f"{backend}:single:{ck}" for ck in CHECKPOINTING[1:]]
    for kind in ("ddp", "fsdp2"):
        cases += [f"{backend}:{kind}:{ck}" for ck in CHECKPOINTING] + [f"{backend}:{kind}:split"]
    return cases


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="unfused", help="comma list of fused, unfused: every check for each")
    parser.add_argument("--cases", default="", help="comma list of backend:wrapper:mode checks to add, e.g. "
                        "fused:fsdp2:non-reentrant (wrapper: single, ddp, fsdp2; mode: none, non-reentrant, "
                        "reentrant, split)")
    args = parser.parse_args()
    cases = [c for b in args.backends.split(",") if b for c in all_cases(b)]
    cases += [c for c in args.cases.split(",") if c and c not in cases]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"run with two processes (the bitwise same-data checks rely on it), got {world}")
    mesh = init_device_mesh("cpu", (world,))
    data = batches()
    # This rank's half of each batch.
    local = [t.chunk(world)[rank] for t in data]
    failures = 0
    plain = {}  # backend -> the single-process run without checkpointing

    def report(name: str, ok: dict, backends: set) -> None:
        nonlocal failures
        flag = torch.tensor([int(all(ok.values()))])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        passed = bool(flag.item())
        failures += not passed
        if rank == 0:
            print(f"{'PASS' if passed else 'FAIL'} {name} backend={','.join(sorted(map(str, backends)))} "
                  + " ".join(f"{k}={'ok' if v else 'DIFF'}" for k, v in ok.items()), flush=True)

    for case in cases:
        backend, kind, mode = case.split(":")
        os.environ.update(FORCE[backend])
        if backend not in plain:
            plain[backend] = train(build("none"), data)
        if mode == "split":
            first, second = (train(wrap(kind, build("none"), mesh), local) for _ in range(2))
            ok = {f"run2=run1 {k}": v for k, v in compare(second, first, True).items()}
            # Each rank's loss is its own share's; the averaged gradients are the whole batch's.
            ok.update({f"~single {k}": v for k, v in compare(first, plain[backend], False, ("grads", "params")).items()})
            report(f"{kind} batch split over {world} ranks", ok, first["backends"])
            continue
        model = build(mode)
        result = train(model if kind == "single" else wrap(kind, model, mesh), data)
        where = "single process" if kind == "single" else f"{kind} same data on {world} ranks"
        report(f"{where} checkpoint={mode} vs plain single process: bitwise", compare(result, plain[backend], True),
               result["backends"])
    dist.barrier()  # every rank is done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every result is reported and the group is destroyed; leave without running C++ static destructors, where a
    # gloo or autograd worker thread still joinable at exit aborts the process ("terminate called without an
    # active exception") after every check has passed.
    os._exit(code)
