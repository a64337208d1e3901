"""flash-attn-4 from JAX on a Hopper/Blackwell GPU: the same bits as PyTorch, determinism, invariance, accuracy.

Runs where JAX and torch see an SM90/SM100 GPU and flash-attn-4 imports (docs/flash_attention.rst: installing
it); skipped elsewhere with the reason. JAX and torch share the GPU: run with XLA_PYTHON_CLIENT_PREALLOCATE=false.
Checked:

- PyTorch == JAX bitwise: ``fused_attn`` on the flash backend and PyTorch's ``flash_backend.flash_attn_func``,
  same inputs and the same flash-attn-4 arguments, give the same output and dQ/dK/dV bits (bshd and thd, GQA,
  causal top-left and bottom-right, sliding windows, padding), in deterministic mode;
- repeated runs (a fresh compile and cached executables) bitwise equal in deterministic mode;
- batch invariance (a sequence alone and inside a batch) and packing invariance (THD rows and a padded BSHD
  batch), bitwise, in deterministic mode;
- accuracy: within the fp32 reference's bound (te_jax_testing's rule);
- selection: ``fused_attn`` picks FlashAttention where PyTorch does (Hopper, measured head dims).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax_testing import make_case, packed_segments, random_qkv
from transformer_engine.jax import flash_backend
import te_jax_testing as te_testing
from transformer_engine.jax.attention import AttnBiasType, AttnMaskType, QKVLayout, SequenceDescriptor, fused_attn


def _skip_reason():
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"needs a CUDA GPU (JAX runs on {device.platform})"
    major = int(str(getattr(device, "compute_capability", "0.0")).split(".")[0] or 0)
    if major not in (9, 10):
        return f"flash-attn-4 runs on SM90/SM100 (compute capability {device.compute_capability})"
    reason = flash_backend.unavailable_reason()
    if reason:
        return reason
    try:
        from transformer_engine.pytorch.attention import flash_backend as torch_flash  # noqa: F401
    except Exception as err:  # the PyTorch frontend is what JAX is compared with
        return f"transformer_engine.pytorch does not import: {type(err).__name__}: {err}"
    return None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def _torch():
    import torch

    return torch


def _to_torch(x):
    torch = _torch()
    return torch.from_dlpack(jnp.array(x, copy=True)).clone()


def _bits(x) -> np.ndarray:
    """The 16-bit patterns of a JAX array or a torch tensor."""
    if hasattr(x, "detach"):
        torch = _torch()
        return x.detach().contiguous().view(torch.int16).cpu().numpy()
    return np.asarray(x).view(np.int16)


def _jax_grads(f, q, k, v, dout):
    def run(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: f((q, k, v)), q, k, v)
        return (out, *vjp(dout))

    return jax.jit(run)(q, k, v, dout)


def _jax_flash(mask, layout=QKVLayout.BSHD_BSHD_BSHD, desc=None, scale=None, window=None, m=1,
               bottom_right_diagonal=None):
    def f(qkv):
        return te_testing.fused_attn_with_backend(
            "flash", qkv, None, desc, None, AttnBiasType.NO_BIAS, mask, layout, scale, 0.0, True, m, window,
            bottom_right_diagonal=bottom_right_diagonal)

    return f


def _torch_flash(q, k, v, dout, fmt, mask, window, scale, deterministic=True, **sequences):
    from transformer_engine.pytorch.attention.flash_backend import flash_attn_func

    tq, tk, tv = (_to_torch(x).requires_grad_(True) for x in (q, k, v))
    out = flash_attn_func(tq, tk, tv, fmt, mask, window, scale, deterministic=deterministic, **sequences)
    out.backward(_to_torch(dout))
    return out, tq.grad, tk.grad, tv.grad


def _assert_bitwise(jax_res, torch_res, what):
    for name, a, t in zip(("out", "dq", "dk", "dv"), jax_res, torch_res):
        np.testing.assert_array_equal(_bits(a), _bits(t), err_msg=f"{what}: {name} differs from PyTorch")


# ------------------------------------------------------------------------------------------------
# PyTorch == JAX
# ------------------------------------------------------------------------------------------------

BSHD_CASES = {
    # name: (mask (JAX), mask (PyTorch), s_q, s_kv, h_q, h_kv, d_qk, d_v, window)
    "causal-gqa-d128": (AttnMaskType.CAUSAL_MASK, "causal", 384, 384, 8, 2, 128, 128, None),
    "no_mask-d64": (AttnMaskType.NO_MASK, "no_mask", 256, 256, 4, 4, 64, 64, None),
    "causal-window-gqa": (AttnMaskType.CAUSAL_MASK, "causal", 512, 512, 8, 2, 128, 128, (96, 0)),
    "causal-topleft-skv>sq": (AttnMaskType.CAUSAL_MASK, "causal", 256, 384, 8, 8, 128, 128, None),
    "causal_bottom_right-sq<skv": (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, "causal_bottom_right", 200, 333, 8, 2, 64,
                                   64, None),
    "causal-d192-128": (AttnMaskType.CAUSAL_MASK, "causal", 256, 256, 4, 4, 192, 128, None),
}


# bf16 everywhere, fp16 once: each (config, dtype) compiles its own kernels (seconds each).
_BSHD_PARAMS = [pytest.param(name, jnp.bfloat16, id=f"{name}-bf16") for name in BSHD_CASES] + [
    pytest.param("causal-gqa-d128", jnp.float16, id="causal-gqa-d128-fp16")]


@pytest.mark.parametrize("name, dtype", _BSHD_PARAMS)
def test_bshd_pytorch_and_jax_are_bitwise_equal(deterministic, name, dtype):
    mask, torch_mask, s_q, s_kv, h_q, h_kv, d_qk, d_v, window = BSHD_CASES[name]
    q, k, v = random_qkv(jax.random.PRNGKey(11), 2, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype)
    dout = jax.random.normal(jax.random.PRNGKey(12), (2, s_q, h_q, d_v), jnp.float32).astype(dtype)
    scale = d_qk**-0.5
    jax_res = _jax_grads(_jax_flash(mask, scale=scale, window=window), q, k, v, dout)
    te_window = window if window is not None else ((-1, 0) if "causal" in torch_mask else (-1, -1))
    torch_res = _torch_flash(q, k, v, dout, "bshd", torch_mask, te_window, scale)
    _assert_bitwise(jax_res, torch_res, name)


def test_padded_bshd_pytorch_and_jax_are_bitwise_equal(deterministic):
    torch = _torch()
    b, s, h_q, h_kv, d = 3, 384, 8, 2, 128
    q, k, v = random_qkv(jax.random.PRNGKey(21), b, s, s, h_q, h_kv, d, d, jnp.bfloat16)
    dout = jax.random.normal(jax.random.PRNGKey(22), q.shape, jnp.float32).astype(jnp.bfloat16)
    lens = np.array([s, s - 77, 129], np.int32)
    f = _jax_flash(AttnMaskType.PADDING_CAUSAL_MASK, desc=SequenceDescriptor.from_seqlens(jnp.asarray(lens)),
                   scale=d**-0.5)
    jax_res = _jax_grads(f, q, k, v, dout)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    torch_res = _torch_flash(q, k, v, dout, "bshd", "padding_causal", (-1, 0), d**-0.5, cu_seqlens_q=cu,
                             cu_seqlens_kv=cu)
    _assert_bitwise(jax_res, torch_res, "bshd padding_causal")


def _thd_segments(seed, b, s, m, lens=None):
    return packed_segments(np.random.default_rng(seed), b, s, m, gaps=True, lens=lens)


@pytest.mark.parametrize("mask, torch_mask, window", [
    (AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, "padding_causal_bottom_right", None),
    (AttnMaskType.PADDING_MASK, "padding", (64, 32)),
    (AttnMaskType.PADDING_CAUSAL_MASK, "padding_causal", None),
], ids=["padding_causal_bottom_right", "padding-window", "padding_causal-self"])
def test_thd_pytorch_and_jax_are_bitwise_equal(deterministic, mask, torch_mask, window):
    """JAX's THD rows [b, s] with m segments (gaps between them) against PyTorch's thd call on the same
    [b * s] tokens: cu_seqlens_*_padded = the segments' starts r * s + offset, max_seqlen = s."""
    torch = _torch()
    b, s, m, h_q, h_kv, d = 2, 512, 3, 8, 2, 128
    seg_q = _thd_segments(31, b, s, m)
    s_kv = s
    seg_kv = seg_q  # self attention (one array for q and kv)
    if mask == AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK:  # cross attention: 7 more keys per sequence
        s_kv = s + 8 * m
        seg_kv = _thd_segments(32, b, s_kv, m, lens=np.where(seg_q.lens > 0, seg_q.lens + 7, 0))
    q, k, v = random_qkv(jax.random.PRNGKey(33), b, s, s_kv, h_q, h_kv, d, d, jnp.bfloat16)
    dout = jax.random.normal(jax.random.PRNGKey(34), q.shape, jnp.float32).astype(jnp.bfloat16)
    if seg_kv is seg_q:
        desc = SequenceDescriptor.from_seqlens_and_offsets(jnp.asarray(seg_q.lens), jnp.asarray(seg_q.offsets))
    else:
        desc = SequenceDescriptor.from_seqlens_and_offsets((jnp.asarray(seg_q.lens), jnp.asarray(seg_kv.lens)),
                                                           (jnp.asarray(seg_q.offsets), jnp.asarray(seg_kv.offsets)))
    f = _jax_flash(mask, layout=QKVLayout.THD_THD_THD, desc=desc, scale=d**-0.5, window=window, m=m,
                   bottom_right_diagonal=True if window is not None else None)
    jax_res = _jax_grads(f, q, k, v, dout)

    def cu(seg):
        lens = seg.lens.reshape(-1)
        starts = seg.starts.copy()
        for r in range(b):  # an empty segment starts where the ones before it end, as the descriptor reads it
            end = 0
            for j in range(m):
                if seg.lens[r, j] == 0:
                    starts[r, j] = end
                else:
                    end = starts[r, j] + seg.lens[r, j]
        starts = (np.arange(b)[:, None] * seg.seqlen + starts).reshape(-1)
        cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        padded = torch.tensor(np.concatenate([starts, [b * seg.seqlen]]), dtype=torch.int32, device="cuda")
        return cu_seqlens, padded

    cu_q, pad_q = cu(seg_q)
    cu_kv, pad_kv = (cu_q, pad_q) if seg_kv is seg_q else cu(seg_kv)
    te_window = window if window is not None else (-1, 0)
    flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # noqa: E731
    torch_res = _torch_flash(flat(q), flat(k), flat(v), flat(dout), "thd", torch_mask, te_window, d**-0.5,
                             cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=pad_q,
                             cu_seqlens_kv_padded=pad_kv, max_seqlen_q=s, max_seqlen_kv=s_kv)
    _assert_bitwise([flat(x) for x in jax_res], torch_res, f"thd {torch_mask}")


