"""A custom `train_step` with `tf.GradientTape` under mixed precision.

The model overrides `train_step` as in Keras's guide "Customizing what
happens in `fit()` with TensorFlow", with one change: instead of taking the
gradients and applying them itself, the step hands the loss and the tape to
`self.optimizer.minimize(loss, variables, tape=tape)`. Under a mixed_float16
policy `compile` wraps the optimizer in a `keras_mp.LossScaleOptimizer`, so
`minimize` scales the loss, unscales the gradients and skips the update on
overflow; the training step never needs to know about loss scaling.

It trains a small classifier on scikit-learn's digits (no download) and
prints the final loss, the loss scale and the number of skipped steps:

    KERAS_BACKEND=tensorflow python examples/custom_train_step_tensorflow.py
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_mp  # noqa: E402

POLICY = "mixed_float16"


class CustomTrainStepModel(keras.Model):
    """A functional model whose training step calls `optimizer.minimize`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        # The loss scale optimizer scales `loss` inside the tape, takes the
        # gradients, unscales them and applies them, or skips the step.
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {metric.name: metric.result() for metric in self.metrics}


def load_data():
    """scikit-learn's 8x8 digits as float32 pixels in [0, 1] and int labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return x, y


def build_model(custom_train_step=True, seed=0):
    """A two-layer classifier of 64 pixels into 10 digits.

    Args:
        custom_train_step: If False, a plain `keras.Model` with the same
            layers and initial weights, to compare with `fit`'s own step.
        seed: Seed of the initial weights.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    logits = keras.layers.Dense(10)(hidden)
    # Logits in float32, so the softmax of the loss runs in float32.
    outputs = keras.layers.Activation("linear", dtype="float32")(logits)
    model_class = CustomTrainStepModel if custom_train_step else keras.Model
    return model_class(inputs, outputs)


def train(
    model, x, y, epochs=10, batch_size=64, learning_rate=1e-3, shuffle=True
):
    """Compiles `model` with Adam (loss-scaled by the policy) and fits it.

    Returns:
        The `History` of `fit`.
    """
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model.fit(
        x, y, epochs=epochs, batch_size=batch_size, shuffle=shuffle, verbose=0
    )


def main():
    if keras.backend.backend() != "tensorflow":
        raise SystemExit(
            "This example needs the TensorFlow backend. Run it with "
            "KERAS_BACKEND=tensorflow."
        )
    keras_mp.set_global_policy(POLICY)
    x, y = load_data()
    model = build_model()
    history = train(model, x, y)
    optimizer = model.optimizer
    print(f"policy: {keras_mp.global_policy().name}")
    print(f"optimizer: {type(optimizer).__name__}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    print(f"train accuracy (last epoch): {history.history['accuracy'][-1]:.4f}")
    print(f"loss scale: {float(np.asarray(optimizer.loss_scale())):g}")
    print(f"skipped steps: {int(np.asarray(optimizer.skipped_steps))}")
    print(f"applied steps: {int(np.asarray(optimizer.iterations))}")


if __name__ == "__main__":
    main()
