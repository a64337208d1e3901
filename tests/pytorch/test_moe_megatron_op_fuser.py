"""Megatron-core 0.19.2 (unchanged) with ``use_transformer_engine_op_fuser=True`` and ``moe_grouped_gemm=True``:
its TEGroupedMLP experts run as ``ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`` over the
TEGroupedLinear modules' own parameters. A tiny MoE GPT (world 1, gloo, CPU; Mixtral-style softmax top-2,
DeepSeek-style sigmoid group-limited top-k with expert bias and a shared expert, and biased experts, whose FC2
bias the operation scales by the router probabilities), in fp32 and in FP8 hybrid (tensorwise and delayed
scaling; Megatron pads each expert's rows to 256 on this path, to 16 on the unfused one), trains 3 SGD steps
bitwise the same twice, bitwise equal to the same model without the op fuser (TEGroupedMLP; both with
``use_te_activation_func``, so the experts' SwiGLU is the same function), and to float32 rounding equal to the
model with torch's SiLU.

Megatron reaches the fused experts only when it reads a TransformerEngine version >= 2.14 and
``NVTE_CUTEDSL_FUSED_GROUPED_MLP=1`` (its gate for TransformerEngine's CuTe kernel). This package reports the
2.10 API level (``transformer_engine.common.version``: the 2.14 gates also switch on paths not built here), so
the test answers Megatron's expert-module version check with 2.14 and sets the variable; nothing else of
Megatron is changed. Skipped with the reason when megatron-core is not installed."""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core.transformer.moe.experts",
                    reason="megatron-core is not installed (pip install megatron-core==0.19.2)")

from transformer_engine.pytorch import ops  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, EXPERTS = 3, 2, 16, 64, 4
_ATTN_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


# One gloo world and Megatron's parallel state for the module, as the dense GPT tests set them up.
from test_megatron_gpt import megatron_world  # noqa: E402,F401

@pytest.fixture(autouse=True)
def _megatron_env(monkeypatch):
    from megatron.core.transformer.moe import experts

    real = experts.is_te_min_version
    monkeypatch.setattr(experts, "is_te_min_version",
                        lambda version, check_equality=True: version == "2.14.0" or real(version, check_equality))
    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")
    # Megatron's router moves CPU weights to torch.cuda.current_device(); keep them on the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    # Megatron writes its attention backend into these variables and asserts them on the next model.
    saved = {k: os.environ.pop(k, None) for k in _ATTN_ENV}
    yield
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def _moe_gpt(style, bias, fp8=None, **flags):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.0,
                 moe_shared_expert_intermediate_size=32) if style == "deepseek" else {}
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, use_cpu_initialization=True,
        params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0, deterministic_mode=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="allgather",  # alltoall creates a CUDA stream
        moe_permute_fusion=True, moe_router_fusion=True, moe_grouped_gemm=True, add_bias_linear=bias,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        attention_backend=AttnBackend.unfused, **extra)
    cfg = dataclasses.replace(cfg, **flags)
    if fp8 is not None:
        cfg = dataclasses.replace(cfg, fp8="hybrid", fp8_recipe=fp8)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS, moe_grouped_gemm=True,
                                                      use_te_activation_func=cfg.use_te_activation_func)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _train(model, init):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    gen = torch.Generator().manual_seed(1)
    pos = torch.arange(SEQ)[None].expand(BATCH, -1)
    mask = torch.triu(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        opt.zero_grad()
        model.set_is_first_microbatch()  # as Megatron's schedules: under FP8, quantize the updated weights
        loss = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


def _bitwise(a, b):
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k])
                                                                          for k in a[1])


CASES = [("mixtral", False, None), ("mixtral", True, None), ("deepseek", False, None),
         ("mixtral", False, "tensorwise"), ("deepseek", False, "delayed")]


@pytest.mark.parametrize("style, bias, fp8", CASES, ids=[f"{s}-{f or 'fp32'}{'-bias' if b else ''}"
                                                         for s, b, f in CASES])
def test_op_fuser_grouped_experts(megatron_world, monkeypatch, style, bias, fp8):
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from transformer_engine.pytorch.ops.basic import grouped_linear as op_module

    fp8_gemm_calls = []
    real = op_module.grouped_linear

    def counted(*args, **kwargs):
        fp8_gemm_calls.append(kwargs.get("fp8_plans") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(op_module, "grouped_linear", counted)

    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    base = _moe_gpt(style, bias, fp8)
    init = {n: p.detach().clone() for n, p in base.named_parameters()}
    # TransformerEngine's activation for the shared expert (DeepSeek) too, in this run and the reference.
    fuser = dict(use_transformer_engine_op_fuser=True, use_te_activation_func=True)
    fused_model = _moe_gpt(style, bias, fp8, **fuser)
    fused = _train(fused_model, init)
    FP8GlobalStateManager.reset()
    # Every step, FC1 and FC2 of both layers through the operations; under FP8 with their FP8 plans.
    assert fp8_gemm_calls == [fp8 is not None] * (STEPS * 2 * 2)
    mlps = [m for m in fused_model.modules() if isinstance(m, TEGroupedMLP)]
    assert len(mlps) == 2 and all(m._with_fused_impl for m in mlps)
    seq = mlps[0]._fused_ops[0]
    assert isinstance(seq, ops.Sequential)
    assert [type(op).__name__ for op in seq] == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    assert seq[0].weight0 is mlps[0].linear_fc1.weight0 and seq[2].weight3 is mlps[0].linear_fc2.weight3
    assert seq[2].num_extra_inputs == (2 if bias else 1)
    assert torch.isfinite(fused[0]).all()
    assert _bitwise(fused, _train(_moe_gpt(style, bias, fp8, **fuser), init))
    FP8GlobalStateManager.reset()
    # Without the op fuser, TEGroupedMLP's own path with TransformerEngine's SwiGLU: the same functions, bitwise.
    unfused = _train(_moe_gpt(style, bias, fp8, use_te_activation_func=True), init)
    FP8GlobalStateManager.reset()
    assert _bitwise(fused, unfused)
    # With torch's F.silu: SiLU's float32 rounding only.
    plain = _train(base, init)
    loss_diff = (fused[0] - plain[0]).abs().max().item()
    param_diff = max((fused[1][k] - plain[1][k]).abs().max().item() for k in plain[1])
    print(f"{style} {fp8 or 'fp32'} bias={bias}: vs torch SiLU max |loss diff| {loss_diff:.3g}, "
          f"max |param diff| {param_diff:.3g}")
    assert loss_diff < 1e-5 and param_diff < 1e-5, (loss_diff, param_diff)
