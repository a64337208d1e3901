"""MultiheadAttention against a float64 plain-torch reference built from its own parameters (layer_reference.py).

Outputs and every gradient (input and each parameter, by TransformerEngine's names) of self and cross attention:
GQA/MQA, both QKV layouts (separate parameters, fused interleaved, fused concatenated), input norm on/off with
both norms, rotary embeddings (both pairings), QK norms before/after RoPE, sliding windows, sbhd/bshd/thd. Then:
bitwise run to run, dropout reproducible from the RNG tracker, KV-cache decode rows bitwise the training rows,
and the refusals. The fused kernels run under Triton's interpreter when TRITON_INTERPRET=1 (CI), else unfused.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import layer_reference as R
from transformer_engine.pytorch import CudaRNGStatesTracker, InferenceParams, RotaryPositionEmbedding
from transformer_engine.pytorch.attention import MultiheadAttention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, HEADS, D = 64, 4, 16
# fp32 module against the fp64 reference: outputs to a few fp32 ulps of their size, gradients (sums over
# tokens) a little looser.
OUT_TOL = dict(atol=2e-6, rtol=1e-5)
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)


def _module(seed=0, **kw):
    torch.manual_seed(seed)
    m = MultiheadAttention(HIDDEN, HEADS, attention_dropout=kw.pop("attention_dropout", 0.0), device=DEVICE, **kw)
    with torch.no_grad():  # non-trivial norms and biases (they start at 1 and 0)
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def _input(fmt, s, b=2, seed=1, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    shape = (b, s, hidden) if fmt == "bshd" else (s, b, hidden)
    return torch.randn(shape, generator=g).to(DEVICE)


CONFIGS = {
    "self_defaults": dict(),
    "self_ln_fused_interleaved_gqa_bshd_rope": dict(input_layernorm=True, fuse_qkv_params=True, num_gqa_groups=2,
                                                    qkv_format="bshd", rope=True),
    "self_rms_zero_gamma_fused_concat_gqa_window_rope_interleaved": dict(
        input_layernorm=True, normalization="RMSNorm", zero_centered_gamma=True, fuse_qkv_params=True,
        qkv_weight_interleaved=False, num_gqa_groups=2, window_size=(3, 0), rotary_pos_interleaved=True, rope=True),
    "self_mqa_no_mask_no_bias": dict(num_gqa_groups=1, attn_mask_type="no_mask", bias=False),
    "self_qk_rmsnorm_before_rope": dict(input_layernorm=True, qk_norm_type="RMSNorm", qk_norm_before_rope=True,
                                        rope=True),
    "self_qk_l2_after_rope_bshd": dict(qk_norm_type="L2Normalization", qkv_format="bshd", rope=True),
    "self_qk_layernorm": dict(qk_norm_type="LayerNorm", input_layernorm=True, normalization="RMSNorm"),
    "cross_ln_fused_gqa": dict(attention_type="cross", input_layernorm=True, fuse_qkv_params=True, num_gqa_groups=2,
                               attn_mask_type="no_mask"),
    "cross_split_mqa_bshd": dict(attention_type="cross", num_gqa_groups=1, attn_mask_type="no_mask",
                                 qkv_format="bshd"),
    "cross_concat_rope_pair": dict(attention_type="cross", fuse_qkv_params=True, qkv_weight_interleaved=False,
                                   attn_mask_type="no_mask", input_layernorm=True, rope=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_fp64_reference(name):
    kw = dict(CONFIGS[name])
    use_rope = kw.pop("rope", False)
    m = _module(**kw)
    fmt = m.qkv_format
    x = _input(fmt, 10).requires_grad_(True)
    x64 = x.detach().cpu().double().requires_grad_(True)
    enc = _input(fmt, 7, seed=2) if m.attention_type == "cross" else None
    rope = None
    if use_rope:
        table = RotaryPositionEmbedding(D, interleaved=m.rotary_pos_interleaved)(16)
        # Cross attention with a (query, key) pair: the keys rotated by other angles.
        rope = (table, RotaryPositionEmbedding(D, rotary_base=500.0)(16)) if m.attention_type == "cross" else table
    out = m(x, encoder_output=enc, rotary_pos_emb=rope)
    P = R.double_params(m)
    ref, _ = R.mha(m, P, x64, encoder_output=enc, rotary_pos_emb=rope)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), ref, **OUT_TOL)
    R.grads_close(m, P, x, x64, out, ref, **GRAD_TOL)


def test_signature_is_transformer_engines():
    """TransformerEngine's argument names in its order (positional calls bind the same way)."""
    import inspect

    init = ("hidden_size num_attention_heads kv_channels attention_dropout layernorm_epsilon init_method "
            "output_layer_init_method layer_number attn_mask_type window_size bottom_right_diagonal tp_group tp_size "
            "num_gqa_groups fuse_wgrad_accumulation get_rng_state_tracker sequence_parallel params_dtype return_bias "
            "return_layernorm_output input_layernorm attention_type set_parallel_mode fuse_qkv_params "
            "zero_centered_gamma qkv_weight_interleaved rotary_pos_interleaved ub_overlap_ag ub_overlap_rs "
            "ub_overlap_rs_dgrad ub_bulk_dgrad ub_bulk_wgrad bias normalization device qkv_format name qk_norm_type "
            "qk_norm_eps qk_norm_before_rope seq_length micro_batch_size softmax_type")
    forward = ("hidden_states attention_mask encoder_output attn_mask_type window_size bottom_right_diagonal "
               "is_first_microbatch checkpoint_core_attention inference_params rotary_pos_emb core_attention_bias_type "
               "core_attention_bias alibi_slopes cu_seqlens_q cu_seqlens_kv cu_seqlens_q_padded cu_seqlens_kv_padded "
               "max_seqlen_q max_seqlen_kv fast_zero_fill pad_between_seqs")
    for fn, names in ((MultiheadAttention.__init__, init), (MultiheadAttention.forward, forward)):
        assert list(inspect.signature(fn).parameters)[1:] == names.split()


