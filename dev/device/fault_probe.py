"""Find which kernel faults: one case per process, each kernel launch synchronized and named.

    python dev/device/fault_probe.py CASE   (CASE: see CASES; prints OK or the failing launch)
"""
import sys

import torch
import triton

CASES = {
    # name: (b, sq, skv, h, d, mask, bias, dtype)
    "d256_sq1": (8, 1, 2048, 16, 256, "no_mask", False, torch.bfloat16),
    "d256_sq1_small": (1, 1, 128, 1, 256, "no_mask", False, torch.bfloat16),
    "d256_sq1_fp16": (8, 1, 2048, 16, 256, "no_mask", False, torch.float16),
    "d256_sq16": (2, 16, 512, 2, 256, "no_mask", False, torch.bfloat16),
    "d256_sq64": (2, 64, 512, 2, 256, "no_mask", False, torch.bfloat16),
    "d256_sq100": (2, 100, 512, 2, 256, "no_mask", False, torch.bfloat16),
    "d192_sq1": (8, 1, 2048, 16, 192, "no_mask", False, torch.bfloat16),
    "d128_sq1": (8, 1, 2048, 16, 128, "no_mask", False, torch.bfloat16),
    "d64_sq1": (8, 1, 2048, 16, 64, "no_mask", False, torch.bfloat16),
    "d256_causal_bias": (2, 2048, 2048, 24, 256, "causal", True, torch.bfloat16),
    "d256_causal_bias_small": (1, 256, 256, 2, 256, "causal", True, torch.bfloat16),
    "d256_bias_small": (1, 256, 256, 2, 256, "no_mask", True, torch.bfloat16),
    "d256_causal_small": (1, 256, 256, 2, 256, "causal", False, torch.bfloat16),
    "d128_causal_bias": (2, 2048, 2048, 24, 128, "causal", True, torch.bfloat16),
}

_current = ["?"]


def _wrap_kernels():
    """Synchronize after every Triton launch and remember the kernel's name."""
    orig = triton.runtime.jit.JITFunction.run

    def run(self, *args, **kwargs):
        _current[0] = self.fn.__name__
        out = orig(self, *args, **kwargs)
        torch.cuda.synchronize()
        return out

    triton.runtime.jit.JITFunction.run = run


def main(name):
    from transformer_engine.pytorch import DotProductAttention

    b, sq, skv, h, d, mask, bias, dtype = CASES[name]
    _wrap_kernels()
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, skv, h, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, skv, h, d, device="cuda", dtype=dtype, requires_grad=True)
    kw = {}
    if bias:
        kw = dict(core_attention_bias_type="post_scale_bias",
                  core_attention_bias=torch.randn(1, h, sq, skv, device="cuda", dtype=dtype))
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask).cuda()
    try:
        out = dpa(q, k, v, **kw)
        torch.cuda.synchronize()
        print(name, "forward ok via", dpa.last_backend, flush=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(name, "OK", flush=True)
    except Exception as e:  # noqa: BLE001
        print(name, "FAULT in", _current[0], type(e).__name__, str(e).splitlines()[0][:200], flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
