"""Triton kernels for attention and RoPE (framework-free: they import only triton).

forward.py: online-softmax forward saving the log-sum-exp.
backward.py: preprocess (delta = rowsum(dO * O)), dK/dV pass, dQ pass.
masking.py: the visibility rule (causal/window/lengths) and loop bounds shared by all passes.
fill.py: zeroing the token rows outside every sequence (for backends that leave them unwritten).
rope.py: rotary position embedding, forward and backward (the PyTorch frontend's fused RoPE).
hopper_ws.py: the warp-specialized Gluon forward, dK/dV and dQ for Hopper.
aot.py and resources.py (tools, not kernels): compiling a launch without a GPU for any target, and the
registers, spills and shared memory of the planned launches.
"""

from transformer_engine.common.attention.kernels.triton_compat import interpret_dot_in_fixed_order

# Under Triton's interpreter, tl.dot as a fixed-order sum: its bits must not depend on the host BLAS (see
# interpret_dot_in_fixed_order).
interpret_dot_in_fixed_order()
