"""Megatron-core's TEDotProductAttention over this package's DotProductAttention.

Megatron-core (0.19.2 in the newest environment) subclasses ``transformer_engine.pytorch.DotProductAttention``
and calls its constructor and ``forward`` itself; these tests build that layer through Megatron's own
``TransformerConfig`` and constructor (gloo world of size 1, ``parallel_state`` initialized) and check its
output and gradients against an fp64 reference: sbhd with the ``[b, 1, s, s]`` causal mask Megatron's GPT
dataset passes, packed thd through ``PackedSeqParams``, GQA, and bitwise repeats in deterministic mode.

Where ``megatron.core`` does not import (Python 3.11 has no megatron-core 0.19), those cases skip, and the
same cases run on ``_ReproducedTEDotProductAttention``: Megatron's exact constructor and forward calls to
DotProductAttention, reproduced from ``megatron/core/extensions/transformer_engine.py`` of megatron-core
0.19.2 (``TEDotProductAttention.__init__`` and ``forward``, for a TransformerEngine that reports >= 2.10).

Backends: ``unfused`` everywhere (fp32 on the CPU); ``fused`` (our Triton kernels, forced with
NVTE_FUSED_ATTN_BACKEND) on a GPU or under ``TRITON_INTERPRET=1`` on the CPU in fp16. The GPU tests at the
end run bf16 on the fused kernels at larger sizes and skip without CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Optional

import pytest
import torch

from dpa_helpers import (
    DEVICE,
    LOWP_DTYPES,
    ON_GPU,
    SelectionSpy,
    assert_close_to_reference,
    cu_seqlens,
    gen,
    reference,
    reference_and_lowp,
    requires_fused,
    requires_gpu,
)
from transformer_engine.common import log as te_log
from transformer_engine.pytorch import DotProductAttention

try:
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    MEGATRON_ERROR = None
except Exception as exc:  # ImportError, or an import-time failure of megatron.core itself
    MEGATRON_ERROR = f"megatron.core does not import here: {type(exc).__name__}: {exc}"

requires_megatron = pytest.mark.skipif(MEGATRON_ERROR is not None, reason=str(MEGATRON_ERROR))
LAYERS = [pytest.param("megatron", marks=requires_megatron), "reproduced"]
BACKENDS = ["unfused", pytest.param("fused", marks=requires_fused)]
HEADS = [(4, 4), (4, 2)]  # (num_attention_heads, num_query_groups): MHA and GQA
HEAD_IDS = ["mha", "gqa"]
D = 64 if ON_GPU else 16
S, B = (197, 3) if ON_GPU else (13, 2)
THD_LENS = [90, 1, 106] if ON_GPU else [5, 1, 7]  # sums to S: one packed row of S tokens
DIST_FILE = os.path.join(tempfile.gettempdir(), f"te_megatron_gloo_{os.getpid()}")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN",
                 "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_APPLY_QK_LAYER_SCALING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(te_log, "_warned_once", set())


@pytest.fixture(scope="module")
def megatron_parallel_state():
    """torch.distributed (gloo, world size 1) and Megatron's parallel_state, as Megatron's training
    initializes them; torn down afterwards when this module set them up."""
    if MEGATRON_ERROR is not None:
        yield None
        return
    started_dist = not torch.distributed.is_initialized()
    if started_dist:
        torch.distributed.init_process_group("gloo", init_method=f"file://{DIST_FILE}", rank=0, world_size=1)
    started_mpu = not parallel_state.model_parallel_is_initialized()
    if started_mpu:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield parallel_state
    if started_mpu:
        parallel_state.destroy_model_parallel()
    if started_dist:
        torch.distributed.destroy_process_group()
        if os.path.exists(DIST_FILE):
            os.remove(DIST_FILE)


@dataclasses.dataclass
class _PackedSeqParams:
    """The fields of Megatron-core 0.19.2's PackedSeqParams that TEDotProductAttention forwards to TE."""

    qkv_format: Optional[str] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    pad_between_seqs: Optional[bool] = None


