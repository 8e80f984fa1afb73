import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import run_python
from keras_mp.testing import to_numpy

BACKEND = keras.backend.backend()


def _data(n=32, features=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    return x, y


def _sequential():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(2),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def _functional():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(2, activation="softmax", dtype="float32")(
        hidden
    )
    return keras.Model(inputs, outputs)


class SubclassedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(2, activation="softmax", dtype="float32")

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("build", [_sequential, _functional, SubclassedModel])
def test_compile_wraps_any_model_in_a_loss_scale_optimizer(build):
    keras_mp.set_global_policy(
        keras_mp.Policy(
            "mixed_bfloat16", loss_scale=keras_mp.DynamicLossScale(256.0, 5)
        )
    )
    model = build()
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    assert type(model.optimizer) is keras_mp.LossScaleOptimizer
    template = keras_mp.global_policy().loss_scale
    assert model.optimizer.loss_scale is not template
    assert model.optimizer.loss_scale.get_config() == template.get_config()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(to_numpy(model.optimizer.iterations)) == 4
    # The policy's scale is a template: it never trains.
    assert not template.built


def test_compile_respects_auto_scale_loss_false_and_wrapped_optimizers():
    keras_mp.set_global_policy("mixed_float16")
    model = _sequential()
    model.compile(keras.optimizers.SGD(0.1), "mse", auto_scale_loss=False)
    assert isinstance(model.optimizer, keras.optimizers.SGD)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    mine = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=4)
    model.compile(mine, "mse")
    assert model.optimizer is mine
    theirs = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(theirs, "mse")
    assert model.optimizer is theirs
    nested = keras_mp.optimizers.Lookahead(
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    )
    model.compile(nested, "mse")
    assert model.optimizer is nested


def test_policy_without_loss_scale_is_not_wrapped_even_for_float16():
    keras_mp.set_global_policy(
        keras_mp.Policy("mixed_float16", loss_scale=None)
    )
    model = _sequential()
    model.compile("sgd", "mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_optimizer_names_and_strings_are_wrapped_too():
    keras_mp.set_global_policy("mixed_float16")
    model = _sequential()
    model.compile("adam", "mse")
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.Adam)


def _train(model, x, y, epochs=1):
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)


def test_saved_model_keeps_wrapper_scale_and_counters_and_continues_exactly(
    tmp_path,
):
    keras_mp.set_global_policy(
        keras_mp.Policy(
            "mixed_bfloat16", loss_scale=keras_mp.DynamicLossScale(64.0, 3)
        )
    )
    keras.utils.set_random_seed(1)
    x, y = _data()
    model = _sequential()
    model.compile(
        keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy"
    )
    _train(model, x, y)
    path = str(tmp_path / "model.keras")
    model.save(path)
    keras_mp.set_global_policy(None)
    restored = keras.saving.load_model(path)
    optimizer = restored.optimizer
    assert type(optimizer) is keras_mp.LossScaleOptimizer
    assert (
        optimizer.loss_scale.get_config()
        == model.optimizer.loss_scale.get_config()
    )
    for a, b in zip(model.optimizer.variables, optimizer.variables):
        assert_bitwise_equal(b, a, msg=a.path)
    _train(model, x, y)
    _train(restored, x, y)
    for a, b in zip(model.weights, restored.weights):
        assert_bitwise_equal(b, a, msg=a.path)
    assert float(to_numpy(optimizer.loss_scale())) == float(
        to_numpy(model.optimizer.loss_scale())
    )


def test_load_model_in_a_fresh_process_keeps_auto_scale_loss_false(tmp_path):
    path = str(tmp_path / "plain.keras")
    keras_mp.set_global_policy("mixed_float16")
    model = _sequential()
    model.compile(keras.optimizers.SGD(0.1), "mse", auto_scale_loss=False)
    model.save(path)
    out = run_python(
        f"""
        import keras, keras_mp
        keras_mp.set_global_policy("mixed_float16")
        model = keras.saving.load_model({path!r})
        print(type(model.optimizer).__name__)
        """,
        env={"KERAS_BACKEND": BACKEND},
    )
    assert out.strip().splitlines()[-1] == "SGD"


