"""FlashAttention (flash-attn-4) behind JAX's ``fused_attn``: selection, reasons, and the plumbing on CPU.

CPU (CI): flash-attn-4 is absent, so selection must keep choosing what it chose before and say why
flash-attn-4 was not chosen. The route itself (``flash_backend``: ``buffer_callback`` -> torch tensors ->
flash-attn-4's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` -> XLA's output buffers) runs on the CPU against a
stand-in ``flash_attn.cute.interface`` that implements those two functions' documented semantics in float64
(bottom-right causal masks and windows, ``cu_seqlens`` as sequence starts with ``seqused`` lengths, the LSE
layouts, rows outside every sequence left as NaN garbage). Against it, ``fused_attn`` must give
TransformerEngine's answer (the fp64 reference of ``te_jax_testing``) for every format and mask it routes
there, under jit, grad, vmap, remat and a dp x tp mesh, and pass flash-attn-4 the arguments checked here.

GPU (H200 with flash-attn-4): tests/jax/test_jax_flash_backend_gpu.py.
"""

from __future__ import annotations

import math
import sys
import types
from typing import List

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the flash-attn-4 route goes through torch tensors")

from te_jax_testing import make_case, random_qkv  # noqa: E402
from transformer_engine.common.attention.backends import NoBackendError  # noqa: E402
from transformer_engine.jax import attention as te_attention  # noqa: E402
from transformer_engine.jax import flash_backend  # noqa: E402
from transformer_engine.jax.primitives import gpu  # noqa: E402
import te_jax_testing as te_testing  # noqa: E402
from transformer_engine.jax.attention import (  # noqa: E402
    AttnBiasType,
    AttnMaskType,
    CPStrategy,
    QKVLayout,
    SequenceDescriptor,
    fused_attn,
)
from transformer_engine.jax.sharding import MeshResource, global_shard_guard  # noqa: E402

ON_CPU = jax.devices()[0].platform == "cpu"
cpu_only = pytest.mark.skipif(not ON_CPU, reason="CPU facts (the stand-in flash-attn-4, no GPU)")
# The stand-in computes on CPU tensors; on a GPU, test_jax_flash_backend_gpu.py runs flash-attn-4 itself.
route = pytest.mark.skipif(not ON_CPU, reason="the stand-in flash-attn-4 runs on CPU buffers")


# -- the stand-in flash_attn.cute.interface -----------------------------------------------------------


def _attend(q, k, v, scale, causal, left, right):
    """One sequence, [s, h, d] float64; query i sees key j when i + s_k - s_q - left <= j <= i + s_k - s_q + right.
    Returns (out [s_q, h, d_v], lse [h, s_q]); a row that sees no key gives 0 and -inf."""
    lq, h, _ = q.shape
    lk, hk, _ = k.shape
    if causal:
        right = 0
    rel = torch.arange(lk)[None, :] - (torch.arange(lq)[:, None] + lk - lq)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if right is not None:
        keep &= rel <= right
    if left is not None:
        keep &= rel >= -left
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    s = (torch.einsum("qhd,khd->hqk", q, k) * scale).masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros(()))  # rows with no key: p = 0, no NaN
    p = torch.exp(s - finite[..., None])
    return torch.einsum("hqk,khd->qhd", p, v), lse


