import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.testing import to_numpy


def _reference_lookahead(w0, grads_fn, lr, k, alpha, steps):
    fast = np.array(w0, "float64")
    slow = fast.copy()
    for step in range(1, steps + 1):
        fast = fast - lr * grads_fn(fast)
        if step % k == 0:
            slow = slow + alpha * (fast - slow)
            fast = slow.copy()
    return fast


def test_lookahead_matches_the_published_algorithm():
    optimizer = keras_mp.optimizers.Lookahead(
        keras.optimizers.SGD(0.1), sync_period=3, slow_step_size=0.5
    )
    w = keras.Variable([1.0, -2.0, 0.5])
    for _ in range(7):
        optimizer.minimize(lambda: ops.sum(ops.square(w)), [w])
    expected = _reference_lookahead(
        [1.0, -2.0, 0.5], lambda v: 2 * v, lr=0.1, k=3, alpha=0.5, steps=7
    )
    np.testing.assert_allclose(to_numpy(w), expected, rtol=1e-5)


def _model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


@pytest.mark.parametrize("order", ["lookahead_outside", "loss_scale_outside"])
def test_lookahead_and_loss_scaling_nest_both_ways_in_fit(order):
    keras_mp.set_global_policy("mixed_bfloat16")
    if order == "lookahead_outside":
        optimizer = keras_mp.optimizers.Lookahead(
            keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
            sync_period=2,
        )
    else:
        optimizer = keras_mp.LossScaleOptimizer(
            keras_mp.optimizers.Lookahead(keras.optimizers.Adam(0.01), 2)
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = _model()
    model.compile(optimizer, "mse")
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    assert int(to_numpy(optimizer.iterations)) == 16


def test_lookahead_config_round_trips_with_non_default_values():
    optimizer = keras_mp.optimizers.Lookahead(
        keras.optimizers.SGD(0.2), sync_period=7, slow_step_size=0.25
    )
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(optimizer)
    )
    assert type(restored) is keras_mp.optimizers.Lookahead
    assert restored.sync_period == 7 and restored.slow_step_size == 0.25


def test_lookahead_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sync_period=0"):
        keras_mp.optimizers.Lookahead(keras.optimizers.SGD(), sync_period=0)
    with pytest.raises(TypeError, match="sync_period"):
        keras_mp.optimizers.Lookahead(keras.optimizers.SGD(), sync_period=2.5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_lookahead_in_fit_matches_the_reference_with_and_without_xla(
    jit_compile,
):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones"),
        ]
    )
    optimizer = keras_mp.optimizers.Lookahead(
        keras.optimizers.SGD(0.1), sync_period=2, slow_step_size=0.5
    )
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=8, epochs=5, verbose=0, shuffle=False)
    expected = _reference_lookahead(
        np.ones((3, 1)),
        lambda w: 2 * x.T @ (x @ w - y) / 8,
        lr=0.1,
        k=2,
        alpha=0.5,
        steps=5,
    )
    np.testing.assert_allclose(
        to_numpy(model.layers[0].kernel), expected, rtol=1e-5, atol=1e-6
    )
