"""A pytest plugin that stands in for a host BLAS whose bits cannot be relied on.

Some BLAS builds (seen on AMD EPYC hosts) change a row's summation order with the shape of the product, so
the same row gets other bits in another tile. Triton's interpreter used to compute ``tl.dot`` with numpy's
matmul; a bitwise claim proven under it then held only on the host it ran on. This plugin makes every host
worse than that one: each call of ``numpy.matmul`` moves its floating-point result one ulp up or not, by a
pseudo-random draw (so no pattern of calls, such as two dots per loop step, keeps the noise in step). A bitwise test that passes with it (``pytest -p tests.host_blas_noise ...``) does not
rest on the host BLAS.
"""

import random

import numpy as np

_matmul = np.matmul
_draw = random.Random(0)


def noisy_matmul(a, b, *args, **kwargs):
    out = _matmul(a, b, *args, **kwargs)
    if _draw.random() < 0.5 and np.issubdtype(np.asarray(out).dtype, np.floating):
        out = np.nextafter(out, np.inf).astype(np.asarray(out).dtype)
    return out


def pytest_configure(config):
    np.matmul = noisy_matmul


def pytest_unconfigure(config):
    np.matmul = _matmul
