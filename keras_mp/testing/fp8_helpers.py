"""Fixtures and checks of the FP8 tests: GEMMs and their gradients,
operands of spread magnitudes, FP8 codes' bits, an FP8 MLP trained, saved
and loaded back."""

import numpy as np

from keras_mp.testing.asserts import to_numpy

_GEMMS_JITTED = {}


def branched_fp8_model(recipes, policy, use_bias=True, features=32, units=16):
    """A model of FP8 Dense layers: `recipes[0]`'s layer `"twice"` (width
    `features`) called twice, then one branch `"d0"`, `"d1"`, ... of
    `units` per other recipe, concatenated (uncompiled). A layer whose
    gradients sum two calls' beside layers of other recipes, on the
    same input."""
    import keras

    import keras_mp

    inputs = keras.Input((features,))
    twice = keras.layers.Dense(
        features,
        use_bias=use_bias,
        dtype=keras_mp.Policy(policy, fp8=recipes[0]),
        name="twice",
    )
    hidden = twice(twice(inputs))
    outputs = [
        keras.layers.Dense(
            units, dtype=keras_mp.Policy(policy, fp8=recipe), name=f"d{i}"
        )(hidden)
        for i, recipe in enumerate(recipes[1:])
    ]
    return keras.Model(inputs, keras.layers.Concatenate()(outputs))


def gemm_and_gradients(function, x, kernel, g, jit=True):
    """`function(x, kernel)` and its gradients for output gradient `g`
    (on JAX in one `jax.jit`, unless `jit=False`: op by op, JAX compiles
    each op for each new shape, ten times slower here)."""
    import keras
    from keras import ops

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def step(x, kernel, g):
            out, vjp = jax.vjp(function, x, kernel)
            return (out, *vjp(ops.cast(g, out.dtype)))

        if not jit:
            return step(x, kernel, g)
        if function not in _GEMMS_JITTED:
            _GEMMS_JITTED[function] = jax.jit(step)
        return _GEMMS_JITTED[function](x, kernel, g)
    if backend == "tensorflow":
        import tensorflow as tf

        x, kernel = tf.convert_to_tensor(x), tf.convert_to_tensor(kernel)
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            out = function(x, kernel)
        g = tf.cast(tf.convert_to_tensor(g), out.dtype)
        return (out, *tape.gradient(out, [x, kernel], output_gradients=g))
    x = ops.convert_to_tensor(x).detach().clone().requires_grad_(True)
    kernel = ops.convert_to_tensor(kernel).detach().clone().requires_grad_(True)
    out = function(x, kernel)
    out.backward(ops.convert_to_tensor(g).to(out.dtype))
    return out.detach(), x.grad, kernel.grad


def fp8_mlp_fit_and_reload(recipe, path, outputs):
    """A 64-64-`outputs` MLP trained for 3 epochs under
    `set_global_policy("mixed_bfloat16", fp8=recipe)`, saved to `path`
    (`.keras`) and loaded back.

    Returns:
        A dict: `"losses"` (the epochs' losses), `"fp8"` (the Dense
        layers' FP8 column of `explain_precision`), `"restored_recipe"`
        (the loaded first layer's recipe), and `"predictions"` (the
        trained and the loaded model's, NumPy).
    """
    import keras

    import keras_mp

    keras_mp.set_global_policy("mixed_bfloat16", fp8=recipe)
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(outputs),
            ]
        )
        x = np.random.default_rng(0).normal(size=(64, 64)).astype("float32")
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        history = model.fit(
            x, x[:, :outputs], batch_size=16, epochs=3, verbose=0
        )
        rows = keras_mp.explain_precision(model, print_fn=None)
    finally:
        keras_mp.set_global_policy(None)
    model.save(path)
    restored = keras.saving.load_model(path)
    return {
        "losses": history.history["loss"],
        "fp8": [row["fp8"] for row in rows if row["class_name"] == "Dense"],
        "restored_recipe": restored.layers[0].dtype_policy.fp8,
        "predictions": [
            to_numpy(m.predict(x, verbose=0)) for m in (model, restored)
        ],
    }


def block_spread_operands(m, k, n, seed=0):
    """`x [m, k]`, a kernel `[k, n]` and an output gradient `[m, n]` in
    float32 whose rows (x, g) and columns (the kernel) span very different
    magnitudes (2**-6 to 2**6), so each block's scale of a block format
    matters."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)) * np.exp2(rng.uniform(-6, 6, (m, 1)))
    w = rng.normal(size=(k, n)) * np.exp2(rng.uniform(-6, 6, (1, n)))
    g = rng.normal(size=(m, n)) * np.exp2(rng.uniform(-6, 6, (m, 1)))
    return x.astype("float32"), w.astype("float32"), g.astype("float32")


def backend_einsum(equation, a, b):
    """The backend's own float32 GEMM of NumPy operands, as `fp8.dot`
    writes its GEMMs, as a NumPy array."""
    from keras import ops

    return to_numpy(
        ops.einsum(equation, ops.convert_to_tensor(a), ops.convert_to_tensor(b))
    )


def fp8_code_bits(codes):
    """The uint8 bit patterns of FP8 codes (a tensor), as NumPy."""
    import keras
    from keras import ops

    if keras.backend.backend() == "torch":
        return to_numpy(ops.view(codes, "uint8"))
    # Flattened first: TensorFlow cannot convert a 0-d FP8 tensor.
    flat = np.asarray(ops.convert_to_numpy(ops.reshape(codes, (-1,))))
    return flat.view(np.uint8).reshape(tuple(codes.shape))


def assert_fp8_codes_equal(codes, expected):
    """FP8 `codes` (a tensor) hold `expected`'s (an `ml_dtypes` array)
    bits, NaN payloads aside: where `expected` is NaN, NaN-ness alone."""
    from keras import ops

    bits, expected_bits = fp8_code_bits(codes), expected.view(np.uint8)
    assert bits.shape == expected_bits.shape
    expected_nan = np.isnan(expected.astype(np.float32))
    nan = np.isnan(to_numpy(ops.cast(codes, "float32")))
    np.testing.assert_array_equal(nan, expected_nan)
    mismatch = (bits != expected_bits) & ~expected_nan
    assert not mismatch.any(), (
        f"{mismatch.sum()} codes differ, e.g. got {bits[mismatch][:5]}, "
        f"expected {expected_bits[mismatch][:5]}"
    )
