"""Guide: precision where it matters, memory where it counts.

Mixed precision used to be one switch: compute in 16 bits, keep float32
variables, and remember to put `dtype="float32"` on the last layer. Two
costs stayed hidden. A few places lose too much in 16 bits (a softmax, the
logits the loss reads), and which ones were float32 was a matter of what each
layer happened to hard-code. And the optimizer's state stayed float32 whatever
the policy: Adam keeps two moments per parameter, 8 bytes of state for every
4-byte weight, two thirds of the training memory of the parameters.

keras_mp makes precision a declared, inspectable property of a model and
halves the optimizer's memory. On one small transformer-like model (token
and position embeddings, single-head attention with a `Softmax` layer,
LayerNormalization, a Dense feed-forward block and Dense logits) trained on a
synthetic task (at every position, predict the token a fixed offset further
on), this guide shows:

1. output dtypes: `keras_mp.Policy("params=float32,compute=bfloat16,
   output=float32")` computes a layer in bfloat16 and returns float32;
2. float32 islands: `set_global_policy("mixed_bfloat16",
   float32_islands=...)` with `DEFAULT_FLOAT32_ISLANDS` (softmax and output
   layers in float32) extended by a rule of our own, and the
   `explain_precision` table saying, per layer, which rule decided;
3. optimizer state in bfloat16: `OptimizerWrapper(Adam, state_dtype=
   "bfloat16")` (stochastic rounding by default) and in 8 bits
   (`state_dtype="float8"`: E4M3 codes with a scale per block of 128)
   against float32 Adam: bytes of state per parameter, measured from the
   optimizer's variables, and the final losses side by side;
4. pure bfloat16 weights with float32 master weights inside the optimizer
   (`master_weights=True`) against the same without masters, where small
   updates round away;
5. FP8 GEMMs that keep FP8 activations for the backward
   (`fp8.Recipe(granularity="rowwise", save_activations="fp8")`) with
   float8 optimizer state: its final loss, and the bytes one training step
   keeps between its forward and backward pass against mixed_bfloat16's
   (`keras_mp.testing.saved_activation_bytes`);

and a bar chart (a PNG, with matplotlib) of the bytes per parameter, weights
plus optimizer state, of each configuration. It runs on every backend:

    python guides/precision_and_memory.py
    KERAS_BACKEND=jax python guides/precision_and_memory.py
    python guides/precision_and_memory.py --quick   # a few steps (CI)
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import logging
import math
import pathlib
import warnings

import keras
import numpy as np
from keras import ops

import keras_mp

DEFAULT_PLOT = (
    pathlib.Path(__file__).parent / "_output" / "precision_memory.png"
)
SEQ_LEN = 16
VOCAB = 16
OFFSET = 3  # the target at position i is the token at position i + OFFSET
DIM = 32
BATCH_SIZE = 64
STEPS_PER_EPOCH = 16

# Every configuration trains a model of its own; TensorFlow warns when that
# many `fit` functions are traced, which is expected here.
logging.getLogger("tensorflow").setLevel(logging.ERROR)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", type=pathlib.Path, default=DEFAULT_PLOT)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    return parser.parse_args(argv)


# ## The task and the model
#
# Sequences of 16 random tokens; the label at position i is the token at
# position (i + 3) mod 16. Guessing gives a loss of ln(16) = 2.77; solving
# it needs the attention to look 3 positions ahead, which the position
# embeddings make possible.


def make_data(quick):
    rng = np.random.default_rng(0)
    count = (2 if quick else STEPS_PER_EPOCH) * BATCH_SIZE
    tokens = rng.integers(0, VOCAB, size=(count, SEQ_LEN)).astype("int32")
    labels = np.roll(tokens, -OFFSET, axis=1)
    return tokens, labels


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position (keras-hub has one; this is it)."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[-2:]),
            initializer=keras.initializers.RandomNormal(stddev=0.1),
            name="positions",
        )

    def call(self, inputs):
        return inputs + self.positions


def build_model():
    """One transformer block: attention, then a feed-forward block.

    The attention is written out with Keras layers, so its `Softmax` is a
    layer of the model that precision rules can see. (Keras's
    `MultiHeadAttention` creates its inner Softmax with the attention
    layer's own policy, so a `Softmax` rule does not reach it: the whole
    MultiHeadAttention layer would need a rule of its own.)
    """
    keras.utils.set_random_seed(0)
    layers = keras.layers
    tokens = keras.Input((SEQ_LEN,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, DIM, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    query = layers.Dense(DIM, name="query")(x)
    query = layers.Rescaling(1 / math.sqrt(DIM), name="query_scale")(query)
    key = layers.Dense(DIM, name="key")(x)
    value = layers.Dense(DIM, name="value")(x)
    scores = layers.Dot(axes=(2, 2), name="scores")([query, key])
    weights = layers.Softmax(name="attention_weights")(scores)
    attended = layers.Dot(axes=(2, 1), name="attend")([weights, value])
    attended = layers.Dense(DIM, name="attention_output")(attended)
    x = layers.LayerNormalization(name="norm_1")(layers.Add()([x, attended]))
    hidden = layers.Dense(4 * DIM, activation="relu", name="ffn_in")(x)
    hidden = layers.Dense(DIM, name="ffn_out")(hidden)
    x = layers.LayerNormalization(name="norm_2")(layers.Add()([x, hidden]))
    logits = layers.Dense(VOCAB, name="logits")(x)
    return keras.Model(tokens, logits, name="offset_lookup")


# With --quick (CI) every `fit` runs eagerly: a check that each line of the
# guide runs, in seconds, instead of compiling five training steps.
RUN_EAGERLY = False


def train(model, optimizer, data, epochs):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        run_eagerly=RUN_EAGERLY,
    )
    x, y = data
    history = model.fit(
        x, y, batch_size=BATCH_SIZE, epochs=epochs, shuffle=False, verbose=0
    )
    return history.history["loss"][-1], history.history["accuracy"][-1]


def nbytes(variables):
    """Bytes the variables hold: element count times their dtype's size."""
    total = 0
    for variable in variables:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        itemsize = (
            2 if dtype in ("bfloat16", "float16") else np.dtype(dtype).itemsize
        )
        total += int(np.prod(variable.shape)) * itemsize
    return total


