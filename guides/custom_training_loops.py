"""Guide: mixed precision in training loops you write yourself.

`fit` does everything in the guide `mixed_precision_with_fit.py` for you.
A loop of your own needs one more thing under a float16 policy: the loss
scale. keras_mp's `LossScaleOptimizer` keeps it out of your way. The
section that runs is chosen by the backend:

- TensorFlow: a `tf.GradientTape` loop in a `tf.function`, first with
  `optimizer.minimize(loss, var_list, tape=tape)` (RFC 234: the optimizer
  scales the loss, takes the gradients, unscales them, skips the step on
  overflow), then with RFC 293's explicit `get_scaled_loss` /
  `get_unscaled_gradients` / `apply_gradients`.
- JAX: a pure, jitted step on explicit state: `model.stateless_call`,
  `jax.value_and_grad` of the *scaled* loss, `optimizer.stateless_apply`.
- PyTorch: an eager loop, first with `scale_loss(loss).backward()` and
  `optimizer.apply(grads)` under `torch.no_grad()`, then with RFC 293's
  `get_scaled_loss` / `torch.autograd.grad` / `get_unscaled_gradients` /
  `apply_gradients`. No step converts a tensor to a Python value: the skip
  is decided on the device.

Each then feeds one batch that overflows and check that the step was skipped
with every weight left bit for bit as it was. Before that, on every backend,
a section for readers coming from torch.amp or DeepSpeed: what each of
their settings becomes, and how a run continues with their scaler's state.

How the optimizer knows whether to divide by the scale: it records, while
the step is built, what you called since the last update.

- `scale_loss` / `get_scaled_loss` / `minimize` (the loss was scaled): the
  gradients given to `apply`/`apply_gradients` are divided by the scale.
- `get_unscaled_gradients` (RFC 293): they are not divided again, whatever
  you did to them in between (clipping, `g * 1.0`, casting).
- Neither (the `train_step` of Keras's "customizing fit" guides, which
  never scales its loss): the gradients are applied as they are, which is
  right, and a warning says that float16 gradients then get no protection
  from underflow, with the one line to add: `loss =
  self.optimizer.scale_loss(loss)`. Gradients you multiplied by the scale
  yourself count as unscaled: go through `scale_loss` instead.

    python guides/custom_training_loops.py            # TensorFlow section
    KERAS_BACKEND=jax python guides/custom_training_loops.py
    KERAS_BACKEND=torch python guides/custom_training_loops.py
    python guides/custom_training_loops.py --quick    # a few steps (CI)
"""

# ruff: noqa: E402 (the variable below must be set before TensorFlow loads)
import os

# Hides TensorFlow's C++ INFO and WARNING lines; set it to 0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import warnings

import keras
import numpy as np
from sklearn.datasets import load_digits

import keras_mp

BATCH_SIZE = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("KERAS_MP_QUICK") == "1",
        help="a few steps only, for CI (also KERAS_MP_QUICK=1)",
    )
    return parser.parse_args(argv)


# ## The setup both loops share
#
# Policy first, then the model. The policy's dynamic loss scale is copied
# into the optimizer by `compile`; a loop that never calls `compile` wraps
# the optimizer itself, with the same default scale.


def setup():
    # On a CPU the hardware check warns that float16 is slow here; this
    # guide is about the loop, not speed.
    # The check runs when the first mixed layer is built: filtered for
    # the whole script, not only around set_global_policy.
    warnings.filterwarnings("ignore", "Mixed precision compatibility")
    keras_mp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
            # Logits in float32, so the loss sees float32 inputs.
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, optimizer, loss_fn


def batches(steps):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    rng = np.random.default_rng(0)
    for _ in range(steps):
        index = rng.integers(0, len(x), BATCH_SIZE)
        yield x[index], y[index]


def overflowing_batch():
    """A batch whose loss (hence every gradient) is inf: a stand-in for a
    float16 overflow."""
    x, y = next(batches(1))
    x = x.copy()
    x[0, 0] = np.inf
    return x, y


