import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy

BACKEND = keras.backend.backend()
FACTOR = 3.0


def _scaled_pairs(grads_and_vars, factor=FACTOR):
    return [(None if g is None else g * factor, v) for g, v in grads_and_vars]


class ScaleLoss(keras_mp.OptimizerWrapper):
    def transform_loss(self, loss):
        return super().transform_loss(loss) * FACTOR


class ScaleUnaggregated(keras_mp.OptimizerWrapper):
    def transform_unaggregated_gradients(self, grads_and_vars):
        return _scaled_pairs(grads_and_vars)


class ScaleAggregated(keras_mp.OptimizerWrapper):
    def aggregate_gradients(self, grads_and_vars):
        return _scaled_pairs(super().aggregate_gradients(grads_and_vars))


class ScaleTransformed(keras_mp.OptimizerWrapper):
    def transform_gradients(self, grads_and_vars):
        return _scaled_pairs(super().transform_gradients(grads_and_vars))


class ScaleApplied(keras_mp.OptimizerWrapper):
    def apply_updates(self, grads_and_vars):
        super().apply_updates(_scaled_pairs(grads_and_vars))


class ScaleGradients(keras_mp.OptimizerWrapper):
    def get_gradients(self, loss, variables, tape=None):
        return _scaled_pairs(super().get_gradients(loss, variables, tape))


FIT_STAGES = [
    ScaleLoss,
    ScaleUnaggregated,
    ScaleAggregated,
    ScaleTransformed,
    ScaleApplied,
]


def _linear_model():
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")]
    )
    return model


def _fit_delta(optimizer, jit_compile="auto"):
    x = np.arange(12, dtype="float32").reshape(4, 3) / 10.0
    y = np.ones((4, 1), "float32")
    model = _linear_model()
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    before = to_numpy(model.layers[0].kernel)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return to_numpy(model.layers[0].kernel) - before


@pytest.mark.parametrize("stage", FIT_STAGES, ids=lambda c: c.__name__)
def test_each_stage_override_runs_inside_fit(stage):
    plain = _fit_delta(keras.optimizers.SGD(0.1))
    wrapped = _fit_delta(stage(keras.optimizers.SGD(0.1)))
    np.testing.assert_allclose(wrapped, plain * FACTOR, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "stage", FIT_STAGES + [ScaleGradients], ids=lambda c: c.__name__
)
def test_each_stage_override_runs_inside_minimize(stage):
    def delta(optimizer):
        w = keras.Variable([1.0, -2.0])
        optimizer.minimize(lambda: ops.sum(ops.square(w)), [w])
        return to_numpy(w) - np.array([1.0, -2.0], "float32")

    plain = delta(keras_mp.OptimizerWrapper(keras.optimizers.SGD(0.1)))
    np.testing.assert_allclose(plain, [-0.2, 0.4], rtol=1e-6)
    wrapped = delta(stage(keras.optimizers.SGD(0.1)))
    np.testing.assert_allclose(wrapped, plain * FACTOR, rtol=1e-5)


@pytest.mark.backends("tensorflow")
def test_stages_run_inside_a_jit_compiled_tf_function_with_a_tape():
    import tensorflow as tf

    optimizer = ScaleTransformed(keras.optimizers.SGD(0.1))
    w = keras.Variable([1.0, -2.0])

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = ops.sum(ops.square(w))
        optimizer.minimize(loss, [w], tape=tape)

    step()
    assert_close(w, [1.0 - 0.6, -2.0 + 1.2])


@pytest.mark.backends("jax")
def test_stages_run_inside_jax_jit_stateless_apply():
    import jax

    optimizer = ScaleTransformed(keras.optimizers.SGD(0.1))
    w = keras.Variable([1.0, -2.0])
    optimizer.build([w])

    @jax.jit
    def step(opt_values, w_value):
        grads = [2 * w_value]
        new_w, new_opt = optimizer.stateless_apply(opt_values, grads, [w_value])
        return new_w[0], new_opt

    new_w, _ = step([v.value for v in optimizer.variables], w.value)
    np.testing.assert_allclose(np.asarray(new_w), [0.4, -0.8], rtol=1e-6)


