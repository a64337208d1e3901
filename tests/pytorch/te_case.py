"""One TransformerEngine test-table case through our DotProductAttention, judged against fp64.

Inputs are built the way TransformerEngine's attention tests build them for a (row, dtype,
qkv_layout, pad_between_seqs, swa) case (te_configs.py): random sequence lengths for padding masks
and thd, a bool ``attention_mask`` for padding masks, views into one packed buffer for packed
layouts, gaps between thd sequences, bias and ALiBi slopes of the row's shape. DotProductAttention
is called with TransformerEngine's constructor and forward arguments. The reference is plain math in
float64 (``_reference``); our error must stay within twice the same math's error in the case's dtype,
plus 1e-3 of the reference's largest magnitude and 1e-6 (1e-5 and 1e-9 in fp32), for the output,
every gradient and max_logit.

    python tests/pytorch/te_case.py --worker   (reads case names on stdin, one JSON result per line)
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
import zlib
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_configs  # noqa: E402

RESULT_PREFIX = "@@result "


def _window(mask: str, window, swa: bool):
    """The window the tests pass: (2, 2) for sliding-window cases, fitted to the mask kind."""
    if swa and tuple(window) == (-1, -1):
        window = (2, 2)
    window = tuple(window)
    if "causal" in mask:
        return (window[0], 0)
    if window == (-1, 0):
        return (-1, -1)
    return window


def _scaled(row: te_configs.Row, scale_down: bool) -> te_configs.Row:
    """A small copy of ``row`` for CPU runs under Triton's interpreter (same kinds, tiny sizes)."""
    if not scale_down:
        return row
    from dataclasses import replace

    group = row.num_heads // row.heads_kv
    heads_kv = 1 if group > 1 else 2
    dqk = 16 if row.head_dim_qk <= 64 else 32
    dv = dqk if row.dim_v == row.head_dim_qk else (16 if row.dim_v < row.head_dim_qk else 48)
    sq = 1 if row.max_seqlen_q == 1 else 13
    skv = sq if not row.is_cross else 21
    window = tuple(min(w, 3) if w > 0 else w for w in row.window_size)
    return replace(row, batch_size=min(row.batch_size, 2), max_seqlen_q=sq, max_seqlen_kv=skv,
                   num_heads=heads_kv * min(group, 2), num_gqa_groups=heads_kv, head_dim_qk=dqk, head_dim_v=dv,
                   window_size=window)


