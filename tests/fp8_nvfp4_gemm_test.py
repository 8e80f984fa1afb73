"""NVFP4 GEMMs: `fp8.Recipe(formats="nvfp4")` in `fp8.dot` and in `fit`.

Each GEMM role quantizes its operands as Transformer Engine's NVFP4 recipe
does: the forward x along K and the kernel in 16x16 tiles (round to
nearest even), the input gradient g along N (stochastic rounding) with the
same tiles, the kernel gradient x and g along the tokens, both rotated by
the 16x16 Hadamard transform (g stochastically rounded). Each result must
be, bit for bit, the backend's own float32 matmul of the oracle's
dequantized operands (`fp8_reference.nv_quantize`, with the random bits of
`fp8_reference.nv_rounding_bits`).
"""

import functools
import math

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp import fp8
from keras_mp._fp8.formats import nvfp4
from keras_mp._fp8.quantizers import nvfp4 as nvfp4_quantizer
from keras_mp.testing import backend_einsum
from keras_mp.testing import block_spread_operands
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import gemm_and_gradients
from keras_mp.testing import to_numpy

RECIPE = fp8.Recipe(formats="nvfp4")


def _values(t, axis=None, role=None):
    """The oracle's NVFP4 values of `t`: 1x16 blocks along `axis` (16x16
    tiles where None), stochastically rounded for `role`."""
    bits = None if role is None else reference.nv_rounding_bits(t, role)
    block_shape = (16, 16) if axis is None else None
    axis = -1 if axis is None else axis
    codes, scale = reference.nv_quantize(t, axis, block_shape, random_bits=bits)
    return reference.nv_dequantize(codes, scale, axis, block_shape)


def _tokens(t, hadamard):
    """`t` padded with zero rows to a multiple of 16, and rotated."""
    t = np.concatenate([t, np.zeros((-t.shape[0] % 16, t.shape[1]), t.dtype)])
    return reference.nv_hadamard(t, 0) if hadamard else t


_operands = functools.partial(block_spread_operands, m=40, k=48, n=32)


@pytest.mark.parametrize("stochastic_rounding", [True, False])
@pytest.mark.parametrize("hadamard", [True, False])
def test_each_gemm_is_the_float32_matmul_of_its_dequantized_operands(
    stochastic_rounding, hadamard
):
    recipe = fp8.Recipe(
        formats="nvfp4",
        stochastic_rounding=stochastic_rounding,
        hadamard=hadamard,
    )
    x, w, g = _operands()
    out, dx, dw = gemm_and_gradients(
        lambda a, b: fp8.dot(a, b, recipe), x, w, g
    )
    sr = stochastic_rounding
    tiles = _values(w)
    expected = {
        # Forward: x along K (RN), the kernel's 16x16 tiles (RN).
        "out": backend_einsum("mk,kn->mn", _values(x, 1), tiles),
        # Input gradient: g along N (SR), the same tiles.
        "dx": backend_einsum(
            "mn,kn->mk", _values(g, 1, "input_gradient" if sr else None), tiles
        ),
        # Kernel gradient: x and g along the tokens (40, padded to 48),
        # rotated; x RN, g SR.
        "dw": backend_einsum(
            "mk,mn->kn",
            _values(_tokens(x, hadamard), 0),
            _values(_tokens(g, hadamard), 0, "kernel_gradient" if sr else None),
        ),
    }
    for name, value in zip(("out", "dx", "dw"), (out, dx, dw)):
        np.testing.assert_array_equal(to_numpy(value), expected[name], name)
    # Unquantized, the rotation leaves the kernel gradient as it was (to
    # float32's rounding of the rotated values).
    rotated = _tokens(x, True).T.astype(np.float64) @ _tokens(g, True)
    exact = x.T.astype(np.float64) @ g
    np.testing.assert_allclose(rotated, exact, atol=1e-5 * np.abs(exact).max())