class FakeInterface(types.ModuleType):
    """``flash_attn.cute.interface``'s ``_flash_attn_fwd`` / ``_flash_attn_bwd`` as flash-attn-4 4.0.0b36 documents
    them, on the CPU in float64 (keywords as there; the ones the JAX route never passes are left out)."""

    def __init__(self):
        super().__init__("flash_attn.cute.interface")
        self.calls: List[dict] = []

    @staticmethod
    def _sequences(q, k, cu_q, cu_k, used_q, used_k):
        """[(rows of q, rows of k)] per sequence; dense calls: one per batch row."""
        if cu_q is None:
            return None
        n = cu_q.shape[0] - 1
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        lens_q = used_q.tolist() if used_q is not None else [starts_q[i + 1] - starts_q[i] for i in range(n)]
        lens_k = used_k.tolist() if used_k is not None else [starts_k[i + 1] - starts_k[i] for i in range(n)]
        return [(slice(starts_q[i], starts_q[i] + lens_q[i]), slice(starts_k[i], starts_k[i] + lens_k[i]))
                for i in range(n)]

    def _flash_attn_fwd(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                        causal=False, softcap=None, window_size_left=None, window_size_right=None,
                        learnable_sink=None, num_splits=1, pack_gqa=None, return_lse=False, out=None, lse=None):
        self.calls.append(dict(func="fwd", q_shape=tuple(q.shape), k_shape=tuple(k.shape),
                               cu_seqlens_q=None if cu_seqlens_q is None else cu_seqlens_q.tolist(),
                               cu_seqlens_k=None if cu_seqlens_k is None else cu_seqlens_k.tolist(),
                               seqused_q=None if seqused_q is None else seqused_q.tolist(),
                               seqused_k=None if seqused_k is None else seqused_k.tolist(),
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, softcap=softcap, window=(window_size_left, window_size_right),
                               num_splits=num_splits, out_shape=tuple(out.shape), lse_shape=tuple(lse.shape)))
        assert out is not None and lse is not None and lse.dtype == torch.float32
        assert isinstance(softmax_scale, float) and softmax_scale > 0
        q64, k64, v64 = (t.double() for t in (q, k, v))
        out.fill_(math.nan)  # torch.empty garbage where nothing is written
        lse.fill_(math.nan)
        seqs = self._sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        if seqs is None:
            assert q.dim() == 4 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
            for n in range(q.shape[0]):
                o, l_ = _attend(q64[n], k64[n], v64[n], softmax_scale, causal, window_size_left, window_size_right)
                out[n] = o.to(out.dtype)
                lse[n] = l_.float()
            return out, lse, None, None, None
        assert q.dim() == 3 and lse.shape == (q.shape[1], q.shape[0])
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        for rows_q, rows_k in seqs:
            assert rows_q.stop - rows_q.start <= max_seqlen_q and rows_k.stop - rows_k.start <= max_seqlen_k
            if rows_q.stop == rows_q.start:
                continue
            o, l_ = _attend(q64[rows_q], k64[rows_k], v64[rows_k], softmax_scale, causal, window_size_left,
                            window_size_right)
            out[rows_q] = o.to(out.dtype)
            lse[:, rows_q] = l_.float()
        return out, lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False,
                        dq=None, dk=None, dv=None):
        self.calls.append(dict(func="bwd", deterministic=deterministic, softcap=softcap, causal=causal,
                               window=(window_size_left, window_size_right), max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, lse_shape=tuple(lse.shape)))
        assert dq is not None and dk is not None and dv is not None
        seqs = self._sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        if seqs is None:
            seqs = [((n,), (n,)) for n in range(q.shape[0])]
        for grad in (dq, dk, dv):
            grad.fill_(math.nan)
        for rows_q, rows_k in seqs:
            if isinstance(rows_q, slice) and rows_q.stop == rows_q.start:
                dk[rows_k], dv[rows_k] = 0, 0  # no query reads these keys
                continue
            leaves = [t[rows].double().requires_grad_(True) for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
            with torch.enable_grad():
                o, l_ = _attend(*leaves, softmax_scale, causal, window_size_left, window_size_right)
                # The saved statistics are flash-attn's own: the forward's LSE for these rows.
                saved = lse[rows_q] if lse.dim() == 3 else lse[:, rows_q]
                seen = torch.isfinite(l_)
                assert torch.allclose(saved.double()[seen], l_.detach()[seen], rtol=1e-5, atol=1e-5)
                grads = torch.autograd.grad(o, leaves, dout[rows_q].double(), allow_unused=True)
            for target, rows, g, leaf in zip((dq, dk, dv), (rows_q, rows_k, rows_k), grads, leaves):
                target[rows] = (torch.zeros_like(leaf) if g is None else g).to(target.dtype)
        return dq, dk, dv


@pytest.fixture
def fake_flash(monkeypatch):
    interface = FakeInterface()
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    # The stand-in's CPU buffers: gap rows cleared in torch (Triton's kernel needs a GPU or the interpreter).
    from te_torch_testing import zero_outside_sequences_reference
    from transformer_engine.common.attention.kernels import fill
    monkeypatch.setattr(fill, "zero_outside_sequences", zero_outside_sequences_reference)
    flash_backend._import_error.cache_clear()
    yield interface
    flash_backend._import_error.cache_clear()


@pytest.fixture
def pretend_hopper(monkeypatch):
    """The frontend sees an SM90 GPU with flash-attn-4 available and the fused kernels' launcher not built (also on
    a GPU machine where it is)."""
    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", (9, 0)))
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: "the JAX FFI extension is not built (pretended)")


