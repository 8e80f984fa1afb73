"""Tests of keras_mp._keras_internals: every keras.src symbol and each patch."""

import ast
import importlib
import pathlib
import threading

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import _keras_internals
from keras_mp.precision import global_policy as global_policy_module

_PACKAGE = pathlib.Path(keras_mp.__file__).parent
_INTERNALS_SOURCE = (_PACKAGE / "_keras_internals.py").read_text()


def _keras_src_imports(source):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module.startswith(
            "keras.src"
        ):
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("keras.src"):
                    yield alias.name, None


def _keras_dtype_policy_module():
    return importlib.import_module("keras.src.dtype_policies.dtype_policy")


def _in_thread(function):
    results = []
    thread = threading.Thread(target=lambda: results.append(function()))
    thread.start()
    thread.join()
    return results[0]


class TestImports:
    def test_every_keras_src_symbol_still_imports(self):
        imports = list(_keras_src_imports(_INTERNALS_SOURCE))
        assert len(imports) >= 8
        for module_name, symbol in imports:
            module = importlib.import_module(module_name)
            if symbol is not None:
                assert hasattr(module, symbol), f"{module_name}.{symbol}"

    def test_every_name_in_all_exists(self):
        for name in _keras_internals.__all__:
            assert hasattr(_keras_internals, name), name

    def test_no_other_keras_mp_module_imports_keras_src(self):
        offenders = []
        for path in _PACKAGE.rglob("*.py"):
            if path.name == "_keras_internals.py":
                continue
            if list(_keras_src_imports(path.read_text())):
                offenders.append(str(path.relative_to(_PACKAGE)))
        assert offenders == []

    def test_ema_lists_hold_only_averaged_pairs_inside_and_return(self):
        plain = keras.Variable(np.ones(2), dtype="float32")
        carrier = keras.Variable(np.ones(2), dtype="float32")
        carrier.overwrite_with_gradient = True
        optimizer = keras.optimizers.SGD(use_ema=True)
        optimizer.build([plain, carrier])
        averages = _keras_internals.moving_averages(optimizer)
        assert averages[1] is None and averages[0] is not None
        with _keras_internals.averaged_pairs_only(optimizer):
            assert optimizer._trainable_variables == [plain]
            assert optimizer._model_variables_moving_average == averages[:1]
        assert list(optimizer._trainable_variables) == [plain, carrier]
        assert _keras_internals.moving_averages(optimizer) == averages

    def test_private_attributes_read_by_helpers_exist(self):
        variable = keras.Variable(np.ones(2), dtype="float32", autocast=False)
        assert _keras_internals.stored_dtype(variable) == "float32"
        assert _keras_internals.variable_autocasts(variable) is False
        with keras_mp.enable_autocast("float16"):
            assert _keras_internals.stored_dtype(variable) == "float32"
        autocasting = keras.Variable(np.ones(2), dtype="float32")
        assert _keras_internals.variable_autocasts(autocasting) is True
        with keras_mp.enable_autocast("float16"):
            assert autocasting.dtype == "float16"
            assert _keras_internals.stored_dtype(autocasting) == "float32"

    def test_untrack_variable_and_all_layers(self):
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        with pytest.raises(ValueError, match="already built"):
            layer.add_weight(shape=(2,), initializer="zeros")
        extra = _keras_internals.add_weight_to_built_layer(
            layer, shape=(2,), initializer="zeros", name="extra"
        )

        def own():
            return [v.path for v in _keras_internals.own_variables(layer)]

        assert own() == ["dense/kernel", "dense/bias", "dense/extra"]
        _keras_internals.untrack_variable(layer, extra)
        assert own() == ["dense/kernel", "dense/bias"]
        assert [v.path for v in layer.weights] == ["dense/kernel", "dense/bias"]
        model = keras.Sequential([keras.Input((3,)), layer])
        layers = _keras_internals.all_layers(model)
        assert layers[0] is model and layers[-1] is layer

    def test_autocast_scope_is_the_one_layers_use(self):
        scope = _keras_internals.AutocastScope("bfloat16")
        with scope:
            assert _keras_internals.get_autocast_scope() is scope
        assert _keras_internals.get_autocast_scope() is None

    def test_without_autocast_removes_and_restores_the_scope(self):
        variable = keras.Variable(np.ones(2), dtype="float32")
        scope = _keras_internals.AutocastScope("float16")
        with scope:
            with _keras_internals.without_autocast():
                assert _keras_internals.get_autocast_scope() is None
                assert variable.dtype == "float32"
            assert _keras_internals.get_autocast_scope() is scope
            assert variable.dtype == "float16"