def test_parameter_names_are_transformer_engines():
    names = lambda m: [n for n, _ in m.named_parameters()]  # noqa: E731
    assert names(_module()) == ["qkv.query_weight", "qkv.query_bias", "qkv.key_weight", "qkv.key_bias",
                                "qkv.value_weight", "qkv.value_bias", "proj.weight", "proj.bias"]
    assert names(_module(input_layernorm=True, fuse_qkv_params=True, normalization="RMSNorm", bias=False)) == [
        "layernorm_qkv.layer_norm_weight", "layernorm_qkv.weight", "proj.weight"]
    assert names(_module(attention_type="cross", input_layernorm=True, qk_norm_type="RMSNorm")) == [
        "q_norm.weight", "k_norm.weight", "layernorm_query.layer_norm_weight", "layernorm_query.layer_norm_bias",
        "layernorm_query.query_weight", "layernorm_query.query_bias", "key_value.key_weight", "key_value.key_bias",
        "key_value.value_weight", "key_value.value_bias", "proj.weight", "proj.bias"]
    assert names(_module(attention_type="cross", fuse_qkv_params=True)) == [
        "query_layer.weight", "query_layer.bias", "key_value.weight", "key_value.bias", "proj.weight", "proj.bias"]
    m = _module(num_gqa_groups=2, kv_channels=8)
    assert tuple(m.qkv.query_weight.shape) == (HEADS * 8, HIDDEN) and tuple(m.qkv.key_weight.shape) == (2 * 8, HIDDEN)
    assert tuple(m.proj.weight.shape) == (HIDDEN, HEADS * 8)


def test_return_bias_and_layernorm_output():
    m = _module(input_layernorm=True, return_bias=True, return_layernorm_output=True)
    x = _input("sbhd", 9)
    out, bias, ln_out = m(x)
    P = R.double_params(m)
    ref, ref_ln = R.mha(m, P, x)
    assert bias is m.proj.bias or torch.equal(bias, m.proj.bias)
    torch.testing.assert_close(out.cpu().double(), ref, **OUT_TOL)
    torch.testing.assert_close(ln_out.cpu().double(), ref_ln, **OUT_TOL)
    # Without input_layernorm there is no norm output to return: (out, bias) only.
    plain = _module(return_bias=True, return_layernorm_output=True)
    assert len(plain(x)) == 2
    no_bias = _module(return_bias=True, bias=False)
    assert no_bias(x)[1].numel() == 0


