"""Tests of keras_mp.loss_scale: values, validation, config, the algorithm."""

import math
import random

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import loss_scale as loss_scale_module
from keras_mp.testing import to_numpy

_FLOAT32_OVERFLOW = 2.0**128


def _reference_update(scale, good_steps, is_finite, config):
    """RFC 293's dynamic loss scale update, in plain Python floats."""
    if not is_finite:
        return max(scale / config["multiplier"], config["min_loss_scale"]), 0
    good_steps += 1
    if good_steps < config["increment_period"]:
        return scale, good_steps
    grown = scale * config["multiplier"]
    max_loss_scale = config["max_loss_scale"]
    if grown < _FLOAT32_OVERFLOW and (
        max_loss_scale is None or grown <= max_loss_scale
    ):
        scale = grown
    return scale, 0


def _state(loss_scale):
    return (
        float(to_numpy(loss_scale.loss_scale)),
        int(to_numpy(loss_scale.num_good_steps)),
    )


def _flags(seed, count, finite_fraction):
    rng = random.Random(seed)
    return [rng.random() < finite_fraction for _ in range(count)]


_ALGORITHM_CASES = {
    "defaults_period_3": dict(
        initial_loss_scale=2.0**15, increment_period=3, multiplier=2.0
    ),
    "floor_below_one": dict(
        initial_loss_scale=4.0,
        increment_period=4,
        multiplier=2.0,
        min_loss_scale=2.0**-3,
    ),
    "floor_not_a_power_of_multiplier": dict(
        initial_loss_scale=64.0,
        increment_period=2,
        multiplier=2.0,
        min_loss_scale=3.0,
    ),
    "cap_reached_exactly": dict(
        initial_loss_scale=2.0**10,
        increment_period=2,
        multiplier=4.0,
        min_loss_scale=1.0,
        max_loss_scale=2.0**14,
    ),
    "cap_between_powers": dict(
        initial_loss_scale=1.0,
        increment_period=1,
        multiplier=2.0,
        max_loss_scale=100.0,
    ),
    "near_float32_overflow": dict(
        initial_loss_scale=2.0**124,
        increment_period=1,
        multiplier=2.0,
        min_loss_scale=2.0**120,
    ),
}


def _config(kwargs):
    return keras_mp.DynamicLossScale(**kwargs).get_config()


def _check_invariants(scale, config):
    assert math.isfinite(scale)
    assert scale >= config["min_loss_scale"]
    if config["max_loss_scale"] is not None:
        assert scale <= config["max_loss_scale"]
    # From a power of two, with a power-of-two multiplier and floor, every
    # scale is an exact power of two.
    if all(
        _is_power_of_two(config[key])
        for key in ("initial_loss_scale", "multiplier", "min_loss_scale")
    ):
        assert _is_power_of_two(scale), scale


def _is_power_of_two(value):
    return math.frexp(value)[0] == 0.5


