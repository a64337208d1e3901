"""DotProductAttention called the way TransformerEngine's own tests call it (tests/pytorch/attention/
test_attention.py): the module built with TE's constructor arguments, forward with TE's keyword set
(attention_mask next to cu_seqlens, num_splits, packed qkv_layer/kv_layer, bias shapes, ALiBi,
bottom_right_diagonal, return_max_logit), checked against the fp64 reference of dpa_helpers.

Configurations are TransformerEngine's (names and shape kinds from its tables), scaled down so the
fused cases run under the Triton interpreter on CPU in fp16.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from dpa_helpers import (
    DEVICE,
    ON_GPU,
    SelectionSpy,
    assert_close_to_reference,
    cu_seqlens,
    gen,
    randn,
    reference,
    reference_and_lowp,
    requires_fused,
    visible,
)
from transformer_engine.common import log as te_log
from transformer_engine.common.attention.backends import NoBackendError
from transformer_engine.pytorch import DotProductAttention

BACKENDS = ["unfused", pytest.param("fused", marks=requires_fused)]
NAMES = {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN",
                 "NVTE_DEBUG", "NVTE_DEBUG_LEVEL", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(te_log, "_warned_once", set())


@dataclass
class ModelConfig:
    """TransformerEngine's test ModelConfig fields that these tests use."""

    batch_size: int
    max_seqlen_q: int
    num_heads: int
    head_dim_qk: int
    max_seqlen_kv: Optional[int] = None
    num_gqa_groups: Optional[int] = None
    head_dim_v: Optional[int] = None
    attn_mask_type: str = "no_mask"
    attn_bias_type: str = "no_bias"
    bias_shape: str = "1hss"
    window_size: Tuple[int, int] = (-1, -1)
    return_max_logit: bool = False

    def __post_init__(self):
        self.max_seqlen_kv = self.max_seqlen_kv or self.max_seqlen_q
        self.num_gqa_groups = self.num_gqa_groups or self.num_heads
        self.head_dim_v = self.head_dim_v or self.head_dim_qk
        self.attn_type = "self" if self.max_seqlen_q == self.max_seqlen_kv else "cross"


def dtype_for(backend: str):
    # The Triton interpreter computes bf16 dots wrongly: fp16 for the fused kernels on CPU.
    return torch.float16 if backend == "fused" or ON_GPU else torch.float32


def padding_mask(lengths, max_len: int) -> torch.Tensor:
    """TransformerEngine's padding mask: [b, 1, 1, s], True after each sequence's tokens."""
    return torch.stack([torch.arange(max_len) >= n for n in lengths]).view(len(lengths), 1, 1, max_len).to(DEVICE)


def te_block(config: ModelConfig, qkv_format: str, **kwargs) -> DotProductAttention:
    """The module as TransformerEngine's _run_dot_product_attention builds it."""
    return DotProductAttention(
        config.num_heads,
        (config.head_dim_qk, config.head_dim_v),
        num_gqa_groups=config.num_gqa_groups,
        attention_dropout=0.0,
        qkv_format=qkv_format,
        attn_mask_type=config.attn_mask_type,
        sequence_parallel=False,
        tp_size=1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number=1,
        attention_type=config.attn_type,
        softmax_type="vanilla",
        return_max_logit=config.return_max_logit,
        **kwargs,
    ).to(device=DEVICE)


def te_forward(block, config: ModelConfig, q, k, v, qkv_format: str, cu_q, cu_kv, attention_mask=None,
               bias=None, alibi_slopes=None, **extra):
    """The forward call of TransformerEngine's _run_dot_product_attention (cu_seqlens always passed,
    the padded ones equal to them, num_splits=1)."""
    kwargs = dict(
        window_size=config.window_size,
        attention_mask=attention_mask,
        qkv_format=qkv_format,
        max_seqlen_q=config.max_seqlen_q,
        max_seqlen_kv=config.max_seqlen_kv,
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=cu_q,
        cu_seqlens_kv_padded=cu_kv,
        attn_mask_type=config.attn_mask_type,
        checkpoint_core_attention=False,
        core_attention_bias_type=config.attn_bias_type,
        core_attention_bias=bias,
        alibi_slopes=alibi_slopes,
        fast_zero_fill=True,
        pad_between_seqs=False,
        num_splits=1,
    )
    kwargs.update(extra)
    return block(q, k, v, **kwargs)


