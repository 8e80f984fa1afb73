"""Guide: gradient transforms, plug-ins of the optimizer pipeline.

`keras_mp.OptimizerWrapper` runs every step as the six stages of RFC 234;
stage 5, `transform_gradients`, runs a chain of plug-ins given as
`transform_gradients=[...]`. A transform maps the list of `(gradient,
variable)` pairs to a new one, in order, like an optax
`GradientTransformation`; unlike optax's closures it is an object with a
config (so optimizers using it save and load) and, when it keeps state, Keras
variables (so compiled steps, JAX stateless steps and checkpoints carry it).

`keras_mp.transforms` ships ClipByValue, ClipByNorm, ClipByGlobalNorm,
AdaptiveClipByGlobalNorm, GradientCentralization, GaussianNoise,
DecoupledWeightDecay and ReplaceNonFinite. This guide:

1. gives transforms as instances, registered names and `(name, config)`;
2. composes clipping, noise and decoupled weight decay in `fit`;
3. writes and registers a stateful transform (momentum as a transform) and
   checks it against Keras's own SGD momentum;
4. saves a model with a transform chain to `.keras` and reloads it;
5. snapshots and restores transform state with `get_state`/`set_state`;
6. overrides pipeline stages by subclassing (RFC 234's clipping and
   Horovod examples);
7. composes transforms with `LossScaleOptimizer` and `Lookahead`.

It runs on every backend, with sklearn's digits data:

    python guides/gradient_transforms.py
    KERAS_BACKEND=jax python guides/gradient_transforms.py
    python guides/gradient_transforms.py --quick   # a few steps (CI)
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import logging
import tempfile
import warnings

import keras
import numpy as np
from keras import ops
from sklearn.datasets import load_digits

import keras_mp

BATCH_SIZE = 32

# Every section trains models of its own; TensorFlow warns when that many
# `fit` functions are traced, which is expected here.
logging.getLogger("tensorflow").setLevel(logging.ERROR)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    return parser.parse_args(argv)


def load_data(quick):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    if quick:
        x, y = x[:256], y[:256]
    return x, y


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
            # Logits in float32, so the loss sees float32 inputs under a
            # mixed policy.
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )


def compile_and_fit(optimizer, data, epochs):
    model = make_model()
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = data
    history = model.fit(
        x, y, batch_size=BATCH_SIZE, epochs=epochs, shuffle=False, verbose=0
    )
    return model, history


def to_numpy(value):
    return np.asarray(ops.convert_to_numpy(value))


def max_difference(a, b):
    return max(
        float(np.max(np.abs(to_numpy(x) - to_numpy(y)))) for x, y in zip(a, b)
    )


# ## 1. Three ways to give a transform
#
# - an instance: every argument explicit;
# - a registered name: the transform with its defaults (`"clip_by_global_norm"`
#   clips to a global norm of 1.0);
# - a `(name, config)` pair: the name with arguments, as in a config file.
#
# All three resolve through `keras_mp.transforms.get` into the same kind of
# object, and the wrapper holds them in a `keras_mp.transforms.Chain`. A
# plain callable taking and returning `grads_and_vars` (RFC 234's form)
# works too, but cannot be serialized; section 3 shows how to make one that
# can.


def show_specifications():
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.SGD(0.1),
        transform_gradients=[
            keras_mp.transforms.ClipByValue(5.0),
            "clip_by_global_norm",
            ("gaussian_noise", {"stddev": 1e-3, "seed": 1}),
        ],
    )
    print("1. The chain of an optimizer given an instance, a name and a pair:")
    for transform in optimizer.transforms.transforms:
        print(f"   {transform}")
    try:
        keras_mp.transforms.get("decoupled_weight_decay")
    except TypeError as error:
        # A transform with a required argument cannot be named alone; the
        # message says what to pass instead.
        print(
            "   As expected, 'decoupled_weight_decay' alone is refused (it "
            "has a required argument); the TypeError says: "
            f"{str(error).split('. ')[-1]}"
        )


# ## 2. Clipping, noise and decoupled weight decay in fit
#
# Transforms run in the order given. Clipping first bounds the global norm
# of each step's gradients, so the noise added next has a known size next
# to them (the recipe of differentially private SGD, which clips each
# example's gradients with `ClipByNorm` before adding the noise).
# `DecoupledWeightDecay` leaves the gradients alone: it decays the
# variables by `weight_decay * learning_rate`, as Keras's `weight_decay`
# argument does (AdamW), before the inner optimizer's update and only on
# steps that are applied. `ClipByGlobalNorm` then `DecoupledWeightDecay`
# with Adam is exactly `keras.optimizers.Adam(weight_decay=...,
# global_clipnorm=...)` (benchmarks/transform_chain_overhead.py checks it);
# the chain adds what Keras has no argument for.
#
# `GaussianNoise` keeps its random state in a Keras variable, made in
# `build`: `optimizer.variables` lists it after Adam's, so it is saved and
# carried through JAX's stateless steps.


def compose_in_fit(data, epochs):
    optimizer = keras_mp.OptimizerWrapper(
        keras.optimizers.Adam(3e-3),
        transform_gradients=[
            keras_mp.transforms.ClipByGlobalNorm(1.0),
            keras_mp.transforms.GaussianNoise(stddev=1e-3, seed=0),
            keras_mp.transforms.DecoupledWeightDecay(
                1e-2, exclude_from_weight_decay=["bias"]
            ),
        ],
    )
    model, history = compile_and_fit(optimizer, data, epochs)
    print(
        "2. Adam + [ClipByGlobalNorm, GaussianNoise, DecoupledWeightDecay]: "
        f"train accuracy {history.history['accuracy'][-1]:.2%} (last epoch)"
    )
    state_variables = optimizer.transforms.variables
    print(
        f"   optimizer variables: {len(optimizer.variables)}, of which "
        f"transform state: {[v.path for v in state_variables]}"
    )
    return model


# ## 3. A stateful transform of your own
#
# Subclass `keras_mp.transforms.Transform`:
#
# - `build(var_list)` creates the state with `self.add_variable(...)` (a
#   scalar here) or `self.add_variable_from_reference(variable, name)` (one
#   per model variable, shaped like it). It runs once, under the
#   transform's name, when the optimizer is built.
# - `call(grads_and_vars)` returns the new pairs, same variables, same
#   order. All math through `keras.ops`, state changed only with
#   `assign`, no Python `if` on tensor values: it then runs inside
#   tf.function, XLA and `jax.jit`. None gradients pass through.
# - `get_config()` returns every constructor argument.
# - `@keras_mp.transforms.register_transform("name")` makes the name usable
#   in `transform_gradients=[...]` and registers the class for saving (here
#   as `"guide>GradientTrace"`).
#
# `GradientTrace` is optax's `trace`: momentum as a transform. With plain
# SGD after it, it is SGD with momentum; the check below trains both ways.


@keras_mp.transforms.register_transform("gradient_trace", package="guide")
class GradientTrace(keras_mp.transforms.Transform):
    """Replaces each gradient with its trace, `decay * trace + gradient`.

    Args:
        decay: Decay of the trace, in `[0, 1)`. Defaults to `0.9`.
        name: Defaults to `"gradient_trace"`.
    """

    def __init__(self, decay=0.9, name=None):
        super().__init__(name=name)
        if not 0.0 <= decay < 1.0:
            raise ValueError(
                f"`decay` must be in [0, 1). Received: decay={decay!r}"
            )
        self.decay = float(decay)

    def build(self, var_list):
        self.traces = {
            variable.path: self.add_variable_from_reference(variable, "trace")
            for variable in var_list
        }
        # Counts the steps this transform ran: only applied ones, since a
        # skipped step (an overflow under loss scaling) keeps all state.
        self.updates = self.add_variable((), dtype="int32", name="updates")

    def call(self, grads_and_vars):
        result = []
        for gradient, variable in grads_and_vars:
            if gradient is not None:
                trace = self.traces[variable.path]
                gradient = self.decay * trace.value + gradient
                trace.assign(gradient)
            result.append((gradient, variable))
        self.updates.assign_add(1)
        return result

    def get_config(self):
        config = super().get_config()
        config["decay"] = self.decay
        return config


def custom_transform(data):
    # A short run: the two compute the same update with the operations in
    # another order, and over hundreds of steps ReLU's kink turns such
    # last-bit differences into visible ones (a unit on the edge of
    # switching off), whatever the optimizer.
    x, y = data
    data = x[: 8 * BATCH_SIZE], y[: 8 * BATCH_SIZE]
    ours, _ = compile_and_fit(
        keras_mp.OptimizerWrapper(
            keras.optimizers.SGD(0.05),
            transform_gradients=[
                ("clip_by_global_norm", {"max_norm": 1.0}),
                ("gradient_trace", {"decay": 0.9}),
            ],
        ),
        data,
        epochs=1,
    )
    keras_way, _ = compile_and_fit(
        keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=1.0),
        data,
        epochs=1,
    )
    trace = ours.optimizer.transforms.transforms[1]
    print(
        "3. SGD + [clip_by_global_norm, gradient_trace] vs Keras's "
        "SGD(momentum=0.9, global_clipnorm=1.0): max weight difference "
        f"{max_difference(ours.weights, keras_way.weights):.1e} after "
        f"{int(to_numpy(trace.updates))} steps"
    )
    return ours


# ## 4. Save and reload
#
# The optimizer's config lists its transforms by registered class and
# config; their state is saved with the optimizer's variables. A reloaded
# model has the same chain and the same state, so training continues
# exactly as it would have. (A `CallableTransform`, a plain callable,
# raises on saving, naming the fix.)


def save_and_reload(model, data):
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        reloaded = keras.models.load_model(path)
    chain = [type(t).__name__ for t in reloaded.optimizer.transforms.transforms]
    same_state = all(
        np.array_equal(to_numpy(a), to_numpy(b))
        for a, b in zip(
            model.optimizer.transforms.variables,
            reloaded.optimizer.transforms.variables,
        )
    )
    x, y = data
    for each in (model, reloaded):
        each.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
    same_weights = max_difference(model.weights, reloaded.weights) == 0.0
    print(
        f"4. Reloaded chain {chain}, same transform state: {same_state}; "
        f"after one more epoch each, identical weights: {same_weights}"
    )


# ## 5. get_state and set_state
#
# `optimizer.get_state()` returns the state of every transform as
# `{"<transform name>/<variable name>": numpy array}`; `set_state` puts it
# back, e.g. to replay the same noise. It checks every key, shape and dtype
# before writing anything, so a bad state leaves the optimizer as it was.


def state_round_trip(model, data):
    optimizer = model.optimizer
    snapshot = optimizer.get_state()
    print(f"5. State keys: {sorted(snapshot)}")
    x, y = data
    model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
    key = "gaussian_noise/seed_generator_state"
    advanced = not np.array_equal(optimizer.get_state()[key], snapshot[key])
    optimizer.set_state(snapshot)
    restored = np.array_equal(optimizer.get_state()[key], snapshot[key])
    print(
        f"   noise seed advanced by an epoch: {advanced}; back to the "
        f"snapshot after set_state: {restored}"
    )
    bad = dict(snapshot)
    bad[key] = np.zeros((3,), snapshot[key].dtype)
    try:
        optimizer.set_state(bad)
    except ValueError as error:
        unchanged = np.array_equal(optimizer.get_state()[key], snapshot[key])
        print(
            "   As expected, set_state refuses a wrong shape with a "
            f"ValueError ({str(error)[:60]}...); state unchanged: "
            f"{unchanged}"
        )


# ## 6. Overriding a stage (RFC 234's examples)
#
# A transform covers stage 5. To change another stage, or to write stage 5
# as a method, subclass `OptimizerWrapper` and override it; the other stages
# and the entry points (`fit`, `minimize`, `apply_gradients`,
# `stateless_apply`) are inherited. RFC 234's two examples:
#
# - clipping in `transform_gradients` (calling `super()` keeps the
#   plug-ins running), each gradient to norm 1, which is Keras's
#   `clipnorm=1.0`;
# - Horovod in `aggregate_gradients`: `hvd.allreduce` replaces the
#   cross-replica sum. `FakeHorovod` stands in for `horovod.tensorflow` in a
#   two-worker job whose other worker's gradients are all zero, so the
#   average halves every gradient. (`OptimizerWrapper(...,
#   aggregate_gradients=fn)` does the same without a subclass.)


def clip_each_to_unit_norm(grads_and_vars):
    return [
        (g * ops.minimum(1.0, 1.0 / ops.sqrt(ops.sum(ops.square(g)))), v)
        for g, v in grads_and_vars
    ]


class ClippingOptimizer(keras_mp.OptimizerWrapper):
    def transform_gradients(self, grads_and_vars):
        return clip_each_to_unit_norm(
            super().transform_gradients(grads_and_vars)
        )


class FakeHorovod:
    """`hvd.allreduce` averaging with a worker whose gradients are zero."""

    size = 2

    def allreduce(self, grads_and_vars):
        return [(g / self.size, v) for g, v in grads_and_vars]


class HorovodOptimizer(keras_mp.OptimizerWrapper):
    def __init__(self, optimizer, hvd, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.hvd = hvd

    def aggregate_gradients(self, grads_and_vars):
        return self.hvd.allreduce(grads_and_vars)


def kernel_update(optimizer):
    """The change of a linear model's kernel after one `fit` step."""
    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.full((4, 1), 10.0, "float32")
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="zeros")]
    )
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    return to_numpy(model.layers[0].kernel)[:, 0]


