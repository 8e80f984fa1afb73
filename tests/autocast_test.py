"""Tests of keras_mp.autocast: AutoCastVariable semantics, enable_autocast."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy

MIXED = ["mixed_float16", "mixed_bfloat16"]


def _dtype(value):
    return keras.backend.standardize_dtype(value.dtype)


class RecordingLayer(keras.layers.Layer):
    """Records what its weights look like while `call` runs."""

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], 2), initializer="ones", name="kernel"
        )
        self.plain = self.add_weight(
            shape=(2,), initializer="ones", autocast=False, name="plain"
        )
        self.counter = self.add_weight(
            shape=(),
            dtype="int32",
            initializer="zeros",
            trainable=False,
            name="counter",
        )

    def call(self, inputs):
        self.seen = {
            "kernel.dtype": self.kernel.dtype,
            "kernel.value": _dtype(self.kernel.value),
            "converted": _dtype(keras.ops.convert_to_tensor(self.kernel)),
            "kernel.true_dtype": self.kernel.true_dtype,
            "plain.dtype": self.plain.dtype,
            "plain.value": _dtype(self.plain.value),
            "counter.dtype": self.counter.dtype,
        }
        return keras.ops.matmul(inputs, self.kernel)


class AssigningLayer(keras.layers.Layer):
    """Assigns to its kernel inside `call`, where reads are autocast."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(2,), initializer="zeros")

    def call(self, inputs):
        self.kernel.assign(keras.ops.full((2,), 1.0 / 3.0, "float32"))
        self.kernel.assign_add(keras.ops.full((2,), 1.0 / 3.0, "float32"))
        return inputs


def _built(layer, input_shape):
    layer.build(input_shape)
    return layer


def _float_weights(layer):
    return [w for w in layer.weights if keras.backend.is_float_dtype(w.dtype)]


class TestWhichWeightsAutocast:
    @pytest.mark.parametrize("policy", MIXED)
    @pytest.mark.parametrize(
        "make_layer, input_shape",
        [
            (lambda p: keras.layers.Dense(2, dtype=p), (None, 3)),
            (lambda p: keras.layers.Conv2D(2, 2, dtype=p), (None, 4, 4, 1)),
            (lambda p: keras.layers.Embedding(5, 2, dtype=p), (None, 3)),
            (
                lambda p: keras.layers.EinsumDense(
                    "ab,bc->ac", output_shape=2, bias_axes="c", dtype=p
                ),
                (None, 3),
            ),
            (lambda p: keras.layers.SimpleRNN(2, dtype=p), (None, 2, 3)),
        ],
        ids=["Dense", "Conv2D", "Embedding", "EinsumDense", "SimpleRNN"],
    )
    def test_builtin_layer_float_weights_are_autocast_variables(
        self, policy, make_layer, input_shape
    ):
        layer = _built(make_layer(policy), input_shape)
        weights = _float_weights(layer)
        assert weights
        for weight in weights:
            assert isinstance(weight, keras_mp.AutoCastVariable), weight.path
            assert weight.true_dtype == "float32"
            assert weight.dtype == "float32"

    @pytest.mark.parametrize("policy", MIXED)
    def test_normalization_layers_keep_their_float32_opt_out(self, policy):
        # Keras normalizes in float32 and creates these weights with
        # autocast=False, which keras_mp honours.
        for layer, shape in [
            (keras.layers.BatchNormalization(dtype=policy), (None, 3)),
            (keras.layers.LayerNormalization(dtype=policy), (None, 3)),
        ]:
            _built(layer, shape)
            for weight in layer.weights:
                assert not isinstance(weight, keras_mp.AutoCastVariable)
                assert weight.dtype == "float32"

    def test_global_policy_makes_builtin_weights_autocast(self, monkeypatch):
        from keras_mp.backend import devices

        monkeypatch.setattr(devices, "_checked_policies", {"mixed_bfloat16"})
        keras_mp.set_global_policy("mixed_bfloat16")
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)]
        )
        assert model.weights
        for weight in model.weights:
            assert isinstance(weight, keras_mp.AutoCastVariable)

    @pytest.mark.parametrize("policy", ["float32", "float16", "bfloat16"])
    def test_non_casting_policy_weights_are_not_autocast(self, policy):
        layer = _built(keras.layers.Dense(2, dtype=policy), (None, 3))
        for weight in layer.weights:
            assert not isinstance(weight, keras_mp.AutoCastVariable)
            assert not hasattr(weight, "true_dtype")

    def test_integer_weights_are_never_autocast(self):
        layer = _built(RecordingLayer(dtype="mixed_float16"), (None, 3))
        assert not isinstance(layer.counter, keras_mp.AutoCastVariable)
        assert layer.counter.dtype == "int32"
        assert isinstance(layer.kernel, keras_mp.AutoCastVariable)

    def test_add_weight_autocast_false_opts_out(self):
        layer = _built(RecordingLayer(dtype="mixed_float16"), (None, 3))
        assert not isinstance(layer.plain, keras_mp.AutoCastVariable)

    def test_explicit_float_dtype_weight_keeps_that_true_dtype(self):
        class Layer(keras.layers.Layer):
            def build(self, input_shape):
                self.wide = self.add_weight(shape=(), dtype="float64")

        layer = _built(Layer(dtype="mixed_bfloat16"), None)
        assert isinstance(layer.wide, keras_mp.AutoCastVariable)
        assert layer.wide.true_dtype == "float64"

    def test_other_objects_are_not_autocast_variables(self):
        plain = keras.Variable(np.ones(2, "float32"))
        assert not isinstance(plain, keras_mp.AutoCastVariable)
        assert not isinstance(plain.value, keras_mp.AutoCastVariable)
        assert not isinstance(np.ones(2), keras_mp.AutoCastVariable)
        assert not isinstance(None, keras_mp.AutoCastVariable)

    def test_direct_construction_raises_type_error(self):
        with pytest.raises(TypeError, match="add_weight"):
            keras_mp.AutoCastVariable(np.ones(2, "float32"))


