"""A stateless JAX `train_step` under mixed precision.

The model overrides `train_step` as in Keras's guide "Customizing what
happens in `fit()` with JAX": a pure function of the training state that
differentiates a stateless loss with `jax.value_and_grad` and updates the
weights with `optimizer.stateless_apply`. Two lines make it loss-scaled:

- inside the loss function, `self.optimizer.scale_loss(loss)` runs under a
  `keras.StatelessScope` that maps the optimizer variables to their values
  in the state, so the scale read is the one this step carries;
- the *scaled* gradients go to `stateless_apply`, which unscales them,
  updates the loss scale and skips the update on overflow.

Under a mixed_float16 policy `compile` wraps the optimizer in a
`keras_mp.LossScaleOptimizer`. It trains a small classifier on
scikit-learn's digits (no download) and prints the final loss, the loss
scale and the number of skipped steps:

    KERAS_BACKEND=jax python examples/custom_train_step_jax.py
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402

POLICY = "mixed_float16"


class CustomTrainStepModel(keras.Model):
    """A functional model with a stateless, loss-scaled JAX training step."""

    def compute_loss_and_updates(
        self,
        trainable_variables,
        non_trainable_variables,
        optimizer_variables,
        x,
        y,
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True
        )
        loss = self.compute_loss(y=y, y_pred=y_pred)
        # The loss scale is an optimizer variable: read this step's value.
        mapping = list(zip(self.optimizer.variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping):
            scaled_loss = self.optimizer.scale_loss(loss)
        return scaled_loss, (loss, y_pred, non_trainable_variables)

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
        (_, (loss, y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            x,
            y,
        )
        # Scaled gradients in: the optimizer unscales them, updates the loss
        # scale, and leaves every variable as it was if one is not finite.
        (
            trainable_variables,
            optimizer_variables,
        ) = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

        new_metrics_variables = []
        logs = {}
        for metric in self.metrics:
            start = len(new_metrics_variables)
            this_metric_variables = metrics_variables[
                start : start + len(metric.variables)
            ]
            if metric.name == "loss":
                this_metric_variables = metric.stateless_update_state(
                    this_metric_variables, loss
                )
            else:
                this_metric_variables = metric.stateless_update_state(
                    this_metric_variables, y, y_pred
                )
            logs[metric.name] = metric.stateless_result(this_metric_variables)
            new_metrics_variables += this_metric_variables

        state = (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            new_metrics_variables,
        )
        return logs, state


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
    if keras.backend.backend() != "jax":
        raise SystemExit(
            "This example needs the JAX backend. Run it with KERAS_BACKEND=jax."
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
