"""MXFP8 GEMMs: `fp8.Recipe(formats="mxfp8")` in `fp8.dot` and in `fit`.

Each GEMM role quantizes its operands along its own contracted axis, each
from the high-precision source (Transformer Engine's MXFP8 recipe): the
forward along K, the input gradient along N, the kernel gradient along the
tokens. Each result must be, bit for bit, the backend's own float32 matmul
of the oracle's dequantized operands (`fp8_reference.mx_quantize`), the
definition of an MXFP8 GEMM on a CPU.
"""

import functools
import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp import fp8
from keras_mp.testing import backend_einsum
from keras_mp.testing import block_spread_operands
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import gemm_and_gradients
from keras_mp.testing import to_numpy

RECIPES = {
    "rceil": fp8.Recipe(formats="mxfp8"),
    "floor": fp8.Recipe(formats="mxfp8", scale_rounding="floor"),
}


def _dequantized(t, axis, rounding):
    """The oracle's MXFP8 values of `t` in blocks along `axis`, with zero
    rows padded to a multiple of 32 where the blocks run along rows."""
    if axis == 0 and t.shape[0] % 32:
        t = np.concatenate(
            [t, np.zeros((-t.shape[0] % 32, t.shape[1]), t.dtype)]
        )
    codes, scale = reference.mx_quantize(t, axis, rounding)
    return reference.mx_dequantize(codes, scale, axis).astype(np.float32)


_operands = functools.partial(block_spread_operands, m=48, k=96, n=64)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_each_gemm_is_the_float32_matmul_of_its_dequantized_operands(rounding):
    x, w, g = _operands()
    out, dx, dw = gemm_and_gradients(
        lambda a, b: fp8.dot(a, b, RECIPES[rounding]), x, w, g
    )
    m = x.shape[0]
    expected = {
        # Forward: x along K, the kernel along K.
        "out": backend_einsum(
            "mk,kn->mn",
            _dequantized(x, 1, rounding),
            _dequantized(w, 0, rounding),
        ),
        # Input gradient: g along N, the kernel along N.
        "dx": backend_einsum(
            "mn,kn->mk",
            _dequantized(g, 1, rounding),
            _dequantized(w, 1, rounding),
        ),
        # Kernel gradient: x and g along the tokens (48, padded to 64).
        "dw": backend_einsum(
            "mk,mn->kn",
            _dequantized(x, 0, rounding),
            _dequantized(g, 0, rounding),
        ),
    }
    for name, value in zip(("out", "dx", "dw"), (out, dx, dw)):
        np.testing.assert_array_equal(to_numpy(value), expected[name], name)
    assert to_numpy(dx).shape == (m, 96)


def test_operands_are_quantized_along_each_gemms_own_axis():
    """Quantizing the kernel gradient's operands along K instead (the
    forward's codes, transposed) gives another result: the roles really
    take their own blocks."""
    x, w, g = _operands(seed=1)
    x64, g64 = x[:32], g[:32]
    _, _, dw = gemm_and_gradients(
        lambda a, b: fp8.dot(a, b, RECIPES["rceil"]), x64, w, g64
    )
    forward_codes = backend_einsum(
        "mk,mn->kn",
        _dequantized(x64, 1, "rceil"),
        _dequantized(g64, 1, "rceil"),
    )
    assert (to_numpy(dw) != forward_codes).any()


def test_a_bfloat16_result_is_the_float32_result_rounded():
    x, w, g = _operands(seed=2)
    out32, _, _ = gemm_and_gradients(
        lambda a, b: fp8.dot(a, b, RECIPES["rceil"], output_dtype="float32"),
        x,
        w,
        g,
    )
    out16, _, _ = gemm_and_gradients(
        lambda a, b: fp8.dot(a, b, RECIPES["rceil"], output_dtype="bfloat16"),
        x,
        w,
        g,
    )
    expected = to_numpy(ops.cast(out32, "bfloat16")).astype(np.float32)
    got = to_numpy(out16).astype(np.float32)
    if keras.backend.backend() == "torch":
        # PyTorch's CPU bfloat16 GEMM sums in its own order (1 ulp:
        # `keras_mp.backend.fp8.einsum_float32`).
        np.testing.assert_allclose(got, expected, rtol=2**-7)
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_nonfinite_value_keeps_its_gemm_nonfinite(bad):
    """The codes never hide an inf or NaN: the block's scale is NaN, so a
    loss-scale skip sees the step."""
    x, w, g = _operands(seed=3)
    g[5, 7] = bad
    _, dx, dw = gemm_and_gradients(
        lambda a, b: fp8.dot(a, b, RECIPES["rceil"]), x, w, g
    )
    assert not np.isfinite(to_numpy(dx)).all()
    assert not np.isfinite(to_numpy(dw)).all()


