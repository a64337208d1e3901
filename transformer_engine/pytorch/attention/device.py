"""What planning and selection need to know about a PyTorch device: vendor and architecture.

ROCm builds of PyTorch present AMD GPUs as "cuda" devices and report a compute capability for them
(9.x on CDNA), which says nothing about the hardware: there the architecture is the device's gfx
target (``gcnArchName``) and the compute capability is left out.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from transformer_engine.common.attention.config import gfx_target

__all__ = ["device_facts"]


def device_facts(device: torch.device) -> Dict[str, Optional[object]]:
    """AttnConfig's ``vendor``, ``compute_capability`` and ``gfx_arch`` for tensors on ``device``."""
    if device.type != "cuda":
        return dict(vendor="nvidia", compute_capability=None, gfx_arch=None)
    if torch.version.hip is not None:
        name = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
        return dict(vendor="amd", compute_capability=None, gfx_arch=gfx_target(name) if name else None)
    return dict(vendor="nvidia", compute_capability=tuple(torch.cuda.get_device_capability(device)), gfx_arch=None)