class TestReadsAndDtypes:
    @pytest.mark.parametrize("policy", MIXED)
    def test_inside_call_dtype_and_reads_are_compute_dtype(self, policy):
        compute_dtype = keras_mp.Policy(policy).compute_dtype
        layer = RecordingLayer(dtype=policy)
        outputs = layer(np.ones((1, 3), "float32"))
        assert layer.seen == {
            "kernel.dtype": compute_dtype,
            "kernel.value": compute_dtype,
            "converted": compute_dtype,
            "kernel.true_dtype": "float32",
            "plain.dtype": "float32",
            "plain.value": "float32",
            "counter.dtype": "int32",
        }
        assert _dtype(outputs) == compute_dtype
        assert_bitwise_equal(outputs, np.full((1, 2), 3, compute_dtype))

    @pytest.mark.parametrize("policy", MIXED)
    def test_outside_call_it_behaves_as_the_stored_variable(self, policy):
        layer = RecordingLayer(dtype=policy)
        layer(np.ones((1, 3), "float32"))
        kernel = layer.kernel
        assert kernel.dtype == "float32"
        assert _dtype(kernel.value) == "float32"
        assert _dtype(keras.ops.convert_to_tensor(kernel)) == "float32"
        assert to_numpy(kernel).dtype == np.float32
        assert _dtype(kernel + 1.0) == "float32"

    def test_float32_layer_inside_call_sees_float32_weights(self):
        class Layer(RecordingLayer):
            def call(self, inputs):
                self.seen = (self.kernel.dtype, _dtype(self.kernel.value))
                return inputs

        layer = Layer(dtype="float32")
        layer(np.ones((1, 3), "float32"))
        assert layer.seen == ("float32", "float32")

    @pytest.mark.backends("jax")
    def test_reads_are_compute_dtype_inside_jitted_stateless_call(self):
        import jax

        layer = RecordingLayer(dtype="mixed_bfloat16")
        # `Layer.stateless_call` runs `call` without `__call__`'s autocast
        # scope, so the layer is called through a model, as `fit` does.
        model = keras.Sequential([keras.Input((3,)), layer])

        @jax.jit
        def forward(trainable, non_trainable, inputs):
            outputs, _ = model.stateless_call(trainable, non_trainable, inputs)
            return outputs

        outputs = forward(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            np.ones((1, 3), "float32"),
        )
        assert str(outputs.dtype) == "bfloat16"
        assert layer.seen["kernel.dtype"] == "bfloat16"

    @pytest.mark.backends("tensorflow")
    def test_reads_are_compute_dtype_inside_tf_function(self):
        import tensorflow as tf

        layer = _built(RecordingLayer(dtype="mixed_bfloat16"), (None, 3))
        outputs = tf.function(layer)(tf.ones((1, 3)))
        assert outputs.dtype == tf.bfloat16
        assert layer.seen["kernel.dtype"] == "bfloat16"


