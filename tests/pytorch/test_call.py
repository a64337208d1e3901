"""AttnCall's flat form at the custom ops' boundary and the autograd Function's gradients by input name."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from transformer_engine.common.attention import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.pytorch.attention import ops
from transformer_engine.pytorch.attention.call import FLAT_SIZE, AttnCall, flatten, op_schema_args, unflatten
from transformer_engine.pytorch.attention.fused_attn import FusedAttnFunc


def _params(**changes) -> AttnParams:
    base = AttnParams(AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, AttnBiasType.ALIBI, QKVFormat.THD, (17, 0), 0.3,
                      dropout_probability=0.25, is_training=False, deterministic=True, bottom_right_diagonal=True,
                      softmax_type=AttnSoftmaxType.LEARNABLE_SOFTMAX, max_seqlen_q=40, max_seqlen_kv=53)
    return dataclasses.replace(base, **changes)


def test_the_schema_takes_every_tensor_role_and_every_parameter():
    args = [a.strip().split(" ") for a in op_schema_args().split(",")]
    names = [name for _, name in args]
    assert names == list(AttnCall.TENSOR_ROLES) + [f"params_{f.name}" for f in dataclasses.fields(AttnParams)]
    assert len(names) == FLAT_SIZE
    assert all(kind == "Tensor?" for kind, _ in args[:len(AttnCall.TENSOR_ROLES)])
    # The ops' schemas hold them, after their own tensors.
    assert str(ops.fused_attn_fwd._opoverload._schema).count("params_") == len(dataclasses.fields(AttnParams))


@pytest.mark.parametrize("changes", [{}, dict(bottom_right_diagonal=None, max_seqlen_q=None, max_seqlen_kv=None),
                                     dict(window_size=(-1, -1), attn_mask_type=AttnMaskType.NO_MASK,
                                          softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX, qkv_format=QKVFormat.SBHD)])
def test_unflatten_rebuilds_the_call(changes):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    slopes = torch.rand(4)
    call = AttnCall(_params(**changes), cu_seqlens_q=cu, cu_seqlens_q_padded=cu, alibi_slopes=slopes,
                    softmax_offset=torch.zeros(4))
    flat = flatten(call)
    assert not any(isinstance(x, AttnMaskType) for x in flat)  # enums as their strings
    flat = [list(x) if isinstance(x, tuple) else x for x in flat]  # the op gets the schema's list as a list
    again = unflatten(flat)
    assert again.params == call.params and type(again.params.attn_mask_type) is AttnMaskType
    assert all(a is b for a, b in zip(again.tensors, call.tensors))
    assert unflatten(flat).params is again.params  # the same values decode once


def test_backward_returns_a_gradient_slot_per_forward_input():
    names = list(inspect.signature(FusedAttnFunc.forward).parameters)[1:]
    from transformer_engine.pytorch.attention import fused_attn

    assert list(fused_attn._FUSED_ATTN_INPUTS) == names == ["q", "k", "v", "bias", "softmax_offset", "call"]
