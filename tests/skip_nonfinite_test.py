"""Skipping non-finite steps without a loss scale, and stopping loudly.

`set_global_policy(..., skip_nonfinite=...)` (on by default under FP8
recipes): `compile` wraps the optimizer in a `LossScaleOptimizer` with a
scale of 1 that skips a step whose gradients hold an inf or NaN, exactly as
a dynamic scale does; `max_consecutive_skips` steps skipped in a row stop
`fit`; `ModelCheckpoint` never writes non-finite weights or optimizer state.
"""

import os
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import count_host_syncs
from keras_mp.testing import to_numpy

BATCH = 8
# FP8 needs GEMM dimensions that are multiples of 16.
FEATURES = 16


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(FEATURES, activation="relu", name="hidden"),
            keras.layers.Dense(FEATURES, name="middle"),
            keras.layers.Dense(1, name="head"),
        ]
    )


def _data(batches, nonfinite=(), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * BATCH, FEATURES)).astype("float32")
    y = rng.normal(size=(batches * BATCH, 1)).astype("float32")
    for batch in nonfinite:
        x[batch * BATCH + 1, 3] = np.nan
    return x, y


def _fit(model, x, y, **kwargs):
    return model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **kwargs
    )


def _state(model):
    return [to_numpy(v) for v in model.weights] + [
        to_numpy(v) for v in model.optimizer.inner_optimizer.variables
    ]


_POLICIES = {
    # Opt-in without FP8, on by default with it.
    "mixed_bfloat16_opt_in": dict(skip_nonfinite=True),
    "fp8_default": dict(fp8=True),
}


@pytest.mark.parametrize(
    "policy",
    [
        "mixed_bfloat16_opt_in",
        # FP8 GEMMs compile slowly on a CPU.
        pytest.param("fp8_default", marks=pytest.mark.slow),
    ],
)
def test_one_nan_batch_is_skipped_bit_identically_and_training_goes_on(
    policy,
):
    keras_mp.set_global_policy("mixed_bfloat16", **_POLICIES[policy])
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras_mp.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert optimizer.skip_nonfinite and optimizer.track_overflow
    assert float(to_numpy(optimizer.loss_scale())) == 1.0
    if policy == "fp8_default":
        assert model.get_layer("hidden").dtype_policy.fp8 is not None
    _fit(model, *_data(1))
    before = _state(model)
    history = _fit(model, *_data(1, nonfinite=[0], seed=1))
    for old, new in zip(before, _state(model)):
        assert_bitwise_equal(new, old)
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert history.history["skipped_steps"] == [1]
    assert history.history["loss_scale"] == [1.0]
    assert int(to_numpy(optimizer.iterations)) == 1
    report = optimizer.overflow_report()
    # The NaN input poisons the first layer's kernel gradient everywhere;
    # whether it reaches the later layers depends on relu(NaN), NaN or 0
    # by backend and kernel (TensorFlow's fused oneDNN relu gives 0 on
    # CPUs with AVX512-BF16).
    layers = {record.layer for record in report}
    assert "hidden" in layers and layers <= {"hidden", "middle", "head"}
    _fit(model, *_data(2, seed=2))
    after = [to_numpy(w) for w in model.weights]
    assert all(np.isfinite(w).all() for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))
    assert int(to_numpy(optimizer.iterations)) == 3
    assert int(to_numpy(optimizer.skipped_steps)) == 1


def test_a_finite_step_is_plain_adams_update_bit_for_bit():
    # A scale of 1 multiplies and divides nothing: the update is the inner
    # optimizer's own, whichever backend decides the skip.
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=False)
    plain = _model()
    plain.compile(keras.optimizers.Adam(1e-2), loss="mse")
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    skipping = _model()
    skipping.compile(keras.optimizers.Adam(1e-2), loss="mse")
    assert isinstance(plain.optimizer, keras.optimizers.Adam)
    assert isinstance(skipping.optimizer, keras_mp.LossScaleOptimizer)
    x, y = _data(3)
    _fit(plain, x, y)
    _fit(skipping, x, y)
    for a, b in zip(plain.weights, skipping.weights):
        assert_bitwise_equal(to_numpy(b), to_numpy(a))


