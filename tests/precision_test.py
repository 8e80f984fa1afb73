"""Tests of keras_mp.precision: precision rules, float32 islands, explain."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import _keras_internals
from keras_mp.testing import to_numpy


def _dtype(tensor):
    return keras.backend.standardize_dtype(tensor.dtype)


def _functional(dtype=None):
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="hidden")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Softmax(name="attention")(x)
    x = keras.layers.Dense(4, name="mid")(x)
    outputs = keras.layers.Dense(3, name="logits", dtype=dtype)(x)
    return keras.Model(inputs, outputs)


class SubclassedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4)
        self.softmax = keras.layers.Softmax()
        self.head = keras.layers.Dense(2, name="head")

    def call(self, inputs):
        return self.head(self.softmax(self.hidden(inputs)))


def _rows(model, **kwargs):
    rows = keras_mp.explain_precision(model, print_fn=None, **kwargs)
    return {row["layer"]: row for row in rows}


def _assert_rows_match_the_layers(model):
    """explain_precision's dtypes are those the layers really use."""
    rows = _rows(model)
    layers = [
        layer
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    probe = keras.Model(model.inputs[0], [layer.output for layer in layers])
    x = np.random.default_rng(0).normal(size=(2, *model.inputs[0].shape[1:]))
    outputs = probe(x.astype("float32"))
    for layer, output in zip(layers, outputs):
        row = rows[layer.path or layer.name]
        assert row["output_dtype"] == _dtype(output), layer.name
        assert row["compute_dtype"] == layer.compute_dtype, layer.name
        for weight in layer.weights:
            assert _dtype(weight.value) == (
                keras.backend.standardize_dtype(weight.dtype)
            )
        for weight in layer.trainable_weights:
            assert row["variable_dtype"] == _dtype(weight.value), layer.name


class TestDefaultIslands:
    @pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
    def test_softmax_and_output_layer_are_float32_others_follow_policy(
        self, policy
    ):
        keras_mp.set_global_policy(policy, float32_islands="default")
        model = _functional()
        compute = keras_mp.Policy(policy).compute_dtype
        by_name = {layer.name: layer for layer in model.layers}
        assert by_name["hidden"].compute_dtype == compute
        assert by_name["norm"].compute_dtype == compute
        assert by_name["mid"].compute_dtype == compute
        assert by_name["attention"].compute_dtype == "float32"
        assert by_name["logits"].compute_dtype == "float32"
        assert by_name["logits"].variable_dtype == "float32"
        assert not isinstance(
            by_name["logits"].kernel, keras_mp.AutoCastVariable
        )
        assert isinstance(by_name["mid"].kernel, keras_mp.AutoCastVariable)
        assert _dtype(model(np.ones((2, 6), "float32"))) == "float32"
        _assert_rows_match_the_layers(model)

    def test_explain_names_the_rule_that_gave_each_dtype(self):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        rows = _rows(_functional())
        assert rows["attention"]["rule"] == (
            "DEFAULT_FLOAT32_ISLANDS: Softmax -> float32"
        )
        assert rows["logits"]["rule"] == (
            "DEFAULT_FLOAT32_ISLANDS: model outputs -> float32"
        )
        assert rows["hidden"]["rule"] == "global policy"
        assert rows["hidden"]["compute_dtype"] == "bfloat16"

    def test_sequential_final_softmax_dense_is_float32(self):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(4),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        first, last = model.layers
        assert first.compute_dtype == "bfloat16"
        assert last.compute_dtype == "float32"
        assert _dtype(model(np.ones((1, 5)))) == "float32"
        _assert_rows_match_the_layers(model)

    def test_a_second_model_on_the_same_layers_changes_nothing(self):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        model = _functional()
        features = keras.Model(model.inputs[0], model.get_layer("mid").output)
        assert model.get_layer("mid").compute_dtype == "bfloat16"
        assert _dtype(features(np.ones((1, 6)))) == "bfloat16"

    def test_subclassed_model_gets_class_rules_at_creation(self):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        model = SubclassedModel()
        assert model.softmax.compute_dtype == "float32"
        model.compile("sgd", "mse")
        model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0)
        assert model.hidden.compute_dtype == "bfloat16"
        # No layer graph: the output rule cannot see the head.
        assert model.head.compute_dtype == "bfloat16"
        rows = _rows(model)
        assert rows[model.softmax.name]["compute_dtype"] == "float32"

    def test_islands_apply_only_to_models_built_afterwards(self):
        keras_mp.set_global_policy("mixed_bfloat16")
        before = _functional()
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        after = _functional()
        keras_mp.set_global_policy("mixed_bfloat16")
        later = _functional()
        assert before.get_layer("attention").compute_dtype == "bfloat16"
        assert after.get_layer("attention").compute_dtype == "float32"
        assert later.get_layer("attention").compute_dtype == "bfloat16"

    def test_normalization_statistics_are_float32_in_keras_already(self):
        # Values 1000 and 1004 are exact in bfloat16, but their variance
        # (4) vanishes in bfloat16 arithmetic (1002**2 is rounded to a
        # multiple of 4096): only float32 statistics normalize them to +-1.
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        x = np.tile([[1000.0, 1004.0]], (4, 4)).reshape(8, 4)
        x[1::2] = x[1::2, ::-1]
        for layer in (
            keras.layers.BatchNormalization(axis=0),
            keras.layers.LayerNormalization(),
            keras.layers.GroupNormalization(groups=2),
        ):
            assert layer.compute_dtype == "bfloat16"
            outputs = layer(x.astype("float32"), training=True)
            assert _dtype(outputs) == "bfloat16"
            np.testing.assert_allclose(
                np.abs(to_numpy(outputs).astype("float32")),
                1.0,
                atol=2e-2,
                err_msg=type(layer).__name__,
            )