def memory(model):
    """Bytes per parameter: weights, optimizer state, master weights.

    Measured from the variables themselves: `model.weights`, and
    `model.optimizer.variables` split into the float32 master copies (the
    optimizer variables named `..._master`) and the rest (Adam's moments,
    the step counter, the seed state of stochastic rounding).
    """
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    optimizer_variables = model.optimizer.variables
    masters = [v for v in optimizer_variables if v.path.endswith("_master")]
    state = [v for v in optimizer_variables if not v.path.endswith("_master")]
    return {
        "weights": nbytes(model.weights) / params,
        "state": nbytes(state) / params,
        "masters": nbytes(masters) / params,
    }


def dtypes(variables):
    counts = {}
    for variable in variables:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        counts[dtype] = counts.get(dtype, 0) + int(np.prod(variable.shape))
    return ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items()))


# ## 1. Output dtypes
#
# A jmp-style spec gives a layer three dtypes: its variables (params), its
# math (compute) and what it returns (output). Logits computed in bfloat16
# but handed to the loss in float32 are the classic use.


def output_dtype_demo():
    policy = keras_mp.Policy("params=float32,compute=bfloat16,output=float32")
    layer = keras.layers.Dense(4, dtype=policy)
    outputs = layer(np.ones((2, 8), "float32"))
    print(
        f"Policy({policy.name!r}): variables {layer.variable_dtype}, "
        f"compute {layer.compute_dtype}, "
        f"outputs {keras.backend.standardize_dtype(outputs.dtype)}"
    )
    short = keras_mp.Policy("p=f32,c=bf16")
    print(
        f"Policy('p=f32,c=bf16') is {short.name!r}, outputs "
        f"{short.output_dtype}: without an output key, a layer returns its "
        "compute dtype\n"
    )


# ## 2. Float32 islands, and why each layer is what it is
#
# `float32_islands="default"` puts Softmax layers and the model's output
# layers in float32. Rules of our own go first and win: here the logits
# keep their float32 output (what the loss reads) but do their matmul in
# bfloat16, and the first LayerNormalization is made a float32 island as
# an example of a path rule. (Normalization statistics need no rule:
# Keras's norm layers compute mean and variance in float32 already.)

