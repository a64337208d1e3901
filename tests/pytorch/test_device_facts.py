"""PyTorch device facts for planning: ROCm builds present AMD GPUs as "cuda" devices with a compute
capability of 9.x; the facts take the vendor from torch.version.hip and the architecture from the
device's gcnArchName, so plans never treat a CDNA GPU as Hopper."""

import types

import torch

from transformer_engine.common.attention import AttnMaskType
from transformer_engine.common.attention.plan import ARCHS, forward_plan
from transformer_engine.pytorch.attention import device as device_mod
from transformer_engine.pytorch.attention import flash_backend


def test_rocm_device_is_amd_with_its_gfx_target(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 4))
    facts = device_mod.device_facts(torch.device("cuda", 0))
    assert facts == dict(vendor="amd", compute_capability=None, gfx_arch="gfx942")

    from transformer_engine.common.attention import AttnConfig
    cfg = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=128, head_dim_v=128, max_seqlen_q=64,
                     max_seqlen_kv=64, dtype="bfloat16", attn_mask_type=AttnMaskType.CAUSAL_MASK, device_type="cuda",
                     **facts)
    plan = forward_plan(cfg)
    assert plan.tiles == ARCHS["gfx942"].fwd[(128, True)] and plan.warp_specialized is None


def test_cuda_device_is_nvidia_with_its_capability(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    assert device_mod.device_facts(torch.device("cuda", 0)) == dict(vendor="nvidia", compute_capability=(8, 0),
                                                                    gfx_arch=None)
    assert device_mod.device_facts(torch.device("cpu"))["compute_capability"] is None


def test_flash_attn_says_rocm_is_not_its_platform(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert "ROCm" in flash_backend.unavailable_reason()