def accuracy(model):
    digits = load_digits()
    logits = keras.ops.convert_to_numpy(model(digits.data / 16.0))
    return float(np.mean(np.argmax(logits, axis=-1) == digits.target))


def report(model, optimizer):
    scale = float(keras.ops.convert_to_numpy(optimizer.loss_scale()))
    print(
        f"  training-set accuracy {accuracy(model):.2%}, loss scale "
        f"{scale:g}, applied steps "
        f"{int(keras.ops.convert_to_numpy(optimizer.iterations))}, skipped "
        f"steps {int(keras.ops.convert_to_numpy(optimizer.skipped_steps))}"
    )


# ## TensorFlow: GradientTape
#
# `minimize(loss, var_list, tape=tape)` runs the whole RFC 234 pipeline. The
# loop does not know that the loss is scaled, nor that a step may be skipped.


def tensorflow_minimize(model, optimizer, loss_fn, steps):
    import tensorflow as tf

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return loss

    for x, y in batches(steps):
        train_step(x, y)
    return train_step


# The explicit RFC 293 form, as tf.keras code wrote it: scale the loss inside
# the tape, unscale the gradients, apply. `apply_gradients` knows that
# `get_unscaled_gradients` ran in this step and does not divide again, even
# after clipping; it still checks the gradients and skips the step on
# overflow.


def tensorflow_explicit(model, optimizer, loss_fn, steps):
    import tensorflow as tf

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for x, y in batches(steps):
        train_step(x, y)
    return train_step


def run_tensorflow(steps):
    model, optimizer, loss_fn = setup()
    print("TensorFlow, optimizer.minimize(loss, var_list, tape=tape):")
    train_step = tensorflow_minimize(model, optimizer, loss_fn, steps)
    report(model, optimizer)

    print("One overflowing batch through the same step:")
    before = [v.numpy().copy() for v in model.variables + optimizer.variables]
    train_step(*overflowing_batch())
    after_step_checks(model, optimizer, before)

    print("TensorFlow, get_scaled_loss / get_unscaled_gradients:")
    model, optimizer, loss_fn = setup()
    tensorflow_explicit(model, optimizer, loss_fn, steps)
    report(model, optimizer)


# ## JAX: a stateless step
#
# JAX differentiates pure functions, so the step takes the variables' values
# as arguments and returns new ones. Two details make it loss-scaled:
#
# - the loss scale is an optimizer variable, so `scale_loss` runs under a
#   `keras.StatelessScope` mapping the optimizer variables to the values
#   this step carries (otherwise it would read a constant baked in at trace
#   time);
# - the gradients of the *scaled* loss go to `stateless_apply`, which
#   unscales them, updates the scale and skips the update on overflow, all
#   as array operations inside the jitted step.


def jax_loop(model, optimizer, loss_fn, steps):
    import jax

    optimizer.build(model.trainable_variables)

    def compute_loss(trainable, non_trainable, optimizer_values, x, y):
        y_pred, non_trainable = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        loss = loss_fn(y, y_pred)
        mapping = list(zip(optimizer.variables, optimizer_values))
        with keras.StatelessScope(state_mapping=mapping):
            scaled_loss = optimizer.scale_loss(loss)
        return scaled_loss, (loss, non_trainable)

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    @jax.jit
    def train_step(state, x, y):
        trainable, non_trainable, optimizer_values = state
        (_, (loss, non_trainable)), grads = grad_fn(
            trainable, non_trainable, optimizer_values, x, y
        )
        trainable, optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, trainable
        )
        return loss, (trainable, non_trainable, optimizer_values)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    for x, y in batches(steps):
        _, state = train_step(state, x, y)
    write_back(model, optimizer, state)
    return train_step, state


