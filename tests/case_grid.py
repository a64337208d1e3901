"""Test grids with a core: every value of every axis runs in CI, the full cross product in the wide level.

``grid("a,b", {"x": 1, "y": 2}, [True, False])`` is the cross product of its axes as ``pytest.param``s. The
core is one case per axis value: a base case (the first combination kept) and every case that differs from it
in one axis only. The other cases are marked ``wide``: qa's L0 levels (CI) leave them out, qa/L1_cpu_wide runs
them. A test keeps its whole grid; only where each case runs changes.

An axis is a dict {id: value} or a sequence (ids: the value for str/int/float/bool/None, else argname+index); a
``pytest.param(value, marks=...)`` in a sequence keeps its marks and id.
``keep(*values)`` drops combinations that do not exist; ``core(*values)`` names extra core cases (e.g. a pair
of values whose interaction is the point of the test).
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

import pytest

WIDE = pytest.mark.wide
_PARAM = type(pytest.param(None))  # what pytest.param returns


def _axis(name: str, values):
    """[(id, value, marks)] of one axis."""
    if isinstance(values, dict):
        return [(i, v, ()) for i, v in values.items()]
    out = []
    for i, v in enumerate(values):
        marks = ()
        if isinstance(v, _PARAM):  # pytest.param(value, marks=..., id=...)
            (v,), marks, given = v.values, tuple(v.marks), v.id
        else:
            given = None
        simple = v is None or isinstance(v, (str, int, float, bool))
        out.append((given or (str(v) if simple else f"{name}{i}"), v, marks))
    return out


def grid(argnames: str, *axes, keep: Optional[Callable[..., bool]] = None,
         core: Optional[Callable[..., bool]] = None) -> Sequence:
    names = [n.strip() for n in argnames.split(",")]
    if len(names) != len(axes):
        raise ValueError(f"grid: {len(names)} argnames for {len(axes)} axes")
    combos = [c for c in itertools.product(*(_axis(n, a) for n, a in zip(names, axes)))
              if keep is None or keep(*(v for _, v, _ in c))]
    if not combos:
        raise ValueError(f"grid({argnames!r}): keep leaves no case")
    base = [i for i, _, _ in combos[0]]
    params, covered = [], [set() for _ in axes]
    for combo in combos:
        ids = [i for i, _, _ in combo]
        values = [v for _, v, _ in combo]
        marks = [m for _, _, ms in combo for m in ms]
        in_core = sum(a != b for a, b in zip(ids, base)) <= 1 or (core is not None and core(*values))
        if in_core:
            for seen, i in zip(covered, ids):
                seen.add(i)
        params.append(pytest.param(*values, id="-".join(ids), marks=marks if in_core else marks + [WIDE]))
    # Every value of every axis that some kept case has runs in the core (a keep() may leave an axis value only
    # in combinations more than one step from the base: then name them in core()).
    for name, seen, combo_ids in zip(names, covered, zip(*[[i for i, _, _ in c] for c in combos])):
        missing = set(combo_ids) - seen
        if missing:
            raise ValueError(f"grid({argnames!r}): the core has no case with {name} in {sorted(missing)}; "
                             "add one through core=")
    return params
