"""Megatron-core GPT on the TransformerEngine spec, tensor parallel over 2 ranks, equals 1 rank.

Both ranks build the same tiny GPTModel (get_gpt_layer_with_transformer_engine_spec) twice: once
with tensor_model_parallel_size=1 (each rank alone) and once with 2 (sequence parallelism on and
off). With use_cpu_initialization Megatron draws every full weight from the same seed and keeps
this rank's shard, so the models start from the same weights. Three SGD steps must give losses
within fp32 rounding of the single-rank run (the tensor-parallel sums run in another order) and
bitwise equal across two tensor-parallel runs.

Sequence parallelism runs on GPUs only: Megatron-core 0.19.2's own output layer (a local
ColumnParallelLinear, megatron/core/tensor_parallel/layers.py, backward of
LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel) allocates its buffer on
torch.cuda.current_device(). On CPU the script says so on a SKIP line.

Run: torchrun --nproc_per_node=2 tests/pytorch/distributed/megatron_gpt_tp.py [--device cuda]
(gloo on CPU, NCCL on GPUs; fp32). Exit status 0 when every check passed; rank 0 prints one line
per check.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, LR = 64, 16, 2, 3, 0.5


class _CPUScoreBuffer:
    """Megatron-core 0.19.2's GlobalMemoryBuffer allocates on torch.cuda.current_device(); the
    TE spec never asks for it, but parallel_state may; on CPU hand out CPU tensors."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)


def train(tp, sequence_parallel, device):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if tp == 1:
        # Each rank alone: model-parallel groups of one rank.
        parallel_state.initialize_model_parallel(1, 1)
    else:
        parallel_state.initialize_model_parallel(tp, 1)
    if device.type == "cpu":
        parallel_state._GLOBAL_MEMORY_BUFFER = _CPUScoreBuffer()
    model_parallel_cuda_manual_seed(123, te_rng_tracker=True)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                            use_cpu_initialization=True, params_dtype=torch.float32, attention_dropout=0.0,
                            hidden_dropout=0.0, deterministic_mode=True, gradient_accumulation_fusion=False,
                            bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ).to(device)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device) for _ in range(STEPS)]
    position_ids = torch.arange(SEQ, device=device)[None].expand(BATCH, -1)
    mask = torch.triu(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device=device), 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    losses = []
    for tokens in data:
        opt.zero_grad()
        loss = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1)).mean()
        loss.backward()
        if sequence_parallel:
            # What Megatron's optimizer does before stepping: sum the gradients of parameters
            # replicated across the TP group but fed by a sequence shard (norms, row biases).
            for p in model.parameters():
                if getattr(p, "sequence_parallel", False) and p.grad is not None:
                    dist.all_reduce(p.grad, group=tp_group)
        opt.step()
        losses.append(loss.detach())
    parallel_state.destroy_model_parallel()
    return torch.stack(losses)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    single = train(1, False, device).cpu()
    failed = 0
    if args.device == "cpu" and rank == 0:
        print("SKIP gpt tp=2 sequence_parallel=True: Megatron's output layer allocates its sequence-parallel "
              "buffer on CUDA (megatron/core/tensor_parallel/layers.py)", flush=True)
    for sequence_parallel in (False, True) if args.device == "cuda" else (False,):
        first, second = train(2, sequence_parallel, device).cpu(), train(2, sequence_parallel, device).cpu()
        problems = []
        if not torch.equal(first, second):
            problems.append(f"two runs differ: {first.tolist()} vs {second.tolist()}")
        # fp32: a few ulps of the loss per step for the reordered sums.
        if not torch.allclose(first, single, rtol=1e-5, atol=0):
            problems.append(f"losses {first.tolist()} vs single rank {single.tolist()}")
        failed += bool(problems)
        if rank == 0:
            label = f"gpt tp=2 sequence_parallel={sequence_parallel}"
            print(("FAIL " if problems else "PASS ") + label + ("" if not problems else ": " + "; ".join(problems)),
                  flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