def test_rounding_bits_are_the_oracles_and_follow_the_tensor():
    _, _, g = _operands(seed=1)
    bits = to_numpy(nvfp4_quantizer.rounding_bits(g, "input_gradient"))
    np.testing.assert_array_equal(
        bits, reference.nv_rounding_bits(g, "input_gradient")
    )
    again = to_numpy(nvfp4_quantizer.rounding_bits(g, "input_gradient"))
    np.testing.assert_array_equal(bits, again)
    other_role = to_numpy(nvfp4_quantizer.rounding_bits(g, "kernel_gradient"))
    nudged = g.copy()
    nudged[3, 4] = np.nextafter(nudged[3, 4], np.float32(np.inf))
    other_step = to_numpy(
        nvfp4_quantizer.rounding_bits(nudged, "input_gradient")
    )
    for different in (other_role, other_step):
        # Nearly every element draws new bits: the key changes them all.
        assert np.mean((bits & 0xFF) != (different & 0xFF)) > 0.9


def test_stochastic_rounding_is_deterministic_and_changes_between_steps():
    x, w, g = _operands(seed=2)
    dot = lambda a, b: fp8.dot(a, b, RECIPE)  # noqa: E731
    _, dx1, dw1 = gemm_and_gradients(dot, x, w, g)
    _, dx2, dw2 = gemm_and_gradients(dot, x, w, g)
    np.testing.assert_array_equal(to_numpy(dx1), to_numpy(dx2))
    np.testing.assert_array_equal(to_numpy(dw1), to_numpy(dw2))
    # Another step's gradient (here the same one, scaled by a power of
    # two: the same codes under round to nearest) rounds differently.
    _, dx3, _ = gemm_and_gradients(dot, x, w, g * np.float32(2.0))
    assert (to_numpy(dx3) != 2.0 * to_numpy(dx1)).any()
    # Unbiased: the mean of many draws is nearer the exact product than
    # round to nearest is (Transformer Engine's test, on the input
    # gradient's operand).
    rng = np.random.default_rng(3)
    row = rng.normal(size=(1, 64)).astype("float32")
    draws = []
    for step in range(64):
        scaled = row * np.float32(1.0 + step * 2.0**-20)
        bits = reference.nv_rounding_bits(scaled, "input_gradient")
        codes, scale = nvfp4.quantize(scaled, random_bits=bits)
        draws.append(to_numpy(nvfp4.dequantize(codes, scale)) / scaled)
    nearest = to_numpy(nvfp4.dequantize(*nvfp4.quantize(row))) / row
    mean_error = np.sqrt(np.mean((np.mean(draws, 0) - 1.0) ** 2))
    assert mean_error < np.sqrt(np.mean((nearest - 1.0) ** 2))


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_nonfinite_output_gradient_keeps_both_gradients_nonfinite(bad):
    """NVFP4 has no inf or NaN code: the block (and the tensor) scale is
    NaN instead, so a loss-scale skip sees the step."""
    x, w, g = _operands(seed=4)
    g[5, 7] = bad
    _, dx, dw = gemm_and_gradients(lambda a, b: fp8.dot(a, b, RECIPE), x, w, g)
    assert not np.isfinite(to_numpy(dx)).all()
    assert not np.isfinite(to_numpy(dw)).all()


def test_kernels_whose_dimensions_are_not_multiples_of_16_are_refused():
    x = np.ones((4, 24), "float32")
    with pytest.raises(
        ValueError, match="multiples of 16.*kernel.shape=.24, 32"
    ):
        fp8.dot(x, np.ones((24, 32), "float32"), RECIPE)