def write_back(model, optimizer, state):
    """Puts the loop's state into the Keras variables (to save, evaluate)."""
    trainable, non_trainable, optimizer_values = state
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_values):
        variable.assign(value)


def run_jax(steps):
    model, optimizer, loss_fn = setup()
    print("JAX, stateless_call + value_and_grad + stateless_apply:")
    train_step, state = jax_loop(model, optimizer, loss_fn, steps)
    report(model, optimizer)

    print("One overflowing batch through the same step:")
    before = [np.array(v.value) for v in model.variables + optimizer.variables]
    _, state = train_step(state, *overflowing_batch())
    write_back(model, optimizer, state)
    after_step_checks(model, optimizer, before)


# ## PyTorch: backward() and apply
#
# The loop Keras's guide "Customizing what happens in `fit()` with PyTorch"
# writes, with one change: `backward()` runs on the *scaled* loss. The
# optimizer gets the scaled gradients, unscales them, updates the scale and
# skips the update on overflow. As torch AMP's GradScaler, it checks and
# unscales the gradients in one fused pass (the `.grad` tensors in place,
# as `GradScaler.unscale_` does), reads the overflow flag on the host once
# per step (free on CPU tensors, one small read on a GPU) and runs the inner
# optimizer's update or not: no copy of the weights or slots. With
# `keras_mp.LossScaleOptimizer(..., skip_on_device=True)` the step never
# waits for the host instead: the update runs in place and each variable is
# then selected between its new and its saved value with `torch.where`.


def torch_backward(model, optimizer, loss_fn, steps):
    import torch

    def train_step(x, y):
        model.zero_grad()
        loss = loss_fn(y, model(x, training=True))
        optimizer.scale_loss(loss).backward()
        grads = [v.value.grad for v in model.trainable_variables]
        with torch.no_grad():
            optimizer.apply(grads, model.trainable_variables)
        return loss

    for x, y in batches(steps):
        train_step(x, y)
    return train_step


# The explicit RFC 293 form on PyTorch: `torch.autograd.grad` of the scaled
# loss with respect to the variables' tensors, then `get_unscaled_gradients`
# and `apply_gradients`, which does not divide them again.


def torch_explicit(model, optimizer, loss_fn, steps):
    import torch

    variables = model.trainable_variables
    for x, y in batches(steps):
        loss = loss_fn(y, model(x, training=True))
        scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = torch.autograd.grad(
            scaled_loss, [v.value for v in variables]
        )
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        with torch.no_grad():
            optimizer.apply_gradients(zip(grads, variables))


def run_torch(steps):
    model, optimizer, loss_fn = setup()
    print("PyTorch, scale_loss(loss).backward() + optimizer.apply:")
    train_step = torch_backward(model, optimizer, loss_fn, steps)
    report(model, optimizer)

    print("One overflowing batch through the same step:")
    before = [
        np.array(keras.ops.convert_to_numpy(v.value))
        for v in model.variables + optimizer.variables
    ]
    train_step(*overflowing_batch())
    after_step_checks(model, optimizer, before)

    print("PyTorch, get_scaled_loss / autograd.grad / get_unscaled_gradients:")
    model, optimizer, loss_fn = setup()
    torch_explicit(model, optimizer, loss_fn, steps)
    report(model, optimizer)


