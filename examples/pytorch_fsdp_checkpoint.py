"""FSDP2 (fully_shard) and activation checkpointing around DotProductAttention, on two CPU processes.

    python examples/pytorch_fsdp_checkpoint.py                     # starts two gloo processes itself
    torchrun --nproc_per_node=2 examples/pytorch_fsdp_checkpoint.py

Every block is recomputed in the backward (torch.utils.checkpoint) and sharded over the two ranks
(one FSDP2 unit per block, then the root). Both ranks train on the same batch, so the averaged
gradient is g / 2 + g / 2 = g exactly: in deterministic mode the run must equal the plain
single-process run (no FSDP2, no checkpointing) bit for bit.
"""

import os
import socket

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLM  # noqa: E402

CFG = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=2, num_gqa_groups=1)


class Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


class LMLoss(torch.nn.Module):
    """FSDP2 hooks the root module's forward: make the loss the forward."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lm = TinyTransformerLM(CFG)
        if checkpointed:
            self.lm.layers = torch.nn.ModuleList(Checkpointed(block) for block in self.lm.layers)

    def forward(self, tokens):
        return self.lm.loss(tokens[:, :-1], tokens[:, 1:])


def train(model, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
        opt.zero_grad()
        loss = model(tokens)
        loss.backward()
        losses.append(loss.detach())
        # An FSDP2 parameter (and its gradient) is a DTensor sharded over the ranks.
        grads.append([getattr(p.grad, "full_tensor", lambda: p.grad)() for p in model.parameters()])
        opt.step()
    return losses, grads


def worker(rank, world, port):
    if port is not None:  # started by main(), not by torchrun
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = train(LMLoss(checkpointed=False))

    model = LMLoss(checkpointed=True)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.lm.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = train(model)

    equal = all(torch.equal(a, b) for a, b in zip(plain[0], sharded[0]))
    equal &= all(torch.equal(a, b) for ga, gb in zip(plain[1], sharded[1]) for a, b in zip(ga, gb))
    flag = torch.tensor([int(equal)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"losses {[round(x.item(), 6) for x in sharded[0]]}; "
              f"FSDP2 + checkpointing on {world} ranks equals the single-process run bitwise: {bool(flag.item())}")
    dist.barrier()  # every rank is done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()
    if not flag.item():
        raise SystemExit(1)


def main():
    if "RANK" in os.environ:  # torchrun
        worker(0, 0, None)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(2, port), nprocs=2)


if __name__ == "__main__":
    main()