# -- availability ----------------------------------------------------------------------------------------


def test_unavailable_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ModuleNotFoundError
    flash_backend._import_error.cache_clear()
    try:
        assert flash_backend.unavailable_reason() == "flash-attn-4 is not installed (pip install .[flash])"
    finally:
        flash_backend._import_error.cache_clear()


def test_unavailable_when_the_interface_lacks_a_keyword(monkeypatch, fake_flash):
    monkeypatch.setattr(fake_flash, "_flash_attn_bwd", lambda q, k, v, out, dout, lse, deterministic=False: None)
    flash_backend._import_error.cache_clear()
    reason = flash_backend.unavailable_reason()
    assert reason.startswith("flash_attn.cute.interface._flash_attn_bwd takes no softmax_scale"), reason


@cpu_only
def test_stand_in_imports_but_torch_sees_no_gpu(fake_flash):
    assert flash_backend._import_error() is None
    assert flash_backend.unavailable_reason() == ("torch sees no CUDA device (flash-attn-4 runs through torch on the "
                                                  "GPU JAX uses)")


def test_no_import_off_supported_gpus(monkeypatch):
    """On CPU, AMD and other NVIDIA generations the packages are not even looked at."""
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: pytest.fail("imported"))
    for facts in (("cpu", "nvidia", None), ("cuda", "amd", None), ("cuda", "nvidia", (8, 0))):
        assert flash_backend.availability_reasons(*facts, False, False) == []


# -- selection ----------------------------------------------------------------------------------------------

B, S, H, HK, D = 2, 128, 8, 2, 64


def _args(dtype=jnp.bfloat16, mask=AttnMaskType.CAUSAL_MASK, layout=QKVLayout.BSHD_BSHD_BSHD, d=D, s_kv=S,
          **overrides):
    q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, s_kv, H, HK, d, d, dtype)
    kwargs = dict(qkv=(q, k, v), bias=None, sequence_descriptor=None, seed=None, attn_bias_type=AttnBiasType.NO_BIAS,
                  attn_mask_type=mask, qkv_layout=layout, scaling_factor=d**-0.5, dropout_probability=0.0,
                  is_training=True)
    kwargs.update(overrides)
    return te_attention._FusedAttnArgs(**kwargs)


def _select(args):
    return te_attention.select_attention_backend(te_attention._parse_call(args).config)


@cpu_only
def test_cpu_selection_is_unchanged_and_says_why_not_flash():
    selection = _select(_args())
    assert selection.name == "UnfusedDotProductAttention"
    assert "device=cpu (supported: cuda)" in selection.rejected["FlashAttention"]
    assert any("CUDA GPUs only" in r for r in selection.rejected["FusedAttention"])


@cpu_only
def test_forcing_flash_on_cpu_raises_with_its_reasons(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "flash")
    args = _args()
    with pytest.raises(NoBackendError, match=r"(?s)`FlashAttention` was forced.*device=cpu"):
        fused_attn(args.qkv, None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
                   QKVLayout.BSHD_BSHD_BSHD, scaling_factor=D**-0.5)