class TestRules:
    def test_user_rules_override_the_defaults_they_extend(self):
        rules = keras_mp.precision_rules(
            {keras.layers.Softmax: None, "hidden": "float32"},
            outputs="mixed_bfloat16",
            base="default",
        )
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands=rules)
        model = _functional()
        assert model.get_layer("attention").compute_dtype == "bfloat16"
        assert model.get_layer("hidden").compute_dtype == "float32"
        assert model.get_layer("logits").compute_dtype == "bfloat16"
        rows = _rows(model)
        assert rows["attention"]["rule"] == (
            "precision_rules: Softmax -> global policy"
        )
        assert rows["hidden"]["rule"] == (
            "precision_rules: path 'hidden' -> float32"
        )
        _assert_rows_match_the_layers(model)

    def test_explicit_dtype_is_kept(self):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        model = _functional(dtype="mixed_bfloat16")
        assert model.get_layer("logits").compute_dtype == "bfloat16"
        softmax = keras.layers.Softmax(dtype="mixed_bfloat16")
        assert softmax.compute_dtype == "bfloat16"
        assert _rows(model)["logits"]["rule"] == "dtype argument"

    def test_rules_can_give_spec_policies_with_an_output_dtype(self):
        rules = keras_mp.precision_rules({"mid": "p=f32,c=bf16,o=f32"})
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands=rules)
        model = _functional()
        mid = model.get_layer("mid")
        assert mid.compute_dtype == "bfloat16"
        assert mid.dtype_policy.output_dtype == "float32"
        # The output layer keeps the global policy: no outputs rule here.
        assert model.get_layer("logits").compute_dtype == "bfloat16"
        _assert_rows_match_the_layers(model)

    def test_path_rule_reaches_subclassed_model_layers_before_training(self):
        rules = keras_mp.precision_rules({".*/head": "float32"})
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands=rules)
        model = SubclassedModel()
        model.compile("sgd", "mse")
        model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0)
        assert model.head.compute_dtype == "float32"
        assert not isinstance(model.head.kernel, keras_mp.AutoCastVariable)
        predictions = model.predict(np.ones((2, 3)), verbose=0)
        assert predictions.dtype == np.float32
        assert _rows(model)[model.head.path]["rule"] == (
            "precision_rules: path '.*/head' -> float32"
        )

    def test_rules_on_a_pure_16_bit_policy_keep_built_weights_dtype(self):
        with pytest.warns(UserWarning, match="keeps the variables"):
            keras_mp.set_global_policy("bfloat16", float32_islands="default")
        model = _functional()
        logits = model.get_layer("logits")
        assert logits.variable_dtype == "bfloat16"
        assert logits.compute_dtype == "float32"
        assert _dtype(logits.kernel.value) == "bfloat16"
        assert _dtype(model(np.ones((1, 6)))) == "float32"

    def test_islands_over_a_global_policy_map_leave_the_map_alone(self):
        policy_map = keras.dtype_policies.DTypePolicyMap(
            "mixed_bfloat16", {"hidden": keras.DTypePolicy("float32")}
        )
        keras_mp.set_global_policy(policy_map, float32_islands="default")
        model = _functional()
        assert model.get_layer("hidden").compute_dtype == "float32"
        assert model.get_layer("mid").compute_dtype == "bfloat16"
        assert model.get_layer("attention").compute_dtype == "float32"
        assert model.get_layer("logits").compute_dtype == "float32"
        assert list(policy_map) == ["hidden"]
        _assert_rows_match_the_layers(model)

    def test_policy_map_compiles_the_rules_for_a_model(self):
        keras_mp.set_global_policy("mixed_bfloat16")
        model = _functional()
        policy_map = keras_mp.DEFAULT_FLOAT32_ISLANDS.policy_map(model)
        assert isinstance(policy_map, keras.dtype_policies.DTypePolicyMap)
        assert sorted(policy_map) == ["attention", "logits"]
        assert policy_map["logits"].name == "float32"
        assert policy_map["hidden"].name == "mixed_bfloat16"

    def test_set_global_policy_without_islands_turns_them_off(self):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        keras_mp.set_global_policy("mixed_bfloat16")
        assert keras.layers.Softmax().compute_dtype == "bfloat16"

    def test_bad_islands_value_raises_value_error(self):
        with pytest.raises(ValueError, match="Received: float32_islands="):
            keras_mp.set_global_policy("mixed_bfloat16", float32_islands="yes")

    @pytest.mark.parametrize("key", [int, keras.optimizers.Adam, 3, ()])
    def test_rule_key_of_the_wrong_type_raises_type_error(self, key):
        with pytest.raises(TypeError, match="layer class"):
            keras_mp.precision_rules({key: "float32"})

    def test_bad_rule_policy_or_pattern_raises_value_error(self):
        with pytest.raises(ValueError, match="Received: 'x' -> 'float8'"):
            keras_mp.precision_rules({"x": "float8"})
        with pytest.raises(ValueError, match="regular expression"):
            keras_mp.precision_rules({"(": "float32"})
        with pytest.raises(ValueError, match="Received: base="):
            keras_mp.precision_rules(base="defaults")


