"""Guide: mixed precision with `Model.fit`.

Mixed precision computes in a 16-bit float type and keeps the weights in
float32. It runs faster where the hardware has fast 16-bit math (NVIDIA GPUs
since Volta, TPUs, recent CPUs with bfloat16 instructions) and uses less
memory for activations. This guide trains a small classifier on
scikit-learn's digits (no download) and shows, in order:

1. choosing a policy by measuring this machine;
2. setting it globally and what `compile` then does to the optimizer;
3. `loss_scale` and `skipped_steps` in the logs of `fit`;
4. the dynamic loss scale at work, with overflows injected on purpose,
   plotted per step (a PNG, written with matplotlib);
5. saving and reloading a mixed precision model.

Run it (about 30 s on 2 CPU cores; `--quick` or KERAS_MP_QUICK=1 for a few
steps only):

    python guides/mixed_precision_with_fit.py --plot /tmp/loss_scale.png
    KERAS_BACKEND=jax python guides/mixed_precision_with_fit.py
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import pathlib
import tempfile
import warnings

import keras
import numpy as np
from keras import ops
from sklearn.datasets import load_digits

import keras_mp

DEFAULT_PLOT = pathlib.Path(__file__).parent / "_output" / "loss_scale.png"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", type=pathlib.Path, default=DEFAULT_PLOT)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    return parser.parse_args(argv)


# ## 1. Choose a policy
#
# A policy names two dtypes: the *compute* dtype of a layer's math and the
# *variable* dtype its weights are stored in. "mixed_float16" and
# "mixed_bfloat16" compute in 16 bits and store in float32, because small
# weight updates round away in 16-bit weights.
#
# Which one is faster depends on the device, the backend's kernels and the
# model. Given a model (or a function that builds one) and a batch,
# `keras_mp.recommend_policy(model, x, y)` times real training steps of it
# under float32, mixed_bfloat16 and mixed_float16 and checks that the
# 16-bit losses track float32's (examples/quickstart.py does this). Called
# without a model, as here, it is a quick probe of the device: it times
# float32, bfloat16 and float16 matmuls, repeating until the comparison is
# clear or its budget is spent, and picks the fastest safe policy.


def choose_policy(quick):
    recommendation = keras_mp.recommend_policy(
        budget_seconds=0.3 if quick else 1.5
    )
    print(recommendation, end="\n\n")
    return recommendation


# This guide trains in "mixed_float16" whatever the recommendation, because
# it is the policy that needs loss scaling, the subject of sections 3 and 4.
# float16 has 5 exponent bits: gradients below about 6e-8 flush to zero.
# Multiplying the loss by a *loss scale* multiplies every gradient by it
# too; the optimizer divides it back out in float32 before the update.
# bfloat16 has float32's 8 exponent bits and needs none of this.
#
# The policy's loss scale is a `DynamicLossScale` by default; this one grows
# every 20 finite steps (instead of 2000) so that its dynamics fit in a
# short run.
POLICY = keras_mp.Policy(
    "mixed_float16", loss_scale=keras_mp.DynamicLossScale(increment_period=20)
)


# ## 2. Set the policy, build, compile
#
# `set_global_policy` must come before the layers are created: each layer
# takes the global policy when it is built. `keras_mp.Policy` is a
# `keras.DTypePolicy`, so Keras's built-in layers accept it, and it carries
# a loss scale.


def build_and_compile():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
            # Keep the softmax in float32: in float16 the small
            # probabilities that the cross-entropy takes the log of vanish.
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=OverflowOnFlaggedBatches(),
        metrics=[FlaggedAccuracy()],
    )
    return model


# `compile` saw a policy with a loss scale and wrapped the optimizer in a
# `keras_mp.LossScaleOptimizer` holding its own copy of the scale; Adam's
# hyperparameters stay reachable through the wrapper (section 2's output).
#
# ## 3 and 4. The loss scale in fit's logs, and overflows on purpose
#
# With a dynamic scale each step (1) scales the loss, (2) unscales the
# gradients, (3) checks them: if any is inf or NaN, the step is *skipped*
# (weights and Adam's state stay bit-identical), the scale is halved and
# `skipped_steps` grows; after 20 finite steps in a row the scale doubles.
# So the scale settles just below the largest value that does not overflow.
#
# To see this happen on cue, the loss below stands in for an overflow: its
# value is the usual cross-entropy, but on batches whose targets carry a flag
# its gradient is infinite, as if float16 had overflowed there. The flag is
# a second column of the targets.


class OverflowOnFlaggedBatches(keras.losses.Loss):
    """Cross-entropy; the gradient is inf on batches flagged in y_true[:, 1]."""

    def call(self, y_true, y_pred):
        labels = ops.cast(y_true[:, 0], "int32")
        values = keras.losses.sparse_categorical_crossentropy(labels, y_pred)
        factor = ops.where(ops.max(y_true[:, 1]) > 0, float("inf"), 1.0)

        @ops.custom_gradient
        def overflow(values):
            def grad(*args, upstream=None):
                if upstream is None:
                    (upstream,) = args
                return upstream * factor

            return ops.copy(values), grad

        return overflow(values)


class FlaggedAccuracy(keras.metrics.SparseCategoricalAccuracy):
    """Accuracy on the label column of the flagged targets."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        super().update_state(y_true[:, :1], y_pred, sample_weight)


