import functools
import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.testing import apply_as_fit
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy

BACKEND = keras.backend.backend()

# One step of a scaled loss's gradients, as `fit` runs it.
_scaled_step = functools.partial(apply_as_fit, scale_loss=True)


def _variables():
    return [
        keras.Variable([1.0, 2.0, 3.0, 4.0], name="a"),
        keras.Variable([[0.5, -0.5]], name="b"),
    ]


def _grads(scale, poison=None):
    grads = [
        np.array([1.0, 6.0, 7.0, 2.0], "float32") * scale,
        np.array([[0.25, -1.0]], "float32") * scale,
    ]
    if poison is not None:
        grads[1][0, 0] = poison
    return [ops.convert_to_tensor(g) for g in grads]


def test_finite_step_unscales_gradients_before_the_inner_update():
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    variables = _variables()
    _scaled_step(optimizer, _grads(optimizer.initial_scale), variables)
    assert_close(variables[0], [0.5, -1.0, -0.5, 3.0])
    assert_close(variables[1], [[0.375, 0.0]])
    assert int(to_numpy(optimizer.iterations)) == 1
    assert int(to_numpy(optimizer.skipped_steps)) == 0


@pytest.mark.parametrize("poison", [np.inf, -np.inf, np.nan])
def test_nonfinite_step_is_skipped_bit_for_bit_and_halves_the_scale(poison):
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.1, weight_decay=0.01),
        loss_scale=keras_mp.DynamicLossScale(1024.0, increment_period=3),
    )
    variables = _variables()
    for _ in range(2):
        _scaled_step(optimizer, _grads(1024.0), variables)
    before_vars = [to_numpy(v) for v in variables]
    inner_before = [to_numpy(v) for v in optimizer.inner_optimizer.variables]
    _scaled_step(optimizer, _grads(1024.0, poison=poison), variables)
    for variable, value in zip(variables, before_vars):
        assert_bitwise_equal(variable, value)
    for variable, value in zip(
        optimizer.inner_optimizer.variables, inner_before
    ):
        assert_bitwise_equal(variable, value, msg=variable.path)
    assert float(to_numpy(optimizer.loss_scale())) == 512.0
    assert int(to_numpy(optimizer.loss_scale.num_good_steps)) == 0
    assert int(to_numpy(optimizer.iterations)) == 2
    assert int(to_numpy(optimizer.skipped_steps)) == 1


@pytest.mark.parametrize(
    "values, applied",
    [
        # Finite float16 values whose sum (2.4e5) is beyond float16's
        # largest value (65504): the step applies.
        ([6e4, 6e4, 6e4, 6e4], True),
        # One inf, one -inf: their sum is NaN, never a finite zero.
        ([np.inf, -np.inf, 1.0, 1.0], False),
        ([1.0, np.nan, 1.0, 1.0], False),
    ],
)
def test_one_finite_check_for_all_gradients_is_exact_for_float16(
    values, applied
):
    # float16 variables get float16 gradients; the second one is finite.
    variables = [
        keras.Variable(np.zeros(4), dtype="float16", name="a"),
        keras.Variable(np.zeros(2), dtype="float16", name="b"),
    ]
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), loss_scale=keras_mp.DynamicLossScale(1.0)
    )
    grads = [
        ops.convert_to_tensor(np.array(values, "float16")),
        ops.convert_to_tensor(np.ones(2, "float16")),
    ]
    _scaled_step(optimizer, grads, variables)
    expected = -np.array(values, "float16") if applied else np.zeros(4)
    assert_bitwise_equal(variables[0], expected.astype("float16"))
    assert int(to_numpy(optimizer.skipped_steps)) == int(not applied)


@pytest.mark.parametrize("skip_on_device", [False, True])
def test_finite_float32_values_summing_past_its_range_skip_on_the_device(
    skip_on_device,
):
    # The one documented approximation of the finite check on the device
    # (`backend.gradients.gradient_sum`): two finite values whose float32
    # sum (6e38) is beyond float32's largest value (3.4e38) count as an
    # overflow. The step is skipped whole and the scale halves, as for an
    # inf. PyTorch's default check (the fused check-and-unscale kernel,
    # decided on the host) looks at each value: the step applies.
    variables = [keras.Variable(np.zeros(2), dtype="float32", name="a")]
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1e-30),
        loss_scale=keras_mp.DynamicLossScale(2.0),
        skip_on_device=skip_on_device,
    )
    grads = [ops.convert_to_tensor(np.array([3e38, 3e38], "float32"))]
    _scaled_step(optimizer, grads, variables)
    exact = keras.backend.backend() == "torch" and not skip_on_device
    expected = -1e-30 * np.float32(1.5e38) if exact else 0.0
    assert_bitwise_equal(variables[0], np.full(2, expected, "float32"))
    assert int(to_numpy(optimizer.skipped_steps)) == int(not exact)
    assert float(to_numpy(optimizer.loss_scale())) == (2.0 if exact else 1.0)


