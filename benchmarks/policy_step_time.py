"""Step time of `fit` in float32, mixed_bfloat16 and mixed_float16.

Two models train on synthetic data on the backend named by KERAS_BACKEND:

- mlp: 512 features, three Dense(1024) layers, 10 classes, batch 256;
- convnet: 32x32x3 images, Conv2D 32-64-128 with pooling, Dense(256),
  10 classes, batch 64.

Each policy gets its own copy of the model, built under `keras_mp.Policy`
(so mixed_float16 comes with its dynamic loss scale and a
`keras_mp.LossScaleOptimizer`, as users get it). Every model is compiled
and warmed up first; then, in each repeat, every policy runs `fit` for its
number of steps, the order rotating between repeats so that machine load
drifts evenly over them. The step time of a repeat is its `fit` wall time
divided by its steps; the table shows the median over repeats and the
speed-up over float32 (float32 step time / policy step time).

float16 has no fast kernels on CPUs (TensorFlow emulates its convolutions),
so mixed_float16 runs `--float16-steps` steps per repeat instead of
`--steps`:

    python benchmarks/policy_step_time.py
    KERAS_BACKEND=jax python benchmarks/policy_step_time.py --repeats 7
    python benchmarks/policy_step_time.py --models mlp --policies float32 \\
        mixed_bfloat16
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import functools
import statistics
import time
import warnings

import keras
import numpy as np

import keras_mp
from keras_mp.testing import describe_machine

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
MODELS = ("mlp", "convnet")
BATCH_SIZES = {"mlp": 256, "convnet": 64}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=POLICIES
    )
    parser.add_argument("--steps", type=int, default=20, help="steps a repeat")
    parser.add_argument(
        "--float16-steps",
        type=int,
        default=4,
        help="steps a repeat for mixed_float16 (slow on CPUs)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats")
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="2 steps, 1 repeat, models an eighth as wide and 8x8 images: "
        "checks that it runs (also KERAS_MP_QUICK=1)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.float16_steps, args.repeats = 2, 2, 1
    for name in ("steps", "float16_steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def input_shape(name, quick=False):
    if name == "mlp":
        return (64,) if quick else (512,)
    return (8, 8, 3) if quick else (32, 32, 3)


def build_model(name, quick=False):
    """The model `name`; with `quick`, an eighth as wide (a check that the
    benchmark runs, not a measurement)."""
    keras.utils.set_random_seed(0)
    width = 8 if quick else 1
    layers = [keras.Input(input_shape(name, quick))]
    if name == "mlp":
        layers += [
            keras.layers.Dense(1024 // width, activation="relu") for _ in "abc"
        ]
    else:
        conv = functools.partial(
            keras.layers.Conv2D,
            kernel_size=3,
            padding="same",
            activation="relu",
        )
        layers += [
            conv(32 // width),
            conv(64 // width),
            keras.layers.MaxPooling2D(),
            conv(128 // width),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(256 // width, activation="relu"),
        ]
    layers += [
        keras.layers.Dense(10),
        # float32 logits: the loss's softmax runs in float32.
        keras.layers.Activation("linear", dtype="float32"),
    ]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_data(name, steps, quick=False):
    rng = np.random.default_rng(0)
    samples = steps * BATCH_SIZES[name]
    x = rng.normal(size=(samples, *input_shape(name, quick))).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    return x, y


def fit_seconds(model, data, batch_size):
    x, y = data
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def steps_for(policy, args):
    return args.float16_steps if policy == "mixed_float16" else args.steps


def run(args):
    """Returns `{(model, policy): [seconds per step, one per repeat]}`."""
    models = {}
    with warnings.catch_warnings():
        # The hardware check's warnings are what this benchmark measures.
        warnings.filterwarnings("ignore", "Mixed precision compatibility")
        for name in args.models:
            for policy in args.policies:
                with keras_mp.policy_scope(keras_mp.Policy(policy)):
                    models[name, policy] = build_model(name, args.quick)
    data = {}
    for name, policy in models:
        steps = steps_for(policy, args)
        data[name, steps] = make_data(name, steps, args.quick)
        warmup = make_data(name, 2, args.quick)
        fit_seconds(models[name, policy], warmup, BATCH_SIZES[name])
    step_times = {key: [] for key in models}
    keys = list(models)
    for repeat in range(args.repeats):
        shift = repeat % len(keys)
        for name, policy in keys[shift:] + keys[:shift]:
            steps = steps_for(policy, args)
            seconds = fit_seconds(
                models[name, policy], data[name, steps], BATCH_SIZES[name]
            )
            step_times[name, policy].append(seconds / steps)
    return step_times


def format_table(args, step_times):
    lines = [
        f"backend={keras.backend.backend()} keras={keras.__version__} "
        f"machine={describe_machine()} steps={args.steps} "
        f"float16_steps={args.float16_steps} repeats={args.repeats}",
        f"{'model':<8} {'policy':<15} {'median ms/step':>15} "
        f"{'min ms/step':>12} {'speed-up':>9}",
    ]
    for name in args.models:
        base = None
        if "float32" in args.policies:
            base = statistics.median(step_times[name, "float32"])
        for policy in args.policies:
            times = step_times[name, policy]
            median = statistics.median(times)
            speedup = f"{base / median:.2f}x" if base else "-"
            lines.append(
                f"{name:<8} {policy:<15} {median * 1e3:>15.2f} "
                f"{min(times) * 1e3:>12.2f} {speedup:>9}"
            )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    print(format_table(args, run(args)))


if __name__ == "__main__":
    main()
