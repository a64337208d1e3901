"""Deterministic backward, as TransformerEngine's ROCm fork tested it and its reviewers asked for
more: under ``global_shard_guard(MeshResource())`` with ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``,
dQ/dK/dV (and the output) are bitwise equal across runs and recompiles and within tolerance of the
unfused fp32 reference, for GQA and non-GQA, sequence packing (THD) and padding, bf16 and fp16, at
every length tested (numerics are checked at all of them).

Plus the determinism contract's invariances: (b) the same sequence inside a different batch, (c) the same
sequences packed (THD) or padded (BSHD). ``selected`` runs what ``fused_attn`` picks (unfused on
CPU, the Triton kernels on a GPU); ``fused`` runs the fused primitives (on CPU their jnp lowering).
On a GPU (qa/L3_determinism) longer sequences and more repeats are used.

Cost: each length of a case compiles twice (run 0 and one recompile at run 1), the other runs
reuse run 0's executable; the fp64 reference is computed once per length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax_testing import attn_fn, make_case, random_qkv
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVFormat, QKVLayout
from transformer_engine.jax import attention as te_attention
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.sharding import MeshResource, global_shard_guard

pytestmark = pytest.mark.determinism

ON_GPU = jax.devices()[0].platform == "gpu"
LENGTHS = [128, 1024, 2048] if ON_GPU else [97]
RUNS = 5 if ON_GPU else 3  # run 1 recompiles; the others reuse run 0's executable


@pytest.fixture(autouse=True)
def deterministic_mode(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    with global_shard_guard(MeshResource()):
        yield


def _run_deterministic_bwd_case(backend, layout, mask, seq_len, h_q, h_kv, dtype, d=64 if ON_GPU else 32):
    is_thd = QKVLayout(layout).qkv_format == QKVFormat.THD
    b = 2
    case = make_case(
        backend, layout=layout, mask=mask, dtype=dtype, b=b, s_q=seq_len, s_kv=seq_len, h_q=h_q, h_kv=h_kv,
        d_qk=d, d_v=d, m=3 if is_thd else 1, desc_kind="offsets" if is_thd else "seqlens", seed=seq_len,
    )
    assert te_attention.is_deterministic_mode()
    fn = case.function()
    first = {k: np.asarray(v) for k, v in case.run(fn).items() if v is not None}
    for run in range(1, RUNS):
        again = case.run(case.function() if run == 1 else fn)  # run 1 compiles anew (bitwise across a recompile)
        for name, value in first.items():
            np.testing.assert_array_equal(np.asarray(again[name]), value, err_msg=f"{name} differs in run {run}")
    case.check_reference(first)


_GQA = [(8, 2) if ON_GPU else (4, 2), (4, 4)]


_LAYOUT_MASKS = [
    (QKVLayout.BSHD_BSHD_BSHD, AttnMaskType.CAUSAL_MASK),
    (QKVLayout.BSHD_BS2HD, AttnMaskType.PADDING_CAUSAL_MASK),
    (QKVLayout.THD_THD_THD, AttnMaskType.PADDING_CAUSAL_MASK),
    (QKVLayout.THD_T2HD, AttnMaskType.PADDING_MASK),
]
_LAYOUT_IDS = ["bshd-causal", "bshd_bs2hd-padding_causal", "thd-padding_causal", "thd_t2hd-padding"]


def _fused_grid():
    """Each layout with GQA and MHA, alternating bf16 and fp16: both dtypes per layout and per heads
    kind (8 cases; the full 16-case cross would double the GPU time at the long lengths)."""
    params = []
    for i, ((layout, mask), name) in enumerate(zip(_LAYOUT_MASKS, _LAYOUT_IDS)):
        for j, (heads, heads_name) in enumerate(zip(_GQA, ("gqa", "mha"))):
            for dtype, dtype_name in ((jnp.bfloat16, "bf16"), (jnp.float16, "fp16")):
                if (i + j) % 2 == (dtype_name == "fp16"):
                    params.append(pytest.param(layout, mask, heads, dtype, id=f"{name}-{heads_name}-{dtype_name}"))
    return params


@pytest.mark.parametrize("layout, mask, heads, dtype", _fused_grid())
def test_deterministic_bwd_fused(layout, mask, heads, dtype):
    for seq_len in LENGTHS:
        _run_deterministic_bwd_case("fused", layout, mask, seq_len, *heads, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout, mask", [_LAYOUT_MASKS[0], _LAYOUT_MASKS[2]], ids=[_LAYOUT_IDS[0], _LAYOUT_IDS[2]])
def test_deterministic_bwd_selected_backend(layout, mask, dtype):
    """What fused_attn picks here (the unfused backend on CPU), GQA."""
    backend = _backend("selected")
    same = f"{_LAYOUT_IDS[_LAYOUT_MASKS.index((layout, mask))]}-gqa-{'bf16' if dtype == jnp.bfloat16 else 'fp16'}"
    if backend == "fused" and same in [p.id for p in _fused_grid()]:
        pytest.skip(f"fused_attn selects the fused backend here: the same case as test_deterministic_bwd_fused[{same}]")
    for seq_len in LENGTHS:
        _run_deterministic_bwd_case(backend, layout, mask, seq_len, *_GQA[0], dtype)


@pytest.mark.parametrize("backend", ["selected", "fused"])
def test_deterministic_bwd_qkv_packed(backend):
    if backend == "selected" and _backend(backend) == "fused":
        pytest.skip("fused_attn selects the fused backend here: the same case as [fused]")
    _run_deterministic_bwd_case(_backend(backend), QKVLayout.BS3HD, AttnMaskType.NO_MASK, LENGTHS[0], 4, 4,
                                jnp.bfloat16)


def _backend(name: str) -> str:
    """``selected``: what fused_attn would pick for a typical config here."""
    if name != "selected":
        return name
    reasons = te_attention.fused_attn_unavailable_reasons(
        True, jnp.bfloat16, jnp.bfloat16, QKVLayout.BSHD_BSHD_BSHD, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
        "vanilla", 0.0, 8, 2, 128, 128, 64, 64)
    return "unfused" if reasons else "fused"


# ------------------------------------------------------------------------------------------------
# Invariances of the fused path
# ------------------------------------------------------------------------------------------------


def _grads(f, q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: f((q, k, v), None), q, k, v)
    return (out, *vjp(dout))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_same_sequence_in_a_different_batch_is_bitwise_equal(dtype):
    """(b): row 1 of a batch of 3 gives the same bits as that row alone."""
    s = LENGTHS[0]
    q, k, v = random_qkv(jax.random.PRNGKey(1), 3, s, s, 4, 2, 32, 32, dtype)
    dout = jax.random.normal(jax.random.PRNGKey(2), q.shape, jnp.float32).astype(dtype)
    lens = jnp.array([s, s // 2 + 3, s - 5], jnp.int32)

    def run(rows):
        desc = SequenceDescriptor.from_seqlens(lens[rows])
        f = attn_fn("fused", sequence_descriptor=desc, seed=None, attn_bias_type=AttnBiasType.NO_BIAS,
                    attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK, qkv_layout=QKVLayout.BSHD_BSHD_BSHD,
                    scaling_factor=0.125, dropout_probability=0.0, is_training=True)
        return jax.jit(_grads, static_argnums=0)(f, q[rows], k[rows], v[rows], dout[rows])

    whole = run(slice(0, 3))
    alone = run(slice(1, 2))
    for name, a, b in zip(("out", "dq", "dk", "dv"), whole, alone):
        np.testing.assert_array_equal(np.asarray(a[1:2]), np.asarray(b), err_msg=name)


def test_packed_and_padded_sequences_agree():
    """(c): the same sequences packed in one THD row or padded in a BSHD batch. Bitwise on a GPU
    (the kernels' loop order does not depend on where a sequence sits); on CPU the jnp lowering's
    sums see a different padding, so within rounding there."""
    lens = [5, 11, 7]
    s_pad, s_packed, dtype = 16, 32, jnp.bfloat16
    q, k, v = random_qkv(jax.random.PRNGKey(3), 3, s_pad, s_pad, 4, 2, 32, 32, dtype)
    dout = jax.random.normal(jax.random.PRNGKey(4), q.shape, jnp.float32).astype(dtype)
    common = dict(seed=None, attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK,
                  scaling_factor=0.125, dropout_probability=0.0, is_training=True)
    padded = attn_fn("fused", sequence_descriptor=SequenceDescriptor.from_seqlens(jnp.array(lens)),
                     qkv_layout=QKVLayout.BSHD_BSHD_BSHD, **common)

    def pack_rows(x):
        parts = [x[i, :n] for i, n in enumerate(lens)]
        row = jnp.concatenate(parts + [jnp.zeros((s_packed - sum(lens), *x.shape[2:]), x.dtype)])
        return row[None]

    packed = attn_fn("fused", sequence_descriptor=SequenceDescriptor.from_seqlens(jnp.array([lens])),
                     qkv_layout=QKVLayout.THD_THD_THD, max_segments_per_seq=3, **common)
    res_pad = jax.jit(_grads, static_argnums=0)(padded, q, k, v, dout)
    res_pack = jax.jit(_grads, static_argnums=0)(packed, *(pack_rows(x) for x in (q, k, v, dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), res_pad, res_pack):
        a = np.asarray(pack_rows(a)[0, : sum(lens)].astype(jnp.float32))
        b = np.asarray(b[0, : sum(lens)].astype(jnp.float32))
        if ON_GPU:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2, err_msg=name)


# ------------------------------------------------------------------------------------------------
# (d) Cross-framework: PyTorch and JAX launch the same kernels, so the same bits (GPU only)
# ------------------------------------------------------------------------------------------------


def _torch_fused():
    if not ON_GPU:
        pytest.skip("cross-framework equality needs a CUDA GPU (both frontends launch the Triton kernels)")
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    fused_attn = pytest.importorskip("transformer_engine.pytorch.attention.fused_attn",
                                     reason="the PyTorch frontend is not importable")
    reasons = te_attention.fused_attn_unavailable_reasons(
        True, jnp.bfloat16, jnp.bfloat16, QKVLayout.BSHD_BSHD_BSHD, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
        "vanilla", 0.0, 8, 2, 128, 128, 64, 64)
    if reasons:
        pytest.skip("JAX fused backend unavailable: " + "; ".join(reasons))
    return torch, fused_attn.fused_attn_func


def _to_torch(torch, x):
    """A JAX bf16/fp16 array -> the same bits as a CUDA torch tensor."""
    a = np.asarray(x)
    bits = torch.from_numpy(a.view(np.int16).copy())
    dtype = torch.bfloat16 if a.dtype == jnp.bfloat16 else torch.float16
    return bits.view(dtype).cuda()


def _to_numpy_bits(torch, t):
    return t.detach().contiguous().view(torch.int16).cpu().numpy()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask, padded", [(AttnMaskType.CAUSAL_MASK, False), (AttnMaskType.PADDING_CAUSAL_MASK, True),
                                          (AttnMaskType.NO_MASK, False)], ids=["causal", "padding_causal", "no_mask"])
def test_pytorch_and_jax_are_bitwise_equal(mask, padded, dtype):
    torch, fused_attn_func = _torch_fused()
    b, s, hq, hk, d = 2, 384, 8, 2, 64
    q, k, v = random_qkv(jax.random.PRNGKey(11), b, s, s, hq, hk, d, d, dtype)
    dout = jax.random.normal(jax.random.PRNGKey(12), q.shape, jnp.float32).astype(dtype)
    lens = jnp.array([s, s - 77], jnp.int32)
    scale = d**-0.5
    desc = SequenceDescriptor.from_seqlens(lens) if padded else None
    f = attn_fn("fused", sequence_descriptor=desc, seed=None, attn_bias_type=AttnBiasType.NO_BIAS,
                attn_mask_type=mask, qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=scale,
                dropout_probability=0.0, is_training=True)
    jax_res = jax.jit(_grads, static_argnums=0)(f, q, k, v, dout)

    tq, tk, tv = (_to_torch(torch, x).requires_grad_(True) for x in (q, k, v))
    cu = None
    if padded:
        cu = torch.tensor([0, s, 2 * s - 77], dtype=torch.int32, device="cuda")
    out = fused_attn_func(tq, tk, tv, "bshd", mask.value, (-1, 0) if mask.is_causal() else (-1, -1), scale,
                          cu_seqlens_q=cu, cu_seqlens_kv=cu, deterministic=True)
    out.backward(_to_torch(torch, dout))
    torch_res = (out, tq.grad, tk.grad, tv.grad)
    for name, a, t in zip(("out", "dq", "dk", "dv"), jax_res, torch_res):
        np.testing.assert_array_equal(np.asarray(a).view(np.int16), _to_numpy_bits(torch, t), err_msg=name)