def build(case: te_configs.Case, device: str, scale_down: bool = False) -> Dict:
    """Everything one call needs: module arguments, forward arguments, q/k/v views and output gradient."""
    row = _scaled(case.row, scale_down)
    dtype = getattr(torch, case.dtype)
    if device == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float16  # the interpreter computes bf16 dots wrongly
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(case.name.encode()))
    b, sq, skv = row.batch_size, row.max_seqlen_q, row.seqlen_kv
    h, hg, dqk, dv = row.num_heads, row.heads_kv, row.head_dim_qk, row.dim_v
    layout = case.qkv_layout
    fmt = "".join(c for c in layout.split("_")[0] if c.isalpha())
    mask = row.attn_mask_type
    window = _window(mask, row.window_size, case.swa)
    if fmt == "thd" and "padding" not in mask:
        mask = "padding_" + mask if mask != "no_mask" else "padding"

    def lengths(max_len: int) -> torch.Tensor:
        if max_len <= 1:
            return torch.ones(b, dtype=torch.int32)
        return torch.randint(1, max_len, (b,), generator=gen, dtype=torch.int32)

    if "padding" in mask:
        lens_q = lengths(sq)
        lens_kv = lens_q if not row.is_cross else lengths(skv)
    else:
        lens_q = torch.full((b,), sq, dtype=torch.int32)
        lens_kv = torch.full((b,), skv, dtype=torch.int32)

    def cu(lens):
        return torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))

    pad = torch.randint(0, 4, (b,), generator=gen, dtype=torch.int32) if case.pad_between_seqs \
        else torch.zeros(b, dtype=torch.int32)
    cu_q, cu_kv = cu(lens_q), cu(lens_kv)
    cu_q_pad, cu_kv_pad = cu(lens_q + pad), cu(lens_kv + pad)

    attention_mask = None
    if "padding" in mask:
        def pad_mask(lens, max_len):
            return (torch.arange(max_len)[None, :] >= lens[:, None]).view(b, 1, 1, max_len).to(device)
        attention_mask = pad_mask(lens_q, sq) if not row.is_cross else (pad_mask(lens_q, sq), pad_mask(lens_kv, skv))

    dims = {"b": b, "sq": sq, "skv": skv, "h": h, "hg": hg, "dqk": dqk, "dv": dv,
            "t": int(cu_q_pad[-1]), "tg": int(cu_kv_pad[-1]), "3": 3, "2": 2}
    tensors: List[torch.Tensor] = []
    for i, part in enumerate(layout.split("_")):
        names = []
        for c in part:
            if c == "s":
                names.append("sq" if i == 0 else "skv")
            elif c == "t":
                names.append("t" if i == 0 else "tg")
            elif c == "h":
                names.append("h" if i == 0 else "hg")
            elif c == "d":
                names.append("dv" if i == 2 else "dqk")
            else:
                names.append(c)
        buf = 0.1 * torch.randn([dims[n] for n in names], generator=gen)
        if fmt == "thd" and case.pad_between_seqs:  # the gap rows hold zeros, as the tests write
            ends = cu_q_pad if i == 0 else cu_kv_pad
            for n in range(b):
                buf[int(ends[n + 1]) - int(pad[n]):int(ends[n + 1])] = 0.0
        buf = buf.to(device, dtype).requires_grad_()
        split = next((j for j, n in enumerate(names) if n.isdigit()), None)
        tensors.extend(buf.unbind(split) if split is not None else [buf])

    out_shape = {"bshd": (b, sq, h * dv), "sbhd": (sq, b, h * dv), "thd": (dims["t"], h * dv)}[fmt]
    d_out = (0.001 * torch.randint(0, 200, out_shape, generator=gen)).to(device, dtype)
    if fmt == "thd" and case.pad_between_seqs:
        for n in range(b):
            d_out[int(cu_q_pad[n + 1]) - int(pad[n]):int(cu_q_pad[n + 1])] = 0.0

    bias = alibi_slopes = None
    if row.attn_bias_type == "post_scale_bias":
        shape = {"1": 1, "b": b, "h": h}
        dims_bias = [shape[c] for c in row.bias_shape[:2]]
        dims_bias += [1, skv] if row.bias_shape == "111s" else [sq, skv]
        bias = torch.randn(dims_bias, generator=gen).to(device, dtype).requires_grad_()
    if row.attn_bias_type == "alibi" and row.alibi_type == "custom":
        shape = (h,) if row.bias_shape == "1hss" else (b, h)
        alibi_slopes = torch.randn(shape, generator=gen).abs().to(device, torch.float32)

    module = dict(num_attention_heads=h, kv_channels=(dqk, dv), num_gqa_groups=hg,
                  attention_dropout=row.dropout_p, qkv_format=fmt, attn_mask_type=mask, sequence_parallel=False,
                  tp_size=1, tp_group=None, layer_number=1, attention_type="cross" if row.is_cross else "self")
    if row.softmax_type != "vanilla":
        module["softmax_type"] = row.softmax_type
    if row.return_max_logit:
        module["return_max_logit"] = True
    forward = dict(window_size=window, attention_mask=attention_mask, qkv_format=fmt, max_seqlen_q=sq,
                   max_seqlen_kv=skv, cu_seqlens_q=cu_q.to(device), cu_seqlens_kv=cu_kv.to(device),
                   cu_seqlens_q_padded=cu_q_pad.to(device), cu_seqlens_kv_padded=cu_kv_pad.to(device),
                   attn_mask_type=mask, checkpoint_core_attention=False,
                   core_attention_bias_type=row.attn_bias_type, core_attention_bias=bias, alibi_slopes=alibi_slopes,
                   fast_zero_fill=True, pad_between_seqs=case.pad_between_seqs)
    if row.num_splits != 1:
        forward["num_splits"] = 1  # what the tests pass to the non-flash backends
    starts_q = cu_q_pad[:-1] if fmt == "thd" else torch.zeros(b, dtype=torch.int32)
    starts_kv = cu_kv_pad[:-1] if fmt == "thd" else torch.zeros(b, dtype=torch.int32)
    return dict(module=module, forward=forward, tensors=tensors, d_out=d_out, bias=bias, fmt=fmt,
                lens_q=lens_q, lens_kv=lens_kv, starts_q=starts_q, starts_kv=starts_kv)


