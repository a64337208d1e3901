"""Megatron-core 0.19.2 (unchanged) with ``moe_grouped_gemm=True``: its TEGroupedMLP experts are this package's
GroupedLinear (and, under FP8, Fp8Padding/Fp8Unpadding). A tiny MoE GPT (world 1, gloo, CPU), Mixtral-style
(softmax top-2) and DeepSeek-style (sigmoid scores, group-limited top-k, expert bias, shared expert), with the
fused permutation and router on, trains 10 SGD steps bitwise the same twice and bitwise equal to the same model
with SequentialMLP experts (one Linear per expert, given the same weights); in fp32, in FP8 hybrid (tensorwise and
delayed scaling) and with biased experts. Skipped with the reason when megatron-core is not installed."""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.experts",
                    reason="megatron-core is not installed (pip install megatron-core==0.19.2)")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, EXPERTS = 10, 2, 16, 64, 4


# One gloo world and Megatron's parallel state for the module, as the dense GPT tests set them up.
from test_megatron_gpt import megatron_world  # noqa: E402,F401

_ATTN_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture(autouse=True)
def _cpu_router_and_attention_env(monkeypatch):
    # Megatron's router moves CPU weights to torch.cuda.current_device(); keep them on the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    # Megatron writes its attention backend into these variables and asserts them on the next model: start
    # from none and leave them as they were for the files that run after this one.
    saved = {k: os.environ.pop(k, None) for k in _ATTN_ENV}
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def _config(style, fp8, bias):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.0,
                 moe_shared_expert_intermediate_size=32) if style == "deepseek" else {}
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
        params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0, deterministic_mode=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="allgather",  # alltoall creates a CUDA stream
        moe_permute_fusion=True, moe_router_fusion=True, add_bias_linear=bias,
        # The experts are under test: attention in framework math (the Triton kernels under the interpreter
        # would take 40x the time of the rest of the model).
        attention_backend=AttnBackend.unfused, **extra)
    if fp8 is not None:
        cfg = dataclasses.replace(cfg, fp8="hybrid", fp8_recipe=fp8)
    return cfg


def _moe_gpt(grouped, style, fp8=None, bias=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    cfg = dataclasses.replace(_config(style, fp8, bias), moe_grouped_gemm=grouped)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(
        num_experts=EXPERTS, moe_grouped_gemm=grouped), vocab_size=VOCAB, max_sequence_length=SEQ)


def _sequential_name(name):
    """A TEGroupedMLP parameter's name in the SequentialMLP model (``linear_fc1.weight2`` ->
    ``local_experts.2.linear_fc1.weight``)."""
    if ".experts.linear_fc" not in name:
        return name
    head, tail = name.split(".experts.")
    fc, param = tail.split(".")
    kind = param.rstrip("0123456789")
    return f"{head}.experts.local_experts.{param[len(kind):]}.{fc}.{kind}"


def _copy_weights(grouped, sequential):
    src = dict(sequential.named_parameters())
    with torch.no_grad():
        for name, p in grouped.named_parameters():
            p.copy_(src[_sequential_name(name)])


def _train(model, skip=0):
    """STEPS SGD steps (plain SGD: no optimizer state to carry), after ``skip`` steps' batches."""
    gen = torch.Generator().manual_seed(1)
    pos = torch.arange(SEQ)[None].expand(BATCH, -1)
    mask = torch.triu(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(skip + STEPS)][skip:]
    for tokens in batches:
        opt.zero_grad()
        model.set_is_first_microbatch()  # as Megatron's schedules: quantize the updated weights each step
        loss = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = [("mixtral", None, False), ("deepseek", None, False), ("mixtral", None, True),
         ("mixtral", "tensorwise", False), ("deepseek", "delayed", False), ("mixtral", "delayed", True)]


@pytest.mark.parametrize("style, fp8, bias", CASES, ids=[f"{s}-{f or 'fp32'}{'-bias' if b else ''}"
                                                         for s, f, b in CASES])