def test_scale_follows_the_algorithm_step_by_step_with_injected_overflows():
    loss_scale = keras_mp.DynamicLossScale(
        initial_loss_scale=4.0,
        increment_period=2,
        multiplier=2.0,
        min_loss_scale=1.0,
        max_loss_scale=16.0,
    )
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=loss_scale
    )
    variables = _variables()
    pattern = "FFFFFFNNNNNFFFNFFFFFFFFNF"
    scale, good, skipped, applied = 4.0, 0, 0, 0
    for step, kind in enumerate(pattern):
        grads = _grads(scale, poison=np.nan if kind == "N" else None)
        _scaled_step(optimizer, grads, variables)
        if kind == "N":
            scale, good, skipped = max(scale / 2, 1.0), 0, skipped + 1
        else:
            good, applied = good + 1, applied + 1
            if good == 2:
                good = 0
                if scale * 2 <= 16.0:
                    scale *= 2
        got = float(to_numpy(optimizer.loss_scale()))
        assert got == scale, f"step {step}: scale {got} != {scale}"
        assert int(to_numpy(optimizer.loss_scale.num_good_steps)) == good
        assert int(to_numpy(optimizer.skipped_steps)) == skipped
        assert int(to_numpy(optimizer.iterations)) == applied
        assert 1.0 <= got <= 16.0 and math.isfinite(got)


def test_fixed_loss_scale_never_skips():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), loss_scale=8
    )
    variables = _variables()
    _scaled_step(optimizer, _grads(8.0, poison=np.inf), variables)
    assert np.isinf(to_numpy(variables[1])[0, 0])
    assert int(to_numpy(optimizer.iterations)) == 1
    assert float(to_numpy(optimizer.loss_scale())) == 8.0


def test_rfc293_style_and_keras3_style_give_identical_updates():
    def run(style):
        keras.utils.set_random_seed(0)
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            loss_scale=keras_mp.DynamicLossScale(256.0),
        )
        variables = _variables()
        optimizer.build(variables)
        grads = _grads(256.0)
        optimizer.get_scaled_loss(1.0)
        if style == "rfc293":
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, variables))
        return [to_numpy(v) for v in variables]

    for a, b in zip(run("keras3"), run("rfc293")):
        assert_bitwise_equal(a, b)


def test_get_unscaled_gradients_passes_none_through():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=4
    )
    grads = optimizer.get_unscaled_gradients([None, ops.ones((2,))])
    assert grads[0] is None
    assert_close(grads[1], [0.25, 0.25])


def test_get_scaled_loss_accepts_tensors_and_callables():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=keras_mp.DynamicLossScale(64)
    )
    assert float(to_numpy(optimizer.get_scaled_loss(ops.ones(())))) == 64.0
    scaled = optimizer.get_scaled_loss(lambda: ops.ones(()) * 2)
    assert float(to_numpy(scaled())) == 128.0


def test_minimize_with_a_callable_loss_on_every_backend():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), loss_scale=keras_mp.DynamicLossScale(1024)
    )
    w = keras.Variable([1.0, -2.0])
    optimizer.minimize(lambda: ops.sum(ops.square(w)), [w])
    # d/dw sum(w^2) = 2w; w - 0.5 * 2w = 0.
    assert_close(w, [0.0, 0.0])
    assert int(to_numpy(optimizer.iterations)) == 1


@pytest.mark.backends("tensorflow")
def test_minimize_with_a_tape_in_tf_function():
    import tensorflow as tf

    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.25),
        loss_scale=keras_mp.DynamicLossScale(2.0**20),
    )
    w = keras.Variable([1.0, -2.0])

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = ops.sum(ops.square(w))
        optimizer.minimize(loss, [w], tape=tape)

    step()
    assert_close(w, [0.5, -1.0])


