"""Batch-invariant GEMM and row norms (framework-free: plans are pure functions, kernels import only triton).

In batch-invariant mode (``NVTE_BATCH_INVARIANT=1``) a row of a GEMM's or a norm's output gets the same bits
whatever the number of rows it is computed with: the tiles and the reduction order are functions of the
other dimensions, the dtype and the device only (plan.py), never of M, and no split-K is used.
"""