def test_kernels_whose_dimensions_are_not_multiples_of_32_are_refused():
    x = np.ones((4, 48), "float32")
    with pytest.raises(
        ValueError, match="multiples of 32.*kernel.shape=.48, 64"
    ):
        fp8.dot(x, np.ones((48, 64), "float32"), RECIPES["rceil"])


def test_the_recipe_says_what_goes_with_mxfp8():
    recipe = RECIPES["rceil"]
    assert recipe.granularity == "microblock"
    assert recipe.scale_rounding == "rceil"
    assert recipe.forward_format == recipe.backward_format == "e4m3"
    assert fp8.Recipe.from_config(recipe.get_config()) == recipe
    # The configs of the other formats are what earlier versions wrote.
    assert "scale_rounding" not in fp8.Recipe().get_config()
    with pytest.raises(ValueError, match='scaling="current" with formats'):
        fp8.Recipe(formats="mxfp8", scaling="delayed")
    with pytest.raises(ValueError, match="Leave `granularity` as None"):
        fp8.Recipe(formats="mxfp8", granularity="rowwise")
    with pytest.raises(ValueError, match="Leave `margin` as 0"):
        fp8.Recipe(formats="mxfp8", margin=1)
    with pytest.raises(ValueError, match='use formats="mxfp8"'):
        fp8.Recipe(scale_rounding="floor")
    with pytest.raises(ValueError, match="scale_rounding"):
        fp8.Recipe(formats="mxfp8", scale_rounding="nearest")


def test_quantize_and_dequantize_take_the_format():
    x, _, _ = _operands(m=64, seed=4)
    codes, scale = fp8.quantize(x, "mxfp8", axis=0, scale_rounding="floor")
    expected_codes, expected_scale = reference.mx_quantize(x, 0, "floor")
    np.testing.assert_array_equal(to_numpy(scale), expected_scale)
    np.testing.assert_array_equal(
        to_numpy(ops.cast(codes, "float32")), expected_codes.astype(np.float32)
    )
    values = fp8.dequantize(codes, scale, "mxfp8", axis=0)
    np.testing.assert_array_equal(
        to_numpy(values),
        reference.mx_dequantize(expected_codes, expected_scale, 0),
    )
    with pytest.raises(ValueError, match="no given scale, no margin"):
        fp8.quantize(x, "mxfp8", scale=1.0)
    with pytest.raises(ValueError, match="Leave both as None"):
        fp8.quantize(x, "mxfp8", granularity="block")
    with pytest.raises(ValueError, match='pass fmt="mxfp8"'):
        fp8.quantize(x, "e4m3", scale_rounding="floor")


def _model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(96, activation="relu"),
            keras.layers.Dense(48, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(4),
        ]
    )


def test_fit_trains_the_rules_layers_in_mxfp8_and_reloads_them(tmp_path):
    keras_mp.set_global_policy("mixed_bfloat16", fp8=RECIPES["rceil"])
    try:
        keras.utils.set_random_seed(0)
        model = _model()
        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, 64)).astype("float32")
        y = (x[:, :4] > 0).astype("float32")
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        history = model.fit(x, y, batch_size=64, epochs=4, verbose=0)
        fp8_columns = [
            row["fp8"]
            for row in keras_mp.explain_precision(model, print_fn=None)
            if row["class_name"] == "Dense"
        ]
    finally:
        keras_mp.set_global_policy("float32")
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    assert fp8_columns[0] == "current/microblock/mxfp8"
    assert fp8_columns[1] == "dims 96x48 not multiples of 32"
    assert fp8_columns[2] == "dims 48x64 not multiples of 32"
    assert fp8_columns[3] == "current/microblock/mxfp8"
    assert fp8_columns[4] == "output layer"
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert restored.layers[0].dtype_policy.fp8 == RECIPES["rceil"]
    np.testing.assert_array_equal(
        to_numpy(restored.predict(x, verbose=0)),
        to_numpy(model.predict(x, verbose=0)),
    )