class _ReproducedTEDotProductAttention(DotProductAttention):
    """Megatron-core 0.19.2's TEDotProductAttention calls, for environments without megatron-core:
    the constructor's keywords (tp_size 1, no RNG tracker, no process groups, no window, vanilla softmax)
    and forward's conversions (thd turns causal/no_mask into padding_causal/padding; the packed
    parameters Megatron keeps are passed as keywords; the mask travels positionally)."""

    def __init__(self, heads: int, groups: int, kv_channels: int, attn_mask_type: str,
                 attention_dropout: float = 0.0, softmax_type: str = "vanilla") -> None:
        self.qkv_format = "sbhd"
        extra = {} if softmax_type == "vanilla" else dict(softmax_type=softmax_type)
        super().__init__(
            num_attention_heads=heads, kv_channels=kv_channels, attention_dropout=attention_dropout,
            attn_mask_type=attn_mask_type, sequence_parallel=False, tp_size=1, get_rng_state_tracker=None,
            tp_group=None, layer_number=1, num_gqa_groups=groups, attention_type="self", softmax_scale=None,
            **extra,
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type: str,
                packed_seq_params: Optional[_PackedSeqParams] = None):
        packed = dataclasses.asdict(packed_seq_params) if packed_seq_params is not None else {}
        qkv_format = packed.get("qkv_format", self.qkv_format)
        if qkv_format == "thd":
            attn_mask_type = {"causal": "padding_causal", "no_mask": "padding"}.get(attn_mask_type, attn_mask_type)
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type, **packed)


class _Layer:
    """One TEDotProductAttention, Megatron's or reproduced, with Megatron's forward signature."""

    def __init__(self, kind: str, heads: int, groups: int, mask: str, deterministic: bool = False,
                 softmax_type: str = "vanilla") -> None:
        self.kind = kind
        if kind == "megatron":
            config = TransformerConfig(num_layers=1, hidden_size=heads * D, num_attention_heads=heads,
                                       num_query_groups=groups, kv_channels=D, attention_dropout=0.0,
                                       hidden_dropout=0.0, deterministic_mode=deterministic,
                                       softmax_type=softmax_type)
            self.module = TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType[mask],
                                                attention_type="self")
        else:
            self.module = _ReproducedTEDotProductAttention(heads, groups, D, mask, softmax_type=softmax_type)
        assert isinstance(self.module, DotProductAttention)

    def __call__(self, q, k, v, attention_mask, mask: str, thd_cu: Optional[torch.Tensor] = None):
        packed = None
        if thd_cu is not None:
            lengths = (thd_cu[1:] - thd_cu[:-1]).tolist()
            cls = PackedSeqParams if self.kind == "megatron" else _PackedSeqParams
            packed = cls(qkv_format="thd", cu_seqlens_q=thd_cu, cu_seqlens_kv=thd_cu, max_seqlen_q=max(lengths),
                         max_seqlen_kv=max(lengths))
        mask_type = AttnMaskType[mask] if self.kind == "megatron" else mask
        return self.module(q, k, v, attention_mask, mask_type, packed_seq_params=packed)


def _megatron_causal_mask(b: int, s: int) -> torch.Tensor:
    """[b, 1, s, s] bool, True above the diagonal (masked out): what Megatron's GPT dataset makes by default
    (its get_ltor_masks_and_position_ids, ``attention_mask < 0.5``)."""
    return torch.ones(b, 1, s, s, dtype=torch.bool, device=DEVICE).triu(1)


def _leaves(shapes, dtype, seed):
    g = gen(seed)
    return [(torch.randn(shape, generator=g)).to(DEVICE, dtype).requires_grad_() for shape in shapes]


def _sbhd_case(layer, heads, groups, dtype, mask, seed=0, with_megatron_mask=True):
    """(out [s, b, h, d], grads, d_out, inputs) of one sbhd forward + backward through ``layer``; the backward
    is ``out.backward`` as a training step runs it (the module's own tensors get their ``.grad``)."""
    q, k, v = _leaves([(S, B, heads, D), (S, B, groups, D), (S, B, groups, D)], dtype, seed)
    attention_mask = _megatron_causal_mask(B, S) if with_megatron_mask else None
    out = layer(q, k, v, attention_mask, mask)
    assert out.shape == (S, B, heads * D)
    out = out.view(S, B, heads, D)
    d_out = torch.randn(out.shape, generator=gen(seed + 1)).to(DEVICE, dtype)
    out.backward(d_out)
    return out.detach(), (q.grad, k.grad, v.grad), d_out, (q, k, v)


def _thd_case(layer, heads, groups, dtype, mask, seed=0):
    """(out [t, h, d], grads, d_out, inputs, cu_seqlens) of one packed thd forward + backward."""
    t = sum(THD_LENS)
    q, k, v = _leaves([(t, heads, D), (t, groups, D), (t, groups, D)], dtype, seed)
    cu = cu_seqlens(THD_LENS)
    out = layer(q, k, v, None, mask, thd_cu=cu)
    assert out.shape == (t, heads * D)
    out = out.view(t, heads, D)
    d_out = torch.randn(out.shape, generator=gen(seed + 1)).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out, grads, d_out, (q, k, v), cu


