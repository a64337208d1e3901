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
