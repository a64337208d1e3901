"""Triton kernels of the batch-invariant mode: a GEMM without split-K and the LayerNorm / RMSNorm rows.

Every program reduces in a fixed order set by its constexpr tiles (plan.py), and one output row is computed
by programs that see that row and the other operand only: a row's bits do not depend on how many rows there
are. Accumulation is float32.
"""

import triton
import triton.language as tl

from transformer_engine.common.attention.kernels.triton_compat import settle_cache_keys


@triton.jit
def bi_gemm_kernel(A, B, C, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``C = A @ B``: one program per (BLOCK_M, BLOCK_N) tile, K in BLOCK_K steps from 0 upwards."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(A + offs_m[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(B + k[:, None].to(tl.int64) * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # float32 stays float32 (no TF32)
    tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def bi_norm_fwd_kernel(X, W, Bias, Y, Mean, Rstd, R, H, stride_x, stride_y, eps,
                       IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """BLOCK_R rows, each reduced alone along the hidden dim (chunks of BLOCK_H from 0 upwards): the mean
    (LayerNorm) and 1/sqrt(variance + eps), then ``(x - mean) * rstd * w (+ b)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mean = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if not IS_RMS:
        total = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            mask = row_ok[:, None] & (h0 + offs[None, :] < H)
            total += tl.load(X + rows64[:, None] * stride_x + h0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(total, axis=1) / H
    sq = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask = row_ok[:, None] & (h0 + offs[None, :] < H)
        x = tl.load(X + rows64[:, None] * stride_x + h0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        sq += xc * xc
    rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / H + eps)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs
        mask = row_ok[:, None] & (cols[None, :] < H)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(Bias + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bi_norm_bwd_kernel(X, W, DY, DX, Mean, Rstd, R, H, stride_x, stride_dy, stride_dx,
                       IS_RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """BLOCK_R rows of the input gradient, each alone: ``rstd * (g - xhat * mean(g * xhat) - mean(g))`` with
    ``g = dy * w`` (the ``mean(g)`` term for LayerNorm only)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
    rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
    sum_gx = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    sum_g = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs
        mask = row_ok[:, None] & (cols[None, :] < H)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        g = tl.where(mask, dy * w[None, :], 0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        sum_gx += g * xhat
        sum_g += g
    c1 = tl.sum(sum_gx, axis=1) / H
    c2 = tl.sum(sum_g, axis=1) / H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs
        mask = row_ok[:, None] & (cols[None, :] < H)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        xhat = (x - mean[:, None]) * rstd[:, None]
        dx = dy * w[None, :] - xhat * c1[:, None]
        if not IS_RMS:
            dx -= c2[:, None]
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], (dx * rstd[:, None]).to(DX.dtype.element_ty),
                 mask=mask)


@triton.jit
def bi_col_sum_kernel(DY, X, Mean, Rstd, DW, DB, R, H, stride_dy, stride_x,
                      HAS_X: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Column sums over the rows, BLOCK_H columns per program: ``DB[h] = sum_r dy[r, h]`` and, with ``HAS_X``,
    a norm's ``DW[h] = sum_r dy[r, h] * xhat[r, h]`` (``xhat = (x - mean) * rstd``). Rows are read BLOCK_R at a
    time from row 0 into BLOCK_R float32 accumulators per column, summed at the end: the order is a function of
    the row count alone, the same in every framework that launches this kernel."""
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    offs = tl.arange(0, BLOCK_R)
    acc_w = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + offs
        row_ok = rows < R
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_b += dy
        if HAS_X:
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
            rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
            acc_w += tl.where(mask, dy * ((x - mean[:, None]) * rstd[:, None]), 0.0)
    tl.store(DB + cols, tl.sum(acc_b, axis=0).to(DB.dtype.element_ty), mask=col_ok)
    if HAS_X:
        tl.store(DW + cols, tl.sum(acc_w, axis=0).to(DW.dtype.element_ty), mask=col_ok)


@triton.jit
def bi_row_exp_sum_kernel(X, Shift, ExpSum, Sum, R, H, stride_x, WITH_SUM: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """BLOCK_R rows, each reduced alone over its H entries (chunks of BLOCK_H from 0 upwards), in float32:
    ``ExpSum[r] = sum_h exp(x[r, h] - Shift[r])`` and, with ``WITH_SUM``, ``Sum[r] = sum_h x[r, h]`` (a cross
    entropy's normalizer and a label-smoothing term over the vocabulary)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    shift = tl.load(Shift + rows, mask=row_ok, other=0.0)
    acc_e = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    acc_x = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask = row_ok[:, None] & (h0 + offs[None, :] < H)
        x = tl.load(X + rows64[:, None] * stride_x + h0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_e += tl.where(mask, tl.exp(x - shift[:, None]), 0.0)
        if WITH_SUM:
            acc_x += x
    tl.store(ExpSum + rows, tl.sum(acc_e, axis=1), mask=row_ok)
    if WITH_SUM:
        tl.store(Sum + rows, tl.sum(acc_x, axis=1), mask=row_ok)


@triton.jit
def _bi_sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _bi_gate(a, FN: tl.constexpr, alpha):
    """An activation's value and derivative at ``a`` (float32), written with exp and IEEE operations only so
    that every framework launching this kernel gets the same bits (torch's and XLA's own tanh / exp differ)."""
    if FN == "gelu":  # tanh approximation; tanh(u) = 1 - 2 / (exp(2u) + 1)
        inner = 0.79788456 + 0.03567741 * a * a
        t = 1.0 - 2.0 / (tl.exp(2.0 * (a * inner)) + 1.0)
        f = a * (0.5 + 0.5 * t)
        df = 0.5 + 0.5 * t + 0.5 * a * (1.0 - t * t) * (0.79788456 + 3.0 * 0.03567741 * a * a)
    elif FN == "qgelu":  # x * sigmoid(alpha x); silu is alpha = 1
        s = _bi_sigmoid(alpha * a)
        f = a * s
        df = s + alpha * a * s * (1.0 - s)
    elif FN == "sigmoid":
        f = _bi_sigmoid(a)
        df = f * (1.0 - f)
    elif FN == "relu":
        f = tl.where(a > 0, a, 0.0)
        df = tl.where(a > 0, 1.0, 0.0)
    else:  # "srelu"
        r = tl.where(a > 0, a, 0.0)
        f = r * r
        df = 2.0 * r
    return f, df


@triton.jit
def bi_act_fwd_kernel(X, Y, R, F, stride_x, stride_y, alpha, limit, offset, FN: tl.constexpr, GATED: tl.constexpr,
                      CLAMPED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """``Y = act(X)`` (``[R, F]``), or gated: ``act(X[:, :F]) * X[:, F:]`` (clamped: the gate's input at most
    ``limit``, the linear half clipped to +-limit plus ``offset``). Elementwise, float32 inside."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < R) & (cols[None, :] < F)
    a = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:
        a = tl.minimum(a, limit)
    f, _ = _bi_gate(a, FN, alpha)
    if GATED:
        b = tl.load(X + rows[:, None] * stride_x + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CLAMPED:
            b = tl.minimum(tl.maximum(b, -limit), limit) + offset
        f = f * b
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], f.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bi_act_bwd_kernel(X, DY, DX, R, F, stride_x, stride_dy, stride_dx, alpha, limit, offset, FN: tl.constexpr,
                      GATED: tl.constexpr, CLAMPED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """The input gradient of :func:`bi_act_fwd_kernel` (``[R, F]``, gated ``[R, 2F]``)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < R) & (cols[None, :] < F)
    g = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a_in = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = a_in
    if CLAMPED:
        a = tl.minimum(a_in, limit)
    f, df = _bi_gate(a, FN, alpha)
    if GATED:
        b_in = tl.load(X + rows[:, None] * stride_x + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = b_in
        if CLAMPED:
            b = tl.minimum(tl.maximum(b_in, -limit), limit) + offset
        da = (g * b) * df
        db = g * f
        if CLAMPED:
            da = tl.where(a_in < limit, da, 0.0)
            db = tl.where((b_in >= -limit) & (b_in <= limit), db, 0.0)
        tl.store(DX + rows[:, None] * stride_dx + F + cols[None, :], db.to(DX.dtype.element_ty), mask=mask)
    else:
        da = g * df
        if CLAMPED:
            da = tl.where(a_in < limit, da, 0.0)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], da.to(DX.dtype.element_ty), mask=mask)


settle_cache_keys(globals())
