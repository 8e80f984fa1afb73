"""Guide: finding the layer that overflows in float16, and fixing it.

A dynamic loss scale hides overflows well: a step with an inf or NaN
gradient is skipped, the scale drops, training goes on. When one layer keeps
overflowing, the scale keeps dropping for everyone, and the question is
*which* layer. keras_mp answers with numbers, counted inside the compiled
step: this guide trains a digits classifier (scikit-learn, no download)
whose first layer sees unnormalized inputs, so its kernel gradient
overflows float16 again and again, and shows, in order:

1. `LossScaleOptimizer(track_overflow=True)` and the
   `keras_mp.callbacks.OverflowReport` callback naming that layer;
2. the fix, one `dtype="float32"` on that layer, and the skipped steps and
   loss scale before and after, plotted per step (a PNG, with matplotlib);
3. `DynamicLossScale(hysteresis=..., on_min_scale=...)`: what the scaler
   does with isolated overflows and with overflows it cannot fix;
4. two optimizers in one loop (generator and discriminator): each has its
   own loss scale, so an overflow in one never skips or rescales the other.

    python guides/debugging_overflows.py --plot /tmp/overflows.png
    KERAS_BACKEND=jax python guides/debugging_overflows.py
    python guides/debugging_overflows.py --quick   # a few steps (CI)
"""

import argparse
import os
import pathlib
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_mp  # noqa: E402

DEFAULT_PLOT = pathlib.Path(__file__).parent / "_output" / "overflows.png"
BATCH_SIZE = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", type=pathlib.Path, default=DEFAULT_PLOT)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    return parser.parse_args(argv)


# ## 1. A model with one overflowing layer
#
# The pixels (0 to 16) are multiplied by 1000 and *not* normalized; the
# first layer's weights are initialized small to match, so its outputs are
# of a normal size. Its kernel gradient, though, is inputs x output
# gradients: a thousand times larger than it would be for normalized
# inputs. Times a loss scale of 2**15 it leaves float16's range (65504)
# long before any other layer's does, and the scale drops until that one
# gradient fits, for every layer.


def load_data(quick):
    digits = load_digits()
    x = (digits.data * 1000.0).astype("float32")
    y = digits.target.astype("int32")
    if quick:
        x, y = x[: 4 * BATCH_SIZE], y[: 4 * BATCH_SIZE]
    return x, y