def _padded(t: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Packed [t, ...] -> [b, max_len, ...], zeros past each sequence."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    width = max(lengths)
    return torch.stack([torch.cat([t[int(cu[i]):int(cu[i]) + n], t.new_zeros((width - n,) + t.shape[1:])])
                        for i, n in enumerate(lengths)])


def _check_sbhd(out, grads, d_out, inputs, mask):
    to_bshd = [x.transpose(0, 1) for x in inputs]
    ref, lowp = reference_and_lowp(to_bshd, d_out.transpose(0, 1),
                                   lambda q, k, v, dtype: reference(q, k, v, mask, dtype=dtype))
    for name, ours, r, lp in zip(("out", "dq", "dk", "dv"), [out] + list(grads), ref, lowp):
        assert_close_to_reference(name, ours.transpose(0, 1), r, lp)


def _check_thd(out, grads, d_out, inputs, cu, mask):
    lengths = (cu[1:] - cu[:-1]).tolist()
    padded = [_padded(x.detach(), cu) for x in inputs]
    ref, lowp = reference_and_lowp(padded, _padded(d_out, cu),
                                   lambda q, k, v, dtype: reference(q, k, v, mask, lens_q=lengths, lens_kv=lengths,
                                                                    dtype=dtype))
    for name, ours, r, lp in zip(("out", "dq", "dk", "dv"), [out] + list(grads), ref, lowp):
        assert_close_to_reference(name, _padded(ours, cu), r, lp)


def _dtype(backend: str) -> torch.dtype:
    return LOWP_DTYPES[0] if backend == "fused" else torch.float32


def _expect_backend(layer: _Layer, backend: str) -> None:
    assert layer.module.last_backend == {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}[backend]


# -- construction ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_megatron_constructs_the_layer(megatron_parallel_state, kind, heads):
    """Megatron's constructor reaches ours with its keywords: heads, GQA groups, kv_channels, sbhd, the
    mask type by its enum name, the default softmax scale, and (Megatron) its tensor-parallel group."""
    h, hk = heads
    layer = _Layer(kind, h, hk, "causal")
    dpa = layer.module
    assert (dpa.num_attention_heads, dpa.num_gqa_groups, dpa.kv_channels) == (h, hk, (D, D))
    assert (dpa.qkv_format, dpa.attn_mask_type, dpa.layer_number, dpa.attention_type) == ("sbhd", "causal", 1, "self")
    assert dpa.softmax_scale == D ** -0.5 and dpa.tp_size == 1 and dpa.softmax_offset is None
    if kind == "megatron":
        assert dpa.tp_group is parallel_state.get_tensor_model_parallel_group()


# -- numerics against the fp64 reference -------------------------------------------------------------------


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_sbhd_causal_with_megatrons_mask(megatron_parallel_state, monkeypatch, kind, backend, heads):
    """sbhd, attn_mask_type causal with the [b, 1, s, s] mask Megatron's GPT dataset passes: the mask type
    decides (as in TransformerEngine) and the result is causal attention, forward and gradients."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    layer = _Layer(kind, *heads, "causal")
    out, grads, d_out, inputs = _sbhd_case(layer, *heads, _dtype(backend), "causal")
    _expect_backend(layer, backend)
    _check_sbhd(out, grads, d_out, inputs, "causal")
    again, *_ = _sbhd_case(layer, *heads, _dtype(backend), "causal", with_megatron_mask=False)
    assert torch.equal(out, again)  # the mask changed nothing


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sbhd_no_mask(megatron_parallel_state, monkeypatch, kind, backend):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    layer = _Layer(kind, 4, 2, "no_mask")
    out, grads, d_out, inputs = _sbhd_case(layer, 4, 2, _dtype(backend), "no_mask", seed=5, with_megatron_mask=False)
    _expect_backend(layer, backend)
    _check_sbhd(out, grads, d_out, inputs, "no_mask")


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_thd_packed_sequences(megatron_parallel_state, monkeypatch, kind, backend, heads, mask):
    """Packed thd through PackedSeqParams (cu_seqlens, max_seqlen): Megatron turns causal/no_mask into
    padding_causal/padding; each sequence attends only within itself, a one-token sequence included."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    layer = _Layer(kind, *heads, mask)
    out, grads, d_out, inputs, cu = _thd_case(layer, *heads, _dtype(backend), mask, seed=11)
    _expect_backend(layer, backend)
    _check_thd(out, grads, d_out, inputs, cu, mask)


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_sink_softmax_from_megatrons_config(megatron_parallel_state, monkeypatch, kind, backend, softmax_type):
    """TransformerConfig.softmax_type reaches our module: softmax_offset as TransformerEngine keeps it (a
    parameter for learnable, a plain zero tensor for off-by-one), the sink in every row's softmax, and the
    offset's gradient (off-by-one's once its requires_grad is set, as TransformerEngine's tests do)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dtype = _dtype(backend)
    layer = _Layer(kind, 4, 2, "causal", softmax_type=softmax_type)
    offset = layer.module.softmax_offset
    assert offset.shape == (4,) and offset.dtype == torch.float32
    assert isinstance(offset, torch.nn.Parameter) == (softmax_type == "learnable")
    if softmax_type == "learnable":
        with torch.no_grad():
            offset.copy_(torch.randn(4, generator=gen(37)))
    else:
        offset.requires_grad = True
    out, grads, d_out, inputs = _sbhd_case(layer, 4, 2, dtype, "causal", seed=35)
    _expect_backend(layer, backend)
    assert offset.grad is not None and offset.grad.abs().sum() > 0
    results = []
    for ref_dtype in (torch.float64, dtype):
        leaves = [t.detach().to(ref_dtype).requires_grad_() for t in inputs + (offset,)]
        q, k, v, sink = leaves
        k, v = (t.repeat_interleave(2, dim=2) for t in (k, v))
        s = torch.einsum("sbhd,tbhd->bhst", q, k) * D ** -0.5
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
        s = torch.cat([s, sink.view(1, 4, 1, 1).expand(B, 4, S, 1)], dim=-1)
        ref = torch.einsum("bhst,tbhd->sbhd", torch.softmax(s, dim=-1)[..., :-1], v)
        results.append([ref] + list(torch.autograd.grad(ref, leaves, d_out.to(ref_dtype))))
    names = ("out", "dq", "dk", "dv", "d_softmax_offset")
    for name, ours, r, lp in zip(names, [out] + list(grads) + [offset.grad], *results):
        assert_close_to_reference(name, ours, r, lp)


# -- determinism ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_deterministic_mode_is_bitwise_over_repeats(megatron_parallel_state, monkeypatch, kind, backend, fmt):
    """Megatron's deterministic_mode (which requires NVTE_ALLOW_NONDETERMINISTIC_ALGO=0): the calls are built
    in deterministic mode, and repeated forward + backward passes give the same bits (GQA)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    spy = SelectionSpy(monkeypatch)
    layer = _Layer(kind, 4, 2, "causal", deterministic=True)
    runs = []
    for _ in range(3):
        if fmt == "sbhd":
            out, grads, *_ = _sbhd_case(layer, 4, 2, _dtype(backend), "causal", seed=17)
        else:
            out, grads, *_ = _thd_case(layer, 4, 2, _dtype(backend), "causal", seed=17)
        runs.append([out] + list(grads))
    _expect_backend(layer, backend)
    assert spy.configs and all(c.deterministic for c in spy.configs)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)


