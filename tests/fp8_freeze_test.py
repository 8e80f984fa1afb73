"""`keras_mp.fp8.freeze` (issue 22, item 5): a trained FP8 model made an
inference model whose kernels are FP8 codes and scales (half of bfloat16's
kernel bytes), with fixed input scales, that saves, reloads and predicts
as the trained model did."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import fp8
from keras_mp import fp8_layers
from keras_mp.testing import assert_bitwise_equal
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

FP8_LAYERS = ("up", "down")


def _model(recipe, lora=False):
    keras_mp.set_global_policy("mixed_bfloat16", fp8=recipe)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(128, activation="relu", name="up")(inputs)
        hidden = keras.layers.Dense(64, name="down")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden))
    finally:
        keras_mp.set_global_policy(None)
    if lora:
        model.get_layer("down").enable_lora(4)
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(256, 64)).astype(np.float32),
        rng.integers(0, 10, size=256),
    )


def _trained(recipe, lora=False, steps=2):
    model = _model(recipe, lora)
    model.compile(
        keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _data()
    model.fit(x, y, batch_size=64, epochs=steps, verbose=0)
    return model


def _merged_kernels(model):
    kernels = {}
    for name in FP8_LAYERS:
        with keras_mp.enable_autocast(None):
            kernels[name] = to_numpy(model.get_layer(name).kernel)
    return kernels


def _relative_difference(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_a_frozen_model_stores_codes_in_half_the_bytes_and_predicts_alike(
    lora,
):
    model = _trained(fp8.Recipe(scaling="delayed", amax_history=16), lora)
    x, _ = _data(1)
    trained = to_numpy(model.predict(x, verbose=0))
    kernels = _merged_kernels(model)
    fp8.freeze(model)
    frozen = to_numpy(model.predict(x, verbose=0))
    paths = [w.path for w in model.weights]
    for name in FP8_LAYERS:
        layer = model.get_layer(name)
        assert f"{name}/kernel" not in paths
        assert not any("lora" in p for p in paths if p.startswith(name))
        state = {
            k: to_numpy(v) for k, v in fp8_layers.static_state(layer).items()
        }
        codes = state["fp8_kernel_codes"]
        # One byte a value: half of the bfloat16 kernel's bytes.
        bfloat16_bytes = kernels[name].size * 2
        assert codes.dtype == np.uint8 and codes.nbytes * 2 == bfloat16_bytes
        scale = reference.scale(np.abs(kernels[name]).max(), "e4m3")
        assert state["fp8_kernel_scale"] == scale
        expected = reference.encode(kernels[name], scale, "e4m3")
        assert_bitwise_equal(codes, expected.view(np.uint8))
        assert not layer.trainable
    # Delayed scaling left each layer's scales: the frozen model predicts
    # as the trained one, within a thousandth of its largest output. LoRA's
    # update, merged into the kernel's FP8 codes, is rounded with it (0.03
    # of the largest output here, after a large update: Adam at 1e-2).
    difference = _relative_difference(frozen, trained)
    print(f"relative prediction difference: {difference:.2e}")
    assert difference <= (5e-2 if lora else 1e-3)
    assert keras_mp.explain_precision(model, print_fn=None)[1]["fp8"] == (
        "static/tensorwise/hybrid"
    )


def test_a_frozen_model_saves_and_reloads_bit_for_bit(tmp_path):
    model = _trained(fp8.Recipe(scaling="delayed", amax_history=4))
    fp8.freeze(model)
    x, _ = _data(2)
    expected = to_numpy(model.predict(x, verbose=0))
    path = str(tmp_path / "frozen.keras")
    model.save(path)
    reloaded = keras.models.load_model(path, compile=False)
    assert_bitwise_equal(to_numpy(reloaded.predict(x, verbose=0)), expected)
    weights = str(tmp_path / "frozen.weights.h5")
    model.save_weights(weights)
    other = fp8.freeze(
        _trained(fp8.Recipe(scaling="delayed", amax_history=4), steps=1)
    )
    other.load_weights(weights)
    assert_bitwise_equal(to_numpy(other.predict(x, verbose=0)), expected)
    # An unfrozen checkpoint has no codes: a frozen model says so.
    unfrozen = str(tmp_path / "unfrozen.weights.h5")
    _model(fp8.Recipe()).save_weights(unfrozen)
    with pytest.raises(ValueError, match="frozen"):
        other.load_weights(unfrozen)


def test_current_scaling_needs_calibration_data_for_its_input_scales():
    model = _trained(fp8.Recipe())
    with pytest.raises(ValueError, match="calibration_data"):
        fp8.freeze(model)
    # Nothing was half-applied.
    assert {w.path for w in model.weights} >= {"up/kernel", "down/kernel"}
    x, _ = _data(3)
    trained = to_numpy(model.predict(x, verbose=0))
    fp8.freeze(model, calibration_data=x)
    scale = fp8_layers.static_state(model.get_layer("up"))["fp8_input_scale"]
    assert to_numpy(scale) == reference.scale(np.abs(x).max(), "e4m3")
    frozen = to_numpy(model.predict(x, verbose=0))
    # The calibrated scale is the whole set's; a batch whose amax has a
    # smaller power-of-two scale would lose a little of E4M3's range at
    # the bottom. Here every 32-row batch has the set's scale: 0 measured.
    assert _relative_difference(frozen, trained) <= 2e-2


def test_statistics_give_the_input_scale():
    model = _trained(fp8.Recipe(stats=True))
    fp8.freeze(model)
    for name in FP8_LAYERS:
        scale = fp8_layers.static_state(model.get_layer(name))[
            "fp8_input_scale"
        ]
        assert to_numpy(scale) > 0


def test_a_frozen_model_refuses_to_train_and_to_freeze_again():
    model = fp8.freeze(_trained(fp8.Recipe(scaling="delayed")))
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    x, _ = _data(4)
    with pytest.raises(ValueError, match="frozen for inference"):
        model.train_on_batch(x[:8], np.zeros((8, 10), np.float32))
    with pytest.raises(ValueError, match="frozen already"):
        fp8.freeze(model)
    with pytest.raises(ValueError, match="none"):
        fp8.freeze(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