def test_a_fixed_scale_skips_only_when_asked():
    def step(optimizer, gradient):
        # RFC 293's loop: the gradients of a scaled loss, unscaled.
        gradient = keras.ops.convert_to_tensor(gradient)
        (unscaled,) = optimizer.get_unscaled_gradients([gradient])
        optimizer.apply_gradients([(unscaled, variable)])

    variable = keras.Variable(np.ones((3,), "float32"))
    nan = np.array([128.0, np.nan, 128.0], "float32")
    fixed = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), 128)
    step(fixed, nan)
    assert np.isnan(to_numpy(variable)).any()  # RFC 293: applied.
    variable.assign(np.ones((3,), "float32"))
    skipping = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), 128, skip_nonfinite=True
    )
    step(skipping, nan)
    assert_bitwise_equal(to_numpy(variable), np.ones((3,), "float32"))
    assert int(to_numpy(skipping.skipped_steps)) == 1
    assert int(to_numpy(skipping.consecutive_skips)) == 1
    assert skipping.max_consecutive_skips == 2
    step(skipping, np.full((3,), 128.0, "float32"))
    np.testing.assert_allclose(to_numpy(variable), np.full((3,), 0.9))
    assert int(to_numpy(skipping.consecutive_skips)) == 0


def test_an_applied_step_resets_a_count_written_between_steps():
    """An applied step sets the count to 0 unless it is held at the limit.
    PyTorch's host-decided step leaves out that update where nothing wrote
    the count since its last one (the update is idempotent); a count
    written between steps (`assign`, a checkpoint's load) is still reset."""
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), 1, skip_nonfinite=True
    )
    variable = keras.Variable(np.ones((3,), "float32"))
    finite = [keras.ops.ones((3,))]

    def count_after_step():
        optimizer.apply(finite, [variable])
        return int(to_numpy(optimizer.consecutive_skips))

    assert count_after_step() == 0
    assert count_after_step() == 0
    optimizer.consecutive_skips.assign(1)
    assert count_after_step() == 0
    optimizer.consecutive_skips.assign(1)
    optimizer.consecutive_skips.assign(1)
    assert count_after_step() == 0
    # Held at the limit (2) until the user assigns 0.
    optimizer.consecutive_skips.assign(2)
    assert count_after_step() == 2
    assert count_after_step() == 2
    optimizer.consecutive_skips.assign(0)
    assert count_after_step() == 0
    optimizer.apply([keras.ops.full((3,), float("nan"))], [variable])
    assert int(to_numpy(optimizer.consecutive_skips)) == 1
    assert count_after_step() == 0
    np.testing.assert_allclose(to_numpy(variable), np.full((3,), 0.2), 1e-6)


def test_skipped_steps_in_a_row_stop_fit_naming_the_layers():
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    # One isolated bad batch is skipped; two in a row stop the run.
    x, y = _data(6, nonfinite=[1, 3, 4])
    with pytest.raises(FloatingPointError) as raised:
        _fit(model, x, y)
    message = str(raised.value)
    assert "2 steps in a row" in message
    assert "max_consecutive_skips=2" in message
    assert "hidden (3 steps)" in message
    optimizer = model.optimizer
    # Stopped at the end of batch 4: batch 5 never ran.
    assert int(to_numpy(optimizer.skipped_steps)) == 3
    assert int(to_numpy(optimizer.iterations)) == 2
    assert int(to_numpy(optimizer.consecutive_skips)) == 2


def test_max_consecutive_skips_none_never_stops_and_can_be_set_before_fit():
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    model.optimizer.max_consecutive_skips = None
    _fit(model, *_data(3, nonfinite=[0, 1, 2]))
    assert int(to_numpy(model.optimizer.skipped_steps)) == 3
    assert model.optimizer.consecutive_skips is None
    with pytest.raises(ValueError, match="before the first step"):
        model.optimizer.max_consecutive_skips = 3
    model.optimizer.max_consecutive_skips = None