def test_float32_adam_state_loads_into_the_mixed_wrapper_and_back(tmp_path):
    x, y = _data()
    keras.utils.set_random_seed(2)
    plain = _sequential()
    plain.compile(
        keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy"
    )
    _train(plain, x, y)
    plain_path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(plain_path)

    keras_mp.set_global_policy("mixed_bfloat16")
    mixed = _sequential()
    mixed.compile(
        keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
        "sparse_categorical_crossentropy",
    )
    mixed.optimizer.build(mixed.trainable_variables)
    mixed.load_weights(plain_path)
    inner = mixed.optimizer.inner_optimizer
    assert len(inner.variables) == len(plain.optimizer.variables)
    for a, b in zip(plain.optimizer.variables, inner.variables):
        assert_bitwise_equal(b, a, msg=a.path)
    assert float(to_numpy(mixed.optimizer.loss_scale())) == 2.0**15

    _train(mixed, x, y)
    mixed_path = str(tmp_path / "mixed.weights.h5")
    mixed.save_weights(mixed_path)
    keras_mp.set_global_policy(None)
    back = _sequential()
    back.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    back.optimizer.build(back.trainable_variables)
    back.load_weights(mixed_path)
    for a, b in zip(inner.variables, back.optimizer.variables):
        assert_bitwise_equal(b, a, msg=a.path)
    for a, b in zip(mixed.weights, back.weights):
        assert_bitwise_equal(b, a, msg=a.path)


def test_float16_gradients_that_flush_to_zero_train_with_loss_scaling():
    # Targets and inputs are tiny, so the float16 gradient of the kernel
    # (16 products of about 1.25e-9, 2e-8 in all) rounds to zero below
    # float16's smallest subnormal (6e-8) unless the loss is scaled first.
    keras_mp.set_global_policy("mixed_float16")
    x = np.full((16, 2), 1e-4, "float32")
    y = np.full((16, 1), 1e-4, "float32")

    def run(optimizer):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((2,)),
                keras.layers.Dense(1, kernel_initializer="zeros"),
            ]
        )
        model.compile(optimizer, "mse", auto_scale_loss=False)
        model.fit(x, y, batch_size=16, epochs=3, verbose=0)
        return to_numpy(model.layers[0].kernel)

    unscaled = run(keras.optimizers.SGD(1.0))
    assert np.all(unscaled == 0.0)
    scaled = run(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(1.0), loss_scale=keras_mp.DynamicLossScale()
        )
    )
    assert np.all(scaled != 0.0)


def test_compile_warns_once_when_the_model_predates_a_loss_scaled_policy():
    import warnings

    model = _sequential()
    keras_mp.set_global_policy("mixed_float16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("adam", "mean_squared_error")
        model.compile("adam", "mean_squared_error")
    late = [w for w in caught if "before building the model" in str(w.message)]
    assert len(late) == 1
    assert "'mixed_float16'" in str(late[0].message)
    assert late[0].filename == __file__


def test_compile_does_not_warn_for_a_model_built_under_the_policy():
    import warnings

    keras_mp.set_global_policy("mixed_float16")
    model = _sequential()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("adam", "mean_squared_error")
    assert not [w for w in caught if issubclass(w.category, UserWarning)]


class PortableStepModel(keras.Model):
    """One custom train_step in the RFC 293 style, for every policy."""

    def __init__(self, style, **kwargs):
        super().__init__(**kwargs)
        self.style = style
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1, dtype="float32")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
            if self.style == "scaled":
                scaled = self.optimizer.get_scaled_loss(loss)
        variables = self.trainable_variables
        if self.style == "minimize":
            self.optimizer.minimize(loss, variables, tape=tape)
        else:
            grads = tape.gradient(scaled, variables)
            grads = self.optimizer.get_unscaled_gradients(grads)
            self.optimizer.apply_gradients(zip(grads, variables))
        return {"loss": loss}


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("style", ["minimize", "scaled"])
@pytest.mark.parametrize(
    "policy", ["mixed_float16", "mixed_bfloat16", "float32"]
)
def test_one_custom_train_step_runs_under_every_policy(policy, style):
    keras_mp.set_global_policy(policy)
    x, labels = _data()
    y = labels.astype("float32")[:, None]
    model = PortableStepModel(style)
    model.compile(keras.optimizers.SGD(0.05), "mean_squared_error")
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert model.evaluate(x, y, verbose=0) < before


def test_plain_optimizers_have_identity_loss_scaling_methods():
    optimizer = keras.optimizers.Adam()
    loss = keras.ops.convert_to_tensor(3.0)
    assert float(optimizer.get_scaled_loss(loss)) == 3.0
    grads = [keras.ops.ones((2,)), None]
    assert optimizer.get_unscaled_gradients(grads) == grads


def test_plain_optimizer_minimizes_a_callable_loss_on_any_backend():
    variable = keras.Variable(np.array([2.0, -1.0], "float32"))
    optimizer = keras.optimizers.SGD(0.25)
    optimizer.minimize(
        lambda: keras.ops.sum(keras.ops.square(variable)), [variable]
    )
    np.testing.assert_allclose(to_numpy(variable), [1.0, -0.5])
    assert int(to_numpy(optimizer.iterations)) == 1
