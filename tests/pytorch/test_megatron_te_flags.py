"""Megatron-core 0.19.2 (unchanged) with the flags that reach for transformer_engine.pytorch.ops and
transformer_engine.pytorch.cpu_offload: ``use_te_activation_func``, ``use_transformer_engine_op_fuser``,
``fused_residual_rmsnorm`` and ``cpu_offloading``. A tiny GPT (RMSNorm, SwiGLU, TE layer spec; MoE with
SequentialMLP experts for the fused residual, whose norm Megatron fuses before an MoE layer only) trains 3 SGD
steps on the CPU with each flag on: the run is bitwise the same twice, and equals the run with the flag off
(bitwise where the math is the same; to float32 rounding where the activation is TransformerEngine's formula
instead of torch's). Skipped with the reason when megatron-core is not installed."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core.extensions.transformer_engine",
                    reason="megatron-core is not installed (pip install megatron-core==0.19.2)")

from transformer_engine.pytorch import cpu_offload, ops  # noqa: E402


# One gloo world and Megatron's parallel state for the module, as the dense GPT tests set them up.
from test_megatron_gpt import megatron_world  # noqa: E402,F401

def _gpt(moe=False, **flags):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_args = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                    moe_token_dispatcher_type="allgather") if moe else {}  # alltoall creates a CUDA stream
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
        params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0, deterministic_mode=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, **moe_args, **flags)
    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=4 if moe else None, use_te_op_fuser=cfg.use_transformer_engine_op_fuser,
        use_te_activation_func=cfg.use_te_activation_func)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)


def _train(model, steps=3, batch=2, seq=16):
    gen = torch.Generator().manual_seed(1)
    pos = torch.arange(seq)[None].expand(batch, -1)
    mask = torch.triu(torch.ones(batch, 1, seq, seq, dtype=torch.bool), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (batch, seq), generator=gen)
        opt.zero_grad()
        # What Megatron's schedules do each step: under FP8 the TE modules quantize their updated weights again
        # (the operations quantize theirs in every forward).
        model.set_is_first_microbatch()
        loss = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), torch.cat([p.detach().flatten() for p in model.parameters()])


def _bitwise(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture
def cpu_router(monkeypatch):
    # Megatron's router moves CPU weights to torch.cuda.current_device(); keep them on the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def test_te_activation_and_op_fuser(megatron_world):
    """use_te_activation_func: the MLP's activation is ops.SwiGLU. use_transformer_engine_op_fuser: the MLP is
    Megatron's TEFusedMLP, an ops.Sequential of RMSNorm, BasicLinear, Bias, SwiGLU, BasicLinear over the
    layer's own parameters; it trains bitwise like the TE-activation run (the same functions)."""
    from megatron.core.extensions.transformer_engine import TEFusedMLP

    base = _train(_gpt())
    act_model = _gpt(use_te_activation_func=True)
    assert isinstance(act_model.decoder.layers[0].mlp.activation_func, ops.SwiGLU)
    act = _train(act_model)
    assert _bitwise(act, _train(_gpt(use_te_activation_func=True)))
    # SiLU as x * sigmoid(x) in float32 against torch's F.silu: measured max |diff| 0 in the losses and 7.5e-9 in
    # the parameters after 3 steps.
    torch.testing.assert_close(act[0], base[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(act[1], base[1], rtol=1e-6, atol=1e-6)

    fused_model = _gpt(use_transformer_engine_op_fuser=True)
    fused = _train(fused_model)
    mlp = fused_model.decoder.layers[0].mlp
    assert isinstance(mlp, TEFusedMLP)
    seq = mlp._fused_impl[0]
    assert isinstance(seq, ops.Sequential)
    assert [type(op).__name__ for op in seq] == ["RMSNorm", "BasicLinear", "Bias", "SwiGLU", "BasicLinear"]
    assert seq[1].weight is mlp.linear_fc1.weight and seq[0].weight is mlp.linear_fc1.layer_norm_weight
    assert _bitwise(fused, act)
    assert _bitwise(fused, _train(_gpt(use_transformer_engine_op_fuser=True)))


def test_op_fuser_in_fp8_is_the_modules_in_fp8(megatron_world):
    """fp8="hybrid" with delayed scaling: the op-fuser MLP's BasicLinear operations keep their own FP8 state and
    quantize as the modules do: bitwise the TE-activation run's losses and parameters."""
    fp8 = dict(fp8="hybrid", fp8_recipe="delayed")
    act = _train(_gpt(use_te_activation_func=True, **fp8))
    assert _bitwise(_train(_gpt(use_transformer_engine_op_fuser=True, **fp8)), act)


def test_fused_residual_rmsnorm(megatron_world, cpu_router):
    """fused_residual_rmsnorm: the norm before each MoE layer is Megatron's TEFusedResidualRMSNorm
    (ops.Sequential(MakeExtraOutput, RMSNorm) sharing the norm's weight); bitwise the unfused run."""
    from megatron.core.extensions.transformer_engine import TEFusedResidualRMSNorm

    base = _train(_gpt(moe=True))
    model = _gpt(moe=True, fused_residual_rmsnorm=True)
    on = _train(model)
    norm = model.decoder.layers[0].pre_mlp_layernorm
    assert isinstance(norm, TEFusedResidualRMSNorm)
    assert [type(op).__name__ for op in norm._fused_impl[0]] == ["MakeExtraOutput", "RMSNorm"]
    assert _bitwise(on, base)
    assert _bitwise(on, _train(_gpt(moe=True, fused_residual_rmsnorm=True)))


def test_cpu_offloading(megatron_world, monkeypatch):
    """cpu_offloading of the first of two layers: Megatron's transformer block enters our context around each
    layer; the saved tensors of layer 0 go through the hooks (on the CPU they stay where they are); bitwise the
    run without offloading, twice. With the host copy forced on CPU tensors too, still bitwise."""
    base = _train(_gpt())
    model = _gpt(cpu_offloading=True, cpu_offloading_num_layers=1)
    context = model.decoder.offload_context
    assert isinstance(context, cpu_offload._CpuOffloadContext)
    on = _train(model)
    assert context.num_packed > 0 and context.num_unpacked == context.num_packed and context.num_moved == 0
    assert _bitwise(on, base)
    monkeypatch.setattr(cpu_offload, "_STAYING_DEVICE_TYPES", ("meta",))
    model = _gpt(cpu_offloading=True, cpu_offloading_num_layers=1)
    assert _bitwise(_train(model), base)
    assert model.decoder.offload_context.num_moved > 0
