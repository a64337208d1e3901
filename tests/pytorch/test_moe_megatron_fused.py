"""Megatron-core 0.19.2's MoE helpers with ``fused=True`` (TransformerEngine's permutation, router
and cross entropy, i.e. this package's) against the same helpers with ``fused=False``
(megatron/core/transformer/moe/moe_utils.py, megatron/core/extensions/transformer_engine.py).
Skipped with the reason when megatron-core is not installed."""

import pytest
import torch

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils",
                                reason="megatron-core is not installed (pip install megatron-core==0.19.2)")
te_ext = pytest.importorskip("megatron.core.extensions.transformer_engine")

import transformer_engine.pytorch.cross_entropy as te_ce  # noqa: E402
import transformer_engine.pytorch.permutation as te_perm  # noqa: E402
import transformer_engine.pytorch.router as te_router  # noqa: E402

T, E, H, K = 16, 8, 32, 2


def close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_megatron_finds_our_functions():
    assert moe_utils.fused_permute is te_perm.moe_permute
    assert moe_utils.fused_permute_with_probs is te_perm.moe_permute_with_probs
    assert moe_utils.fused_unpermute is te_perm.moe_unpermute
    assert moe_utils.fused_sort_chunks_by_index is te_perm.moe_sort_chunks_by_index
    assert moe_utils.fused_sort_chunks_by_index_with_probs is te_perm.moe_sort_chunks_by_index_with_probs
    assert moe_utils.fused_topk_with_score_function is te_router.fused_topk_with_score_function
    assert moe_utils.fused_compute_score_for_moe_aux_loss is te_router.fused_compute_score_for_moe_aux_loss
    assert moe_utils.fused_moe_aux_loss is te_router.fused_moe_aux_loss
    assert te_ext.te_parallel_cross_entropy is not None


def _routing(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    probs, routing_map = moe_utils.topk_routing_with_score_function(logits, K, score_function="softmax")
    return torch.randn(T, H, generator=g), probs, routing_map


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("drop", [0, 5])
def test_permute_unpermute_fused_equals_unfused(with_probs, drop):
    tokens, probs, routing_map = _routing(1)
    n_out = T * K - drop
    results = []
    for fused in (False, True):
        x = tokens.clone().requires_grad_()
        p = probs.clone().requires_grad_()
        out, pprobs, idx, _, _ = moe_utils.permute(x, routing_map, probs=p if with_probs else None,
                                                   num_out_tokens=n_out, fused=fused)
        h = torch.tanh(out) if pprobs is None else torch.tanh(out) * pprobs.unsqueeze(-1)
        # Megatron's unfused unpermute merges probs only for undropped maps (it drops by editing the map)
        merge = p if drop == 0 else None
        y = moe_utils.unpermute(h, idx, restore_shape=x.shape, probs=merge, routing_map=routing_map, fused=fused)
        y.square().sum().backward()
        results.append((out.detach(), y.detach(), x.grad, p.grad))
    (o0, y0, gx0, gp0), (o1, y1, gx1, gp1) = results
    assert torch.equal(o0, o1)
    close(y1, y0)
    close(gx1, gx0)
    if gp0 is None:
        assert gp1 is None
    else:
        close(gp1, gp0)


def test_sort_chunks_fused_equals_unfused():
    g = torch.Generator().manual_seed(2)
    split_sizes = torch.tensor([4, 0, 7, 3, 2, 6])
    sorted_idxs = torch.tensor([3, 0, 5, 2, 1, 4])
    x = torch.randn(int(split_sizes.sum()), H, generator=g)
    p = torch.rand(x.shape[0], generator=g)
    a, pa = moe_utils.sort_chunks_by_idxs(x, split_sizes, sorted_idxs, probs=p, fused=False)
    b, pb = moe_utils.sort_chunks_by_idxs(x, split_sizes, sorted_idxs, probs=p, fused=True)
    c, _ = moe_utils.sort_chunks_by_idxs(x, split_sizes, sorted_idxs, fused=True)
    assert torch.equal(a, b) and torch.equal(pa, pb) and torch.equal(a, c)


@pytest.mark.parametrize("kwargs", [
    dict(score_function="softmax"),
    dict(score_function="softmax", use_pre_softmax=True, scaling_factor=2.0),
    dict(score_function="sigmoid", expert_bias=torch.linspace(-0.2, 0.2, E), num_groups=4, group_topk=2),
])
def test_router_fused_equals_unfused(kwargs):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    outs = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        probs, routing_map = moe_utils.topk_routing_with_score_function(x, K, fused=fused, **kwargs)
        rmap, scores = moe_utils.compute_routing_scores_for_aux_loss(x, K, kwargs["score_function"], fused=fused)
        aux = moe_utils.switch_load_balancing_loss_func(scores, rmap.sum(0), T, K, E, 1e-2, fused=fused)
        (probs.square().sum() + aux).backward()
        outs.append((probs.detach(), routing_map, aux.detach(), x.grad))
    for u, v in zip(*outs):
        assert torch.equal(u, v)


def test_te_parallel_cross_entropy_equals_torch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 2, 40, generator=g)
    labels = torch.randint(0, 40, (8, 2), generator=g)
    loss = te_ext.te_parallel_cross_entropy(logits, labels, None)
    ref = torch.nn.functional.cross_entropy(logits.double().reshape(-1, 40), labels.reshape(-1), reduction="none")
    close(loss.double(), ref.reshape(8, 2))


