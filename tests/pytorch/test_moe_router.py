"""transformer_engine.pytorch.router against Megatron-core's unfused router.

The references reproduce ``group_limited_topk``, ``topk_routing_with_score_function``,
``compute_routing_scores_for_aux_loss`` and ``switch_load_balancing_loss_func`` of
megatron/core/transformer/moe/moe_utils.py (megatron-core 0.19.2, ``fused=False``, grad enabled).
The same ops in the same order: outputs and gradients must agree bitwise. With tied scores the router
breaks ties by the lower expert index (``torch.topk`` leaves their order to the implementation), so the tie
cases run the references with an index-ordered top-k.
"""

import pytest
import torch

from transformer_engine.pytorch.router import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                                               fused_topk_with_score_function)

T, E = 16, 8


# --- Megatron 0.19.2 moe_utils.py, unfused ---------------------------------------------------

def ref_group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
                  .reshape(num_tokens, -1))
    masked_scores = scores.masked_fill(~score_mask.bool(), float('-inf'))
    return torch.topk(masked_scores, k=topk, dim=-1)


def ref_topk_routing(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                     scaling_factor=None, score_function="softmax", expert_bias=None):
    num_tokens, num_experts = logits.shape

    def compute_topk(scores, topk, num_groups=None, group_topk=None):
        if group_topk:
            return ref_group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1, sorted=torch.is_grad_enabled())

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        else:
            scores, top_indices = compute_topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits.float())
        else:
            scores = torch.nn.functional.softplus(logits.float()).sqrt()
        if expert_bias is not None:
            scores_for_routing = scores + expert_bias.float()
            _, top_indices = compute_topk(scores_for_routing, topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def ref_scores_for_aux_loss(logits, topk, score_function):
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = torch.nn.functional.softplus(logits.float()).sqrt()
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_map, scores


def ref_aux_loss(probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff):
    aggregated_probs_per_expert = probs.sum(dim=0)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


# ---------------------------------------------------------------------------------------------

CASES = [
    dict(topk=2, use_pre_softmax=False, score_function="softmax"),
    dict(topk=2, use_pre_softmax=True, score_function="softmax", scaling_factor=2.5),
    dict(topk=1, use_pre_softmax=False, score_function="sigmoid"),
    dict(topk=3, use_pre_softmax=False, score_function="sigmoid", bias=True),
    dict(topk=4, use_pre_softmax=False, score_function="sigmoid", bias=True, num_groups=4, group_topk=2,
         scaling_factor=1.5),
    dict(topk=2, use_pre_softmax=True, score_function="softmax", num_groups=2, group_topk=1),
    dict(topk=2, use_pre_softmax=False, score_function="sqrtsoftplus", bias=True),
]


def _logits(seed, dtype, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:    # few distinct values: many ties
        return torch.randint(-2, 3, (T, E), generator=g).to(dtype)
    return torch.randn(T, E, generator=g).to(dtype)


def _index_ordered_topk(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties in index order (the rule the router documents)."""
    assert largest
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


@pytest.fixture
def index_ordered_references(monkeypatch):
    monkeypatch.setattr(torch, "topk", _index_ordered_topk)
    monkeypatch.setattr(torch.Tensor, "topk", _index_ordered_topk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("ties", [False, True])
def test_topk_with_score_function_matches_megatron(case, dtype, ties, request):
    if ties:
        request.getfixturevalue("index_ordered_references")
    case = dict(case)
    bias = torch.linspace(-0.3, 0.3, E) if case.pop("bias", False) else None
    kwargs = dict(use_pre_softmax=case["use_pre_softmax"], num_groups=case.get("num_groups"),
                  group_topk=case.get("group_topk"), scaling_factor=case.get("scaling_factor"),
                  score_function=case["score_function"], expert_bias=bias)
    logits = _logits(1, dtype, ties)
    x = logits.clone().requires_grad_()
    probs, routing_map = fused_topk_with_score_function(x, case["topk"], **kwargs)
    xr = logits.clone().requires_grad_()
    ref_probs, ref_map = ref_topk_routing(xr, case["topk"], **kwargs)
    assert probs.dtype == dtype and routing_map.dtype == torch.bool
    assert torch.equal(routing_map, ref_map)
    assert torch.equal(probs, ref_probs)
    gy = torch.randn(T, E, generator=torch.Generator().manual_seed(2)).to(dtype)
    (probs * gy).sum().backward()
    (ref_probs * gy).sum().backward()
    assert torch.equal(x.grad, xr.grad)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_scores_for_aux_loss_and_aux_loss_match_megatron(score_function):
    logits = _logits(3, torch.float32)
    x = logits.clone().requires_grad_()
    xr = logits.clone().requires_grad_()
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits=x, topk=2, score_function=score_function)
    ref_map, ref_scores = ref_scores_for_aux_loss(xr, 2, score_function)
    assert torch.equal(routing_map, ref_map) and torch.equal(scores, ref_scores)
    tokens_per_expert = routing_map.sum(0)
    loss = fused_moe_aux_loss(probs=scores, tokens_per_expert=tokens_per_expert, total_num_tokens=T,
                              topk=2, num_experts=E, coeff=1e-2)
    ref = ref_aux_loss(ref_scores, tokens_per_expert, T, 2, E, 1e-2)
    assert torch.equal(loss, ref)
    loss.backward()
    ref.backward()
    assert torch.equal(x.grad, xr.grad)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("groups", [None, (4, 2)])
def test_ties_go_to_the_lower_expert_index(score_function, groups):
    logits = torch.zeros(T, E)     # every score tied
    num_groups, group_topk = groups or (None, None)
    probs, rmap = fused_topk_with_score_function(logits, 4, False, num_groups, group_topk, None, score_function,
                                                 None)
    expected = torch.arange(E) < 4  # experts 0-3 (groups 0 and 1 when grouped)
    assert torch.equal(rmap, expected.expand(T, E))
    assert torch.equal(probs != 0, rmap)
    rmap2, _ = fused_compute_score_for_moe_aux_loss(logits, 4, score_function)
    assert torch.equal(rmap2, expected.expand(T, E))


def test_aux_loss_positional_order_is_te_order():
    probs = torch.rand(T, E)
    tpe = torch.arange(E, dtype=torch.float32)
    # TE's positional order: (probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)
    assert torch.equal(fused_moe_aux_loss(probs, tpe, T, E, 2, 0.1), ref_aux_loss(probs, tpe, T, 2, E, 0.1))


def _run(deterministic):
    torch.use_deterministic_algorithms(deterministic)
    try:
        x = _logits(4, torch.float32).requires_grad_()
        probs, rmap = fused_topk_with_score_function(x, 4, False, 4, 2, 2.0, "sigmoid", torch.zeros(E))
        rm, scores = fused_compute_score_for_moe_aux_loss(x, 4, "sigmoid")
        loss = (probs.square().sum() + fused_moe_aux_loss(scores, rm.sum(0), T, E, 4, 0.1))
        loss.backward()
        return [probs.detach(), rmap, loss.detach(), x.grad]
    finally:
        torch.use_deterministic_algorithms(False)


def test_bitwise_run_to_run_and_under_deterministic_algorithms():
    a, b, c = _run(False), _run(False), _run(True)
    for u, v, w in zip(a, b, c):
        assert torch.equal(u, v) and torch.equal(u, w)


def test_bad_arguments_are_named():
    logits = _logits(0, torch.float32)
    with pytest.raises(ValueError, match="`score_function`"):
        fused_topk_with_score_function(logits, 2, False, None, None, None, "relu", None)
    with pytest.raises(ValueError, match="`logits`"):
        fused_topk_with_score_function(logits.double(), 2, False, None, None, None, "softmax", None)
    with pytest.raises(ValueError, match="`topk`"):
        fused_compute_score_for_moe_aux_loss(logits, E + 1, "softmax")
    with pytest.raises(ValueError, match="`num_groups`"):
        fused_topk_with_score_function(logits, 2, False, 3, 1, None, "sigmoid", None)
    with pytest.raises(ValueError, match="`num_groups` and `group_topk`"):
        fused_topk_with_score_function(logits, 2, False, 4, None, None, "sigmoid", None)
    with pytest.raises(ValueError, match="`expert_bias`"):
        fused_topk_with_score_function(logits, 2, False, None, None, None, "sigmoid", torch.zeros(E + 1))
    with pytest.raises(ValueError, match="num_experts"):
        fused_moe_aux_loss(torch.rand(T, E), torch.ones(E - 1), T, E, 2, 0.1)