class TestAssignment:
    @pytest.mark.parametrize("policy", MIXED)
    def test_assignment_outside_call_keeps_float32_precision(self, policy):
        layer = _built(keras.layers.Dense(2, dtype=policy), (None, 3))
        value = np.full((3, 2), 1.0 / 3.0, "float32")
        layer.kernel.assign(value)
        assert layer.kernel.dtype == "float32"
        assert_bitwise_equal(layer.kernel, value)

    @pytest.mark.parametrize("policy", MIXED)
    def test_assignment_inside_call_keeps_float32_precision(self, policy):
        layer = AssigningLayer(dtype=policy)
        layer(np.ones((1, 2), "float32"))
        assert isinstance(layer.kernel, keras_mp.AutoCastVariable)
        assert layer.kernel.dtype == "float32"
        third = np.float32(1.0 / 3.0)
        assert_bitwise_equal(layer.kernel, np.full((2,), third + third))

    @pytest.mark.parametrize("policy", MIXED)
    def test_assign_sub_inside_call_keeps_float32_precision(self, policy):
        class Layer(keras.layers.Layer):
            def build(self, input_shape):
                self.total = self.add_weight(shape=(), initializer="ones")

            def call(self, inputs):
                self.total.assign_sub(keras.ops.convert_to_tensor(2.0**-12))
                return inputs

        layer = Layer(dtype=policy)
        for _ in range(3):
            layer(np.ones((1, 1), "float32"))
        # float16 and bfloat16 cannot hold 1 - 2**-12: each step would round
        # back to 1 if the variable were read in the compute dtype.
        expected = np.float32(1.0 - 3 * 2.0**-12)
        assert_bitwise_equal(layer.total, expected)
        assert layer.total.dtype == "float32"

    @pytest.mark.parametrize("policy", MIXED)
    def test_assign_inside_call_writes_the_stored_variable(self, policy):
        # On torch, `assign` writes into `variable.value`, which inside a
        # mixed layer's call is a temporary cast copy.
        class Layer(keras.layers.Layer):
            def build(self, input_shape):
                self.state = self.add_weight(
                    shape=(2,), initializer="zeros", trainable=False
                )

            def call(self, inputs):
                self.state.assign(keras.ops.full((2,), 1.0 / 3.0, "float32"))
                return inputs

        layer = Layer(dtype=policy)
        layer(np.ones((1, 1), "float32"))
        assert_bitwise_equal(layer.state, np.full((2,), 1.0 / 3.0, "float32"))

    def test_assignment_under_enable_autocast_keeps_float32(self):
        layer = _built(keras.layers.Dense(2, dtype="mixed_float16"), (None, 3))
        value = np.full((3, 2), 0.1, "float32")
        with keras_mp.enable_autocast("float16"):
            layer.kernel.assign(value)
            assert _dtype(layer.kernel.value) == "float16"
        assert_bitwise_equal(layer.kernel, value)

    def test_optimizer_updates_keep_float32_storage(self):
        layer = _built(keras.layers.Dense(1, dtype="mixed_bfloat16"), (None, 2))
        optimizer = keras.optimizers.SGD(learning_rate=2.0**-20)
        kernel_before = to_numpy(layer.kernel).copy()
        gradients = [keras.ops.ones(v.shape) for v in layer.trainable_variables]
        optimizer.apply(gradients, layer.trainable_variables)
        assert layer.kernel.dtype == "float32"
        # A step far below bfloat16's resolution still changes float32 storage.
        assert not np.array_equal(to_numpy(layer.kernel), kernel_before)
        np.testing.assert_allclose(
            to_numpy(layer.kernel), kernel_before - 2.0**-20, rtol=0, atol=0
        )


