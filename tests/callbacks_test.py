"""Keras callbacks drive the optimizer through the LossScaleOptimizer wrapper.

Every model here is compiled under a mixed_bfloat16 policy with a dynamic
loss scale, so `compile` wraps the optimizer in `keras_mp.LossScaleOptimizer`
and the callbacks only ever see the wrapper.
"""

import csv

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy


@pytest.fixture(autouse=True)
def mixed_policy_with_loss_scale():
    keras_mp.set_global_policy(
        keras_mp.Policy("mixed_bfloat16", loss_scale="dynamic")
    )


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype(
        "float32"
    )
    return x, y


def _model(optimizer=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(0.01), loss="mse"
    )
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    return model


def _fit(model, callbacks, epochs, **kwargs):
    x, y = _data()
    return model.fit(
        x,
        y,
        batch_size=8,
        epochs=epochs,
        callbacks=callbacks,
        verbose=0,
        **kwargs,
    )


class _WeightsAtEpochEnd(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


def test_learning_rate_scheduler_sets_the_inner_learning_rate_used_by_fit():
    model = _model()
    snapshots = _WeightsAtEpochEnd()
    schedule = keras.callbacks.LearningRateScheduler(
        lambda epoch: 0.01 if epoch == 0 else 0.0
    )
    history = _fit(model, [schedule, snapshots], epochs=2)
    assert history.history["learning_rate"] == pytest.approx([0.01, 0.0])
    assert float(to_numpy(model.optimizer.inner_optimizer.learning_rate)) == 0.0
    # The compiled step reads the new rate: with 0.0, Adam moves nothing.
    for after_first, after_second in zip(*snapshots.weights):
        assert_bitwise_equal(after_second, after_first)
    assert int(to_numpy(model.optimizer.iterations)) == 8


def test_reduce_lr_on_plateau_lowers_the_inner_learning_rate():
    model = _model(keras.optimizers.Adam(0.04))
    # A min_delta no loss can beat: every epoch after the first is a plateau.
    reduce = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=1e9
    )
    history = _fit(model, [reduce], epochs=3)
    # Each epoch logs the rate it trained with, before the callback lowers it.
    assert history.history["learning_rate"] == pytest.approx([0.04, 0.04, 0.02])
    inner_learning_rate = model.optimizer.inner_optimizer.learning_rate
    assert float(to_numpy(inner_learning_rate)) == pytest.approx(0.01)


def test_tensorboard_writes_logs_with_the_inner_learning_rate(tmp_path):
    # The TensorBoard callback writes through tf.summary, which needs the
    # tensorboard package (not a dependency of tensorflow-cpu).
    pytest.importorskip("tensorboard")
    import tensorflow as tf

    model = _model()
    callbacks = [
        keras.callbacks.LearningRateScheduler(lambda epoch: 0.01 / (epoch + 1)),
        keras.callbacks.TensorBoard(log_dir=str(tmp_path)),
    ]
    _fit(model, callbacks, epochs=2)
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
    assert logged["epoch_learning_rate"] == pytest.approx([0.01, 0.005])
    assert len(logged["epoch_loss"]) == 2


def test_early_stopping_stops_and_restores_the_best_weights():
    model = _model()
    snapshots = _WeightsAtEpochEnd()
    stop = keras.callbacks.EarlyStopping(
        monitor="loss", patience=0, min_delta=1e9, restore_best_weights=True
    )
    history = _fit(model, [snapshots, stop], epochs=10)
    assert history.epoch == [0, 1]
    for restored, best in zip(model.get_weights(), snapshots.weights[0]):
        assert_bitwise_equal(restored, best)


def test_swap_ema_weights_uses_the_inner_optimizers_moving_average():
    model = _model(keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.9))
    x, y = _data()
    history = _fit(
        model,
        [keras.callbacks.SwapEMAWeights()],
        epochs=2,
        validation_data=(x, y),
    )
    inner = model.optimizer.inner_optimizer
    # At the end of fit the moving average replaces the weights.
    for variable, average in zip(
        model.trainable_variables, inner._model_variables_moving_average
    ):
        assert_bitwise_equal(variable, average)
    # Validation ran on the moving average, the weights `evaluate` sees now.
    loss = model.evaluate(x, y, batch_size=8, verbose=0)
    assert_close(history.history["val_loss"][-1], loss)


def test_csv_logger_writes_one_row_per_epoch(tmp_path):
    model = _model()
    path = tmp_path / "training.csv"
    history = _fit(model, [keras.callbacks.CSVLogger(str(path))], epochs=3)
    with open(path, newline="") as csv_file:
        rows = list(csv.DictReader(csv_file))
    assert [int(row["epoch"]) for row in rows] == [0, 1, 2]
    assert [float(row["loss"]) for row in rows] == pytest.approx(
        history.history["loss"]
    )