def test_delegates_hyperparameters_and_refuses_other_attributes():
    inner = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)
    optimizer = keras_mp.LossScaleOptimizer(inner)
    assert float(optimizer.momentum) == 0.9 and optimizer.nesterov is True
    optimizer.momentum = 0.5
    assert inner.momentum == 0.5
    optimizer.learning_rate = 0.25
    assert float(to_numpy(inner.learning_rate)) == 0.25
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    assert not inner._use_weight_decay(keras.Variable([1.0], name="bias"))
    assert "momentum" in dir(optimizer) and "nesterov" in dir(optimizer)
    assert optimizer.iterations is inner.iterations
    with pytest.raises(AttributeError, match="no_such_thing"):
        optimizer.no_such_thing  # noqa: B018
    optimizer.build([keras.Variable([1.0])])
    with pytest.raises(AttributeError, match="inner_optimizer.momentums"):
        optimizer.momentums  # noqa: B018


def test_variables_are_the_inner_ones_then_the_loss_scale():
    inner = keras.optimizers.Adam(0.1)
    optimizer = keras_mp.LossScaleOptimizer(inner)
    optimizer.build(_variables())
    names = [v.name for v in optimizer.variables]
    n = len(inner.variables)
    assert optimizer.variables[:n] == inner.variables
    assert names[n:] == ["loss_scale", "num_good_steps", "skipped_steps"]


def test_is_a_keras_loss_scale_optimizer_and_serializes_nested():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.3, momentum=0.2),
        loss_scale=keras_mp.DynamicLossScale(
            initial_loss_scale=128.0,
            increment_period=7,
            multiplier=4.0,
            min_loss_scale=0.5,
            max_loss_scale=4096.0,
        ),
        aggregate_in_float16=True,
        name="scaled",
        skip_on_device=True,
    )
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    config = keras.saving.serialize_keras_object(optimizer)
    assert config["registered_name"] == "keras_mp>LossScaleOptimizer"
    restored = keras.saving.deserialize_keras_object(config)
    assert type(restored) is keras_mp.LossScaleOptimizer
    assert restored.get_config() == optimizer.get_config()
    assert restored.loss_scale.get_config() == optimizer.loss_scale.get_config()
    assert restored.aggregate_in_float16 is True
    assert restored.skip_on_device is True
    assert float(restored.inner_optimizer.momentum) == 0.2


def test_skip_on_device_must_be_a_bool():
    with pytest.raises(TypeError, match="Received: skip_on_device='yes'"):
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(), skip_on_device="yes"
        )


def test_reads_keras3_and_tf_keras_constructor_arguments():
    keras3 = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=64.0, dynamic_growth_steps=5
    )
    assert keras3.loss_scale.initial_loss_scale == 64.0
    assert keras3.loss_scale.increment_period == 5
    tf_keras_config = {
        "inner_optimizer": keras.saving.serialize_keras_object(
            keras.optimizers.SGD(0.1)
        ),
        "dynamic": False,
        "initial_scale": 32.0,
        "dynamic_growth_steps": None,
    }
    fixed = keras_mp.LossScaleOptimizer.from_config(tf_keras_config)
    assert isinstance(fixed.loss_scale, keras_mp.FixedLossScale)
    assert fixed.loss_scale.loss_scale_value == 32.0


def test_bad_input_raises_with_what_was_expected_and_received():
    with pytest.raises(TypeError, match="Received: inner_optimizer='adam'"):
        keras_mp.LossScaleOptimizer("adam")
    inner = keras.optimizers.SGD(0.1)
    scaled = keras_mp.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="already scales the loss"):
        keras_mp.LossScaleOptimizer(scaled)
    with pytest.raises(ValueError, match="already scales the loss"):
        keras_mp.LossScaleOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        )
    with pytest.raises(ValueError, match="already wrapped"):
        keras_mp.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="needs a loss scale"):
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=None)
    with pytest.raises(ValueError, match="at least 1"):
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=0.5)
    with pytest.raises(ValueError, match="does not support arguments: `foo`"):
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), foo=1)


def test_float16_gradients_for_float32_variables_name_the_variable():
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    variable = keras.Variable([1.0, 2.0], name="kernel_x")
    with pytest.raises(ValueError, match="kernel_x.*float16"):
        optimizer.apply_gradients([(ops.ones((2,), dtype="float16"), variable)])


# ---------------------------------------------------------------------------
# Regression tests of ordinary paths that used to give silent wrong results.


def _rfc293_gradients(optimizer, variable, coefficients):
    """Gradients of `get_scaled_loss(sum(variable * coefficients))`."""
    from keras_mp.backend import gradients as backend_gradients

    def scaled_loss():
        return optimizer.get_scaled_loss(
            ops.sum(variable * ops.convert_to_tensor(coefficients))
        )

    return backend_gradients.compute_gradients(scaled_loss, [variable])


