"""exp2 of a score tile with part of the elements on the FMA units instead of the special-function unit.

The special-function unit (MUFU) evaluates 16 exp2 per clock per SM on Hopper, against 128 fp32 FMAs: where a
softmax block has few matrix-product FLOPs per score (small head dims) the exponentials set the pace. With
``EXP2_POLY = n`` (2, 4 or 8), one element in every ``n`` of each thread's registers takes a polynomial instead:

    2^x = 2^floor(x) * 2^f,  f = x - floor(x) in [0, 1),  2^f ~ 1 + f (c1 + f (c2 + f c3))

(degree-3 minimax with the constant exactly 1, relative error < 9e-5: below bf16's and fp16's rounding of P);
floor(x) comes from adding 1.5 * 2^23 rounding down, whose low mantissa bits then hold it, and 2^floor(x) is an
integer add into the exponent field. The other elements keep ``ex2.approx.ftz.f32``, the instruction exp2
compiles to, so ``EXP2_POLY = 0`` is the plain kernel. Both paths give +0 for -inf (the clamp at -127 then a
flush of the subnormal result) and NaN for NaN. Which element takes which path depends only on its place in
the tile, so results stay bitwise reproducible and invariant wherever the tiling is.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Coefficients of 2^f on [0, 1) (c1, c2, c3), fp32 bit patterns for PTX.
_C1, _C2, _C3 = "0f3F31F328", "0f3E691C10", "0f3D9DD4CA"
_MAGIC = "0f4B400000"  # 1.5 * 2^23
_NEG127 = "0fC2FE0000"


def _asm(n: int) -> str:
    """PTX for one inline-asm instance over ``n`` packed fp32 elements: element 0 by the polynomial, the rest
    by MUFU (outputs $0..$n-1, inputs $n..$2n-1)."""
    poly = (
        "{ .reg .b32 a, t, j, f, p;",
        f"max.NaN.f32 a, ${n}, {_NEG127};",  # -inf -> -127; NaN stays
        f"add.rm.f32 t, a, {_MAGIC};",  # the low mantissa bits of t: floor(a)
        f"sub.f32 j, t, {_MAGIC};",  # floor(a), exactly
        "sub.f32 f, a, j;",
        f"fma.rn.f32 p, f, {_C3}, {_C2};",
        f"fma.rn.f32 p, p, f, {_C1};",
        "fma.rn.f32 p, p, f, 0f3F800000;",
        "shl.b32 t, t, 23;",  # floor(a) << 23 (the magic's own bits shift out)
        "add.s32 p, p, t;",
        # 2^-127 is subnormal: flushed to +0 (as MUFU's ftz does), and max(2^a, a) = 2^a passes NaN on.
        "max.ftz.NaN.f32 $0, p, a; }",
    )
    mufu = tuple(f"ex2.approx.ftz.f32 ${i}, ${n + i};" for i in range(1, n))
    return "\n".join(poly + mufu)


def _constraints(n: int) -> str:
    return ",".join(["=r"] * n + ["r"] * n)


_ASM2, _ASM4, _ASM8 = tl.constexpr(_asm(2)), tl.constexpr(_asm(4)), tl.constexpr(_asm(8))
_CON2, _CON4, _CON8 = tl.constexpr(_constraints(2)), tl.constexpr(_constraints(4)), tl.constexpr(_constraints(8))


@triton.jit
def exp2_split(x, EXP2_POLY: tl.constexpr):
    """exp2(x) of an fp32 tile, one element in EXP2_POLY by the FMA polynomial (0: all by MUFU)."""
    tl.static_assert((EXP2_POLY == 0) | (EXP2_POLY == 2) | (EXP2_POLY == 4) | (EXP2_POLY == 8))
    if EXP2_POLY == 2:
        return tl.inline_asm_elementwise(_ASM2, _CON2, [x], dtype=tl.float32, is_pure=True, pack=2)
    elif EXP2_POLY == 4:
        return tl.inline_asm_elementwise(_ASM4, _CON4, [x], dtype=tl.float32, is_pure=True, pack=4)
    elif EXP2_POLY == 8:
        return tl.inline_asm_elementwise(_ASM8, _CON8, [x], dtype=tl.float32, is_pure=True, pack=8)
    else:
        return tl.math.exp2(x)


@gluon.jit
def exp2_split_gl(x, EXP2_POLY: gl.constexpr):
    """exp2_split for the Gluon kernels (hopper_ws.py)."""
    gl.static_assert((EXP2_POLY == 0) | (EXP2_POLY == 2) | (EXP2_POLY == 4) | (EXP2_POLY == 8))
    if EXP2_POLY == 2:
        return gl.inline_asm_elementwise(_ASM2, _CON2, [x], dtype=gl.float32, is_pure=True, pack=2)
    elif EXP2_POLY == 4:
        return gl.inline_asm_elementwise(_ASM4, _CON4, [x], dtype=gl.float32, is_pure=True, pack=4)
    elif EXP2_POLY == 8:
        return gl.inline_asm_elementwise(_ASM8, _CON8, [x], dtype=gl.float32, is_pure=True, pack=8)
    else:
        return gl.exp2(x)
