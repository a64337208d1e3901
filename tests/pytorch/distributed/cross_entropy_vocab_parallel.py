"""parallel_cross_entropy over two gloo ranks, each holding half of the vocabulary, against the
single-process call on the whole vocabulary: the loss on every rank and each rank's gradient shard.
Twice, bitwise. Prints one PASS/FAIL line per check from rank 0; exit status 0 when all passed.

Run: python tests/pytorch/distributed/cross_entropy_vocab_parallel.py <store file>
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy  # noqa: E402

WORLD, B, SQ, V = 2, 2, 8, 32


def data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, SQ, V, generator=g) * 3
    target = torch.randint(0, V, (B, SQ), generator=g)
    target[0, 3] = -100
    target[1, 0] = V - 1              # a target on the last rank's shard
    grad = torch.randn(B, SQ, generator=g)
    return logits, target, grad


def run(logits, target, grad, group, ls, reduce):
    x = logits.clone().requires_grad_()
    loss = parallel_cross_entropy(x, target, ls, reduce, group)
    (loss * (1.0 if reduce else grad)).sum().backward()
    return loss.detach(), x.grad


def worker(rank, store_path):
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    group = dist.new_group(list(range(WORLD)))
    logits, target, grad = data()
    shard = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
    ok = True
    for ls in (0.0, 0.1):
        for reduce in (False, True):
            full_loss, full_grad = run(logits, target, grad, None, ls, reduce)
            loss, g = run(logits[..., shard].contiguous(), target, grad, group, ls, reduce)
            loss2, g2 = run(logits[..., shard].contiguous(), target, grad, group, ls, reduce)
            dl = (loss - full_loss).abs().max().item()
            dg = (g - full_grad[..., shard]).abs().max().item()
            good = dl < 1e-5 and dg < 1e-6 and torch.equal(loss, loss2) and torch.equal(g, g2)
            ok &= good
            if rank == 0:
                print(f"{'PASS' if good else 'FAIL'} ls={ls} reduce={reduce} max|dloss|={dl:.2e} "
                      f"max|dgrad|={dg:.2e}", flush=True)
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)          # mp.spawn raises, the script exits non-zero


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=WORLD)