class TestFixedLossScale:
    def test_call_returns_float32_scalar_of_the_value(self):
        scale = keras_mp.FixedLossScale(128)
        value = scale()
        assert keras.backend.standardize_dtype(value.dtype) == "float32"
        assert tuple(value.shape) == ()
        assert float(to_numpy(value)) == 128.0
        assert scale.loss_scale_value == 128.0

    def test_fixed_scale_never_skips_and_never_changes(self):
        scale = keras_mp.FixedLossScale(2.0**10)
        scale.build()
        for is_finite in (True, False, False, True):
            assert bool(to_numpy(scale.update(is_finite))) is True
            assert float(to_numpy(scale())) == 2.0**10
        assert scale.variables == []
        assert not scale.is_dynamic

    def test_fixed_scale_of_one_is_allowed(self):
        assert float(to_numpy(keras_mp.FixedLossScale(1)())) == 1.0

    @pytest.mark.parametrize("value", [0.5, 0, -4])
    def test_fixed_scale_below_one_raises_value_error(self, value):
        with pytest.raises(ValueError, match="at least 1") as info:
            keras_mp.FixedLossScale(value)
        assert f"loss_scale_value={value!r}" in str(info.value)

    @pytest.mark.parametrize("value", ["128", True, None, [2]])
    def test_fixed_scale_non_number_raises_type_error(self, value):
        with pytest.raises(TypeError, match="must be a number") as info:
            keras_mp.FixedLossScale(value)
        assert f"loss_scale_value={value!r}" in str(info.value)

    @pytest.mark.parametrize("value", [float("inf"), float("nan")])
    def test_fixed_scale_non_finite_raises_value_error(self, value):
        with pytest.raises(ValueError, match="finite"):
            keras_mp.FixedLossScale(value)

    def test_fixed_scale_config_round_trip(self):
        scale = keras_mp.FixedLossScale(384)
        config = scale.get_config()
        assert config == {"loss_scale_value": 384.0}
        restored = keras_mp.FixedLossScale.from_config(config)
        assert restored.get_config() == config
        serialized = keras.saving.serialize_keras_object(scale)
        assert serialized["registered_name"] == "keras_mp>FixedLossScale"
        restored = keras.saving.deserialize_keras_object(serialized)
        assert isinstance(restored, keras_mp.FixedLossScale)
        assert float(to_numpy(restored())) == 384.0