def test_the_recipe_says_what_goes_with_nvfp4():
    assert RECIPE.granularity == "nvfp4"
    assert RECIPE.stochastic_rounding is True and RECIPE.hadamard is True
    assert RECIPE.forward_format == RECIPE.backward_format == "e2m1"
    assert fp8.Recipe.from_config(RECIPE.get_config()) == RECIPE
    plain = fp8.Recipe(
        formats="nvfp4", stochastic_rounding=False, hadamard=False
    )
    assert plain != RECIPE and hash(plain) != hash(RECIPE)
    assert "hadamard=False" in repr(plain)
    # The configs of the other formats are what earlier versions wrote.
    config = fp8.Recipe(formats="mxfp8").get_config()
    assert "stochastic_rounding" not in config and "hadamard" not in config
    with pytest.raises(ValueError, match='scaling="current" with formats'):
        fp8.Recipe(formats="nvfp4", scaling="delayed")
    with pytest.raises(ValueError, match="Leave `granularity` as None"):
        fp8.Recipe(formats="nvfp4", granularity="block")
    with pytest.raises(ValueError, match="Leave `margin` as 0"):
        fp8.Recipe(formats="nvfp4", margin=1)
    with pytest.raises(ValueError, match="Leave `scale_rounding` as None"):
        fp8.Recipe(formats="nvfp4", scale_rounding="rceil")
    with pytest.raises(ValueError, match='scaling="current" with formats'):
        fp8.Recipe(formats="nvfp4", scaling="delayed", stats=True)
    # Statistics, and the static recipe of a frozen layer (`fp8.freeze`).
    assert fp8.Recipe(formats="nvfp4", stats=True).stats is True
    assert fp8.Recipe(formats="nvfp4", scaling="static").scaling == "static"
    for option in ("stochastic_rounding", "hadamard"):
        with pytest.raises(ValueError, match='use formats="nvfp4"'):
            fp8.Recipe(**{option: True})
        with pytest.raises(TypeError, match="is a bool"):
            fp8.Recipe(formats="nvfp4", **{option: 1})


@pytest.mark.parametrize(
    "kwargs", [{"axis": 0}, {"axis": -1}, {"block_shape": (16, 16)}]
)
def test_quantize_and_dequantize_take_the_format(kwargs):
    x, _, _ = _operands(m=32, seed=5)
    codes, scale = fp8.quantize(x, "nvfp4", **kwargs)
    expected_codes, expected_scale = reference.nv_quantize(x, **kwargs)
    np.testing.assert_array_equal(to_numpy(codes), expected_codes)
    np.testing.assert_array_equal(
        to_numpy(ops.cast(scale[0], "float32")),
        expected_scale[0].astype(np.float32),
    )
    values = fp8.dequantize(codes, scale, "nvfp4", **kwargs)
    np.testing.assert_array_equal(
        to_numpy(values),
        reference.nv_dequantize(expected_codes, expected_scale, **kwargs),
    )


def test_quantize_refuses_what_nvfp4_does_not_take():
    x, _, _ = _operands(m=32, seed=6)
    with pytest.raises(ValueError, match="no given scale, no margin"):
        fp8.quantize(x, "nvfp4", margin=1)
    with pytest.raises(ValueError, match=r"None or \(16, 16\)"):
        fp8.quantize(x, "nvfp4", block_shape=(128, 128))
    codes, _ = fp8.quantize(x, "nvfp4")
    with pytest.raises(ValueError, match="the pair"):
        fp8.dequantize(codes, 1.0, "nvfp4")


def test_the_rules_keep_the_first_and_last_blocks_of_nvfp4():
    rules = fp8.Rules(nvfp4_high_precision_first=2, nvfp4_high_precision_last=1)
    assert rules.high_precision_blocks(RECIPE, 5) == {
        0: "first",
        1: "first",
        4: "last",
    }
    assert rules.high_precision_blocks(RECIPE, 2) == {0: "first", 1: "first"}
    assert rules.high_precision_blocks(fp8.Recipe(formats="mxfp8"), 5) == {}
    assert (
        rules.high_precision_reason(RECIPE, "first", "bfloat16")
        == "nvfp4: first 2 blocks kept in bfloat16"
    )
    assert rules.required_multiple(RECIPE) == 16
    with pytest.raises(ValueError, match=">= 0"):
        fp8.Rules(nvfp4_high_precision_last=-1)