def override_stages():
    ours = kernel_update(ClippingOptimizer(keras.optimizers.SGD(1.0)))
    keras_way = kernel_update(keras.optimizers.SGD(1.0, clipnorm=1.0))
    print(
        "6. ClippingOptimizer: update norm "
        f"{np.linalg.norm(ours):.4f}, max difference from Keras's "
        f"clipnorm=1.0: {np.max(np.abs(ours - keras_way)):.1e}"
    )
    plain = kernel_update(keras.optimizers.SGD(1e-3))
    averaged = kernel_update(
        HorovodOptimizer(keras.optimizers.SGD(1e-3), FakeHorovod())
    )
    print(
        "   HorovodOptimizer: update / plain SGD update = "
        f"{np.round(averaged / plain, 4).tolist()}"
    )


# ## 7. With LossScaleOptimizer and Lookahead
#
# Wrappers nest, and each runs its own chain in its own stage 5. Under a
# mixed_float16 policy `compile` wraps the optimizer in a
# `LossScaleOptimizer`, so here the result is
# LossScaleOptimizer(Lookahead(SGD)): the loss scale optimizer unscales the
# gradients and checks them for overflow, then Lookahead's chain sees the
# true gradients, SGD updates the fast weights, and Lookahead syncs the slow
# ones every 5 applied updates. On an overflow the whole inner step is
# skipped: no transform runs and none of their state moves, so
# `GradientTrace.updates` counts exactly the applied steps.
#
# A chain given to the `LossScaleOptimizer` itself
# (`keras_mp.LossScaleOptimizer(inner, transform_gradients=[...])`) also
# runs after unscaling and after the overflow check, so even
# `ReplaceNonFinite` there cannot hide an overflow from it. A wrapper put
# *outside* the LossScaleOptimizer would see scaled gradients: keep
# transforms that look at gradient values inside.


