"""Quickstart: mixed precision on a small convnet, next to float32.

Trains the same convnet on scikit-learn's digits (1797 8x8 images, no
download) twice, in float32 and in the mixed precision policy that suits this
machine, then prints the test accuracy, the median step time and the
speed-up of each, and the final loss scale and skipped steps.

The mixed policy is the one `keras_mp.recommend_policy()` picks after timing
float32, bfloat16 and float16 matmuls here. Where it picks float32 (16-bit
math is not faster on this machine), the mixed run uses mixed_bfloat16 all
the same, so you see what it would cost. `--policy` chooses it yourself.

    python examples/quickstart.py         # under 2 minutes on 2 CPU cores
    KERAS_BACKEND=jax python examples/quickstart.py
    python examples/quickstart.py --policy mixed_float16  # shows loss scaling
    python examples/quickstart.py --quick # seconds: a smoke test for CI

`--quick` (or the environment variable KERAS_MP_QUICK=1) trains one epoch
on a few batches: the numbers it prints mean nothing.
"""

import argparse
import os
import statistics
import time
import warnings

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import keras_mp


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--policy",
        choices=("auto", "mixed_bfloat16", "mixed_float16"),
        default="auto",
        help="the mixed policy; 'auto' asks keras_mp.recommend_policy()",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="one short epoch, for CI (also KERAS_MP_QUICK=1)",
    )
    return parser.parse_args(argv)


def load_data(quick):
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]  # (n, 8, 8, 1)
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0
    )
    if quick:
        return x_train[:256], y_train[:256], x_test[:64], y_test[:64]
    return x_train, y_train, x_test, y_test


def build_model():
    """A small convnet; its layers take the global policy."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
            # The softmax in float32: a 16-bit softmax loses the small
            # probabilities that the cross-entropy takes the log of.
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


class StepTimer(keras.callbacks.Callback):
    """Wall time between batch ends, after the first epoch (compilation)."""

    def __init__(self):
        super().__init__()
        self.step_seconds = []
        self._last = None

    def on_epoch_begin(self, epoch, logs=None):
        self._last = None
        self._timing = epoch > 0 or self.params["epochs"] == 1

    def on_train_batch_end(self, batch, logs=None):
        # Keras has turned this step's logs into Python floats already, so
        # the step has finished on the device (JAX dispatches asynchronously).
        now = time.perf_counter()
        if self._timing and self._last is not None:
            self.step_seconds.append(now - self._last)
        self._last = now


def train(policy, data, args):
    """Trains a fresh model under `policy`; returns a dict of results."""
    x_train, y_train, x_test, y_test = data
    with keras_mp.policy_scope(policy):
        keras.utils.set_random_seed(0)
        model = build_model()
        # Under a policy with a loss scale, compile wraps the optimizer in a
        # keras_mp.LossScaleOptimizer; fit then logs loss_scale and
        # skipped_steps (keras_mp.callbacks.LossScaleLogger).
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    timer = StepTimer()
    history = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[timer],
        verbose=0,
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {
        "policy": policy,
        "accuracy": accuracy,
        "step_ms": 1000 * statistics.median(timer.step_seconds),
        "optimizer": type(model.optimizer).__name__,
        "loss_scale": history.history.get("loss_scale", [None])[-1],
        "skipped_steps": history.history.get("skipped_steps", [None])[-1],
    }


def choose_mixed_policy(args):
    """The mixed policy to run, and a line saying why."""
    if args.policy != "auto":
        return args.policy, f"{args.policy} was chosen with --policy."
    recommendation = keras_mp.recommend_policy(
        budget_seconds=0.5 if args.quick else 2.0
    )
    print(recommendation, end="\n\n")
    if recommendation.policy != "float32":
        return recommendation.policy, (
            f"{recommendation.policy} is what recommend_policy() picked."
        )
    return "mixed_bfloat16", (
        "recommend_policy() picked float32: 16-bit math is not faster here. "
        "The mixed run uses mixed_bfloat16 anyway, to show what it costs; "
        "train in float32 on this machine."
    )


def loss_scale_lines(mixed):
    if mixed["loss_scale"] is None:
        return [
            f"Loss scale: none. {mixed['policy']} computes in bfloat16, which "
            "has float32's exponent range: small gradients do not flush to "
            "zero, so the policy has no loss scale and the optimizer is "
            f"{mixed['optimizer']}, unwrapped.",
            "  To watch loss scaling at work: --policy mixed_float16 (float16 "
            "needs it), or keras_mp.Policy('mixed_bfloat16', "
            "loss_scale='dynamic') in your own code.",
        ]
    return [
        f"Loss scale: {mixed['loss_scale']:g} at the end of training, "
        f"{mixed['skipped_steps']} steps skipped for non-finite gradients "
        f"({mixed['optimizer']}, added by compile; fit logs both as "
        "'loss_scale' and 'skipped_steps')."
    ]


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.epochs = 1
    data = load_data(args.quick)
    print(f"Keras {keras.__version__}, backend {keras.backend.backend()}\n")
    mixed_policy, why = choose_mixed_policy(args)
    with warnings.catch_warnings():
        # The hardware check has had its say in `why` (or the user chose).
        warnings.filterwarnings("ignore", "Mixed precision compatibility")
        results = [train(p, data, args) for p in ("float32", mixed_policy)]
    base, mixed = results
    print(f"Mixed policy: {why}\n")
    header = ("policy", "test accuracy", "median step", "speed-up")
    print(f"{header[0]:<16}{header[1]:>15}{header[2]:>14}{header[3]:>10}")
    for result in results:
        speedup = base["step_ms"] / result["step_ms"]
        print(
            f"{result['policy']:<16}{result['accuracy']:>15.2%}"
            f"{result['step_ms']:>11.1f} ms{speedup:>9.2f}x"
        )
    print()
    for line in loss_scale_lines(mixed):
        print(line)
    if args.quick:
        print("\n(--quick: one short epoch; the numbers above mean nothing.)")


if __name__ == "__main__":
    main()
