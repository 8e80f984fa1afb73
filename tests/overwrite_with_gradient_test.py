"""Variables that overwrite themselves with their gradient pass untouched.

Keras's `model.quantize("float8")` keeps each layer's scales and amax
histories in variables with `overwrite_with_gradient=True`: their
"gradient" is the new value. keras_mp's pipeline sets them apart once
(`split_overwritten`), so no transform, unscaling, slot, master copy,
Lookahead interpolation or overflow counter touches them, and a non-finite
one still skips the step.

With a learning rate of 0 the weights never move, so the float8 state of
every run depends only on the data: each wrapped run must end with the
plain Keras optimizer's state, bit for bit.
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy

T = keras_mp.transforms


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return x, y


def _float8_state_after_fit(optimizer, policy=None):
    """The float8 state of a quantized two-Dense model after 4 steps."""
    if policy is not None:
        keras_mp.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model.quantize("float8")
    model.compile(optimizer, loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    state = [
        to_numpy(v)
        for v in model.trainable_weights
        if getattr(v, "overwrite_with_gradient", False)
    ]
    # Two layers, three scales and three histories each.
    assert len(state) == 12
    return state


def _adam(**kwargs):
    return keras.optimizers.Adam(0.0, **kwargs)


_WRAPPED = {
    "every_transform": lambda: keras_mp.OptimizerWrapper(
        _adam(),
        transform_gradients=[
            T.ClipByValue(1e-4),
            T.ClipByNorm(1e-3),
            T.GradientCentralization(),
            T.DecoupledWeightDecay(0.1),
            T.GaussianNoise(1.0, seed=3),
            T.ReplaceNonFinite(),
            T.AdaptiveClipByGlobalNorm(multiplier=1.01),
            T.ClipByGlobalNorm(1e-3),
        ],
    ),
    "lookahead": lambda: keras_mp.optimizers.Lookahead(
        _adam(), sync_period=2, slow_step_size=0.5
    ),
    "bfloat16_state": lambda: keras_mp.OptimizerWrapper(
        _adam(), state_dtype="bfloat16"
    ),
    "accumulation": lambda: keras_mp.OptimizerWrapper(
        _adam(gradient_accumulation_steps=2),
        transform_gradients=[T.ClipByGlobalNorm(1e-3)],
    ),
}


@pytest.mark.parametrize("case", sorted(_WRAPPED))
def test_keras_float8_state_is_untouched_by_the_wrapper(case):
    reference = _adam(
        gradient_accumulation_steps=2 if case == "accumulation" else None
    )
    expected = _float8_state_after_fit(reference)
    keras.utils.clear_session()
    got = _float8_state_after_fit(_WRAPPED[case]())
    for want, have in zip(expected, got):
        assert_bitwise_equal(have, want)


def test_loss_scale_optimizer_with_clipping_keeps_keras_float8_state():
    # Keras's own LossScaleOptimizer leaves the state alone; clipping the
    # unscaled gradients by a tiny norm must not change that.
    expected = _float8_state_after_fit(
        keras.optimizers.LossScaleOptimizer(_adam())
    )
    keras.utils.clear_session()
    got = _float8_state_after_fit(
        keras_mp.LossScaleOptimizer(
            _adam(), transform_gradients=[T.ClipByGlobalNorm(1e-3)]
        )
    )
    for want, have in zip(expected, got):
        assert_bitwise_equal(have, want)


def test_master_weights_copy_no_float8_state():
    optimizer = keras_mp.OptimizerWrapper(_adam(), master_weights=True)
    got = _float8_state_after_fit(optimizer, policy="bfloat16")
    keras.utils.clear_session()
    expected = _float8_state_after_fit(_adam(), policy="bfloat16")
    for want, have in zip(expected, got):
        assert_bitwise_equal(have, want)
    masters = [v.name for v in optimizer.variables if "master" in v.name]
    assert masters and not any(
        part in name for name in masters for part in ("scale", "amax_history")
    ), masters


def _overwriting_variable(value):
    variable = keras.Variable(value, dtype="float32", name="amax_history")
    variable.overwrite_with_gradient = True
    return variable


def test_overwriting_gradient_is_assigned_as_is_and_left_out_of_the_norm():
    kernel = keras.Variable(np.ones((2,), "float32"), name="kernel")
    history = _overwriting_variable(np.zeros((3,), "float32"))
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0),
        loss_scale=keras_mp.DynamicLossScale(4.0),
        transform_gradients=[T.ClipByGlobalNorm(1.0)],
        track_overflow=True,
    )
    optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))
    new_history = np.array([3.0, 4.0, 1e30], "float32")
    # Scaled by 4: unscaled (0.3, 0.4), norm 0.5, under the clip.
    optimizer.apply(
        [keras.ops.convert_to_tensor([1.2, 1.6]), new_history],
        [kernel, history],
    )
    assert_bitwise_equal(to_numpy(history), new_history)
    np.testing.assert_allclose(to_numpy(kernel), [0.7, 0.6], rtol=1e-6)
    assert int(to_numpy(optimizer.iterations)) == 1


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_overwriting_gradient_skips_the_step_and_is_not_reported(
    bad,
):
    kernel = keras.Variable(np.ones((2,), "float32"), name="kernel")
    history = _overwriting_variable(np.array([1.0, 2.0, 3.0], "float32"))
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.1),
        loss_scale=keras_mp.DynamicLossScale(4.0),
        track_overflow=True,
    )
    optimizer.build([kernel, history])
    state = [kernel, history, *optimizer.inner_optimizer.variables]
    before = [to_numpy(v) for v in state]
    optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))
    optimizer.apply(
        [
            keras.ops.convert_to_tensor([1.0, 1.0]),
            np.array([1.0, bad, 2.0], "float32"),
        ],
        [kernel, history],
    )
    for value, variable in zip(before, state, strict=True):
        assert_bitwise_equal(to_numpy(variable), value)
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert float(to_numpy(optimizer.loss_scale())) == 2.0
    assert list(optimizer.overflow_report()) == []


_MIRRORED = """
import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import keras
import numpy as np

import keras_mp

rng = np.random.RandomState(0)
x = rng.randn(32, 16).astype("float32")
x[16:] *= 10  # the second replica's rows hold the largest inputs
y = rng.randn(32, 4).astype("float32")


def float8_state(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(4)]
        )
        model.quantize("float8")
        model.compile(
            keras_mp.OptimizerWrapper(keras.optimizers.Adam(0.0)), loss="mse"
        )
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return [
        keras.ops.convert_to_numpy(v).tolist()
        for v in model.trainable_weights
        if v.overwrite_with_gradient
    ]


one = float8_state(tf.distribute.get_strategy())
two = float8_state(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
print("RESULT " + json.dumps({"one": one, "two": two}))
"""


@pytest.mark.backends("tensorflow")
@pytest.mark.slow
def test_mirrored_replicas_record_the_largest_amax_as_one_device_does():
    # Each replica computes a new amax history from its half of the batch:
    # the max of the two is the one device's (a sum would overstate it,
    # the first replica's alone, as Keras's optimizer keeps, understate it).
    import json

    from keras_mp.testing import run_python

    out = run_python(_MIRRORED, env={"KERAS_BACKEND": "tensorflow"})
    line = [row for row in out.splitlines() if row.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])
    assert len(result["one"]) == 12
    for one, two in zip(result["one"], result["two"], strict=True):
        assert_bitwise_equal(
            np.asarray(two, "float32"), np.asarray(one, "float32")
        )