class TestDynamicLossScaleConstruction:
    def test_defaults_follow_rfc_293(self):
        scale = keras_mp.DynamicLossScale()
        assert scale.get_config() == {
            "initial_loss_scale": 2.0**15,
            "increment_period": 2000,
            "multiplier": 2.0,
            "min_loss_scale": 1.0,
            "max_loss_scale": None,
            "hysteresis": 1,
            "on_min_scale": "warn",
        }
        assert scale.is_dynamic
        assert float(to_numpy(scale())) == 2.0**15

    def test_call_before_build_returns_initial_scale_as_float32(self):
        scale = keras_mp.DynamicLossScale(initial_loss_scale=1024)
        assert not scale.built
        value = scale()
        assert keras.backend.standardize_dtype(value.dtype) == "float32"
        assert float(to_numpy(value)) == 1024.0

    def test_state_is_float32_scale_and_integer_counter_variables(self):
        scale = keras_mp.DynamicLossScale(initial_loss_scale=512)
        scale.build()
        assert isinstance(scale.loss_scale, keras.Variable)
        assert isinstance(scale.num_good_steps, keras.Variable)
        assert scale.loss_scale.dtype == "float32"
        assert "int" in scale.num_good_steps.dtype
        assert not scale.loss_scale.trainable
        assert not scale.num_good_steps.trainable
        assert scale.variables == [scale.loss_scale, scale.num_good_steps]
        assert _state(scale) == (512.0, 0)

    def test_build_is_idempotent(self):
        scale = keras_mp.DynamicLossScale()
        scale.build()
        variables = scale.variables
        scale.build()
        assert scale.variables == variables
        assert len(variables) == 2

    def test_accessing_state_builds_the_scale(self):
        scale = keras_mp.DynamicLossScale(initial_loss_scale=8)
        assert float(to_numpy(scale.loss_scale)) == 8.0
        assert scale.built

    def test_state_variables_are_assignable_for_debugging(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=16, increment_period=5
        )
        scale.loss_scale.assign(256.0)
        scale.num_good_steps.assign(4)
        assert float(to_numpy(scale())) == 256.0
        scale.update(True)
        assert _state(scale) == (512.0, 0)

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(multiplier=1.0), "multiplier` must be greater than 1"),
            (dict(multiplier=0.5), "multiplier` must be greater than 1"),
            (dict(increment_period=0), "increment_period` must be at least 1"),
            (dict(min_loss_scale=0), "min_loss_scale` must be positive"),
            (dict(min_loss_scale=-1.0), "min_loss_scale` must be positive"),
            (
                dict(initial_loss_scale=1, min_loss_scale=2),
                "initial_loss_scale` must be at least `min_loss_scale",
            ),
            (
                dict(initial_loss_scale=8, max_loss_scale=4),
                "initial_loss_scale` must be at most `max_loss_scale",
            ),
            (dict(initial_loss_scale=float("inf")), "must be finite"),
            (dict(multiplier=float("nan")), "must be finite"),
            (dict(max_loss_scale=float("inf")), "must be finite"),
        ],
    )
    def test_invalid_arguments_raise_value_error(self, kwargs, match):
        with pytest.raises(ValueError, match=match) as info:
            keras_mp.DynamicLossScale(**kwargs)
        assert "Received:" in str(info.value)

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(increment_period=1.5),
            dict(increment_period=True),
            dict(multiplier="2"),
            dict(initial_loss_scale=None),
            dict(min_loss_scale=True),
            dict(max_loss_scale="big"),
        ],
    )
    def test_wrongly_typed_arguments_raise_type_error(self, kwargs):
        with pytest.raises(TypeError) as info:
            keras_mp.DynamicLossScale(**kwargs)
        ((name, value),) = kwargs.items()
        assert f"{name}={value!r}" in str(info.value)

    def test_min_loss_scale_may_be_below_one(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=0.5, min_loss_scale=2.0**-10
        )
        assert float(to_numpy(scale())) == 0.5

    def test_equal_min_initial_and_max_are_valid(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=4, min_loss_scale=4, max_loss_scale=4
        )
        scale.update(True)
        scale.update(False)
        assert float(to_numpy(scale())) == 4.0

    def test_config_round_trip_with_non_default_values(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=2.0**8,
            increment_period=17,
            multiplier=4.0,
            min_loss_scale=0.25,
            max_loss_scale=2.0**20,
            hysteresis=3,
            on_min_scale="ignore",
        )
        config = scale.get_config()
        assert config == {
            "initial_loss_scale": 256.0,
            "increment_period": 17,
            "multiplier": 4.0,
            "min_loss_scale": 0.25,
            "max_loss_scale": 2.0**20,
            "hysteresis": 3,
            "on_min_scale": "ignore",
        }
        assert keras_mp.DynamicLossScale.from_config(config).get_config() == (
            config
        )
        serialized = keras.saving.serialize_keras_object(scale)
        assert serialized["registered_name"] == "keras_mp>DynamicLossScale"
        restored = keras.saving.deserialize_keras_object(serialized)
        assert isinstance(restored, keras_mp.DynamicLossScale)
        assert restored.get_config() == config

    def test_min_loss_scale_survives_config_and_governs_the_floor(self):
        # jmp's DynamicLossScale lost its floor through a round trip.
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=8.0, min_loss_scale=2.0
        )
        restored = keras_mp.DynamicLossScale.from_config(scale.get_config())
        for _ in range(5):
            restored.update(False)
        assert float(to_numpy(restored())) == 2.0

    def test_repr_names_every_argument(self):
        text = repr(keras_mp.DynamicLossScale(increment_period=7))
        assert text.startswith("DynamicLossScale(")
        for key in keras_mp.DynamicLossScale().get_config():
            assert key in text