def test_selected_on_hopper_where_it_fits(pretend_hopper):
    selection = _select(_args())
    assert selection.name == "FlashAttention", selection.rejected
    assert selection.rejected == {}


def test_the_same_order_as_pytorch(pretend_hopper):
    """d=96 on Hopper: not measured faster, so after the fused kernels (here unavailable: not built), and
    not verified against the reference there (a reason), so the unfused backend runs it."""
    selection = _select(_args(d=96))
    assert list(selection.rejected) == ["FusedAttention", "FlashAttention"]
    assert any("not verified against the reference" in r for r in selection.rejected["FlashAttention"])


@pytest.mark.parametrize("overrides, reason", [
    (dict(dtype=jnp.float32), "dtype=float32"),
    (dict(dropout_probability=0.1, seed=jax.random.PRNGKey(1)), "dropout=0.1"),
    (dict(return_max_logit=True), "return_max_logit=True"),
    (dict(softmax_type="off_by_one"), "softmax_type=off-by-one"),
    (dict(mask=AttnMaskType.NO_MASK, window_size=(16, 16)), "aligned top-left (bottom_right_diagonal=False)"),
    (dict(s_kv=64), "(top-left) with s_q=128 > s_kv=64"),
])
def test_reasons_for_what_flash_attn_4_cannot_do(pretend_hopper, overrides, reason):
    selection = _select(_args(**overrides))
    assert selection.name != "FlashAttention"
    assert any(reason in r for r in selection.rejected["FlashAttention"]), selection.rejected["FlashAttention"]


def test_bias_is_a_reason(pretend_hopper):
    bias = jnp.zeros((1, H, S, S), jnp.bfloat16)
    selection = _select(_args(bias=bias, attn_bias_type=AttnBiasType.POST_SCALE_BIAS))
    assert any("attn_bias_type=post_scale_bias" in r for r in selection.rejected["FlashAttention"])


def test_unavailable_package_is_a_reason(monkeypatch):
    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", (9, 0)))
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: "flash-attn-4 is not installed (test)")
    selection = _select(_args())
    assert "flash-attn-4 is not installed (test)" in selection.rejected["FlashAttention"]


def test_deterministic_mode_on_blackwell_is_a_reason(monkeypatch):
    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", (10, 0)))
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: "the JAX FFI extension is not built (pretended)")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    selection = _select(_args())
    assert any("not batch/packing invariant" in r for r in selection.rejected["FlashAttention"])
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    assert _select(_args()).name == "FlashAttention"


def test_disabled_by_nvte_flash_attn(pretend_hopper, monkeypatch):
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    selection = _select(_args())
    assert selection.rejected["FlashAttention"] == ["disabled by NVTE_FLASH_ATTN=0"]


def test_top_left_padding_causal_needs_one_length_array(pretend_hopper):
    lens = jnp.array([S, 77], jnp.int32)
    one = _select(_args(mask=AttnMaskType.PADDING_CAUSAL_MASK,
                        sequence_descriptor=SequenceDescriptor.from_seqlens(lens)))
    assert one.name == "FlashAttention", one.rejected
    two = _select(_args(mask=AttnMaskType.PADDING_CAUSAL_MASK,
                        sequence_descriptor=SequenceDescriptor.from_seqlens((lens, lens + 0))))
    assert any("may differ from the query lengths" in r for r in two.rejected["FlashAttention"])
    bottom_right = _select(_args(mask=AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
                                 sequence_descriptor=SequenceDescriptor.from_seqlens((lens, lens + 0))))
    assert bottom_right.name == "FlashAttention", bottom_right.rejected


def test_context_parallelism_is_a_reason(pretend_hopper, monkeypatch):
    from transformer_engine.jax import context_parallel

    monkeypatch.setattr(context_parallel, "mesh_axis_size", lambda axis: 2)
    config = te_attention._parse_call(_args(context_parallel_axis="cp",
                                            context_parallel_strategy=CPStrategy.ALL_GATHER)).config
    selection = te_attention.select_attention_backend(config)
    assert any("context parallelism" in r for r in selection.rejected["FlashAttention"])


