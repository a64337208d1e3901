"""A Megatron-core GPT on this package (its TransformerEngine layer spec): trained twice, bit for bit.

    pip install setuptools wheel pybind11      # a new venv has none; --no-build-isolation builds with them
    pip install --no-build-isolation ".[pytorch]" && pip install megatron-core==0.19.2   # Python 3.12
    python examples/megatron_gpt.py          # GPU if there is one (bf16), else CPU (fp32)

Megatron-core's ``get_gpt_layer_with_transformer_engine_spec`` builds the layers from this package's
``LayerNormLinear``, ``Linear`` and ``DotProductAttention``, and Megatron's Adam is this package's
``FusedAdam``. One process (world size 1), ``deterministic_mode=True`` with
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``: the two runs' losses and parameters are bitwise equal.
docs/megatron.rst shows this file and the whole install (torch's CPU build, the versions CI tests);
tests/pytorch/test_megatron_gpt.py runs it.
"""

import argparse
import os
import sys
import tempfile

import torch

VOCAB, SEQ, BATCH = 128, 32, 2


def build_model(device: str, dtype: torch.dtype, seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device == "cpu",
        attention_dropout=0.0, hidden_dropout=0.0,
        deterministic_mode=True,
        # Megatron's own output layer needs Apex for this fusion (this package's layers do not).
        gradient_accumulation_fusion=False,
        # Megatron's jit-fused bias-dropout and its fused softmax are for CUDA.
        bias_dropout_fusion=device == "cuda", masked_softmax_fusion=False, persist_layer_norm=False,
    )
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    return model.to(device=device, dtype=dtype)


def train(model, device: str, steps: int):
    """``steps`` steps of Megatron's Adam on random tokens (the same every run); the losses and final parameters."""
    from megatron.core.optimizer import Adam  # this package's FusedAdam

    optimizer = Adam(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), adam_w_mode=True)
    data = torch.Generator().manual_seed(1)
    position_ids = torch.arange(SEQ, device=device)[None].expand(BATCH, -1)
    mask = torch.triu(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device=device), 1)  # True: masked out
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(device)
        optimizer.zero_grad()
        loss = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1)).float().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    args = parser.parse_args()
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print("megatron-core is not installed: pip install megatron-core==0.19.2 (Python 3.12)", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # deterministic_mode requires it with TransformerEngine
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    # te_rng_tracker: this package's tracker, which follows the CPU generator when there is no GPU.
    model_parallel_cuda_manual_seed(123, te_rng_tracker=True)
    try:
        losses1, params1 = train(build_model(device, dtype), device, args.steps)
        losses2, params2 = train(build_model(device, dtype), device, args.steps)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    same = torch.equal(losses1, losses2) and all(torch.equal(a, b) for a, b in zip(params1, params2))
    print(f"device {device}, {dtype}; losses {[round(x, 4) for x in losses1.tolist()]}")
    print(f"two runs bitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
