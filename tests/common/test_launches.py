"""Both frontends launch the same kernels for the same call, without a GPU.

PyTorch (``pytorch/attention/kernel_runner.py``) runs its forward and backward on meta tensors with the
launch itself captured; JAX (``jax/primitives/gpu.py``) describes its FFI programs' launches with
``gpu.launch_call``. Both go through ``common.attention.launch_description``: the lists must be equal
kernel by kernel (name, grid, every argument by name with tensors as slot names, launch options) over a
grid of dtypes, head dims, masks and windows, bias shapes, GQA, packed sequences and sink softmax types,
on an sm_90 device (so the Gluon kernels serve d=128). Both frontends plan one backward whatever the
determinism mode (no atomic variant exists), so the mode is not a parameter here.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Tuple

import pytest

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

from transformer_engine.common.attention import launch_description  # noqa: E402
from transformer_engine.common.attention.plan import padded_head_dim  # noqa: E402
from transformer_engine.common.attention.enums import (  # noqa: E402
    AttnBiasType, AttnMaskType, AttnSoftmaxType, BackwardGrads, QKVFormat,
)
from transformer_engine.jax.primitives import gpu  # noqa: E402
from transformer_engine.jax.primitives.attention import FusedAttnStatic  # noqa: E402
from transformer_engine.pytorch.attention import kernel_runner  # noqa: E402
import te_torch_testing as testing  # noqa: E402

SM90 = dict(device_type="cuda", vendor="nvidia", compute_capability=(9, 0), gfx_arch=None)
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "bfloat16"
    dims: Tuple[int, int] = (128, 128)
    mask: AttnMaskType = AttnMaskType.NO_MASK
    window: Tuple[int, int] = (-1, -1)
    bottom_right: bool = False
    heads: Tuple[int, int] = (8, 8)
    bias: Optional[Tuple[int, int]] = None  # (b|1, h|1) of a [., ., s_q, s_kv] post_scale_bias
    segments: int = 1  # padding masks: sequences per row (packed mode)
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX
    batch: int = 2
    seqlen: Tuple[int, int] = (256, 384)

    @property
    def name(self) -> str:
        parts = [self.dtype, f"d{self.dims[0]}x{self.dims[1]}", self.mask.value, f"h{self.heads[0]}x{self.heads[1]}"]
        if self.window != (-1, -1):
            parts.append(f"w{self.window[0]}_{self.window[1]}{'br' if self.bottom_right else 'tl'}")
        if self.bias:
            parts.append(f"bias{self.bias[0]}{self.bias[1]}ss")
        if self.segments > 1:
            parts.append(f"m{self.segments}")
        if self.softmax_type != AttnSoftmaxType.VANILLA_SOFTMAX:
            parts.append(self.softmax_type.value)
        return "-".join(parts)


def _cases():
    out = []
    masks = [AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_MASK,
             AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK]
    for dtype, dims, mask in itertools.product(("float16", "bfloat16", "float32"), ((64, 64), (128, 128), (192, 192),
                                                                                  (256, 256)), masks):
        out.append(Case(dtype, dims, mask, segments=2 if mask.is_padding() else 1))
    for dims in ((64, 64), (128, 128), (256, 256)):
        out += [
            Case(dims=dims, mask=AttnMaskType.NO_MASK, window=(64, 16), bottom_right=True, heads=(8, 2)),
            Case(dims=dims, mask=AttnMaskType.NO_MASK, window=(32, 32), bottom_right=False),
            Case(dims=dims, mask=AttnMaskType.CAUSAL_MASK, window=(48, 0), heads=(8, 1)),
            Case(dims=dims, mask=AttnMaskType.PADDING_CAUSAL_MASK, window=(40, 0), heads=(6, 2), segments=3),
        ]
    for bias, mask in itertools.product(((1, 8), (2, 1), (2, 8), (1, 1)), (AttnMaskType.NO_MASK,
                                                                          AttnMaskType.CAUSAL_MASK)):
        out.append(Case(dims=(64, 64), mask=mask, bias=bias))
        heads = (8, 4) if bias[1] == 1 else (8, 8)
        out.append(Case(dtype="float16", dims=(128, 128), mask=mask, bias=bias, heads=heads))
    for stype in (AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, AttnSoftmaxType.LEARNABLE_SOFTMAX):
        out += [Case(dims=(128, 128), mask=AttnMaskType.CAUSAL_MASK, softmax_type=stype),
                Case(dims=(64, 64), mask=AttnMaskType.PADDING_CAUSAL_MASK, heads=(8, 2), segments=2,
                     softmax_type=stype)]
    out.append(Case(dims=(128, 64), mask=AttnMaskType.CAUSAL_MASK, heads=(4, 1)))
    # Hopper's narrow-V tiles at 192/128, where the Q/K head dim splits (128 + 64); with a bias it does not.
    out += [Case(dims=(192, 128), mask=AttnMaskType.CAUSAL_MASK, heads=(8, 2)),
            Case(dims=(192, 128), mask=AttnMaskType.PADDING_CAUSAL_MASK, heads=(8, 2), segments=2,
                 softmax_type=AttnSoftmaxType.LEARNABLE_SOFTMAX),
            Case(dims=(192, 128), mask=AttnMaskType.NO_MASK, bias=(1, 8))]
    return out


CASES = _cases()


@pytest.fixture(autouse=True)
def _sm90(monkeypatch):
    monkeypatch.setattr(kernel_runner, "_device", lambda device: dict(SM90))
    monkeypatch.delenv("NVTE_FUSED_ATTN_PLAN_ARCH", raising=False)
    monkeypatch.delenv("NVTE_FUSED_ATTN_WS", raising=False)


def _torch_launches(case: Case, monkeypatch, grads: BackwardGrads = BackwardGrads.DQ_DKDV):
    """(forward, backward) launch lists of PyTorch's launcher for ``case``, on meta tensors (the backward
    runs the ``grads`` passes)."""
    b, (s_q, s_kv), (hq, hk), (dqk, dv) = case.batch, case.seqlen, case.heads, case.dims
    dtype = TORCH_DTYPES[case.dtype]
    meta = dict(dtype=dtype, device="meta")
    packed = case.mask.is_padding()
    seqs, sequences = None, {}
    if packed:  # JAX's padding masks run the packed mode: the same as PyTorch's thd over all rows' tokens
        fmt = QKVFormat.THD
        q, k, v = (torch.empty((b * s, h, d), **meta) for s, h, d in ((s_q, hq, dqk), (s_kv, hk, dqk), (s_kv, hk, dv)))
        m = case.segments
        lens_q = torch.tensor([s_q // m] * (b * m), dtype=torch.int32)
        lens_k = torch.tensor([s_kv // m] * (b * m), dtype=torch.int32)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), lens_q.cumsum(0).to(torch.int32)])
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lens_k.cumsum(0).to(torch.int32)])
        sequences = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k,
                         max_seqlen_q=s_q, max_seqlen_kv=s_kv)
    else:
        fmt = QKVFormat.BSHD
        q, k, v = (torch.empty((b, s, h, d), **meta) for s, h, d in ((s_q, hq, dqk), (s_kv, hk, dqk), (s_kv, hk, dv)))
    bias = torch.empty((*case.bias, s_q, s_kv), **meta) if case.bias else None
    offset = torch.empty((hq,), dtype=torch.float32, device="meta") if case.softmax_type.has_sink else None
    call = testing.fused_call(fmt, case.mask, case.window, 0.125, bottom_right_diagonal=case.bottom_right, bias=bias,
                              softmax_type=case.softmax_type, softmax_offset=offset, **sequences)
    if packed:
        # JAX's rows of m sequences each (its max_segments_per_seq): the segment-row grid
        seqs = dataclasses.replace(kernel_runner.sequences(q, k, call), segments_per_row=m)
    with testing.recorded_launches(run=False) as captured:
        out, lse = kernel_runner.forward(q, k, v, call, seqs=seqs)
        kernel_runner.backward(q, k, v, out, torch.empty_like(out), lse, call, seqs=seqs, bias_grad=bias is not None,
                               softmax_offset_grad=case.softmax_type.is_learnable, grads=grads)
    return captured


def _jax_launches(case: Case, grads: BackwardGrads = BackwardGrads.DQ_DKDV):
    """(forward, backward) launch lists of the JAX CUDA lowering for ``case`` (the backward runs the
    ``grads`` passes)."""
    b, (s_q, s_kv), (hq, hk), (dqk, dv) = case.batch, case.seqlen, case.heads, case.dims
    static = FusedAttnStatic(case.mask, AttnBiasType.POST_SCALE_BIAS if case.bias else AttnBiasType.NO_BIAS,
                             QKVFormat.BSHD, case.window, 0.125, 0.0, True, True,
                             bottom_right_diagonal=case.bottom_right, softmax_type=case.softmax_type)
    nseq = b * case.segments if case.mask.is_padding() else b
    q, k, v, o = (b, s_q, hq, dqk), (b, s_kv, hk, dqk), (b, s_kv, hk, dv), (b, s_q, hq, dv)
    bias_shape = (*case.bias, s_q, s_kv) if case.bias else None
    m = case.segments if case.mask.is_padding() else 1  # as the lowering passes max_segments_per_seq
    fwd = gpu.launch_call(static, dict(q=q, k=k, v=v, out=o), jnp.dtype(case.dtype), nseq, bias_shape, (9, 0), m)
    bwd = gpu.launch_call(static, dict(q=q, k=k, v=v, out=o, d_out=o, dq=q, dk=k, dv=v), jnp.dtype(case.dtype), nseq,
                          bias_shape, (9, 0), m)
    return [launch_description.forward_launches(fwd),
            launch_description.backward_launches(bwd, bias_grad=case.bias is not None,
                                       sink_grad=case.softmax_type.is_learnable, grads=grads)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pytorch_and_jax_launch_the_same_kernels(case, monkeypatch):
    ours = _torch_launches(case, monkeypatch)
    theirs = _jax_launches(case)
    assert len(ours) == len(theirs) == 2
    for step, pt, jx in zip(("forward", "backward"), ours, theirs):
        assert [x.name for x in pt] == [x.name for x in jx], step
        for a, b in zip(pt, jx):
            assert a.describe() == b.describe(), (step, a.name, _diff(a, b))


def test_every_launch_pins_fp_contraction_on(monkeypatch):
    """FMA contraction is part of the kernels' bits and Triton's default for it changes after 3.9: every
    launch of both frontends states it, so a Triton upgrade cannot change the arithmetic silently."""
    for case in CASES[:8]:
        for launches in (*_jax_launches(case), *_torch_launches(case, monkeypatch)):
            assert launches and all(x.options.get("enable_fp_fusion") is True for x in launches), case.name


# The partial backwards (context parallelism's dQ-only and dK/dV-only calls) over a subset of the grid:
# every kind of launch (Gluon and Triton passes, dBias, dsink, packed mode, GQA) appears in it.
PARTIAL_CASES = [c for i, c in enumerate(CASES) if i % 3 == 0 or c.bias or c.softmax_type.is_learnable]
PASSES = {BackwardGrads.DQ: ("attn_bwd_dq_kernel", "attn_bwd_dq_ws_kernel"),
          BackwardGrads.DKDV: ("attn_bwd_dkdv_kernel", "attn_bwd_dkdv_ws_kernel")}


@pytest.mark.parametrize("grads", [BackwardGrads.DQ, BackwardGrads.DKDV], ids=lambda g: g.value)
@pytest.mark.parametrize("case", PARTIAL_CASES, ids=lambda c: c.name)
def test_partial_backward_is_the_whole_backward_less_one_pass(case, grads, monkeypatch):
    """A partial backward launches exactly the whole backward's launches (each one unchanged, in order)
    less the other gradient pass, in both frontends: the same kernels on the same arguments, so the
    gradients it computes are the whole backward's bits."""
    whole = _jax_launches(case)[1]
    dropped = PASSES[BackwardGrads.DKDV if grads == BackwardGrads.DQ else BackwardGrads.DQ]
    expected = [x.describe() for x in whole if x.name not in dropped]
    dkdv_passes = sum(x.name in PASSES[BackwardGrads.DKDV] for x in whole)  # two where dV is a pass of its own
    assert dkdv_passes in (1, 2)
    assert len(expected) == len(whole) - (dkdv_passes if grads == BackwardGrads.DQ else 1)
    pt_fwd, pt_bwd = _torch_launches(case, monkeypatch, grads)
    jx_fwd, jx_bwd = _jax_launches(case, grads)
    assert [x.describe() for x in pt_fwd] == [x.describe() for x in jx_fwd]
    for step, described in (("pytorch", pt_bwd), ("jax", jx_bwd)):
        assert [x.describe() for x in described] == expected, step
    names = [x.name for x in jx_bwd]
    assert names[0] == "attn_bwd_preprocess_kernel" and any(n in PASSES[grads] for n in names)


