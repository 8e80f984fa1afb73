"""Step time of `fit` with a gradient transform chain, next to Keras built-ins.

Three optimizers do the same math on the same MLP, data and initial weights,
on the backend named by KERAS_BACKEND, under the mixed_bfloat16 policy
(float16 matmuls are emulated, and very slow, on CPUs):

- keras: `keras.optimizers.Adam(lr, weight_decay=wd, global_clipnorm=c)`;
- wrapper: `keras_mp.OptimizerWrapper(keras.optimizers.Adam(lr),
  transform_gradients=[ClipByGlobalNorm(c), DecoupledWeightDecay(wd),
  ReplaceNonFinite()])`;
- loss_scale: the same chain in `keras_mp.LossScaleOptimizer` with a dynamic
  loss scale (2**15, growth every 2000 steps, so it never moves here).

Keras clips the gradients first, then decays the weights, then runs Adam's
update; the chain does the same in the same order. `ReplaceNonFinite` is the
identity on the finite gradients of this benchmark: it stands for the
transforms a chain adds beyond Keras's built-ins, and is real work, a few
elementwise passes over every gradient (`--identity-transform
clip_by_value` takes `ClipByValue(1e30)`, one pass, instead). On TensorFlow
without XLA, the default on CPUs, every op runs as a kernel of its own and
those passes show in the step time; XLA (on JAX, or `--jit-compile true`)
fuses them into the update.

Before timing, the script checks that the three compute the same update:
float32 copies of the model train for `--check-steps` steps with each
optimizer, and it prints the largest absolute difference of their weights
from the keras variant's (and exits with an error above 1e-5). The check
runs in float32 because the optimizers' math is float32 under either policy
(float32 variables and gradients), while under mixed_bfloat16 a last-bit
difference in a float32 weight (from a different fusion of the same update)
can change its bfloat16 copy by a whole bfloat16 step, so trajectories drift
apart after a few steps whatever the optimizer. That drift is printed too,
for the timed mixed_bfloat16 models after the warm-up.

Then, after `--warmup-steps` untimed steps, every repeat runs `fit` for
`--steps` steps on each variant, the order rotating between repeats so that
machine load drifts evenly over the three. A callback records the wall and
process CPU time between consecutive batch ends (a steady-state step,
without `fit`'s setup); a repeat's step time is the median over its steps.
The table shows the median over repeats; the ratios are the medians of each
repeat's ratio (its variants ran back to back). CPU time is the steadier
figure on a machine shared with other work.

    KERAS_BACKEND=jax python benchmarks/transform_chain_overhead.py
    KERAS_BACKEND=tensorflow python benchmarks/transform_chain_overhead.py \\
        --steps 100 --repeats 9
    python benchmarks/transform_chain_overhead.py --steps 2 --repeats 1  # CI
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import statistics
import time
import warnings

import keras
import numpy as np

import keras_mp

VARIANTS = ("keras", "wrapper", "loss_scale")
INITIAL_SCALE = 2.0**15
GROWTH_STEPS = 2000
# Transforms that leave this benchmark's finite gradients unchanged.
IDENTITY_TRANSFORMS = {
    "replace_non_finite": keras_mp.transforms.ReplaceNonFinite,
    # Far above any gradient element here.
    "clip_by_value": lambda: keras_mp.transforms.ClipByValue(1e30),
}
# Above this, the variants do not compute the same update.
SAME_MATH_TOLERANCE = 1e-5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="steps a repeat")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats")
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="untimed steps first"
    )
    parser.add_argument(
        "--check-steps",
        type=int,
        default=5,
        help="steps of the same-weights check, in float32",
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--clip-norm", type=float, default=0.5)
    parser.add_argument(
        "--identity-transform",
        choices=sorted(IDENTITY_TRANSFORMS),
        default="replace_non_finite",
        help="the chain's third transform, the identity on these gradients",
    )
    parser.add_argument(
        "--jit-compile",
        choices=("auto", "true", "false"),
        default="auto",
        help="`compile(jit_compile=...)`; auto leaves XLA off on CPU TF",
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(
            "--steps must be at least 2 (a step is a batch-to-batch gap)"
        )
    for name in ("repeats", "check_steps", "batch_size", "hidden", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must be at least 0")
    args.jit_compile = {"auto": "auto", "true": True, "false": False}[
        args.jit_compile
    ]
    return args


def make_optimizer(variant, args):
    if variant == "keras":
        return keras.optimizers.Adam(
            args.learning_rate,
            weight_decay=args.weight_decay,
            global_clipnorm=args.clip_norm,
        )
    chain = [
        keras_mp.transforms.ClipByGlobalNorm(args.clip_norm),
        keras_mp.transforms.DecoupledWeightDecay(args.weight_decay),
        IDENTITY_TRANSFORMS[args.identity_transform](),
    ]
    inner = keras.optimizers.Adam(args.learning_rate)
    if variant == "wrapper":
        return keras_mp.OptimizerWrapper(inner, transform_gradients=chain)
    return keras_mp.LossScaleOptimizer(
        inner,
        loss_scale=keras_mp.DynamicLossScale(
            INITIAL_SCALE, increment_period=GROWTH_STEPS
        ),
        transform_gradients=chain,
    )


def build_model(args, variant):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((args.features,))]
    layers += [
        keras.layers.Dense(args.hidden, activation="relu")
        for _ in range(args.layers)
    ]
    layers += [
        keras.layers.Dense(args.classes),
        # float32 logits: the loss's softmax runs in float32.
        keras.layers.Activation("linear", dtype="float32"),
    ]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=make_optimizer(variant, args),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=args.jit_compile,
    )
    return model


def make_data(args, steps, seed):
    rng = np.random.default_rng(seed)
    samples = steps * args.batch_size
    x = rng.normal(size=(samples, args.features)).astype("float32")
    y = rng.integers(0, args.classes, size=(samples,)).astype("int32")
    return x, y


class StepTimer(keras.callbacks.Callback):
    """Wall and CPU seconds between consecutive batch ends of one `fit`.

    Overriding `on_train_batch_end` also turns off Keras's asynchronous
    callback dispatch, and the logs are read back each step, so each gap
    is a finished step.
    """

    def on_train_begin(self, logs=None):
        self.marks = []

    def on_train_batch_end(self, batch, logs=None):
        self.marks.append((time.perf_counter(), time.process_time()))

    def step_times(self):
        """`(median wall, median cpu)` seconds of the steps after the first."""
        gaps = [
            (wall - wall0, cpu - cpu0)
            for (wall0, cpu0), (wall, cpu) in zip(self.marks, self.marks[1:])
        ]
        return (
            statistics.median(g[0] for g in gaps),
            statistics.median(g[1] for g in gaps),
        )


def fit(model, data, batch_size, callbacks=()):
    x, y = data
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def max_differences(models):
    """Per variant, the largest absolute weight difference from keras."""
    reference = [keras.ops.convert_to_numpy(w) for w in models["keras"].weights]
    differences = {}
    for variant in VARIANTS[1:]:
        weights = [
            keras.ops.convert_to_numpy(w) for w in models[variant].weights
        ]
        differences[variant] = max(
            float(np.max(np.abs(w - r))) for w, r in zip(weights, reference)
        )
    return differences


def check_same_math(args):
    """Trains float32 copies with each optimizer; see the module docstring.

    Returns:
        `(moved, differences)`: how far the keras variant's weights moved
        from their initial values (to put the differences in proportion),
        and `max_differences` of the trained copies.
    """
    with keras_mp.policy_scope("float32"):
        models = {variant: build_model(args, variant) for variant in VARIANTS}
    initial = [keras.ops.convert_to_numpy(w) for w in models["keras"].weights]
    data = make_data(args, args.check_steps, seed=1)
    for model in models.values():
        fit(model, data, args.batch_size)
    moved = max(
        float(np.max(np.abs(keras.ops.convert_to_numpy(w) - i)))
        for w, i in zip(models["keras"].weights, initial)
    )
    return moved, max_differences(models)


def run(args):
    """Checks the math, then times the variants.

    Returns:
        A dict: `moved` and `differences` from `check_same_math`,
        `drift` (`max_differences` of the timed models after the warm-up,
        or None without one) and `step_times`,
        `{variant: [(wall, cpu) seconds per step, one pair a repeat]}`.
    """
    moved, differences = check_same_math(args)
    with warnings.catch_warnings():
        # On a CPU the hardware check warns that bfloat16 may be slow there.
        warnings.filterwarnings("ignore", "Mixed precision compatibility")
        keras_mp.set_global_policy("mixed_bfloat16")
    models = {variant: build_model(args, variant) for variant in VARIANTS}
    drift = None
    if args.warmup_steps:
        warmup = make_data(args, args.warmup_steps, seed=2)
        for model in models.values():
            fit(model, warmup, args.batch_size)
        drift = max_differences(models)
    timed = make_data(args, args.steps, seed=3)
    timer = StepTimer()
    step_times = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        shift = repeat % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            fit(models[variant], timed, args.batch_size, [timer])
            step_times[variant].append(timer.step_times())
    skipped = keras.ops.convert_to_numpy(
        models["loss_scale"].optimizer.skipped_steps
    )
    if int(skipped):
        raise RuntimeError(
            f"The loss_scale variant skipped {int(skipped)} steps (an "
            "overflow), so its steps were not comparable."
        )
    return {
        "moved": moved,
        "differences": differences,
        "drift": drift,
        "step_times": step_times,
    }


def format_report(args, result):
    step_times = result["step_times"]

    def median(variant, column):
        return statistics.median(t[column] for t in step_times[variant])

    wall = {v: median(v, 0) for v in VARIANTS}
    cpu = {v: median(v, 1) for v in VARIANTS}
    lines = [
        f"backend={keras.backend.backend()} keras={keras.__version__} "
        f"policy=mixed_bfloat16 jit_compile={args.jit_compile} "
        f"identity_transform={args.identity_transform} "
        f"mlp={args.features}-{'x'.join([str(args.hidden)] * args.layers)}-"
        f"{args.classes} batch={args.batch_size} steps={args.steps} "
        f"repeats={args.repeats}",
        f"same math, float32, {args.check_steps} steps (weights moved up to "
        f"{result['moved']:.3g}): max |w - w_keras| "
        + ", ".join(f"{v}={d:.3g}" for v, d in result["differences"].items()),
        f"{'variant':<11} {'median wall ms/step':>20} {'min wall':>9} "
        f"{'median cpu ms/step':>19}",
    ]
    if result["drift"] is not None:
        lines.insert(
            2,
            f"mixed_bfloat16 drift after {args.warmup_steps} warm-up steps "
            "(informational): max |w - w_keras| "
            + ", ".join(f"{v}={d:.3g}" for v, d in result["drift"].items()),
        )
    for variant in VARIANTS:
        fastest = min(t[0] for t in step_times[variant])
        lines.append(
            f"{variant:<11} {wall[variant] * 1e3:>20.3f} "
            f"{fastest * 1e3:>9.3f} {cpu[variant] * 1e3:>19.3f}"
        )
    for column, name in enumerate(("wall", "cpu")):

        def ratio(variant, column=column):
            # Paired: each repeat's variants ran back to back.
            return statistics.median(
                t[column] / k[column]
                for t, k in zip(step_times[variant], step_times["keras"])
            )

        lines.append(
            f"ratio ({name}, median over repeats): wrapper/keras = "
            f"{ratio('wrapper'):.3f} (target <= 1.05)   "
            f"loss_scale/keras = {ratio('loss_scale'):.3f}"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    print(format_report(args, result))
    worst = max(result["differences"].values())
    if not worst <= SAME_MATH_TOLERANCE:
        raise SystemExit(
            f"The variants reached different weights (max difference "
            f"{worst:.3g} > {SAME_MATH_TOLERANCE:g}): the timings would not "
            "compare the same math."
        )


if __name__ == "__main__":
    main()
