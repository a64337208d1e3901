"""MoE router functions, as TransformerEngine's ``pytorch.router`` names them.

Megatron imports these at TransformerEngine API level 2.7 and later and calls them when
``moe_router_fusion`` is set. They compute what Megatron's unfused router computes
(``topk_routing_with_score_function``, ``compute_routing_scores_for_aux_loss`` and
``switch_load_balancing_loss_func`` in megatron/core/transformer/moe/moe_utils.py), in plain
torch: scores in float32, top-k with ties broken by the lower expert index (a stable descending
sort, so the choice is the same on every device; ``torch.topk`` leaves the order of tied values to
the implementation), the sparse ``[tokens, experts]`` outputs built by one-hot comparison and a sum
over k (no scatter), so forward and backward are deterministic.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def _check_logits(name: str, logits, topk: int, score_function: str) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"`logits` of {name} must be a 2-D [num_tokens, num_experts] tensor, got {shape}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"`logits` of {name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if not isinstance(topk, int) or not 1 <= topk <= logits.shape[1]:
        raise ValueError(f"`topk` of {name} must be an int in [1, num_experts={logits.shape[1]}], got {topk!r}")
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"`score_function` of {name} must be one of {_SCORE_FUNCTIONS}, got {score_function!r}")


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    return torch.nn.functional.softplus(logits.float()).sqrt()


def _topk_by_index(x: torch.Tensor, k: int):
    """The k largest entries of each row and their indices, largest first; equal values in index order."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        num_tokens, num_experts = scores.shape
        # Groups ranked by the sum of their best topk // group_topk scores; experts outside the
        # chosen groups masked to -inf before the final top-k.
        group_scores = _topk_by_index(scores.view(num_tokens, num_groups, -1), topk // group_topk)[0].sum(-1)
        group_idx = _topk_by_index(group_scores, group_topk)[1]
        chosen = (group_idx.unsqueeze(-1) == torch.arange(num_groups, device=scores.device)).any(1)
        expert_mask = chosen.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
        masked = scores.masked_fill(~expert_mask.reshape(num_tokens, -1), float("-inf"))
        return _topk_by_index(masked, topk)
    return _topk_by_index(scores, topk)


def _dense(values: torch.Tensor, indices: torch.Tensor, num_experts: int):
    """``[tokens, k]`` values at expert ``indices`` -> ``[tokens, experts]`` (sum of one-hots, exact)."""
    onehot = indices.unsqueeze(-1) == torch.arange(num_experts, device=indices.device)   # [T, k, E]
    routing_map = onehot.any(1)
    dense = (onehot.to(values.dtype) * values.unsqueeze(-1)).sum(1)
    return dense, routing_map


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    num_groups: Optional[int],
    group_topk: Optional[int],
    scaling_factor: Optional[float],
    score_function: str,
    expert_bias: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: returns ``(probs [tokens, experts] in logits' dtype, routing_map bool)``.

    ``score_function="softmax"``: softmax then top-k (``use_pre_softmax``) or top-k logits then
    softmax over them. ``"sigmoid"`` / ``"sqrtsoftplus"``: top-k of ``score + expert_bias``, the
    chosen scores normalized to sum 1 when ``topk > 1``. ``num_groups``/``group_topk``:
    group-limited top-k. ``scaling_factor`` multiplies the probs. As in Megatron's unfused router,
    ``expert_bias`` only takes part with sigmoid/sqrtsoftplus scores.
    """
    name = "fused_topk_with_score_function"
    _check_logits(name, logits, topk, score_function)
    num_tokens, num_experts = logits.shape
    if bool(num_groups) != bool(group_topk):
        raise ValueError(f"`num_groups` and `group_topk` of {name} must be given together, "
                         f"got num_groups={num_groups!r}, group_topk={group_topk!r}")
    if group_topk:
        if num_experts % num_groups or not 1 <= group_topk <= num_groups or topk % group_topk:
            raise ValueError(f"{name}: `num_groups` must divide num_experts={num_experts}, `group_topk` be in "
                             f"[1, num_groups] and divide `topk`; got num_groups={num_groups}, "
                             f"group_topk={group_topk}, topk={topk}")
    if expert_bias is not None and tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(f"`expert_bias` of {name} must have shape ({num_experts},), got {tuple(expert_bias.shape)}")

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs, top_indices = _topk(scores, topk, num_groups, group_topk)
        else:
            top_logits, top_indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        scores = _scores(logits, score_function)
        if expert_bias is not None:
            _, top_indices = _topk(scores + expert_bias.float(), topk, num_groups, group_topk)
            top_scores = torch.gather(scores, 1, top_indices)
        else:
            top_scores, top_indices = _topk(scores, topk, num_groups, group_topk)
        probs = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else top_scores
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    return _dense(probs, top_indices, num_experts)


def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scores for the load-balancing loss: returns ``(routing_map bool, scores float32)``.

    Softmax scores, or sigmoid/sqrtsoftplus scores normalized over all experts; ``routing_map``
    marks each token's top-k of those scores.
    """
    _check_logits("fused_compute_score_for_moe_aux_loss", logits, topk, score_function)
    scores = _scores(logits, score_function)
    if score_function != "softmax":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top_indices = _topk_by_index(scores, topk)[1]
    routing_map = (top_indices.unsqueeze(-1) == torch.arange(logits.shape[1], device=logits.device)).any(1)
    return routing_map, scores


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Switch-style load-balancing loss
    ``sum_e(sum_t probs[t, e] * tokens_per_expert[e]) * num_experts * coeff / (topk * total_num_tokens**2)``.
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"`probs` of fused_moe_aux_loss must be a 2-D [num_tokens, num_experts] tensor, "
                         f"got {getattr(probs, 'shape', type(probs).__name__)}")
    if probs.shape[1] != num_experts or tuple(tokens_per_expert.shape) != (num_experts,):
        raise ValueError(f"`probs` [.., {probs.shape[1]}] and `tokens_per_expert` {tuple(tokens_per_expert.shape)} "
                         f"of fused_moe_aux_loss must both have num_experts={num_experts} entries")
    aggregated = probs.sum(dim=0)
    return torch.sum(aggregated * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))