@pytest.mark.parametrize("grads", list(BackwardGrads), ids=lambda g: g.value)
def test_a_backward_without_preprocess_is_the_backward_less_its_first_launch(grads):
    """preprocess=False (delta filled by an earlier call over the rows) drops the preprocess and changes
    no other launch."""
    call = _bwd_call(CASES[0])
    whole = launch_description.backward_launches(call, grads=grads)
    without = launch_description.backward_launches(call, grads=grads, preprocess=False)
    assert whole[0].name == "attn_bwd_preprocess_kernel"
    assert [x.describe() for x in without] == [x.describe() for x in whole[1:]]


def test_partial_backward_rejects_an_unknown_part():
    with pytest.raises(ValueError):
        launch_description.backward_launches(_bwd_call(CASES[0]), grads="dk")


def _bwd_call(case: Case) -> launch_description.Call:
    b, (s_q, s_kv), (hq, hk), (dqk, dv) = case.batch, case.seqlen, case.heads, case.dims
    static = FusedAttnStatic(case.mask, AttnBiasType.NO_BIAS, QKVFormat.BSHD, case.window, 0.125, 0.0, True, True)
    q, k, v, o = (b, s_q, hq, dqk), (b, s_kv, hk, dqk), (b, s_kv, hk, dv), (b, s_q, hq, dv)
    return gpu.launch_call(static, dict(q=q, k=k, v=v, out=o, d_out=o, dq=q, dk=k, dv=v), jnp.dtype(case.dtype), b,
                           None, (9, 0))