def test_grouped_gemm_gpt_bitwise_twice_and_equal_to_sequential(megatron_world, monkeypatch, style, fp8, bias):
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    calls = {"grouped": 0, "pad": 0}
    real_forward, real_pad = te.GroupedLinear.forward, te.Fp8Padding.forward

    def counted(self, *args, **kwargs):
        calls["grouped"] += 1
        return real_forward(self, *args, **kwargs)

    def counted_pad(self, *args, **kwargs):
        calls["pad"] += 1
        return real_pad(self, *args, **kwargs)

    monkeypatch.setattr(te.GroupedLinear, "forward", counted)
    monkeypatch.setattr(te.Fp8Padding, "forward", counted_pad)
    sequential = _moe_gpt(False, style, fp8, bias)
    assert any(isinstance(m, SequentialMLP) for m in sequential.modules())
    runs = []
    for _ in range(2):
        FP8GlobalStateManager.reset()
        model = _moe_gpt(True, style, fp8, bias)
        assert sum(isinstance(m, TEGroupedMLP) for m in model.modules()) == 2
        _copy_weights(model, sequential)
        runs.append(_train(model))
    # Every step: fc1 and fc2 of both layers through GroupedLinear (and, in FP8, the padding of its inputs).
    assert calls["grouped"] == 2 * STEPS * 2 * 2
    assert calls["pad"] == (2 * 2 * STEPS * 2 if fp8 else 0)  # hidden states and probs, per layer and step
    (losses1, params1), (losses2, params2) = runs
    assert torch.equal(losses1, losses2) and all(torch.equal(params1[k], params2[k]) for k in params1)
    FP8GlobalStateManager.reset()
    losses0, params0 = _train(sequential)
    assert torch.isfinite(losses1).all()
    loss_diff = (losses1 - losses0).abs().max().item()
    param_diff = max((p - params0[_sequential_name(n)]).abs().max().item() for n, p in params1.items())
    print(f"{style} {fp8 or 'fp32'} bias={bias}: max |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g}")
    # On the CPU GroupedLinear runs one GEMM per expert through Linear's path, on the same rows as SequentialMLP's
    # Linears (zero-padded alike under FP8; an expert without tokens records its weight's amax alike): the bits
    # are the same.
    assert loss_diff == 0 and param_diff == 0, (loss_diff, param_diff)


def test_grouped_gemm_gpt_fp8_checkpoint_resume_is_bitwise(megatron_world):
    """Megatron's TEGroupedLinear load hook runs on our module: a delayed-scaling run saved after 3 steps with
    ``torch.save(model.state_dict())`` and loaded into a fresh model carries every expert GEMM's FP8 state and
    the weights; training on gives the uninterrupted run's bits."""
    import io

    global STEPS
    full = _moe_gpt(True, "mixtral", "delayed")
    # Megatron's RNG tracker has moved on by the next build: start both runs from the same weights.
    init = {k: v.clone() for k, v in full.state_dict().items() if v is not None}
    ref_losses, ref_params = _train(full)
    FP8GlobalStateManager.reset()
    steps, STEPS = STEPS, 3
    try:
        first = _moe_gpt(True, "mixtral", "delayed")
        first.load_state_dict(init)
        _train(first)
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
        FP8GlobalStateManager.reset()
        resumed = _moe_gpt(True, "mixtral", "delayed")
        resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        for (name, a), b in zip(first.named_modules(), resumed.modules()):
            if isinstance(a, te.GroupedLinear):
                for attr in a._fp8_state_attrs():
                    assert torch.equal(a.__dict__[attr].fwd_meta.amax_history, b.__dict__[attr].fwd_meta.amax_history)
        STEPS = steps - 3
        losses, params = _train(resumed, skip=3)
    finally:
        STEPS = steps
    assert torch.equal(losses, ref_losses[3:]) and all(torch.equal(params[k], ref_params[k]) for k in params)
