"""Probe: where the KV-cache steps' rows differ from the training rows (alibi, fp32) on a GPU."""
import os, sys
from collections import OrderedDict
import torch
sys.path.insert(0, "tests/pytorch")
sys.path.insert(0, "tests")
from test_kv_cache import _sequences, _params, LAYER, DEVICE
from transformer_engine.pytorch import DotProductAttention
from te_torch_testing import recorded_launches
os.environ["NVTE_FLASH_ATTN"] = "0"


def flags(rec):
    out = []
    for launches in rec:
        for l in launches:
            a = {k: v for k, v in l.args.items() if k.isupper() and not hasattr(v, "name")}
            out.append((getattr(l.kernel, "__name__", str(l.kernel))[:40], a.get("BLOCK_M"), a.get("BLOCK_N"),
                        a.get("BOTTOM_RIGHT"), a.get("SINGLE_LOOP"), a.get("HAS_ALIBI")))
    return out


def diff(a, b):
    return (a != b).flatten(1).any(1).nonzero().flatten().tolist(), (a.float() - b.float()).abs().max().item()


def run(dtype, d, alibi, sizes, n=21, h=2):
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal", layer_number=LAYER).to(DEVICE).eval()
    q, k, v = _sequences([n], h, h, d, dtype, seed=3)[0]
    bias = dict(core_attention_bias_type="alibi") if alibi else {}
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    with recorded_launches() as rec:
        train = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, **bias)
    print(f"== {dtype} d={d} alibi={alibi} sizes={sizes}: train {dpa.last_backend} {flags(rec)}")
    br = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="padding_causal_bottom_right", **bias)
    print("   bottom-right training call vs top-left:", diff(br, train))
    params, pos = _params(h, d, dtype, paged=True), 0
    for size in sizes:
        params.pre_step(OrderedDict([(5, size)]))
        with recorded_launches() as rec:
            row = dpa(q[pos:pos + size], k[pos:pos + size], v[pos:pos + size], inference_params=params, **bias)
        print(f"   step {pos}+{size} {dpa.last_backend} {flags(rec)}: differing rows, max", diff(row, train[pos:pos + size]))
        pos += size


for dtype in (torch.float32, torch.float16):
    for alibi in (True, False):
        run(dtype, 16, alibi, (7, 7, 6, 1))
run(torch.float32, 16, True, (21,))
run(torch.float32, 64, True, (7, 7, 6, 1), n=100)