@requires_megatron
def test_megatron_deterministic_mode_needs_the_variable(megatron_parallel_state):
    """Megatron's own check, before our constructor runs: deterministic_mode without
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 is refused."""
    with pytest.raises(RuntimeError, match="NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        _Layer("megatron", 4, 2, "causal", deterministic=True)


# -- GPU: bf16 on the fused kernels ---------------------------------------------------------------------


@requires_gpu
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_gpu_bf16_fused(megatron_parallel_state, monkeypatch, kind, heads, fmt):
    """bf16 on our fused kernels (forced), against the fp64 reference with bf16's own error, then bitwise
    over repeats in deterministic mode."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    layer = _Layer(kind, *heads, "causal", deterministic=True)
    runs = []
    for _ in range(3):
        if fmt == "sbhd":
            out, grads, d_out, inputs = _sbhd_case(layer, *heads, torch.bfloat16, "causal", seed=29)
        else:
            out, grads, d_out, inputs, cu = _thd_case(layer, *heads, torch.bfloat16, "causal", seed=29)
        runs.append([out] + list(grads))
    _expect_backend(layer, "fused")
    if fmt == "sbhd":
        _check_sbhd(out, grads, d_out, inputs, "causal")
    else:
        _check_thd(out, grads, d_out, inputs, cu, "causal")
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)