def _diff(a: launch_description.Launch, b: launch_description.Launch):
    da, db = a.describe(), b.describe()
    args = {k: (v, dict(db[2]).get(k)) for k, v in da[2] if dict(db[2]).get(k) != v}
    return dict(grid=(da[1], db[1]), options=(da[3], db[3]), args=args)


def test_the_grid_covers_what_it_says():
    """Every kernel the launches have (the Gluon ones included) appears, and the modifiers do."""
    names = set()
    for case in CASES:
        for described in _jax_launches(case):
            names |= {x.name for x in described}
    assert names == {"attn_fwd_kernel", "attn_fwd_ws_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel",
                     "attn_bwd_dkdv_ws_kernel", "attn_bwd_dq_kernel", "attn_bwd_dq_ws_kernel", "attn_bwd_dbias_kernel",
                     "attn_bwd_dsink_kernel"}
    assert {c.dtype for c in CASES} == {"float16", "bfloat16", "float32"}
    assert {c.dims[0] for c in CASES} >= {64, 128, 192, 256}
    assert any(c.heads[0] != c.heads[1] for c in CASES) and any(c.segments > 1 for c in CASES)
    assert {c.bias for c in CASES if c.bias} == {(1, 8), (2, 1), (2, 8), (1, 1)}


def test_the_split_reaches_both_frontends():
    """At 192/128 the forward, dK/dV and dQ launches split Q/K into 128 + 64 (plan.split_head_dim), the
    dBias launch keeps one 256-wide tile; every other launch has BLOCK_DQK2 = 0."""
    for case in CASES:
        split = case.dims == (192, 128) and case.dtype != "float32" and not case.bias
        for described in _jax_launches(case):
            for x in described:
                if x.name in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
                    assert (x.args["BLOCK_DQK"], x.args["BLOCK_DQK2"]) == ((128, 64) if split else
                                                                          (padded_head_dim(case.dims[0]), 0)), case
                elif x.name == "attn_bwd_dbias_kernel":
                    assert x.args["BLOCK_DQK"] == padded_head_dim(case.dims[0]), case


