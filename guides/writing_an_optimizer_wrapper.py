"""Guide: writing an optimizer wrapper by overriding one stage.

`keras_mp.OptimizerWrapper` runs every training step as six stages (RFC 234),
each a public method:

1. `transform_loss(loss)`                      e.g. scale the loss
2. `get_gradients(loss, variables, tape)`      differentiate
3. `transform_unaggregated_gradients(g_and_v)`  per replica
4. `aggregate_gradients(g_and_v)`               sum across replicas
5. `transform_gradients(g_and_v)`               e.g. clip
6. `apply_updates(g_and_v)`                     the inner optimizer's update

A wrapper overrides the stage it is about and inherits the rest, so it
works in `fit`, in a `tf.GradientTape` loop and in a JAX stateless step
alike, and it composes with `keras_mp.LossScaleOptimizer`. This guide
writes `ClipAndCount`: stage 5 clips the gradients to a maximum global norm
and counts, in a variable, the steps it clipped. It then shows the wrapper
in `fit` under a mixed_float16 policy, hyperparameter delegation, why the
order of wrappers matters, and saving.

    python guides/writing_an_optimizer_wrapper.py
    KERAS_BACKEND=jax python guides/writing_an_optimizer_wrapper.py
    python guides/writing_an_optimizer_wrapper.py --quick   # a few steps (CI)
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import tempfile
import warnings

import keras
import numpy as np
from keras import ops
from sklearn.datasets import load_digits

import keras_mp


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    return parser.parse_args(argv)


# ## The wrapper
#
# - State is a Keras variable made in `build_wrapper` with
#   `self.add_variable`: it is then part of `optimizer.variables`, so it is
#   saved with the optimizer and carried through JAX's stateless steps.
# - The stage uses only `keras.ops` and no Python `if` on tensor values:
#   it runs inside a compiled step (tf.function, XLA, jax.jit).
# - It calls `super().transform_gradients(...)`, which runs the plug-ins
#   given as `transform_gradients=[...]` (`keras_mp.transforms`).
# - `get_config` adds its own argument to the wrapper's config (which holds
#   the inner optimizer), so `from_config` and `model.save` work unchanged.


@keras.saving.register_keras_serializable(package="guide")
class ClipAndCount(keras_mp.OptimizerWrapper):
    """Clips gradients to a global norm and counts the steps it clipped.

    Args:
        optimizer: The optimizer to wrap.
        max_norm: Largest global norm of the gradients. Defaults to `1.0`.
        **kwargs: `transform_gradients`, `aggregate_gradients`, `name`.
    """

    def __init__(self, optimizer, max_norm=1.0, **kwargs):
        if not max_norm > 0:
            raise ValueError(
                f"`max_norm` must be positive. Received: max_norm={max_norm!r}"
            )
        super().__init__(optimizer, **kwargs)
        self.max_norm = float(max_norm)

    def build_wrapper(self, var_list):
        self.clipped_steps = self.add_variable(
            shape=(), dtype="int32", initializer="zeros", name="clipped_steps"
        )

    def transform_gradients(self, grads_and_vars):
        grads_and_vars = super().transform_gradients(grads_and_vars)
        grads = [g for g, _ in grads_and_vars if g is not None]
        norm = ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))
        factor = ops.minimum(1.0, self.max_norm / ops.maximum(norm, 1e-12))
        self.clipped_steps.assign_add(
            ops.cast(ops.greater(norm, self.max_norm), "int32")
        )
        return [
            (None if g is None else g * ops.cast(factor, g.dtype), v)
            for g, v in grads_and_vars
        ]

    def get_config(self):
        config = super().get_config()
        config["max_norm"] = self.max_norm
        return config


# ## In fit, under mixed_float16
#
# `compile` wraps the optimizer in a `keras_mp.LossScaleOptimizer` because
# the policy has a loss scale, and it wraps *ours*:
# LossScaleOptimizer(ClipAndCount(Adam)). That order is the right one: the
# loss scale optimizer unscales the gradients in its own stage 5, then hands
# them to the inner optimizer, so `ClipAndCount` sees true gradients. On an
# overflow the whole inner update is skipped, count included.


def train(epochs, quick):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    if quick:
        x, y = x[:256], y[:256]
    # On a CPU the hardware check warns that float16 is slow here.
    # The check runs when the first mixed layer is built: filtered for
    # the whole script, not only around set_global_policy.
    warnings.filterwarnings("ignore", "Mixed precision compatibility")
    keras_mp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    model.compile(
        optimizer=ClipAndCount(keras.optimizers.Adam(3e-3), max_norm=0.5),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    return model, history


def show_training(model, history):
    optimizer = model.optimizer
    ours = optimizer.inner_optimizer
    print(
        f"model.optimizer: {type(optimizer).__name__}"
        f"({type(ours).__name__}({type(ours.inner_optimizer).__name__}))"
    )
    print(
        f"train accuracy {history.history['accuracy'][-1]:.2%} (last epoch), "
        "loss scale "
        f"{history.history['loss_scale'][-1]:g}, skipped steps "
        f"{history.history['skipped_steps'][-1]}"
    )
    clipped = int(ops.convert_to_numpy(ours.clipped_steps))
    applied = int(ops.convert_to_numpy(optimizer.iterations))
    print(f"ClipAndCount clipped {clipped} of {applied} applied steps")


# ## Hyperparameters go through
#
# A wrapper delegates the inner optimizer's hyperparameters (every key of
# its `get_config()` but `name`): reading and setting them on the outermost
# wrapper reaches Adam, which is what `LearningRateScheduler` and
# `ReduceLROnPlateau` rely on. Anything else of the inner optimizer raises
# AttributeError, so a method that would bypass the stages cannot be called
# by accident.


def show_delegation(model):
    optimizer = model.optimizer
    optimizer.learning_rate = 1e-3
    adam = optimizer.inner_optimizer.inner_optimizer
    print(
        f"through two wrappers: beta_1={float(optimizer.beta_1):g}, "
        f"learning_rate set to "
        f"{float(ops.convert_to_numpy(adam.learning_rate)):g} on Adam"
    )


# ## The order of wrappers matters
#
# `ClipAndCount(LossScaleOptimizer(Adam))` would be wrong: its stage 5 would
# run before the loss scale optimizer unscales, on gradients 32768 times too
# large, so it would clip nearly every step. Wrappers that look at gradient
# values belong *inside* the LossScaleOptimizer, which is where `compile`
# puts them.


def show_wrong_order():
    x = np.ones((8, 4), "float32")
    y = np.ones((8, 1), "float32")
    keras_mp.set_global_policy(None)
    for name, make in [
        (
            "LossScaleOptimizer(ClipAndCount(SGD))",
            lambda: keras_mp.LossScaleOptimizer(
                ClipAndCount(keras.optimizers.SGD(0.01), max_norm=1000.0)
            ),
        ),
        (
            "ClipAndCount(LossScaleOptimizer(SGD))",
            lambda: ClipAndCount(
                keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.01)),
                max_norm=1000.0,
            ),
        ),
    ]:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = make()
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=8, epochs=4, verbose=0)
        clip = (
            optimizer
            if isinstance(optimizer, ClipAndCount)
            else (optimizer.inner_optimizer)
        )
        clipped = int(ops.convert_to_numpy(clip.clipped_steps))
        print(f"  {name}: clipped {clipped} of 4 steps (max_norm=1000)")


# ## Saving
#
# The config nests: ClipAndCount's holds Adam's, the loss scale optimizer's
# holds ClipAndCount's. A saved model comes back with the same chain, the
# same max_norm and the same counter.


def show_saving(model):
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        reloaded = keras.models.load_model(path)
    ours = reloaded.optimizer.inner_optimizer
    print(
        f"reloaded: {type(reloaded.optimizer).__name__}"
        f"({type(ours).__name__}(max_norm={ours.max_norm:g})), clipped_steps "
        f"{int(ops.convert_to_numpy(ours.clipped_steps))}"
    )


def main(argv=None):
    args = parse_args(argv)
    model, history = train(1 if args.quick else args.epochs, args.quick)
    show_training(model, history)
    show_delegation(model)
    show_saving(model)
    print("Order of wrappers:")
    show_wrong_order()


if __name__ == "__main__":
    main()