def _attend(inputs: Dict):
    """(outputs by name, backend that ran, module) of one forward and backward pass through our
    DotProductAttention, as the tests call it."""
    from transformer_engine.pytorch import DotProductAttention

    q, k, v = inputs["tensors"]
    fwd = dict(inputs["forward"])
    bias = inputs["bias"]
    module = DotProductAttention(**inputs["module"]).to(device=q.device, dtype=q.dtype)
    if module.softmax_type != "vanilla":  # as TransformerEngine's test does, off-by-one's zero offset included
        module.softmax_offset.requires_grad = True
    out = module(q, k, v, **fwd)
    max_logit = None
    if isinstance(out, tuple):
        out, max_logit = out
    wanted = [q, k, v] + ([bias] if bias is not None else [])
    offset = getattr(module, "softmax_offset", None)
    learnable = isinstance(offset, torch.Tensor) and offset.requires_grad
    if learnable:
        wanted.append(offset)
    grads = torch.autograd.grad(out, wanted, inputs["d_out"])
    result = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if bias is not None:
        result["dbias"] = grads[3]
    if learnable:
        result["d_softmax_offset"] = grads[-1]
    if max_logit is not None:
        result["max_logit"] = max_logit
    return result, module.last_backend, module


def _reference(inputs: Dict, module, q, k, v, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The call's outputs and gradients from plain fp math in ``dtype``, one sequence at a time.

    TransformerEngine's semantics stated directly: query i of a sequence sees key j when
    ``i + diag - left <= j <= i + diag + right`` (diag = 0 for causal/padding_causal, len_kv - len_q
    otherwise, also for windows and ALiBi), scores ``scale * q.k + bias - slope * |j - i - diag|``,
    an extra sink logit (0 for off-by-one, softmax_offset[h] for learnable) in each row's softmax,
    rows that see no key and positions outside every sequence zero. max_logit: the largest visible
    score of each head.
    """
    from dpa_helpers import visible

    fmt, mask, window = inputs["fmt"], inputs["forward"]["attn_mask_type"], inputs["forward"]["window_size"]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qf, kf, vf = leaves
    bias = inputs["bias"]
    if bias is not None:
        bias = bias.detach().to(dtype).requires_grad_()
        leaves.append(bias)
    softmax_type = getattr(module, "softmax_type", "vanilla")
    offset = getattr(module, "softmax_offset", None)
    if isinstance(offset, torch.Tensor):
        offset = offset.detach().to(dtype).reshape(-1).requires_grad_()
        leaves.append(offset)
    slopes = inputs["forward"]["alibi_slopes"]
    if inputs["forward"]["core_attention_bias_type"] == "alibi" and slopes is None:
        from transformer_engine.pytorch.attention.unfused import default_alibi_slopes

        slopes = default_alibi_slopes(q.shape[-2], q.device)
    scale = module.softmax_scale
    h, hk = q.shape[-2], k.shape[-2]

    def rows(t, n, start, length):
        if fmt == "thd":
            return t[start:start + length]
        return t[n, :length] if fmt == "bshd" else t[:length, n]

    outs = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=dtype, device=q.device)
    max_logit = torch.full((h,), float("-inf"), dtype=dtype, device=q.device)
    for n in range(len(inputs["lens_q"])):
        lq, lk = int(inputs["lens_q"][n]), int(inputs["lens_kv"][n])
        sq0, sk0 = int(inputs["starts_q"][n]), int(inputs["starts_kv"][n])
        qi = rows(qf, n, sq0, lq)
        ki = rows(kf, n, sk0, lk).repeat_interleave(h // hk, dim=1)
        vi = rows(vf, n, sk0, lk).repeat_interleave(h // hk, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        if bias is not None:
            s = s + bias[n if bias.shape[0] > 1 else 0][:, :lq, :lk]
        diag = 0 if mask in ("causal", "padding_causal") else lk - lq
        if slopes is not None:
            sl = (slopes[n] if slopes.dim() == 2 else slopes).to(dtype)
            rel = torch.arange(lk, device=q.device)[None, :] - torch.arange(lq, device=q.device)[:, None] - diag
            s = s - sl[:, None, None] * rel.abs().to(dtype)
        keep = visible(lq, lk, mask, window).to(q.device).expand(h, lq, lk)
        s = s.masked_fill(~keep, float("-inf"))
        if lq and lk:
            max_logit = torch.maximum(max_logit, s.detach().amax(dim=(1, 2)))
        if softmax_type != "vanilla":
            sink = torch.zeros(h, dtype=dtype, device=q.device) if offset is None else offset
            s = torch.cat([s, sink[:, None, None].expand(h, lq, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :lk]
        else:
            p = torch.softmax(s, dim=-1)
        p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros_like(p))
        o = torch.einsum("hqk,khd->qhd", p, vi)
        if fmt == "thd":
            outs[sq0:sq0 + lq] = o
        elif fmt == "bshd":
            outs[n, :lq] = o
        else:
            outs[:lq, n] = o
    out = outs.reshape(*outs.shape[:-2], -1)
    grads = torch.autograd.grad(out, leaves, inputs["d_out"].to(dtype), allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]
    result = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if bias is not None:
        result["dbias"] = grads[3]
    if isinstance(offset, torch.Tensor):
        result["d_softmax_offset"] = grads[-1]
    result["max_logit"] = max_logit
    return result


def _error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    if ours.numel() != ref.numel():
        return math.inf
    ours, ref = ours.detach().to(torch.float64), ref.detach().to(torch.float64).reshape(ours.shape)
    diff = (ours - ref).abs()
    if torch.isnan(diff).any():
        return math.inf
    return diff.max().item() if diff.numel() else 0.0


def run_case(case: te_configs.Case, device: str = "cuda", scale_down: bool = False) -> Dict:
    """{status: pass | fail | refused | error, backend, detail}, in deterministic mode; raises on CUDA
    errors (the process is then unusable: the caller records a crash)."""
    before = os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    try:
        return _run_case(case, device, scale_down)
    finally:
        if before is None:
            os.environ.pop("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
        else:
            os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = before


def _run_case(case: te_configs.Case, device: str, scale_down: bool) -> Dict:
    try:
        inputs = build(case, device, scale_down)
    except Exception as err:  # noqa: BLE001  (a driver bug: say so)
        return dict(status="error", backend=None, detail=f"building inputs: {type(err).__name__}: {err}")
    try:
        ours, backend, module = _attend(inputs)
    except NotImplementedError as err:
        return dict(status="refused", backend=None, detail=" ".join(str(err).split())[:400])
    except (ValueError, TypeError) as err:
        return dict(status="error", backend=None, detail=f"{type(err).__name__}: {' '.join(str(err).split())[:400]}")
    except RuntimeError as err:
        if "CUDA" in str(err) or "illegal" in str(err):
            raise
        return dict(status="error", backend=None, detail=f"RuntimeError: {' '.join(str(err).split())[:400]}")
    q, k, v = inputs["tensors"]
    ref = _reference(inputs, module, q, k, v, torch.float64)
    lowp = _reference(inputs, module, q, k, v, ours["out"].dtype)
    worst = []
    rel_floor = {torch.float32: 1e-5}.get(ours["out"].dtype, 1e-3)
    abs_floor = {torch.float32: 1e-9}.get(ours["out"].dtype, 1e-6)
    for name, value in ours.items():
        err, base = _error(value, ref[name]), _error(lowp[name], ref[name])
        # An exactly-zero reference (s_q = 1 under a top-left causal mask: one visible key, dQ = 0)
        # still leaves rounding noise: a tiny absolute floor next to the relative one.
        floor = rel_floor * (ref[name].detach().abs().max().item() if ref[name].numel() else 0.0) + abs_floor
        worst.append(f"{name} {err:.2e} (torch {base:.2e})")
        if not err <= 2 * base + floor:
            return dict(status="fail", backend=backend, detail="; ".join(worst))
    return dict(status="pass", backend=backend, detail="; ".join(worst))


def _cases_by_name() -> Dict[str, te_configs.Case]:
    return {c.name: c for c in te_configs.cases()}


def worker(device: str, scale_down: bool) -> None:
    """Run the cases named on stdin, one JSON result line each; exit after a CUDA error."""
    table = _cases_by_name()
    # For the runner's own tests: cases whose process dies without a word, as after a GPU fault.
    die_on = set(filter(None, os.environ.get("TE_TABLES_DIE_ON", "").split(",")))
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        if name in die_on:
            os._exit(7)
        try:
            result = run_case(table[name], device, scale_down)
        except torch.OutOfMemoryError as err:  # other workers held the memory: the runner retries alone
            torch.cuda.empty_cache()
            result = dict(status="oom", backend=None, detail=" ".join(str(err).split())[:200])
        except Exception as err:  # noqa: BLE001  (a CUDA error: this process's context is gone)
            result = dict(status="crashed", backend=None,
                          detail=f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
                          trace=traceback.format_exc()[-1500:])
            print(RESULT_PREFIX + json.dumps(dict(result, case=name)), flush=True)
            os._exit(3)
        print(RESULT_PREFIX + json.dumps(dict(result, case=name)), flush=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker("cuda" if torch.cuda.is_available() else "cpu", "--scale-down" in sys.argv)
