"""The backend registry (framework-free): identities, opt-in capabilities, ordering by data."""

from __future__ import annotations

import pytest

from transformer_engine.common.attention import AttnBiasType, AttnConfig, AttnMaskType, AttnSoftmaxType, QKVLayout
from transformer_engine.common.attention.backends import (
    BACKENDS,
    AttentionBackend,
    FlashAttention,
    FusedAttention,
    UnfusedDotProductAttention,
    backend_named,
    backends_for,
)
from transformer_engine.common.attention.policy import order_backends

CONFIG = AttnConfig.of(batch_size=2, num_heads_q=8, num_heads_kv=2, head_dim_qk=64, head_dim_v=32, max_seqlen_q=128,
                    max_seqlen_kv=128, dtype="float16", qkv_layout=QKVLayout.SBHD_SBHD_SBHD,
                    attn_mask_type=AttnMaskType.CAUSAL_MASK, window_size=(16, 0), attn_bias_type=AttnBiasType.ALIBI,
                    dropout_probability=0.1, softmax_type=AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, deterministic=True,
                    return_max_logit=True, device_type="cuda", compute_capability=(9, 0))


def test_identities_are_unique():
    for attr in ("NAME", "SHORT_NAME", "ENABLE_VAR", "PRIORITY"):
        values = [getattr(b, attr) for b in BACKENDS]
        assert len(set(values)) == len(values), (attr, values)
    assert [b.PRIORITY for b in BACKENDS] == sorted(b.PRIORITY for b in BACKENDS)


def test_backends_per_framework_and_by_name():
    assert backends_for("jax") == (FlashAttention, FusedAttention, UnfusedDotProductAttention)
    assert backends_for("pytorch") == (FlashAttention, FusedAttention, UnfusedDotProductAttention)
    assert backend_named("fused") is FusedAttention
    assert backend_named("FlashAttention") is FlashAttention
    with pytest.raises(ValueError, match="`backend` must be one of flash, fused, unfused, got 'cudnn'"):
        backend_named("cudnn")


def test_capabilities_are_opt_in():
    """A backend that declares nothing is refused everything, each with its reason: a new mask type,
    bias or layout is not silently claimed by a backend that never declared it."""
    reasons = AttentionBackend.not_supported_reasons(CONFIG)
    for expected in ("framework=pytorch", "device=cuda", "dtype=float16", "head_dim_qk=64 != head_dim_v=32",
                     "attn_mask_type=causal", "qkv_format=sbhd", "attn_bias_type=alibi", "dropout=0.1",
                     "softmax_type=off-by-one", "window_size=(16, 0)", "num_heads_q=8 != num_heads_kv=2",
                     "deterministic backward requested", "return_max_logit=True"):
        assert any(expected in r for r in reasons), (expected, reasons)

    class OnlyCausal(UnfusedDotProductAttention):
        SUPPORTED_MASKS = frozenset({AttnMaskType.CAUSAL_MASK})

    assert OnlyCausal.not_supported_reasons(CONFIG) == []
    padding = CONFIG.replace(attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK)
    assert OnlyCausal.not_supported_reasons(padding) == ["attn_mask_type=padding_causal"]


def test_max_logit_is_fused_and_unfused_not_flash():
    assert UnfusedDotProductAttention.not_supported_reasons(CONFIG) == []
    assert not any("return_max_logit" in r for r in FusedAttention.not_supported_reasons(CONFIG))
    assert "return_max_logit=True (the kernels do not return the row maxima)" in \
        FlashAttention.not_supported_reasons(CONFIG)


def test_order_reads_the_classes():
    """flash-attn-4 first where measured faster, after the fused kernels elsewhere on its GPUs."""
    def order(**fields):
        config = CONFIG.replace(**fields)
        return [b.SHORT_NAME for b in order_backends(list(reversed(BACKENDS)), config)]

    assert order(head_dim_qk=128, head_dim_v=128) == ["flash", "fused", "unfused"]
    assert order(head_dim_qk=96, head_dim_v=96) == ["fused", "flash", "unfused"]
    assert order(compute_capability=(10, 0), head_dim_qk=128, head_dim_v=128) == ["fused", "flash", "unfused"]
    assert order(compute_capability=(8, 0), head_dim_qk=96, head_dim_v=96) == ["flash", "fused", "unfused"]
    assert order(device_type="cpu", compute_capability=None) == ["flash", "fused", "unfused"]
    # d=256 on Hopper: flash-attn-4 first without determinism, our kernels first with it
    # (FlashAttention.MEASURED_FASTER_DETERMINISTIC leaves it out).
    assert order(head_dim_qk=256, head_dim_v=256, deterministic=False) == ["flash", "fused", "unfused"]
    assert order(head_dim_qk=256, head_dim_v=256, deterministic=True) == ["fused", "flash", "unfused"]
    for dims in ((64, 64), (128, 128), (192, 128)):
        assert order(head_dim_qk=dims[0], head_dim_v=dims[1], deterministic=True) == ["flash", "fused", "unfused"]