def test_wrappers_nest_both_ways_and_train_in_fit():
    outer = keras_mp.OptimizerWrapper(
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=8)
    )
    inner_first = keras_mp.LossScaleOptimizer(
        keras_mp.OptimizerWrapper(keras.optimizers.SGD(0.1)), loss_scale=8
    )
    plain = _fit_delta(keras.optimizers.SGD(0.1))
    for optimizer in (outer, inner_first):
        np.testing.assert_allclose(
            _fit_delta(optimizer), plain, rtol=1e-5, atol=1e-7
        )
        assert int(to_numpy(optimizer.iterations)) == 1


def test_nested_config_round_trips_with_non_default_values():
    optimizer = keras_mp.OptimizerWrapper(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(0.02, beta_1=0.8),
            loss_scale=keras_mp.FixedLossScale(16),
        ),
        name="outer",
    )
    config = keras.saving.serialize_keras_object(optimizer)
    restored = keras.saving.deserialize_keras_object(config)
    assert restored.name == "outer"
    inner = restored.inner_optimizer
    assert type(inner) is keras_mp.LossScaleOptimizer
    assert inner.loss_scale.loss_scale_value == 16.0
    assert float(inner.inner_optimizer.beta_1) == 0.8
    # Delegation reaches through both levels.
    assert float(restored.beta_1) == 0.8


def test_wrapper_variables_follow_the_inner_layout_and_load_both_ways():
    variables = [keras.Variable(np.ones((2, 2), "float32"))]
    plain = keras.optimizers.Adam(0.1)
    plain.build(variables)
    wrapped = keras_mp.OptimizerWrapper(
        keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), loss_scale=4)
    )
    wrapped.build(variables)
    store = {}
    wrapped.save_own_variables(store)
    assert sorted(store) == [str(i) for i in range(len(plain.variables))]
    plain.load_own_variables(store)
    for a, b in zip(plain.variables, wrapped.variables):
        assert_bitwise_equal(a, b)


def test_delegation_is_limited_to_hyperparameters():
    inner = keras.optimizers.Adam(0.1, beta_2=0.95, weight_decay=0.01)
    optimizer = keras_mp.OptimizerWrapper(inner)
    assert float(optimizer.beta_2) == 0.95
    assert float(optimizer.weight_decay) == 0.01
    optimizer.weight_decay = 0.02
    assert inner.weight_decay == 0.02
    optimizer.clipnorm = 1.0
    assert inner.clipnorm == 1.0
    assert {"beta_1", "beta_2", "epsilon", "amsgrad"} <= set(dir(optimizer))
    optimizer.build([keras.Variable([1.0])])
    with pytest.raises(AttributeError, match="_momentums.*not delegate"):
        optimizer._momentums  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        optimizer.no_such_thing  # noqa: B018


def test_wrapping_a_non_optimizer_raises_type_error():
    with pytest.raises(TypeError, match="Received: inner_optimizer=.*list"):
        keras_mp.OptimizerWrapper([1, 2])
    with pytest.raises(TypeError, match="aggregate_gradients"):
        keras_mp.OptimizerWrapper(keras.optimizers.SGD(), aggregate_gradients=3)


def test_aggregate_gradients_argument_replaces_the_default_sum():
    def double(grads_and_vars):
        return [(g * 2.0, v) for g, v in grads_and_vars]

    plain = _fit_delta(keras.optimizers.SGD(0.1))
    wrapped = _fit_delta(
        keras_mp.OptimizerWrapper(
            keras.optimizers.SGD(0.1), aggregate_gradients=double
        )
    )
    np.testing.assert_allclose(wrapped, plain * 2.0, rtol=1e-5, atol=1e-7)


def test_inner_optimizer_is_the_argument_name_and_optimizer_still_works():
    by_new_name = keras_mp.OptimizerWrapper(
        inner_optimizer=keras.optimizers.SGD(0.1)
    )
    by_old_name = keras_mp.OptimizerWrapper(optimizer=keras.optimizers.SGD(0.2))
    assert float(by_new_name.learning_rate) == pytest.approx(0.1)
    assert float(by_old_name.learning_rate) == pytest.approx(0.2)
    with pytest.raises(TypeError, match="once"):
        keras_mp.OptimizerWrapper(
            keras.optimizers.SGD(), optimizer=keras.optimizers.SGD()
        )