class TestGlobalPolicyLookup:
    def test_lookup_is_installed_once_and_reaches_public_names(self):
        lookup = _keras_dtype_policy_module().dtype_policy
        assert lookup._keras_mp_lookup
        _keras_internals.install_global_policy_lookup(lambda: None)
        assert _keras_dtype_policy_module().dtype_policy is lookup
        assert keras.config.dtype_policy is lookup
        assert keras.mixed_precision.dtype_policy is lookup
        assert keras.mixed_precision.global_policy is lookup

    def test_keras_thread_policy_wins_then_process_policy_then_floatx(self):
        lookup = _keras_dtype_policy_module().dtype_policy
        assert lookup().name == "float32"
        keras.config.set_floatx("float64")
        assert lookup().name == "float64"
        global_policy_module._set_global_policy_unchecked(
            keras_mp.Policy("mixed_bfloat16")
        )
        assert lookup().name == "mixed_bfloat16"
        keras.config.set_dtype_policy("float16")
        assert lookup().name == "float16"
        # keras_mp clears Keras's thread-local policy when it sets its own.
        global_policy_module._set_global_policy_unchecked(
            keras_mp.Policy("float64")
        )
        assert lookup().name == "float64"

    def test_floatx_default_is_never_cached(self):
        for _ in range(2):
            assert keras.config.dtype_policy().name == "float32"
        keras.config.set_floatx("float16")
        assert keras.config.dtype_policy().name == "float16"
        assert _in_thread(lambda: keras.config.dtype_policy().name) == (
            "float16"
        )

    def test_set_keras_thread_policy_sets_and_clears(self):
        _keras_internals.set_keras_thread_policy(keras.DTypePolicy("float16"))
        assert keras.layers.Dense(1).compute_dtype == "float16"
        assert _in_thread(lambda: keras.layers.Dense(1).compute_dtype) == (
            "float32"
        )
        _keras_internals.set_keras_thread_policy(None)
        assert keras.layers.Dense(1).compute_dtype == "float32"

    def test_keras_session_is_one_token_until_clear_session(self):
        session = _keras_internals.keras_session()
        assert _keras_internals.keras_session() is session
        assert _in_thread(_keras_internals.keras_session) is session
        keras.utils.clear_session()
        assert _keras_internals.keras_session() is not session


class TestPolicyDeserialization:
    def test_hook_is_installed_once(self):
        from_config = _keras_internals.Operation.from_config
        assert from_config.__func__._keras_mp_hook
        _keras_internals.install_policy_deserialization(lambda policy: True)
        assert _keras_internals.Operation.from_config.__func__ is (
            from_config.__func__
        )

    def test_keras_mp_policy_object_reaches_the_constructor(self):
        policy = keras_mp.Policy("mixed_float16", loss_scale=64)
        config = keras.layers.Dense(2, dtype=policy).get_config()
        assert config["dtype"]["registered_name"] == "keras_mp>Policy"
        layer = keras.layers.Dense.from_config(config)
        assert isinstance(layer.dtype_policy, keras_mp.Policy)
        assert layer.dtype_policy.loss_scale.loss_scale_value == 64.0

    def test_keras_policies_and_other_configs_pass_through(self):
        config = keras.layers.Dense(2, dtype="float16").get_config()
        layer = keras.layers.Dense.from_config(config)
        assert type(layer.dtype_policy) is keras.DTypePolicy
        assert layer.dtype_policy.name == "float16"
        config = dict(keras.layers.Dense(2).get_config(), dtype="bfloat16")
        assert keras.layers.Dense.from_config(config).compute_dtype == (
            "bfloat16"
        )


