"""`loss_scale` and `skipped_steps` in the logs of `fit`.

`keras_mp.callbacks.LossScaleLogger`, and `fit` adding it by itself when the
optimizer is a keras_mp LossScaleOptimizer. Overflows are injected with a
loss whose value stays finite but whose gradient is infinite on batches
flagged in the targets, so a step is skipped exactly where a test wants it.
"""

import csv
import re

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp.callbacks import LossScaleLogger

BATCH_SIZE = 4
BATCHES = 4


class _OverflowOnFlaggedBatches(keras.losses.Loss):
    """Mean squared error; the gradient is inf where y_true[:, 1] is set."""

    def call(self, y_true, y_pred):
        values = ops.square(y_true[:, :1] - y_pred)[:, 0]
        factor = ops.where(ops.max(y_true[:, 1]) > 0, float("inf"), 1.0)

        @ops.custom_gradient
        def overflow(values):
            def grad(*args, upstream=None):
                if upstream is None:
                    (upstream,) = args
                return upstream * factor

            return ops.copy(values), grad

        return overflow(values)


class _BatchLogs(keras.callbacks.Callback):
    """Records the logs every later callback receives at batch end."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))


def _data(overflow_batches=()):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH_SIZE * BATCHES, 3)).astype("float32")
    y = np.zeros((len(x), 2), "float32")
    y[:, 0] = x @ np.array([1.0, -2.0, 0.5], "float32")
    for batch in overflow_batches:
        y[batch * BATCH_SIZE : (batch + 1) * BATCH_SIZE, 1] = 1.0
    return x, y


def _model(loss_scale=None, optimizer=None):
    if loss_scale is None:
        loss_scale = keras_mp.DynamicLossScale(1024, increment_period=1000)
    keras_mp.set_global_policy(
        keras_mp.Policy("mixed_bfloat16", loss_scale=loss_scale)
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(
        optimizer or keras.optimizers.SGD(0.01),
        loss=_OverflowOnFlaggedBatches(),
    )
    return model


def _fit(model, epochs=2, overflow_batches=(), **kwargs):
    x, y = _data(overflow_batches)
    kwargs.setdefault("verbose", 0)
    return model.fit(
        x, y, batch_size=BATCH_SIZE, epochs=epochs, shuffle=False, **kwargs
    )


def test_fit_adds_loss_scale_and_skipped_steps_to_history():
    history = _fit(_model(), epochs=2)
    assert history.history["loss_scale"] == [1024.0, 1024.0]
    assert history.history["skipped_steps"] == [0, 0]


def test_history_shows_the_scale_halving_and_the_skips_of_each_epoch():
    history = _fit(_model(), epochs=3, overflow_batches=[1])
    assert history.history["loss_scale"] == [512.0, 256.0, 128.0]
    # Counted since the optimizer was created, like `iterations`.
    assert history.history["skipped_steps"] == [1, 2, 3]
    assert np.isfinite(history.history["loss"]).all()


def test_batch_update_freq_logs_the_values_after_each_step():
    recorder = _BatchLogs()
    _fit(
        _model(),
        epochs=2,
        overflow_batches=[1, 2],
        callbacks=[LossScaleLogger(update_freq="batch"), recorder],
    )
    assert [logs["loss_scale"] for logs in recorder.batches] == [
        1024.0,
        512.0,
        256.0,
        256.0,
        256.0,
        128.0,
        64.0,
        64.0,
    ]
    assert [logs["skipped_steps"] for logs in recorder.batches] == [
        0,
        1,
        2,
        2,
        2,
        3,
        4,
        4,
    ]


def test_integer_update_freq_logs_every_that_many_batches():
    recorder = _BatchLogs()
    _fit(
        _model(),
        epochs=1,
        callbacks=[LossScaleLogger(update_freq=2), recorder],
    )
    assert ["loss_scale" in logs for logs in recorder.batches] == [
        False,
        True,
        False,
        True,
    ]


def test_epoch_update_freq_leaves_batch_logs_alone():
    recorder = _BatchLogs()
    _fit(_model(), epochs=1, callbacks=[recorder])
    assert not any("loss_scale" in logs for logs in recorder.batches)


def test_csv_logger_file_has_loss_scale_and_skipped_steps_columns(tmp_path):
    path = tmp_path / "training.csv"
    _fit(
        _model(),
        epochs=2,
        overflow_batches=[0],
        callbacks=[keras.callbacks.CSVLogger(str(path))],
    )
    with open(path, newline="") as csv_file:
        rows = list(csv.DictReader(csv_file))
    assert [float(row["loss_scale"]) for row in rows] == [512.0, 256.0]
    assert [int(row["skipped_steps"]) for row in rows] == [1, 2]


def test_tensorboard_event_files_hold_loss_scale_scalars(tmp_path):
    import tensorflow as tf

    _fit(
        _model(),
        epochs=2,
        overflow_batches=[3],
        callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path))],
    )
    event_files = sorted((tmp_path / "train").glob("events.out.tfevents.*"))
    assert event_files
    logged = {}
    for event_file in event_files:
        for event in tf.compat.v1.train.summary_iterator(str(event_file)):
            for value in event.summary.value:
                if not value.tag.startswith("epoch_"):
                    continue  # e.g. the model config, written as text
                logged.setdefault(value.tag, []).append(
                    float(tf.make_ndarray(value.tensor))
                )
    assert logged["epoch_loss_scale"] == [512.0, 256.0]
    assert logged["epoch_skipped_steps"] == [1.0, 2.0]


def test_progress_bar_shows_loss_scale_and_skipped_steps(capsys):
    _fit(_model(), epochs=1, overflow_batches=[0], verbose=1)
    output = capsys.readouterr().out
    assert "loss_scale: 512.0000" in output
    assert "skipped_steps: 1\n" in output


def test_log_loss_scale_false_leaves_the_logs_unchanged():
    recorder = _BatchLogs()
    history = _fit(
        _model(), epochs=1, log_loss_scale=False, callbacks=[recorder]
    )
    assert set(history.history) == {"loss"}
    assert not any("loss_scale" in logs for logs in recorder.batches)


def test_a_logger_passed_to_fit_replaces_the_automatic_one():
    logger = LossScaleLogger(update_freq="batch")
    recorder = _BatchLogs()
    model = _model()
    _fit(model, epochs=1, callbacks=[recorder, logger])
    # Placed after the recorder by the user, so the recorder never sees the
    # values: the logger the user passed is the only one.
    assert not any("loss_scale" in logs for logs in recorder.batches)
    assert model.history.history["loss_scale"] == [1024.0]


def test_a_single_callback_or_nested_lists_are_accepted_as_keras_does():
    recorder = _BatchLogs()
    _fit(_model(), epochs=1, callbacks=recorder)
    assert len(recorder.batches) == BATCHES
    logger = LossScaleLogger(update_freq="batch")
    history = _fit(_model(), epochs=1, callbacks=[[logger], [recorder]])
    assert history.history["loss_scale"] == [1024.0]
    assert "loss_scale" in recorder.batches[-1]


def test_fixed_loss_scale_is_logged_and_never_skips():
    history = _fit(_model(loss_scale=keras_mp.FixedLossScale(128)), epochs=1)
    assert history.history["loss_scale"] == [128.0]
    assert history.history["skipped_steps"] == [0]


def test_loss_scale_optimizer_inside_another_wrapper_is_found():
    inner = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=keras_mp.DynamicLossScale(64)
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(
        keras_mp.optimizers.Lookahead(inner), loss=_OverflowOnFlaggedBatches()
    )
    history = _fit(model, epochs=1, overflow_batches=[2])
    assert history.history["loss_scale"] == [32.0]
    assert history.history["skipped_steps"] == [1]


def test_no_logs_are_added_without_a_loss_scale_optimizer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data()
    history = model.fit(x, y[:, :1], batch_size=BATCH_SIZE, verbose=0)
    assert set(history.history) == {"loss"}


def test_logger_without_loss_scale_optimizer_raises_and_names_the_fix():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data()
    with pytest.raises(ValueError, match="keras_mp.LossScaleOptimizer"):
        model.fit(x, y[:, :1], verbose=0, callbacks=[LossScaleLogger()])


@pytest.mark.parametrize("update_freq", ["step", 0, -1, 1.5, True, None])
def test_invalid_update_freq_raises(update_freq):
    with pytest.raises(ValueError, match="update_freq"):
        LossScaleLogger(update_freq=update_freq)


def test_only_epoch_updates_let_keras_dispatch_batch_callbacks_async():
    assert LossScaleLogger().async_safe
    assert not LossScaleLogger(update_freq="batch").async_safe
    assert not LossScaleLogger(update_freq=10).async_safe


@pytest.mark.parametrize("verbose", [1, 2])
def test_progress_bar_prints_skipped_steps_as_an_integer(capsys, verbose):
    keras_mp.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mean_squared_error")
    x = np.ones((8, 3), "float32")
    model.fit(x, np.ones((8, 1)), batch_size=4, epochs=1, verbose=verbose)
    output = capsys.readouterr().out
    assert re.search(r"skipped_steps: \d+\n", output)
    assert not re.search(r"skipped_steps: \d+\.", output)
    assert re.search(r"loss_scale: \d+\.0000", output)