# ## Coming from torch.amp or DeepSpeed
#
# What each piece of a torch.amp loop becomes:
#
# - `torch.autocast("cuda", dtype=torch.float16)` around the forward pass:
#   `keras_mp.set_global_policy("mixed_float16")` before building the model
#   (or `with keras_mp.policy_scope("mixed_float16"):` around building some
#   layers). A policy is decided per layer when the layer is created, not
#   per op while it runs; float32 islands (`precision_rules`) play the part
#   of autocast's float32 op list.
# - `GradScaler(init_scale, growth_factor, backoff_factor, growth_interval)`:
#   `keras_mp.DynamicLossScale(initial_loss_scale=init_scale,
#   multiplier=growth_factor, increment_period=growth_interval)`. One
#   factor does both, so `backoff_factor` is `1 / growth_factor`; keras_mp
#   adds a floor, `min_loss_scale` (1 by default), which GradScaler lacks.
# - `GradScaler(enabled=False)`, as for bfloat16: no loss scale; the
#   `"mixed_bfloat16"` policy has none.
# - `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`:
#   the `LossScaleOptimizer` loops above (it scales, unscales, skips and
#   updates the scale).
# - DeepSpeed's `"fp16"` block: `DynamicLossScale.from_deepspeed(config)`;
#   `initial_scale_power` p gives `2**p`, `loss_scale_window` the
#   `increment_period`, `hysteresis` and `min_loss_scale` keep their names.
#   A static `loss_scale` > 0 is `keras_mp.FixedLossScale(loss_scale)`.
#   The docstring of `from_deepspeed` says where the steps differ (without
#   ZeRO DeepSpeed grows one step later; its hysteresis counts overflows
#   per growth unless `consecutive_hysteresis` is set).
#
# To continue a run, `DynamicLossScale.from_torch(state_dict)` and
# `from_deepspeed(config, state)` take the saved scaler state: the scale
# and the count of finite steps continue where they stopped. Give the
# result to the optimizer, which creates its variables with that state.


def coming_from_torch_or_deepspeed():
    # What `torch.load(...)["scaler"]` holds after `scaler.state_dict()`:
    # 1999 finite steps in a row since the scale last changed.
    grad_scaler_state = {
        "scale": 2.0**14,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 1999,
    }
    scale = keras_mp.DynamicLossScale.from_torch(grad_scaler_state)
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3), loss_scale=scale
    )
    optimizer.build([keras.Variable(np.zeros(3, "float32"))])
    print(
        f"  from a GradScaler: scale {float(optimizer.loss_scale()):g}, "
        f"{int(keras.ops.convert_to_numpy(scale.num_good_steps))} finite "
        "steps counted"
    )
    # The next finite step is the 2000th in a row: the scale doubles, as
    # GradScaler's `update()` would double it. (Called by hand here; the
    # optimizer calls it once per step.)
    scale.update(True)
    print(f"  after one more finite step: {float(scale()):g}")

    ds_config = {
        "train_batch_size": 32,
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
    }
    scale = keras_mp.DynamicLossScale.from_deepspeed(ds_config)
    print(
        f"  from a DeepSpeed fp16 block: scale {float(scale()):g}, "
        f"increment_period {scale.increment_period}, hysteresis "
        f"{scale.hysteresis}, min_loss_scale {scale.min_loss_scale:g}"
    )


def after_step_checks(model, optimizer, before):
    after = [
        np.array(keras.ops.convert_to_numpy(v.value))
        for v in model.variables + optimizer.variables
    ]
    scale_variables = {id(v) for v in optimizer.loss_scale.variables}
    scale_variables.add(id(optimizer.skipped_steps))
    unchanged = all(
        a.tobytes() == b.tobytes()
        for v, a, b in zip(model.variables + optimizer.variables, after, before)
        if id(v) not in scale_variables
    )
    report(model, optimizer)
    print(
        "  weights and Adam's state bit-identical after the skipped step: "
        f"{unchanged}"
    )
    if not unchanged:
        raise SystemExit("A skipped step changed the weights.")


def main(argv=None):
    args = parse_args(argv)
    steps = 5 if args.quick else args.steps
    backend = keras.backend.backend()
    print("Coming from torch.amp or DeepSpeed:")
    coming_from_torch_or_deepspeed()
    if backend == "tensorflow":
        run_tensorflow(steps)
    elif backend == "jax":
        run_jax(steps)
    elif backend == "torch":
        run_torch(steps)
    else:
        print(
            f"No section for the {backend} backend; use fit (see the guide "
            "mixed_precision_with_fit.py)."
        )


if __name__ == "__main__":
    main()