RULES = keras_mp.precision_rules(
    {
        "logits": "params=float32,compute=bfloat16,output=float32",
        "norm_1": "float32",
    },
    base="default",
    name="guide_rules",
)


def islands_demo():
    keras_mp.set_global_policy("mixed_bfloat16", float32_islands=RULES)
    model = build_model()
    print("Rules, in the order they are tried:")
    for rule in RULES.rules:
        print(f"  {rule}")
    print("\nexplain_precision(model):")
    rows = keras_mp.explain_precision(model)
    islands = [r["layer"] for r in rows if r["compute_dtype"] == "float32"]
    print(f"\nLayers computing in float32: {', '.join(islands)}\n")
    return model


# ## 3. Optimizer state in bfloat16
#
# `state_dtype="bfloat16"` creates Adam's two moments in bfloat16: 4 bytes
# of state per parameter instead of 8. Each update still computes in
# float32 (the moments are read upcast); the result is stored with
# stochastic rounding, so increments smaller than bfloat16's rounding step
# survive on average instead of being dropped every step.
#
# `state_dtype="float8"` (Adam and AdamW) goes to one byte a moment: E4M3
# codes, with a float32 power-of-two scale for each block of 128 values,
# about 2.06 bytes of state per parameter. The second moment is stored as
# its square root (so it spans the same range as the first) and rounded
# stochastically; the first moment is rounded to nearest.


def make_adam(steps):
    """Adam with a learning rate decaying to zero, as transformers train.

    beta_2=0.98 is the value of the original Transformer paper; it is also
    a value bfloat16 can hold, which Keras's default 0.999 is not (see
    section 4).
    """
    schedule = keras.optimizers.schedules.CosineDecay(5e-3, steps)
    return keras.optimizers.Adam(schedule, beta_2=0.98)


def state_demo(mixed, data, epochs, steps):
    """Trains the mixed model with float32 Adam, and copies with bfloat16
    and float8 state."""
    adam = make_adam(steps)
    loss, accuracy = train(mixed, adam, data, epochs)
    low = build_model()
    wrapper = keras_mp.OptimizerWrapper(
        make_adam(steps), state_dtype="bfloat16"
    )
    low_loss, low_accuracy = train(low, wrapper, data, epochs)
    eight = build_model()
    float8 = keras_mp.OptimizerWrapper(make_adam(steps), state_dtype="float8")
    eight_loss, eight_accuracy = train(eight, float8, data, epochs)
    print(f"float32 Adam, optimizer variables:   {dtypes(adam.variables)}")
    print(f"bfloat16 state, optimizer variables: {dtypes(wrapper.variables)}")
    print(f"float8 state, optimizer variables:   {dtypes(float8.variables)}")
    print(
        "(besides the two moments: the step counter and, for stochastic\n"
        "rounding, the seed generator's state; float8 codes are uint8, with\n"
        "float32 block scales)"
    )
    print(
        f"final loss: float32 state {loss:.4f}, bfloat16 state "
        f"{low_loss:.4f}, float8 state {eight_loss:.4f}\n"
    )
    return (
        (mixed, loss, accuracy),
        (low, low_loss, low_accuracy),
        (eight, eight_loss, eight_accuracy),
    )


# ## 4. Pure bfloat16 weights, with and without master weights
#
# `Policy("bfloat16")` keeps the variables themselves in bfloat16 (2 bytes
# a weight). bfloat16 keeps 8 significant bits: next to a LayerNormalization
# scale of 1 its values are 1/256 to 1/128 apart, so an update below about
# 0.002 is rounded away, every time. Early in training Adam's steps are
# large enough; as the learning rate decays they are not, and the weights
# freeze. `master_weights=True` keeps a float32 copy of each weight inside
# the optimizer, applies the update there and writes the rounded value
# back, so small updates add up. The masters cost 4 bytes a parameter, and
# the moments follow the masters' dtype unless `state_dtype` says otherwise.
#
# Keras's Adam also computes its bias correction in the variable's dtype,
# and 0.999 (its default beta_2) is 1.0 in bfloat16: on bfloat16 variables
# every step is then exactly zero. With masters, Adam works on float32
# variables and the default is fine; `beta_2_pitfall` shows both.