@pytest.mark.backends("tensorflow", "jax")  # steps_per_execution > 1
def test_the_limit_is_counted_in_the_step_and_held_for_the_batch_end_check():
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    model = _model()
    model.compile(keras.optimizers.SGD(1e-2), loss="mse", steps_per_execution=2)
    # Two steps per call of the compiled step, checked after each call:
    # steps 1 and 2 skipped in a row, step 3 applied. The count reaches 2
    # inside the second call and is held there for the check after it.
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        _fit(model, *_data(4, nonfinite=[1, 2]))
    optimizer = model.optimizer
    assert int(to_numpy(optimizer.iterations)) == 2
    assert int(to_numpy(optimizer.consecutive_skips)) == 2
    optimizer.consecutive_skips.assign(0)
    _fit(model, *_data(4, nonfinite=[1], seed=1))
    assert int(to_numpy(optimizer.consecutive_skips)) == 0


def test_model_checkpoint_warns_and_skips_a_nonfinite_save(tmp_path):
    # No FP8, so no skip: the NaN batch poisons the weights.
    keras_mp.set_global_policy("mixed_bfloat16")
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    good = os.path.join(tmp_path, "good.weights.h5")
    _fit(
        model,
        *_data(1),
        callbacks=[
            keras.callbacks.ModelCheckpoint(good, save_weights_only=True)
        ],
    )
    assert os.path.exists(good)
    poisoned = os.path.join(tmp_path, "poisoned.keras")
    with pytest.warns(UserWarning, match="ModelCheckpoint skipped this save"):
        _fit(
            model,
            *_data(1, nonfinite=[0]),
            callbacks=[keras.callbacks.ModelCheckpoint(poisoned)],
        )
    assert np.isnan(to_numpy(model.get_layer("hidden").kernel)).any()
    assert not os.path.exists(poisoned)


def test_model_checkpoint_saves_after_a_skipped_step(tmp_path):
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    path = os.path.join(tmp_path, "model_{batch}.keras")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "ModelCheckpoint skipped")
        _fit(
            model,
            *_data(2, nonfinite=[1]),
            callbacks=[keras.callbacks.ModelCheckpoint(path, save_freq=1)],
        )
    assert sorted(os.listdir(tmp_path)) == ["model_1.keras", "model_2.keras"]


def test_the_skip_wrapper_survives_save_and_load_model(tmp_path):
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    model.optimizer.max_consecutive_skips = 5
    _fit(model, *_data(2, nonfinite=[1]))
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    keras_mp.set_global_policy(None)
    loaded = keras.saving.load_model(path)
    optimizer = loaded.optimizer
    assert type(optimizer) is keras_mp.LossScaleOptimizer
    assert optimizer.skip_nonfinite and optimizer.track_overflow
    assert optimizer.max_consecutive_skips == 5
    assert isinstance(optimizer.loss_scale, keras_mp.FixedLossScale)
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert int(to_numpy(optimizer.consecutive_skips)) == 1
    _fit(loaded, *_data(1, nonfinite=[0]))
    assert int(to_numpy(optimizer.skipped_steps)) == 2


def test_config_round_trip_keeps_every_argument():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5),
        loss_scale=None,
        skip_nonfinite=True,
        max_consecutive_skips=7,
        track_overflow=True,
    )
    config = optimizer.get_config()
    assert config["skip_nonfinite"] is True
    assert config["max_consecutive_skips"] == 7
    restored = keras_mp.LossScaleOptimizer.from_config(config)
    assert restored.get_config() == config
    dynamic = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    assert dynamic.max_consecutive_skips is None
    assert not dynamic.skip_nonfinite


def test_an_optimizer_with_a_loss_scale_is_not_wrapped_again():
    keras_mp.set_global_policy("mixed_bfloat16", fp8=True, skip_nonfinite=True)
    given = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), 8.0)
    model = _model()
    model.compile(given, loss="mse")
    assert model.optimizer is given
    keras_mp.set_global_policy("mixed_float16", skip_nonfinite=True)
    model = _model()
    model.compile(keras.optimizers.Adam(), loss="mse")
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    inner = model.optimizer.inner_optimizer
    assert isinstance(inner, keras.optimizers.Adam)
    assert not isinstance(inner, keras_mp.OptimizerWrapper)
    assert model.optimizer.loss_scale.is_dynamic