class TestEnableAutocast:
    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_reads_become_the_given_dtype(self, dtype):
        variable = keras.Variable(np.full((2,), 1.5, "float32"))
        with keras_mp.enable_autocast(dtype):
            assert variable.dtype == dtype
            assert _dtype(variable.value) == dtype
        assert variable.dtype == "float32"
        assert _dtype(variable.value) == "float32"

    @pytest.mark.backends("tensorflow")
    def test_none_reports_and_reads_the_stored_dtype(self):
        variable = keras.Variable(np.ones((2,)), dtype="float64")
        with keras_mp.enable_autocast("float16"):
            with keras_mp.enable_autocast(None):
                assert variable.dtype == "float64"
                assert _dtype(variable.value) == "float64"
            assert variable.dtype == "float16"

    def test_integer_variables_are_not_cast(self):
        variable = keras.Variable(np.arange(3, dtype="int32"), trainable=False)
        with keras_mp.enable_autocast("float16"):
            assert variable.dtype == "int32"

    def test_none_reads_stored_dtype_inside_a_mixed_layer(self):
        class Layer(RecordingLayer):
            def call(self, inputs):
                with keras_mp.enable_autocast(None):
                    self.inner = self.kernel.dtype
                return super().call(inputs)

        layer = Layer(dtype="mixed_float16")
        layer(np.ones((1, 3), "float32"))
        assert layer.inner == "float32"
        assert layer.seen["kernel.dtype"] == "float16"

    def test_scopes_nest_and_restore(self):
        variable = keras.Variable(np.ones((2,), "float32"))
        with keras_mp.enable_autocast("float16"):
            with keras_mp.enable_autocast("bfloat16"):
                assert variable.dtype == "bfloat16"
            assert variable.dtype == "float16"
        assert variable.dtype == "float32"

    def test_scope_is_left_on_exception(self):
        variable = keras.Variable(np.ones((2,), "float32"))
        with pytest.raises(RuntimeError), keras_mp.enable_autocast("float16"):
            raise RuntimeError("inside")
        assert variable.dtype == "float32"

    @pytest.mark.parametrize("dtype", ["int32", "bool", "nonsense", 5])
    def test_invalid_dtype_raises_value_error(self, dtype):
        with (
            pytest.raises(ValueError, match="float dtype name") as info,
            keras_mp.enable_autocast(dtype),
        ):
            pass
        assert f"Received: dtype={dtype!r}" in str(info.value)


class TestCheckpoints:
    @staticmethod
    def _model(dtype):
        inputs = keras.Input((3,))
        x = keras.layers.Dense(4, dtype=dtype)(inputs)
        x = keras.layers.BatchNormalization(dtype=dtype)(x)
        outputs = keras.layers.Dense(1, dtype=dtype)(x)
        return keras.Model(inputs, outputs)

    @pytest.mark.parametrize("policy", MIXED)
    def test_float32_weights_load_into_mixed_model_and_back(
        self, policy, tmp_path
    ):
        keras.utils.set_random_seed(1)
        trained = self._model("float32")
        trained.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
        trained.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
        float32_path = str(tmp_path / "float32.weights.h5")
        trained.save_weights(float32_path)

        mixed = self._model(policy)
        mixed.load_weights(float32_path)
        assert len(mixed.weights) == len(trained.weights)
        for loaded, saved in zip(mixed.weights, trained.weights):
            assert loaded.dtype == "float32"
            assert_bitwise_equal(loaded, saved, msg=loaded.path)
        assert any(
            isinstance(w, keras_mp.AutoCastVariable) for w in mixed.weights
        )
        mixed_outputs = mixed.predict(x, verbose=0)
        assert _dtype(mixed_outputs) == keras_mp.Policy(policy).compute_dtype

        mixed_path = str(tmp_path / "mixed.weights.h5")
        mixed.save_weights(mixed_path)
        restored = self._model("float32")
        restored.load_weights(mixed_path)
        for loaded, saved in zip(restored.weights, trained.weights):
            assert_bitwise_equal(loaded, saved, msg=loaded.path)