def test_thd_packed_matches_each_sequence_alone():
    """thd with cu_seqlens (rotary per sequence): each sequence's rows are the reference's for it alone."""
    m = _module(qkv_format="thd", input_layernorm=True, num_gqa_groups=2, attn_mask_type="padding_causal")
    lens = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32, device=DEVICE)
    x = torch.randn(sum(lens), HIDDEN, generator=torch.Generator().manual_seed(4)).to(DEVICE).requires_grad_(True)
    rope = RotaryPositionEmbedding(D)(16)
    out = m(x, rotary_pos_emb=rope, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    P = R.double_params(m)
    m.qkv_format = "bshd"  # the reference reads the format: each sequence alone as a batch of one
    try:
        refs = [R.mha(m, P, x.detach()[cu[i]:cu[i + 1]][None], rotary_pos_emb=rope, attn_mask_type="causal")[0][0]
                for i in range(3)]
    finally:
        m.qkv_format = "thd"
    torch.testing.assert_close(out.cpu().double(), torch.cat(refs), **OUT_TOL)


def _fwd_bwd(m, x, **kw):
    x = x.clone().requires_grad_(True)
    out = m(x, **kw)
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=out.device))
    return [out.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]


def test_bitwise_run_to_run():
    x = _input("sbhd", 12)
    rope = RotaryPositionEmbedding(D)(16)
    runs = [_fwd_bwd(_module(input_layernorm=True, num_gqa_groups=2), x, rotary_pos_emb=rope) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # Recomputing the core attention in the backward gives the same bits.
    recomputed = _fwd_bwd(_module(input_layernorm=True, num_gqa_groups=2), x, rotary_pos_emb=rope,
                          checkpoint_core_attention=True)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], recomputed))


def test_dropout_reproducible_from_the_rng_tracker():
    tracker = CudaRNGStatesTracker()

    def run(seed):
        tracker.reset()
        tracker.add("model-parallel-rng", seed)
        m = _module(attention_dropout=0.5, get_rng_state_tracker=lambda: tracker).train()
        torch.manual_seed(1234 + seed)  # the default generator differs: dropout must not draw from it
        return _fwd_bwd(m, _input("sbhd", 8))

    a, b, c = run(11), run(11), run(12)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])
    # Dropout is applied: the training output differs from the eval one.
    m = _module(attention_dropout=0.5, get_rng_state_tracker=lambda: tracker)
    assert not torch.equal(m(_input("sbhd", 8)), a[0])


def _decode_module(fmt):
    return _module(qkv_format=fmt, input_layernorm=True, normalization="RMSNorm", num_gqa_groups=2,
                   fuse_qkv_params=True, qk_norm_type="RMSNorm", layer_number=2)


@pytest.mark.parametrize("fmt, paged", [("bshd", False), ("sbhd", False), ("thd", False), ("bshd", True)])
def test_kv_cache_decode_rows_equal_training_rows(fmt, paged):
    """Prefill two prompts, then decode token by token (the second sequence joins late, one finishes early):
    every output row is bitwise the training forward's row for that token (each sequence alone, causal). The GEMMs
    run in the product's batch-invariant mode for the paged case (its interpreted kernels are slow on the CPU)
    and row by row for the others (layer_reference.row_by_row_gemms)."""
    with R.batch_invariant_gemms() if paged else R.row_by_row_gemms():
        _decode_rows_equal_training_rows(fmt, paged)


