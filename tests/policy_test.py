"""Tests of keras_mp.policy: Policy, the global policy and policy_scope."""

import threading
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.backend import devices
from keras_mp.testing import to_numpy

_NON_DEFAULT_DYNAMIC = dict(
    initial_loss_scale=2.0**9,
    increment_period=11,
    multiplier=4.0,
    min_loss_scale=0.5,
    max_loss_scale=2.0**24,
)


@pytest.fixture
def hardware_checked(monkeypatch):
    """Marks the hardware check as done, so it warns about nothing."""
    monkeypatch.setattr(
        devices, "_checked_policies", {"mixed_float16", "mixed_bfloat16"}
    )


def _in_thread(function):
    results = {}

    def target():
        try:
            results["value"] = function()
        except BaseException as error:  # re-raised in the main thread
            results["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in results:
        raise results["error"]
    return results["value"]


class TestPolicy:
    @pytest.mark.parametrize(
        "name, compute_dtype, variable_dtype",
        [
            ("mixed_float16", "float16", "float32"),
            ("mixed_bfloat16", "bfloat16", "float32"),
            ("float32", "float32", "float32"),
            ("float16", "float16", "float16"),
            ("bfloat16", "bfloat16", "bfloat16"),
            ("float64", "float64", "float64"),
        ],
    )
    def test_names_give_compute_and_variable_dtypes(
        self, name, compute_dtype, variable_dtype
    ):
        policy = keras_mp.Policy(name)
        assert policy.name == name
        assert policy.compute_dtype == compute_dtype
        assert policy.variable_dtype == variable_dtype

    def test_policy_is_a_keras_dtype_policy_that_layers_accept(self):
        policy = keras_mp.Policy("mixed_bfloat16")
        assert isinstance(policy, keras.DTypePolicy)
        layer = keras.layers.Dense(2, dtype=policy)
        assert layer.dtype_policy is policy
        assert layer.compute_dtype == "bfloat16"
        assert layer.variable_dtype == "float32"
        outputs = layer(np.ones((1, 3), "float32"))
        assert keras.backend.standardize_dtype(outputs.dtype) == "bfloat16"

    def test_auto_loss_scale_is_dynamic_only_for_mixed_float16(self):
        loss_scale = keras_mp.Policy("mixed_float16").loss_scale
        assert isinstance(loss_scale, keras_mp.DynamicLossScale)
        assert loss_scale.get_config() == (
            keras_mp.DynamicLossScale().get_config()
        )
        for name in ("mixed_bfloat16", "float32", "float16", "bfloat16"):
            assert keras_mp.Policy(name).loss_scale is None, name

    def test_each_auto_policy_gets_its_own_loss_scale(self):
        first = keras_mp.Policy("mixed_float16").loss_scale
        second = keras_mp.Policy("mixed_float16").loss_scale
        assert first is not second

    def test_loss_scale_none_disables_scaling(self):
        assert keras_mp.Policy("mixed_float16", loss_scale=None).loss_scale is (
            None
        )

    def test_loss_scale_dynamic_name(self):
        policy = keras_mp.Policy("mixed_bfloat16", loss_scale="dynamic")
        assert isinstance(policy.loss_scale, keras_mp.DynamicLossScale)

    def test_loss_scale_number_gives_fixed_scale(self):
        policy = keras_mp.Policy("mixed_float16", loss_scale=1024)
        assert isinstance(policy.loss_scale, keras_mp.FixedLossScale)
        assert float(to_numpy(policy.loss_scale())) == 1024.0

    def test_loss_scale_instance_is_kept(self):
        scale = keras_mp.DynamicLossScale(**_NON_DEFAULT_DYNAMIC)
        assert keras_mp.Policy("mixed_float16", scale).loss_scale is scale

    def test_loss_scale_config_dict_is_deserialized(self):
        scale = keras_mp.DynamicLossScale(**_NON_DEFAULT_DYNAMIC)
        config = keras.saving.serialize_keras_object(scale)
        policy = keras_mp.Policy("mixed_float16", loss_scale=config)
        assert isinstance(policy.loss_scale, keras_mp.DynamicLossScale)
        assert policy.loss_scale.get_config() == scale.get_config()

    @pytest.mark.parametrize("loss_scale", ["static", {"a": 1}])
    def test_bad_loss_scale_value_raises_value_error(self, loss_scale):
        with pytest.raises(ValueError, match="Received: loss_scale="):
            keras_mp.Policy("mixed_float16", loss_scale=loss_scale)

    @pytest.mark.parametrize("loss_scale", [True, [8], object()])
    def test_bad_loss_scale_type_raises_type_error(self, loss_scale):
        with pytest.raises(TypeError, match="Received: loss_scale="):
            keras_mp.Policy("mixed_float16", loss_scale=loss_scale)

    def test_fixed_loss_scale_below_one_raises_value_error(self):
        with pytest.raises(ValueError, match="at least 1"):
            keras_mp.Policy("mixed_float16", loss_scale=0.5)

    @pytest.mark.parametrize(
        "attribute", ["name", "compute_dtype", "variable_dtype", "loss_scale"]
    )
    def test_properties_are_read_only(self, attribute):
        policy = keras_mp.Policy("mixed_float16")
        with pytest.raises(AttributeError):
            setattr(policy, attribute, "float32")

    @pytest.mark.parametrize(
        "name", ["mixed_float32", "mixed_float", "float", "fp16", ""]
    )
    def test_bad_name_raises_value_error_listing_valid_names(self, name):
        with pytest.raises(ValueError) as info:
            keras_mp.Policy(name)
        message = str(info.value)
        for valid in ("'mixed_float16'", "'mixed_bfloat16'", "'float32'"):
            assert valid in message
        assert f"Received: name={name!r}" in message

    def test_quantized_name_raises_value_error_naming_keras_api(self):
        with pytest.raises(ValueError, match="quantiz") as info:
            keras_mp.Policy("int8_from_float32")
        assert "keras.dtype_policies.get" in str(info.value)
        assert "Received: name='int8_from_float32'" in str(info.value)

    @pytest.mark.parametrize("name", [16, None, keras.DTypePolicy("float32")])
    def test_non_string_name_raises_type_error(self, name):
        with pytest.raises(TypeError) as info:
            keras_mp.Policy(name)
        message = str(info.value)
        assert "'mixed_float16'" in message
        assert f"(of type {type(name).__name__})" in message

    @pytest.mark.parametrize(
        "loss_scale",
        [
            keras_mp.DynamicLossScale(**_NON_DEFAULT_DYNAMIC),
            keras_mp.FixedLossScale(96),
            None,
        ],
        ids=["dynamic", "fixed", "none"],
    )
    def test_config_round_trip_keeps_the_loss_scale(self, loss_scale):
        policy = keras_mp.Policy("mixed_float16", loss_scale=loss_scale)
        config = policy.get_config()
        assert config["name"] == "mixed_float16"
        restored = keras_mp.Policy.from_config(config)
        assert restored == policy
        if loss_scale is None:
            assert restored.loss_scale is None
        else:
            assert type(restored.loss_scale) is type(loss_scale)
            assert restored.loss_scale is not loss_scale
            assert restored.loss_scale.get_config() == loss_scale.get_config()

    def test_serialize_round_trip_uses_registered_name(self):
        policy = keras_mp.Policy(
            "mixed_bfloat16", keras_mp.DynamicLossScale(**_NON_DEFAULT_DYNAMIC)
        )
        serialized = keras.saving.serialize_keras_object(policy)
        assert serialized["registered_name"] == "keras_mp>Policy"
        restored = keras.saving.deserialize_keras_object(serialized)
        assert isinstance(restored, keras_mp.Policy)
        assert restored == policy
        assert keras.dtype_policies.deserialize(serialized) == policy

    @pytest.mark.parametrize(
        "config",
        [{"loss_scale": None}, "mixed_float16", {"name": "float32", "x": 1}],
    )
    def test_malformed_config_raises_value_error(self, config):
        with pytest.raises(ValueError, match="Policy config"):
            keras_mp.Policy.from_config(config)

    def test_equality_compares_name_and_loss_scale(self):
        assert keras_mp.Policy("mixed_float16") == keras_mp.Policy(
            "mixed_float16"
        )
        assert keras_mp.Policy("mixed_float16", 8) != keras_mp.Policy(
            "mixed_float16", 16
        )
        assert keras_mp.Policy("mixed_float16", None) != keras_mp.Policy(
            "mixed_float16"
        )
        assert keras_mp.Policy("float32") != keras_mp.Policy("float64")

    def test_equal_to_keras_float_policy_that_means_the_same(self):
        # What `keras.config.set_dtype_policy(keras.DTypePolicy(name))`
        # gives is `Policy(name)`; Keras's own tests compare the two.
        for name in ("float32", "mixed_bfloat16", "mixed_float16"):
            assert keras_mp.Policy(name) == keras.DTypePolicy(name)
            assert keras.DTypePolicy(name) == keras_mp.Policy(name)
        assert keras_mp.Policy("float32") != keras.DTypePolicy("float64")
        # A loss scale or a recipe other than the name's own is a choice
        # Keras's policy does not hold.
        assert keras_mp.Policy("mixed_float16", None) != keras.DTypePolicy(
            "mixed_float16"
        )
        assert keras_mp.Policy("float32", 8) != keras.DTypePolicy("float32")
        assert keras_mp.Policy("mixed_bfloat16", fp8=True) != (
            keras.DTypePolicy("mixed_bfloat16")
        )
        assert keras_mp.Policy("float32") != (
            keras.dtype_policies.QuantizedDTypePolicy("int8", "float32")
        )

    def test_keras_clear_session_forgets_only_a_policy_keras_set(self):
        # As in Keras: `clear_session` undoes `keras.config.set_dtype_policy`.
        keras.config.set_dtype_policy("mixed_bfloat16")
        assert keras_mp.global_policy().name == "mixed_bfloat16"
        keras.utils.clear_session()
        assert keras.config.dtype_policy().name == "float32"
        assert keras_mp.global_policy().name == "float32"
        assert keras.layers.Dense(2).compute_dtype == "float32"
        # keras_mp's own global policy, with its recipe, outlives it.
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        keras.utils.clear_session()
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
        layer = keras.layers.Dense(32)
        layer.build((None, 32))
        assert layer.dtype_policy.fp8 is not None

    def test_repr_shows_name_and_loss_scale(self):
        text = repr(keras_mp.Policy("mixed_float16", loss_scale=64))
        assert "mixed_float16" in text
        assert "FixedLossScale" in text


class TestLayerSerialization:
    def _policy(self):
        return keras_mp.Policy(
            "mixed_float16", keras_mp.DynamicLossScale(**_NON_DEFAULT_DYNAMIC)
        )

    def _assert_same_policy(self, layer, policy):
        assert isinstance(layer.dtype_policy, keras_mp.Policy)
        assert layer.dtype_policy == policy
        assert layer.dtype_policy.loss_scale.get_config() == (
            policy.loss_scale.get_config()
        )

    def test_layer_serialize_deserialize_keeps_keras_mp_policy(self):
        policy = self._policy()
        layer = keras.layers.Dense(3, dtype=policy)
        restored = keras.layers.deserialize(keras.layers.serialize(layer))
        self._assert_same_policy(restored, policy)
        assert restored.compute_dtype == "float16"

    def test_layer_from_config_keeps_keras_mp_policy(self):
        policy = keras_mp.Policy("mixed_bfloat16", loss_scale=32)
        layer = keras.layers.Dense(3, dtype=policy)
        restored = keras.layers.Dense.from_config(layer.get_config())
        assert restored.dtype_policy == policy

    def test_keras_dtype_policy_layers_still_reload_as_keras_policies(self):
        layer = keras.layers.Dense(3, dtype="mixed_bfloat16")
        restored = keras.layers.deserialize(keras.layers.serialize(layer))
        assert not isinstance(restored.dtype_policy, keras_mp.Policy)
        assert restored.dtype_policy.name == "mixed_bfloat16"

    @pytest.mark.parametrize("kind", ["sequential", "functional"])
    def test_saved_model_reloads_layers_with_their_policy(self, kind, tmp_path):
        policy = self._policy()
        if kind == "sequential":
            model = keras.Sequential(
                [keras.Input((3,)), keras.layers.Dense(2, dtype=policy)]
            )
        else:
            inputs = keras.Input((3,))
            outputs = keras.layers.Dense(2, dtype=policy)(inputs)
            model = keras.Model(inputs, outputs)
        path = str(tmp_path / "model.keras")
        model.save(path)
        with keras_mp.policy_scope("float64"):
            restored = keras.models.load_model(path)
        dense = restored.layers[-1]
        self._assert_same_policy(dense, policy)
        assert isinstance(dense.kernel, keras_mp.AutoCastVariable)
        np.testing.assert_array_equal(
            to_numpy(dense.kernel), to_numpy(model.layers[-1].kernel)
        )


class TestGlobalPolicy:
    def test_unset_global_policy_tracks_floatx_on_every_call(self):
        policy = keras_mp.global_policy()
        assert isinstance(policy, keras_mp.Policy)
        assert policy.name == "float32"
        keras.config.set_floatx("float64")
        assert keras_mp.global_policy().name == "float64"
        assert keras.layers.Dense(2).compute_dtype == "float64"
        keras.config.set_floatx("float16")
        assert keras_mp.global_policy().name == "float16"
        assert keras.config.dtype_policy().name == "float16"

    def test_set_global_policy_stops_tracking_floatx(self, hardware_checked):
        keras_mp.set_global_policy("mixed_bfloat16")
        keras.config.set_floatx("float64")
        assert keras_mp.global_policy().name == "mixed_bfloat16"
        assert keras.layers.Dense(2).compute_dtype == "bfloat16"

    def test_set_global_policy_none_returns_to_tracking_floatx(
        self, hardware_checked
    ):
        keras_mp.set_global_policy("mixed_bfloat16")
        keras_mp.set_global_policy(None)
        assert keras_mp.global_policy().name == "float32"
        # Asking Keras must not pin the policy it answers.
        assert keras.config.dtype_policy().name == "float32"
        keras.config.set_floatx("float64")
        assert keras_mp.global_policy().name == "float64"
        assert keras.layers.Dense(2).compute_dtype == "float64"

    def test_global_policy_becomes_keras_global_dtype_policy(
        self, hardware_checked
    ):
        keras_mp.set_global_policy("mixed_float16")
        assert keras.config.dtype_policy().name == "mixed_float16"
        for layer in (
            keras.layers.Dense(2),
            keras.layers.Conv2D(2, 3),
            keras.layers.Embedding(4, 2),
        ):
            assert layer.compute_dtype == "float16"
            assert layer.variable_dtype == "float32"
            assert layer.dtype_policy is keras_mp.global_policy()

    def test_policy_object_is_kept_with_its_loss_scale(self, hardware_checked):
        policy = keras_mp.Policy("mixed_float16", loss_scale=512)
        keras_mp.set_global_policy(policy)
        assert keras_mp.global_policy() is policy
        assert keras.layers.Dense(2).dtype_policy.loss_scale is (
            policy.loss_scale
        )

    def test_name_gives_policy_with_auto_loss_scale(self, hardware_checked):
        keras_mp.set_global_policy("mixed_float16")
        policy = keras_mp.global_policy()
        assert isinstance(policy, keras_mp.Policy)
        assert isinstance(policy.loss_scale, keras_mp.DynamicLossScale)

    def test_keras_dtype_policy_is_accepted(self, hardware_checked):
        keras_mp.set_global_policy(keras.DTypePolicy("mixed_bfloat16"))
        policy = keras_mp.global_policy()
        assert isinstance(policy, keras_mp.Policy)
        assert policy.name == "mixed_bfloat16"
        assert keras.layers.Dense(2).compute_dtype == "bfloat16"

    @pytest.mark.parametrize(
        "policy", ["int32", "uint8", "bool", keras.DTypePolicy("int32")]
    )
    def test_non_float_global_policy_raises_value_error(self, policy):
        with pytest.raises(ValueError, match="floating-point") as info:
            keras_mp.set_global_policy(policy)
        assert "Received: policy=" in str(info.value)
        assert keras_mp.global_policy().name == "float32"

    def test_quantized_global_policy_raises_value_error(self):
        quantized = keras.dtype_policies.get("int8_from_float32")
        with pytest.raises(ValueError, match="quantized"):
            keras_mp.set_global_policy(quantized)

    @pytest.mark.parametrize("policy", [16, 1.5, object(), ["float32"]])
    def test_wrong_type_raises_type_error_naming_expected(self, policy):
        with pytest.raises(TypeError) as info:
            keras_mp.set_global_policy(policy)
        message = str(info.value)
        assert "keras_mp.Policy" in message
        assert "keras.DTypePolicy" in message
        assert f"(of type {type(policy).__name__})" in message

    def test_unknown_name_raises_value_error_and_keeps_policy(
        self, hardware_checked
    ):
        keras_mp.set_global_policy("mixed_bfloat16")
        with pytest.raises(ValueError, match="Received: name='mixed_flaot16'"):
            keras_mp.set_global_policy("mixed_flaot16")
        assert keras_mp.global_policy().name == "mixed_bfloat16"

    @pytest.mark.parametrize("name", ["float16", "bfloat16"])
    def test_low_precision_global_policy_warns_and_names_mixed(self, name):
        with pytest.warns(UserWarning, match=f"'mixed_{name}'"):
            keras_mp.set_global_policy(name)
        assert keras_mp.global_policy().name == name

    @pytest.mark.parametrize(
        "name", ["mixed_float16", "mixed_bfloat16", "float32", "float64"]
    )
    def test_other_global_policies_do_not_warn(self, name, hardware_checked):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            keras_mp.set_global_policy(name)

    def test_hardware_check_waits_for_the_first_mixed_layer(self, monkeypatch):
        checked = []
        monkeypatch.setattr(devices, "check_hardware_once", checked.append)
        keras_mp.set_global_policy("mixed_bfloat16")
        keras_mp.set_global_policy(keras_mp.Policy("mixed_float16"))
        assert checked == []
        keras.layers.Dense(1).build((None, 2))
        keras.layers.Dense(1, dtype="mixed_bfloat16").build((None, 2))
        assert set(checked) == {"mixed_bfloat16", "mixed_float16"}


class TestGlobalPolicyAcrossThreads:
    def test_layer_built_in_worker_thread_sees_the_policy(
        self, hardware_checked
    ):
        keras_mp.set_global_policy("mixed_bfloat16")

        def build():
            layer = keras.layers.Dense(2)
            layer.build((None, 3))
            return layer

        layer = _in_thread(build)
        assert layer.compute_dtype == "bfloat16"
        assert isinstance(layer.kernel, keras_mp.AutoCastVariable)
        assert _in_thread(lambda: keras_mp.global_policy().name) == (
            "mixed_bfloat16"
        )

    def test_keras_query_in_worker_does_not_hide_the_policy(
        self, hardware_checked
    ):
        keras_mp.set_global_policy("mixed_bfloat16")

        def query_then_build():
            queried = keras.config.dtype_policy().name
            return queried, keras.layers.Dense(2).compute_dtype

        assert _in_thread(query_then_build) == ("mixed_bfloat16", "bfloat16")

    def test_policy_set_in_worker_thread_applies_to_main_thread(
        self, hardware_checked
    ):
        keras_mp.set_global_policy("mixed_bfloat16")
        _in_thread(lambda: keras_mp.set_global_policy("float64"))
        assert keras_mp.global_policy().name == "float64"
        assert keras.layers.Dense(2).compute_dtype == "float64"
        assert keras.config.dtype_policy().name == "float64"

    def test_policy_scope_is_seen_only_by_its_thread(self):
        keras_mp.set_global_policy("float64")
        with keras_mp.policy_scope("mixed_bfloat16"):
            assert keras.layers.Dense(2).compute_dtype == "bfloat16"
            assert _in_thread(lambda: keras.layers.Dense(2).compute_dtype) == (
                "float64"
            )
            assert _in_thread(lambda: keras_mp.global_policy().name) == (
                "float64"
            )
        assert keras_mp.global_policy().name == "float64"

    def test_scopes_in_two_threads_do_not_leak_into_each_other(self):
        import threading

        inside = threading.Barrier(2)
        seen = {}

        def scoped(name):
            with keras_mp.policy_scope(name):
                inside.wait(timeout=30)
                seen[name] = (
                    keras_mp.global_policy().name,
                    keras.layers.Dense(1).compute_dtype,
                )
                inside.wait(timeout=30)

        threads = [
            threading.Thread(target=scoped, args=(name,))
            for name in ("float64", "mixed_bfloat16")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert seen == {
            "float64": ("float64", "float64"),
            "mixed_bfloat16": ("mixed_bfloat16", "bfloat16"),
        }
        assert keras_mp.global_policy().name == "float32"

    def test_scope_restores_what_it_replaced_after_a_global_change(self):
        keras_mp.set_global_policy("float64")
        with keras_mp.policy_scope("mixed_bfloat16"):
            keras_mp.set_global_policy("mixed_float16")
            assert keras_mp.global_policy().name == "mixed_bfloat16"
        assert keras_mp.global_policy().name == "mixed_float16"

    def test_scope_takes_fp8_and_float32_islands_like_set_global_policy(self):
        def built(units=32, cls=keras.layers.Dense):
            layer = cls(units) if cls is keras.layers.Dense else cls()
            if cls is keras.layers.Dense:
                layer.build((None, 64))
            return layer

        recipe = keras_mp.fp8.Recipe(granularity="rowwise")
        with keras_mp.policy_scope(
            "mixed_bfloat16", float32_islands="default", fp8=recipe
        ):
            assert built().dtype_policy.fp8 == recipe
            assert built(cls=keras.layers.Softmax).compute_dtype == "float32"
            # Only this thread's layers take them.
            assert (
                _in_thread(lambda: getattr(built().dtype_policy, "fp8", None))
                is None
            )
        assert getattr(built().dtype_policy, "fp8", None) is None
        assert built(cls=keras.layers.Softmax).compute_dtype == "float32"
        # As `set_global_policy(policy)` does, a scope without them has
        # none inside, and restores the global ones after.
        keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
        with keras_mp.policy_scope("mixed_bfloat16"):
            assert built().dtype_policy.fp8 is None
            with keras_mp.policy_scope("mixed_bfloat16", fp8=recipe):
                assert built().dtype_policy.fp8 == recipe
            assert built().dtype_policy.fp8 is None
        assert built().dtype_policy.fp8 == keras_mp.fp8.DEFAULT_RECIPE

    @pytest.mark.parametrize(
        "arguments, error",
        [
            ({"fp8": "yes"}, TypeError),
            ({"float32_islands": "all"}, ValueError),
            ({"fp8": {"granularity": "columnwise"}}, ValueError),
        ],
    )
    def test_bad_scope_arguments_change_nothing(self, arguments, error):
        keras_mp.set_global_policy("float64")
        with (
            pytest.raises(error),
            keras_mp.policy_scope("mixed_bfloat16", **arguments),
        ):
            pass
        assert keras_mp.global_policy().name == "float64"
        assert keras.layers.Dense(2).compute_dtype == "float64"


class TestOneSourceOfTruthWithKeras:
    @pytest.mark.parametrize(
        "setter",
        [
            lambda p: keras.mixed_precision.set_global_policy(p),
            lambda p: keras.mixed_precision.set_dtype_policy(p),
            lambda p: keras.config.set_dtype_policy(p),
        ],
        ids=["set_global_policy", "mixed_precision.set_dtype_policy", "config"],
    )
    def test_keras_setters_set_the_keras_mp_global_policy(self, setter):
        keras_mp.set_global_policy("float64")
        setter("mixed_bfloat16")
        assert keras_mp.global_policy().name == "mixed_bfloat16"
        assert keras.layers.Dense(1).compute_dtype == "bfloat16"
        assert _in_thread(lambda: keras_mp.global_policy().name) == (
            "mixed_bfloat16"
        )
        keras_mp.set_global_policy("float32")
        assert keras.mixed_precision.global_policy().name == "float32"

    def test_keras_mixed_float16_gets_the_keras_mp_loss_scale(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        policy = keras_mp.global_policy()
        assert isinstance(policy, keras_mp.Policy)
        assert isinstance(policy.loss_scale, keras_mp.DynamicLossScale)

    def test_dtype_policy_map_is_accepted_and_its_entries_honoured(self):
        policy_map = keras.dtype_policies.DTypePolicyMap(
            default_policy=keras_mp.Policy("mixed_float16")
        )
        policy_map["head"] = keras.DTypePolicy("float32")
        keras_mp.set_global_policy(policy_map)
        assert keras_mp.global_policy() is policy_map
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, name="hidden")
        head = keras.layers.Dense(1, name="head")
        model = keras.Model(inputs, head(hidden(inputs)))
        assert hidden.compute_dtype == "float16"
        assert isinstance(hidden.kernel, keras_mp.AutoCastVariable)
        assert head.compute_dtype == "float32"
        assert not isinstance(head.kernel, keras_mp.AutoCastVariable)
        model.compile("sgd", "mean_squared_error")
        assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)

    def test_dtype_policy_map_of_a_non_float_default_is_rejected(self):
        policy_map = keras.dtype_policies.DTypePolicyMap(
            default_policy=keras.DTypePolicy("int32")
        )
        with pytest.raises(ValueError, match="floating-point"):
            keras_mp.set_global_policy(policy_map)


class TestPolicyScope:
    def test_scope_sets_and_restores_unset_policy(self):
        with keras_mp.policy_scope("float64"):
            assert keras_mp.global_policy().name == "float64"
            assert keras.layers.Dense(1).compute_dtype == "float64"
        assert keras_mp.global_policy().name == "float32"
        keras.config.set_floatx("float16")
        # Restored to "unset", so it tracks floatx again.
        assert keras_mp.global_policy().name == "float16"

    def test_scopes_nest_and_restore_the_previous_policy_object(
        self, hardware_checked
    ):
        outer = keras_mp.Policy("mixed_float16", loss_scale=8)
        keras_mp.set_global_policy(outer)
        with keras_mp.policy_scope("mixed_bfloat16"):
            with keras_mp.policy_scope(keras.DTypePolicy("float64")):
                assert keras_mp.global_policy().name == "float64"
            assert keras_mp.global_policy().name == "mixed_bfloat16"
        assert keras_mp.global_policy() is outer
        assert keras.layers.Dense(1).dtype_policy is outer

    def test_scope_restores_after_an_exception(self):
        with pytest.raises(RuntimeError), keras_mp.policy_scope("float64"):
            raise RuntimeError("inside the scope")
        assert keras_mp.global_policy().name == "float32"
        assert keras.layers.Dense(1).compute_dtype == "float32"

    def test_invalid_policy_in_scope_raises_and_changes_nothing(self):
        with pytest.raises(ValueError), keras_mp.policy_scope("int32"):
            pass
        assert keras_mp.global_policy().name == "float32"


class _RecordInputDtype(keras.layers.Layer):
    """Records the dtype it receives (when traced, inside compiled steps)."""

    def __init__(self, **kwargs):
        # autocast=False: Keras would otherwise cast the input to float32.
        super().__init__(autocast=False, **kwargs)
        self.seen = []

    def call(self, inputs):
        self.seen.append(keras.backend.standardize_dtype(inputs.dtype))
        return keras.ops.cast(inputs, "float32")


def _dtype(tensor):
    return keras.backend.standardize_dtype(tensor.dtype)


class TestOutputDtype:
    @pytest.mark.parametrize(
        "spec, name, dtypes",
        [
            (
                "params=float32,compute=bfloat16,output=float32",
                "params=float32,compute=bfloat16,output=float32",
                ("float32", "bfloat16", "float32"),
            ),
            (
                "p=f32,c=f16,o=full",
                "params=float32,compute=float16,output=float32",
                ("float32", "float16", "float32"),
            ),
            (
                " c = bf16 ",
                "mixed_bfloat16",
                ("float32", "bfloat16", "bfloat16"),
            ),
            ("p=f16,c=f16", "float16", ("float16", "float16", "float16")),
            ("p=bf16", "bfloat16", ("bfloat16", "bfloat16", "bfloat16")),
            (
                "compute=float32,params=bfloat16",
                "params=bfloat16,compute=float32,output=float32",
                ("bfloat16", "float32", "float32"),
            ),
            (
                "o=f64",
                "params=float32,compute=float32,output=float64",
                ("float32", "float32", "float64"),
            ),
            ("f16", "float16", ("float16", "float16", "float16")),
            ("full", "float32", ("float32", "float32", "float32")),
        ],
    )
    def test_jmp_specs_give_params_compute_output_and_shortest_name(
        self, spec, name, dtypes
    ):
        policy = keras_mp.Policy(spec)
        assert policy.name == name
        assert (
            policy.variable_dtype,
            policy.compute_dtype,
            policy.output_dtype,
        ) == dtypes
        assert keras_mp.Policy(policy.name) == policy

    def test_half_is_float16_off_tpu_as_in_jmp(self):
        kinds = {d["kind"] for d in devices.device_details()}
        expected = "bfloat16" if "tpu" in kinds else "float16"
        policy = keras_mp.Policy("c=half")
        assert policy.compute_dtype == expected
        assert policy.variable_dtype == "float32"

    @pytest.mark.parametrize(
        "name", ["mixed_float16", "mixed_bfloat16", "float32", "bfloat16"]
    )
    def test_names_keep_output_equal_to_compute(self, name):
        policy = keras_mp.Policy(name)
        assert policy.output_dtype == policy.compute_dtype

    def test_output_dtype_is_read_only(self):
        policy = keras_mp.Policy("p=f32,c=bf16,o=f32")
        with pytest.raises(AttributeError):
            policy.output_dtype = "float16"

    def test_auto_loss_scale_follows_float16_compute_with_float32_params(self):
        scaled = keras_mp.Policy("p=f32,c=f16,o=f32")
        assert isinstance(scaled.loss_scale, keras_mp.DynamicLossScale)
        assert keras_mp.Policy("p=f16,c=f16,o=f32").loss_scale is None
        assert keras_mp.Policy("p=f32,c=bf16,o=f32").loss_scale is None

    @pytest.mark.parametrize(
        "spec, fragment",
        [
            ("p=f32,x=f16", "Unknown key 'x'"),
            ("c=f8", "Unknown dtype 'f8'"),
            ("c=int8", "Unknown dtype 'int8'"),
            ("p=f32,p=f16", "gives 'params' twice"),
            ("p=f32,c", "Unknown key 'c'"),
        ],
    )
    def test_bad_spec_raises_value_error_listing_keys_and_dtypes(
        self, spec, fragment
    ):
        with pytest.raises(ValueError) as info:
            keras_mp.Policy(spec)
        message = str(info.value)
        assert fragment in message
        for valid in ("p/c/o", "'bf16'", "'f16'", "'full'", "'half'"):
            assert valid in message
        assert f"Received: name={spec!r}" in message

    def test_spec_config_round_trips_with_its_loss_scale(self):
        policy = keras_mp.Policy("p=f32,c=f16,o=f32", loss_scale=64)
        restored = keras_mp.Policy.from_config(policy.get_config())
        assert restored == policy
        assert restored.output_dtype == "float32"
        assert float(to_numpy(restored.loss_scale())) == 64.0

    @pytest.mark.parametrize(
        "make_layer, input_shape",
        [
            (lambda dtype: keras.layers.Dense(3, dtype=dtype), (2, 4)),
            (
                lambda dtype: keras.layers.Conv2D(2, 3, dtype=dtype),
                (1, 5, 5, 2),
            ),
            (
                lambda dtype: keras.layers.Activation("softmax", dtype=dtype),
                (2, 4),
            ),
        ],
        ids=["Dense", "Conv2D", "Activation"],
    )
    def test_built_in_layers_return_the_output_dtype(
        self, make_layer, input_shape
    ):
        policy = keras_mp.Policy("p=f32,c=bf16,o=f32")
        layer = make_layer(policy)
        eager = layer(np.ones(input_shape, "float32"))
        assert _dtype(eager) == "float32"
        symbolic = make_layer(policy)(keras.Input(input_shape[1:]))
        assert symbolic.dtype == "float32"
        # Computed in bfloat16: the output is bfloat16-rounded.
        reference = make_layer("mixed_bfloat16")
        reference.build(input_shape)
        reference.set_weights(layer.get_weights())
        x = np.random.default_rng(0).normal(size=input_shape)
        np.testing.assert_array_equal(
            to_numpy(layer(x)),
            to_numpy(reference(x)).astype("float32"),
        )

    def test_mixed_name_layers_still_return_the_compute_dtype(self):
        layer = keras.layers.Dense(2, dtype=keras_mp.Policy("mixed_bfloat16"))
        assert _dtype(layer(np.ones((1, 3)))) == "bfloat16"

    def test_output_dtype_reaches_the_next_layer_inside_fit_and_predict(self):
        record = _RecordInputDtype()
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(
            3, dtype=keras_mp.Policy("p=f32,c=bf16,o=f32")
        )(inputs)
        plain = keras.layers.Dense(3, dtype="mixed_bfloat16")(inputs)
        outputs = record(
            keras.layers.Concatenate(dtype="float32")(
                [
                    hidden,
                    keras.layers.Activation("linear", dtype="float32")(plain),
                ]
            )
        )
        model = keras.Model(inputs, outputs)
        assert set(record.seen) == {"float32"}
        model.compile("sgd", "mse")
        x = np.ones((4, 4), "float32")
        record.seen.clear()
        model.fit(x, np.ones((4, 6)), epochs=1, verbose=0)
        model.predict(x, verbose=0)
        assert record.seen and set(record.seen) == {"float32"}

    def test_output_cast_runs_inside_a_compiled_train_step(self):
        record = _RecordInputDtype()
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(
                    3, dtype=keras_mp.Policy("p=f32,c=bf16,o=f32")
                ),
                record,
            ]
        )
        model.compile("sgd", "mse", jit_compile=True)
        record.seen.clear()
        model.fit(np.ones((4, 4)), np.ones((4, 3)), epochs=1, verbose=0)
        assert record.seen and set(record.seen) == {"float32"}

    def test_output_cast_keeps_the_mask(self):
        inputs = np.array([[1, 2, 0]])
        embedding = keras.layers.Embedding(
            4, 2, mask_zero=True, dtype=keras_mp.Policy("p=f32,c=bf16,o=f32")
        )
        outputs = embedding(inputs)
        assert _dtype(outputs) == "float32"
        np.testing.assert_array_equal(
            to_numpy(outputs._keras_mask), [[True, True, False]]
        )

    def test_layer_with_a_spec_policy_reloads_with_it(self, tmp_path):
        policy = keras_mp.Policy("p=f32,c=bf16,o=f32", loss_scale=8)
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(2, dtype=policy)]
        )
        path = str(tmp_path / "model.keras")
        model.save(path)
        restored = keras.models.load_model(path)
        dense = restored.layers[-1]
        assert dense.dtype_policy == policy
        assert dense.dtype_policy.output_dtype == "float32"
        x = np.ones((2, 3), "float32")
        assert _dtype(restored(x)) == "float32"
        np.testing.assert_array_equal(to_numpy(restored(x)), to_numpy(model(x)))


