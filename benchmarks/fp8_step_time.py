"""Step time of FP8 recipes against mixed_bfloat16 and Keras's float8.

One small causal transformer block (token and position embeddings,
MultiHeadAttention, a feed-forward block, a vocabulary head) trains on
synthetic tokens on the backend named by KERAS_BACKEND, in these variants,
each its own copy of the same model (same seed):

- `mixed_bfloat16`: keras_mp's policy, no FP8;
- `keras_float8`: the same, then Keras's own `model.quantize("float8")`
  on every Dense and EinsumDense but the head (delayed per-tensor scaling,
  fake-quantized matmuls);
- `fp8_<scaling>_<granularity>`: `keras_mp.set_global_policy(
  "mixed_bfloat16", fp8=keras_mp.fp8.Recipe(...))`, whose default rules
  give FP8 GEMMs to the same layers (every Dense and EinsumDense but the
  head).

Every model is compiled and warmed up first; then, in each repeat, every
variant runs `fit` for `--steps` steps, the order rotating between repeats
so that machine load drifts evenly over them. With `--loop train_on_batch`
each repeat is instead `--steps` calls of `train_on_batch` on one batch of
tensors made once: on TensorFlow on a 2-core CPU, `fit`'s input pipeline
puts whole repeats at about 64 ms a step whatever the variant (a
bimodal median), where `train_on_batch` is not. The table shows each
variant's median ms/step and its ratio to mixed_bfloat16 and to
keras_float8 (below 1 is faster), and delayed scaling's to current
scaling's: the median over repeats of the two variants' times in the same
repeat, so that the machine's drift between repeats cancels. On a CPU every
FP8 variant is emulation (FP8 values multiplied in float32 or bfloat16):
these ratios measure the cost of the quantization around the GEMMs, not FP8
GEMM speed, which needs a GPU with FP8 tensor cores.

    python benchmarks/fp8_step_time.py
    KERAS_BACKEND=jax python benchmarks/fp8_step_time.py --repeats 7
    OMP_NUM_THREADS=1 KERAS_BACKEND=torch python benchmarks/fp8_step_time.py
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
from keras_mp.testing import describe_machine

RECIPES = {
    "fp8_current_tensorwise": dict(granularity="tensorwise"),
    "fp8_current_rowwise": dict(granularity="rowwise"),
    "fp8_current_block": dict(granularity="block"),
    "fp8_delayed_tensorwise": dict(scaling="delayed"),
}
VARIANTS = ("mixed_bfloat16", "keras_float8", *RECIPES)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=None,
        help="default: all (with --quick: bfloat16, Keras's float8 and the "
        "tensorwise recipe; the guide's test trains the other recipes)",
    )
    parser.add_argument("--steps", type=int, default=20, help="steps a repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--dim", type=int, default=128, help="model width (a multiple of 128)"
    )
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument(
        "--loop",
        choices=("fit", "train_on_batch"),
        default="fit",
        help="fit: `fit` on NumPy arrays, --steps batches a repeat (the "
        "default); train_on_batch: --steps calls on one batch of tensors "
        "made once, without fit's input pipeline",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="2 steps, 1 repeat, 3 variants: checks that it runs (also "
        "KERAS_MP_QUICK=1)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.seq_len = 2, 1, 16
    if args.variants is None:
        args.variants = VARIANTS[:3] if args.quick else VARIANTS
    for name in ("steps", "repeats", "batch_size", "seq_len", "vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.dim < 128 or args.dim % 128:
        parser.error(
            f"--dim must be a multiple of 128 (the block recipe's tiles). "
            f"Received: --dim {args.dim}"
        )
    return args


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position (no GEMM: the FP8 rules skip it)."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[-2:]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="positions",
        )

    def call(self, inputs):
        return inputs + self.positions


def build_model(args):
    keras.utils.set_random_seed(0)
    layers = keras.layers
    tokens = keras.Input((args.seq_len,), dtype="int32")
    x = layers.Embedding(args.vocab, args.dim, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    attended = layers.MultiHeadAttention(
        num_heads=4, key_dim=args.dim // 4, name="attention"
    )(x, x, use_causal_mask=True)
    x = layers.LayerNormalization(name="norm_1")(x + attended)
    hidden = layers.Dense(4 * args.dim, activation="gelu", name="ffn_in")(x)
    x = layers.LayerNormalization(name="norm_2")(
        x + layers.Dense(args.dim, name="ffn_out")(hidden)
    )
    logits = layers.Dense(args.vocab, name="head", dtype="float32")(x)
    return keras.Model(tokens, logits)


def keras_float8_filter(layer):
    """The layers keras_mp's default FP8 rules pick here: every Dense and
    EinsumDense but the head."""
    gemm = (keras.layers.Dense, keras.layers.EinsumDense)
    return isinstance(layer, gemm) and layer.name != "head"


def fp8_layers(model):
    """Names of the layers whose GEMMs run in FP8 (either kind)."""
    names = []
    for layer in model._flatten_layers(include_self=False):
        policy = layer.dtype_policy
        if getattr(policy, "fp8", None) is not None or (
            policy.quantization_mode == "float8"
        ):
            names.append(layer.name)
    return sorted(names)


def build(variant, args):
    if variant in RECIPES:
        recipe = keras_mp.fp8.Recipe(**RECIPES[variant])
        keras_mp.set_global_policy("mixed_bfloat16", fp8=recipe)
    else:
        keras_mp.set_global_policy("mixed_bfloat16")
    try:
        model = build_model(args)
        if variant == "keras_float8":
            model.quantize("float8", filters=keras_float8_filter)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    finally:
        keras_mp.set_global_policy(None)
    return model


def make_data(args, steps):
    rng = np.random.default_rng(0)
    samples = steps * args.batch_size
    x = rng.integers(0, args.vocab, size=(samples, args.seq_len), dtype="int32")
    return x, np.roll(x, -1, axis=1)


def timed_inputs(args, steps):
    """What one timed call trains on, `(x, y, calls)`: `make_data`'s
    arrays for `fit` (calls None), or for `--loop train_on_batch` its first
    batch as tensors, made once outside the timing, and `steps` calls."""
    x, y = make_data(args, steps)
    if args.loop == "fit":
        return x, y, None
    first = slice(0, args.batch_size)
    tensors = [keras.ops.convert_to_tensor(a[first]) for a in (x, y)]
    return (*tensors, steps)


def repeat_seconds(model, inputs, args):
    """Seconds of one repeat: `fit` on the arrays, or the calls of
    `train_on_batch` (`timed_inputs`)."""
    x, y, calls = inputs
    start = time.perf_counter()
    if calls is not None:
        for _ in range(calls):
            model.train_on_batch(x, y)
    else:
        model.fit(
            x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0
        )
    return time.perf_counter() - start


def run(args):
    """Returns `{variant: [seconds per step, one per repeat]}`."""
    with warnings.catch_warnings():
        # On a CPU the hardware check warns that bfloat16 is emulated.
        warnings.filterwarnings("ignore", "Mixed precision compatibility")
        models = {variant: build(variant, args) for variant in args.variants}
    for variant, model in models.items():
        layers = fp8_layers(model)
        print(f"{variant}: {len(layers)} FP8 layers {layers}")
    data = timed_inputs(args, args.steps)
    warmup = timed_inputs(args, 2)
    for model in models.values():
        repeat_seconds(model, warmup, args)
    step_times = {variant: [] for variant in models}
    keys = list(models)
    for repeat in range(args.repeats):
        shift = repeat % len(keys)
        for variant in keys[shift:] + keys[:shift]:
            seconds = repeat_seconds(models[variant], data, args)
            step_times[variant].append(seconds / args.steps)
    return step_times


def format_table(args, step_times):
    medians = {v: statistics.median(t) for v, t in step_times.items()}
    lines = [
        f"backend={keras.backend.backend()} keras={keras.__version__} "
        f"machine={describe_machine()} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')} "
        f"steps={args.steps} repeats={args.repeats} batch={args.batch_size} "
        f"seq={args.seq_len} dim={args.dim} loop={args.loop}",
        f"{'variant':<24} {'median ms/step':>15} {'min ms/step':>12} "
        f"{'/mixed_bfloat16':>16} {'/keras_float8':>14}",
    ]
    for variant, times in step_times.items():
        ratios = []
        for base in ("mixed_bfloat16", "keras_float8"):
            ratio = paired_ratio(step_times, variant, base)
            ratios.append("-" if ratio is None else f"{ratio:.3f}")
        lines.append(
            f"{variant:<24} {medians[variant] * 1e3:>15.2f} "
            f"{min(times) * 1e3:>12.2f} {ratios[0]:>16} {ratios[1]:>14}"
        )
    for variant in RECIPES:
        ratio = paired_ratio(step_times, variant, "keras_float8")
        if ratio is not None:
            lines.append(f"{variant}/keras_float8 = {ratio:.3f}")
    delayed, current = "fp8_delayed_tensorwise", "fp8_current_tensorwise"
    ratio = paired_ratio(step_times, delayed, current)
    if ratio is not None:
        lines.append(f"{delayed}/{current} = {ratio:.3f} (paired)")
    return "\n".join(lines)


def paired_ratio(step_times, variant, base):
    """The median over repeats of `variant`'s time over `base`'s in the same
    repeat (run back to back, so that the machine's drift cancels), or
    None when `base` did not run."""
    if variant not in step_times or base not in step_times:
        return None
    pairs = zip(step_times[variant], step_times[base], strict=True)
    return statistics.median(mine / theirs for mine, theirs in pairs)


def main(argv=None):
    args = parse_args(argv)
    print(format_table(args, run(args)))


if __name__ == "__main__":
    main()