def bshd_inputs(config: ModelConfig, dtype, seed: int = 0):
    g = gen(seed)
    c = config
    q = randn((c.batch_size, c.max_seqlen_q, c.num_heads, c.head_dim_qk), dtype, g)
    k = randn((c.batch_size, c.max_seqlen_kv, c.num_gqa_groups, c.head_dim_qk), dtype, g)
    v = randn((c.batch_size, c.max_seqlen_kv, c.num_gqa_groups, c.head_dim_v), dtype, g)
    return q, k, v


def check(name, out, grads, inputs, d_out, ref_fn):
    ref, low = reference_and_lowp(inputs, d_out, ref_fn)
    assert_close_to_reference(f"{name} out", out, ref[0], low[0])
    for label, g, r, lo in zip(("dq", "dk", "dv", "dbias"), grads, ref[1:], low[1:]):
        assert_close_to_reference(f"{name} {label}", g, r, lo)


# ------------------------------------------------------------------------------------------------
# Signature: TransformerEngine's parameter order
# ------------------------------------------------------------------------------------------------

# TransformerEngine's DotProductAttention.__init__ and forward parameters, in order.
TE_INIT = ["num_attention_heads", "kv_channels", "num_gqa_groups", "attention_dropout", "qkv_format", "attn_mask_type",
           "window_size", "bottom_right_diagonal", "sequence_parallel", "tp_size", "get_rng_state_tracker", "tp_group",
           "layer_number", "attention_type", "cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type",
           "softmax_scale", "softmax_type", "return_max_logit", "name"]
TE_FORWARD = ["query_layer", "key_layer", "value_layer", "attention_mask", "qkv_format", "cu_seqlens_q",
              "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv",
              "attn_mask_type", "window_size", "bottom_right_diagonal", "checkpoint_core_attention",
              "core_attention_bias_type", "core_attention_bias", "alibi_slopes", "fast_zero_fill", "inference_params",
              "pad_between_seqs", "fp8_output", "bf16_backward", "num_splits", "score_mod", "score_mod_bprop",
              "score_mod_tensors", "score_mod_bprop_tensors", "qkv_layer", "kv_layer", "qkv_interleave_dim"]


def test_signatures_follow_transformer_engine_order():
    assert list(inspect.signature(DotProductAttention.__init__).parameters)[1:] == TE_INIT
    assert list(inspect.signature(DotProductAttention.forward).parameters)[1:] == TE_FORWARD


def test_positional_constructor_after_window_size_and_name():
    dpa = DotProductAttention(2, 16, 2, 0.0, "bshd", "no_mask", (4, 4), False, False, 1, None, None, 3, "self",
                              name="attn0")
    assert dpa.bottom_right_diagonal is False and dpa.layer_number == 3 and dpa.name == "attn0"
    assert dpa.sequence_parallel is False and dpa.tp_size == 1


def test_mask_type_spellings():
    assert DotProductAttention(2, 16, attn_mask_type="padding,causal").attn_mask_type == "padding_causal"
    assert DotProductAttention(2, 16, attn_mask_type="causal_padding").attn_mask_type == "padding_causal"


# ------------------------------------------------------------------------------------------------
# bottom_right_diagonal: windows and ALiBi
# ------------------------------------------------------------------------------------------------

