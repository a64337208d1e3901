"""common.quantizer_roles: each recipe's quantizer specs per role (TransformerEngine's formats, tiles, scale
options and GEMM accumulation defaults), the refusals by name, the row alignment table. Framework-free."""

from __future__ import annotations

import pytest

from transformer_engine.common import quantizer_roles as roles
from transformer_engine.common import recipe


def test_delayed_scaling_specs():
    r = recipe.DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="most_recent", reduce_amax=False)
    rq = roles.quantizers_for(r)
    assert rq.recipe is r and rq.stateful and not rq.needs_block_gemm_device
    assert [s.role for s in rq.specs] == [roles.Role.INPUT, roles.Role.WEIGHT, roles.Role.GRAD_OUTPUT]
    assert [s.fmt for s in rq.specs] == ["e4m3", "e4m3", "e5m2"]  # HYBRID
    for s in rq.specs:
        assert (s.scaling, s.tile, s.margin, s.amax_history_len, s.amax_compute_algo, s.reduce_amax) == \
            (roles.Scaling.DELAYED, None, 2, 16, "most_recent", False)
        assert s.stateful and not s.second_layout
    assert rq.split_accumulator == (False, True, True)  # TransformerEngine: fast accumulation in fprop only
    assert [rq.use_split_accumulator(g) for g in roles.GEMMS] == [False, True, True]
    with pytest.raises(ValueError, match="`gemm` must be one of"):
        rq.use_split_accumulator("fwd")


def test_current_scaling_specs_follow_the_recipe_fields():
    r = recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3,
                                    fp8_quant_fwd_weight=recipe.QParams(power_2_scale=True, amax_epsilon=0.5),
                                    fp8_gemm_fprop=recipe.MMParams(use_split_accumulator=True))
    rq = roles.quantizers_for(r)
    assert not rq.stateful and [s.fmt for s in rq.specs] == ["e4m3"] * 3
    assert (rq.weight.power_2_scale, rq.weight.amax_epsilon) == (True, 0.5)
    assert (rq.input.power_2_scale, rq.input.amax_epsilon) == (False, 0.0)
    assert all(s.scaling is roles.Scaling.CURRENT and s.tile is None for s in rq.specs)
    assert rq.split_accumulator == (True, True, True)


def test_block_scaling_specs():
    rq = roles.quantizers_for(recipe.Float8BlockScaling())
    assert rq.needs_block_gemm_device and not rq.stateful
    assert (rq.input.tile, rq.weight.tile, rq.grad_output.tile) == ((1, 128), (128, 128), (1, 128))
    assert (rq.input.second_layout, rq.weight.second_layout, rq.grad_output.second_layout) == (True, False, True)
    assert all(s.power_2_scale and s.fmt == "e4m3" and s.fmt_max == 448.0 for s in rq.specs)
    assert rq.split_accumulator == (True, True, True)


@pytest.mark.parametrize("bad,reason", [(recipe.MXFP8BlockScaling(), "Blackwell"),
                                        (recipe.NVFP4BlockScaling(), "Blackwell"),
                                        (recipe.CustomRecipe(), "user quantizer factories")])
def test_refused_recipes_by_name(bad, reason):
    with pytest.raises(NotImplementedError, match=f"{type(bad).__name__}: .*{reason}"):
        roles.quantizers_for(bad)
    assert roles.refusal(bad).startswith(type(bad).__name__)


def test_unregistered_recipe_and_non_recipe():
    class Unbuilt(recipe.Recipe):
        _DEFAULTS = dict(fp8_format=recipe.Format.E4M3)

    with pytest.raises(NotImplementedError, match="Unbuilt: no quantizers"):
        roles.quantizers_for(Unbuilt())
    with pytest.raises(ValueError, match="`recipe` must be a transformer_engine.common.recipe.Recipe"):
        roles.quantizers_for("delayed")
    assert roles.refusal(recipe.DelayedScaling()) is None


def test_row_alignment():
    assert roles.row_alignment(recipe.DelayedScaling()) == 16
    assert roles.row_alignment(recipe.Float8BlockScaling()) == 16
    assert roles.row_alignment(recipe.MXFP8BlockScaling()) == 32
    assert roles.row_alignment(recipe.NVFP4BlockScaling()) == 128
    custom = recipe.CustomRecipe()
    with pytest.raises(ValueError, match="quantization_alignment"):
        roles.row_alignment(custom)
    custom.quantization_alignment = 64
    assert roles.row_alignment(custom) == 64