def _model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(96, activation="relu"),
            keras.layers.Dense(48, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(40, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(4),
        ]
    )


def test_fit_trains_the_rules_layers_in_nvfp4_and_reloads_them(tmp_path):
    keras_mp.set_global_policy("mixed_bfloat16", fp8=RECIPE)
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
    assert fp8_columns == [
        "nvfp4: first block kept in bfloat16",
        "current/nvfp4/nvfp4",
        # The last block whose GEMM would run NVFP4: the two after it
        # cannot.
        "nvfp4: last block kept in bfloat16",
        "dims 64x40 not multiples of 16",
        "dims 40x64 not multiples of 16",
        "output layer",
    ]
    assert model.layers[1].dtype_policy.fp8 == RECIPE
    assert model.layers[0].dtype_policy.fp8 is None
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert restored.layers[1].dtype_policy.fp8 == RECIPE
    np.testing.assert_array_equal(
        to_numpy(restored.predict(x, verbose=0)),
        to_numpy(model.predict(x, verbose=0)),
    )


def test_a_keras_hub_decoder_keeps_its_first_and_last_blocks_and_trains():
    keras_hub = pytest.importorskip("keras_hub")
    keras_mp.set_global_policy("mixed_bfloat16", fp8=RECIPE)
    try:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=3,
            num_heads=2,
            hidden_dim=32,
            intermediate_dim=64,
            max_sequence_length=16,
        )
        columns = {
            row["layer"]: row["fp8"]
            for row in keras_mp.explain_precision(backbone, print_fn=None)
            if row["class_name"] in ("Dense", "EinsumDense")
        }
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 64, (8, 16))
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
    for layer, column in columns.items():
        block = layer.split("/")[0]
        expected = {
            "transformer_layer_0": "nvfp4: first block kept in bfloat16",
            "transformer_layer_1": "current/nvfp4/nvfp4",
            "transformer_layer_2": "nvfp4: last block kept in bfloat16",
        }[block]
        assert column == expected, layer
    assert len(columns) == 18
    losses = history.history["loss"]
    assert losses[-1] < losses[0]


# ------------------------------------------------------------- statistics
def _reference_bin(amax):
    """The histogram bin of a float32 `amax` (`_fp8/stats.py`), from
    `np.frexp`."""
    if not np.isfinite(amax):
        return 510
    if amax < 2.0**-126:
        return 0
    mantissa, exponent = np.frexp(float(amax))
    return 2 * (exponent - 1 + 127) + int(mantissa > 0.875)


def _reference_row(t, axis=None, role=None):
    """The statistics row of `t` quantized as the oracle quantizes it
    (1x16 blocks along `axis`, 16x16 tiles where None, stochastically
    rounded for `role`): flushed, a non-zero value dequantized to zero
    (code ±0, or a block scale of 0); saturated, `|t * enc_block|` above 6
    in a block of finite, non-zero scale."""
    t = np.asarray(t, np.float32)
    bits = None if role is None else reference.nv_rounding_bits(t, role)
    block_shape = (16, 16) if axis is None else None
    axis = -1 if axis is None else axis
    codes, (block, s_enc) = reference.nv_quantize(
        t, axis, block_shape, random_bits=bits
    )
    decode = block.astype(np.float32)
    if block_shape is None:
        decode = np.repeat(decode, 16, axis=axis)
    else:
        decode = np.repeat(np.repeat(decode, 16, 0), 16, 1)
    tiny = np.abs(t) < np.finfo(np.float32).tiny
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        encode = np.minimum(
            np.float32(1) / (decode * (np.float32(1) / np.float32(s_enc))),
            np.finfo(np.float32).max,
        )
        scaled = np.where(tiny, np.float32(0), t) * encode
    finite = ~np.isnan(decode)
    row = np.zeros(515)
    row[_reference_bin(np.abs(t).max())] = 1
    row[512] = t.size
    row[513] = np.sum((t != 0) & finite & (((codes & 7) == 0) | (decode == 0)))
    row[514] = np.sum(finite & (decode > 0) & (np.abs(scaled) > 6))
    return row


