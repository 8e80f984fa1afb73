"""Step time of `fit` with plain Adam and with the skip without a loss scale.

Three optimizers train the same MLP on the same data from the same initial
weights, on the backend named by KERAS_BACKEND: `plain`, Keras's Adam as
`compile` leaves it under `set_global_policy(policy, skip_nonfinite=False)`;
`skip`, what `compile` makes of it under `skip_nonfinite=True` (the default
under FP8 recipes): `keras_mp.LossScaleOptimizer(Adam, loss_scale=1,
skip_nonfinite=True, track_overflow=True)`, with `fit`'s check of
`max_consecutive_skips` at the end of each batch; and `skip_unchecked`, the
same with `max_consecutive_skips=None` (no per-batch check). On PyTorch a
fourth, `check_only`, is the least an exact skip can cost there: `plain`'s
Adam with its `apply` preceded by torch.amp's fused finite check of the
gradients and one host read of the flag, nothing else (no wrapper, no
counters); the gap between it and `skip` is keras_mp's own. Each is
compiled and warmed up first; then in every repeat each runs `fit` for
`--steps` steps, the order rotating between repeats. The table shows median
wall and process-CPU milliseconds per step and each variant's ratio to
plain, as the ratio of medians and as the median of the per-repeat ratios
("paired", steadier on a loaded machine):

    KERAS_BACKEND=jax python benchmarks/skip_nonfinite_overhead.py
    KERAS_BACKEND=tensorflow python benchmarks/skip_nonfinite_overhead.py
"""

import argparse
import platform
import statistics
import time

import keras
import numpy as np

import keras_mp

VARIANTS = ("plain", "skip", "skip_unchecked")
# Variants that run on PyTorch only.
TORCH_VARIANTS = ("check_only",)


def variants():
    """The variants of this backend."""
    if keras.backend.backend() == "torch":
        return VARIANTS + TORCH_VARIANTS
    return VARIANTS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps a repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats")
    parser.add_argument(
        "--warmup-steps", type=int, default=20, help="untimed steps first"
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument(
        "--policy",
        default="mixed_bfloat16",
        choices=("mixed_bfloat16", "float32"),
    )
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "batch_size", "hidden", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def build_model(args, variant):
    skips = variant in ("skip", "skip_unchecked")
    keras_mp.set_global_policy(args.policy, skip_nonfinite=skips)
    keras.utils.set_random_seed(0)
    layers = [keras.Input((args.features,))]
    layers += [
        keras.layers.Dense(args.hidden, activation="relu")
        for _ in range(args.layers)
    ]
    layers += [keras.layers.Dense(10, dtype="float32")]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    wrapped = isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    if wrapped != skips:
        raise AssertionError(f"{variant}: compile gave {model.optimizer!r}")
    if variant == "skip_unchecked":
        model.optimizer.max_consecutive_skips = None
    if variant == "check_only":
        check_before_apply(model.optimizer)
        skips_a_nan_batch(model, args)
    return model


def skips_a_nan_batch(model, args):
    """Raises unless a batch of NaN inputs leaves every weight's bits."""
    x = np.full((args.batch_size, args.features), np.nan, "float32")
    y = np.zeros((args.batch_size,), "int32")
    before = [np.array(w) for w in model.get_weights()]
    model.train_on_batch(x, y)
    after = model.get_weights()
    if any(a.tobytes() != b.tobytes() for a, b in zip(before, after)):
        raise AssertionError("check_only applied a step with NaN gradients")


def check_before_apply(optimizer):
    """Makes PyTorch `optimizer.apply` skip a step with a non-finite
    gradient: torch.amp's fused check (`GradScaler.unscale_`'s kernel, at
    an inverse scale of 1, in place on `fit`'s gradients, the variables'
    `.grad`, as `LossScaleOptimizer` checks them) and one host read: the
    skip of `LossScaleOptimizer` on PyTorch without its pipeline."""
    import torch

    apply = optimizer.apply
    one = torch.ones(1)

    def checked_apply(grads, trainable_variables=None):
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(
            list(grads), found, one
        )
        if not bool(found):
            apply(grads, trainable_variables)

    optimizer.apply = checked_apply


def make_data(args, steps):
    rng = np.random.default_rng(0)
    samples = steps * args.batch_size
    x = rng.normal(size=(samples, args.features)).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    return x, y


def fit_seconds(model, data, batch_size):
    x, y = data
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        log_loss_scale=False,
    )
    return time.perf_counter() - wall, time.process_time() - cpu


def run(args):
    names = variants()
    models = {variant: build_model(args, variant) for variant in names}
    keras_mp.set_global_policy(None)
    warmup = make_data(args, max(args.warmup_steps, 1))
    timed = make_data(args, args.steps)
    for model in models.values():
        fit_seconds(model, warmup, args.batch_size)
    step_times = {variant: [] for variant in names}
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for variant in names[shift:] + names[:shift]:
            wall, cpu = fit_seconds(models[variant], timed, args.batch_size)
            step_times[variant].append((wall / args.steps, cpu / args.steps))
    return step_times


def format_table(args, step_times):
    lines = [
        f"machine={platform.processor() or platform.machine()} "
        f"backend={keras.backend.backend()} policy={args.policy} "
        f"mlp={args.features}-{'x'.join([str(args.hidden)] * args.layers)}-10 "
        f"batch={args.batch_size} steps={args.steps} repeats={args.repeats}",
        f"{'variant':<15} {'median wall ms/step':>20} {'median cpu ms/step':>19}",
    ]
    medians = {}
    for variant in step_times:
        medians[variant] = [
            statistics.median(t[column] for t in step_times[variant])
            for column in (0, 1)
        ]
        lines.append(
            f"{variant:<15} {medians[variant][0] * 1e3:>20.3f} "
            f"{medians[variant][1] * 1e3:>19.3f}"
        )
    lines.append(
        f"{'ratio':<21} {'wall':>7} {'paired':>7} {'cpu':>7} {'paired':>7}"
    )
    for variant in list(step_times)[1:]:
        figures = []
        for column in (0, 1):
            figures.append(medians[variant][column] / medians["plain"][column])
            figures.append(
                statistics.median(
                    a[column] / b[column]
                    for a, b in zip(step_times[variant], step_times["plain"])
                )
            )
        lines.append(
            f"{variant + '/plain':<21} "
            + " ".join(f"{f:>7.3f}" for f in figures)
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    print(format_table(args, run(args)))


if __name__ == "__main__":
    main()
