"""The unfused paths' fixed reduction order (common/attention/reduction.py) as a plain-Python reference."""

from __future__ import annotations

from typing import List


def tree_sum_order(values: List[float]) -> float:
    """The adjacent-pair tree sum of ``values`` in Python floats, odd levels zero-padded."""
    level = list(values)
    if not level:
        return 0.0
    while len(level) > 1:
        if len(level) % 2:
            level.append(0.0)
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]
