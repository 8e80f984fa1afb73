"""Loss scaling that explains itself: overflow provenance and scaler policy.

`LossScaleOptimizer(track_overflow=True)` counts, inside the step, how often
each variable's gradient was non-finite and when that first happened;
`overflow_report()` and `keras_mp.callbacks.OverflowReport` read them.
`DynamicLossScale(hysteresis=..., on_min_scale=...)` delays the scale's drop
and decides what happens when overflows continue at `min_loss_scale`.
"""

import functools

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.testing import apply_as_fit
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import to_numpy

BACKEND = keras.backend.backend()

# One step of a scaled loss's gradients, as `fit` runs it.
_scaled_step = functools.partial(apply_as_fit, scale_loss=True)


def _variables():
    return [
        keras.Variable(np.ones((3,), "float32"), name="a"),
        keras.Variable(np.ones((2, 2), "float32"), name="b"),
        keras.Variable(np.ones((1,), "float32"), name="c"),
    ]


def _grads(poison=()):
    grads = [np.full((3,), 0.5), np.full((2, 2), -0.25), np.full((1,), 2.0)]
    grads = [g.astype("float32") * 8.0 for g in grads]
    for index, value in poison:
        grads[index].flat[0] = value
    return [ops.convert_to_tensor(g) for g in grads]


def _tracking_optimizer(**scale_kwargs):
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        loss_scale=keras_mp.DynamicLossScale(8.0, **scale_kwargs),
        track_overflow=True,
    )
    variables = _variables()
    optimizer.build(variables)
    return optimizer, variables


def _counters(optimizer):
    return (
        to_numpy(optimizer._overflow_counts).tolist(),
        to_numpy(optimizer._overflow_first_steps).tolist(),
    )


def test_counters_name_exactly_the_poisoned_variables_and_first_steps():
    optimizer, variables = _tracking_optimizer()
    schedule = [
        (),  # step 0: finite
        ((1, np.nan),),  # step 1: b
        (),  # step 2: finite
        ((0, np.inf), (1, -np.inf)),  # step 3: a and b
        (),  # step 4: finite
    ]
    seen = []
    for poison in schedule:
        before_vars = [to_numpy(v) for v in variables]
        before_inner = [
            to_numpy(v) for v in optimizer.inner_optimizer.variables
        ]
        before_counters = _counters(optimizer)
        _scaled_step(optimizer, _grads(poison), variables)
        if poison:
            for v, value in zip(variables, before_vars):
                assert_bitwise_equal(v, value, msg=v.path)
            for v, value in zip(
                optimizer.inner_optimizer.variables, before_inner
            ):
                assert_bitwise_equal(v, value, msg=v.path)
        else:
            # Finite steps leave the counters as they were.
            assert _counters(optimizer) == before_counters
        seen.append(_counters(optimizer))
    assert seen[-1] == ([1, 2, 0], [3, 1, -1])
    assert int(to_numpy(optimizer.skipped_steps)) == 2
    assert int(to_numpy(optimizer.iterations)) == 3

    report = optimizer.overflow_report()
    assert [(r.path, r.count, r.first_step) for r in report] == [
        ("b", 2, 1),
        ("a", 1, 3),
    ]
    assert len(optimizer.overflow_report(top=1)) == 1
    table = str(report).splitlines()
    assert table[0].split() == [
        "variable",
        "layer",
        "overflows",
        "first",
        "step",
    ]
    assert table[2].split()[0] == "b" and table[2].split()[-2:] == ["2", "1"]


def test_report_names_layers_and_survives_save_and_load(tmp_path):
    keras_mp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="hidden"),
            keras.layers.Dense(1, name="out", dtype="float32"),
        ]
    )
    model.compile(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), track_overflow=True
        ),
        loss="mse",
    )
    x = np.ones((32, 4), "float32")
    y = np.zeros((32, 1), "float32")
    # The first batch's inputs overflow float16 gradients at any scale.
    x[:8] = 6e4
    printed = []
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[keras_mp.callbacks.OverflowReport(print_fn=printed.append)],
    )
    # Printed after each epoch with a skipped step, and only then.
    skipped = history.history["skipped_steps"]
    assert skipped[0] >= 1 and skipped[1] - skipped[0] >= 1
    assert len(printed) == 2
    assert "hidden/kernel" in printed[0] and "hidden" in printed[0]
    assert all(isinstance(v, (int, float)) for v in skipped)
    report = model.optimizer.overflow_report()
    assert {r.layer for r in report} <= {"hidden", "out"}
    assert any(
        r.path.endswith("hidden/kernel") and r.first_step == 0 for r in report
    )

    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert restored.optimizer.track_overflow
    # The same counts for the same variables (a reloaded Sequential model's
    # variable paths lose the model's name prefix).
    assert [
        (r.path.rsplit("/", 2)[-2:], r.layer, r.count, r.first_step)
        for r in restored.optimizer.overflow_report()
    ] == [
        (r.path.rsplit("/", 2)[-2:], r.layer, r.count, r.first_step)
        for r in report
    ]