def _statistics_operands():
    x, w, g = _operands(m=32, k=48, n=32, seed=3)
    # Values far below their block's largest: codes ±0, and a block 2**-30
    # below the tensor's amax, whose E4M3 scale is 0.
    x[0, 1:4] *= 1e-3
    w[16:32, 0:16] *= 2.0**-30
    g[:, 5] *= 1e-2
    return x, w, g


@pytest.mark.parametrize("stochastic_rounding", [True, False])
def test_statistics_count_each_roles_e2m1_codes_as_numpy_does(
    stochastic_rounding,
):
    recipe = fp8.Recipe(
        formats="nvfp4", stats=True, stochastic_rounding=stochastic_rounding
    )
    x, w, g = _statistics_operands()
    carrier = np.zeros((3, 515), "float32")
    _, _, got = gemm_and_gradients(
        lambda a, c: fp8.dot(a, w, recipe, stats=c), x, carrier, g
    )
    got = to_numpy(got)
    role = "input_gradient" if stochastic_rounding else None
    want = np.stack(
        [_reference_row(x, 1), _reference_row(w), _reference_row(g, 1, role)]
    )
    np.testing.assert_array_equal(got, want)
    # Something to count in every row: flushed and saturated values.
    assert (got[:, 513] > 0).all() and (got[:, 514] > 0).all()
    # The zero-scale tile's 256 values are flushed, none saturated.
    assert got[1, 513] >= 256
    # Statistics change no number of the GEMMs.
    plain = fp8.Recipe(formats="nvfp4", stochastic_rounding=stochastic_rounding)
    counted = gemm_and_gradients(
        lambda a, b: fp8.dot(a, b, recipe, stats=carrier), x, w, g
    )
    for a, b in zip(
        counted, gemm_and_gradients(lambda a, b: fp8.dot(a, b, plain), x, w, g)
    ):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def _stats_model(policy):
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(96, activation="relu", dtype=policy, name="a")
    hidden = hidden(inputs)
    hidden = keras.layers.Dense(32, dtype=policy, name="b")(hidden)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))


def test_report_names_nvfp4_e2m1_and_the_amaxs_block_scale():
    policy = keras_mp.Policy(
        "mixed_bfloat16", fp8=fp8.Recipe(formats="nvfp4", stats=True)
    )
    keras.utils.set_random_seed(0)
    model = _stats_model(policy)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 64)).astype("float32")
    y = (x[:, :4] > 0).astype("float32")
    printed = []
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(
        x,
        y,
        batch_size=32,
        verbose=0,
        callbacks=[
            keras_mp.callbacks.FP8Report(saturated=0.0, print_fn=printed.append)
        ],
    )
    report = fp8.report(model)
    assert len(report) == 6
    assert {row.format for row in report} == {"nvfp4 e2m1"}
    for row in report:
        # The amax's block: E4M3 scale 448 over `S_enc = 2688 / amax`.
        assert row.amax_low / 6 <= row.scale <= row.amax_high / 6
        assert row.count > 0 and 0 <= row.flushed < 1
    # The round-to-nearest E4M3 block scales leave some values above 6.
    assert printed and "nvfp4 e2m1" in printed[0]
    assert "nvfp4 e2m1" in str(report)