_ALIGN = [
    # (mask, s_q, s_kv, bottom_right_diagonal, where): both corners at s_q < s_kv and s_q > s_kv.
    ("no_mask", 11, 21, False, "init"), ("no_mask", 11, 21, True, "forward"), ("no_mask", 21, 11, None, "init"),
    ("no_mask", 21, 11, False, "forward"), ("padding", 21, 11, True, "init"), ("padding", 11, 21, False, "forward"),
    # The causal masks fix the diagonal whatever is passed (TransformerEngine overrides it).
    ("causal", 11, 21, True, "forward"), ("causal_bottom_right", 21, 11, False, "init"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias_type", ["no_bias", "alibi"])
@pytest.mark.parametrize("mask,sq,skv,bottom_right,where", _ALIGN)
def test_bottom_right_diagonal(monkeypatch, backend, bias_type, mask, sq, skv, bottom_right, where):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    window = (3, 0) if "causal" in mask else (3, 2)
    config = ModelConfig(2, sq, 2, 16, max_seqlen_kv=skv, attn_mask_type=mask, attn_bias_type=bias_type,
                         window_size=window)
    dtype = dtype_for(backend)
    q, k, v = bshd_inputs(config, dtype)
    lens_q, lens_kv = ([sq, sq - 3], [skv - 4, skv]) if "padding" in mask else (None, None)
    cu_q = cu_seqlens(lens_q) if lens_q else None
    cu_kv = cu_seqlens(lens_kv) if lens_kv else None
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float32, device=DEVICE) if bias_type == "alibi" else None
    block = te_block(config, "bshd", **({"bottom_right_diagonal": bottom_right} if where == "init" else {}))
    extra = {"bottom_right_diagonal": bottom_right} if where == "forward" else {}
    out = te_forward(block, config, q, k, v, "bshd", cu_q, cu_kv, alibi_slopes=slopes, **extra)
    assert block.last_backend == NAMES[backend]
    out = out.view(2, sq, 2, 16)
    d_out = randn(out.shape, dtype, gen(5), requires_grad=False)
    grads = torch.autograd.grad(out, (q, k, v), d_out)

    def ref(q_, k_, v_, dtype):
        return reference(q_, k_, v_, mask, window, lens_q=lens_q, lens_kv=lens_kv, alibi_slopes=slopes, dtype=dtype,
                         bottom_right=bottom_right)

    check(f"{backend} {mask} {bias_type}", out, grads, (q, k, v), d_out, ref)


def test_bottom_right_diagonal_moves_the_window():
    """The two corners differ where s_q != s_kv (so the tests above can fail)."""
    assert not torch.equal(visible(11, 21, "no_mask", (3, 2), True), visible(11, 21, "no_mask", (3, 2), False))
    assert torch.equal(visible(11, 21, "causal", (3, 0), True), visible(11, 21, "causal", (3, 0), False))


def test_bottom_right_diagonal_must_be_a_bool():
    with pytest.raises(ValueError, match="`bottom_right_diagonal` must be None or a bool, got 'yes'"):
        DotProductAttention(2, 16, bottom_right_diagonal="yes")


# ------------------------------------------------------------------------------------------------
# attention_mask next to cu_seqlens (padding), and with thd
# ------------------------------------------------------------------------------------------------

# TransformerEngine's padding configurations (mask_*), scaled down.
_PADDING = {
    "mask_2_0": ModelConfig(2, 13, 2, 16, attn_mask_type="padding"),
    "mask_3_1": ModelConfig(2, 11, 2, 16, max_seqlen_kv=17, attn_mask_type="padding_causal_bottom_right"),
    "mask_2_1": ModelConfig(2, 13, 2, 16, num_gqa_groups=1, attn_mask_type="padding_causal"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", list(_PADDING))
def test_attention_mask_with_cu_seqlens(monkeypatch, backend, model):
    """TE passes both: the cu_seqlens are used and the mask agrees with them."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    config = _PADDING[model]
    dtype = dtype_for(backend)
    q, k, v = bshd_inputs(config, dtype)
    lens_q = [config.max_seqlen_q - 2, config.max_seqlen_q]
    lens_kv = lens_q if config.attn_type == "self" else [config.max_seqlen_kv, config.max_seqlen_kv - 5]
    mask_q = padding_mask(lens_q, config.max_seqlen_q)
    attention_mask = mask_q if config.attn_type == "self" else (mask_q, padding_mask(lens_kv, config.max_seqlen_kv))
    block = te_block(config, "bshd")
    out = te_forward(block, config, q, k, v, "bshd", cu_seqlens(lens_q), cu_seqlens(lens_kv),
                     attention_mask=attention_mask)
    out = out.view(*q.shape[:3], config.head_dim_v)
    d_out = randn(out.shape, dtype, gen(3), requires_grad=False)
    grads = torch.autograd.grad(out, (q, k, v), d_out)

    def ref(q_, k_, v_, dtype):
        return reference(q_, k_, v_, config.attn_mask_type, lens_q=lens_q, lens_kv=lens_kv, dtype=dtype)

    check(f"{backend} {model}", out, grads, (q, k, v), d_out, ref)


def test_attention_mask_fills_a_missing_cu_seqlens_side():
    config = ModelConfig(2, 9, 2, 16, max_seqlen_kv=13, attn_mask_type="padding")
    q, k, v = bshd_inputs(config, torch.float32)
    lens_q, lens_kv = [9, 4], [13, 6]
    masks = (padding_mask(lens_q, 9), padding_mask(lens_kv, 13))
    block = te_block(config, "bshd")
    both = block(q, k, v, attention_mask=masks, qkv_format="bshd", cu_seqlens_q=cu_seqlens(lens_q))
    ref = block(q, k, v, qkv_format="bshd", cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    assert torch.equal(both, ref)


def test_attention_mask_contradicting_cu_seqlens_is_refused():
    config = ModelConfig(2, 9, 2, 16, attn_mask_type="padding")
    q, k, v = bshd_inputs(config, torch.float32)
    block = te_block(config, "bshd")
    with pytest.raises(ValueError, match="`attention_mask` and `cu_seqlens_q` must describe the same sequences"):
        block(q, k, v, attention_mask=padding_mask([9, 5], 9), qkv_format="bshd",
              cu_seqlens_q=cu_seqlens([9, 4]), cu_seqlens_kv=cu_seqlens([9, 4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_mask_with_thd(monkeypatch, backend):
    """TE's thd calls pass the [b, 1, 1, max_seqlen] padding mask of the padded view too."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    lens = [7, 3, 10]
    config = ModelConfig(3, 10, 2, 16, attn_mask_type="padding_causal")
    dtype = dtype_for(backend)
    g = gen(1)
    t = sum(lens)
    q, k, v = (randn((t, 2, 16), dtype, g) for _ in range(3))
    cu = cu_seqlens(lens)
    block = te_block(config, "thd")
    out = te_forward(block, config, q, k, v, "thd", cu, cu, attention_mask=padding_mask(lens, 10))
    plain = block(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=10, max_seqlen_kv=10)
    assert torch.equal(out, plain)
    with pytest.raises(ValueError, match="must describe the same sequences"):
        te_forward(block, config, q, k, v, "thd", cu, cu, attention_mask=padding_mask([7, 4, 9], 10))


# ------------------------------------------------------------------------------------------------
# Bias shapes (TE's model_configs_bias_shapes: 11ss, 1hss, b1ss, bhss, 111s)
# ------------------------------------------------------------------------------------------------

_BIAS = {
    "bias_1_0": "11ss", "bias_1_1": "1hss", "bias_1_2": "b1ss", "bias_1_3": "bhss", "bias_1_4": "111s",
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", list(_BIAS))
def test_bias_shapes(monkeypatch, backend, model):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    config = ModelConfig(3, 13, 2, 16, max_seqlen_kv=19, attn_bias_type="post_scale_bias", bias_shape=_BIAS[model])
    dtype = dtype_for(backend)
    q, k, v = bshd_inputs(config, dtype)
    dims = {"b": 3, "h": 2}
    shape = [dims.get(c, 1) for c in config.bias_shape[:2]]
    shape += [1, 19] if config.bias_shape == "111s" else [13, 19]
    bias = randn(shape, dtype, gen(4))
    block = te_block(config, "bshd")
    out = te_forward(block, config, q, k, v, "bshd", None, None, bias=bias)
    assert block.last_backend == NAMES[backend]
    out = out.view(3, 13, 2, 16)
    d_out = randn(out.shape, dtype, gen(6), requires_grad=False)
    grads = torch.autograd.grad(out, (q, k, v, bias), d_out)
    assert grads[3].shape == bias.shape

    def ref(q_, k_, v_, bias_, dtype):
        return reference(q_, k_, v_, bias=bias_, dtype=dtype)

    check(f"{backend} {model}", out, grads, (q, k, v, bias), d_out, ref)


@requires_fused
def test_fused_dbias_of_a_row_bias_is_deterministic(monkeypatch):
    """111s dBias sums every query row in a fixed order: bitwise equal across runs."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    config = ModelConfig(2, 37, 2, 16, attn_bias_type="post_scale_bias", bias_shape="111s")
    q, k, v = bshd_inputs(config, torch.float16)
    bias = randn((1, 1, 1, 37), torch.float16, gen(2))
    block = te_block(config, "bshd")
    runs = []
    for _ in range(2):
        out = te_forward(block, config, q, k, v, "bshd", None, None, bias=bias)
        runs.append(torch.autograd.grad(out, bias, torch.ones_like(out))[0])
    assert torch.equal(runs[0], runs[1])


def test_bias_shape_not_in_te_list_is_refused():
    config = ModelConfig(2, 9, 2, 16, attn_bias_type="post_scale_bias")
    q, k, v = bshd_inputs(config, torch.float32)
    block = te_block(config, "bshd")
    with pytest.raises(ValueError, match=r"1hss, b1ss, bhss, 11ss or 111s\), got \(1, 2, 1, 9\)"):
        te_forward(block, config, q, k, v, "bshd", None, None, bias=torch.zeros(1, 2, 1, 9))


# ------------------------------------------------------------------------------------------------
# num_splits, return_max_logit, packed inputs, refused arguments
# ------------------------------------------------------------------------------------------------


def test_num_splits():
    config = ModelConfig(2, 9, 2, 16)
    q, k, v = bshd_inputs(config, torch.float32)
    block = te_block(config, "bshd")
    assert torch.equal(block(q, k, v, num_splits=1), block(q, k, v))
    with pytest.raises(NotImplementedError, match="`num_splits` must be 1, got 2"):
        block(q, k, v, num_splits=2)
    with pytest.raises(ValueError, match="`num_splits` must be a positive int, got 0"):
        block(q, k, v, num_splits=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask,window,bias_type", [("no_mask", (-1, -1), "no_bias"),
                                                   ("padding_causal", (4, 0), "post_scale_bias"),
                                                   ("padding", (2, 3), "alibi")])
def test_return_max_logit(monkeypatch, backend, mask, window, bias_type):
    """TE's max_logit: [h], the max of the masked scaled scores (+ bias) over batch, queries and keys, from
    the unfused math and from the fused forward kernel (each row's max, then a max over rows)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    config = ModelConfig(2, 11, 3, 16, max_seqlen_kv=14, attn_mask_type=mask, window_size=window,
                         attn_bias_type=bias_type, return_max_logit=True)
    q, k, v = bshd_inputs(config, torch.float32)
    lens_q, lens_kv = [11, 6], [9, 14]
    padded = "padding" in mask
    bias = randn((1, 3, 11, 14), torch.float32, gen(8)) if bias_type == "post_scale_bias" else None
    slopes = torch.tensor([0.5, 0.25, 0.125], device=DEVICE) if bias_type == "alibi" else None
    block = te_block(config, "bshd")
    out = te_forward(block, config, q, k, v, "bshd", cu_seqlens(lens_q) if padded else None,
                     cu_seqlens(lens_kv) if padded else None, bias=bias, alibi_slopes=slopes)
    out, max_logit = out
    assert out.shape == (2, 11, 48) and max_logit.shape == (3,) and max_logit.dtype == q.dtype
    assert not max_logit.requires_grad
    assert block.last_backend == NAMES[backend]
    expected = torch.full((3,), float("-inf"), dtype=torch.float64)
    for n in range(2):
        lq, lk = (lens_q[n], lens_kv[n]) if padded else (11, 14)
        # The reference on the CPU, where visible() builds its mask.
        s = torch.einsum("qhd,khd->hqk", q[n, :lq].detach().double().cpu(), k[n, :lk].detach().double().cpu()) / 4.0
        if bias is not None:
            s = s + bias[0, :, :lq, :lk].detach().double().cpu()
        if slopes is not None:
            rel = torch.arange(lk)[None, :] - torch.arange(lq)[:, None] - (lk - lq)
            s = s - slopes.double().cpu()[:, None, None] * rel.abs()
        keep = visible(lq, lk, mask, window)
        expected = torch.maximum(expected, s.masked_fill(~keep, float("-inf")).amax(dim=(1, 2)))
    torch.testing.assert_close(max_logit.double().cpu(), expected, rtol=1e-6, atol=1e-6)
    # The output is the backend's own: the same bits as the call without max_logit on that backend.
    plain = te_block(ModelConfig(2, 11, 3, 16, max_seqlen_kv=14, attn_mask_type=mask, window_size=window,
                                 attn_bias_type=bias_type), "bshd")
    ref_out = te_forward(plain, config, q, k, v, "bshd", cu_seqlens(lens_q) if padded else None,
                         cu_seqlens(lens_kv) if padded else None, bias=bias, alibi_slopes=slopes)
    assert torch.equal(out, ref_out)


def test_return_max_logit_with_flash_attention_forced_says_why(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "flash")
    config = ModelConfig(2, 9, 2, 16, return_max_logit=True)
    q, k, v = bshd_inputs(config, torch.float16)
    with pytest.raises(NoBackendError, match="return_max_logit=True"):
        te_block(config, "bshd")(q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,layout,dim", [("bshd", "bs3hd", -3), ("sbhd", "sbh3d", -2), ("thd", "t3hd", -3),
                                            ("bshd", "bshd_bs2hd", -3), ("bshd", "bshd_bsh2d", -2)])
def test_packed_qkv_layer_and_kv_layer(monkeypatch, backend, fmt, layout, dim):
    """TE's declarative packed inputs: the same results as the q, k, v views, gradients on the buffer."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dtype = dtype_for(backend)
    b, s, h, d = 2, 9, 2, 16
    outer = {"bshd": (b, s), "sbhd": (s, b), "thd": (b * s,)}[fmt]
    count = 2 if "2" in layout else 3
    inner = (count, h, d) if dim == -3 else (h, count, d)
    packed = randn(outer + inner, dtype, gen(2))
    kwargs = dict(qkv_format=fmt, attn_mask_type="padding" if fmt == "thd" else "no_mask")
    block = DotProductAttention(h, d, **kwargs).to(DEVICE)
    if fmt == "thd":
        cu = cu_seqlens([s, s])
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
    q = randn(outer + (h, d), dtype, gen(3)) if count == 2 else None
    if count == 3:
        out = block(qkv_layer=packed, qkv_interleave_dim=dim, **kwargs)
        views = [packed.select(dim, i) for i in range(3)]
    else:
        out = block(q, kv_layer=packed, qkv_interleave_dim=dim, **kwargs)
        views = [q] + [packed.select(dim, i) for i in range(2)]
    assert torch.equal(out, block(*views, **kwargs))
    (grad,) = torch.autograd.grad(out, packed, torch.ones_like(out))
    assert grad.shape == packed.shape and grad.abs().sum() > 0


@pytest.mark.parametrize("call,err,match", [
    (lambda blk, q, p: blk(q, qkv_layer=p), ValueError, "`query_layer`, `key_layer` and `value_layer` must be None"),
    (lambda blk, q, p: blk(qkv_layer=p, kv_layer=p), ValueError, "give either `qkv_layer` or `kv_layer`"),
    (lambda blk, q, p: blk(qkv_layer=p, qkv_interleave_dim=-1), ValueError, "`qkv_interleave_dim` must be -3"),
    (lambda blk, q, p: blk(kv_layer=p), ValueError, "`query_layer` must be given with `kv_layer`"),
    (lambda blk, q, p: blk(q, kv_layer=p), ValueError, "`kv_layer` must be 5-D .* size 2 at dim -3"),
    (lambda blk, q, p: blk(q), ValueError, "must be given unless a packed"),
    (lambda blk, q, p: blk(q, q, q, bf16_backward=True), NotImplementedError, "`bf16_backward=True`"),
    (lambda blk, q, p: blk(q, q, q, score_mod=lambda *a: a), NotImplementedError, "`score_mod`"),
])
def test_packed_and_refused_arguments(call, err, match):
    block = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    q = torch.zeros(2, 5, 2, 16)
    packed = torch.zeros(2, 5, 3, 2, 16)
    with pytest.raises(err, match=match):
        call(block, q, packed)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_rng_tracker_fork_follows_sequence_parallel(monkeypatch, sequence_parallel):
    """TE forks the tracker for dropout unless sequence_parallel is set."""
    import contextlib

    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self):
            forks.append(1)
            yield

    block = DotProductAttention(2, 16, attention_dropout=0.5, qkv_format="bshd", attn_mask_type="no_mask",
                                sequence_parallel=sequence_parallel, get_rng_state_tracker=Tracker)
    q = torch.randn(1, 5, 2, 16, device=DEVICE)
    block(q, q, q)
    assert len(forks) == (0 if sequence_parallel else 1)
