"""The partial fused backward primitive (``FusedAttnStatic.backward_grads``: dQ only, dK/dV only) on the
CPU lowering: the gradients it computes are bitwise the whole backward's, the others are zeros of their
shapes. Context parallelism (transformer_engine/jax/context_parallel.py) asks each of its backward calls
for its part only; the CUDA lowering's programs are checked in test_jax_gpu_lowering.py and the launch
lists in tests/common/test_launches.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common.attention.enums import (
    AttnBiasType, AttnMaskType, AttnSoftmaxType, BackwardGrads, QKVFormat,
)
from transformer_engine.jax.attention_math import SeqInfo, full_seq_info
from transformer_engine.jax.primitives.attention import FusedAttnStatic, fused_attn_bwd, fused_attn_fwd

B, S, D = 2, 32, 16
# Packed (thd): two sequences per row, the rest padding; lengths not multiples of anything.
LENS = np.array([[10, 13], [20, 5]], np.int32)
OFFSETS = np.array([[0, 10, 23], [0, 20, 25]], np.int32)

# (format, mask, (h_q, h_kv), dtype)
CASES = [
    (QKVFormat.BSHD, AttnMaskType.NO_MASK, (4, 2), jnp.float16),
    (QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK, (2, 2), jnp.float32),
    (QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK, (4, 1), jnp.bfloat16),
    (QKVFormat.THD, AttnMaskType.PADDING_MASK, (2, 2), jnp.float32),
    (QKVFormat.THD, AttnMaskType.PADDING_CAUSAL_MASK, (4, 2), jnp.float16),
]


def _case_id(case):
    fmt, mask, (hq, hk), dtype = case
    return f"{fmt.value}-{mask.value}-h{hq}x{hk}-{jnp.dtype(dtype).name}"


def _static(fmt, mask, deterministic=True, **kw) -> FusedAttnStatic:
    window = (-1, 0) if mask.is_causal() else (-1, -1)
    return FusedAttnStatic(mask, AttnBiasType.NO_BIAS, fmt, window, D ** -0.5, 0.0, True, deterministic, **kw)


def _operands(fmt, heads, dtype):
    hq, hk = heads
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    q, k, v, dout = (jax.random.normal(key, (B, S, h, D), jnp.float32).astype(dtype)
                     for key, h in zip(keys, (hq, hk, hk, hq)))
    if fmt == QKVFormat.THD:
        seq = SeqInfo(jnp.asarray(LENS), jnp.asarray(LENS), jnp.asarray(OFFSETS), jnp.asarray(OFFSETS))
    else:
        seq = full_seq_info(B, S, S)
    return q, k, v, dout, seq


def _grads_fn(static: FusedAttnStatic, grads: BackwardGrads):
    """jit of forward then the ``grads`` backward: (dq, dk, dv, dsink)."""

    @jax.jit
    def fn(q, k, v, dout, seq, softmax_offset):
        bias = jnp.zeros((0,), q.dtype)
        seeds = jnp.zeros((q.shape[0], q.shape[2], 2), jnp.uint32)
        out, aux = fused_attn_fwd(q, k, v, bias, seq, seeds, static, softmax_offset)
        part = dataclasses.replace(static, backward_grads=grads)
        dq, dk, dv, _, dsink = fused_attn_bwd(q, k, v, bias, out, dout, aux, seq, seeds, part, softmax_offset)
        return dq, dk, dv, dsink

    return fn


def _bits(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_partial_backward_gradients_are_the_whole_backwards_bits(case, deterministic):
    fmt, mask, heads, dtype = case
    static = _static(fmt, mask, deterministic)
    q, k, v, dout, seq = _operands(fmt, heads, dtype)
    offset = jnp.zeros((heads[0],), jnp.float32)
    whole = _grads_fn(static, BackwardGrads.DQ_DKDV)(q, k, v, dout, seq, offset)
    dq_only = _grads_fn(static, BackwardGrads.DQ)(q, k, v, dout, seq, offset)
    dkdv_only = _grads_fn(static, BackwardGrads.DKDV)(q, k, v, dout, seq, offset)
    np.testing.assert_array_equal(_bits(dq_only[0]), _bits(whole[0]))
    np.testing.assert_array_equal(_bits(dkdv_only[1]), _bits(whole[1]))
    np.testing.assert_array_equal(_bits(dkdv_only[2]), _bits(whole[2]))
    assert all(float(jnp.abs(g.astype(jnp.float32)).max()) > 0 for g in whole[:3])  # a real check
    # The gradients left out: zeros of the right shape and dtype.
    for got, like in ((dq_only[1], k), (dq_only[2], v), (dkdv_only[0], q)):
        assert got.shape == like.shape and got.dtype == like.dtype
        assert not np.any(np.asarray(got.astype(jnp.float32)))


def test_dq_only_backward_keeps_the_sink_gradient():
    static = _static(QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK, softmax_type=AttnSoftmaxType.LEARNABLE_SOFTMAX)
    q, k, v, dout, seq = _operands(QKVFormat.BSHD, (2, 2), jnp.float32)
    offset = jnp.asarray([0.3, -0.5], jnp.float32)
    whole = _grads_fn(static, BackwardGrads.DQ_DKDV)(q, k, v, dout, seq, offset)
    part = _grads_fn(static, BackwardGrads.DQ)(q, k, v, dout, seq, offset)
    np.testing.assert_array_equal(_bits(part[3]), _bits(whole[3]))
    np.testing.assert_array_equal(_bits(part[0]), _bits(whole[0]))
    assert float(jnp.abs(whole[3]).max()) > 0


def test_abstract_eval_keeps_the_shapes():
    """The partial primitive's results have the whole one's types (the sharding rules are the same)."""
    static = _static(QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK)
    q, k, v, dout, seq = _operands(QKVFormat.BSHD, (4, 2), jnp.float16)
    offset = jnp.zeros((4,), jnp.float32)
    types = {g: jax.eval_shape(_grads_fn(static, g), q, k, v, dout, seq, offset) for g in BackwardGrads}
    assert types[BackwardGrads.DQ] == types[BackwardGrads.DKDV] == types[BackwardGrads.DQ_DKDV]
