"""A one-pass backward with dQ accumulated in a fixed order, against the two-pass backward (NOTES.md 26).

The product's backward recomputes the scores in a separate dQ pass (7 matrix products per block pair
instead of 5) so that no floating-point atomics decide the order of dQ's sums. This prototype keeps the
one pass and makes the order fixed instead: each dK/dV program (one key block) adds its [BLOCK_M, d]
part of dQ into an fp32 accumulator with a TMA reduce-add (``tensor_descriptor.atomic_add``, which Triton
3.6 lowers to ``cp.reduce.async.bulk.tensor`` on sm_90), after waiting on a per-query-block semaphore
for its turn. Programs are dispatched highest key block first. Orders (ORDER):

- HIGHEST_FIRST: at query block i, the key blocks that visit it, highest first. Every wait is on a program
  that started earlier, so there is no deadlock when the grid does not fit on the GPU at once. Causal:
  program j starts at its diagonal block, which its order makes first: in the ideal nobody waits. No
  mask: every program starts at query block 0 and waits there for the programs above it (each lags one
  step per key block above it).
- ROTATED (no mask): program j starts at its diagonal block and wraps round; the order at a block is the
  order of arrival, so in the ideal nobody waits, but the waits are cyclic: every key block of a head must
  be resident at once (true at the timed shapes, not for long sequences).
- UNORDERED: no semaphores (what the order costs; not deterministic).

Scope: bshd contiguous, h_q = h_kv, s_q = s_kv divisible by BLOCK_N, BLOCK_N a multiple of BLOCK_M,
no mask or top-left causal, fp16/bf16, no bias, dropout or sink. On the GPU it checks the gradients
against an fp32 reference (small shapes) and against the product's backward, bitwise repeats in the
ordered modes, and times the product's backward (preprocess, dK/dV, dQ) against this one (preprocess,
zeroing, the one pass, dQ's conversion) and the one pass alone, in one run.

    python dev/tuning/ordered_dq.py                      # the GPU: checks, then times
    TRITON_INTERPRET=1 python dev/tuning/ordered_dq.py --interpret   # the CPU: order and sums only
    python dev/tuning/ordered_dq.py --compile            # the CPU: sm_90 registers, stack, shared memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _delta_kernel(O, DO, DELTA, seqlen, num_heads, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d O * dO (fp32), as the product's preprocess."""
    i0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // num_heads, bh % num_heads
    row = num_heads * HEAD_DIM
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = b.to(tl.int64) * seqlen * row + h * HEAD_DIM + offs_m[:, None] * row + offs_d[None, :]
    o = tl.load(O + ptrs).to(tl.float32)
    do = tl.load(DO + ptrs).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * seqlen + offs_m, tl.sum(o * do, axis=1))


UNORDERED, HIGHEST_FIRST, ROTATED = 0, 1, 2  # ORDER: how dQ's adds are ordered (module docstring)
ORDER_NAMES = {UNORDERED: "unordered", HIGHEST_FIRST: "highest-first", ROTATED: "rotated"}


def _orders(causal):
    """The orders worth timing: causal rotates nothing (each program starts at its diagonal already)."""
    return (HIGHEST_FIRST, UNORDERED) if causal else (HIGHEST_FIRST, ROTATED, UNORDERED)


