"""Out-of-bounds accesses of the Triton kernels on the CPU: under Triton's interpreter, every load and store
address that its mask lets through must lie inside the storage of one of the kernel's tensor arguments (the
interpreter's host copies); the first that does not raises, naming the kernel and the addresses. The interpreter
itself reads host memory unchecked, so without this an out-of-bounds read that would fault on the GPU passes.

    PYTHONPATH=dev/tuning TRITON_INTERPRET=1 python -m pytest -p interpreter_bounds tests/pytorch/test_fused_attn.py

(a pytest plugin by module name; importing it anywhere before the kernels run also works). It patches
Triton 3.6's interpreter internals (GridExecutor._init_args_hst, InterpreterBuilder.create_masked_load/store).
"""
import numpy as np
from triton.runtime import interpreter as I

_ranges = []
_current = [""]

_orig_init = I.GridExecutor._init_args_hst


def _init_args_hst(self, args_dev, kwargs):
    args_hst, kwargs_hst = _orig_init(self, args_dev, kwargs)
    _ranges.clear()
    _current[0] = getattr(self.fn, "__name__", "?")

    def add(a):
        if hasattr(a, "untyped_storage"):
            st = a.untyped_storage()
            _ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        elif isinstance(a, tuple):
            for x in a:
                add(x)
    for a in args_hst:
        add(a)
    for a in kwargs_hst.values():
        add(a)
    return args_hst, kwargs_hst


def _check(ptrs, mask, size, what):
    addr = ptrs.data.astype(np.uint64)
    m = mask.data.astype(bool) if mask is not None else np.ones(addr.shape, bool)
    m = np.broadcast_to(m, addr.shape)
    a = addr[m]
    if a.size == 0:
        return
    ok = np.zeros(a.shape, bool)
    for lo, hi in _ranges:
        ok |= (a >= lo) & (a + size <= hi)
    if not ok.all():
        bad = a[~ok][:5]
        raise AssertionError(f"out-of-bounds {what} in {_current[0]}: {int((~ok).sum())} addresses, e.g. "
                             f"{[hex(int(x)) for x in bad]}; ranges {[(hex(lo), hi - lo) for lo, hi in _ranges]}")


_orig_load = I.InterpreterBuilder.create_masked_load
_orig_store = I.InterpreterBuilder.create_masked_store


def create_masked_load(self, ptrs, mask, other, *a, **k):
    _check(ptrs, mask, np.dtype(I._get_np_dtype(ptrs.get_element_ty())).itemsize, "load")
    return _orig_load(self, ptrs, mask, other, *a, **k)


def create_masked_store(self, ptrs, value, mask, *a, **k):
    _check(ptrs, mask, np.dtype(I._get_np_dtype(ptrs.get_element_ty())).itemsize, "store")
    return _orig_store(self, ptrs, value, mask, *a, **k)


I.GridExecutor._init_args_hst = _init_args_hst
I.InterpreterBuilder.create_masked_load = create_masked_load
I.InterpreterBuilder.create_masked_store = create_masked_store