# -- the route, against the stand-in --------------------------------------------------------------------------


CASES = {
    "bshd-no_mask-gqa": dict(mask=AttnMaskType.NO_MASK, h_q=4, h_kv=2),
    "bshd-causal": dict(mask=AttnMaskType.CAUSAL_MASK),
    "bshd-causal-topleft-skv>sq": dict(mask=AttnMaskType.CAUSAL_MASK, s_q=24, s_kv=40),
    "bshd-causal_bottom_right-sq>skv": dict(mask=AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, s_q=40, s_kv=24),
    "bshd-causal-window": dict(mask=AttnMaskType.CAUSAL_MASK, window=(5, 0)),
    "bshd-no_mask-window-bottom_right": dict(mask=AttnMaskType.NO_MASK, window=(4, 3), bottom_right_diagonal=True),
    "sbhd-causal": dict(layout=QKVLayout.SBHD_SBHD_SBHD, mask=AttnMaskType.CAUSAL_MASK),
    "bs3hd-no_mask": dict(layout=QKVLayout.BS3HD, mask=AttnMaskType.NO_MASK),
    "bshd-padding-kvpacked": dict(layout=QKVLayout.BSHD_BS2HD, mask=AttnMaskType.PADDING_MASK),
    "bshd-padding_causal_bottom_right-gqa": dict(mask=AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, h_q=4, h_kv=1),
    "bshd-padding-segment_ids": dict(mask=AttnMaskType.PADDING_MASK, desc_kind="segment_ids"),
    "thd-padding-gaps": dict(layout=QKVLayout.THD_THD_THD, mask=AttnMaskType.PADDING_MASK, m=3, desc_kind="offsets"),
    "thd-padding_causal_bottom_right-gqa": dict(layout=QKVLayout.THD_THD_THD,
                                                mask=AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, m=3,
                                                desc_kind="offsets", h_q=4, h_kv=2),
    "thd-padding-window": dict(layout=QKVLayout.THD_T2HD, mask=AttnMaskType.PADDING_MASK, m=2,
                               window=(3, 2), bottom_right_diagonal=True),
}


def _self_attention_segments(seed, b, s, m):
    """The same segments for queries and keys (self attention: top-left causal equals bottom-right)."""
    from te_jax_testing import packed_segments, padded_segments

    rng = np.random.default_rng(seed)
    seg = packed_segments(rng, b, s, m, gaps=True) if m > 1 else padded_segments(rng, b, s)
    return seg, seg


@route
@pytest.mark.parametrize("name", list(CASES))
def test_route_gives_transformer_engine_semantics(fake_flash, name):
    """Output and gradients of fused_attn on the flash backend equal the fp64 reference, padded and gap rows
    included (the stand-in leaves NaN there: the route must clear them)."""
    config = dict(CASES[name])
    case = make_case("flash", dtype=jnp.float32, b=2, s_q=config.pop("s_q", 32), s_kv=config.pop("s_kv", 32), **config)
    results = case.run()
    for value in results.values():
        assert value is None or bool(jnp.all(jnp.isfinite(value)))
    case.check_reference(results)
    assert [c["func"] for c in fake_flash.calls] == ["fwd", "bwd"]


@route
@pytest.mark.parametrize("layout", [QKVLayout.BSHD_BSHD_BSHD, QKVLayout.THD_THD_THD])
def test_top_left_padding_causal_self_attention(fake_flash, layout):
    """One length array for q and kv: top-left equals bottom-right, and the route runs it."""
    thd = layout == QKVLayout.THD_THD_THD
    segments = _self_attention_segments(3, 2, 32, 3 if thd else 1)
    case = make_case("flash", layout=layout, mask=AttnMaskType.PADDING_CAUSAL_MASK, dtype=jnp.float32,
                     m=3 if thd else 1, desc_kind="offsets" if thd else "seqlens", segments=segments, h_q=4, h_kv=2)
    case.check_reference(case.run())


