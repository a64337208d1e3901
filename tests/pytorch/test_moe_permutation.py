"""transformer_engine.pytorch.permutation against Megatron-core's unfused permutation.

The references reproduce ``permute``, ``unpermute`` and ``sort_chunks_by_idxs`` of
megatron/core/transformer/moe/moe_utils.py (megatron-core 0.19.2, the argsort / index_add path),
evaluated in float64 for gradients. Forward rows are gathers, so they must agree bitwise; sums
over a token's experts agree to float32 rounding.
"""

import pytest
import torch

from transformer_engine.pytorch.permutation import (moe_permute, moe_permute_with_probs,
                                                    moe_sort_chunks_by_index,
                                                    moe_sort_chunks_by_index_with_probs, moe_unpermute)

T, E, H, K = 12, 6, 16, 2


def close(a, b):
    """float32 rounding of a few-term sum against a float64 reference."""
    torch.testing.assert_close(a.double(), b.double(), rtol=2e-6, atol=2e-6)


# --- Megatron 0.19.2 moe_utils.py, unfused ---------------------------------------------------

def ref_permute(tokens, routing_map, probs, num_out_tokens):
    num_tokens = tokens.shape[0]
    flat_sorted = routing_map.bool().T.contiguous().reshape(-1).argsort(descending=True, stable=True)
    flat_sorted = flat_sorted[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted] if probs is not None else None
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def ref_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None):
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype)
    out = out.index_add(0, sorted_indices, permuted_tokens)
    return out.to(input_dtype)


def ref_sort_chunks(inp, split_sizes, sorted_idxs):
    chunks = torch.split(inp, split_sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs.tolist()], dim=0)


# ---------------------------------------------------------------------------------------------

def routing(seed=0, topk=K, num_tokens=T, num_experts=E):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    idx = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.softmax(logits, -1) * routing_map
    tokens = torch.randn(num_tokens, H, generator=g)
    return tokens, routing_map, probs, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drop", [0, 5])
def test_permute_with_probs_matches_megatron_order_bitwise(dtype, drop):
    tokens, routing_map, probs, _ = routing()
    tokens = tokens.to(dtype)
    n_out = T * K - drop
    out, pprobs, row_id_map = moe_permute_with_probs(tokens, probs, routing_map, num_out_tokens=n_out)
    ref_out, ref_pprobs, _ = ref_permute(tokens, routing_map, probs, n_out)
    assert out.dtype == dtype and out.shape == (n_out, H)
    assert torch.equal(out, ref_out) and torch.equal(pprobs, ref_pprobs)
    out2, _ = moe_permute(tokens, routing_map, num_out_tokens=n_out)
    assert torch.equal(out2, ref_out)
    assert row_id_map.shape == (T, E) and int((row_id_map >= 0).sum()) == n_out


def test_permute_default_num_out_tokens_is_every_routed_pair():
    tokens, routing_map, _, _ = routing(seed=1)
    out, _ = moe_permute(tokens, routing_map)
    assert torch.equal(out, ref_permute(tokens, routing_map, None, T * K)[0])


def test_unpermute_forward_and_gradients_match_megatron():
    tokens, routing_map, probs, _ = routing(seed=2)
    x = tokens.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    out, pprobs, row_id_map = moe_permute_with_probs(x, p, routing_map, num_out_tokens=T * K)
    expert_out = torch.tanh(out) * (1 + pprobs.unsqueeze(-1))            # use both outputs
    y = moe_unpermute(expert_out, row_id_map, merging_probs=p, restore_shape=x.shape)
    gy = torch.randn(T, H, generator=torch.Generator().manual_seed(9))
    (y * gy).sum().backward()

    x64 = tokens.double().requires_grad_()
    p64 = probs.double().requires_grad_()
    r_out, r_pprobs, sorted_indices = ref_permute(x64, routing_map, p64, T * K)
    r_expert = torch.tanh(r_out) * (1 + r_pprobs.unsqueeze(-1))
    r_y = ref_unpermute(r_expert, sorted_indices, x64.shape, probs=p64, routing_map=routing_map)
    (r_y * gy.double()).sum().backward()

    close(y, r_y)
    close(x.grad, x64.grad)
    close(p.grad, p64.grad)
    assert torch.equal(p.grad == 0, ~routing_map)                        # unrouted pairs get no gradient


def test_unpermute_without_probs_and_round_trip_exact():
    tokens, routing_map, _, _ = routing(seed=3, topk=1)
    out, row_id_map = moe_permute(tokens, routing_map)
    assert torch.equal(moe_unpermute(out, row_id_map, restore_shape=tokens.shape), tokens)
    tokens, routing_map, _, _ = routing(seed=3)
    out, row_id_map = moe_permute(tokens, routing_map)
    ref = ref_unpermute(out.double(), ref_permute(tokens, routing_map, None, T * K)[2], tokens.shape)
    close(moe_unpermute(out, row_id_map), ref)