def load_data(quick, overflow_batches, batch_size):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = np.zeros((len(x), 2), "float32")
    y[:, 0] = digits.target
    if quick:
        x, y = x[:256], y[:256]
    for batch in overflow_batches:
        y[batch * batch_size : (batch + 1) * batch_size, 1] = 1.0
    return x, y


# `fit` adds `keras_mp.callbacks.LossScaleLogger` by itself when the
# optimizer is a LossScaleOptimizer: `loss_scale` and `skipped_steps` then
# appear in the epoch logs, hence in `History`, `CSVLogger`, `TensorBoard`
# and the progress bar. Passing your own `LossScaleLogger(update_freq=...)`
# adds them to batch logs too (here every step, to plot them);
# `fit(..., log_loss_scale=False)` leaves them out.


def train(model, x, y, epochs, batch_size):
    per_step = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: per_step.append(
            (logs["loss_scale"], logs["skipped_steps"])
        )
    )
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,  # the flagged batches stay where they were put
        callbacks=[keras_mp.callbacks.LossScaleLogger("batch"), record],
        verbose=2,
    )
    return history, per_step


def plot(per_step, overflow_steps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(per_step) + 1)
    scales = [scale for scale, _ in per_step]
    skipped = [count for _, count in per_step]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    top.step(steps, scales, where="post")
    top.set_yscale("log", base=2)
    top.set_ylabel("loss scale")
    for step in overflow_steps:
        top.axvline(step, color="tab:red", alpha=0.3, linewidth=1)
    top.set_title(
        "Dynamic loss scale (red: injected overflows; other drops: real ones)"
    )
    bottom.step(steps, skipped, where="post", color="tab:orange")
    bottom.set_ylabel("skipped steps")
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_xlabel("step")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ## 5. Save and reload
#
# The saved model keeps its policy (with the loss scale) and its optimizer:
# the LossScaleOptimizer comes back with its scale's current value, whatever
# the global policy is when loading.


def save_and_reload(model):
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        keras_mp.set_global_policy(None)
        return keras.models.load_model(
            path,
            custom_objects={
                "OverflowOnFlaggedBatches": OverflowOnFlaggedBatches,
                "FlaggedAccuracy": FlaggedAccuracy,
            },
        )


def main(argv=None):
    args = parse_args(argv)
    batch_size = 32
    epochs = 2 if args.quick else args.epochs
    overflow_batches = (3,) if args.quick else (10,)

    choose_policy(args.quick)

    # On a CPU the hardware check warns that float16 is slow here; this
    # guide is about loss scaling, not speed.
    # The check runs when the first mixed layer is built: filtered for
    # the whole script, not only around set_global_policy.
    warnings.filterwarnings("ignore", "Mixed precision compatibility")
    keras_mp.set_global_policy(POLICY)
    model = build_and_compile()
    optimizer = model.optimizer
    print(f"Global policy: {keras_mp.global_policy()}")
    print(
        f"Dense layers compute in {model.layers[0].compute_dtype}, store "
        f"weights in {model.layers[0].variable_dtype}"
    )
    print(
        f"compile wrapped the optimizer: {type(optimizer).__name__}"
        f"({type(optimizer.inner_optimizer).__name__}), loss scale "
        f"{optimizer.loss_scale}, learning rate through the wrapper: "
        f"{float(ops.convert_to_numpy(optimizer.learning_rate)):g}\n"
    )

    x, y = load_data(args.quick, overflow_batches, batch_size)
    history, per_step = train(model, x, y, epochs, batch_size)
    steps_per_epoch = -(-len(x) // batch_size)
    overflow_steps = [
        epoch * steps_per_epoch + batch + 1
        for epoch in range(epochs)
        for batch in overflow_batches
    ]
    print(f"\nHistory keys: {sorted(history.history)}")
    for key in ("loss_scale", "skipped_steps"):
        print(f"{key} at each epoch end: {history.history[key]}")
    injected = len(overflow_steps)
    total = per_step[-1][1]
    print(
        f"{total} steps skipped: {injected} injected, {total - injected} "
        "real float16 overflows as the scale grew too large"
    )

    plot(per_step, overflow_steps, args.plot)
    print(f"Plot of the loss scale per step: {args.plot}")

    reloaded = save_and_reload(model)
    scale = reloaded.optimizer.loss_scale
    print(
        f"\nReloaded: policy {reloaded.layers[0].dtype_policy.name}, "
        f"optimizer {type(reloaded.optimizer).__name__}, loss scale "
        f"{float(ops.convert_to_numpy(scale())):g}"
    )


if __name__ == "__main__":
    main()