def test_report_and_callback_refuse_an_optimizer_that_does_not_track():
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="track_overflow=True"):
        optimizer.overflow_report()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer, loss="mse")
    with pytest.raises(ValueError, match="track_overflow=True"):
        model.fit(
            np.ones((4, 2)),
            np.ones((4, 1)),
            verbose=0,
            callbacks=[keras_mp.callbacks.OverflowReport()],
        )


def test_tracking_is_off_by_default_and_adds_no_variables():
    plain = keras_mp.LossScaleOptimizer(keras.optimizers.Adam())
    tracking = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(), track_overflow=True
    )
    for optimizer in (plain, tracking):
        optimizer.build(_variables())
    assert len(tracking.variables) == len(plain.variables) + 2
    config = tracking.get_config()
    assert config["track_overflow"] is True
    assert keras_mp.LossScaleOptimizer.from_config(config).track_overflow


def test_hysteresis_lowers_the_scale_only_after_overflows_in_a_row():
    optimizer, variables = _tracking_optimizer(hysteresis=2)
    scales = []
    for poison in ((), ((0, np.nan),), (), ((0, np.nan),), ((2, np.inf),)):
        _scaled_step(optimizer, _grads(poison), variables)
        scales.append(float(to_numpy(optimizer.loss_scale())))
    # One overflow: skipped, scale kept; a finite step resets the count;
    # two in a row: the scale halves.
    assert scales == [8.0, 8.0, 8.0, 8.0, 4.0]
    assert int(to_numpy(optimizer.skipped_steps)) == 3


def test_default_hysteresis_keeps_todays_numbers_and_checkpoint_layout():
    default = keras_mp.DynamicLossScale(8.0)
    explicit = keras_mp.DynamicLossScale(8.0, hysteresis=1)
    for scale in (default, explicit):
        scale.build()
    assert [v.name for v in default.variables] == [
        "loss_scale",
        "num_good_steps",
    ]
    for is_finite in (False, True, True, False):
        assert float(to_numpy(default.update(is_finite))) == float(
            to_numpy(explicit.update(is_finite))
        )
    assert float(to_numpy(default())) == 2.0
    with_hysteresis = keras_mp.DynamicLossScale(8.0, hysteresis=3)
    with_hysteresis.build()
    assert len(with_hysteresis.variables) == 3


def test_scaler_policy_config_round_trips_and_old_configs_load():
    scale = keras_mp.DynamicLossScale(
        64.0, increment_period=7, hysteresis=4, on_min_scale="raise"
    )
    restored = keras_mp.DynamicLossScale.from_config(scale.get_config())
    assert restored.hysteresis == 4 and restored.on_min_scale == "raise"
    old = {
        "initial_loss_scale": 64.0,
        "increment_period": 7,
        "multiplier": 2.0,
        "min_loss_scale": 1.0,
        "max_loss_scale": None,
    }
    loaded = keras_mp.DynamicLossScale.from_config(old)
    assert loaded.hysteresis == 1 and loaded.on_min_scale == "warn"


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"hysteresis": 0}, ValueError),
        ({"hysteresis": 1.5}, TypeError),
        ({"on_min_scale": "stop"}, ValueError),
    ],
)
def test_scaler_policy_validates_its_arguments(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        keras_mp.DynamicLossScale(**kwargs)


def _at_floor(on_min_scale, track_overflow=True):
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=keras_mp.DynamicLossScale(
            1.0, min_loss_scale=1.0, on_min_scale=on_min_scale
        ),
        track_overflow=track_overflow,
    )
    variables = _variables()
    optimizer.build(variables)
    optimizer.check_min_scale()  # the baseline
    _scaled_step(optimizer, _grads(((1, np.nan),)), variables)
    return optimizer


