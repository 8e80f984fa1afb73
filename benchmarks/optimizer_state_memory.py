"""Optimizer state memory and step time: float32 Adam vs bfloat16 state.

Three variants train the same MLP (512-1024x3-10, batch 64) with Adam on
the backend named by KERAS_BACKEND:

- float32_adam: `keras.optimizers.Adam`, float32 weights (Keras as is);
- bf16_state: `keras_mp.OptimizerWrapper(Adam, state_dtype="bfloat16")`
  (stochastic rounding on, the default), float32 weights;
- bf16_nearest: the same with `stochastic_rounding=False` (round to
  nearest), to show what the random bits cost;
- bf16_params_adam: plain Keras Adam on the model built under
  `keras_mp.Policy("bfloat16")`: its slots follow the bfloat16 weights and
  its math is bfloat16; the baseline that shows what bfloat16 compute
  costs on this machine, apart from the optimizer;
- bf16_state_master: the same with `master_weights=True` and the model
  built under `keras_mp.Policy("bfloat16")` (bfloat16 weights, float32
  masters inside the optimizer);
- float8_state: `OptimizerWrapper(Adam, state_dtype="float8")` (E4M3 codes
  with a float32 scale per block of 128, the second moment stochastically
  rounded), float32 weights; its step time is also given as a ratio to
  bf16_state's.

Printed per variant: bytes of optimizer state per parameter, summed from
the optimizer's actual variables (masters included), and of weights plus
state; the peak memory of one compiled training step where the backend
exposes it (JAX: XLA's `memory_analysis()` of the jitted step; the
TensorFlow and PyTorch CPU runtimes report nothing comparable, which the
table says); and the median `fit` step time with its ratio to
float32_adam. Variants alternate within each repeat, the order rotating:

    KERAS_BACKEND=jax python benchmarks/optimizer_state_memory.py
    KERAS_BACKEND=torch python benchmarks/optimizer_state_memory.py --steps 20
    python benchmarks/optimizer_state_memory.py --variants bf16_state,float8_state
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import statistics
import time
import warnings

import keras
import numpy as np

import keras_mp
from keras_mp.backend import memory
from keras_mp.testing import describe_machine

VARIANTS = (
    "float32_adam",
    "bf16_state",
    "bf16_nearest",
    "bf16_params_adam",
    "bf16_state_master",
    "float8_state",
)
BFLOAT16_MODELS = ("bf16_params_adam", "bf16_state_master")
BATCH_SIZE = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps a repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats")
    parser.add_argument("--width", type=int, default=1024, help="hidden units")
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="width 32, 2 steps, 1 repeat: checks that it runs",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated variants to run (float32_adam always runs)",
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile the TensorFlow step with XLA (JAX always uses XLA)",
    )
    args = parser.parse_args(argv)
    if args.jit_compile and keras.backend.backend() != "tensorflow":
        parser.error("--jit-compile is for the TensorFlow backend")
    chosen = set(args.variants.split(",")) | {"float32_adam"}
    if chosen - set(VARIANTS):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    args.variants = tuple(v for v in VARIANTS if v in chosen)
    if args.quick:
        args.width, args.steps, args.repeats = 32, 2, 1
    for name in ("steps", "repeats", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def build(variant, width, jit_compile=False):
    keras.utils.set_random_seed(0)
    policy = "bfloat16" if variant in BFLOAT16_MODELS else "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "bfloat16 policies train badly"
        with keras_mp.policy_scope(keras_mp.Policy(policy)):
            model = keras.Sequential(
                [keras.Input((512,))]
                + [keras.layers.Dense(width, activation="relu") for _ in "abc"]
                + [keras.layers.Dense(10, dtype="float32")]
            )
    optimizer = keras.optimizers.Adam(1e-3)
    if variant not in ("float32_adam", "bf16_params_adam"):
        optimizer = keras_mp.OptimizerWrapper(
            optimizer,
            state_dtype="float8" if variant == "float8_state" else "bfloat16",
            stochastic_rounding=variant != "bf16_nearest",
            master_weights=variant == "bf16_state_master",
        )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # "auto": XLA on JAX, none on TensorFlow (Keras's default there) and
        # on torch.
        jit_compile=True if jit_compile else "auto",
    )
    return model


def make_data(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH_SIZE, 512)).astype("float32")
    y = rng.integers(0, 10, size=(steps * BATCH_SIZE,)).astype("int32")
    return x, y


def nbytes(variables):
    return sum(
        int(np.prod(v.shape)) * np.dtype(_numpy_dtype(v.dtype)).itemsize
        for v in variables
    )


def _numpy_dtype(dtype):
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype


def fit_seconds(model, data):
    x, y = data
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def run(args):
    models = {
        variant: build(variant, args.width, args.jit_compile)
        for variant in args.variants
    }
    data = make_data(args.steps)
    warmup = make_data(2)
    rows = {}
    x0, y0 = warmup[0][:BATCH_SIZE], warmup[1][:BATCH_SIZE]
    for variant, model in models.items():
        fit_seconds(model, warmup)  # builds the optimizer, compiles the step
        params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        state = nbytes(model.optimizer.variables)
        weights = nbytes(model.trainable_variables)
        peak, detail = memory.train_step_memory(model, x0, y0)
        rows[variant] = {
            "params": params,
            "state": state / params,
            "total": (state + weights) / params,
            "peak": peak,
            "detail": detail,
            "times": [],
        }
    variants = args.variants
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            seconds = fit_seconds(models[variant], data)
            rows[variant]["times"].append(seconds / args.steps)
    return rows


def format_table(args, rows):
    base = rows["float32_adam"]
    base_time = statistics.median(base["times"])
    lines = [
        f"backend={keras.backend.backend()} keras={keras.__version__} "
        f"machine={describe_machine()} params={base['params']} "
        f"batch={BATCH_SIZE} steps={args.steps} repeats={args.repeats} "
        f"xla={args.jit_compile or keras.backend.backend() == 'jax'}",
        f"{'variant':<18} {'state B/param':>13} {'state/f32':>9} "
        f"{'w+state B/param':>15} {'peak step MB':>12} {'ms/step':>8} "
        f"{'time/f32':>8}",
    ]
    for variant in args.variants:
        row = rows[variant]
        median = statistics.median(row["times"])
        peak = "-" if row["peak"] is None else f"{row['peak'] / 2**20:.1f}"
        lines.append(
            f"{variant:<18} {row['state']:>13.2f} "
            f"{row['state'] / base['state']:>9.3f} {row['total']:>15.2f} "
            f"{peak:>12} {median * 1e3:>8.2f} {median / base_time:>8.3f}"
        )
    for variant in args.variants[1:]:
        row = rows[variant]
        lines.append(
            f"{variant}: state/f32 = {row['state'] / base['state']:.3f}, "
            "time/f32 = "
            f"{statistics.median(row['times']) / base_time:.3f}"
        )
    if "float8_state" in rows and "bf16_state" in rows:
        ratio = statistics.median(rows["float8_state"]["times"]) / (
            statistics.median(rows["bf16_state"]["times"])
        )
        lines.append(f"float8_state: time/bf16_state = {ratio:.3f}")
    for variant in args.variants:
        lines.append(f"peak memory of {variant}: {rows[variant]['detail']}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    print(format_table(args, run(args)))


if __name__ == "__main__":
    main()