def _float16_carrier(scaled):
    keras.utils.set_random_seed(0)
    recipe = fp8.Recipe(formats="nvfp4", stats=True, stochastic_rounding=False)
    policy = keras_mp.Policy("mixed_float16", loss_scale=None, fp8=recipe)
    model = _stats_model(policy)
    optimizer = keras.optimizers.SGD(0.01)
    if scaled:
        optimizer = keras_mp.LossScaleOptimizer(optimizer)
    model.compile(optimizer, loss="mse", auto_scale_loss=scaled)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 64)).astype("float32")
    model.train_on_batch(x, rng.normal(size=(16, 4)).astype("float32"))
    carrier = next(
        v for v in model.get_layer("b").weights if v.path.endswith("fp8_stats")
    )
    return model, to_numpy(carrier)


def test_under_loss_scaling_the_nvfp4_gradient_row_is_loss_scale_free():
    # Round to nearest: a power-of-two loss scale changes no E2M1 code.
    scaled_model, scaled = _float16_carrier(True)
    assert float(to_numpy(scaled_model.optimizer.loss_scale())) == 2.0**15
    _, plain = _float16_carrier(False)
    np.testing.assert_array_equal(scaled, plain)
    assert plain[2, 512] == 16 * 32


# ----------------------------------------------------------------- freeze
def _weight_bytes(layer):
    return sum(
        math.prod(v.shape)
        * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in layer.weights
        if v is not getattr(layer, "bias", None)
    )


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_freeze_stores_packed_e2m1_codes_and_e4m3_scales_and_predicts_the_same(
    kind, tmp_path
):
    policy = keras_mp.Policy("mixed_bfloat16", fp8=RECIPE)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 64))
    if kind == "dense":
        layer = keras.layers.Dense(96, activation="relu", dtype=policy)
        hidden = layer(inputs)
    else:
        layer = keras.layers.EinsumDense(
            "abc,cde->abde",
            (8, 3, 32),
            bias_axes="de",
            activation="relu",
            dtype=policy,
        )
        hidden = keras.layers.Reshape((8, 96))(layer(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
    x = np.random.default_rng(0).normal(size=(16, 8, 64)).astype("float32")
    model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, x[..., :4], batch_size=8, epochs=2, verbose=0)
    # The GEMM's [K, N] kernel, as training's forward quantized it.
    matrix = to_numpy(layer.kernel).reshape(64, 96)
    codes, (block, tensor_scale) = reference.nv_quantize(
        matrix, block_shape=(16, 16)
    )
    before = to_numpy(model.predict(x, verbose=0))
    fp8.freeze(model)
    assert layer.dtype_policy.fp8 == fp8.Recipe(
        formats="nvfp4", scaling="static"
    )
    state = {v.name: v for v in layer.weights}
    assert set(state) - {"bias"} == {
        "fp8_kernel_codes",
        "fp8_kernel_scale",
        "fp8_kernel_tensor_scale",
    }
    # Two codes a byte along K, the first in the low nibble.
    np.testing.assert_array_equal(
        to_numpy(state["fp8_kernel_codes"]), reference.nv_pack(codes, 0)
    )
    np.testing.assert_array_equal(
        to_numpy(state["fp8_kernel_scale"]),
        block.astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
    )
    assert to_numpy(state["fp8_kernel_tensor_scale"]) == tensor_scale
    # 64 x 96 weights: half a byte each, one E4M3 byte per 16x16 tile,
    # and the four bytes of the tensor scale.
    assert _weight_bytes(layer) / (64 * 96) == 0.5 + 1 / 256 + 4 / (64 * 96)
    after = to_numpy(model.predict(x, verbose=0))
    np.testing.assert_array_equal(after, before)
    with pytest.raises(ValueError, match="frozen for inference"):
        model(x, training=True)
    path = tmp_path / "frozen.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_array_equal(
        to_numpy(restored.predict(x, verbose=0)), before
    )


def test_freeze_keeps_refusing_a_high_precision_forward():
    recipe = fp8.Recipe(formats="nvfp4", high_precision="forward")
    policy = keras_mp.Policy("mixed_bfloat16", fp8=recipe)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(96, dtype=policy)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
    with pytest.raises(ValueError, match="forward GEMM in high precision"):
        fp8.freeze(model)
