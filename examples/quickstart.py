"""Quickstart: is mixed precision faster here, and loss scaling at work.

Three parts, about half a minute on 2 CPU cores, on scikit-learn's digits
(1797 8x8 images, no download):

1. Speed. `keras_mp.recommend_policy(build, x, y)` times real training steps
   of the convnet below under float32, mixed_bfloat16 and mixed_float16
   (loss scaling included), alternating them until the comparison is clear
   or its few seconds of budget are spent, checks that the 16-bit losses
   track float32's, and picks the fastest sound policy, with the table.
2. Accuracy. The convnet trains to the end under the recommended policy;
   train and test accuracy are printed.
3. Loss scaling, the reason float16 trains at all. A small model trains
   under mixed_float16 with a dynamic loss scale; one batch is made to
   overflow float16. The table shows that step skipped (weights untouched),
   the scale halved, and the scale growing again after clean steps.

    python examples/quickstart.py
    KERAS_BACKEND=jax python examples/quickstart.py
    python examples/quickstart.py --policy mixed_bfloat16  # part 2 in it
    python examples/quickstart.py --quick  # seconds: a smoke test for CI

`--quick` (or the environment variable KERAS_MP_QUICK=1) takes a few steps
of each part: the numbers it prints mean nothing. TensorFlow's C++ log lines
are silenced here with `TF_CPP_MIN_LOG_LEVEL=2` (set it yourself to see
them).
"""

import argparse
import os

# Before TensorFlow is imported: its C++ INFO and WARNING lines are noise here.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import textwrap  # noqa: E402
import warnings  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras_mp  # noqa: E402