def test_on_min_scale_warn_warns_once_naming_the_worst_variables():
    optimizer = _at_floor("warn")
    with pytest.warns(UserWarning, match=r"min_loss_scale.*Worst.*\bb \(1x\)"):
        optimizer.check_min_scale()
    # Once only.
    optimizer.scale_loss(1.0)
    with warnings_as_errors():
        optimizer.check_min_scale()


def test_on_min_scale_raise_and_ignore():
    with pytest.raises(FloatingPointError, match="min_loss_scale"):
        _at_floor("raise", track_overflow=False).check_min_scale()
    with warnings_as_errors():
        _at_floor("ignore").check_min_scale()


def test_on_min_scale_raise_stops_fit():
    keras_mp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, dtype="float32")]
    )
    model.compile(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1),
            loss_scale=keras_mp.DynamicLossScale(1.0, on_min_scale="raise"),
        ),
        loss="mse",
    )
    x = np.full((8, 2), np.inf, "float32")
    with pytest.raises(FloatingPointError, match="min_loss_scale"):
        model.fit(x, np.ones((8, 1)), epochs=3, verbose=0)


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


# ---------------------------------------------------------------------------
# Gradient accumulation inside a LossScaleOptimizer.


def _regression_batches(count, size=4):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(count * size, 3)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5], "float32")).astype("float32")
    return [
        (x[i * size : (i + 1) * size], y[i * size : (i + 1) * size])
        for i in range(count)
    ]


def _accumulating(steps, scale=64.0):
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.05, gradient_accumulation_steps=steps),
        loss_scale=keras_mp.DynamicLossScale(scale, increment_period=100),
    )
    weights = keras.Variable(np.array([0.1, 0.2, 0.3], "float32"), name="w")
    optimizer.build([weights])
    return optimizer, weights


def _micro_step(optimizer, weights, x, y, poison=False):
    """Gradients of `scale_loss(mean squared error)`, taken by hand."""
    scale = float(to_numpy(optimizer.loss_scale()))
    optimizer.scale_loss(1.0)
    residual = x @ to_numpy(weights) - y
    grad = (2.0 / len(y)) * (x.T @ residual) * scale
    if poison:
        grad[0] = np.inf
    _scaled_step(
        optimizer, [ops.convert_to_tensor(grad.astype("float32"))], [weights]
    )


def test_accumulated_update_equals_one_step_on_the_concatenated_batch():
    batches = _regression_batches(3)
    accumulating, w_accumulated = _accumulating(3)
    for x, y in batches:
        _micro_step(accumulating, w_accumulated, x, y)
    single, w_single = _accumulating(None)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    _micro_step(single, w_single, x, y)
    np.testing.assert_allclose(
        to_numpy(w_accumulated), to_numpy(w_single), rtol=1e-5, atol=1e-6
    )
    assert int(to_numpy(accumulating.skipped_steps)) == 0


def test_a_non_finite_micro_step_discards_the_whole_window():
    batches = _regression_batches(6)
    optimizer, weights = _accumulating(3)
    base = optimizer.inner_optimizer
    before = [to_numpy(v) for v in base.variables if "iteration" not in v.path]
    for i, (x, y) in enumerate(batches[:3]):
        _micro_step(optimizer, weights, x, y, poison=(i == 1))
        # The scale changes once per window, at its end.
        expected_scale = 32.0 if i == 2 else 64.0
        assert float(to_numpy(optimizer.loss_scale())) == expected_scale
    # Weights and slots unchanged; accumulators emptied; one skipped step.
    after = [to_numpy(v) for v in base.variables if "iteration" not in v.path]
    for a, b in zip(after, before):
        assert_bitwise_equal(a, b)
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert int(to_numpy(base.iterations)) == 0
    # The next window trains as one step on its three batches would, from
    # the untouched state (at the lowered scale).
    for x, y in batches[3:]:
        _micro_step(optimizer, weights, x, y)
    single, w_single = _accumulating(None, scale=32.0)
    x = np.concatenate([b[0] for b in batches[3:]])
    y = np.concatenate([b[1] for b in batches[3:]])
    _micro_step(single, w_single, x, y)
    np.testing.assert_allclose(
        to_numpy(weights), to_numpy(w_single), rtol=1e-5, atol=1e-6
    )
    assert int(to_numpy(optimizer.skipped_steps)) == 1
    assert int(to_numpy(base.iterations)) == 1
