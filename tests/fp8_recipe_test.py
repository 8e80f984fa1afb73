"""`keras_mp.fp8.Recipe`: a plain serializable value, checked on entry."""

import keras
import pytest

from keras_mp import fp8
from keras_mp._fp8 import recipe as recipe_module

NON_DEFAULT = {
    "scaling": "current",
    "granularity": "block",
    "formats": "e4m3",
    "margin": 2,
    "amax_history": 16,
    "amax_algo": "most_recent",
    "stats": True,
}


def test_get_config_round_trips_every_field():
    recipe = fp8.Recipe(**NON_DEFAULT)
    assert recipe.get_config() == NON_DEFAULT
    restored = fp8.Recipe.from_config(recipe.get_config())
    assert restored == recipe and hash(restored) == hash(recipe)
    assert restored != fp8.Recipe()
    assert "granularity='block'" in repr(recipe)


def test_recipe_is_registered_and_serializes_with_keras():
    assert keras.saving.get_registered_name(fp8.Recipe) == "keras_mp>Recipe"
    recipe = fp8.Recipe(**NON_DEFAULT)
    config = keras.saving.serialize_keras_object(recipe)
    assert config["registered_name"] == "keras_mp>Recipe"
    assert keras.saving.deserialize_keras_object(config) == recipe


def test_formats_give_the_forward_and_backward_formats():
    assert fp8.Recipe().forward_format == "e4m3"
    assert fp8.Recipe().backward_format == "e5m2"
    assert fp8.Recipe(formats="e4m3").backward_format == "e4m3"


@pytest.mark.parametrize(
    "field, value",
    [
        ("scaling", "dynamic"),
        ("granularity", "mx"),
        ("formats", "e5m2"),
        ("amax_algo", "mean"),
        ("margin", -1),
        ("margin", 1.5),
        ("margin", True),
        ("amax_history", 0),
    ],
)
def test_bad_fields_raise_naming_the_field_and_the_value(field, value):
    with pytest.raises(ValueError, match=f"Received: {field}={value!r}"):
        fp8.Recipe(**{field: value})


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"amax_history_len": 16}, "`amax_history_len` is `amax_history`"),
        ({"granularty": "rowwise"}, "`granularty` is `granularity`"),
        ({"stochastic": True}, "Received unknown fields \\['stochastic'\\]"),
    ],
)
def test_an_unknown_field_raises_a_value_error_naming_the_fields(kwargs, hint):
    with pytest.raises(ValueError, match=hint):
        fp8.Recipe(**kwargs)


def test_an_unknown_config_key_raises():
    with pytest.raises(ValueError, match="history"):
        fp8.Recipe.from_config({"history": 3})


def test_get_resolves_true_none_configs_and_recipes():
    recipe = fp8.Recipe(granularity="rowwise")
    assert recipe_module.get(True) is fp8.DEFAULT_RECIPE
    assert recipe_module.get(None) is None
    assert recipe_module.get(False) is None
    assert recipe_module.get(recipe) is recipe
    assert recipe_module.get(recipe.get_config()) == recipe
    with pytest.raises(TypeError, match="Received: fp8="):
        recipe_module.get("rowwise")


@pytest.mark.parametrize("granularity", ["rowwise", "block"])
def test_delayed_scaling_of_rows_or_blocks_raises_with_the_fix(granularity):
    with pytest.raises(ValueError, match="granularity='tensorwise'"):
        fp8.Recipe(scaling="delayed", granularity=granularity)


def test_a_delayed_recipe_round_trips():
    recipe = fp8.Recipe(
        scaling="delayed", amax_history=16, amax_algo="most_recent", margin=1
    )
    assert fp8.Recipe.from_config(recipe.get_config()) == recipe
