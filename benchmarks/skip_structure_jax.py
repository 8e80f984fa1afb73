"""How the shape of a skipped-step check costs on XLA, in a bare JAX step.

A hand-written `jax.jit` training step of issue 13's MLP (Dense layers with
relu, softmax cross-entropy, Adam written out with `jax.numpy`, a dynamic
loss scale), with no Keras in the step, so that only the structure of the
skip differs between variants:

- plain: Adam updates each variable from its gradient (XLA may start an
  update as soon as its gradient exists);
- barrier: Adam after an optimization barrier over every gradient (the
  floor of any skip that keeps weights and slots bit for bit);
- check_sum_cond: keras_mp's finite check (`keras_mp.backend.gradients.
  all_finite`: one float32 sum per gradient, `isfinite` of the stacked
  sums) deciding a `lax.cond` around the update, as keras_mp's JAX step
  does;
- check_isfinite_cond: `all(isfinite(g))` per gradient deciding the same
  `lax.cond` (exact, and on XLA's CPU backend not handed to YNNPACK);
- check_bits_cond: an integer `max` of each gradient's exponent bits
  (exact: all ones only for an inf or a NaN) deciding the same `lax.cond`;
- cond_early: the same `lax.cond` on a flag known when the step starts
  (`scale > 0`), which isolates what the conditional itself costs;
- select_late: the sum check, then `where(finite, new, old)` over every
  weight and slot after an unconditional update;
- select_early: the same select on a flag known when the step starts
  (`scale > 0`), which isolates what waiting for the check costs.

Every variant scales the loss and unscales the gradients (barrier and plain
excepted: they compute the plain loss's gradients). In each repeat every
variant runs `--steps` steps (the order rotating between repeats); the
table shows each one's median step time and the median over repeats of its
ratio to plain in the same repeat ("paired"). The figures answer why
keras_mp's JAX step is shaped as it is; `loss_scale_overhead.py` measures
keras_mp itself in `fit`:

    KERAS_BACKEND=jax python benchmarks/skip_structure_jax.py --repeats 21
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_mp.backend import devices  # noqa: E402
from keras_mp.backend import gradients as backend_gradients  # noqa: E402

VARIANTS = (
    "plain",
    "barrier",
    "check_sum_cond",
    "check_isfinite_cond",
    "check_bits_cond",
    "cond_early",
    "select_late",
    "select_early",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=25)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60, help="steps a repeat")
    parser.add_argument("--repeats", type=int, default=15, help="repeats")
    return parser.parse_args(argv)


def init_params(args):
    rng = np.random.default_rng(0)
    sizes = [args.hidden] * (args.layers + 1) + [10]
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        kernel = rng.normal(size=(fan_in, fan_out)) * np.sqrt(2 / fan_in)
        params.append(
            (
                jnp.asarray(kernel, "float32"),
                jnp.zeros((fan_out,), "float32"),
            )
        )
    return params


def loss_fn(params, x, y):
    h = x
    for kernel, bias in params[:-1]:
        h = jax.nn.relu(h @ kernel + bias)
    logits = h @ params[-1][0] + params[-1][1]
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))


def adam(params, m, v, grads, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-7):
    t = t + 1
    alpha = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    m = jax.tree.map(lambda m, g: m + (g - m) * (1 - b1), m, grads)
    v = jax.tree.map(lambda v, g: v + (g * g - v) * (1 - b2), v, grads)
    params = jax.tree.map(
        lambda p, m, v: p - m * alpha / (jnp.sqrt(v) + eps), params, m, v
    )
    return params, m, v, t


_EXPONENT = 0x7F800000  # float32's exponent bits: all ones for inf and NaN


def exponent_max(g):
    """The largest exponent field among the float32 values of `g`."""
    return jnp.max(jax.lax.bitcast_convert_type(g, jnp.int32) & _EXPONENT)


def make_step(variant):
    def step(state, x, y):
        params, m, v, t, scale = state
        if variant == "plain":
            grads = jax.grad(loss_fn)(params, x, y)
            return adam(params, m, v, grads, t) + (scale,)
        if variant == "barrier":
            grads = jax.lax.optimization_barrier(
                jax.grad(loss_fn)(params, x, y)
            )
            return adam(params, m, v, grads, t) + (scale,)
        grads = jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)
        leaves = jax.tree.leaves(grads)
        if variant == "check_isfinite_cond":
            finite = jnp.all(
                jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves])
            )
        elif variant == "check_bits_cond":
            finite = jnp.all(
                jnp.stack([exponent_max(g) != _EXPONENT for g in leaves])
            )
        elif variant in ("cond_early", "select_early"):
            finite = scale > 0
        else:
            finite = backend_gradients.all_finite(leaves)
        inverse = 1 / scale

        def applied():
            unscaled = jax.tree.map(lambda g: g * inverse, grads)
            return adam(params, m, v, unscaled, t)

        if variant.startswith("select"):
            new = applied()
            old = (params, m, v, t)
            params, m, v, t = jax.tree.map(
                lambda a, b: jnp.where(finite, a, b), new, old
            )
        else:
            params, m, v, t = jax.lax.cond(
                finite, applied, lambda: (params, m, v, t)
            )
        return params, m, v, t, jnp.where(finite, scale, scale / 2)

    return jax.jit(step, donate_argnums=0)


def initial_state(params):
    return (
        jax.tree.map(jnp.array, params),
        jax.tree.map(jnp.zeros_like, params),
        jax.tree.map(jnp.zeros_like, params),
        jnp.int32(0),
        jnp.float32(2.0**15),
    )


def run(args):
    params = init_params(args)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(args.batch_size, args.hidden)), "float32")
    y = jnp.asarray(rng.integers(0, 10, size=(args.batch_size,)), "int32")
    steps = {name: make_step(name) for name in VARIANTS}
    states = {}
    for name, step in steps.items():
        states[name] = step(initial_state(params), x, y)
    jax.block_until_ready(states)
    # Every variant must have applied its step (no false skip).
    for name, state in states.items():
        if int(state[3]) != 1:
            raise RuntimeError(f"{name} skipped its first step")
    times = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        shift = repeat % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            state = states[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                state = steps[name](state, x, y)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - start) / args.steps)
            states[name] = state
    # A skipped timed step would halve the scale and change what the
    # variants compute: none may have skipped.
    applied = 1 + args.repeats * args.steps
    for name, state in states.items():
        if int(state[3]) != applied or float(state[4]) != 2.0**15:
            raise RuntimeError(
                f"{name} skipped a timed step (step count {int(state[3])} "
                f"of {applied}, loss scale {float(state[4])}), so its "
                "steps were not comparable."
            )
    return times


def format_table(args, times):
    lines = [
        f"backend=jax jax={jax.__version__} "
        f"device={', '.join(d['name'] for d in devices.device_details())} "
        f"cores={os.cpu_count()} mlp={args.hidden}x{args.layers}-10 "
        f"batch={args.batch_size} steps={args.steps} repeats={args.repeats}",
        f"{'variant':<20} {'median ms/step':>15} {'ratio':<24} {'paired':>7}",
    ]
    for name in VARIANTS:
        paired = statistics.median(
            a / b for a, b in zip(times[name], times["plain"])
        )
        lines.append(
            f"{name:<20} {statistics.median(times[name]) * 1e3:>15.3f} "
            f"{name + '/plain':<24} {paired:>7.3f}"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit(
            "skip_structure_jax.py measures JAX steps and calls keras_mp's "
            "finite check through keras.ops, so it needs the JAX backend. "
            f"Received: KERAS_BACKEND={keras.backend.backend()!r}. Run it "
            "with KERAS_BACKEND=jax."
        )
    print(format_table(args, run(args)))


if __name__ == "__main__":
    main()
