"""Plain-torch float64 references of MultiheadAttention and TransformerLayer, built from a module's parameters.

Each reference reads the module's configuration and its parameters by TransformerEngine's names and states the
math directly: matmuls, norms, softmax attention with explicit masks, rotary rotation, activations. The QKV
layouts are written as index formulas (which output channels hold head ``j``'s query, key and value), not with
the module's views, so a layout error shows up as a mismatch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, Optional, Tuple

import torch

from transformer_engine.common.modules import apply_activation

F64 = torch.float64


def double_params(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The module's parameters as float64 CPU leaves that record gradients, by name (the references run on the
    CPU whatever device the module is on)."""
    return {n: p.detach().to("cpu", F64).requires_grad_(True) for n, p in module.named_parameters()}


def norm(x, weight, bias, eps, normalization, zero_centered_gamma):
    gamma = 1.0 + weight if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps) * gamma
        return y + bias
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma


def linear(x, P, prefix, names=("",)):
    """``x W^T + b`` with the weight (and bias) of ``prefix``: one ``weight`` or parts ``<name>_weight``."""
    if f"{prefix}weight" in P:
        w, b = P[f"{prefix}weight"], P.get(f"{prefix}bias")
    else:
        w = torch.cat([P[f"{prefix}{n}_weight"] for n in names])
        b = torch.cat([P[f"{prefix}{n}_bias"] for n in names]) if f"{prefix}{names[0]}_bias" in P else None
    y = x @ w.t()
    return y if b is None else y + b