class TestDynamicLossScaleAlgorithm:
    def test_nonfinite_step_halves_scale_resets_counter_and_skips(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=1024, increment_period=10
        )
        scale.update(True)
        scale.update(True)
        assert _state(scale) == (1024.0, 2)
        should_apply = scale.update(False)
        assert bool(to_numpy(should_apply)) is False
        assert _state(scale) == (512.0, 0)

    def test_finite_steps_grow_scale_after_increment_period(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=2, increment_period=3
        )
        for expected in [(2.0, 1), (2.0, 2), (4.0, 0), (4.0, 1)]:
            assert bool(to_numpy(scale.update(True))) is True
            assert _state(scale) == expected

    def test_counter_resets_at_the_cap_while_the_scale_stays(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=8, increment_period=2, max_loss_scale=8
        )
        for expected in [(8.0, 1), (8.0, 0), (8.0, 1), (8.0, 0)]:
            scale.update(True)
            assert _state(scale) == expected

    def test_scale_never_becomes_inf(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=2.0**126, increment_period=1
        )
        for _ in range(4):
            scale.update(True)
            assert math.isfinite(float(to_numpy(scale())))
        assert float(to_numpy(scale())) == 2.0**127

    def test_floor_is_never_crossed(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=2.0, min_loss_scale=0.25
        )
        for expected in [1.0, 0.5, 0.25, 0.25, 0.25]:
            scale.update(False)
            assert float(to_numpy(scale())) == expected

    def test_update_accepts_python_bool_and_tensor(self):
        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=4, increment_period=1
        )
        scale.update(keras.ops.convert_to_tensor(False))
        assert _state(scale) == (2.0, 0)
        scale.update(keras.ops.isfinite(keras.ops.convert_to_tensor(1.0)))
        assert _state(scale) == (4.0, 0)

    @pytest.mark.parametrize("case", sorted(_ALGORITHM_CASES))
    def test_update_matches_python_reference_over_many_steps(self, case):
        kwargs = _ALGORITHM_CASES[case]
        config = _config(kwargs)
        scale = keras_mp.DynamicLossScale(**kwargs)
        expected = (config["initial_loss_scale"], 0)
        assert _state(scale) == expected
        flags = _flags(seed=len(case), count=60, finite_fraction=0.8)
        for step, is_finite in enumerate(flags):
            should_apply = scale.update(is_finite)
            expected = _reference_update(*expected, is_finite, config)
            assert bool(to_numpy(should_apply)) is is_finite, step
            assert _state(scale) == expected, (step, is_finite)
            _check_invariants(expected[0], config)

    def test_long_runs_of_overflow_and_growth_stay_in_bounds(self):
        kwargs = dict(
            initial_loss_scale=2.0**6,
            increment_period=2,
            multiplier=2.0,
            min_loss_scale=2.0**2,
            max_loss_scale=2.0**9,
        )
        config = _config(kwargs)
        scale = keras_mp.DynamicLossScale(**kwargs)
        flags = [False] * 8 + [True] * 20 + [False, True] * 4
        expected = (config["initial_loss_scale"], 0)
        seen = set()
        for is_finite in flags:
            scale.update(is_finite)
            expected = _reference_update(*expected, is_finite, config)
            assert _state(scale) == expected
            seen.add(expected[0])
        assert min(seen) == 2.0**2
        assert max(seen) == 2.0**9

    @pytest.mark.backends("jax")
    def test_update_inside_jax_jit_with_stateless_scope(self):
        import jax

        kwargs = dict(
            initial_loss_scale=2.0**5,
            increment_period=3,
            multiplier=2.0,
            min_loss_scale=0.5,
            max_loss_scale=2.0**7,
        )
        config = _config(kwargs)
        scale = keras_mp.DynamicLossScale(**kwargs)
        scale.build()
        variables = scale.variables

        @jax.jit
        def step(values, is_finite):
            mapping = list(zip(variables, values))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                should_apply = scale.update(is_finite)
            new_values = [scope.get_current_value(v) for v in variables]
            return new_values, should_apply

        values = [v.value for v in variables]
        expected = (config["initial_loss_scale"], 0)
        flags = _flags(seed=7, count=40, finite_fraction=0.75)
        for is_finite in flags:
            values, should_apply = step(values, np.asarray(is_finite))
            expected = _reference_update(*expected, is_finite, config)
            assert bool(should_apply) is is_finite
            assert (float(values[0]), int(values[1])) == expected
            _check_invariants(expected[0], config)
        assert str(values[0].dtype) == "float32"
        # The stateless step left the variables untouched.
        assert _state(scale) == (config["initial_loss_scale"], 0)
        assert step._cache_size() == 1

    @pytest.mark.backends("tensorflow")
    def test_update_inside_tf_function(self):
        import tensorflow as tf

        kwargs = dict(
            initial_loss_scale=2.0**5,
            increment_period=3,
            multiplier=2.0,
            min_loss_scale=0.5,
            max_loss_scale=2.0**7,
        )
        config = _config(kwargs)
        scale = keras_mp.DynamicLossScale(**kwargs)
        scale.build()

        @tf.function(jit_compile=False)
        def step(is_finite):
            return scale.update(is_finite)

        expected = (config["initial_loss_scale"], 0)
        flags = _flags(seed=7, count=40, finite_fraction=0.75)
        for is_finite in flags:
            should_apply = step(tf.constant(is_finite))
            expected = _reference_update(*expected, is_finite, config)
            assert bool(should_apply) is is_finite
            assert _state(scale) == expected
            _check_invariants(expected[0], config)
        assert step.experimental_get_tracing_count() == 1

    @pytest.mark.backends("tensorflow")
    def test_update_inside_xla_compiled_tf_function(self):
        import tensorflow as tf

        scale = keras_mp.DynamicLossScale(
            initial_loss_scale=4, increment_period=2, min_loss_scale=1
        )
        scale.build()
        step = tf.function(scale.update, jit_compile=True)
        config = scale.get_config()
        expected = (4.0, 0)
        for is_finite in [True, True, False, False, False, True, True]:
            step(tf.constant(is_finite))
            expected = _reference_update(*expected, is_finite, config)
            assert _state(scale) == expected