# --- a tiny MoE GPT trained through Megatron with the three fusions on --------------------------

# One gloo world and Megatron's parallel state for the module, as the dense GPT tests set them up.
from test_megatron_gpt import megatron_world  # noqa: E402,F401

def _moe_gpt(fused, style):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.0,
                 moe_shared_expert_intermediate_size=32, add_bias_linear=False) if style == "deepseek" else {}
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
        params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0, deterministic_mode=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, num_moe_experts=4, moe_router_topk=2,
        moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="allgather",   # alltoall creates a CUDA stream
        moe_permute_fusion=fused, moe_router_fusion=fused, cross_entropy_loss_fusion=fused,
        cross_entropy_fusion_impl="te", **extra)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(
        num_experts=4, moe_grouped_gemm=False), vocab_size=64, max_sequence_length=16)


def _train_moe(model, steps=4, batch=2, seq=16):
    gen = torch.Generator().manual_seed(1)
    pos = torch.arange(seq)[None].expand(batch, -1)
    mask = torch.triu(torch.ones(batch, 1, seq, seq, dtype=torch.bool), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (batch, seq), generator=gen)
        opt.zero_grad()
        loss = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("style", ["mixtral", "deepseek"])
def test_moe_gpt_fused_trains_like_unfused_and_bitwise_twice(megatron_world, monkeypatch, style):
    """Mixtral-style (softmax top-2) and DeepSeek-style (sigmoid, group-limited top-k, expert bias,
    scaling, shared expert) MoE GPTs, SequentialMLP experts, 4 SGD steps: with the fusions on, every
    fused entry point is called, the run is bitwise the same twice and equals the unfused run to
    float32 rounding."""
    import megatron.core.models.common.language_module.language_module as lm

    # Megatron's router moves CPU weights to torch.cuda.current_device(); keep them on the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    calls = {}

    def counting(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for name in ("fused_permute", "fused_unpermute", "fused_topk_with_score_function",
                 "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"):
        counting(moe_utils, name)
    counting(lm, "te_parallel_cross_entropy")
    losses0, params0 = _train_moe(_moe_gpt(False, style))
    assert not calls
    losses1, params1 = _train_moe(_moe_gpt(True, style))
    assert set(calls) == {"fused_permute", "fused_unpermute", "fused_topk_with_score_function",
                          "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
                          "te_parallel_cross_entropy"}, calls
    losses2, params2 = _train_moe(_moe_gpt(True, style))
    assert torch.equal(losses1, losses2) and torch.equal(params1, params2)
    torch.testing.assert_close(losses1, losses0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(params1, params0, rtol=1e-6, atol=1e-7)
