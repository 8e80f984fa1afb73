"""FP8 against bfloat16 on a GPU: the GEMM, `fp8.dot`, and a training step.

Needs a GPU with FP8 tensor cores (H100/H200, Ada); run it on the backend
named by KERAS_BACKEND (torch or jax). It lives outside `benchmarks/*.py`,
which the test suite runs on a CPU, because on a CPU every number here
would be emulation. Three measurements, each paired with bfloat16 in the
same process (median of `--repeats` timings of `--iterations` calls):

1. The GEMM alone, `M = K = N = --size` (8192): `keras.ops.matmul` of
   bfloat16 operands against `keras_mp.backend.fp8.einsum_float32` of FP8
   codes (E4M3 x E4M3, float32 accumulation), the product `fp8.dot` runs.
2. `keras_mp.fp8.dot` forward and backward (quantization included:
   amaxes, scales, casts; tensorwise, hybrid) against `keras.ops.matmul`
   of bfloat16 operands forward and backward.
3. A training step of an MLP of `--layers` Dense layers `--width` wide
   under `mixed_bfloat16`, without and with `fp8=Recipe()` (the default
   rules put every hidden Dense in FP8; the output layer stays bfloat16).

    KERAS_BACKEND=torch python benchmarks/gpu/fp8_gemm.py
    KERAS_BACKEND=jax python benchmarks/gpu/fp8_gemm.py --size 4096
"""

import argparse
import statistics
import time

import keras
import numpy as np

import keras_mp
from keras_mp.backend import fp8 as fp8_backend


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    return parser.parse_args(argv)


def synchronize(value=None):
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif backend == "jax" and value is not None:
        import jax

        jax.block_until_ready(value)


def timed(fn, iterations, repeats):
    """Median seconds per call of `fn` (after two warm-up calls)."""
    for _ in range(2):
        synchronize(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            out = fn()
        synchronize(out)
        times.append((time.perf_counter() - start) / iterations)
    return statistics.median(times)


def describe_device():
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        device = (
            torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        )
        return f"torch {torch.__version__}, {device}"
    import jax

    return f"jax {jax.__version__}, {jax.devices()[0].device_kind}"


def gemm_functions(args):
    """(bfloat16 matmul, FP8 codes product), both jitted on JAX."""
    rng = np.random.default_rng(0)
    size = args.size
    a = rng.standard_normal((size, size), dtype="float32")
    b = rng.standard_normal((size, size), dtype="float32")
    a16 = keras.ops.convert_to_tensor(a, "bfloat16")
    b16 = keras.ops.convert_to_tensor(b, "bfloat16")
    a8 = keras.ops.cast(keras.ops.convert_to_tensor(a), "float8_e4m3fn")
    b8 = keras.ops.cast(keras.ops.convert_to_tensor(b), "float8_e4m3fn")

    def bf16():
        return keras.ops.matmul(a16, b16)

    def fp8():
        return fp8_backend.einsum_float32("mk,kn->mn", a8, b8)

    return _jit(bf16), _jit(fp8)


def dot_functions(args):
    """Forward and backward of a bfloat16 matmul and of `fp8.dot`."""
    rng = np.random.default_rng(1)
    size = args.size
    x = keras.ops.convert_to_tensor(
        rng.standard_normal((size, size), dtype="float32"), "bfloat16"
    )
    w = keras.ops.convert_to_tensor(
        rng.standard_normal((size, size), dtype="float32") * 0.01
    )
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def loss_bf16(x, w):
            return keras.ops.sum(
                keras.ops.matmul(x, keras.ops.cast(w, "bfloat16"))
            )

        def loss_fp8(x, w):
            return keras.ops.sum(
                keras_mp.fp8.dot(x, w, output_dtype="bfloat16")
            )

        g16 = jax.jit(jax.grad(loss_bf16, argnums=(0, 1)))
        g8 = jax.jit(jax.grad(loss_fp8, argnums=(0, 1)))
        return (lambda: g16(x, w)), (lambda: g8(x, w))
    import torch

    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)

    def bf16():
        y = torch.matmul(x, w.to(torch.bfloat16))
        return torch.autograd.grad(y.sum(), (x, w))

    def fp8():
        y = keras_mp.fp8.dot(x, w, output_dtype="bfloat16")
        return torch.autograd.grad(y.sum(), (x, w))

    return bf16, fp8


def _jit(fn):
    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn)
    return fn


def build_model(args, fp8):
    keras_mp.set_global_policy(
        "mixed_bfloat16", fp8=keras_mp.fp8.Recipe() if fp8 else None
    )
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((args.width,))
        x = inputs
        for _ in range(args.layers):
            x = keras.layers.Dense(args.width, activation="gelu")(x)
        outputs = keras.layers.Dense(16, dtype="float32")(x)
        model = keras.Model(inputs, outputs)
        model.compile(
            keras.optimizers.Adam(1e-4),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    finally:
        keras_mp.set_global_policy(None)
    return model


def step_seconds(args):
    rng = np.random.default_rng(2)
    rows = args.batch_size * args.steps
    x = rng.standard_normal((rows, args.width), dtype="float32")
    y = rng.integers(0, 16, size=(rows,))
    results = {}
    models = {
        name: build_model(args, name == "fp8") for name in ("bf16", "fp8")
    }
    for model in models.values():
        model.fit(
            x[: 2 * args.batch_size],
            y[: 2 * args.batch_size],
            batch_size=args.batch_size,
            verbose=0,
        )
    for name in models:
        results[name] = []
    for _ in range(args.repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=args.batch_size, verbose=0)
            results[name].append((time.perf_counter() - start) / args.steps)
    return {name: statistics.median(t) for name, t in results.items()}


def main(argv=None):
    args = parse_args(argv)
    print(f"# {describe_device()}, keras {keras.__version__}")
    flops = 2 * args.size**3
    bf16, fp8 = gemm_functions(args)
    t16 = timed(bf16, args.iterations, args.repeats)
    t8 = timed(fp8, args.iterations, args.repeats)
    print(
        f"GEMM {args.size}^3: bf16 {t16 * 1e3:.3f} ms "
        f"({flops / t16 / 1e12:.0f} TFLOP/s), fp8 codes {t8 * 1e3:.3f} ms "
        f"({flops / t8 / 1e12:.0f} TFLOP/s); bf16/fp8 = {t16 / t8:.2f}"
    )
    bf16, fp8 = dot_functions(args)
    t16 = timed(bf16, args.iterations, args.repeats)
    t8 = timed(fp8, args.iterations, args.repeats)
    print(
        f"forward+backward {args.size}^3: bf16 matmul {t16 * 1e3:.3f} ms, "
        f"fp8.dot {t8 * 1e3:.3f} ms; bf16/fp8 = {t16 / t8:.2f}"
    )
    steps = step_seconds(args)
    print(
        f"training step, MLP {args.layers}x{args.width}, batch "
        f"{args.batch_size}: mixed_bfloat16 {steps['bf16'] * 1e3:.2f} ms, "
        f"fp8 tensorwise {steps['fp8'] * 1e3:.2f} ms; "
        f"bf16/fp8 = {steps['bf16'] / steps['fp8']:.2f}"
    )


if __name__ == "__main__":
    main()