def test_dropped_rows_contribute_nothing():
    tokens, routing_map, probs, _ = routing(seed=4)
    n_out = T * K - 7
    out, row_id_map = moe_permute(tokens, routing_map, num_out_tokens=n_out)
    _, _, sorted_indices = ref_permute(tokens, routing_map, probs, n_out)
    y = moe_unpermute(out, row_id_map, restore_shape=tokens.shape)
    ref = torch.zeros(T, H, dtype=torch.float64).index_add(0, sorted_indices, out.double())
    close(y, ref)


def test_index_map_equals_mask_map():
    tokens, routing_map, probs, idx = routing(seed=5)
    x = tokens.clone().requires_grad_()
    out_m, rid_m = moe_permute(x, routing_map)
    xi = tokens.clone().requires_grad_()
    out_i, rid_i = moe_permute(xi, idx.to(torch.int32), map_type="index")
    assert torch.equal(out_m, out_i) and rid_i.shape == (T, K)
    w = torch.gather(probs, 1, idx)
    y_m = moe_unpermute(out_m, rid_m, merging_probs=probs)
    y_i = moe_unpermute(out_i, rid_i, merging_probs=w, map_type="index")
    assert torch.equal(y_m, y_i)                                          # same slots, same order
    y_m.square().sum().backward()
    y_i.square().sum().backward()
    assert torch.equal(x.grad, xi.grad)


def test_sort_chunks_forward_backward_match_megatron():
    g = torch.Generator().manual_seed(6)
    split_sizes = torch.tensor([3, 0, 5, 2, 4])
    sorted_idx = torch.tensor([2, 0, 4, 1, 3])
    n = int(split_sizes.sum())
    x = torch.randn(n, H, generator=g, requires_grad=True)
    p = torch.rand(n, generator=g, requires_grad=True)
    out, out_p = moe_sort_chunks_by_index_with_probs(x, p, split_sizes, sorted_idx)
    assert torch.equal(out, ref_sort_chunks(x, split_sizes, sorted_idx))
    assert torch.equal(out_p, ref_sort_chunks(p, split_sizes, sorted_idx))
    assert torch.equal(moe_sort_chunks_by_index(x, split_sizes, sorted_idx), out)
    gy, gp = torch.randn(n, H, generator=g), torch.randn(n, generator=g)
    (out * gy).sum().add((out_p * gp).sum()).backward()
    xr, pr = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    (ref_sort_chunks(xr, split_sizes, sorted_idx) * gy).sum().add(
        (ref_sort_chunks(pr, split_sizes, sorted_idx) * gp).sum()).backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(p.grad, pr.grad)


def _run_all(deterministic):
    torch.use_deterministic_algorithms(deterministic)
    try:
        tokens, routing_map, probs, _ = routing(seed=7)
        x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out, pprobs, rid = moe_permute_with_probs(x, p, routing_map, T * K)
        y = moe_unpermute(torch.sin(out) * pprobs.unsqueeze(-1), rid, merging_probs=p)
        y.square().sum().backward()
        return [y.detach(), x.grad, p.grad]
    finally:
        torch.use_deterministic_algorithms(False)


def test_bitwise_run_to_run_and_under_deterministic_algorithms():
    a, b, c = _run_all(False), _run_all(False), _run_all(True)
    for u, v, w in zip(a, b, c):
        assert torch.equal(u, v) and torch.equal(u, w)


def test_refusals_are_named():
    tokens, routing_map, probs, _ = routing()
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(NotImplementedError, match="`inp="):
            moe_permute(tokens.to(torch.float8_e4m3fn), routing_map)
    with pytest.raises(ValueError, match="`map_type`"):
        moe_permute(tokens, routing_map, map_type="dense")
    with pytest.raises(ValueError, match="`routing_map`"):
        moe_permute(tokens, routing_map[:-1])
    with pytest.raises(ValueError, match="`probs`"):
        moe_permute_with_probs(tokens, probs[:, :-1], routing_map)
    _, rid = moe_permute(tokens, routing_map)
    with pytest.raises(ValueError, match="`restore_shape`"):
        moe_unpermute(torch.zeros(T * K, H), rid, restore_shape=(T + 1, H))
    with pytest.raises(ValueError, match="`split_sizes`"):
        moe_sort_chunks_by_index(tokens, torch.tensor([5, 5]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="`sorted_index`"):
        moe_sort_chunks_by_index(tokens, torch.tensor([6, 6]), torch.tensor([1, 1]))