class TestGet:
    def test_none_and_instances_pass_through(self):
        assert loss_scale_module.get(None) is None
        scale = keras_mp.FixedLossScale(4)
        assert loss_scale_module.get(scale) is scale

    def test_dynamic_gives_default_dynamic_scale(self):
        scale = loss_scale_module.get("dynamic")
        assert isinstance(scale, keras_mp.DynamicLossScale)
        assert scale.get_config() == keras_mp.DynamicLossScale().get_config()

    @pytest.mark.parametrize("value", [128, 256.0, np.float32(8)])
    def test_number_gives_fixed_scale(self, value):
        scale = loss_scale_module.get(value)
        assert isinstance(scale, keras_mp.FixedLossScale)
        assert scale.loss_scale_value == float(value)

    def test_config_dict_gives_the_described_scale(self):
        original = keras_mp.DynamicLossScale(
            initial_loss_scale=64, increment_period=3, max_loss_scale=1024
        )
        config = keras.saving.serialize_keras_object(original)
        scale = loss_scale_module.get(config)
        assert isinstance(scale, keras_mp.DynamicLossScale)
        assert scale.get_config() == original.get_config()

    def test_unknown_name_raises_value_error(self):
        with pytest.raises(ValueError, match="'dynamic'") as info:
            loss_scale_module.get("static")
        assert "loss_scale='static'" in str(info.value)

    def test_dict_without_class_name_raises_value_error(self):
        with pytest.raises(ValueError, match="class_name"):
            loss_scale_module.get({"initial_loss_scale": 2})

    def test_config_of_another_class_raises_value_error(self):
        config = keras.saving.serialize_keras_object(keras.layers.Dense(1))
        with pytest.raises(ValueError, match="Expected a loss scale config"):
            loss_scale_module.get(config)

    @pytest.mark.parametrize("value", [True, [2], object()])
    def test_other_types_raise_type_error(self, value):
        with pytest.raises(TypeError, match="`loss_scale` must be") as info:
            loss_scale_module.get(value)
        assert type(value).__name__ in str(info.value)


class TestLossScaleBase:
    def test_base_class_leaves_value_update_and_config_to_subclasses(self):
        base = keras_mp.LossScale()
        with pytest.raises(NotImplementedError):
            base()
        with pytest.raises(NotImplementedError):
            base.update(True)
        with pytest.raises(NotImplementedError):
            base.get_config()
        assert not base.is_dynamic
        assert base.variables == []

    def test_subclass_works_where_a_loss_scale_is_expected(self):
        class HalfFiniteScale(keras_mp.LossScale):
            def __call__(self):
                return keras.ops.convert_to_tensor(2.0, "float32")

            def update(self, is_finite):
                return keras.ops.convert_to_tensor(is_finite, "bool")

            def get_config(self):
                return {}

        scale = HalfFiniteScale()
        assert loss_scale_module.get(scale) is scale
        policy = keras_mp.Policy("mixed_float16", loss_scale=scale)
        assert policy.loss_scale is scale
        assert repr(scale) == "HalfFiniteScale()"
