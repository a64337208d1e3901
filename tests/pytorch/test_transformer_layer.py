"""TransformerLayer against a float64 plain-torch reference built from its own parameters (layer_reference.py).

Outputs and every gradient for encoder and decoder layers: every norm placement (pre-norm, post-layernorm
residuals, BERT's output_layernorm, both together, parallel attention+MLP), both norms, several activations, GQA,
rotary embeddings, bshd/sbhd, sliding windows, no biases. Then: bitwise run to run, dropout and drop path
reproducible from their generators, a 2-layer stack decoding through the KV cache bitwise the training rows,
TransformerEngine's quickstart example, tensor parallelism on two gloo ranks, and the refusals.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import layer_reference as R
from transformer_engine.common.modules import LayerStructure
from transformer_engine.pytorch import (
    CudaRNGStatesTracker, InferenceParams, RotaryPositionEmbedding, TransformerLayer,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, FFN, HEADS, D = 64, 96, 4, 16
OUT_TOL = dict(atol=5e-6, rtol=2e-5)
GRAD_TOL = dict(atol=2e-5, rtol=2e-4)
REPO = Path(__file__).resolve().parents[2]


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("hidden_dropout", 0.0)
    kw.setdefault("attention_dropout", 0.0)
    layer = TransformerLayer(HIDDEN, FFN, HEADS, device=DEVICE, **kw)
    with torch.no_grad():  # non-trivial norms and biases (they start at 1 and 0)
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.eval()


def _input(fmt, s, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((b, s, HIDDEN) if fmt == "bshd" else (s, b, HIDDEN), generator=g).to(DEVICE)


CONFIGS = {
    "encoder_defaults": dict(),
    "encoder_rms_swiglu_gqa_bshd_rope_fused_qkv": dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2,
                                                       attn_input_format="bshd", fuse_qkv_params=True, rope=True),
    "encoder_post_layernorm_residual_relu": dict(apply_residual_connection_post_layernorm=True, activation="relu"),
    "encoder_output_layernorm_zero_gamma_srelu": dict(output_layernorm=True, zero_centered_gamma=True,
                                                      activation="srelu", self_attn_mask_type="no_mask"),
    "encoder_output_layernorm_and_post_layernorm_rms": dict(output_layernorm=True,
                                                            apply_residual_connection_post_layernorm=True,
                                                            normalization="RMSNorm"),
    "encoder_parallel_attention_mlp_qgelu_window": dict(parallel_attention_mlp=True, activation="qgelu",
                                                        window_size=(4, 0)),
    "encoder_clamped_swiglu_no_bias": dict(activation="clamped_swiglu", activation_params={"limit": 0.5},
                                           bias=False),
    "decoder_geglu_gqa": dict(layer_type="decoder", activation="geglu", num_gqa_groups=2),
    "decoder_post_layernorm_rms_bshd_rope": dict(layer_type="decoder", apply_residual_connection_post_layernorm=True,
                                                 normalization="RMSNorm", attn_input_format="bshd", rope=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_fp64_reference(name):
    kw = dict(CONFIGS[name])
    use_rope = kw.pop("rope", False)
    layer = _layer(**kw)
    fmt = layer.attn_input_format
    x = _input(fmt, 10).requires_grad_(True)
    x64 = x.detach().cpu().double().requires_grad_(True)
    enc = _input(fmt, 7, seed=2) if layer.layer_type == "decoder" else None
    rope = RotaryPositionEmbedding(D)(16) if use_rope else None
    out = layer(x, encoder_output=enc, rotary_pos_emb=rope)
    P = R.double_params(layer)
    ref = R.transformer_layer(layer, P, x64, encoder_output=enc, rotary_pos_emb=rope)
    assert out.shape == x.shape
    torch.testing.assert_close(out.cpu().double(), ref, **OUT_TOL)
    R.grads_close(layer, P, x, x64, out, ref, **GRAD_TOL)


def test_signature_is_transformer_engines():
    """TransformerEngine's argument names in its order (positional calls bind the same way)."""
    import inspect

    init = ("hidden_size ffn_hidden_size num_attention_heads num_gqa_groups layernorm_epsilon hidden_dropout "
            "attention_dropout init_method output_layer_init_method layer_number kv_channels self_attn_mask_type "
            "window_size bottom_right_diagonal enc_dec_attn_mask_type enc_dec_bottom_right_diagonal "
            "enc_dec_window_size tp_group tp_size params_dtype get_rng_state_tracker fuse_wgrad_accumulation "
            "seq_length micro_batch_size sequence_parallel apply_residual_connection_post_layernorm output_layernorm "
            "parallel_attention_mlp layer_type drop_path_rate set_parallel_mode fuse_qkv_params "
            "rotary_pos_interleaved zero_centered_gamma qkv_weight_interleaved ub_tp_comm_overlap ub_overlap_ag "
            "ub_overlap_rs ub_overlap_rs_dgrad ub_bulk_dgrad ub_bulk_wgrad bias activation activation_params "
            "normalization device attn_input_format name qk_norm_type qk_norm_eps qk_norm_before_rope softmax_type")
    forward = ("hidden_states attention_mask self_attn_mask_type window_size bottom_right_diagonal encoder_output "
               "enc_dec_attn_mask enc_dec_attn_mask_type enc_dec_window_size enc_dec_bottom_right_diagonal "
               "is_first_microbatch checkpoint_core_attention inference_params rotary_pos_emb core_attention_bias_type "
               "core_attention_bias alibi_slopes cu_seqlens_q cu_seqlens_kv cu_seqlens_q_padded cu_seqlens_kv_padded "
               "max_seqlen_q max_seqlen_kv fast_zero_fill pad_between_seqs")
    for fn, names in ((TransformerLayer.__init__, init), (TransformerLayer.forward, forward)):
        assert list(inspect.signature(fn).parameters)[1:] == names.split()