@route
def test_arguments_passed_to_flash_attn_4(fake_flash, monkeypatch):
    """The varlen call: starts r * s + offset, seqused the lengths, max_seqlen the row length, the LSE as
    [h, b * s]; deterministic mode reaches the backward; softcap 0 and one split, as PyTorch passes."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    b, s, h = 2, 16, 4
    q, k, v = random_qkv(jax.random.PRNGKey(5), b, s, s, h, 2, 16, 16, jnp.float32)
    lens = jnp.array([[5, 7], [9, 0]], jnp.int32)
    offsets = jnp.array([[0, 6, 13], [2, 11, 11]], jnp.int32)
    desc = SequenceDescriptor.from_seqlens_and_offsets(lens, offsets)

    def loss(q, k, v):
        out = te_testing.fused_attn_with_backend(
            "flash", (q, k, v), None, desc, None, AttnBiasType.NO_BIAS, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
            QKVLayout.THD_THD_THD, 0.25, 0.0, True, 2, (3, -1))
        return jnp.sum(out**2)

    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))  # the callbacks have run
    fwd, bwd = fake_flash.calls
    assert fwd["cu_seqlens_q"] == [0, 6, 18, 27, 32] and fwd["cu_seqlens_k"] == [0, 6, 18, 27, 32]
    assert fwd["seqused_q"] == [5, 7, 9, 0] and fwd["seqused_k"] == [5, 7, 9, 0]
    assert fwd["q_shape"] == (b * s, h, 16) and fwd["k_shape"] == (b * s, 2, 16)
    assert (fwd["max_seqlen_q"], fwd["max_seqlen_k"]) == (s, s)
    assert fwd["lse_shape"] == (h, b * s) and bwd["lse_shape"] == (h, b * s)
    assert fwd["softmax_scale"] == 0.25 and fwd["causal"] and fwd["window"] == (3, None)
    assert fwd["softcap"] == 0.0 and fwd["num_splits"] == 1
    assert bwd["deterministic"] is True and bwd["softcap"] == 0.0 and bwd["window"] == (3, None)


@route
def test_dense_call_and_nondeterministic_backward(fake_flash):
    q, k, v = random_qkv(jax.random.PRNGKey(6), 2, 16, 16, 4, 4, 16, 16, jnp.float32)

    def loss(q):
        out = te_testing.fused_attn_with_backend("flash", (q, k, v), None, None, None, AttnBiasType.NO_BIAS,
                                                 AttnMaskType.NO_MASK, QKVLayout.BSHD_BSHD_BSHD, 0.25)
        return jnp.sum(out)

    jax.block_until_ready(jax.jit(jax.grad(loss))(q))
    fwd, bwd = fake_flash.calls
    assert fwd["cu_seqlens_q"] is None and fwd["q_shape"] == (2, 16, 4, 16) and fwd["lse_shape"] == (2, 4, 16)
    assert not fwd["causal"] and fwd["window"] == (None, None)
    assert bwd["deterministic"] is False


@route
def test_negative_scale_runs_on_minus_q(fake_flash):
    """flash-attn-4 gets a positive scale; q carries the sign (the fused path's rule), and dq comes back."""
    case = make_case("flash", dtype=jnp.float32, mask=AttnMaskType.NO_MASK)
    case.scale = -case.scale
    case.kwargs["scaling_factor"] = case.scale
    case.check_reference(case.run())
    assert fake_flash.calls[0]["softmax_scale"] > 0


@route
def test_forced_through_fused_attn_on_a_pretended_hopper(fake_flash, monkeypatch):
    """NVTE_FUSED_ATTN_BACKEND=flash: selection accepts it (Hopper, available) and fused_attn runs the route."""
    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", (9, 0)))
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: None)
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "flash")
    with te_testing.recording_backend_selections() as names:
        case = make_case("selected", dtype=jnp.float16, mask=AttnMaskType.CAUSAL_MASK, d_qk=64, d_v=64)
        results = case.run()
    assert names == ["FlashAttention"]
    case.check_reference(results)


