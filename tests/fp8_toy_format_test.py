"""A format plugged in from outside the package (issue 47, item 2): E4M3
in blocks of 64 along each GEMM's contracted axis, with power-of-two
scales, defined here alone as a `Quantizer` subclass and registered with
`keras_mp._fp8.quantizers.register`. It trains, matches a NumPy +
ml_dtypes reference, reports, freezes (in its own frozen form) and
reloads, with no other change to keras_mp."""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp import fp8
from keras_mp import fp8_layers
from keras_mp._fp8 import quantizers
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_bits
from keras_mp._fp8.formats.e4m3_e5m2 import e4m3_values
from keras_mp._fp8.formats.e4m3_e5m2 import encode
from keras_mp._fp8.formats.e4m3_e5m2 import scale_from_amax
from keras_mp._fp8.quantizers.base import pad_rows
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

BLOCK = 64


def _blocked(t, axis):
    """2-D `t` in blocks of 64 along `axis`, and the blocks' axis:
    `[rows, columns / 64, 64]` (axis 1) or `[rows / 64, 64, columns]`
    (axis 0), the unknown dimension first (a traced batch)."""
    if axis == 1:
        return ops.reshape(t, (-1, t.shape[1] // BLOCK, BLOCK)), 2
    return ops.reshape(t, (-1, BLOCK, t.shape[1])), 1


def _unblocked(t, axis):
    columns = t.shape[1] * t.shape[2] if axis == 1 else t.shape[2]
    return ops.reshape(t, (-1, columns))


class Block64(quantizers.Quantizer):
    """E4M3 (E5M2 output gradients where the recipe is hybrid) in blocks
    of 64 along each GEMM's contracted axis, each block with the
    power-of-two scale of its amax."""

    name = "toy_block64"
    quantizes_from_source = True
    frozen_layout = "matrix"

    def _codes(self, t, axis, fmt, margin):
        """Codes of 2-D `t` in blocks along `axis` (`_blocked`) and their
        scales."""
        blocks, block_axis = _blocked(ops.cast(t, "float32"), axis)
        amax = ops.max(ops.abs(blocks), axis=block_axis, keepdims=True)
        scale = scale_from_amax(amax, fmt, margin)
        return encode(blocks / scale, fmt), scale

    def _values(self, call, name, t, axis, fmt):
        codes, scale = self._codes(t, axis, fmt, call.margin)
        if call.rows is not None and name not in call.rows:
            call.observe(name, _blocked(t, axis)[0], scale, fmt)
        return _unblocked(ops.cast(codes, "float32") * scale, axis)

    def quantize(self, x, fmt, axis, margin, scale, block_shape):
        return self._codes(x, axis, fmt, margin)

    def dequantize(self, codes, scale, axis, block_shape):
        return _unblocked(ops.cast(codes, "float32") * scale, axis)

    def check(self, kernel_shape, recipe):
        if any(d is None or d % BLOCK for d in kernel_shape):
            raise ValueError(
                f"{self.name} blocks the kernel along K and N by {BLOCK}. "
                f"Received: kernel.shape={tuple(kernel_shape)}. Use "
                f"dimensions that are multiples of {BLOCK}."
            )

    def forward(self, call, x, w):
        call.saved.update(w=w)
        fmt = call.forward_format
        vx = self._values(call, "input", x, 1, fmt)
        vw = self._values(call, "kernel", w, 0, fmt)
        return ops.matmul(vx, vw)

    def input_gradient(self, call, g):
        vg = self._values(call, "output_gradient", g, 1, call.backward_format)
        vw = self._values(call, "kernel", call.saved["w"], 1, "e4m3")
        return ops.matmul(vg, ops.transpose(vw))

    def kernel_gradient(self, call, g):
        vx = self._values(
            call, "input", pad_rows(call.input(), BLOCK), 0, "e4m3"
        )
        vg = self._values(
            call, "output_gradient", pad_rows(g, BLOCK), 0, call.backward_format
        )
        return ops.matmul(ops.transpose(vx), vg)

    def frozen_variables(self, shape):
        k, n = shape
        return {
            "fp8_kernel_codes": ((k, n), "uint8", "zeros"),
            "fp8_kernel_scale": ((k // BLOCK, n), "float32", "ones"),
        }

    def freeze_kernel(self, kernel, recipe, input_scale=None):
        codes, scale = self._codes(kernel, 0, "e4m3", recipe.margin)
        bits = e4m3_bits(ops.cast(codes, "float32"))
        return {
            "fp8_kernel_codes": ops.reshape(bits, ops.shape(kernel)),
            "fp8_kernel_scale": ops.reshape(scale, (-1, ops.shape(kernel)[1])),
        }

    def kernel_from_frozen(self, state, recipe):
        values, _ = _blocked(e4m3_values(state["fp8_kernel_codes"]), 0)
        scale = ops.expand_dims(state["fp8_kernel_scale"], 1)
        # The forward quantizes these values again to the same ones: each
        # block's amax gives back its scale or half of it, and doubling an
        # E4M3 code below 448 is exact.
        current = fp8.Recipe(
            granularity=self.name, formats=recipe.formats, margin=recipe.margin
        )
        return _unblocked(values * scale, 0), dict(recipe=current)


quantizers.register(Block64())
RECIPE = fp8.Recipe(granularity="toy_block64")


def _reference_values(t, axis, fmt):
    """`t` quantized in blocks of 64 along `axis` and dequantized, in
    NumPy and ml_dtypes."""
    t = np.asarray(t, np.float32)
    moved = np.moveaxis(t, axis, 0)
    blocks = moved.reshape(-1, BLOCK, moved.shape[1])
    scale = reference.scale(np.max(np.abs(blocks), axis=1, keepdims=True), fmt)
    values = reference.encode(blocks, scale, fmt).astype(np.float32) * scale
    return np.moveaxis(values.reshape(moved.shape), 0, axis)


def _model(recipe):
    keras_mp.set_global_policy("float32", fp8=recipe)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(128, activation="relu", name="up")(inputs)
        hidden = keras.layers.Dense(64, name="down")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))
    finally:
        keras_mp.set_global_policy(None)
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    return x, np.tanh(x[:, :4] * 2 - x[:, 4:8])


def test_a_registered_format_names_a_recipe_and_its_layers_run_it():
    model = _model(RECIPE)
    for name in ("up", "down"):
        recipe = fp8_layers.layer_recipe(model.get_layer(name))
        assert recipe.granularity == "toy_block64"
        assert isinstance(quantizers.get(recipe), Block64)
    assert fp8_layers.layer_recipe(model.get_layer("head")) is None
    restored = fp8.Recipe.from_config(RECIPE.get_config())
    assert restored == RECIPE


def test_register_refuses_a_builtin_name_and_a_non_quantizer():
    class Clash(Block64):
        name = "rowwise"

    with pytest.raises(ValueError, match="Received: name='rowwise'"):
        quantizers.register(Clash())
    with pytest.raises(TypeError, match="Quantizer"):
        quantizers.register(object())


def test_the_forward_and_input_gradient_match_numpy_and_ml_dtypes():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 128)).astype(np.float32) * 3
    w = rng.normal(size=(128, 64)).astype(np.float32) / 8
    g = rng.normal(size=(32, 64)).astype(np.float32)
    out = to_numpy(fp8.dot(x, w, recipe=RECIPE))
    expected = _reference_values(x, 1, "e4m3") @ _reference_values(w, 0, "e4m3")
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    # E5M2 output gradients: the recipe is hybrid.
    dx = _reference_values(g, 1, "e5m2") @ _reference_values(w, 1, "e4m3").T
    x_tensor = ops.convert_to_tensor(x)
    if keras.backend.backend() == "jax":
        import jax

        _, vjp = jax.vjp(lambda t: fp8.dot(t, w, recipe=RECIPE), x_tensor)
        (grad,) = vjp(ops.convert_to_tensor(g))
    elif keras.backend.backend() == "torch":
        import torch

        x_tensor.requires_grad_(True)
        fp8.dot(x_tensor, w, recipe=RECIPE).backward(torch.as_tensor(g))
        grad = x_tensor.grad
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(x_tensor)
            y = fp8.dot(x_tensor, w, recipe=RECIPE)
        grad = tape.gradient(y, x_tensor, output_gradients=tf.constant(g))
    np.testing.assert_allclose(to_numpy(grad), dx, rtol=1e-5, atol=1e-5)