def build_model(first_layer_dtype=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(
                32,
                activation="relu",
                name="projection",
                dtype=first_layer_dtype,
                # Weights sized for the raw inputs: outputs of a normal size.
                kernel_initializer=keras.initializers.RandomNormal(stddev=1e-4),
            ),
            keras.layers.Dense(10, name="logits", dtype="float32"),
        ]
    )
    model.compile(
        keras_mp.LossScaleOptimizer(
            # Adam's steps scale with the learning rate, not the gradient:
            # small, for the first layer's small weights.
            keras.optimizers.Adam(1e-4),
            # Short growth period, so the scale keeps probing upwards and
            # the overflowing layer shows up again and again.
            loss_scale=keras_mp.DynamicLossScale(
                2**15, increment_period=25, max_loss_scale=2**16
            ),
            track_overflow=True,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class PerStep(keras.callbacks.Callback):
    """Collects the loss scale and skipped steps after every step."""

    def __init__(self):
        super().__init__()
        self.scales, self.skipped = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(logs["loss_scale"])
        self.skipped.append(logs["skipped_steps"])


def train(model, x, y, epochs, report=True):
    per_step = PerStep()
    callbacks = [
        # Per-batch logging so that PerStep sees every step; first, so the
        # values are in the logs the next callbacks receive.
        keras_mp.callbacks.LossScaleLogger(update_freq="batch"),
        per_step,
    ]
    if report:
        callbacks.append(keras_mp.callbacks.OverflowReport(top=1))
    history = model.fit(
        x,
        y,
        batch_size=BATCH_SIZE,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return history, per_step


# ## 2. Fix it where it overflows
#
# The report names `projection/kernel`. Computing that one layer in float32
# (its gradient then never passes through float16) removes the overflows,
# and the loss scale stays high for the rest of the model. Normalizing the
# inputs would fix it too; the point is that the report tells you where.


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    for label, per_step in runs.items():
        steps = np.arange(1, len(per_step.scales) + 1)
        top.step(steps, per_step.scales, where="post", label=label)
        bottom.step(steps, per_step.skipped, where="post", label=label)
    top.set_yscale("log", base=2)
    top.set_ylabel("loss scale")
    top.legend()
    top.set_title("One overflowing layer, before and after its float32 fix")
    bottom.set_ylabel("skipped steps (total)")
    bottom.set_xlabel("step")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ## 3. The scaler's policy
#
# `hysteresis=2` keeps the scale through an isolated overflow (the step is
# still skipped) and lowers it on the second in a row, as DeepSpeed and
# Megatron do. `on_min_scale` decides what happens when overflows continue
# with the scale at `min_loss_scale`, where lowering it cannot help:
# "warn" (the default, once), "raise" (FloatingPointError, which stops
# `fit`), or "ignore". `fit` checks it each time LossScaleLogger reads the
# state; a custom loop calls `optimizer.check_min_scale()` every few steps.


def scaler_policy_demo():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=keras_mp.DynamicLossScale(
            8.0, min_loss_scale=2.0, hysteresis=2, on_min_scale="raise"
        ),
    )
    weight = keras.Variable([1.0])
    optimizer.build([weight])
    optimizer.check_min_scale()  # the baseline of the check
    scales = []
    for gradient in (np.inf, 1.0, np.inf, np.inf, np.inf, np.inf):
        optimizer.scale_loss(1.0)
        optimizer.apply([ops.array([gradient])], [weight])
        scales.append(float(ops.convert_to_numpy(optimizer.loss_scale())))
    print(
        "hysteresis=2, gradients inf, 1, inf, inf, inf, inf -> loss scale "
        f"after each step: {scales}"
    )
    try:
        optimizer.check_min_scale()
    except FloatingPointError as error:
        print(f"on_min_scale='raise' -> FloatingPointError: {error}\n")


# ## 4. Two optimizers, two loss scales
#
# A GAN trains a generator and a discriminator with two optimizers. Each
# `LossScaleOptimizer` owns its loss scale (giving one `DynamicLossScale`
# object to both raises), so an overflow in the discriminator's gradients
# skips the discriminator's step and lowers its scale only. `minimize` with
# a callable loss runs on every backend.


def two_optimizers_demo():
    keras.utils.set_random_seed(1)
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    g_optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    d_optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    real = np.random.default_rng(0).normal(size=(16, 2)).astype("float32")
    noise = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
    for step in range(3):
        # An overflow in the discriminator's loss at step 1 only.
        factor = np.inf if step == 1 else 1.0

        def d_loss(factor=factor):
            fake = generator(noise)
            loss = bce(np.ones((16, 1)), discriminator(real)) + bce(
                np.zeros((16, 1)), discriminator(fake)
            )
            return loss * factor

        def g_loss():
            return bce(np.ones((16, 1)), discriminator(generator(noise)))

        d_optimizer.minimize(d_loss, discriminator.trainable_variables)
        g_optimizer.minimize(g_loss, generator.trainable_variables)
    for name, optimizer in (
        ("discriminator", d_optimizer),
        ("generator", g_optimizer),
    ):
        print(
            f"{name:>13}: loss scale "
            f"{float(ops.convert_to_numpy(optimizer.loss_scale())):g}, "
            f"applied {int(ops.convert_to_numpy(optimizer.iterations))}, "
            f"skipped {int(ops.convert_to_numpy(optimizer.skipped_steps))}"
        )


def main(argv=None):
    args = parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    with warnings.catch_warnings():
        # On a CPU the hardware check warns that float16 is slow here; this
        # guide is about overflows, not speed.
        warnings.filterwarnings("ignore", "Mixed precision compatibility")
        keras_mp.set_global_policy("mixed_float16")
    x, y = load_data(args.quick)

    print("## float16 everywhere")
    model = build_model()
    history, before = train(model, x, y, epochs)
    print(
        f"training-set accuracy {history.history['accuracy'][-1]:.2%}, "
        f"skipped steps {history.history['skipped_steps'][-1]}, "
        f"loss scale {history.history['loss_scale'][-1]:g}"
    )
    report = model.optimizer.overflow_report(top=3)
    print(f"overflow_report(top=3):\n{report}\n")

    print("## The overflowing layer computed in float32")
    fixed = build_model(first_layer_dtype="float32")
    history, after = train(fixed, x, y, epochs, report=False)
    print(
        f"training-set accuracy {history.history['accuracy'][-1]:.2%}, "
        f"skipped steps {history.history['skipped_steps'][-1]}, "
        f"loss scale {history.history['loss_scale'][-1]:g}\n"
    )
    plot(
        {"float16 everywhere": before, "projection in float32": after},
        args.plot,
    )
    print(f"Plot of the loss scale and skipped steps per step: {args.plot}\n")

    print("## The scaler's policy")
    scaler_policy_demo()
    print("## Two optimizers, two loss scales")
    two_optimizers_demo()


if __name__ == "__main__":
    main()