def pure_bfloat16_model():
    with warnings.catch_warnings():
        # "The global policy 'bfloat16' keeps the variables in bfloat16 ...
        # training often stalls": the problem master weights answer.
        warnings.filterwarnings("ignore", "The global policy 'bfloat16'")
        with keras_mp.policy_scope(keras_mp.Policy("bfloat16")):
            return build_model()


def pure_bfloat16(master_weights, data, epochs, steps):
    model = pure_bfloat16_model()
    optimizer = keras_mp.OptimizerWrapper(
        make_adam(steps), state_dtype="bfloat16", master_weights=master_weights
    )
    loss, accuracy = train(model, optimizer, data, epochs)
    return model, loss, accuracy


def beta_2_pitfall():
    for master_weights in (False, True):
        weight = keras.Variable(np.full((3,), 0.5, "float32"), dtype="bfloat16")
        optimizer = keras_mp.OptimizerWrapper(
            keras.optimizers.Adam(0.01),  # beta_2=0.999
            state_dtype="bfloat16",
            master_weights=master_weights,
        )
        for _ in range(5):
            optimizer.apply([ops.ones((3,), "bfloat16")], [weight])
        value = ops.convert_to_numpy(ops.cast(weight, "float32"))
        print(
            f"Adam(0.01), 5 steps from 0.5, master_weights={master_weights}: "
            f"weight {float(value[0]):.4f}"
        )


# ## 5. FP8 GEMMs that keep FP8 activations, with float8 state
#
# `fp8=keras_mp.fp8.Recipe(granularity="rowwise", save_activations="fp8")`
# runs the Dense layers' GEMMs in FP8 with a scale per row (the embeddings
# and the output layer stay bfloat16: `fp8.Rules`) and keeps, for the
# backward, each layer's input as the forward's E4M3 codes and row scales:
# about half the bytes of the bfloat16 input a layer keeps otherwise. The
# kernel gradient quantizes their values again along the tokens, as
# DeepSeek-V3 does. With float8 optimizer state beside it, this is the
# least memory keras_mp trains in. What one step keeps between its forward
# and its backward pass is read from the step itself
# (`keras_mp.testing.saved_activation_bytes`: JAX's residuals, PyTorch's
# autograd graph, the forward tensors TensorFlow's traced gradient reads).
# It pays only where nothing else
# keeps the bfloat16 input: on PyTorch `relu` keeps its output (the next
# layer's input) for its own backward anyway, and the query, key and value
# layers each keep codes of the one input a bfloat16 step keeps once, so
# here the step keeps more on PyTorch, a little less on JAX and about a
# sixth less on TensorFlow. On a CPU
# FP8 is emulated: what this section shows is memory and loss, not speed.
# (PyTorch's CPU multiplies FP8 values kept in float32, and so keeps
# float32 values for the backward; the bytes below are those of FP8 codes,
# as on a GPU.)

FP8_RECIPE = keras_mp.fp8.Recipe(granularity="rowwise", save_activations="fp8")


