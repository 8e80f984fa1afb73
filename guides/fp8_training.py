"""Guide: FP8 training on every backend.

FP8 (8-bit floats: E4M3 with 3 mantissa bits, E5M2 with 2) halves the bytes
of bfloat16 GEMM operands and, on GPUs with FP8 tensor cores (H100 and
later), doubles their throughput. keras_mp makes FP8 a precision of the
policy, like bfloat16: a layer whose policy carries a `keras_mp.fp8.Recipe`
computes its GEMM (forward, input gradient and kernel gradient) on FP8
operands with float32 accumulation, on TensorFlow, JAX and PyTorch alike.
This guide trains a small causal transformer on synthetic tokens and shows,
in order:

1. turning FP8 on with `set_global_policy(..., fp8=...)`, and which layers
   the default rules give it (`explain_precision`);
2. the loss of each recipe against mixed_bfloat16 on the same seed, with a
   PNG of the loss curves, and `keras_mp.fp8.report`: what each FP8 layer's
   input, kernel and output gradient looked like in the last step;
3. what granularity buys: one outlier channel 1000x the others, and the
   error of each recipe's GEMM;
4. `fp8.quantize`, the building block: codes, scales, and why inf and NaN
   are never clipped into range;
5. LoRA on FP8 layers: the frozen kernel's GEMM in FP8, the low-rank path
   in the compute dtype.

On a CPU the FP8 GEMMs are emulated (FP8 codes multiplied in float32,
exactly): the numbers below are FP8's numerics, not its speed
(benchmarks/fp8_step_time.py measures the step time).

Run it (about 2 minutes on 2 CPU cores; `--quick` or KERAS_MP_QUICK=1 for
20 steps a run):

    python guides/fp8_training.py --plot /tmp/fp8_loss.png
    KERAS_BACKEND=jax python guides/fp8_training.py
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import pathlib
import warnings

import keras
import numpy as np

import keras_mp

DEFAULT_PLOT = pathlib.Path(__file__).parent / "_output" / "fp8_loss.png"
VOCAB = 64
SEQ_LEN = 32
DIM = 128  # a multiple of 128: the "block" recipe's tiles
BATCH_SIZE = 32


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", type=pathlib.Path, default=DEFAULT_PLOT)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    return args


# ## The data and the model
#
# Tokens follow a fixed bigram chain: each token has a few likely
# successors, so the best possible loss is the chain's entropy, and a model
# that learns the table gets close to it. The model is one transformer
# block (causal MultiHeadAttention, a feed-forward block) with a vocabulary
# head, as in any decoder.


def bigram_table(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.5, size=(VOCAB, VOCAB))
    table = np.exp(logits - logits.max(axis=1, keepdims=True))
    return table / table.sum(axis=1, keepdims=True)


def make_tokens(table, sequences, seed):
    rng = np.random.default_rng(seed)
    tokens = np.empty((sequences, SEQ_LEN + 1), dtype="int32")
    tokens[:, 0] = rng.integers(0, VOCAB, size=sequences)
    cumulative = np.cumsum(table, axis=1)
    for t in range(1, SEQ_LEN + 1):
        draws = rng.random(sequences)[:, None]
        rows = cumulative[tokens[:, t - 1]]
        tokens[:, t] = np.minimum((draws > rows).sum(axis=1), VOCAB - 1)
    return tokens[:, :-1], tokens[:, 1:]


def entropy(table):
    """The chain's entropy in nats: the loss of a perfect model."""
    stationary = np.full(VOCAB, 1 / VOCAB)
    for _ in range(200):
        stationary = stationary @ table
    return float(-(stationary[:, None] * table * np.log(table)).sum())


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