def test_a_model_with_nothing_trainable_steps_under_the_wrapper():
    """A frozen model (fine-tuning with every layer frozen, or a probe)
    compiles with the skipping wrapper and trains as plain SGD does:
    nothing changes, the wrapper stays unbuilt until something is
    trainable (once unbuilt, JAX's `stateless_apply` raised)."""
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    model = _model()
    for layer in model.layers:
        layer.trainable = False
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data(3, nonfinite=(1,))
    before = [to_numpy(v) for v in model.weights]
    _fit(model, x, y)
    for want, got in zip(before, model.weights):
        assert_bitwise_equal(got, want)
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)


def test_without_fp8_or_with_false_the_optimizer_is_left_alone():
    for kwargs in (dict(), dict(fp8=True, skip_nonfinite=False)):
        keras_mp.set_global_policy("mixed_bfloat16", **kwargs)
        model = _model()
        model.compile(keras.optimizers.Adam(), loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.Adam), kwargs
        assert not isinstance(model.optimizer, keras_mp.OptimizerWrapper)


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(TypeError, match="skip_nonfinite='yes'"):
        keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite="yes")
    with pytest.raises(TypeError, match="skip_nonfinite=1"):
        keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=1)
    with pytest.raises(TypeError, match="skip_nonfinite"):
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), skip_nonfinite=1)
    with pytest.raises(ValueError, match="at least 1"):
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(), skip_nonfinite=True, max_consecutive_skips=0
        )
    with pytest.raises(TypeError, match="positive int"):
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(), max_consecutive_skips=2.5
        )
    with pytest.raises(ValueError, match="skip_nonfinite=True"):
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=None)


@pytest.mark.backends("tensorflow", "jax")
def test_the_skip_adds_no_host_read_and_the_stop_check_one_per_batch():
    def reads(max_consecutive_skips):
        keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
        model = _model()
        model.compile(keras.optimizers.SGD(1e-2), loss="mse")
        model.optimizer.max_consecutive_skips = max_consecutive_skips
        _fit(model, *_data(2))
        counted = []
        for batches in (3, 6):
            with count_host_syncs() as counts:
                _fit(model, *_data(batches, nonfinite=[1]))
            counted.append(sum(counts.values()))
        return counted[1] - counted[0]

    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=False)
    plain = _model()
    plain.compile(keras.optimizers.SGD(1e-2), loss="mse")
    _fit(plain, *_data(2))
    counted = []
    for batches in (3, 6):
        with count_host_syncs() as counts:
            _fit(plain, *_data(batches))
        counted.append(sum(counts.values()))
    plain_reads = counted[1] - counted[0]
    assert reads(None) == plain_reads
    assert reads(2) == plain_reads + 3


@pytest.mark.backends("torch")
def test_torch_checks_the_limit_in_the_step_only_inside_fit(monkeypatch):
    """PyTorch's step decides the skip on the host, so it knows without a
    read whether it skipped: the step checks the count (after a skipped
    step only) in place of a per-batch callback, which would make Keras
    read every batch's logs; outside `fit` a loop checks for itself, as on
    the other backends."""
    from keras_mp import callbacks as callbacks_module

    batch_checks = []
    monkeypatch.setattr(
        callbacks_module._ConsecutiveSkipsCheck,
        "on_train_batch_end",
        lambda self, batch, logs=None: batch_checks.append(batch),
    )
    keras_mp.set_global_policy("mixed_bfloat16", skip_nonfinite=True)
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        _fit(model, *_data(6, nonfinite=[1, 3, 4]))
    assert batch_checks == []
    optimizer = model.optimizer
    assert int(to_numpy(optimizer.iterations)) == 2
    assert not optimizer._checks_skips_in_step
    # A hand-written loop: skipped steps are counted, and nothing raises.
    variables = model.trainable_variables
    nan_grads = [keras.ops.full(v.shape, float("nan")) for v in variables]
    optimizer.consecutive_skips.assign(0)
    for _ in range(3):
        optimizer.apply(nan_grads, variables)
    assert int(to_numpy(optimizer.consecutive_skips)) == 2