def _decode_rows_equal_training_rows(fmt, paged):
    m = _decode_module(fmt)
    lens, prompts, joins = [9, 6], [4, 3], [0, 2]
    seqs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(20 + i)).to(DEVICE)
            for i, n in enumerate(lens)]
    rope = RotaryPositionEmbedding(D)(16)
    with torch.no_grad():
        train = [m(s[None] if fmt == "bshd" else s[:, None], rotary_pos_emb=rope, attn_mask_type="causal")
                 if fmt != "thd" else
                 m(s, rotary_pos_emb=rope, attn_mask_type="padding_causal",
                   cu_seqlens_q=torch.tensor([0, len(s)], dtype=torch.int32, device=DEVICE),
                   cu_seqlens_kv=torch.tensor([0, len(s)], dtype=torch.int32, device=DEVICE), max_seqlen_q=len(s),
                   max_seqlen_kv=len(s))
                 for s in seqs]
    train = [t.reshape(-1, HIDDEN) for t in train]
    params = InferenceParams(2, 16, 2, D, torch.float32, qkv_format=fmt, is_paged=paged,
                             page_size=4 if paged else None, total_num_pages=8 if paged else None)
    got, pos, t = [[], []], [0, 0], 0
    with torch.no_grad():
        while any(p < n for p, n in zip(pos, lens)):
            step = OrderedDict((i, prompts[i] if pos[i] == 0 else 1) for i in (1, 0)
                               if joins[i] <= t and pos[i] < lens[i])
            t += 1
            params.pre_step(step)
            if fmt == "thd":
                x = torch.cat([seqs[i][pos[i]:pos[i] + n] for i, n in step.items()])
            else:
                width = max(step.values())
                x = torch.zeros(len(step), width, HIDDEN, device=DEVICE)
                for b, (i, n) in enumerate(step.items()):
                    x[b, :n] = seqs[i][pos[i]:pos[i] + n]
                x = x.transpose(0, 1).contiguous() if fmt == "sbhd" else x
            out = m(x, rotary_pos_emb=rope, inference_params=params)
            first = 0
            for b, (i, n) in enumerate(step.items()):
                if fmt == "thd":
                    rows, first = out[first:first + n], first + n
                else:
                    rows = out[b, :n] if fmt == "bshd" else out[:n, b]
                got[i].append(rows)
                pos[i] += n
    for i in range(2):
        rows = torch.cat(got[i])
        bad = (rows != train[i]).any(-1).nonzero().flatten().tolist()
        assert not bad, f"sequence {i}: rows {bad} differ by up to {(rows - train[i]).abs().max().item()}"


def test_refusals_name_the_argument():
    with pytest.raises(NotImplementedError, match="ub_overlap_ag"):
        MultiheadAttention(HIDDEN, HEADS, ub_overlap_ag=True, device=DEVICE)
    with pytest.raises(NotImplementedError, match="fuse_wgrad_accumulation"):
        MultiheadAttention(HIDDEN, HEADS, fuse_wgrad_accumulation=True, device=DEVICE)  # separate Q/K/V parameters
    with pytest.raises(ValueError, match="attention_type"):
        MultiheadAttention(HIDDEN, HEADS, attention_type="both", device=DEVICE)
    with pytest.raises(ValueError, match="num_gqa_groups"):
        MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=3, device=DEVICE)
    with pytest.raises(ValueError, match="qk_norm_type"):
        MultiheadAttention(HIDDEN, HEADS, qk_norm_type="BatchNorm", device=DEVICE)
    with pytest.raises(ValueError, match="normalization"):
        MultiheadAttention(HIDDEN, HEADS, normalization="GroupNorm", device=DEVICE)
    with pytest.raises(ValueError, match="layer_number"):
        MultiheadAttention(HIDDEN, HEADS, layer_number=0, device=DEVICE)
    with pytest.raises(ValueError, match="tp_size"):
        MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=2, tp_size=4, device=DEVICE)
    cross = _module(attention_type="cross")
    x = _input("sbhd", 4)
    with pytest.raises(ValueError, match="encoder_output"):
        cross(x)
    params = InferenceParams(2, 16, HEADS, D, torch.float32)
    with pytest.raises(NotImplementedError, match="inference_params"):
        cross(x, encoder_output=x, inference_params=params)
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        _module()(x, rotary_pos_emb=(torch.zeros(8, 1, 1, D, device=DEVICE),) * 3)