def test_it_trains_reports_freezes_and_reloads(tmp_path):
    model = _model(fp8.Recipe(granularity="toy_block64", stats=True))
    x, y = _data()
    history = model.fit(x, y, batch_size=64, epochs=8, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses

    report = fp8.report(model)
    rows = {(row.layer, row.tensor): row for row in report.rows}
    for name in ("up", "down"):
        path = next(layer for layer, _ in rows if layer.endswith(name))
        assert rows[(path, "input")].format == "e4m3"
        assert rows[(path, "output_gradient")].format == "e5m2"
        assert rows[(path, "kernel")].count > 0

    before = to_numpy(model.predict(x, verbose=0))
    fp8.freeze(model)
    up = model.get_layer("up")
    assert up.dtype_policy.fp8.scaling == "static"
    assert up.dtype_policy.fp8.granularity == "toy_block64"
    state = {v.name: v for v in up.weights}
    assert "kernel" not in state and "fp8_input_scale" not in state
    assert tuple(state["fp8_kernel_codes"].shape) == (64, 128)
    assert state["fp8_kernel_codes"].dtype == "uint8"
    assert tuple(state["fp8_kernel_scale"].shape) == (1, 128)
    after = to_numpy(model.predict(x, verbose=0))
    np.testing.assert_array_equal(after, before)
    # The stored codes are the kernel's E4M3 codes in blocks of 64.
    codes = to_numpy(state["fp8_kernel_codes"]).view(ml_dtypes.float8_e4m3fn)
    stored = codes.astype(np.float32) * to_numpy(state["fp8_kernel_scale"])
    assert np.all(np.isfinite(stored))

    path = tmp_path / "toy.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_array_equal(
        to_numpy(restored.predict(x, verbose=0)), after
    )