class TestSavedPolicyFormat:
    """A layer's policy is saved without `class_name`, with a note for Keras.

    Keras alone then refuses it with an error that shows the note (see
    `tests/interop_test.py`); with keras_mp imported it loads as before.
    """

    def _policy(self):
        return keras_mp.Policy("p=f32,c=f16,o=f32", loss_scale=16)

    def test_layer_config_carries_the_note_and_no_class_name(self):
        config = keras.layers.Dense(2, dtype=self._policy()).get_config()
        dtype = config["dtype"]
        assert list(dtype)[0] == "keras_mp"
        assert "import keras_mp" in dtype["keras_mp"]
        assert "class_name" not in dtype
        assert dtype["registered_name"] == "keras_mp>Policy"
        plain = keras.saving.serialize_keras_object(self._policy())
        assert {k: v for k, v in dtype.items() if k != "keras_mp"} == {
            k: v for k, v in plain.items() if k != "class_name"
        }

    def test_keras_policies_are_saved_as_keras_writes_them(self):
        config = keras.layers.Dense(2, dtype="mixed_bfloat16").get_config()
        assert config["dtype"] == keras.saving.serialize_keras_object(
            keras.DTypePolicy("mixed_bfloat16")
        )

    def test_public_serialize_and_deserialize_round_trip(self):
        serialized = keras.dtype_policies.serialize(self._policy())
        assert "class_name" not in serialized
        restored = keras.dtype_policies.deserialize(serialized)
        assert restored == self._policy()
        assert keras.dtype_policies.get(serialized) == self._policy()

    def test_layer_saved_in_the_previous_format_loads_identically(self):
        layer = keras.layers.Dense(2, dtype=self._policy())
        layer.build((None, 3))
        new_format = layer.get_config()
        old_format = dict(
            new_format,
            dtype=keras.saving.serialize_keras_object(self._policy()),
        )
        assert "class_name" in old_format["dtype"]
        restored = [
            keras.layers.deserialize(
                {
                    "class_name": "Dense",
                    "config": config,
                    "module": "keras.layers",
                }
            )
            for config in (old_format, new_format)
        ]
        for other in restored:
            assert other.dtype_policy == layer.dtype_policy
            assert other.get_config() == new_format

    def test_custom_layer_building_itself_from_the_config_gets_the_policy(self):
        class Custom(keras.layers.Dense):
            @classmethod
            def from_config(cls, config):
                return cls(**config)

        config = Custom(2, dtype=self._policy()).get_config()
        assert Custom.from_config(config).dtype_policy == self._policy()
