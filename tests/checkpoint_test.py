"""Saving and restoring wrapped optimizers through Keras's ordinary paths.

`save_weights`/`load_weights`, `ModelCheckpoint`, `model.save`/`load_model`
(`.keras` and legacy `.h5`) and `get_weights`/`set_weights` must restore a
LossScaleOptimizer's whole state (iterations, loss scale, slots) into a fresh
model, so that an interrupted training resumes exactly as if it had never
stopped, and must refuse a mismatched checkpoint before anything changes.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy

STEPS_PER_EPOCH = 4


def _policy():
    # A short increment period, so the scale grows during the run and a lost
    # or misplaced scale or counter changes the numbers.
    return keras_mp.Policy(
        "mixed_float16",
        loss_scale=keras_mp.DynamicLossScale(2.0**10, increment_period=3),
    )


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16 * STEPS_PER_EPOCH, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]
    return x, y


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(
        keras.optimizers.Adam(0.01), loss=keras.losses.MeanSquaredError()
    )
    return model


def _fit(model, epochs, **kwargs):
    x, y = _data()
    model.fit(
        x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


def _state(model):
    optimizer = model.optimizer
    return {
        "iterations": int(to_numpy(optimizer.iterations)),
        "loss_scale": float(to_numpy(optimizer.loss_scale())),
        "num_good_steps": int(to_numpy(optimizer.loss_scale.num_good_steps)),
        "skipped_steps": int(to_numpy(optimizer.skipped_steps)),
    }


def _assert_same_training(resumed, uninterrupted):
    assert _state(resumed) == _state(uninterrupted)
    for a, b in zip(resumed.weights, uninterrupted.weights):
        # Same ops in the same order on CPU; float32's tolerance allows for
        # a compiler that reorders a reduction.
        assert_close(a, b, msg=a.path)
    for a, b in zip(
        resumed.optimizer.variables, uninterrupted.optimizer.variables
    ):
        assert_close(a, b, msg=a.path)


@pytest.fixture
def uninterrupted():
    keras_mp.set_global_policy(_policy())
    model = _model()
    _fit(model, epochs=2)
    assert _state(model)["iterations"] == 2 * STEPS_PER_EPOCH
    assert _state(model)["loss_scale"] > 2.0**10
    return model


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_load_weights_into_a_fresh_unbuilt_optimizer_resumes_exactly(
    uninterrupted, tmp_path, suffix
):
    first = _model()
    _fit(first, epochs=1)
    path = str(tmp_path / f"ckpt{suffix}")
    if suffix == ".keras":
        first.save(path)
    else:
        first.save_weights(path)
    fresh = _model()
    assert not fresh.optimizer.built
    fresh.load_weights(path)
    _fit(fresh, epochs=1)
    _assert_same_training(fresh, uninterrupted)


def test_model_checkpoint_weights_only_resumes_exactly(uninterrupted, tmp_path):
    path = str(tmp_path / "epoch.weights.h5")
    first = _model()
    _fit(
        first,
        epochs=1,
        callbacks=[
            keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
        ],
    )
    fresh = _model()
    fresh.load_weights(path)
    _fit(fresh, epochs=1)
    _assert_same_training(fresh, uninterrupted)


def test_load_model_resumes_exactly_under_any_global_policy(
    uninterrupted, tmp_path
):
    first = _model()
    _fit(first, epochs=1)
    path = str(tmp_path / "model.keras")
    first.save(path)
    keras_mp.set_global_policy(None)
    restored = keras.models.load_model(path)
    assert isinstance(restored.optimizer, keras_mp.LossScaleOptimizer)
    _fit(restored, epochs=1)
    _assert_same_training(restored, uninterrupted)


def test_legacy_h5_save_and_load_model_resume_exactly(uninterrupted, tmp_path):
    first = _model()
    _fit(first, epochs=1)
    path = str(tmp_path / "model.h5")
    first.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored.optimizer, keras_mp.LossScaleOptimizer)
    # The loader builds the optimizer for `model._trainable_variables`,
    # empty for a Sequential model; the values wait for the real build.
    restored.optimizer.build(restored.trainable_variables)
    assert _state(restored) == _state(first)
    for a, b in zip(restored.optimizer.variables, first.optimizer.variables):
        assert_bitwise_equal(a, to_numpy(b), msg=a.path)
    _fit(restored, epochs=1)
    _assert_same_training(restored, uninterrupted)


def _built_optimizer(**kwargs):
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        loss_scale=keras_mp.DynamicLossScale(64.0, increment_period=2),
        **kwargs,
    )
    variables = [keras.Variable(np.ones((3,), "float32"))]
    optimizer.build(variables)
    return optimizer, variables


def test_set_weights_of_get_weights_copies_every_variable_in_order():
    source, variables = _built_optimizer()
    for grads in ([1.0, 2.0, 3.0], [2.0, 2.0, 2.0], [np.inf, 0.0, 0.0]):
        source.scale_loss(1.0)
        source.apply([keras.ops.array(grads) * 64.0], variables)
    target, _ = _built_optimizer()
    weights = source.get_weights()
    assert len(weights) == len(source.variables)
    target.set_weights(weights)
    for a, b in zip(target.variables, source.variables):
        assert_bitwise_equal(a, to_numpy(b), msg=a.path)
    assert int(to_numpy(target.iterations)) == 2
    assert int(to_numpy(target.skipped_steps)) == 1


def test_set_weights_reports_a_mismatch_before_assigning_anything():
    target, _ = _built_optimizer()
    before = target.get_weights()
    other, _ = _built_optimizer(
        transform_gradients=["adaptive_clip_by_global_norm"]
    )
    with pytest.raises(ValueError, match="Nothing was loaded or assigned"):
        target.set_weights(other.get_weights())
    wrong_shape = [np.array(w) for w in before]
    wrong_shape[-1] = np.zeros((2,), "float32")
    wrong_shape[0] = np.array(99, wrong_shape[0].dtype)
    with pytest.raises(ValueError, match="Nothing was loaded or assigned"):
        target.set_weights(wrong_shape)
    for variable, value in zip(target.variables, before):
        assert_bitwise_equal(variable, value, msg=variable.path)


def test_set_weights_on_an_unbuilt_optimizer_applies_at_build():
    source, variables = _built_optimizer()
    source.scale_loss(1.0)
    source.apply([keras.ops.array([1.0, 2.0, 3.0]) * 64.0], variables)
    target = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        loss_scale=keras_mp.DynamicLossScale(64.0, increment_period=2),
    )
    target.set_weights(source.get_weights())
    target.build([keras.Variable(np.ones((3,), "float32"))])
    for a, b in zip(target.variables, source.variables):
        assert_bitwise_equal(a, to_numpy(b), msg=a.path)
    mismatched = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    mismatched.set_weights(source.get_weights())
    with pytest.raises(ValueError, match="Nothing was loaded or assigned"):
        mismatched.build([keras.Variable(np.ones((2,), "float32"))])


def test_a_mismatched_checkpoint_leaves_the_optimizer_state_intact(tmp_path):
    keras_mp.set_global_policy(_policy())
    source = _model()
    _fit(source, epochs=1)
    path = str(tmp_path / "ckpt.weights.h5")
    source.save_weights(path)
    # Same model and inner optimizer, but a wrapper with other variables.
    target = _model()
    target.compile(
        keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            transform_gradients=["adaptive_clip_by_global_norm"],
        ),
        loss="mse",
    )
    _fit(target, epochs=1)
    before = target.optimizer.get_weights()
    with pytest.raises(ValueError, match="Nothing was loaded or assigned"):
        target.load_weights(path)
    for variable, value in zip(target.optimizer.variables, before):
        assert_bitwise_equal(variable, value, msg=variable.path)


# Plain Keras optimizers, which `compile` keeps under float32 and
# mixed_bfloat16: Keras alone skips the state loaded into an optimizer that
# is not built yet, and the resumed run starts from iterations 0.


def _plain_state(model):
    return [to_numpy(v) for v in model.optimizer.variables]


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
@pytest.mark.parametrize("how", ["load_weights", "model_checkpoint"])
def test_plain_optimizer_restores_at_build_under_any_policy(
    policy, how, tmp_path
):
    keras_mp.set_global_policy(policy)
    path = str(tmp_path / "ckpt.weights.h5")
    uninterrupted = _model()
    _fit(uninterrupted, epochs=2)
    first = _model()
    if how == "model_checkpoint":
        callback = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
        _fit(first, epochs=1, callbacks=[callback])
    else:
        _fit(first, epochs=1)
        first.save_weights(path)
    fresh = _model()
    assert isinstance(fresh.optimizer, keras.optimizers.Adam)
    assert not isinstance(fresh.optimizer, keras_mp.OptimizerWrapper)
    assert not fresh.optimizer.built
    fresh.load_weights(path)
    _fit(fresh, epochs=1)
    assert int(to_numpy(fresh.optimizer.iterations)) == 2 * STEPS_PER_EPOCH
    for a, b in zip(fresh.weights, uninterrupted.weights, strict=True):
        assert_close(a, b, msg=a.path)
    for a, b in zip(
        _plain_state(fresh), _plain_state(uninterrupted), strict=True
    ):
        assert_close(a, b)


def test_plain_optimizer_drops_a_mismatched_checkpoint_at_build_with_a_warning(
    tmp_path,
):
    path = str(tmp_path / "sgd.weights.h5")
    first = _model()
    first.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    _fit(first, epochs=1)
    first.save_weights(path)
    fresh = _model()
    fresh.load_weights(path)
    with pytest.warns(UserWarning, match="Dropped the state of optimizer"):
        _fit(fresh, epochs=1)
    # Adam started fresh: one epoch of its own steps, no SGD momentum.
    assert int(to_numpy(fresh.optimizer.iterations)) == STEPS_PER_EPOCH


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class TaskLikeModel(keras.Model):
    """A model built as keras-hub builds its tasks (`BertTextClassifier`).

    Its constructor compiles with default arguments and it overrides
    `compile`, so Keras's `load_model` does not compile it from the saved
    config (it warns), and its optimizer is not built when the saved state
    loads. Checked on keras-hub 0.32 itself: without keras_mp a reloaded
    classifier resumed at iterations 0 with its default learning rate.
    keras_mp calls this `compile` with the saved arguments instead.
    """

    def __init__(self, units=8, **kwargs):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(units, activation="relu")(inputs)
        outputs = keras.layers.Dense(1, dtype="float32")(hidden)
        super().__init__(inputs, outputs, **kwargs)
        self.units = units
        self.compile()

    def compile(self, optimizer=None, loss="mse", **kwargs):
        super().compile(
            optimizer=optimizer or keras.optimizers.Adam(1e-4),
            loss=loss,
            **kwargs,
        )

    def get_config(self):
        return {"units": self.units, "name": self.name}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
def test_a_task_reloaded_with_load_model_resumes_exactly(policy, tmp_path):
    keras_mp.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = TaskLikeModel()
    model.compile(keras.optimizers.Adam(0.01))
    _fit(model, epochs=1)
    path = str(tmp_path / "task.keras")
    model.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = keras.saving.load_model(path)
    # keras_mp called the custom `compile` with the saved optimizer and
    # built it (Keras alone warns and keeps the constructor's Adam(1e-4)).
    assert not [w for w in caught if "compile()" in str(w.message)]
    assert restored.optimizer.built
    _fit(model, epochs=1)
    _fit(restored, epochs=1)
    assert int(to_numpy(restored.optimizer.iterations)) == 2 * STEPS_PER_EPOCH
    assert float(to_numpy(restored.optimizer.learning_rate)) == pytest.approx(
        0.01
    )
    for a, b in zip(restored.weights, model.weights, strict=True):
        assert_close(a, b, msg=a.path)
    for a, b in zip(_plain_state(restored), _plain_state(model), strict=True):
        assert_close(a, b)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class StrictCompileTask(TaskLikeModel):
    """A task whose `compile` refuses the arguments Keras saves."""

    def compile(self, optimizer=None):
        super().compile(optimizer=optimizer)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class FailingCompileTask(TaskLikeModel):
    """A task whose `compile` fails halfway with the saved arguments
    (after Keras's `compile` has set the optimizer)."""

    def compile(self, optimizer=None, loss="mse", **kwargs):
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        if kwargs:
            raise RuntimeError("this task cannot take the saved arguments")


def _wrapped_adam():
    return keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(0.01), state_dtype="bfloat16"
    )


