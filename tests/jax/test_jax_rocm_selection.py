"""JAX on ROCm: device facts come from the gfx target JAX reports as ``compute_capability``, and fused_attn's
selection says why the fused backend cannot run there (its launcher loads CUDA cubins only) instead of
crashing or falling back without a reason. Selection only: on this CPU the calls would run jnp."""

import jax.numpy as jnp
import pytest

import transformer_engine.jax.attention as te_attention
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVFormat
from transformer_engine.jax.primitives import gpu
from transformer_engine.jax.primitives.attention import FusedAttnStatic


def _config():
    params = FusedAttnStatic(attn_mask_type=AttnMaskType.CAUSAL_MASK, attn_bias_type=AttnBiasType.NO_BIAS,
                             qkv_format=QKVFormat.BSHD, window_size=(-1, 0), scaling_factor=128 ** -0.5)
    return te_attention._make_config(
        batch_size=2, num_heads_q=4, num_heads_kv=4, head_dim_qk=128, head_dim_v=128, max_seqlen_q=256,
        max_seqlen_kv=256, dtype=jnp.bfloat16, params=params, bias_shape=None)


def test_rocm_device_facts_and_the_reason_fused_does_not_run(monkeypatch):
    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", "gfx942"))
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: None)  # as if the extension were built
    config = _config()
    assert (config.vendor, config.gfx_arch, config.compute_capability, config.arch) == ("amd", "gfx942", None,
                                                                                        "gfx942")
    selection = te_attention.select_attention_backend(config)
    assert selection.backend.SHORT_NAME == "unfused"
    reasons = selection.rejected[te_attention.FusedAttention.NAME]
    assert any("vendor=amd (ROCm)" in r and "CUDA cubins" in r for r in reasons), reasons


def test_cuda_device_facts_still_select_fused(monkeypatch):
    monkeypatch.setattr(te_attention, "_device_facts", lambda: ("cuda", (9, 0)))
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: None)
    config = _config()
    assert (config.vendor, config.compute_capability, config.arch) == ("nvidia", (9, 0), "sm90")
    assert te_attention.select_attention_backend(config).backend.SHORT_NAME == "fused"


class _Device:
    def __init__(self, platform, capability):
        self.platform, self.compute_capability = platform, capability


@pytest.mark.parametrize("platform,capability,want", [
    ("gpu", "gfx942:sramecc+:xnack-", ("cuda", "gfx942")), ("rocm", "gfx90a", ("cuda", "gfx90a")),
    ("gpu", "9.0", ("cuda", (9, 0))), ("cpu", None, ("cpu", None)),
])
def test_device_facts_read_the_gfx_target(monkeypatch, platform, capability, want):
    monkeypatch.setattr(te_attention.jax, "devices", lambda *a: [_Device(platform, capability)])
    assert te_attention._device_facts() == want


def test_cuda_lowering_says_why_not_on_rocm(monkeypatch):
    """The CUDA-only parts say what they support rather than failing on a gfx string."""
    monkeypatch.setattr(gpu.jax, "devices", lambda *a: [_Device("gpu", "gfx942")])
    with pytest.raises(NotImplementedError, match="ROCm GPU \\(gfx942\\).*CUDA cubins"):
        gpu._compute_capability()
    with pytest.raises(NotImplementedError, match="CUDA cubins"):
        gpu.rocm_lowering(None)
