"""Keras's EMA (`use_ema=True`) leaves `overwrite_with_gradient` variables
alone (issue 35): FP8 statistics carriers and Keras's float8 scales and
amax histories are neither averaged, nor overwritten from an average, nor
changed by `finalize_variable_values`.

Keras 3.15 alone raises on TensorFlow ("None values not supported" in
`_backend_apply_gradients`'s `Cond`) and on JAX (a TypeError) for such
variables; on PyTorch it leaves them alone (measured: the carriers come out
bit-identical there on the code before the fix too).

Three steps with `ema_overwrite_frequency=3`: the third step's gradients
come from weights no EMA has touched yet, so its carriers and scales must
be bit-identical to a run without EMA, while the weights end as their
moving averages (the overwrite, then `fit`'s `finalize_variable_values`).

A second `fit` after that finalize (issue 48 item 4) trains from the
averages on every backend: Keras 3.15 alone fails it on JAX, in float32.
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import _keras_internals
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient
from keras_mp.testing import to_numpy

pytestmark = [
    pytest.mark.filterwarnings("ignore:Mixed precision compatibility check"),
    pytest.mark.filterwarnings(
        "ignore:Layer InputLayer does not have a `quantize`:UserWarning"
    ),
]


def _optimizer(use_ema, wrapper):
    optimizer = keras.optimizers.Adam(
        1e-2, use_ema=use_ema, ema_overwrite_frequency=3 if use_ema else None
    )
    if wrapper == "loss_scale":
        return keras_mp.LossScaleOptimizer(optimizer)
    if wrapper == "wrapper":
        return keras_mp.OptimizerWrapper(
            optimizer,
            transform_gradients=["clip_by_global_norm"],
            state_dtype="bfloat16",
        )
    return optimizer


def _train(fp8, wrapper, use_ema):
    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    if fp8 == "delayed":
        recipe = keras_mp.fp8.Recipe(scaling="delayed")
    else:
        recipe = keras_mp.fp8.Recipe(stats=True)
    if fp8 != "float8":
        # "plain": the optimizer `compile` keeps with the skip turned off
        # (under an FP8 recipe it would wrap it in a skipping
        # LossScaleOptimizer, the "loss_scale" cases' path).
        keras_mp.set_global_policy(
            "mixed_bfloat16", fp8=recipe, skip_nonfinite=wrapper != "plain"
        )
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(16)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(16)(hidden))
    if fp8 == "float8":
        model.quantize("float8")
    model.compile(_optimizer(use_ema, wrapper), "mse")
    rng = np.random.default_rng(0)
    x = rng.random((24, 16)).astype("float32")
    y = rng.random((24, 16)).astype("float32")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return model


def _base_optimizer(optimizer):
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


@pytest.mark.parametrize(
    "fp8, wrapper",
    [
        ("delayed", "plain"),
        ("stats", "loss_scale"),
        ("delayed", "wrapper"),
        ("float8", "plain"),
        ("float8", "loss_scale"),
    ],
)
def test_ema_leaves_overwriting_variables_alone(fp8, wrapper):
    reference = _train(fp8, wrapper, use_ema=False)
    model = _train(fp8, wrapper, use_ema=True)
    if wrapper == "plain":
        # `compile` kept the user's optimizer (`skip_nonfinite=False`).
        assert type(model.optimizer).__name__ == "Adam"
    pairs = list(zip(reference.trainable_variables, model.trainable_variables))
    overwritten = [(r, v) for r, v in pairs if overwrites_with_gradient(v)]
    regular = [(r, v) for r, v in pairs if not overwrites_with_gradient(v)]
    assert overwritten and regular
    for expected, variable in overwritten:
        np.testing.assert_array_equal(to_numpy(variable), to_numpy(expected))
    base = _base_optimizer(model.optimizer)
    averages = _keras_internals.moving_averages(base)
    assert [a is None for a in averages] == [
        overwrites_with_gradient(v) for v in model.trainable_variables
    ]
    # One average per variable, in the order of the model's (None for the
    # overwriting ones).
    by_variable = dict(zip(map(id, model.trainable_variables), averages))
    for expected, variable in regular:
        average = by_variable[id(variable)]
        np.testing.assert_array_equal(to_numpy(variable), to_numpy(average))
        assert not np.array_equal(to_numpy(variable), to_numpy(expected))
    # Again by hand: the overwriting variables still keep their values.
    before = [to_numpy(v) for _, v in overwritten]
    model.optimizer.finalize_variable_values(model.trainable_variables)
    for value, (_, variable) in zip(before, overwritten):
        np.testing.assert_array_equal(to_numpy(variable), value)


def _float32_model(wrapper):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(16)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(16)(hidden))
    model.compile(_optimizer(True, wrapper), "mse")
    return model


@pytest.mark.parametrize("wrapper", ["plain", "wrapper"])
def test_a_second_fit_after_ema_finalize_trains_from_the_averages(wrapper):
    # Keras 3.15 alone, on JAX: the first `fit`'s finalize leaves each
    # weight sharing its average's buffer, and the second `fit` ends in
    # "'NoneType' object is not callable". The reference continues from
    # the same values in a model and optimizer rebuilt from NumPy copies.
    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.random((24, 16)).astype("float32")
    y = rng.random((24, 16)).astype("float32")
    model = _float32_model(wrapper)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    weights = model.get_weights()
    state = [to_numpy(v) for v in model.optimizer.variables]

    reference = _float32_model(wrapper)
    reference.set_weights(weights)
    reference.optimizer.build(reference.trainable_variables)
    assert len(reference.optimizer.variables) == len(state)
    for variable, value in zip(reference.optimizer.variables, state):
        variable.assign(value)

    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    averages = _keras_internals.moving_averages(
        _base_optimizer(model.optimizer)
    )
    for variable, expected, average, before in zip(
        model.trainable_variables,
        reference.trainable_variables,
        averages,
        weights,
    ):
        np.testing.assert_allclose(
            to_numpy(variable), to_numpy(expected), rtol=1e-6, atol=1e-7
        )
        np.testing.assert_array_equal(to_numpy(variable), to_numpy(average))
        assert not np.array_equal(to_numpy(variable), before)