def rope(x, freqs, interleaved, positions):
    """x [b, s, h, d] rotated by the angles ``freqs`` [S, 1, 1, d2] at ``positions`` [b, s]."""
    ang = freqs.reshape(freqs.shape[0], freqs.shape[-1]).to("cpu", F64)[positions][:, :, None, :]  # [b, s, 1, d2]
    d2 = ang.shape[-1]
    xr = x[..., :d2]
    if interleaved:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        rot = torch.cat((-xr[..., d2 // 2:], xr[..., : d2 // 2]), dim=-1)
    return torch.cat((xr * torch.cos(ang) + rot * torch.sin(ang), x[..., d2:]), dim=-1)


def attention(q, k, v, mask_type, window, scale, groups, bottom_right=None):
    """Softmax attention, [b, s, h, d]; query head j reads key/value head j // (h // groups). Query i sees key
    j when ``i + diag - left <= j <= i + diag + right`` (a bound of -1 unbounded; causal masks right = 0); diag
    is 0 for causal (top-left) and s_kv - s_q for bottom-right alignment."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    per = h // groups
    idx = torch.arange(h) // per
    k, v = k[:, :, idx], v[:, :, idx]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    left, right = (-1, -1) if window is None else window
    if "causal" in mask_type:
        right = 0
    if bottom_right is None:
        bottom_right = mask_type not in ("causal", "padding_causal")
    diag = sk - sq if bottom_right else 0
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i + diag - left
    if right >= 0:
        visible &= j <= i + diag + right
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _heads(y, idx, d):
    """Columns ``idx[j] * d .. + d`` of y [..., n] as head j: [..., len(idx), d]."""
    return torch.stack([y[..., c * d:(c + 1) * d] for c in idx], dim=-2)


def mha(m, P, x, encoder_output=None, rotary_pos_emb=None, prefix="", attn_mask_type=None, window_size=None,
        positions=None):
    """MultiheadAttention ``m``'s output(s) in float64 from parameters ``P`` (``prefix``: the module's name in
    P). x and encoder_output in the module's qkv_format (sbhd or bshd). Returns (out, ln_out or None)."""
    fmt = m.qkv_format
    to_b = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
    x = to_b(x.to("cpu", F64))
    h, G, d = m.num_attention_heads_per_partition, m.num_gqa_groups_per_partition, m.hidden_size_per_attention_head
    per = h // G
    ln_out = None

    def normed(name):
        ln = name.replace(".", "")
        return norm(x, P[f"{prefix}{ln}.layer_norm_weight"], P.get(f"{prefix}{ln}.layer_norm_bias"),
                    getattr(m, ln).eps, getattr(m, ln).normalization, getattr(m, ln).zero_centered_gamma)

    if m.attention_type == "self":
        name = "layernorm_qkv." if m.input_layernorm else "qkv."
        inp = normed(name) if m.input_layernorm else x
        if m.input_layernorm:
            ln_out = inp
        y = linear(inp, P, prefix + name, ("query", "key", "value"))
        if m.qkv_weight_interleaved:  # per group: its queries, its key, its value
            qi = [(j // per) * (per + 2) + j % per for j in range(h)]
            ki = [g * (per + 2) + per for g in range(G)]
            vi = [g * (per + 2) + per + 1 for g in range(G)]
        else:  # [q | k | v]
            qi, ki, vi = list(range(h)), [h + g for g in range(G)], [h + G + g for g in range(G)]
        q, k, v = _heads(y, qi, d), _heads(y, ki, d), _heads(y, vi, d)
    else:
        name = "layernorm_query." if m.input_layernorm else "query_layer."
        inp = normed(name) if m.input_layernorm else x
        if m.input_layernorm:
            ln_out = inp
        q = _heads(linear(inp, P, prefix + name, ("query",)), range(h), d)
        y = linear(to_b(encoder_output.to("cpu", F64)), P, prefix + "key_value.", ("key", "value"))
        if m.qkv_weight_interleaved:
            k, v = _heads(y, [2 * g for g in range(G)], d), _heads(y, [2 * g + 1 for g in range(G)], d)
        else:
            k, v = _heads(y, range(G), d), _heads(y, [G + g for g in range(G)], d)

    def qk_norm(t, which):
        mod = getattr(m, which)
        if type(mod).__name__ == "L2Normalization":
            return t / torch.sqrt((t * t).sum(-1, keepdim=True) + mod.eps)
        return norm(t, P[f"{prefix}{which}.weight"], P.get(f"{prefix}{which}.bias"), mod.eps,
                    "RMSNorm" if type(mod).__name__ == "RMSNorm" else "LayerNorm", mod.zero_centered_gamma)

    if m.q_norm is not None and m.qk_norm_before_rope:
        q, k = qk_norm(q, "q_norm"), qk_norm(k, "k_norm")
    if rotary_pos_emb is not None:
        qf, kf = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        pos_q = torch.arange(q.shape[1]).expand(q.shape[0], -1) if positions is None else positions
        pos_k = torch.arange(k.shape[1]).expand(k.shape[0], -1) if positions is None else positions
        q = rope(q, qf, m.rotary_pos_interleaved, pos_q)
        k = rope(k, kf, m.rotary_pos_interleaved, pos_k)
    if m.q_norm is not None and not m.qk_norm_before_rope:
        q, k = qk_norm(q, "q_norm"), qk_norm(k, "k_norm")

    mask = attn_mask_type or m.attn_mask_type
    window = window_size if window_size is not None else m.window_size
    o = attention(q, k, v, mask, window, 1.0 / math.sqrt(d), G, m.bottom_right_diagonal)
    out = o.flatten(-2) @ P[f"{prefix}proj.weight"].t()
    if not m.return_bias and f"{prefix}proj.bias" in P:  # with return_bias it is returned unadded
        out = out + P[f"{prefix}proj.bias"]
    back = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
    return back(out), (None if ln_out is None else back(ln_out))


def mlp(layer, P, x, prefix="layernorm_mlp."):
    """LayerNormMLP: norm, FC1, activation (common/modules.py's table), FC2. Returns (out, ln_out)."""
    ln = norm(x, P[f"{prefix}layer_norm_weight"], P.get(f"{prefix}layer_norm_bias"), layer.eps,
              layer.normalization, layer.zero_centered_gamma)
    y = ln @ P[f"{prefix}fc1_weight"].t()
    if f"{prefix}fc1_bias" in P:
        y = y + P[f"{prefix}fc1_bias"]
    a = apply_activation(torch, layer.activation, y, getattr(layer, "activation_params", None))
    out = a @ P[f"{prefix}fc2_weight"].t()
    if f"{prefix}fc2_bias" in P:
        out = out + P[f"{prefix}fc2_bias"]
    return out, ln


def transformer_layer(t, P, x, encoder_output=None, rotary_pos_emb=None) -> torch.Tensor:
    """TransformerLayer ``t`` in float64 (eval mode: no dropout, no drop path), composed as TransformerEngine's
    forward does, written out here without LayerStructure."""
    x = x.to("cpu", F64)
    sa = t.self_attention
    # With output_layernorm the self attention has no input norm; with post-layernorm residuals a sublayer's
    # residual is its normalized input.
    attn, attn_ln = mha(sa, P, x, rotary_pos_emb=rotary_pos_emb, prefix="self_attention.")
    if sa.return_bias and "self_attention.proj.bias" in P:
        attn = attn + P["self_attention.proj.bias"]
    mlp_mod = t.layernorm_mlp
    if t.parallel_attention_mlp:
        m_out, _ = mlp(mlp_mod, P, x)
        out = x + attn + m_out
    else:
        residual = attn_ln if (t.apply_residual_connection_post_layernorm and not t.output_layernorm) else x
        h = residual + attn
        if t.layer_type == "decoder":
            ia = t.inter_attention
            c, c_ln = mha(ia, P, h, encoder_output=encoder_output, rotary_pos_emb=rotary_pos_emb,
                          prefix="inter_attention.")
            if "inter_attention.proj.bias" in P:
                c = c + P["inter_attention.proj.bias"]
            h = (c_ln if t.apply_residual_connection_post_layernorm else h) + c
        m_out, m_ln = mlp(mlp_mod, P, h)
        out = (m_ln if t.apply_residual_connection_post_layernorm else h) + m_out
    if t.output_layernorm:
        ln = t.layernorm
        out = norm(out, P["layernorm.weight"], P.get("layernorm.bias"), ln.eps,
                   "RMSNorm" if type(ln).__name__ == "RMSNorm" else "LayerNorm", ln.zero_centered_gamma)
    return out


def grads_close(module, P, x, x64, out, ref, atol=2e-6, rtol=2e-5, seed=7) -> Dict[str, float]:
    """Backpropagate the same random weighting of ``out`` (module, fp32, any device) and ``ref`` (fp64, CPU); assert
    the input and every parameter gradient agree. Returns the max abs difference per gradient."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g)
    (out * w.to(out.device, out.dtype)).sum().backward()
    (ref * w.to(F64)).sum().backward()
    dx = x.grad.to("cpu", F64)
    diffs = {"input": (dx - x64.grad).abs().max().item()}
    torch.testing.assert_close(dx, x64.grad, atol=atol, rtol=rtol)
    for n, p in module.named_parameters():
        assert p.grad is not None, f"{n} got no gradient"
        grad = p.grad.to("cpu", F64)
        torch.testing.assert_close(grad, P[n].grad, atol=atol, rtol=rtol, msg=lambda s: f"{n}: {s}")
        diffs[n] = (grad - P[n].grad).abs().max().item()
    return diffs


@contextlib.contextmanager
def row_by_row_gemms() -> Iterator[None]:
    """``torch.nn.functional.linear`` computed one token row at a time. A BLAS may sum a row's products in another
    order for another number of rows (CPU sgemm does for small counts), so a decode step's GEMM over its few rows
    and the training forward's over all rows can differ in the last bit; batch-invariant GEMMs remove that, and
    this stands in for them, so that a decode test checks the rest of the block: norms, RoPE positions, the KV
    cache and attention."""
    plain = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([plain(rows[i:i + 1], weight, bias) for i in range(rows.shape[0])])
        return out.reshape(*x.shape[:-1], weight.shape[0])

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = plain


def batch_invariant_gemms():
    """The product's batch-invariant mode (``te.batch_invariant()``: GEMMs and norms whose rows do not depend on
    the row count) where its kernels run (CUDA, or the CPU under Triton's interpreter); elsewhere
    :func:`row_by_row_gemms` stands in for it."""
    from transformer_engine.pytorch.attention.config import triton_interpreting
    from transformer_engine.pytorch.batch_invariance import batch_invariant

    if torch.cuda.is_available() or triton_interpreting():
        return batch_invariant()
    return row_by_row_gemms()