def fp8_demo(data, epochs, steps):
    """Trains the model with FP8 activations and float8 state; prints the
    bytes a step keeps against the mixed_bfloat16 model's."""
    keras_mp.set_global_policy(
        "mixed_bfloat16", float32_islands=RULES, fp8=FP8_RECIPE
    )
    model = build_model()
    keras_mp.set_global_policy("mixed_bfloat16", float32_islands=RULES)
    reference = build_model()
    keras_mp.set_global_policy("float32")
    layers = [
        layer.name
        for layer in model.layers
        if getattr(layer.dtype_policy, "fp8", None) is not None
    ]
    print(f"FP8 layers: {', '.join(layers)} (explain_precision says why)")
    optimizer = keras_mp.OptimizerWrapper(
        make_adam(steps), state_dtype="float8"
    )
    loss, accuracy = train(model, optimizer, data, epochs)
    print(f"final loss: {loss:.4f}")
    from keras_mp.backend import fp8 as backend_fp8
    from keras_mp.testing import saved_activation_bytes

    # PyTorch's CPU keeps float32 values; a GPU keeps codes: measure those.
    backend_fp8.SCALED_MM_ON_CPU = True
    x, y = data[0][:BATCH_SIZE], data[1][:BATCH_SIZE]
    step_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    kept = {
        "mixed_bfloat16": saved_activation_bytes(reference, x, y, step_loss),
        "FP8, fp8 activations": saved_activation_bytes(model, x, y, step_loss),
    }
    backend_fp8.SCALED_MM_ON_CPU = False
    print(f"bytes one step of {BATCH_SIZE} sequences keeps for the backward:")
    for label, nbytes in kept.items():
        print(f"  {label:<22} {nbytes / 1024:8.1f} KiB")
    print()
    return model, loss, accuracy


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    figure, axes = plt.subplots(figsize=(9, 4.8))
    positions = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for key, legend in (
        ("weights", "weights"),
        ("state", "optimizer state (moments)"),
        ("masters", "float32 master weights"),
    ):
        heights = np.array([results[label][key] for label in labels])
        axes.bar(positions, heights, bottom=bottom, label=legend)
        bottom += heights
    for i, label in enumerate(labels):
        axes.text(i, bottom[i] + 0.15, f"{bottom[i]:.1f}", ha="center")
        axes.text(
            i, 0.3, f"loss {results[label]['loss']:.3f}", ha="center", size=8
        )
    axes.set_xticks(positions, [label.replace(", ", ",\n") for label in labels])
    axes.set_ylabel("bytes per parameter (measured)")
    axes.set_ylim(0, max(bottom) * 1.12)
    axes.set_title(
        f"Memory per parameter by configuration ({keras.backend.backend()})"
    )
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None):
    global RUN_EAGERLY
    args = parse_args(argv)
    RUN_EAGERLY = args.quick
    epochs = 1 if args.quick else args.epochs
    data = make_data(args.quick)
    steps = epochs * len(data[0]) // BATCH_SIZE
    results = {}

    def record(label, model, loss, accuracy):
        results[label] = {**memory(model), "loss": loss, "accuracy": accuracy}

    # On a CPU the hardware check warns that bfloat16 is emulated and slow;
    # this guide is about precision and memory, not speed.
    warnings.filterwarnings("ignore", "Mixed precision compatibility")

    print("## 1. Output dtypes")
    output_dtype_demo()

    print("## 2. Float32 islands")
    mixed = islands_demo()

    print("## 3. Optimizer state in bfloat16")
    keras_mp.set_global_policy("float32")
    baseline = build_model()
    record(
        "float32, Adam",
        baseline,
        *train(baseline, make_adam(steps), data, epochs),
    )
    keras_mp.set_global_policy("mixed_bfloat16", float32_islands=RULES)
    float32_state, bfloat16_state, float8_state = state_demo(
        mixed, data, epochs, steps
    )
    record("mixed_bfloat16, Adam", *float32_state)
    record("mixed_bfloat16, bfloat16 state", *bfloat16_state)
    record("mixed_bfloat16, float8 state", *float8_state)

    print("## 4. Pure bfloat16 weights")
    keras_mp.set_global_policy("float32")
    masters = pure_bfloat16(True, data, epochs, steps)
    plain = pure_bfloat16(False, data, epochs, steps)
    print(f"pure bfloat16 model, weights: {dtypes(masters[0].weights)}")
    print(
        f"final loss: with master weights {masters[1]:.4f}, "
        f"without {plain[1]:.4f}"
    )
    record("pure bfloat16, bfloat16 state, masters", *masters)
    record("pure bfloat16, bfloat16 state", *plain)
    beta_2_pitfall()

    print("## 5. FP8 activations and float8 state")
    record(
        "mixed_bfloat16, FP8 activations, float8 state",
        *fp8_demo(data, epochs, steps),
    )

    print("\n## Memory and final loss by configuration")
    width = max(len(label) for label in results)
    print(
        f"{'configuration':<{width}}  weights  state  masters  total  "
        "final loss  accuracy"
    )
    for label, row in results.items():
        total = row["weights"] + row["state"] + row["masters"]
        print(
            f"{label:<{width}}  {row['weights']:7.2f}  {row['state']:5.2f}  "
            f"{row['masters']:7.2f}  {total:5.2f}  {row['loss']:10.4f}  "
            f"{row['accuracy']:8.2%}"
        )
    print(
        "(bytes per parameter, measured from model.weights and "
        "model.optimizer.variables)"
    )
    plot(results, args.plot)
    print(f"\nBar chart of the bytes per parameter: {args.plot}")


if __name__ == "__main__":
    main()