@triton.jit
def _one_pass_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, SEM, seqlen, num_heads, total_rows, qk_scale, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     ORDER: tl.constexpr, TMA: tl.constexpr):
    nk = seqlen // BLOCK_N
    nq = seqlen // BLOCK_M
    R: tl.constexpr = BLOCK_N // BLOCK_M
    j = nk - 1 - tl.program_id(0)  # highest key block first: what a program waits on started earlier
    bh = tl.program_id(1)
    b, h = bh // num_heads, bh % num_heads
    row = num_heads * HEAD_DIM
    base = b.to(tl.int64) * seqlen * row + h * HEAD_DIM
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + base + offs_n[:, None] * row + offs_d[None, :])
    v = tl.load(V + base + offs_n[:, None] * row + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if TMA:
        desc = tl.make_tensor_descriptor(DQ_ACC, shape=[total_rows, row], strides=[row, 1],
                                         block_shape=[BLOCK_M, HEAD_DIM])
    # Causal: from the diagonal block on. No mask: every query block, from block 0 or (ROTATED) from the
    # diagonal block round to the one before it.
    first = j * R if (CAUSAL or ORDER == 2) else 0
    steps = nq - j * R if CAUSAL else nq
    for t in range(0, steps):
        i = first + t
        if ORDER == 2 and not CAUSAL:
            i = i % nq
        offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.load(Q + base + offs_m[:, None] * row + offs_d[None, :])
        do = tl.load(DO + base + offs_m[:, None] * row + offs_d[None, :])
        lse2 = tl.load(LSE + bh.to(tl.int64) * seqlen + offs_m) * LOG2E
        delta = tl.load(DELTA + bh.to(tl.int64) * seqlen + offs_m)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        dq_part = tl.dot(tl.trans(ds_t.to(k.dtype)), k)  # [BLOCK_M, HEAD_DIM], fp32
        sem = SEM + bh.to(tl.int64) * nq + i
        if ORDER != 0:
            # This program's place among the key blocks that add to query block i. HIGHEST_FIRST (and causal):
            # the visitors [0, jmax] highest first. ROTATED: by arrival, program j' reaching block i after
            # (i - j' R) mod nq steps, which orders them by (i // R - j') mod nk.
            if CAUSAL:
                turn = tl.minimum(nk - 1, i // R) - j
            elif ORDER == 1:
                turn = nk - 1 - j
            else:
                turn = (i // R - j + nk) % nk
            while tl.atomic_add(sem, 0, sem="acquire") != turn:
                pass
        if TMA:
            desc.atomic_add([b * seqlen + i * BLOCK_M, h * HEAD_DIM], dq_part)
        else:
            tl.atomic_add(DQ_ACC + base + offs_m[:, None] * row + offs_d[None, :], dq_part, sem="relaxed")
        if ORDER != 0:
            tl.atomic_add(sem, 1, sem="release")
    tl.store(DK + base + offs_n[:, None] * row + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + base + offs_n[:, None] * row + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _convert_kernel(ACC, DQ, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(DQ + offs, (tl.load(ACC + offs, mask=keep) * scale).to(DQ.dtype.element_ty), mask=keep)


def one_pass_backward(q, k, v, out, d_out, lse, causal, tiles, order=HIGHEST_FIRST, tma=True, parts=None):
    """(dq, dk, dv) over [b, s, h, d] contiguous tensors; ``lse`` [b, h, s] natural log (the product's).
    ``parts``: a dict that receives the buffers (to time the one pass alone)."""
    block_m, block_n, warps, stages = tiles
    b, s, h, d = q.shape
    scale = d ** -0.5
    delta = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    _delta_kernel[(s // block_m, b * h)](out, d_out, delta, s, h, HEAD_DIM=d, BLOCK_M=block_m)
    acc = torch.zeros((b, s, h, d), dtype=torch.float32, device=q.device)
    sem = torch.zeros((b * h, s // block_m), dtype=torch.int32, device=q.device)
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    args = (q, k, v, d_out, lse, delta, dk, dv, acc, sem, s, h, b * s, scale * 1.4426950408889634, scale)
    meta = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, ORDER=order, TMA=tma,
                num_warps=warps, num_stages=stages)
    _one_pass_kernel[(s // block_n, b * h)](*args, **meta)
    _convert_kernel[(triton.cdiv(acc.numel(), 1024),)](acc, dq, acc.numel(), scale, BLOCK=1024)
    if parts is not None:
        parts.update(kernel=_one_pass_kernel, args=args, meta=meta, grid=(s // block_n, b * h), acc=acc, sem=sem)
    return dq, dk, dv


def reference_grads(q, k, v, d_out, causal):
    """fp32 (fp64 on the CPU) autograd reference over [b, s, h, d]."""
    dt = torch.float64 if q.device.type == "cpu" else torch.float32
    qf, kf, vf = (t.detach().to(dt).requires_grad_(True) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), is_causal=causal).transpose(1, 2)
    out.backward(d_out.to(dt))
    return qf.grad, kf.grad, vf.grad


def _forward(q, k, v, causal):
    """out and lse [b, h, s] (natural log): the product's forward on the GPU, the reference on the CPU."""
    if q.is_cuda:
        from transformer_engine.pytorch.attention import kernel_runner
        from transformer_engine.pytorch.attention.call import fused_call

        return kernel_runner.forward(q, k, v, fused_call("bshd", "causal" if causal else "no_mask", None,
                                                         q.shape[-1] ** -0.5))
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    sc = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        sc = sc.masked_fill(torch.ones_like(sc[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(sc, -1)
    out = (torch.softmax(sc, -1) @ vf).transpose(1, 2).to(q.dtype).contiguous()
    return out, lse.float().contiguous()


def _errors(grads, refs):
    return [float((g.double() - r.double()).abs().max()) for g, r in zip(grads, refs)]


def _visits(order, causal, j, nq, R):
    """The query blocks program j visits, in its order (the kernel's loop)."""
    if causal:
        return list(range(j * R, nq))
    first = j * R if order == ROTATED else 0
    return [(first + t) % nq for t in range(nq)]


def _turn(order, causal, i, j, nk, R):
    """Program j's place among the adds to query block i (the kernel's)."""
    if causal:
        return min(nk - 1, i // R) - j
    return nk - 1 - j if order == HIGHEST_FIRST else (i // R - j + nk) % nk


def simulate(order, causal, nk, R, slots) -> str:
    """Run the programs of one head as the GPU would: ``slots`` resident at once, dispatched highest key block
    first, each taking one step per tick when its block's semaphore shows its turn. Returns "ok" when all
    finish with every block's adds in turn order 0, 1, ..., "deadlock" when none can move, else what broke;
    with "ok", the share of resident program-ticks spent waiting."""
    nq = nk * R
    pending = list(range(nk - 1, -1, -1))  # dispatch order
    running = {}
    sem = [0] * nq
    expected = [sorted(j for j in range(nk) if i in _visits(order, causal, j, nq, R)) for i in range(nq)]
    turns = [sorted(_turn(order, causal, i, j, nk, R) for j in expected[i]) for i in range(nq)]
    if any(t != list(range(len(t))) for t in turns):
        return "turns are not 0, 1, ... at every block"
    waiting = busy = 0
    while pending or running:
        while pending and len(running) < slots:
            j = pending.pop(0)
            running[j] = _visits(order, causal, j, nq, R)
        moved = False
        seen = list(sem)  # a tick's steps all see the semaphores as the tick began
        for j in list(running):
            i = running[j][0]
            busy += 1
            if seen[i] != _turn(order, causal, i, j, nk, R):
                waiting += 1
            else:
                sem[i] += 1
                running[j].pop(0)
                moved = True
                if not running[j]:
                    del running[j]
        if not moved:
            return "deadlock"
    if any(sem[i] != len(expected[i]) for i in range(nq)):
        return "missing adds"
    return f"ok, {waiting / busy:.0%} of resident ticks waiting"


def check_cpu() -> int:
    """The orders' schedules (:func:`simulate`), then the kernel under the interpreter (pointer atomics in
    place of TMA; programs one at a time, so the rotated order, which needs its programs resident together,
    runs in the simulation only): sums against fp64, and the bits over repeats. Returns the failures."""
    failures = 0
    for order, causal, slots, want in ((HIGHEST_FIRST, False, 3, "ok"), (HIGHEST_FIRST, False, 8, "ok"),
                                       (HIGHEST_FIRST, True, 3, "ok"), (HIGHEST_FIRST, True, 8, "ok"),
                                       (ROTATED, False, 8, "ok"), (ROTATED, False, 3, "deadlock")):
        for R in (1, 2, 4):
            got = simulate(order, causal, 8, R, slots)
            ok = got.split(",")[0] == want
            failures += not ok
            print(f"schedule {ORDER_NAMES[order]} causal={causal} 8 key blocks R={R} {slots} resident: {got} "
                  f"({'as expected' if ok else 'FAILED: expected ' + want})")
    for causal, order in ((False, HIGHEST_FIRST), (True, HIGHEST_FIRST)):
        for tiles in ((16, 32, 1, 1), (16, 16, 1, 1)):
            torch.manual_seed(0)
            b, s, h, d = 2, 64, 2, 16
            q, k, v, d_out = (torch.randn(b, s, h, d, dtype=torch.float16) for _ in range(4))
            out, lse = _forward(q, k, v, causal)
            refs = reference_grads(q, k, v, d_out, causal)
            grads = one_pass_backward(q, k, v, out, d_out, lse, causal, tiles, order, tma=False)
            errs = _errors(grads, refs)
            again = one_pass_backward(q, k, v, out, d_out, lse, causal, tiles, order, tma=False)
            same = all(torch.equal(a, c) for a, c in zip(grads, again))
            ok = max(errs) < 2e-2 and same
            failures += not ok
            print(f"cpu causal={causal} order={ORDER_NAMES[order]} tiles={tiles}: max errors dq/dk/dv {errs}, repeat bitwise {same}: "
                  f"{'ok' if ok else 'FAILED'}")
    return failures


def compare_on_gpu(script, check_dims, cases, masks, variants_of, out_path):
    """The GPU runs of the one-pass prototypes. Per mask and head dim in ``check_dims``: every variant's errors
    against fp32 autograd (2x1024x4xd) beside the product's, and whether a repeat gives the same bits. Per case
    (b, h, s, d) and mask: the product's backward time against each variant's, whole and its one pass alone.
    ``variants_of(d, causal)``: {name: run(q, k, v, out, d_out, lse, causal, parts=None) -> (dq, dk, dv)}, where
    ``parts`` receives the pass's launch and buffers (kernel, grid, args, meta, acc, sem). A variant that fails
    is recorded and the rest go on; each row is printed as it completes (a hang keeps the earlier rows)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "attention"))
    from common import bench_ms, run_metadata
    from transformer_engine.pytorch.attention import kernel_runner
    from transformer_engine.pytorch.attention.call import fused_call

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

    def inputs(b, h, s, d, causal):
        torch.manual_seed(0)
        q, k, v, d_out = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = _forward(q, k, v, causal)
        call = fused_call("bshd", "causal" if causal else "no_mask", None, d ** -0.5)
        product = lambda: kernel_runner.backward(q, k, v, out, d_out, lse, call)[:3]  # noqa: E731
        return (q, k, v, out, d_out, lse), product

    rows = []
    for causal in masks:
        for d in check_dims:
            tensors, product = inputs(2, 4, 1024, d, causal)
            refs = reference_grads(*tensors[:3], tensors[4], causal)
            row = dict(kind="check", d=d, causal=causal, product_errors=_errors(product(), refs))
            for name, run in variants_of(d, causal).items():
                try:
                    grads, again = run(*tensors, causal), run(*tensors, causal)
                    torch.cuda.synchronize()
                    row[name] = dict(errors=_errors(grads, refs),
                                     repeat_bitwise=all(torch.equal(a, c) for a, c in zip(grads, again)))
                except Exception as err:  # a variant that does not compile or fit
                    row[name] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    for (b, h, s, d) in cases:
        for causal in masks:
            tensors, product = inputs(b, h, s, d, causal)
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            ref = [g.float() for g in product()]
            ms = bench_ms(product)
            row = dict(kind="time", case=f"{b}x{h}x{s}x{d}", causal=causal, product_ms=ms,
                       product_tflops=flops / ms * 1e-9)
            for name, run in variants_of(d, causal).items():
                try:
                    parts = {}
                    grads = run(*tensors, causal, parts=parts)
                    torch.cuda.synchronize()
                    err = max(float((g.float() - r).abs().max() / r.abs().max()) for g, r in zip(grads, ref))
                    t_all = bench_ms(lambda: run(*tensors, causal))  # noqa: B023 (called at once)

                    def one_pass_alone():
                        parts["acc"].zero_()
                        parts["sem"].zero_()
                        parts["kernel"][parts["grid"]](*parts["args"], **parts["meta"])

                    row[name] = dict(ms=t_all, ratio_vs_product=ms / t_all,
                                     one_pass_and_zeroing_ms=bench_ms(one_pass_alone), rel_err_vs_product=err)
                except Exception as err:
                    row[name] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = run_metadata(script, torch.cuda.get_device_name())
    if out_path:
        with open(out_path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


def run_gpu(out_path):
    def variants_of(d, causal):
        return {f"{tiles} {ORDER_NAMES[order]}":
                (lambda *a, parts=None, t=tiles, o=order: one_pass_backward(*a, t, o, parts=parts))
                for tiles in TILES_BY_D[d] for order in _orders(causal)}

    compare_on_gpu("python dev/tuning/ordered_dq.py", list(TILES_BY_D), [(8, 32, 2048, 64), (4, 16, 4096, 128)],
                   (False, True), variants_of, out_path)


# (BLOCK_M, BLOCK_N, warps, stages); the d=128 ones without stack or with the least (--compile).
TILES_BY_D = {64: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2)],
              128: [(32, 128, 8, 2), (64, 64, 8, 2)]}


def _sass_has(cubin: bytes, opcode: str) -> bool:
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return opcode in subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def compile_sm90() -> None:
    """Each timed tile compiled for sm_90 on this machine (no GPU): registers, stack (spills), shared memory."""
    from transformer_engine.common.attention.kernels.aot import Pointer, compile_kernel
    from transformer_engine.common.attention.kernels.resources import resources, target

    ptr = {name: Pointer(dt) for name, dt in (("Q", "bfloat16"), ("K", "bfloat16"), ("V", "bfloat16"),
                                              ("DO", "bfloat16"), ("LSE", "float32"), ("DELTA", "float32"),
                                              ("DK", "bfloat16"), ("DV", "bfloat16"), ("DQ_ACC", "float32"),
                                              ("SEM", "int32"))}
    for d, tile_list in TILES_BY_D.items():
        for block_m, block_n, warps, stages in tile_list:
            for causal in (False, True):
                args = dict(ptr, seqlen=4096, num_heads=16, total_rows=4 * 4096, qk_scale=0.1, sm_scale=0.1,
                            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, ORDER=ROTATED, TMA=True)
                try:
                    kernel = compile_kernel(_one_pass_kernel, args, dict(num_warps=warps, num_stages=stages),
                                            target("sm90"))
                    report = resources(kernel)
                    report["tma_reduce_in_sass"] = _sass_has(kernel.cubin, "UTMAREDG")
                except Exception as err:
                    report = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                print(f"d={d} tiles={(block_m, block_n, warps, stages)} causal={causal}: {report}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interpret", action="store_true", help="the CPU check under TRITON_INTERPRET=1")
    ap.add_argument("--compile", action="store_true", help="compile the tiles for sm_90 here (no GPU needed)")
    ap.add_argument("--out", default=None, help="JSON of the GPU rows")
    args = ap.parse_args()
    if args.compile:
        return compile_sm90()
    if args.interpret:
        sys.exit(1 if check_cpu() else 0)
    run_gpu(args.out)


if __name__ == "__main__":
    main()