def test_report_names_the_format_and_a_nonfinite_batch_is_skipped():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 64)).astype("float32")
    y = (x[:, :4] > 0).astype("float32")
    keras_mp.set_global_policy(
        "mixed_bfloat16", fp8=fp8.Recipe(formats="mxfp8", stats=True)
    )
    try:
        keras.utils.set_random_seed(0)
        model = _model()
        model.compile(keras.optimizers.Adam(1e-3), loss="mse")
        model.fit(x, y, batch_size=32, verbose=0)
        rows = fp8.report(model).rows
        # One NaN in one batch: the skip without a loss scale (on by
        # default under an FP8 recipe) leaves every weight finite.
        x[40, 3] = np.nan
        model.fit(x, y, batch_size=32, verbose=0)
    finally:
        keras_mp.set_global_policy("float32")
    assert {row.format for row in rows} == {"mxfp8 e4m3"}
    assert {row.tensor for row in rows} == {
        "input",
        "kernel",
        "output_gradient",
    }
    kernel = next(row for row in rows if row.tensor == "kernel")
    # The E8M0 scale of the block holding the amax: amax / scale <= 448.
    assert kernel.amax_high / kernel.scale <= 448 * 2
    assert int(to_numpy(model.optimizer.skipped_steps)) == 1
    for weight in model.weights:
        assert np.isfinite(to_numpy(weight)).all(), weight.path


def _weight_bytes(layer):
    return sum(
        math.prod(v.shape)
        * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in layer.weights
        if v is not getattr(layer, "bias", None)
    )


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_freeze_stores_codes_and_e8m0_scales_and_predicts_the_same(
    kind, tmp_path
):
    keras_mp.set_global_policy("mixed_bfloat16", fp8=RECIPES["floor"])
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 64))
        if kind == "dense":
            hidden = keras.layers.Dense(96, activation="relu")(inputs)
        else:
            hidden = keras.layers.EinsumDense(
                "abc,cde->abde", (8, 3, 32), bias_axes="de", activation="relu"
            )(inputs)
            hidden = keras.layers.Reshape((8, 96))(hidden)
        model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        x = np.random.default_rng(0).normal(size=(16, 8, 64)).astype("float32")
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        model.fit(x, x[..., :4], batch_size=8, epochs=2, verbose=0)
        layer = model.layers[1]
        float_bytes = _weight_bytes(layer)
        before = to_numpy(model.predict(x, verbose=0))
        fp8.freeze(model)
    finally:
        keras_mp.set_global_policy("float32")
    assert layer.dtype_policy.fp8.scaling == "static"
    state = {v.name: v for v in layer.weights}
    assert set(state) >= {"fp8_kernel_codes", "fp8_kernel_scale"}
    assert "fp8_input_scale" not in state
    # 64 x 96 weights: one byte each, and one E8M0 byte per 32 of them.
    assert tuple(state["fp8_kernel_scale"].shape) == (2, 96)
    assert _weight_bytes(layer) / (64 * 96) == 1 + 1 / 32
    assert float_bytes / (64 * 96) == 4
    after = to_numpy(model.predict(x, verbose=0))
    np.testing.assert_array_equal(after, before)
    path = tmp_path / "frozen.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_array_equal(
        to_numpy(restored.predict(x, verbose=0)), before
    )


def test_a_keras_hub_decoder_trains_its_gemms_in_mxfp8():
    keras_hub = pytest.importorskip("keras_hub")
    keras_mp.set_global_policy("mixed_bfloat16", fp8=RECIPES["rceil"])
    try:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=2,
            num_heads=2,
            hidden_dim=64,
            intermediate_dim=128,
            max_sequence_length=16,
        )
        columns = [
            row["fp8"]
            for row in keras_mp.explain_precision(backbone, print_fn=None)
            if row["class_name"] in ("Dense", "EinsumDense")
        ]
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        tokens = np.random.default_rng(0).integers(0, 64, (8, 16))
        x = {"token_ids": tokens, "padding_mask": np.ones((8, 16), bool)}
        model.compile(
            keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = model.fit(
            x, tokens, batch_size=8, epochs=20, shuffle=False, verbose=0
        )
    finally:
        keras_mp.set_global_policy("float32")
    # Every attention projection and feed-forward GEMM (dims 64 and 128).
    assert columns == ["current/microblock/mxfp8"] * len(columns)
    assert len(columns) == 12
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
