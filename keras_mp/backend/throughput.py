"""Compiled matmuls to time, one per backend, for `keras_mp.recommend_policy`.

Imports nothing from keras_mp.

Each runner multiplies a square matrix by another `chain` times in one
compiled call and returns only a scalar, so a call costs `2 * size**3 *
chain` floating point operations plus a negligible reduction and transfer.
The second matrix holds values near `1 / size`, which keeps every product
near 0.5: no overflow in float16, no subnormals anywhere, so no dtype is
timed on a slow path that training would not take.
"""

import keras
import numpy as np


def _operands(size, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.0, 1.0, (size, size)).astype("float32")
    b = rng.uniform(0.0, 2.0 / size, (size, size)).astype("float32")
    return a, b


def _tensorflow_runner(dtype, size, chain):
    import tensorflow as tf

    a, b = (tf.cast(tf.constant(m), dtype) for m in _operands(size))
    # As `Model.fit` with `jit_compile="auto"` on this backend: XLA only where
    # TensorFlow sees an accelerator. On CPUs fit runs TensorFlow's own
    # kernels (oneDNN), which are what training speed depends on there.
    jit = any(d.device_type != "CPU" for d in tf.config.list_physical_devices())

    @tf.function(jit_compile=jit)
    def run(a, b):
        x = a
        for _ in range(chain):
            x = tf.linalg.matmul(x, b)
        return tf.reduce_sum(tf.cast(x, "float32"))

    return lambda: run(a, b).numpy()


def _jax_runner(dtype, size, chain):
    import jax
    import jax.numpy as jnp

    a, b = (jnp.asarray(m, dtype=dtype) for m in _operands(size))

    @jax.jit
    def run(a, b):
        x = a
        for _ in range(chain):
            x = x @ b
        return jnp.sum(x.astype("float32"))

    return lambda: run(a, b).block_until_ready()


def _eager_runner(dtype, size, chain):
    # Backends without a graph compiler of their own here (torch, numpy):
    # eager kernels are what their training loops run.
    from keras import ops

    a, b = (ops.cast(ops.convert_to_tensor(m), dtype) for m in _operands(size))

    def run():
        x = a
        for _ in range(chain):
            x = ops.matmul(x, b)
        return ops.convert_to_numpy(ops.sum(ops.cast(x, "float32")))

    return run


def _torch_device_type():
    from keras import ops

    return ops.convert_to_tensor(0.0).device.type


def dtype_notes(details):
    """How the matmuls of each dtype really run here, where not as named.

    The runners call the same matmul that Keras layers call, so their
    timings are what training would see; these notes say why a dtype's
    figure may be a float32 one, or an emulation.

    Args:
        details: `devices.device_details()` of this process.

    Returns:
        A dict from dtype name to a short note, for the dtypes that do not
        run natively as themselves.
    """
    notes = {}
    on_cpu = all(d["kind"] == "cpu" for d in details)
    if keras.backend.backend() == "torch" and _torch_device_type() == "cpu":
        # keras.src.backend.torch.numpy.matmul (keras 3.0 - 3.15).
        notes["float16"] = (
            "upcast: Keras runs float16 matmuls on torch CPUs in float32, "
            "with a cast in and out"
        )
    if on_cpu and not all(d["native_bfloat16"] for d in details):
        notes["bfloat16"] = "emulated: this CPU has no bfloat16 instructions"
    return notes


def matmul_runner(dtype, size, chain):
    """A zero-argument callable running `chain` compiled matmuls to the end.

    Args:
        dtype: `"float32"`, `"float16"` or `"bfloat16"`.
        size: Side of the square matrices.
        chain: Matmuls per call.

    Returns:
        A callable that runs them on the active backend's default device
        and returns only once the result is computed.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _tensorflow_runner(dtype, size, chain)
    if backend == "jax":
        return _jax_runner(dtype, size, chain)
    return _eager_runner(dtype, size, chain)
