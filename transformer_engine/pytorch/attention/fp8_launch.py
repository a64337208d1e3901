"""The launches of FP8 attention (kernels/fp8.py): what the custom ops ``transformer_engine::fp8_attn_fwd`` /
``fp8_attn_bwd`` (ops.py) run.

The launches come from ``launch_description.fp8_forward_launches`` / ``fp8_backward_launches`` and run through
the bf16 path's kernel runner and launch cache, kept per call signature. A leaf below ops.py: the autograd
Function and the module glue (fp8_attention.py) call the ops, the ops call these.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from transformer_engine.common.attention import launch_description
from transformer_engine.common.attention.fp8 import Fp8Plan, fp8_plan
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import AttnCall
from transformer_engine.pytorch.attention.config import triton_interpreting
from transformer_engine.pytorch.attention.kernel_runner import sequences
from transformer_engine.pytorch.attention.signature_cache import SignatureCache, environment_signature, tensor_signature

__all__ = ["fp8_arch", "descale_strides", "fp8_forward_impl", "fp8_backward_impl"]


def fp8_arch(device: torch.device) -> str:
    """The plan's architecture name for tensors on ``device``."""
    if device.type == "cpu":
        if not triton_interpreting():
            raise NotImplementedError("FP8 attention on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1), "
                                      f"got device {device}")
        return "interpreter"
    if device.type != "cuda":
        raise NotImplementedError(f"FP8 attention runs on CUDA/ROCm or under TRITON_INTERPRET=1, got device {device}")
    if torch.version.hip is not None:
        return getattr(torch.cuda.get_device_properties(device), "gcnArchName", "gfx").split(":")[0]
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise NotImplementedError(f"FP8 attention needs FP8 tensor cores (sm_89 or newer), got sm_{major}{minor}")
    return f"sm{major}{minor}"


def descale_strides(descale: torch.Tensor, batch: int, hk: int) -> Tuple[torch.Tensor, dict]:
    """``descale`` as the kernels read it: fp32 [4] (one scale per tensor: batch and head strides 0) or
    [batch, h_kv, 4] (one per sequence and kv head)."""
    if descale.dim() == 1:
        return descale, dict(stride_db=0, stride_dh=0)
    if tuple(descale.shape) != (batch, hk, 4):
        raise ValueError(f"`descale` must be fp32 [4] or [batch, h_kv, 4] = [{batch}, {hk}, 4], got "
                         f"{tuple(descale.shape)}")
    descale = descale.contiguous()
    return descale, dict(stride_db=descale.stride(0), stride_dh=descale.stride(1))


def _plan(q: torch.Tensor, v: torch.Tensor) -> Fp8Plan:
    return fp8_plan(q.shape[-1], v.shape[-1], fp8_arch(q.device))


_FP8_FORWARDS = SignatureCache("fp8_attention.forward")
_FP8_BACKWARDS = SignatureCache("fp8_attention.backward")


def _launches(cache, name: str, describe_launches, tensors: dict, descale: torch.Tensor, call: AttnCall, seqs,
              lse: torch.Tensor, plan: Fp8Plan):
    """The prepared launches (launch_cache) of an FP8 pass, from its launch description, kept per call signature
    as the bf16 kernel runner keeps its own."""
    key = (name, environment_signature(), tensor_signature(descale), tensor_signature(lse)) + tuple(
        tensor_signature(t) for t in tensors.values()) + kernel_runner._call_signature(call)
    entry = cache.get(key)
    if entry is None:
        descale, dstrides = descale_strides(descale, seqs.batch, tensors["k"].shape[-2])
        described = dataclasses.replace(
            kernel_runner.describe(tensors["q"], tensors["k"], tensors["v"], call, seqs, tensors,
                                   (lse.stride(0), lse.stride(1))),
            descale_strides=(dstrides["stride_db"], dstrides["stride_dh"]))
        entry = kernel_runner._prepare(describe_launches(described, plan))
        cache.put(key, entry)
    return entry


def fp8_forward_impl(q8, k8, v8, descale: torch.Tensor, call: AttnCall,
                     out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, fwd_amax fp32 [3]) of :func:`fp8_attn_forward`: what the custom op
    ``transformer_engine::fp8_attn_fwd`` (ops.py) runs."""
    plan = _plan(q8, v8)
    seqs = sequences(q8, k8, call)
    hq = q8.shape[-2]
    out = torch.zeros(tuple(q8.shape[:-1]) + (v8.shape[-1],), dtype=out_dtype, device=q8.device)
    lse = torch.empty((seqs.batch, hq, seqs.max_q), dtype=torch.float32, device=q8.device)
    fwd_amax = torch.zeros(3, dtype=torch.float32, device=q8.device)
    descale = descale_strides(descale, seqs.batch, k8.shape[-2])[0]
    tensors = dict(q=q8, k=k8, v=v8, out=out)
    launches = _launches(_FP8_FORWARDS, "fp8_forward", launch_description.fp8_forward_launches, tensors, descale,
                         call, seqs, lse, plan)
    kernel_runner._run(launches, dict(tensors, lse=lse, fwd_amax=fwd_amax, descale=descale,
                                      **kernel_runner._sequence_buffers(seqs)))
    return out, lse, fwd_amax


def fp8_backward_impl(q8, k8, v8, out, do8, lse, descale: torch.Tensor, call: AttnCall,
                      grad_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, bwd_amax fp32 [3]) of :func:`fp8_attn_backward`: what the custom op
    ``transformer_engine::fp8_attn_bwd`` (ops.py) runs."""
    plan = _plan(q8, v8)
    seqs = sequences(q8, k8, call)
    dev = q8.device
    delta = torch.empty_like(lse)
    dq = torch.zeros(q8.shape, dtype=grad_dtype, device=dev)
    dk = torch.zeros(k8.shape, dtype=grad_dtype, device=dev)
    dv = torch.zeros(v8.shape, dtype=grad_dtype, device=dev)
    bwd_amax = torch.zeros(3, dtype=torch.float32, device=dev)
    descale = descale_strides(descale, seqs.batch, k8.shape[-2])[0]
    tensors = dict(q=q8, k=k8, v=v8, out=out, d_out=do8, dq=dq, dk=dk, dv=dv)
    launches = _launches(_FP8_BACKWARDS, "fp8_backward", launch_description.fp8_backward_launches, tensors, descale,
                         call, seqs, lse, plan)
    kernel_runner._run(launches, dict(tensors, lse=lse, delta=delta, bwd_amax=bwd_amax, descale=descale,
                                      **kernel_runner._sequence_buffers(seqs)))
    return dq, dk, dv, bwd_amax