@route
def test_vmap_runs_each_instance(fake_flash):
    q, k, v = random_qkv(jax.random.PRNGKey(7), 3, 16, 16, 4, 4, 16, 16, jnp.float32)

    def f(q, k, v):
        return te_testing.fused_attn_with_backend("flash", (q, k, v), None, None, None, AttnBiasType.NO_BIAS,
                                                  AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 0.25)

    batched = jax.jit(jax.vmap(f))(q[:, None], k[:, None], v[:, None])
    np.testing.assert_array_equal(np.asarray(batched[:, 0]), np.asarray(jax.jit(f)(q, k, v)))
    grads = jax.jit(jax.grad(lambda q: jnp.sum(jax.vmap(f)(q, k[:, None], v[:, None]) ** 2)))(q[:, None])
    ref = jax.jit(jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2)))(q)
    np.testing.assert_allclose(np.asarray(grads[:, 0]), np.asarray(ref), rtol=1e-6, atol=1e-6)


@route
def test_remat_recomputes_through_the_route(fake_flash):
    q, k, v = random_qkv(jax.random.PRNGKey(8), 2, 16, 16, 4, 4, 16, 16, jnp.float32)

    def f(q):
        out = te_testing.fused_attn_with_backend("flash", (q, k, v), None, None, None, AttnBiasType.NO_BIAS,
                                                 AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 0.25)
        return jnp.sum(jnp.sin(out))

    plain = jax.block_until_ready(jax.jit(jax.grad(f))(q))
    fake_flash.calls.clear()
    rematted = jax.block_until_ready(jax.jit(jax.grad(jax.checkpoint(f)))(q))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(rematted))
    assert [c["func"] for c in fake_flash.calls] == ["fwd", "bwd"]  # recomputed inside the backward pass


@route
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_mesh_splits_batch_and_heads(fake_flash):
    """With a dp x tp mesh and MeshResource, each device calls flash-attn-4 on its own rows and heads
    (a host callback cannot be partitioned otherwise), and the result equals the unsplit call."""
    b, s, h, hk = 4, 16, 4, 2
    q, k, v = random_qkv(jax.random.PRNGKey(9), b, s, s, h, hk, 16, 16, jnp.float32)
    lens = jnp.array([16, 9, 12, 1], jnp.int32)
    desc = SequenceDescriptor.from_seqlens(lens)

    def loss(q, k, v):
        out = te_testing.fused_attn_with_backend("flash", (q, k, v), None, desc, None, AttnBiasType.NO_BIAS,
                                                 AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 0.25)
        return jnp.sum(out**2), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    # Dispatch is asynchronous: the host callbacks (which record the calls) have run once the results are ready.
    (_, ref_out), ref_grads = jax.block_until_ready(step(q, k, v))
    fake_flash.calls.clear()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))
    with jax.set_mesh(mesh), global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
        (_, out), grads = jax.block_until_ready(step(q, k, v))
    shapes = {c["q_shape"] for c in fake_flash.calls if c["func"] == "fwd"}
    assert shapes == {(1 * s, h // 2, 16)}, shapes
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    for a, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)


@route
def test_eager_calls_do_not_recompile(fake_flash):
    """The callback is part of JAX's cache key for an eager call: one object per configuration, so the second
    eager call reuses the first one's executable."""
    import logging

    q, k, v = random_qkv(jax.random.PRNGKey(10), 2, 16, 16, 4, 4, 16, 16, jnp.float32)

    def f(q):
        return te_testing.fused_attn_with_backend("flash", (q, k, v), None, None, None, AttnBiasType.NO_BIAS,
                                                  AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 0.25)

    jax.block_until_ready(f(q))
    messages = []

    class Records(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, logger = Records(logging.DEBUG), logging.getLogger("jax")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            jax.block_until_ready(f(q))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert not [m for m in messages if m.startswith("Compiling") and "buffer_callback" in m], messages
    assert [c["func"] for c in fake_flash.calls] == ["fwd", "fwd"]