class TestTrainerAndSaveable:
    def test_trainer_is_the_base_of_keras_models(self):
        assert issubclass(keras.Model, _keras_internals.Trainer)
        assert callable(_keras_internals.Trainer.compile)

    def test_keras_saveable_is_the_base_of_layers_and_optimizers(self):
        assert issubclass(keras.layers.Layer, _keras_internals.KerasSaveable)
        assert issubclass(
            keras.optimizers.Optimizer, _keras_internals.KerasSaveable
        )

    def test_quantization_modes_name_quantized_policies(self):
        assert "int8" in _keras_internals.QUANTIZATION_MODES
        with pytest.raises(ValueError, match="quantiz"):
            keras_mp.Policy("int8_from_mixed_float16")

    def test_no_automatic_dependency_tracking_is_a_decorator(self):
        class Layer(keras.layers.Layer):
            @_keras_internals.no_automatic_dependency_tracking
            def set_untracked(self, value):
                self.untracked = value

        layer = Layer()
        layer.set_untracked([keras.Variable(1.0)])
        assert layer.weights == []


def test_keras_loaders_run_inside_keras_mps_loading_wrapper():
    """`load_model` and `load_weights_only` are replaced once, and the
    replacements call the originals inside the wrapper (the FP8 layers'
    one migration warning per load)."""
    from keras.src.saving import saving_lib

    for name in ("load_model", "load_weights_only"):
        assert getattr(saving_lib, name)._keras_mp_hook
    before = saving_lib.load_weights_only
    _keras_internals.install_loading_wrapper(lambda: None)
    assert saving_lib.load_weights_only is before


def test_model_serialization_hook_reaches_every_deserializer():
    """The record beside a model's config reaches `restore` through each
    name Keras deserializes with (`load_model` calls `saving_lib`'s), is
    installed once, and leaves objects without a record alone."""
    from keras.src.saving import saving_lib
    from keras.src.saving import serialization_lib

    for module in (serialization_lib, saving_lib, keras.saving, keras.utils):
        assert module.deserialize_keras_object._keras_mp_hook
    before = serialization_lib.get_build_and_compile_config
    _keras_internals.install_model_serialization("x", None, None, None)
    assert serialization_lib.get_build_and_compile_config is before
    keras_mp.set_global_policy("mixed_bfloat16", float32_islands="default")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    keras_mp.set_global_policy(None)
    config = keras.saving.serialize_keras_object(model)
    assert [entry[0] for entry in config["keras_mp_precision"]["layers"]] == [
        "InputLayer",
        "Dense",
    ]
    plain = keras.saving.serialize_keras_object(keras.layers.Dense(2))
    assert "keras_mp_precision" not in plain
    reloaded = keras.saving.deserialize_keras_object(config)
    assert reloaded.layers[-1]._keras_mp_precision_rule == (
        "DEFAULT_FLOAT32_ISLANDS: model outputs -> float32"
    )


def test_model_checkpoint_saves_go_through_one_guard():
    # Every save of `ModelCheckpoint` (per batch or per epoch) goes through
    # `_save_model`; keras_mp's guard replaces it once, and only once.
    checkpoint = keras.callbacks.ModelCheckpoint
    guarded = checkpoint._save_model
    assert getattr(guarded, "_keras_mp_hook", False)
    _keras_internals.install_checkpoint_save_guard(lambda callback: False)
    assert checkpoint._save_model is guarded


def test_constant_is_made_once_on_torch_and_is_the_value_elsewhere():
    from keras_mp._keras_internals import constant

    first = constant(0x7FFFFF, "int32")
    vector = constant((1, 2), "int32")
    if keras.backend.backend() == "torch":
        assert constant(0x7FFFFF, "int32") is first
        assert keras.backend.standardize_dtype(first.dtype) == "int32"
        assert int(first) == 0x7FFFFF
        # The same number in another dtype is another tensor.
        assert constant(0x7FFFFF, "float32") is not first
    else:
        assert first == 0x7FFFFF
    assert keras.backend.standardize_dtype(vector.dtype) == "int32"
    assert keras.ops.convert_to_numpy(vector).tolist() == [1, 2]


def test_custom_compile_restore_is_installed_once():
    # `load_model` reaches keras_mp's restore of a custom `compile()`
    # through `Trainer.compile_from_config`, replaced once.
    trainer = _keras_internals.Trainer
    hooked = trainer.compile_from_config
    assert getattr(hooked, "_keras_mp_hook", False)
    _keras_internals.install_custom_compile_restore(lambda model, config: True)
    assert trainer.compile_from_config is hooked
