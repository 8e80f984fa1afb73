"""LoRA on FP8 layers (issue 22, item 4): `layer.enable_lora(rank)` on an FP8
Dense or EinsumDense runs the frozen base kernel's GEMM in FP8 and the
low-rank path `x @ A @ B * alpha / rank` in the compute dtype, so an update
smaller than the kernel's FP8 rounding still changes the output; `fit`
trains A and B and leaves the base kernel bit-identical."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import fp8
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy


def _stored(variable):
    with keras_mp.enable_autocast(None):
        return keras.ops.copy(variable)


def _on_the_grid(shape, seed):
    """Float32 values of E4M3 codes times 2**-4, of magnitudes 16 ... 448
    times 2**-4 (an FP8 spacing of 2**-3 or more), with the tensor's amax
    at E4M3's 448 * 2**-4: the default recipe's kernel scale is 2**-4 and
    quantizes these values to themselves."""
    rng = np.random.default_rng(seed)
    w = rng.uniform(16, 448, size=shape) * rng.choice([-1, 1], size=shape)
    w = w.astype(np.float32)
    w.flat[0] = 448.0
    codes = reference.encode(w, np.float32(1.0), "e4m3").astype(np.float32)
    return codes / 16


def _lora_layer(layer, kernel, a, b, alpha):
    layer.kernel.assign(kernel)
    layer.enable_lora(a.shape[-1], lora_alpha=alpha)
    layer.lora_kernel_a.assign(a)
    layer.lora_kernel_b.assign(b)
    return layer


def _tiny_update(a_shape, n, seed):
    """A and B whose product is far below the kernel's FP8 spacing."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=a_shape).astype(np.float32)
    b = (rng.normal(size=(a_shape[-1], n)) * 1e-4).astype(np.float32)
    return a, b


@pytest.mark.parametrize("kind", ["dense", "einsum_dense"])
def test_the_low_rank_path_is_added_outside_fp8(kind):
    policy = keras_mp.Policy("float32", fp8=True)
    rng = np.random.default_rng(1)
    if kind == "dense":
        layer = keras.layers.Dense(32, use_bias=False, dtype=policy)
        x = rng.normal(size=(8, 64)).astype(np.float32)
        layer.build((None, 64))
        kernel = _on_the_grid((64, 32), seed=2)
        a, b = _tiny_update((64, 4), 32, seed=3)
        equation = "mk,kn->mn"
    else:
        layer = keras.layers.EinsumDense(
            "abc,cde->abde", (5, 3, 16), dtype=policy
        )
        x = rng.normal(size=(2, 5, 64)).astype(np.float32)
        layer.build((None, 5, 64))
        kernel = _on_the_grid((64, 3, 16), seed=2)
        a, b = _tiny_update((64, 3, 4), 16, seed=3)
        equation = "abc,cde->abde"
    alpha = 8
    _lora_layer(layer, kernel, a, b, alpha)
    # What the FP8 GEMM gives for the base kernel alone, and for Keras's
    # merged kernel `W + A @ B * alpha / rank`: the same codes, so merging
    # first would lose the update entirely.
    merged = kernel + (a @ b) * (alpha / 4)
    assert not np.array_equal(merged, kernel)
    base = to_numpy(fp8.einsum(equation, x, kernel))
    np.testing.assert_array_equal(
        to_numpy(fp8.einsum(equation, x, merged)), base
    )
    out = to_numpy(layer(x))
    update = np.einsum(
        equation, x.astype(np.float64), (a @ b).astype(np.float64)
    )
    update *= alpha / 4
    assert np.abs(update).max() > 1e-3
    np.testing.assert_allclose(out - base, update, rtol=0, atol=2e-5)


def _lora_model(lora=True):
    """A Dense and an EinsumDense in FP8 by the default rules under
    mixed_bfloat16, each with LoRA of rank 4 (unless `lora=False`)."""
    keras_mp.set_global_policy("mixed_bfloat16", fp8=True)
    try:
        x = keras.Input((16, 64))
        h = keras.layers.Dense(64, activation="relu", name="up")(x)
        h = keras.layers.EinsumDense("abc,cd->abd", (None, 64), name="proj")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(x, keras.layers.Dense(4, name="logits")(h))
        if lora:
            model.get_layer("up").enable_lora(4)
            model.get_layer("proj").enable_lora(4)
    finally:
        keras_mp.set_global_policy("float32")
    return model


