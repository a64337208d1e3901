"""tests/case_grid.py: the core of a grid is its base case and every one-axis step from it; the rest is `wide`."""

import pytest
from case_grid import grid


def _wide(param) -> bool:
    return any(m.name == "wide" for m in param.marks)


def test_the_core_is_the_base_and_every_one_axis_step():
    params = grid("a,b,c", ["x", "y", "z"], {"one": 1, "two": 2}, [True, False])
    assert len(params) == 12
    core = [p.id for p in params if not _wide(p)]
    assert core == ["x-one-True", "x-one-False", "x-two-True", "y-one-True", "z-one-True"]
    assert params[0].values == ("x", 1, True)


def test_keep_drops_cases_and_core_adds_them():
    params = grid("d,h", ["f32", "f16"], ["gqa", "mha"], keep=lambda d, h: d == "f32" or h == "gqa")
    assert [p.id for p in params] == ["f32-gqa", "f32-mha", "f16-gqa"]
    assert not any(_wide(p) for p in params)
    params = grid("a,b", [1, 2], [3, 4], core=lambda a, b: (a, b) == (2, 4))
    assert [p.id for p in params if not _wide(p)] == ["1-3", "1-4", "2-3", "2-4"]


def test_a_value_the_core_misses_is_an_error():
    with pytest.raises(ValueError, match="the core has no case with a in"):
        grid("a,b", [1, 2], [3, 4], keep=lambda a, b: (a, b) in {(1, 3), (2, 4)})


def test_param_marks_and_ids_are_kept():
    params = grid("backend,n", ["unfused", pytest.param("fused", marks=pytest.mark.gpu, id="F")], [1, 2])
    by_id = {p.id: p for p in params}
    assert set(by_id) == {"unfused-1", "unfused-2", "F-1", "F-2"}
    assert by_id["F-2"].values == ("fused", 2)
    assert [m.name for m in by_id["F-1"].marks] == ["gpu"]
    assert sorted(m.name for m in by_id["F-2"].marks) == ["gpu", "wide"]


def test_argnames_must_match_the_axes():
    with pytest.raises(ValueError, match="2 argnames for 3 axes"):
        grid("a,b", [1], [2], [3])