def with_loss_scale_and_lookahead(data, epochs):
    # On a CPU the hardware check warns that float16 is slow here; this
    # guide is about composition, not speed.
    # The check runs when the first mixed layer is built: filtered for
    # the whole script, not only around set_global_policy.
    warnings.filterwarnings("ignore", "Mixed precision compatibility")
    keras_mp.set_global_policy("mixed_float16")
    x, y = data
    x = x.copy()
    # One batch that overflows float16 (its inputs become inf), as a real
    # overflow would: that step must be skipped.
    x[2 * BATCH_SIZE : 3 * BATCH_SIZE] *= 1e6
    optimizer = keras_mp.optimizers.Lookahead(
        keras.optimizers.SGD(0.05),
        sync_period=5,
        transform_gradients=[
            keras_mp.transforms.ClipByGlobalNorm(1.0),
            GradientTrace(0.9),
        ],
    )
    model, _ = compile_and_fit(optimizer, (x, y), epochs)
    keras_mp.set_global_policy(None)
    outer = model.optimizer
    trace = optimizer.transforms.transforms[1]
    print(
        f"7. model.optimizer: {type(outer).__name__}"
        f"({type(outer.inner_optimizer).__name__}"
        f"({type(outer.inner_optimizer.inner_optimizer).__name__}))"
    )
    print(
        f"   skipped steps {int(to_numpy(outer.skipped_steps))}, applied "
        f"steps {int(to_numpy(outer.iterations))}, GradientTrace.updates "
        f"{int(to_numpy(trace.updates))}, loss scale "
        f"{float(to_numpy(outer.loss_scale())):g}"
    )


def main(argv=None):
    args = parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    data = load_data(args.quick)
    show_specifications()
    composed = compose_in_fit(data, epochs)
    traced = custom_transform(data)
    save_and_reload(traced, data)
    state_round_trip(composed, data)
    override_stages()
    with_loss_scale_and_lookahead(data, epochs)


if __name__ == "__main__":
    main()