def test_parameter_names_are_transformer_engines():
    names = [n for n, _ in _layer(layer_type="decoder", output_layernorm=True, fuse_qkv_params=True).named_parameters()]
    assert names == [
        "self_attention.qkv.weight", "self_attention.qkv.bias", "self_attention.proj.weight",
        "self_attention.proj.bias", "inter_attention.layernorm_query.layer_norm_weight",
        "inter_attention.layernorm_query.layer_norm_bias", "inter_attention.layernorm_query.weight",
        "inter_attention.layernorm_query.bias", "inter_attention.key_value.weight", "inter_attention.key_value.bias",
        "inter_attention.proj.weight", "inter_attention.proj.bias", "layernorm_mlp.layer_norm_weight",
        "layernorm_mlp.layer_norm_bias", "layernorm_mlp.fc1_weight", "layernorm_mlp.fc1_bias",
        "layernorm_mlp.fc2_weight", "layernorm_mlp.fc2_bias", "layernorm.weight", "layernorm.bias"]


def test_composition_comes_from_layer_structure(monkeypatch):
    """The layer runs LayerStructure.run: the shared order of sublayers, norms and residuals."""
    calls = []
    run = LayerStructure.run

    def spy(self, *args, **kwargs):
        calls.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(LayerStructure, "run", spy)
    layer = _layer(layer_type="decoder", apply_residual_connection_post_layernorm=True)
    layer(_input("sbhd", 5), encoder_output=_input("sbhd", 3))
    assert calls == [LayerStructure(layer_type="decoder", apply_residual_connection_post_layernorm=True)]


def _fwd_bwd(layer, x, **kw):
    x = x.clone().requires_grad_(True)
    out = layer(x, **kw)
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=out.device))
    return [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def test_bitwise_run_to_run():
    x = _input("sbhd", 12)
    rope = RotaryPositionEmbedding(D)(16)
    runs = [_fwd_bwd(_layer(num_gqa_groups=2, activation="swiglu"), x, rotary_pos_emb=rope) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_dropout_and_drop_path_reproducible():
    """Attention dropout from the RNG tracker, hidden dropout and drop path from torch's default generator: the
    same seeds give the same bits, another seed other bits, and training differs from eval."""
    tracker = CudaRNGStatesTracker()

    def run(seed):
        tracker.reset()
        tracker.add("model-parallel-rng", seed)
        layer = _layer(hidden_dropout=0.3, attention_dropout=0.3, drop_path_rate=0.5,
                       get_rng_state_tracker=lambda: tracker).train()
        torch.manual_seed(seed)
        return _fwd_bwd(layer, _input("sbhd", 6)), layer

    (a, layer), (b, _), (c, _) = run(5), run(5), run(6)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(layer.eval()(_input("sbhd", 6)), a[0])


def test_drop_path_drops_whole_slices_of_the_first_dim():
    from transformer_engine.pytorch.transformer import DropPath

    dp = DropPath(0.5).train()
    torch.manual_seed(0)
    x = torch.ones(64, 3, 5)
    y = dp(x)
    kept = y.flatten(1).eq(2.0).all(1)
    dropped = y.flatten(1).eq(0.0).all(1)
    assert bool((kept | dropped).all()) and 10 < int(kept.sum()) < 54
    assert torch.equal(dp.eval()(x), x)


def test_two_layer_stack_kv_cache_decode_rows_equal_training_rows():
    """Two layers (RMSNorm, SwiGLU, GQA, RoPE) prefill a prompt of each of two sequences, then decode token by
    token; every row of the stack's output is bitwise the training forward's (each sequence alone, causal), with
    the GEMMs and norms in the product's batch-invariant mode (layer_reference.batch_invariant_gemms)."""
    layers = [_layer(seed=i, normalization="RMSNorm", activation="swiglu", num_gqa_groups=2, layer_number=i + 1,
                     attn_input_format="bshd", fuse_qkv_params=True) for i in range(2)]
    rope = RotaryPositionEmbedding(D)(16)
    lens, prompts = [8, 5], [3, 2]
    seqs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(30 + i)).to(DEVICE)
            for i, n in enumerate(lens)]

    def stack(x, **kw):
        for layer in layers:
            x = layer(x, rotary_pos_emb=rope, **kw)
        return x

    params = InferenceParams(2, 16, 2, D, torch.float32, qkv_format="bshd")
    got, pos = [[], []], [0, 0]
    with torch.no_grad(), R.batch_invariant_gemms():
        train = [stack(s[None])[0] for s in seqs]
        while any(p < n for p, n in zip(pos, lens)):
            step = OrderedDict((i, prompts[i] if pos[i] == 0 else 1) for i in (0, 1) if pos[i] < lens[i])
            params.pre_step(step)
            x = torch.zeros(len(step), max(step.values()), HIDDEN, device=DEVICE)
            for b, (i, n) in enumerate(step.items()):
                x[b, :n] = seqs[i][pos[i]:pos[i] + n]
            out = stack(x, inference_params=params)
            for b, (i, n) in enumerate(step.items()):
                got[i].append(out[b, :n])
                pos[i] += n
    for i in range(2):
        rows = torch.cat(got[i])
        bad = (rows != train[i]).any(-1).nonzero().flatten().tolist()
        assert not bad, f"sequence {i}: rows {bad} differ by up to {(rows - train[i]).abs().max().item()}"