def test_launch_lists_name_every_kernel_parameter_in_order():
    """A launch passes each parameter of its kernel exactly once, in the kernel's order; tensors as slots."""
    for case in CASES[:8]:
        for described in _jax_launches(case):
            for x in described:
                assert list(x.args) == list(x.kernel.arg_names), x.name
                assert all(isinstance(v, launch_description.Slot) for k, v in x.args.items() if k.isupper() and
                           not isinstance(v, (bool, int, str))), x.name


@pytest.mark.parametrize("seqlen", [(1, 384), (256, 1), (1, 1), (256, 384), (255, 17)], ids=str)
@pytest.mark.parametrize("dims", [(64, 64), (256, 256)], ids=lambda d: f"d{d[0]}")
def test_a_length_of_one_takes_the_length_generic_kernel(seqlen, dims, monkeypatch):
    """Lengths stay specialized (the alignment hint) except a length of 1: its launches take the
    kernels' twins with the lengths runtime values, in both frontends (kernels/masking.py)."""
    from transformer_engine.common.attention.kernels import backward, forward

    kernels = {k.__name__: k for k in (forward.attn_fwd_kernel, backward.attn_bwd_dkdv_kernel,
                                       backward.attn_bwd_dq_kernel)}
    monkeypatch.setenv("NVTE_FUSED_ATTN_WS", "0")  # the Triton kernels (Hopper plans Gluon ones at d=256)
    case = Case(dims=dims, mask=AttnMaskType.CAUSAL_MASK, seqlen=seqlen)
    for frontend in (_torch_launches(case, monkeypatch), _jax_launches(case)):
        block_loops = [x for described in frontend for x in described if x.name in kernels]
        assert len(block_loops) == (3 if dims[0] == 64 else 4)  # two dK/dV passes at d=256
        for x in block_loops:
            base = kernels[x.name]
            assert x.kernel is (base.length_generic if 1 in seqlen else base), (x.name, seqlen)


def test_the_jax_static_is_the_common_params():
    """FusedAttnStatic extends AttnParams (its fields, in its order) and keeps JAX's default diagonal."""
    from transformer_engine.common.attention.params import AttnParams

    args = (AttnMaskType.NO_MASK, AttnBiasType.NO_BIAS, QKVFormat.BSHD, (8, 8), 0.125, 0.0, True, True)
    static = FusedAttnStatic(*args)
    assert isinstance(static, AttnParams) and static.checkpoint_name == "context"
    assert static.bottom_right is False and AttnParams(*args).bottom_right is True  # a None diagonal
    assert dataclasses.replace(static, bottom_right_diagonal=True).bottom_right is True
