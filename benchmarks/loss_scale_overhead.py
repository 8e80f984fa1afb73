"""Step time of `fit` with and without loss scaling, keras_mp next to Keras.

Three variants of the same MLP train on the same data from the same initial
weights, on the backend named by KERAS_BACKEND:

- plain: the inner optimizer (Adam) alone, no loss scaling;
- keras: `keras.optimizers.LossScaleOptimizer(Adam)`;
- keras_mp: `keras_mp.LossScaleOptimizer(Adam)`;
- keras_mp_device (PyTorch only): `keras_mp.LossScaleOptimizer(Adam,
  skip_on_device=True)`, the opt-in skip with no host read: with Keras's
  Adam, torch's fused AdamW kernel skipping on a device flag (with other
  optimizers every weight and slot is saved before the in-place update and
  selected after it);
- barrier (under XLA only: JAX, or TensorFlow with `--jit-compile`): the
  inner optimizer alone, its update made to wait for every gradient (an XLA
  optimization barrier over all of them), and nothing else.

The barrier variant is the floor of any skip that keeps weights and slots
bit for bit: the decision depends on every gradient, so no variable may be
updated before the last gradient is computed and checked, while a plain
step updates each variable as soon as its own gradient exists (still in
cache, overlapping the rest of the backward pass). keras_mp/barrier is
what keras_mp adds over that floor (the finite check, the conditional, the
scale update); barrier/plain is what the floor itself costs.

Both wrappers get the same explicit dynamic loss scale (2**15, growth every
2000 steps). The policy defaults to mixed_bfloat16 because float16 matmuls
are emulated, and very slow, on CPUs: the wrappers then pay exactly what loss
scaling adds to a step (scale the loss, unscale the gradients, the finite
check, the conditional update, the scale update) on top of the same model.

Each variant is compiled and warmed up first. Then, in every repeat, each
variant runs `fit` for `--steps` steps (the order rotating between
repeats, so that machine load drifts evenly over the three); the step time
of a repeat is its `fit` time divided by the steps, and the table shows the
median over repeats, of wall time and of this process's CPU time (the
steadier figure on a machine shared with other work). Each ratio is given
as the ratio of the medians and, steadier under a drifting load, as the
median of the ratios within each repeat ("paired").

On PyTorch, whose `fit` runs eagerly, it also counts the host syncs each
variant's optimizer makes per step (tensors converted to Python values,
which make a GPU step wait for the host; see
`keras_mp.testing.count_host_syncs`): Keras's LossScaleOptimizer decides
the skip with a Python `if` on the device's flag, as keras_mp does by
default after one fused check-and-unscale pass; keras_mp_device decides it
on the device:

    KERAS_BACKEND=jax python benchmarks/loss_scale_overhead.py
    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/loss_scale_overhead.py
    KERAS_BACKEND=tensorflow python benchmarks/loss_scale_overhead.py \\
        --steps 200 --repeats 7 [--jit-compile]

`--jit-compile` compiles the TensorFlow step with XLA (Keras's default on
a CPU-only machine is no XLA; JAX always compiles with XLA).
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import collections
import statistics
import time

import keras
import numpy as np

import keras_mp
from keras_mp.testing import count_host_syncs

BASE_VARIANTS = ("plain", "keras", "keras_mp")
BASE_RATIOS = (
    ("keras_mp", "plain"),
    ("keras_mp", "keras"),
    ("keras", "plain"),
)
DEVICE_RATIOS = (
    ("keras_mp_device", "plain"),
    ("keras_mp_device", "keras"),
)
BARRIER_RATIOS = (("keras_mp", "barrier"), ("barrier", "plain"))
INITIAL_SCALE = 2.0**15
GROWTH_STEPS = 2000


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
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument(
        "--policy",
        default="mixed_bfloat16",
        choices=("mixed_bfloat16", "mixed_float16", "float32"),
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile the TensorFlow step with XLA (JAX always uses XLA)",
    )
    args = parser.parse_args(argv)
    if args.jit_compile and keras.backend.backend() != "tensorflow":
        parser.error(
            "--jit-compile is for the TensorFlow backend (JAX always uses "
            f"XLA). Received it with KERAS_BACKEND={keras.backend.backend()}."
        )
    for name in ("steps", "repeats", "batch_size", "hidden", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def variants(args):
    """The variants this backend runs: `barrier` needs XLA; the opt-in
    skip on the device changes nothing off PyTorch."""
    if uses_xla(args):
        return BASE_VARIANTS + ("barrier",)
    if keras.backend.backend() == "torch":
        return BASE_VARIANTS + ("keras_mp_device",)
    return BASE_VARIANTS


def ratios(args):
    if uses_xla(args):
        return BASE_RATIOS + BARRIER_RATIOS
    if keras.backend.backend() == "torch":
        return BASE_RATIOS + DEVICE_RATIOS
    return BASE_RATIOS


def uses_xla(args):
    backend = keras.backend.backend()
    return backend == "jax" or (backend == "tensorflow" and args.jit_compile)


class BarrierAdam(keras.optimizers.Adam):
    """Adam whose update starts only once every gradient is computed."""

    def apply(self, grads, trainable_variables=None):
        return super().apply(optimization_barrier(grads), trainable_variables)


def optimization_barrier(grads):
    """`grads`, each available only once all of them are (XLA only)."""
    if keras.backend.backend() == "jax":
        import jax

        return list(jax.lax.optimization_barrier(list(grads)))
    from tensorflow.compiler.tf2xla.python import xla

    return list(xla.optimization_barrier(*grads))


def make_optimizer(variant):
    if variant == "barrier":
        return BarrierAdam(1e-3)
    inner = keras.optimizers.Adam(1e-3)
    if variant == "plain":
        return inner
    if variant == "keras":
        return keras.optimizers.LossScaleOptimizer(
            inner,
            initial_scale=INITIAL_SCALE,
            dynamic_growth_steps=GROWTH_STEPS,
        )
    return keras_mp.LossScaleOptimizer(
        inner,
        loss_scale=keras_mp.DynamicLossScale(
            INITIAL_SCALE, increment_period=GROWTH_STEPS
        ),
        skip_on_device=variant == "keras_mp_device",
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
        optimizer=make_optimizer(variant),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # "auto" means XLA on JAX and none on TensorFlow (Keras's default
        # there, and on torch, which has no XLA).
        jit_compile=True if args.jit_compile else "auto",
    )
    return model


def make_data(args, steps):
    rng = np.random.default_rng(0)
    samples = steps * args.batch_size
    x = rng.normal(size=(samples, args.features)).astype("float32")
    y = rng.integers(0, args.classes, size=(samples,)).astype("int32")
    return x, y


def fit_seconds(model, data, batch_size):
    """Wall and process CPU seconds of one epoch of `fit` over `data`."""
    x, y = data
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - wall, time.process_time() - cpu


def optimizer_host_syncs(model, data, batch_size):
    """Host syncs per step inside `model.optimizer.apply` during `fit`."""
    x, y = data
    steps = len(x) // batch_size
    counts = collections.Counter()
    optimizer = model.optimizer
    apply = optimizer.apply

    def counting_apply(*args, **kwargs):
        with count_host_syncs() as syncs:
            result = apply(*args, **kwargs)
        counts.update(syncs)
        return result

    optimizer.apply = counting_apply
    try:
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    finally:
        del optimizer.apply
    return sum(counts.values()) / steps


def run(args):
    """Times the variants.

    Returns:
        `({variant: [(wall, cpu) seconds per step, one pair a repeat]},
        {variant: host syncs per optimizer step} on torch, else None)`.
    """
    # No policy loss scale: `compile` must leave the plain variant unwrapped.
    keras_mp.set_global_policy(keras_mp.Policy(args.policy, loss_scale=None))
    names = variants(args)
    models = {variant: build_model(args, variant) for variant in names}
    warmup = make_data(args, max(args.warmup_steps, 1))
    timed = make_data(args, args.steps)
    for model in models.values():
        fit_seconds(model, warmup, args.batch_size)
    syncs = None
    if keras.backend.backend() == "torch":
        syncs = {
            variant: optimizer_host_syncs(model, warmup, args.batch_size)
            for variant, model in models.items()
        }
    step_times = {variant: [] for variant in names}
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for variant in names[shift:] + names[:shift]:
            wall, cpu = fit_seconds(models[variant], timed, args.batch_size)
            step_times[variant].append((wall / args.steps, cpu / args.steps))
    for variant in names:
        optimizer = models[variant].optimizer
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            continue
        scale = float(keras.ops.convert_to_numpy(optimizer.scale_loss(1.0)))
        if scale != INITIAL_SCALE:
            raise RuntimeError(
                f"The {variant} loss scale moved to {scale} during the "
                "benchmark (an overflow), so its steps were not comparable."
            )
    return step_times, syncs


def format_table(args, step_times, syncs=None):
    def median(variant, column):
        return statistics.median(t[column] for t in step_times[variant])

    names = list(step_times)
    wall = {v: median(v, 0) for v in names}
    cpu = {v: median(v, 1) for v in names}
    lines = [
        f"backend={keras.backend.backend()} policy={args.policy} "
        f"mlp={args.features}-{'x'.join([str(args.hidden)] * args.layers)}-"
        f"{args.classes} batch={args.batch_size} steps={args.steps} "
        f"repeats={args.repeats} "
        f"xla={args.jit_compile or keras.backend.backend() == 'jax'}",
        f"{'variant':<16} {'median wall ms/step':>20} {'min wall':>9} "
        f"{'median cpu ms/step':>19}",
    ]
    for variant in names:
        fastest = min(t[0] for t in step_times[variant])
        lines.append(
            f"{variant:<16} {wall[variant] * 1e3:>20.3f} {fastest * 1e3:>9.3f} "
            f"{cpu[variant] * 1e3:>19.3f}"
        )
    lines.append(
        f"{'ratio':<22} {'wall':>7} {'paired':>7} {'cpu':>7} {'paired':>7}"
    )
    for numerator, denominator in ratios(args):
        figures = []
        for column, medians in ((0, wall), (1, cpu)):
            figures.append(medians[numerator] / medians[denominator])
            figures.append(
                statistics.median(
                    a[column] / b[column]
                    for a, b in zip(
                        step_times[numerator], step_times[denominator]
                    )
                )
            )
        lines.append(
            f"{numerator + '/' + denominator:<22} "
            + " ".join(f"{figure:>7.3f}" for figure in figures)
        )
    if syncs is not None:
        lines.append("host syncs per optimizer step (torch)")
        for variant in names:
            lines.append(f"{variant + '-syncs':<22} {syncs[variant]:>7.2f}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    print(format_table(args, *run(args)))


if __name__ == "__main__":
    main()
