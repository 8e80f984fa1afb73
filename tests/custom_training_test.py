"""Custom training steps from `examples/` train exactly as `fit` does.

Each example overrides `train_step` (TensorFlow: `optimizer.minimize` with
a tape; JAX: `scale_loss` under a StatelessScope, then `stateless_apply`;
PyTorch: `scale_loss(loss).backward()`, then `apply` under `no_grad`).
Trained on the same data from the same initial weights as a plain
`keras.Model` under `fit`, it must reach the same weights, loss scale,
applied steps and skipped steps, including through overflowing steps.
"""

import importlib.util
import pathlib

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.testing import assert_close
from keras_mp.testing import to_numpy

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load_example(name):
    spec = importlib.util.spec_from_file_location(
        f"keras_mp_example_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(example):
    x, y = example.load_data()
    x, y = x[:256], y[:256]
    # Inputs this large overflow float16 gradients at the initial scale of
    # 2**15: the first steps are skipped and the scale halves until they fit.
    x[:64] *= 1000.0
    return x, y


def _train_custom_and_plain(example_name, monkeypatch):
    example = _load_example(example_name)
    traced = []
    custom_train_step = example.CustomTrainStepModel.train_step

    def spied_train_step(self, *args):
        traced.append(type(self))
        return custom_train_step(self, *args)

    # Guards against comparing `fit` with itself.
    monkeypatch.setattr(
        example.CustomTrainStepModel, "train_step", spied_train_step
    )
    keras_mp.set_global_policy(example.POLICY)
    x, y = _data(example)
    models = {}
    for custom in (True, False):
        model = example.build_model(custom_train_step=custom)
        example.train(model, x, y, epochs=2, batch_size=64, shuffle=False)
        models[custom] = model
    assert traced and set(traced) == {example.CustomTrainStepModel}
    return models[True], models[False]


def _assert_same_training(custom, plain):
    assert type(custom.optimizer) is keras_mp.LossScaleOptimizer
    assert type(plain).__name__ == "Functional"
    skipped = int(to_numpy(custom.optimizer.skipped_steps))
    assert skipped > 0
    assert skipped == int(to_numpy(plain.optimizer.skipped_steps))
    assert int(to_numpy(custom.optimizer.iterations)) == 8 - skipped
    assert int(to_numpy(plain.optimizer.iterations)) == 8 - skipped
    assert float(to_numpy(custom.optimizer.loss_scale())) == float(
        to_numpy(plain.optimizer.loss_scale())
    )
    # Tolerance 1e-5 (float32's): both steps run the same float16 ops in the
    # same order and agree bit for bit on CPU, but each is its own compiled
    # program, and another compiler version or device may fuse and round
    # differently (a one-ulp float16 change in an activation shifts an Adam
    # update of lr 1e-3 by about 1e-6). A missed or doubled unscale, or a
    # step wrongly applied or skipped, moves weights by ~1e-3 or more.
    for custom_weight, plain_weight in zip(custom.weights, plain.weights):
        assert_close(custom_weight, plain_weight, msg=custom_weight.path)


@pytest.mark.backends("tensorflow")
def test_tensorflow_minimize_train_step_trains_as_fit_does(monkeypatch):
    custom, plain = _train_custom_and_plain(
        "custom_train_step_tensorflow", monkeypatch
    )
    _assert_same_training(custom, plain)


@pytest.mark.backends("jax")
def test_jax_stateless_train_step_trains_as_fit_does(monkeypatch):
    custom, plain = _train_custom_and_plain(
        "custom_train_step_jax", monkeypatch
    )
    _assert_same_training(custom, plain)


# The custom `train_step` of Keras's "Customizing what happens in fit()"
# guides, verbatim per backend: gradients of the unscaled loss go straight to
# `optimizer.apply`/`stateless_apply`, with no `scale_loss`. Under a
# mixed_float16 policy `compile` wraps the optimizer in a LossScaleOptimizer;
# it must apply those gradients as they are (not divided by 2**15) and say
# that the loss is not scaled.


def _guide_model_class():
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        class GuideModel(keras.Model):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                trainable_vars = self.trainable_variables
                gradients = tape.gradient(loss, trainable_vars)
                self.optimizer.apply(gradients, trainable_vars)
                return {"loss": loss}

    elif backend == "jax":
        import jax

        class GuideModel(keras.Model):
            def compute_loss_and_updates(
                self, trainable_variables, non_trainable_variables, x, y
            ):
                y_pred, non_trainable_variables = self.stateless_call(
                    trainable_variables,
                    non_trainable_variables,
                    x,
                    training=True,
                )
                loss = self.compute_loss(x, y, y_pred)
                return loss, (y_pred, non_trainable_variables)

            def train_step(self, state, data):
                (
                    trainable_variables,
                    non_trainable_variables,
                    optimizer_variables,
                    metrics_variables,
                ) = state
                x, y = data
                grad_fn = jax.value_and_grad(
                    self.compute_loss_and_updates, has_aux=True
                )
                (loss, (_, non_trainable_variables)), grads = grad_fn(
                    trainable_variables, non_trainable_variables, x, y
                )
                trainable_variables, optimizer_variables = (
                    self.optimizer.stateless_apply(
                        optimizer_variables, grads, trainable_variables
                    )
                )
                state = (
                    trainable_variables,
                    non_trainable_variables,
                    optimizer_variables,
                    metrics_variables,
                )
                return {"loss": loss}, state

    else:
        import torch

        class GuideModel(keras.Model):
            def train_step(self, data):
                x, y = data
                self.zero_grad()
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                loss.backward()
                trainable_weights = [v for v in self.trainable_weights]
                gradients = [v.value.grad for v in trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(gradients, trainable_weights)
                return {"loss": loss}

    return GuideModel


def _guide_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]
    return x, y


def _build(model_class):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32")(hidden)
    return model_class(inputs, outputs)


def test_keras_guide_train_step_under_mixed_float16_applies_full_updates():
    x, y = _guide_data()
    models = {}
    # Reference: `fit` under the same float16 compute with no loss scaling,
    # which is exactly what the guide's step computes.
    for name, policy, model_class in (
        ("guide", "mixed_float16", _guide_model_class()),
        ("unscaled", keras_mp.Policy("mixed_float16", None), keras.Model),
    ):
        keras_mp.set_global_policy(policy)
        model = _build(model_class)
        initial = [to_numpy(w) for w in model.trainable_weights]
        model.compile(keras.optimizers.SGD(0.05), loss="mse")
        if name == "guide":
            assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
            with pytest.warns(UserWarning, match="did not scale"):
                model.fit(x, y, batch_size=16, epochs=2, shuffle=False)
        else:
            assert not isinstance(
                model.optimizer, keras.optimizers.LossScaleOptimizer
            )
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False)
        models[name] = model
    for guide_w, reference_w, start in zip(
        models["guide"].trainable_weights,
        models["unscaled"].trainable_weights,
        initial,
    ):
        # Training moved each weight far more than float16 rounding...
        assert np.abs(to_numpy(reference_w) - start).max() > 1e-2
        # ...and the guide's step moved it the same way, not 2**15 less.
        assert_close(guide_w, reference_w, dtype="float16", msg=guide_w.path)
    assert int(to_numpy(models["guide"].optimizer.iterations)) == 8


@pytest.mark.backends("torch")
def test_torch_backward_train_step_trains_as_fit_does(monkeypatch):
    custom, plain = _train_custom_and_plain(
        "custom_train_step_torch", monkeypatch
    )
    _assert_same_training(custom, plain)