# ------------------------------------------------------------------------------------------------
# Determinism: repeated runs, batch and packing invariance
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, mask", [(QKVLayout.BSHD_BSHD_BSHD, AttnMaskType.CAUSAL_MASK),
                                          (QKVLayout.THD_THD_THD, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK)],
                         ids=["bshd-causal", "thd-padding_causal_bottom_right"])
def test_deterministic_runs_are_bitwise_equal(deterministic, layout, mask):
    thd = layout == QKVLayout.THD_THD_THD
    case = make_case("flash", layout=layout, mask=mask, dtype=jnp.bfloat16, b=2, s_q=1024, s_kv=1024, h_q=16,
                     h_kv=4, d_qk=128, d_v=128, m=3 if thd else 1, desc_kind="offsets" if thd else "seqlens")
    fn = case.function()
    first = {k: _bits(v) for k, v in case.run(fn).items() if v is not None}
    for run in range(1, 6):
        again = case.run(case.function() if run == 1 else fn)  # run 1 compiles anew
        for name, value in first.items():
            np.testing.assert_array_equal(_bits(again[name]), value, err_msg=f"{name} differs in run {run}")


@pytest.mark.parametrize("mask, dims", [(AttnMaskType.CAUSAL_MASK, (128, 128)), (AttnMaskType.NO_MASK, (64, 64)),
                                        (AttnMaskType.PADDING_CAUSAL_MASK, (128, 128))],
                         ids=["causal-d128", "no_mask-d64", "padding_causal-d128"])