def build_model():
    keras.utils.set_random_seed(0)
    layers = keras.layers
    tokens = keras.Input((SEQ_LEN,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, DIM, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    attended = layers.MultiHeadAttention(
        num_heads=4, key_dim=DIM // 4, name="attention"
    )(x, x, use_causal_mask=True)
    x = layers.LayerNormalization(name="norm_1")(x + attended)
    hidden = layers.Dense(4 * DIM, activation="gelu", name="ffn_in")(x)
    hidden = layers.Dense(DIM, name="ffn_out")(hidden)
    x = layers.LayerNormalization(name="norm_2")(x + hidden)
    logits = layers.Dense(VOCAB, name="head")(x)
    return keras.Model(tokens, logits, name="decoder")


class BatchLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train(recipe, train_data, eval_data, steps):
    """Trains the model under mixed_bfloat16 (with `recipe`'s FP8 GEMMs
    where the default rules put them); returns (model, per-step losses,
    eval loss)."""
    keras_mp.set_global_policy("mixed_bfloat16", fp8=recipe)
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = train_data
    losses = BatchLosses()
    model.fit(
        x[: steps * BATCH_SIZE],
        y[: steps * BATCH_SIZE],
        batch_size=BATCH_SIZE,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[losses],
    )
    eval_loss = model.evaluate(*eval_data, batch_size=256, verbose=0)
    return model, losses.losses, float(eval_loss)


# ## 1. Turning FP8 on
#
# `set_global_policy("mixed_bfloat16", fp8=recipe)` sets the policy for
# every layer, and gives the recipe to the layers `keras_mp.fp8.DEFAULT_RULES`
# picks: every Dense and EinsumDense (MultiHeadAttention's query, key, value
# and output projections are EinsumDense) whose GEMM dimensions are
# multiples of 16 (128 for "block"), but not the model's output layer (the
# logits decide the loss) nor embeddings (a lookup, not a GEMM).
# `explain_precision` says, for each layer, which recipe it runs or why it
# has none. `fp8=True` is the default recipe: current scaling (each scale
# from this step's amax, no state), one scale per tensor, E4M3 forward and
# E5M2 for output gradients.

#
# `stats=True` (the tensorwise run below) makes each FP8 layer count, inside
# the training step, its tensors' amax and how many values were flushed to
# zero or saturated; `keras_mp.fp8.report(model)` reads them after training.
# The counts change no number of the training (the tensorwise run's loss is
# the same without them); they cost a few reductions per GEMM. During `fit`,
# `keras_mp.callbacks.FP8Report(saturated=0.001, flushed=0.01)` prints the
# same table at the end of an epoch where a fraction passes its threshold.
#
# "delayed" is Transformer Engine's delayed scaling: each scale comes from
# the max of the last `amax_history=1024` steps' amaxes, kept in three
# non-trainable variables per layer (`fp8_amax_history`, `fp8_steps`,
# `fp8_scale`), so a step needs no amax of its own before its GEMM. The
# first step runs current scaling; a step's amaxes reach the history by
# the layer's next call; a step the loss scale skips writes nothing.
#
# "mxfp8" is OCP MXFP8 (Blackwell's FP8): E4M3 values in blocks of 32 along
# each GEMM's contracted axis, each block with an E8M0 power-of-two scale,
# every operand quantized from its bfloat16 source along the axis its GEMM
# contracts (Transformer Engine's MXFP8 recipe). Its GEMMs need dimensions
# that are multiples of 32; the rules keep the others in bfloat16.
#
# "nvfp4" is NVFP4 after Transformer Engine's recipe: 4-bit E2M1 values in
# blocks of 16 with E4M3 block scales over a float32 tensor scale,
# stochastic rounding of the output gradient and a 16x16 Hadamard rotation
# of the kernel gradient's operands. Its rules keep the model's first and
# last blocks in bfloat16, as Megatron does: here the attention and
# `ffn_out`, so `ffn_in` alone runs NVFP4.

RECIPES = {
    "tensorwise": keras_mp.fp8.Recipe(granularity="tensorwise", stats=True),
    "rowwise": keras_mp.fp8.Recipe(granularity="rowwise"),
    "block": keras_mp.fp8.Recipe(granularity="block"),
    "e4m3 tensorwise": keras_mp.fp8.Recipe(formats="e4m3"),
    "delayed": keras_mp.fp8.Recipe(scaling="delayed"),
    "mxfp8": keras_mp.fp8.Recipe(formats="mxfp8"),
    "nvfp4": keras_mp.fp8.Recipe(formats="nvfp4"),
}


def plot(curves, path):
    """Top: each run's training loss (the running mean over the epoch that
    Keras logs per batch). Bottom: each FP8 run minus mixed_bfloat16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    base = np.array(curves["mixed_bfloat16"])
    steps = np.arange(1, len(base) + 1)
    for index, (label, losses) in enumerate(curves.items()):
        color = f"C{index}"
        top.plot(steps, losses, label=label, lw=1, color=color)
        if label != "mixed_bfloat16":
            bottom.plot(steps, np.array(losses) - base, lw=1, color=color)
    top.set_ylabel("training loss, running mean (nats)")
    top.set_title(
        f"FP8 recipes against mixed_bfloat16 ({keras.backend.backend()})"
    )
    top.legend()
    bottom.axhline(0.0, color="black", lw=0.5)
    bottom.set_ylabel("FP8 - mixed_bfloat16")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ## 3. What granularity buys
#
# One scale per tensor is set by the tensor's largest value. An outlier
# channel (LLM activations have them) 1000x the others pushes every other
# value toward E4M3's smallest numbers, where its 3 mantissa bits become
# fewer or none. Finer scales confine the outlier: "block" gives each 1x128
# tile along the contracted axis its own scale, so only the tile holding
# the outlier channel pays. "rowwise" gives each row (each token) its own
# scale, which does not help here, since every token has the outlier; it
# helps where magnitudes differ by token, and in the kernel-gradient GEMM,
# which contracts over tokens, so that its rows are channels.


def outlier_errors(rows=256, channels=512, outlier=7):
    """For each granularity: the mean relative error of the *other*
    channels after an E4M3 round trip, and the fraction of them flushed to
    zero."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, channels)).astype("float32")
    x[:, outlier] *= 1000.0
    others = np.arange(channels) != outlier
    results = {}
    for granularity in ("tensorwise", "rowwise", "block"):
        codes, scale = keras_mp.fp8.quantize(x, granularity=granularity)
        if granularity == "block":
            # One scale per 1x128 tile: repeated over the tile's values.
            scale = keras.ops.repeat(scale, 128, axis=-1)
        decoded = keras.ops.convert_to_numpy(
            keras.ops.cast(codes, "float32") * scale
        )
        error = np.abs(decoded - x)[:, others] / np.abs(x[:, others])
        flushed = (decoded[:, others] == 0) & (x[:, others] != 0)
        results[granularity] = (float(error.mean()), float(flushed.mean()))
    return results


# ## 4. The building block: fp8.quantize
#
# `fp8.quantize(x)` returns FP8 codes and a float32 power-of-two scale with
# `x ≈ codes * scale`. The scale is the smallest power of two that brings
# the largest value within E4M3's 448: dividing by it is exact, so the only
# rounding is the cast, and a loss scale (a power of two too) changes no
# code. Finite values past the range are clipped before the cast; inf and
# NaN are not: a tensor holding one gets a non-finite scale, so an
# overflowing float16 gradient stays non-finite and the loss-scale
# optimizer still skips the step.


def quantize_demo():
    for values in (
        np.array([1e-4, 0.3, 1.0, -3.0, 500.0, 1e5], dtype="float32"),
        np.array([0.3, 1.0, np.inf], dtype="float32"),
    ):
        codes, scale = keras_mp.fp8.quantize(values, fmt="e4m3")
        codes = keras.ops.convert_to_numpy(keras.ops.cast(codes, "float32"))
        scale = float(keras.ops.convert_to_numpy(scale))
        print(f"values {values.tolist()}")
        print(f"  scale {scale}, codes {codes.tolist()}")
        with np.errstate(invalid="ignore"):  # 0 * inf is NaN, as it should
            print(f"  codes * scale {(codes * scale).tolist()}")


# ## 5. LoRA on FP8 layers
#
# `layer.enable_lora(rank)` freezes a layer's kernel and trains a low-rank
# update `A @ B` (scaled by `lora_alpha / rank`) instead. On an FP8 layer
# the frozen kernel's GEMM stays in FP8 and the low-rank path runs in the
# compute dtype, added to the GEMM's result: merged into the kernel first
# (as Keras's `layer.kernel` gives it), the update would be rounded to the
# kernel's FP8 codes, and an update smaller than their spacing (3 mantissa
# bits: a step of 1/8 to 1/16 of each value) would be lost. Below, the FP8
# model fine-tunes its feed-forward block on a different chain.


def lora_finetune(model, train_data, eval_data, steps):
    """Enables LoRA (rank 8) on the feed-forward Dense layers of an FP8
    model and fine-tunes them; returns the eval losses before and after,
    and whether the frozen FP8 kernels stayed bit-identical."""
    layers = [model.get_layer(name) for name in ("ffn_in", "ffn_out")]
    for layer in model.layers:
        layer.trainable = layer in layers
    for layer in layers:
        layer.enable_lora(8)
    frozen = [keras.ops.convert_to_numpy(layer._kernel) for layer in layers]
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = model.evaluate(*eval_data, batch_size=256, verbose=0)
    x, y = train_data
    model.fit(
        x[: steps * BATCH_SIZE],
        y[: steps * BATCH_SIZE],
        batch_size=BATCH_SIZE,
        epochs=1,
        verbose=0,
    )
    after = model.evaluate(*eval_data, batch_size=256, verbose=0)
    unchanged = all(
        np.array_equal(keras.ops.convert_to_numpy(layer._kernel), kernel)
        for layer, kernel in zip(layers, frozen)
    )
    return float(before), float(after), unchanged


# ## 6. Freezing for inference
#
# `keras_mp.fp8.freeze(model)` makes a trained FP8 model an inference model:
# each FP8 layer's kernel (with its LoRA update merged in) is stored as
# E4M3 codes, one byte a value, and a power-of-two scale; its input scale
# is fixed: from the statistics of the last training step for the layers
# that counted them (the LoRA-tuned feed-forward block), from the delayed
# history with delayed scaling, and from `calibration_data` for the others
# (the attention projections, frozen during the fine-tuning).
# The float32 kernels are gone: the model predicts, saves and reloads, but
# no longer trains.


def freeze_demo(model, calibration_data):
    """Freezes `model`; returns its FP8 layers' kernel bytes in bfloat16
    before, and as FP8 codes after (read from the variables)."""
    fp8_layers = {
        row["layer"].split("/")[-1]
        for row in keras_mp.explain_precision(model, print_fn=None)
        if "/" in row.get("fp8", "")
    }
    before = sum(
        int(np.prod(weight.shape)) * 2
        for weight in model.weights
        if weight.path.endswith("/kernel")
        and weight.path.split("/")[-2] in fp8_layers
    )
    keras_mp.fp8.freeze(model, calibration_data=calibration_data)
    after = sum(
        keras.ops.convert_to_numpy(weight).nbytes
        for weight in model.weights
        if weight.path.endswith("fp8_kernel_codes")
    )
    return before, after


def main(argv=None):
    args = parse_args(argv)
    # On a CPU the hardware check warns that bfloat16 is emulated.
    warnings.filterwarnings("ignore", "Mixed precision compatibility")
    table = bigram_table()
    train_data = make_tokens(table, args.steps * BATCH_SIZE, seed=1)
    eval_data = make_tokens(table, 512, seed=2)
    print(f"The chain's entropy (the best loss): {entropy(table):.4f} nats")

    print("\n## 1. Turning FP8 on")
    keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
    keras_mp.explain_precision(build_model())

    print("\n## 2. Each recipe against mixed_bfloat16, same seed")
    _, base_curve, base_loss = train(None, train_data, eval_data, args.steps)
    curves = {"mixed_bfloat16": base_curve}
    print(f"{'recipe':<18} {'eval loss':>10} {'gap (nats)':>11}")
    print(f"{'mixed_bfloat16':<18} {base_loss:>10.4f} {'':>11}")
    for name, recipe in RECIPES.items():
        model, curve, loss = train(recipe, train_data, eval_data, args.steps)
        curves[f"fp8 {name}"] = curve
        print(f"{name:<18} {loss:>10.4f} {loss - base_loss:>+11.4f}")
        if recipe.stats:
            counted = model
    keras_mp.set_global_policy(None)
    plot(curves, args.plot)
    print(f"Loss curves: {args.plot}")
    # Amax as the range of a power-of-two bin; its exact scale; the
    # fractions of values saturated and flushed to zero, last step.
    print("\nWhat the tensorwise run's FP8 layers saw in its last step:")
    print(keras_mp.fp8.report(counted))

    print("\n## 3. One outlier channel 1000x the others, E4M3")
    print(
        f"{'granularity':<12} {'mean rel. error of the rest':>28} {'flushed to 0':>13}"
    )
    for name, (error, flushed) in outlier_errors().items():
        print(f"{name:<12} {error:>28.2%} {flushed:>13.2%}")

    print("\n## 4. fp8.quantize")
    quantize_demo()

    print("\n## 5. LoRA on the FP8 model, fine-tuned on another chain")
    other = bigram_table(seed=1)
    before, after, unchanged = lora_finetune(
        counted,
        make_tokens(other, args.steps * BATCH_SIZE, seed=3),
        make_tokens(other, 512, seed=4),
        max(args.steps // 2, 4),
    )
    print(f"eval loss on the new chain: {before:.4f} -> {after:.4f}")
    print(f"frozen FP8 kernels bit-identical: {unchanged}")

    print("\n## 6. Freezing the fine-tuned model for inference")
    eval_tokens = make_tokens(other, 512, seed=4)[0]
    trained = keras.ops.convert_to_numpy(
        counted.predict(eval_tokens, verbose=0)
    )
    before_bytes, after_bytes = freeze_demo(counted, eval_tokens[:256])
    frozen = keras.ops.convert_to_numpy(counted.predict(eval_tokens, verbose=0))
    difference = np.abs(
        frozen.astype("float32") - trained.astype("float32")
    ).max()
    print(
        f"FP8 kernel bytes: {before_bytes} (bfloat16) -> {after_bytes} (codes)"
    )
    largest = np.abs(trained.astype("float32")).max()
    print(
        "largest logit difference, frozen - trained: "
        f"{difference / largest:.2%} of the largest logit"
    )


if __name__ == "__main__":
    main()