def test_fit_trains_the_low_rank_weights_and_leaves_the_fp8_base_alone():
    model = _lora_model()
    rows = keras_mp.explain_precision(model, print_fn=None)
    table = {row["layer"]: row["fp8"] for row in rows}
    assert table["up"] == table["proj"] == "current/tensorwise/hybrid"
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 16, 64)).astype(np.float32)
    y = rng.normal(size=(32, 4)).astype(np.float32)
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    before = {v.path: to_numpy(_stored(v)) for v in model.weights}
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for layer in ("up", "proj"):
        path = f"{layer}/kernel"
        kernel = model.get_layer(layer)._kernel
        np.testing.assert_array_equal(
            to_numpy(_stored(kernel)), before[kernel.path], err_msg=path
        )
        lora_b = model.get_layer(layer).lora_kernel_b
        # B starts at zero (Keras's initializer) and must have moved.
        assert np.abs(to_numpy(lora_b)).max() > 0, layer
        assert np.isfinite(to_numpy(lora_b)).all()


def _fine_tuned():
    """The LoRA model after a few steps of `fit`, and its inputs."""
    model = _lora_model()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 16, 64)).astype(np.float32)
    y = rng.normal(size=(16, 4)).astype(np.float32)
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model, x


def _lora_state(model):
    return {
        f"{name}/{part}": to_numpy(
            _stored(getattr(model.get_layer(name), part))
        )
        for name in ("up", "proj")
        for part in ("_kernel", "lora_kernel_a", "lora_kernel_b")
    }


def _assert_same_lora_model(got, model, x):
    """`got` holds `model`'s W, A and B and predicts as it does, bit for
    bit."""
    expected = _lora_state(model)
    for key, value in _lora_state(got).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    np.testing.assert_array_equal(
        to_numpy(got.predict(x, verbose=0)),
        to_numpy(model.predict(x, verbose=0)),
    )


def test_weights_reload_into_a_fresh_lora_model_exactly(tmp_path):
    # Keras saves the kernel with A @ B merged into it (rounded to the
    # compute dtype); rounded again to FP8, a small update would be lost.
    # keras_mp also saves W, A and B, and an FP8 layer with LoRA reloads
    # them as they were: the same predictions, bit for bit.
    model, x = _fine_tuned()
    path = str(tmp_path / "lora.weights.h5")
    model.save_weights(path)
    fresh = _lora_model()
    fresh.load_weights(path)
    _assert_same_lora_model(fresh, model, x)
    # A model without LoRA loads Keras's merged kernel, as it would from
    # Keras alone.
    plain = _lora_model(lora=False)
    plain.load_weights(path)
    layer = model.get_layer("up")
    merged = to_numpy(layer.kernel).astype(np.float32)  # Keras's merge
    np.testing.assert_array_equal(
        to_numpy(_stored(plain.get_layer("up").kernel)), merged
    )


def test_a_saved_lora_model_reloads_and_predicts_the_same(tmp_path):
    model, x = _fine_tuned()
    path = str(tmp_path / "lora.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    assert reloaded.get_layer("up").lora_enabled
    _assert_same_lora_model(reloaded, model, x)


def test_a_lora_layer_with_statistics_reloads_its_carrier(tmp_path):
    # Keras saves no A and B entries: the carrier is found after the
    # entries Keras does save.
    from keras_mp._fp8 import stats

    def build():
        keras_mp.set_global_policy("mixed_bfloat16", fp8=fp8.Recipe(stats=True))
        try:
            inputs = keras.Input((64,))
            hidden = keras.layers.Dense(64, name="up")(inputs)
            model = keras.Model(
                inputs, keras.layers.Dense(4, name="out")(hidden)
            )
            model.get_layer("up").enable_lora(4)
        finally:
            keras_mp.set_global_policy("float32")
        return model

    keras.utils.set_random_seed(0)
    model = build()
    rng = np.random.default_rng(6)
    x = rng.normal(size=(16, 64)).astype(np.float32)
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, np.zeros((16, 4), np.float32), epochs=2, verbose=0)
    path = str(tmp_path / "lora_stats.weights.h5")
    model.save_weights(path)
    fresh = build()
    fresh.load_weights(path)
    carrier = to_numpy(stats.layer_carrier(model.get_layer("up")))
    assert carrier.any()
    np.testing.assert_array_equal(
        to_numpy(stats.layer_carrier(fresh.get_layer("up"))), carrier
    )
    np.testing.assert_array_equal(
        to_numpy(fresh.predict(x, verbose=0)),
        to_numpy(model.predict(x, verbose=0)),
    )