def test_same_sequence_alone_and_in_a_batch(deterministic, mask, dims):
    b, s, h_q, h_kv = 4, 768, 8, 2
    q, k, v = random_qkv(jax.random.PRNGKey(41), b, s, s, h_q, h_kv, *dims, jnp.bfloat16)
    dout = jax.random.normal(jax.random.PRNGKey(42), (b, s, h_q, dims[1]), jnp.float32).astype(jnp.bfloat16)
    lens = jnp.array([s, 300, 517, 1], jnp.int32)

    def run(rows):
        desc = SequenceDescriptor.from_seqlens(lens[rows]) if mask.is_padding() else None
        return _jax_grads(_jax_flash(mask, desc=desc, scale=dims[0] ** -0.5), q[rows], k[rows], v[rows], dout[rows])

    whole = run(slice(0, b))
    for row in range(b):
        alone = run(slice(row, row + 1))
        for name, a, one in zip(("out", "dq", "dk", "dv"), whole, alone):
            np.testing.assert_array_equal(_bits(a[row:row + 1]), _bits(one), err_msg=f"{name}, row {row}")


@pytest.mark.parametrize("mask, gap", [(AttnMaskType.PADDING_MASK, 0), (AttnMaskType.PADDING_CAUSAL_MASK, 3),
                                       (AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, 3)],
                         ids=["padding-gap0", "padding_causal-gap3", "padding_causal_bottom_right-gap3"])
