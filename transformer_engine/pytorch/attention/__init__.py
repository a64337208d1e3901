"""PyTorch attention: custom ops, autograd function, backends and the DotProductAttention module."""