def test_thd_packed_rows_equal_each_sequence_alone():
    """attn_input_format="thd": three sequences packed with cu_seqlens give, row for row and bit for bit, what the
    same layer (bshd) gives each sequence alone (GEMMs row by row: layer_reference.row_by_row_gemms)."""
    kw = dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2)
    packed = _layer(attn_input_format="thd", self_attn_mask_type="padding_causal", **kw)
    alone = _layer(attn_input_format="bshd", **kw)
    lens = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32, device=DEVICE)
    x = torch.randn(sum(lens), HIDDEN, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    rope = RotaryPositionEmbedding(D)(16)
    with torch.no_grad(), R.row_by_row_gemms():
        out = packed(x, rotary_pos_emb=rope, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
        refs = [alone(x[cu[i]:cu[i + 1]][None], rotary_pos_emb=rope)[0] for i in range(3)]
    assert torch.equal(out, torch.cat(refs))


def test_quickstart_example_runs():
    """examples/te_quickstart_pytorch.py: TransformerEngine's quickstart layer, forward and backward."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "te_quickstart_pytorch.py")], capture_output=True,
                          text=True, env=env, cwd=str(REPO), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matches the plain PyTorch layer: True" in proc.stdout, proc.stdout
    assert "two runs bitwise equal: True" in proc.stdout, proc.stdout


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_tensor_parallel_on_two_gloo_ranks_matches_single_rank():
    """tests/pytorch/distributed/transformer_layer_tp.py: heads split over 2 ranks (GQA, split and fused QKV,
    sequence parallel, post-layernorm, parallel attention+MLP, QK norms, a decoder) equal the single-rank layer."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # unfused: seconds, not minutes
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "pytorch" / "distributed" / "transformer_layer_tp.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and len(lines) == 5 and all(line.startswith("PASS") for line in lines), report


def test_refusals_name_the_argument():
    with pytest.raises(NotImplementedError, match="ub_tp_comm_overlap"):
        TransformerLayer(HIDDEN, FFN, HEADS, ub_tp_comm_overlap=True, device="cpu")
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation"):
        TransformerLayer(HIDDEN, FFN, HEADS, fuse_wgrad_accumulation=True, device="cpu")
    with pytest.raises(ValueError, match="layer_type"):
        TransformerLayer(HIDDEN, FFN, HEADS, layer_type="encoder-decoder", device="cpu")
    with pytest.raises(ValueError, match="parallel_attention_mlp"):
        TransformerLayer(HIDDEN, FFN, HEADS, parallel_attention_mlp=True, layer_type="decoder", device="cpu")
    with pytest.raises(ValueError, match="output_layernorm"):
        TransformerLayer(HIDDEN, FFN, HEADS, parallel_attention_mlp=True, output_layernorm=True, device="cpu")
    with pytest.raises(ValueError, match="hidden_dropout"):
        TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=1.0, device="cpu")
    with pytest.raises(ValueError, match="drop_path_rate"):
        TransformerLayer(HIDDEN, FFN, HEADS, drop_path_rate=-0.1, device="cpu")
    with pytest.raises(ValueError, match="activation"):
        TransformerLayer(HIDDEN, FFN, HEADS, activation="tanh", device="cpu")
    with pytest.raises(ValueError, match="attn_input_format"):
        TransformerLayer(HIDDEN, FFN, HEADS, attn_input_format="hbsd", device="cpu")
    decoder = _layer(layer_type="decoder")
    x = _input("sbhd", 4)
    with pytest.raises(ValueError, match="encoder_output"):
        decoder(x)
    params = InferenceParams(2, 16, HEADS, D, torch.float32)
    with pytest.raises(NotImplementedError, match="inference_params"):
        decoder(x, encoder_output=x, inference_params=params)