def _clip_by_global_norm_that_clips_nothing(grads):
    norm = ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))
    factor = ops.minimum(1.0, ops.divide(1e6, norm))
    return [g * factor for g in grads]


@pytest.mark.parametrize(
    "post_process",
    [
        lambda grads: grads,
        lambda grads: [g * 1.0 for g in grads],
        lambda grads: [ops.clip(g, -1e6, 1e6) for g in grads],
        _clip_by_global_norm_that_clips_nothing,
    ],
    ids=["identity", "times_one", "clip", "clip_by_global_norm"],
)
def test_rfc293_loop_with_post_processing_unscales_exactly_once(post_process):
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=keras_mp.DynamicLossScale(1024)
    )
    variable = keras.Variable([1.0, 2.0])
    coefficients = np.array([0.25, -0.5], "float32")
    scaled = _rfc293_gradients(optimizer, variable, coefficients)
    assert_close(scaled[0], coefficients * 1024)
    grads = post_process(optimizer.get_unscaled_gradients(scaled))
    optimizer.apply_gradients(zip(grads, [variable]))
    assert_close(variable, np.array([1.0, 2.0]) - 0.1 * coefficients)


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("compiled", [False, True])
def test_rfc293_tape_loop_with_clipping_unscales_exactly_once(compiled):
    import tensorflow as tf

    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=keras_mp.DynamicLossScale(1024)
    )
    variable = keras.Variable([1.0, 2.0])
    coefficients = tf.constant([0.25, -0.5])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable.value * coefficients)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, [variable.value])
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        grads, _ = tf.clip_by_global_norm(grads, 1e6)
        optimizer.apply_gradients(zip(grads, [variable]))

    (tf.function(step) if compiled else step)()
    assert_close(variable, [1.0 - 0.025, 2.0 + 0.05])


def test_keras3_loop_still_unscales_after_post_processing():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=keras_mp.DynamicLossScale(1024)
    )
    variable = keras.Variable([1.0, 2.0])
    coefficients = np.array([0.25, -0.5], "float32")
    scaled = _rfc293_gradients(optimizer, variable, coefficients)
    optimizer.apply([ops.clip(scaled[0], -1e6, 1e6)], [variable])
    assert_close(variable, np.array([1.0, 2.0]) - 0.1 * coefficients)


def test_gradients_of_an_unscaled_loss_are_applied_undivided_with_a_warning():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=keras_mp.DynamicLossScale(1024)
    )
    variable = keras.Variable([1.0, 2.0])
    with pytest.warns(UserWarning, match="scale_loss"):
        optimizer.apply([ops.array([0.25, -0.5])], [variable])
    assert_close(variable, [1.0 - 0.025, 2.0 + 0.05])
    # Non-finite gradients of an unscaled loss are still skipped.
    before = to_numpy(variable)
    optimizer.apply([ops.array([np.inf, 0.0])], [variable])
    assert_bitwise_equal(variable, before)
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert float(to_numpy(optimizer.loss_scale())) == 512.0


def test_two_optimizers_cannot_share_one_loss_scale():
    scale = keras_mp.DynamicLossScale(1024)
    first = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=scale
    )
    assert first.loss_scale is scale
    with pytest.raises(ValueError, match="already belongs to"):
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=scale)
    # Each optimizer given its own scale keeps its own state: an overflow in
    # one neither skips nor rescales the other.
    second = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=type(scale).from_config(scale.get_config()),
    )
    a, b = keras.Variable([1.0, 2.0]), keras.Variable([1.0, 2.0])
    first.scale_loss(1.0)
    first.apply([ops.array([np.inf, 0.0])], [a])
    second.scale_loss(1.0)
    second.apply([ops.array([1024.0, 0.0])], [b])
    assert float(to_numpy(first.loss_scale())) == 512.0
    assert float(to_numpy(second.loss_scale())) == 1024.0
    assert int(to_numpy(second.skipped_steps)) == 0
    assert_close(b, [0.9, 2.0])


def test_policy_loss_scale_is_copied_per_compiled_model():
    keras_mp.set_global_policy(
        keras_mp.Policy(
            "mixed_float16", loss_scale=keras_mp.DynamicLossScale(8)
        )
    )
    optimizers = []
    for _ in range(2):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
        optimizers.append(model.optimizer)
    assert optimizers[0].loss_scale is not optimizers[1].loss_scale
