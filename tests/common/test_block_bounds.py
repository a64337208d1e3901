"""Block bounds (kernels/masking.py): which K/V blocks a query block visits and which of them skip the
element mask (key_block_bounds), and the same for the query blocks of a K/V block (query_block_bounds).

The Triton kernels (forward.py, backward.py) and the Gluon ones (hopper_ws.py) call these same
@triton.jit functions, so there is one definition to check. Their code is run here in plain Python (the
functions' own bytecode, with ``tl`` standing for Python integers), for every tile size the plans use,
against the element-wise mask (masking.visible's rule) of every block pair: no mask, causal top-left and
bottom-right, sliding windows (left/right, 0 and unbounded), unequal and padded lengths (blocks past a
sequence's length, lengths of 0 and off block boundaries).
"""

import inspect
import itertools
import re
import types

import numpy as np
import pytest

pytest.importorskip("triton")

from transformer_engine.common.attention import plan  # noqa: E402
from transformer_engine.common.attention.kernels import backward, forward, hopper_ws, masking  # noqa: E402


class _Int32(int):
    """A kernel's int32 scalar: arithmetic stays _Int32 so that every division can be checked. Triton
    divides integers rounding toward zero and Python rounds down; they agree on the dividends >= 0 the
    bounds divide (asserted), so the Python evaluation is the kernels' arithmetic (no value here nears
    2**31)."""

    def __add__(self, other):
        return _Int32(int(self) + int(other))

    __radd__ = __add__

    def __sub__(self, other):
        return _Int32(int(self) - int(other))

    def __rsub__(self, other):
        return _Int32(int(other) - int(self))

    def __mul__(self, other):
        return _Int32(int(self) * int(other))

    __rmul__ = __mul__

    def __neg__(self):
        return _Int32(-int(self))

    def __floordiv__(self, other):
        assert self >= 0 and other > 0, f"{int(self)} // {int(other)} rounds differently in Triton"
        return _Int32(int(self) // int(other))


# The triton.language calls the bounds make, on scalars (cdiv as triton.language.standard defines it).
_TL = types.SimpleNamespace(maximum=lambda a, b: _Int32(max(a, b)), minimum=lambda a, b: _Int32(min(a, b)),
                            cdiv=lambda x, div: (x + (div - 1)) // div, where=lambda c, a, b: a if c else b,
                            constexpr=masking.tl.constexpr)


def _in_python(jit_fn):
    """The @triton.jit function's own code, with ``tl`` bound to _TL."""
    fn = jit_fn.fn
    return types.FunctionType(fn.__code__, dict(fn.__globals__, tl=_TL), fn.__name__, fn.__defaults__,
                              fn.__closure__)


key_block_bounds = _in_python(masking.key_block_bounds)
query_block_bounds = _in_python(masking.query_block_bounds)
segment_bounds = _in_python(masking.segment_bounds)


def _planned_tiles():
    """(BLOCK_M, BLOCK_N) of every Tiles in plan.py's tables (all targets, Triton and Gluon kernels), and
    the clamped tiles forward_plan / backward_plan derive from them."""
    found = set()

    def walk(value):
        if isinstance(value, plan.Tiles):
            if value.block_n:
                found.add((value.block_m, value.block_n))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
        elif isinstance(value, plan.ArchTables):  # one architecture's tables, every kernel variant's
            for item in vars(value).values():
                walk(item)

    for value in vars(plan).values():
        walk(value)
    found |= {(min(m, 64), min(n, 32)) for m, n in found} | {(min(m, 32), min(n, 64)) for m, n in found}
    return sorted(found)


TILES = _planned_tiles()


def _lengths(block_m, block_n):
    """Sequence lengths around each block boundary (0: an empty sequence of a packed or padded batch), and
    one spanning a few blocks of each side."""
    return sorted({0, 1, block_m - 1, block_m, block_m + 1, block_n - 1, block_n, block_n + 1,
                   2 * max(block_m, block_n) + 3})


def _windows(block_m, block_n):
    """Window sizes (-1: unbounded, HAS_LEFT / HAS_RIGHT false, as plan.mask_flags passes; 0: causal's
    right side) around a block's size and past both."""
    return sorted({-1, 0, 1, min(block_m, block_n) - 1, max(block_m, block_n) + 1, block_m + block_n + 5})


def test_tiles_cover_the_plans():
    assert {(16, 16), (128, 64), (64, 128), (128, 128), (64, 64), (32, 128)} <= set(TILES), TILES


def test_kernels_call_the_shared_bounds():
    """Both kernel families use masking's functions, and no kernel module computes bounds of its own."""
    for module in (forward, backward, hopper_ws):
        assert module.key_block_bounds is masking.key_block_bounds, module.__name__
        source = inspect.getsource(module)
        assert not re.search(r"^\s*(full_lo|full_hi)\s*=", source, re.MULTILINE), module.__name__
    for module in (backward, hopper_ws):
        assert module.query_block_bounds is masking.query_block_bounds, module.__name__
    assert hopper_ws.visible is masking.visible


def _band(rows, cols, diag, left, right):
    """The window rule alone (no lengths) on [rows, cols]: -left <= j - (i + diag) <= right."""
    rel = np.arange(cols)[None, :] - (np.arange(rows)[:, None] + diag)
    keep = np.ones((rows, cols), dtype=bool)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    return keep


def _blocks(values, block_m, block_n, num_m, num_n):
    return values.reshape(num_m, block_m, num_n, block_n).transpose(0, 2, 1, 3)


def _same(actual, expected, what):
    if not np.array_equal(actual, expected):  # np.testing's message, only on failure (it is slow)
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def _check(bounds, block, length, alive, unmaskable, band_any, band_all, real_any, real_full, inside, what):
    """The bounds of each block of one side (row r: (lo, full_lo, full_hi, hi)) over the other side's
    blocks of size ``block`` (column b); the other arguments are [row, b] (or [row]) booleans.

    Exact: nothing is visited from a block that starts past its own sequence (not ``alive``); otherwise
    block b is visited iff it starts inside its sequence (``length``) and the window touches the tile, and,
    where the row's block may skip the mask at all (``unmaskable``), unmasked iff the tile lies inside the
    sequence and inside the window. So against the element-wise mask: every block with a visible element is
    visited, an unmasked block has every element visible (``real_full``), and for tiles inside both
    sequences (``inside``) visited and unmasked are exactly "some element visible" and "every element
    visible"."""
    lo, full_lo, full_hi, hi = (np.array([int(v) for v in column])[:, None] for column in zip(*bounds))
    assert (lo <= full_lo).all() and (full_lo <= full_hi).all() and (full_hi <= hi).all(), what
    assert ((hi <= length) | (hi == lo)).all(), what
    # Loops step by ``block`` from lo and test a block's start against [full_lo, full_hi).
    assert ((lo == hi) | (lo % block == 0)).all(), what
    assert ((full_lo == full_hi) | ((full_lo % block == 0) & (full_hi % block == 0))).all(), what
    starts = np.arange(band_any.shape[1])[None, :] * block
    visited = (starts >= lo) & (starts < hi)
    unmasked = (starts >= full_lo) & (starts < full_hi)
    _same(visited, band_any & (starts < length) & alive[:, None], what)
    _same(unmasked, band_all & (starts + block <= length) & unmaskable[:, None], what)
    assert not (real_any & ~visited).any(), what
    assert not (unmasked & ~real_full).any(), what
    _same(visited[inside], real_any[inside], what)
    _same(unmasked[inside], real_full[inside], what)
    # The segmented loops (masked head, unmasked middle, masked tail) visit the same blocks.
    segments = [segment_bounds(s, lo, full_lo, full_hi, hi) for s in range(3)]
    for (start, end), expected in zip(segments, ((lo, full_lo), (full_lo, full_hi), (full_hi, hi))):
        assert start is expected[0] and end is expected[1], what


@pytest.mark.parametrize("block_m,block_n", TILES)
def test_block_bounds_match_the_element_mask(block_m, block_n):
    checked = 0
    lengths, windows = _lengths(block_m, block_n), _windows(block_m, block_n)
    for len_q, len_k, left, right, bottom_right in itertools.product(lengths, lengths, windows, windows,
                                                                     (False, True)):
        if bottom_right and (len_q == len_k or left < 0 and right < 0):
            continue  # the same diagonal as top-left, or none
        diag = len_k - len_q if bottom_right else 0
        # Every block the grid can launch (it covers the batch's longest sequence) and one past this one.
        num_m, num_n = -(-len_q // block_m) + 1, -(-len_k // block_n) + 1
        rows, cols = num_m * block_m, num_n * block_n
        band = _blocks(_band(rows, cols, diag, left, right), block_m, block_n, num_m, num_n)
        in_q, in_k = np.arange(rows) < len_q, np.arange(cols) < len_k
        real = band & _blocks(in_q[:, None] & in_k[None, :], block_m, block_n, num_m, num_n)
        band_any, band_all, real_any = band.any(axis=(2, 3)), band.all(axis=(2, 3)), real.any(axis=(2, 3))
        m_alive, n_alive = np.arange(num_m) * block_m < len_q, np.arange(num_n) * block_n < len_k
        m_whole, n_whole = np.arange(1, num_m + 1) * block_m <= len_q, np.arange(1, num_n + 1) * block_n <= len_k
        inside = m_whole[:, None] & n_whole[None, :]
        args = (_Int32(len_q), _Int32(len_k), _Int32(diag), _Int32(max(left, 0)), _Int32(max(right, 0)),
                block_m, block_n, left >= 0, right >= 0)
        case = f"len_q={len_q} len_k={len_k} window=({left}, {right}) diag={diag} tiles={block_m}x{block_n}"
        # The forward and dQ loops (a query block's key blocks): rows past len_q are dropped from the
        # results, so a key block may skip the mask when every key is visible to the block's real rows.
        row_real = _blocks(np.broadcast_to(in_q[:, None], (rows, cols)), block_m, block_n, num_m, num_n)
        real_full = (real | ~row_real).all(axis=(2, 3)) & n_whole[None, :] & m_alive[:, None]
        _check([key_block_bounds(_Int32(m * block_m), *args) for m in range(num_m)], block_n, len_k, m_alive,
               m_alive, band_any, band_all, real_any, real_full, inside, f"query blocks: {case}")
        # The dK/dV loops (a key block's query blocks) sum over query rows: an unmasked query block must see
        # the key block whole, and a key block running past len_k masks every query block.
        _check([query_block_bounds(_Int32(n * block_n), *args) for n in range(num_n)], block_m, len_q, n_alive,
               n_whole, band_any.T, band_all.T, real_any.T, real.all(axis=(2, 3)).T, inside.T, f"key blocks: {case}")
        checked += num_m + num_n
    assert checked > 5000, checked