def say(text):
    """Prints a paragraph indented under its part, wrapped at 79 columns."""
    print(
        textwrap.fill(text, 79, initial_indent="   ", subsequent_indent="   ")
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=3.0,
        help="timed training steps in part 1, compilation excluded",
    )
    parser.add_argument(
        "--policy",
        choices=("auto", "float32", "mixed_bfloat16", "mixed_float16"),
        default="auto",
        help="the policy of part 2; 'auto' takes recommend_policy()'s",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps of each part, for CI (also KERAS_MP_QUICK=1)",
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


def build_convnet():
    """A small convnet; its layers take the global policy."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
            # The softmax in float32: a 16-bit softmax loses the small
            # probabilities that the cross-entropy takes the log of.
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def compile_for_digits(model):
    # Under a policy with a loss scale, compile wraps the optimizer in a
    # keras_mp.LossScaleOptimizer; fit then logs loss_scale and
    # skipped_steps (keras_mp.callbacks.LossScaleLogger).
    model.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def build_and_compile():
    """The convnet, built and compiled under the policy of the moment."""
    model = build_convnet()
    compile_for_digits(model)
    return model


# ---------------------------------------------------------------- part 1


def part_1(data, args):
    x_train, y_train, _, _ = data
    print("1. Speed: training steps of the convnet under each policy")
    # A function that builds the model (rather than a model) lets
    # recommend_policy build it under each policy as you would: the float32
    # softmax stays float32. It calls it with each policy set, copies one
    # set of weights into all three and restores the global policy after.
    recommendation = keras_mp.recommend_policy(
        build_and_compile,
        x_train[: args.batch_size],
        y_train[: args.batch_size],
        budget_seconds=0.3 if args.quick else args.budget_seconds,
    )
    *table, choice = str(recommendation).splitlines()
    for line in table:
        print(f"   {line}")
    say(choice)
    print()
    return recommendation.policy


# ---------------------------------------------------------------- part 2


def part_2(policy, data, args):
    x_train, y_train, x_test, y_test = data
    if args.policy != "auto":
        policy = args.policy
    epochs = 1 if args.quick else args.epochs
    print(f"2. Accuracy: the convnet trained for {epochs} epochs in {policy}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Mixed precision compatibility")
        with keras_mp.policy_scope(policy):
            keras.utils.set_random_seed(0)
            model = build_convnet()
            compile_for_digits(model)
        history = model.fit(
            x_train,
            y_train,
            batch_size=args.batch_size,
            epochs=epochs,
            verbose=0,
        )
    _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
    train_accuracy = history.history["accuracy"][-1]
    print(
        f"   train accuracy {train_accuracy:.2%} (last epoch), "
        f"test accuracy {test_accuracy:.2%} (held-out 20%)"
    )
    print()


# ---------------------------------------------------------------- part 3


def scale_and_skips(optimizer):
    return (
        int(keras.ops.convert_to_numpy(optimizer.iterations)),
        float(keras.ops.convert_to_numpy(optimizer.loss_scale())),
        int(keras.ops.convert_to_numpy(optimizer.skipped_steps)),
    )


def part_3(data, args):
    x_train, y_train, x_test, y_test = data
    flat_train = x_train.reshape(len(x_train), -1)
    flat_test = x_test.reshape(len(x_test), -1)
    growth = 2 if args.quick else 10
    loss_scale = keras_mp.DynamicLossScale(
        initial_loss_scale=1024, increment_period=growth
    )
    print(
        "3. Loss scaling: an MLP under mixed_float16, with "
        f"DynamicLossScale(initial_loss_scale=1024, increment_period={growth})"
    )
    with warnings.catch_warnings():
        # float16 is emulated on most CPUs: slow, and this part is small.
        warnings.filterwarnings("ignore", "Mixed precision compatibility")
        with keras_mp.policy_scope(
            keras_mp.Policy("mixed_float16", loss_scale=loss_scale)
        ):
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(64, activation="relu"),
                    keras.layers.Dense(10),
                    keras.layers.Activation("softmax", dtype="float32"),
                ]
            )
            compile_for_digits(model)
    optimizer = model.optimizer

    # One batch whose inputs are beyond float16's largest value (65504):
    # the float16 forward pass gives inf, the gradients are not finite.
    overflowing = flat_train[: args.batch_size] * 1e5
    steps = -(-len(flat_train) // args.batch_size)

    def clean_epoch():
        model.fit(flat_train, y_train, batch_size=args.batch_size, verbose=0)

    rows = []
    clean_epoch()
    rows.append((f"1 epoch ({steps} steps)", *scale_and_skips(optimizer)))
    before = [w.copy() for w in model.get_weights()]
    model.fit(
        overflowing,
        y_train[: args.batch_size],
        batch_size=args.batch_size,
        epochs=1,
        verbose=0,
    )
    untouched = all(
        np.array_equal(a, b) for a, b in zip(before, model.get_weights())
    )
    rows.append(("1 overflowing batch", *scale_and_skips(optimizer)))
    clean_epoch()
    rows.append(("1 more epoch", *scale_and_skips(optimizer)))

    print(
        f"   {'after':<24}{'applied updates':>16}{'Loss scale:':>13}"
        f"{'skipped steps':>15}"
    )
    for label, applied, scale, skipped in rows:
        print(f"   {label:<24}{applied:>16}{scale:>13g}{skipped:>15}")
    _, test_accuracy = model.evaluate(flat_test, y_test, verbose=0)
    say(
        "The overflowing step was skipped: weights untouched "
        f"({untouched}), scale halved. Test accuracy {test_accuracy:.2%}."
    )
    say(
        "Why: float16 keeps 5 exponent bits, so gradients below about "
        "6e-8 flush to zero. The loss is multiplied by the scale before "
        "differentiation and the gradients divided by it after, in float32; "
        "when a step overflows, it is skipped and the scale halves, and after "
        f"{growth} finite steps in a row it doubles. compile set this up from "
        "the policy; fit logs 'loss_scale' and 'skipped_steps'. bfloat16 has "
        "float32's exponent range and needs none of this."
    )


def main(argv=None):
    args = parse_args(argv)
    data = load_data(args.quick)
    print(f"Keras {keras.__version__}, backend {keras.backend.backend()}\n")
    recommended = part_1(data, args)
    part_2(recommended, data, args)
    part_3(data, args)
    if args.quick:
        print("\n(--quick: a few steps per part; the numbers mean nothing.)")


if __name__ == "__main__":
    main()