def test_packed_thd_equals_padded_bshd(deterministic, mask, gap):
    """The same sequences packed in one THD row (with ``gap`` tokens between them) or padded in a BSHD batch."""
    lens = [130, 511, 77, 256]
    s_pad = 512
    s_packed = sum(lens) + gap * len(lens) + 64
    h_q, h_kv, d = 8, 2, 128
    q, k, v = random_qkv(jax.random.PRNGKey(51), len(lens), s_pad, s_pad, h_q, h_kv, d, d, jnp.bfloat16)
    dout = jax.random.normal(jax.random.PRNGKey(52), q.shape, jnp.float32).astype(jnp.bfloat16)
    starts = np.cumsum([0] + [n + gap for n in lens[:-1]]) + gap

    def pack(x):
        row = jnp.zeros((s_packed, *x.shape[2:]), x.dtype)
        for i, n in enumerate(lens):
            row = row.at[starts[i]:starts[i] + n].set(x[i, :n])
        return row[None]

    padded = _jax_grads(_jax_flash(mask, desc=SequenceDescriptor.from_seqlens(jnp.array(lens)), scale=d**-0.5),
                        q, k, v, dout)
    offsets = jnp.array([list(starts) + [s_packed]], jnp.int32)
    desc = SequenceDescriptor.from_seqlens_and_offsets(jnp.array([lens], jnp.int32), offsets)
    packed = _jax_grads(_jax_flash(mask, layout=QKVLayout.THD_THD_THD, desc=desc, scale=d**-0.5, m=len(lens)),
                        *(pack(x) for x in (q, k, v, dout)))
    for name, a, p in zip(("out", "dq", "dk", "dv"), padded, packed):
        for i, n in enumerate(lens):
            np.testing.assert_array_equal(_bits(a[i, :n]), _bits(p[0, starts[i]:starts[i] + n]),
                                          err_msg=f"{name}, sequence {i}")


# ------------------------------------------------------------------------------------------------
# Accuracy and selection
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    dict(mask=AttnMaskType.CAUSAL_MASK, h_q=16, h_kv=4, d_qk=128, d_v=128, s_q=1024, s_kv=1024),
    dict(mask=AttnMaskType.NO_MASK, d_qk=64, d_v=64, s_q=333, s_kv=333),
    dict(mask=AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, d_qk=192, d_v=128, s_q=200, s_kv=500),
    dict(layout=QKVLayout.THD_THD_THD, mask=AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, m=3, desc_kind="offsets",
         h_q=8, h_kv=2, d_qk=128, d_v=128, s_q=1024, s_kv=1024),
    dict(layout=QKVLayout.SBHD_SBHD_SBHD, mask=AttnMaskType.CAUSAL_MASK, window=(128, 0), d_qk=128, d_v=128,
         s_q=512, s_kv=512),
], ids=["bshd-causal-gqa", "bshd-no_mask-d64-s333", "bshd-causal_br-d192", "thd-gqa", "sbhd-window"])
def test_accuracy_against_the_fp32_reference(deterministic, config):
    """bf16, in deterministic mode (the kernels the other tests compile); fp16's bits are compared with
    PyTorch above."""
    case = make_case("flash", dtype=jnp.bfloat16, b=2, **config)
    case.check_reference(case.run())


def test_selected_where_pytorch_selects_it():
    """Hopper, d=128: measured faster, so first in both frameworks (FlashAttention.MEASURED_FASTER)."""
    if not str(jax.devices()[0].compute_capability).startswith("9."):
        pytest.skip("the measured preference is Hopper's")
    q, k, v = random_qkv(jax.random.PRNGKey(61), 2, 256, 256, 8, 2, 128, 128, jnp.bfloat16)
    with te_testing.recording_backend_selections() as names:
        jax.jit(lambda q, k, v: fused_attn((q, k, v), None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
                                           QKVLayout.BSHD_BSHD_BSHD, scaling_factor=128**-0.5))(q, k, v)
    assert names == ["FlashAttention"]