class TestSaveLoad:
    def test_islands_survive_save_and_load_without_rules_active(self, tmp_path):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        model = _functional()
        path = str(tmp_path / "model.keras")
        model.save(path)
        keras_mp.set_global_policy(None)
        restored = keras.models.load_model(path)
        for name in ("hidden", "norm", "attention", "mid", "logits"):
            assert restored.get_layer(name).dtype_policy == (
                model.get_layer(name).dtype_policy
            ), name
        rows = _rows(restored, rules="default")
        assert rows["logits"]["rule"] == (
            "DEFAULT_FLOAT32_ISLANDS: model outputs -> float32"
        )
        # As it was saved (the record beside the model's config), not the
        # "dtype argument" each layer's config now gives it.
        assert rows["hidden"]["rule"] == "global policy"
        x = np.ones((2, 6), "float32")
        np.testing.assert_array_equal(to_numpy(restored(x)), to_numpy(model(x)))

    def test_loading_under_other_islands_keeps_the_saved_dtypes(self, tmp_path):
        keras_mp.set_global_policy("mixed_bfloat16")
        model = _functional()
        path = str(tmp_path / "model.keras")
        model.save(path)
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        restored = keras.models.load_model(path)
        assert restored.get_layer("logits").compute_dtype == "bfloat16"
        assert restored.get_layer("attention").compute_dtype == "bfloat16"


class TestExplainPrecision:
    def test_prints_a_table_with_one_line_per_layer(self):
        keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
        model = _functional()
        printed = []
        rows = keras_mp.explain_precision(model, print_fn=printed.append)
        (table,) = printed
        lines = table.splitlines()
        assert lines[0].split() == [
            "layer",
            "class",
            "variable",
            "compute",
            "output",
            "rule",
        ]
        assert len(lines) == 2 + len(rows)
        assert any(
            line.startswith("logits") and "model outputs -> float32" in line
            for line in lines
        )

    def test_non_model_raises_type_error(self):
        with pytest.raises(TypeError, match="Received: model="):
            keras_mp.explain_precision("model")

    def test_a_layer_held_by_two_parents_has_one_row(self):
        # As keras-hub's CausalLM and its backbone both hold the embedding.
        class Holder(keras.layers.Layer):
            def __init__(self, *held, **kwargs):
                super().__init__(**kwargs)
                self.held = list(held)

            def call(self, x):
                for layer in self.held:
                    x = layer(x)
                return x

        shared = keras.layers.Dense(8, name="shared")
        inner = Holder(shared, name="inner")
        outer = Holder(inner, shared, name="outer")
        outer(keras.ops.ones((2, 8)))
        rows = keras_mp.explain_precision(outer, print_fn=None)
        names = [row["layer"] for row in rows]
        assert sorted(names) == sorted(set(names))
        assert len(rows) == 3


class TestKerasInternals:
    def test_producing_operation_is_the_layer_that_made_a_tensor(self):
        inputs = keras.Input((2,))
        dense = keras.layers.Dense(3)
        assert _keras_internals.producing_operation(dense(inputs)) is dense
        assert _keras_internals.producing_operation(np.ones(2)) is None

    def test_own_variables_exclude_sublayers(self):
        model = SubclassedModel()
        model(np.ones((1, 3)))
        assert _keras_internals.own_variables(model) == []
        assert _keras_internals.own_variables(model.head) == (
            model.head.weights
        )

    def test_replace_layer_policy_leaves_a_shared_map_alone(self):
        policy_map = keras.dtype_policies.DTypePolicyMap("mixed_bfloat16")
        layer = keras.layers.Dense(2, dtype=policy_map)
        layer.build((None, 3))
        _keras_internals.replace_layer_policy(layer, keras_mp.Policy("float32"))
        assert layer.compute_dtype == "float32"
        assert len(policy_map) == 0

    def test_functional_is_the_class_of_functional_models(self):
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        assert isinstance(model, _keras_internals.Functional)
