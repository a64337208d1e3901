"""The fixed reduction structure of the unfused attention paths (framework-free description).

A row's result must not depend on how many padded or masked keys (or queries) follow it, so every
sum over keys (softmax normaliser, ``P V``, ``dS K``, ``rowsum(dP * P)``) and over queries
(``dK``, ``dV``) has one structure, a function of the position alone:

* The axis is cut into aligned blocks of ``KEY_BLOCK`` (keys) / ``QUERY_BLOCK`` (queries). Products
  whose contraction runs along the axis (``P V``, ``dS K``, ``dS^T Q``, ``P^T dO``) are computed one
  block pair at a time with a matmul of one fixed shape (``[QUERY_BLOCK, KEY_BLOCK]`` by
  ``[KEY_BLOCK, d]``), so the contraction inside a block has a fixed length and order.
* Partial results (one per block, or single elements for a plain sum) are combined by an
  adjacent-pair tree: level ``k`` holds the sums of the aligned runs ``[i 2^k, (i+1) 2^k)``, and a
  level of odd length gets one zero appended. Appending zeros at the end of the axis (padding,
  masked keys, empty blocks) changes no bit of the result: ``x + 0 == x`` in IEEE arithmetic.

Maxima (the softmax row max) are exact in any order and need no structure. Products along the
head dim (``Q K^T``, ``dO V^T``) are computed in the same fixed block shapes, so their per-element
contraction over ``d`` does not depend on how the BLAS library blocks a larger matrix.
"""

from __future__ import annotations

__all__ = ["KEY_BLOCK", "QUERY_BLOCK", "num_blocks", "tree_levels"]

KEY_BLOCK = 64
QUERY_BLOCK = 64


def num_blocks(length: int, block: int) -> int:
    """Blocks of ``block`` covering ``length`` positions (the last block zero-padded)."""
    if length < 0 or block < 1:
        raise ValueError(f"`length` must be >= 0 and `block` >= 1, got {length} and {block}")
    return -(-length // block)


def tree_levels(n: int) -> int:
    """Levels of the adjacent-pair tree over ``n`` items (0 for ``n <= 1``)."""
    levels = 0
    while n > 1:
        n = (n + 1) // 2
        levels += 1
    return levels
