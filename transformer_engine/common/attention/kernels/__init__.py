"""Triton kernels for attention (framework-free: they import only triton).

forward.py: online-softmax forward saving the log-sum-exp.
backward.py: preprocess (delta = rowsum(dO * O)), dK/dV pass (optionally with atomic dQ), dQ pass.
masking.py: the visibility rule (causal/window/lengths) and loop bounds shared by all passes.
fill.py: zeroing the token rows outside every sequence (for backends that leave them unwritten).
"""
