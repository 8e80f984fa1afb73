"""A PyTorch `train_step` under mixed precision.

The model overrides `train_step` as in Keras's guide "Customizing what
happens in `fit()` with PyTorch": a forward pass, `loss.backward()`, and
`optimizer.apply` under `torch.no_grad()`. One line makes it loss-scaled:

- `loss.backward()` becomes `self.optimizer.scale_loss(loss).backward()`;
  the *scaled* gradients then go to `optimizer.apply`, which unscales them,
  updates the loss scale and skips the update on overflow.

The skip is decided on the device: the update runs in place and every
variable is then selected between its new and its old value with
`torch.where`, so no tensor is converted to a Python bool and a GPU step
never waits for the host (torch AMP's GradScaler does, every step).

Under a mixed_float16 policy `compile` wraps the optimizer in a
`keras_mp.LossScaleOptimizer`. It trains a small classifier on
scikit-learn's digits (no download) and prints the final loss, the loss
scale and the number of skipped steps:

    KERAS_BACKEND=torch python examples/custom_train_step_torch.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import keras_mp  # noqa: E402

POLICY = "mixed_float16"


class CustomTrainStepModel(keras.Model):
    """A functional model with a loss-scaled PyTorch training step."""

    def train_step(self, data):
        x, y = data
        # Clear the gradients left by the previous step.
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        # Differentiate the scaled loss, so small float16 gradients survive.
        self.optimizer.scale_loss(loss).backward()
        trainable_weights = self.trainable_weights[:]
        gradients = [v.value.grad for v in trainable_weights]
        # Scaled gradients in: the optimizer unscales them, updates the loss
        # scale, and leaves every variable as it was if one is not finite.
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)

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
    if keras.backend.backend() != "torch":
        raise SystemExit(
            "This example needs the PyTorch backend. Run it with "
            "KERAS_BACKEND=torch."
        )
    keras_mp.set_global_policy(POLICY)
    x, y = load_data()
    model = build_model()
    history = train(model, x, y)
    optimizer = model.optimizer
    print(f"policy: {keras_mp.global_policy().name}")
    print(f"optimizer: {type(optimizer).__name__}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    print(f"final accuracy: {history.history['accuracy'][-1]:.4f}")
    print(f"loss scale: {float(np.asarray(optimizer.loss_scale())):g}")
    print(f"skipped steps: {int(np.asarray(optimizer.skipped_steps))}")
    print(f"applied steps: {int(np.asarray(optimizer.iterations))}")


if __name__ == "__main__":
    main()