@pytest.mark.parametrize("task", [StrictCompileTask, FailingCompileTask])
def test_a_task_whose_compile_fails_on_load_warns_and_is_left_alone(
    task, tmp_path
):
    keras.utils.set_random_seed(0)
    model = task()
    model.compile(_wrapped_adam())
    _fit(model, epochs=1)
    path = str(tmp_path / "task.keras")
    model.save(path)
    with pytest.warns(UserWarning, match="without the optimizer") as caught:
        restored = keras.saving.load_model(path)
    message = str(
        next(
            w for w in caught if "without the optimizer" in str(w.message)
        ).message
    )
    # What was lost, why, and the fix.
    assert "OptimizerWrapper(Adam)" in message
    assert ("TypeError" if task is StrictCompileTask else "RuntimeError") in (
        message
    )
    assert "model.load_weights(path)" in message
    # As Keras left it: the constructor's optimizer, nothing half applied.
    assert isinstance(restored.optimizer, keras.optimizers.Adam)
    assert not isinstance(restored.optimizer, keras_mp.OptimizerWrapper)
    assert float(to_numpy(restored.optimizer.learning_rate)) == (
        pytest.approx(1e-4)
    )
    optimizer = restored._compile_config.config["optimizer"]
    assert optimizer is restored.optimizer
    # The fix the warning gives resumes exactly.
    restored.compile(_wrapped_adam())
    restored.load_weights(path)
    _fit(model, epochs=1)
    _fit(restored, epochs=1)
    for a, b in zip(restored.weights, model.weights, strict=True):
        assert_close(a, b, msg=a.path)
    variables = zip(
        restored.optimizer.variables, model.optimizer.variables, strict=True
    )
    for a, b in variables:
        assert_bitwise_equal(a, b, msg=a.path)
