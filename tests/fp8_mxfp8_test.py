"""`keras_mp._fp8.formats.mxfp8`: MXFP8 codes and E8M0 scales bit for bit as NumPy.

The oracle (`keras_mp.testing.fp8_reference.mx_*`) finds exponents with
`np.frexp` and float64 comparisons, divides in float64 and casts with
`ml_dtypes`. Every backend must give the same E4M3 code bits (NaN-ness
compared for NaN codes), the same E8M0 bytes and the same dequantized
float32 bits, subnormals included, though XLA on a CPU flushes subnormal
floats to zero (JAX and TensorFlow) and PyTorch does not.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_mp._fp8.formats import mxfp8
from keras_mp.testing import assert_fp8_codes_equal
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

DTYPES = ["float32", "bfloat16", "float16"]
ROUNDINGS = ["rceil", "floor"]
ROWS, COLUMNS = 256, 128  # 8 x 4 tiles of 32 x 32


def _next_up(value):
    value = np.float32(value)
    return np.nextafter(value, np.float32(np.inf), dtype=np.float32)


def _tile(rng, diagonal, fill=None):
    """A 32 x 32 tile whose every row and column has amax `diagonal`: the
    diagonal holds it (random signs), the rest `fill` or smaller values."""
    diagonal = np.float32(diagonal)
    if fill is None:
        fill = diagonal * rng.uniform(0, 1, (32, 32)).astype(np.float32)
    tile = np.broadcast_to(np.float32(fill), (32, 32)).copy()
    tile *= rng.choice([-1, 1], (32, 32)).astype(np.float32)
    np.fill_diagonal(tile, diagonal * rng.choice([-1, 1], 32))
    return tile


def _data(dtype, seed=0):
    """Log-uniform magnitudes over the dtype's range, each row spanning 10
    binades of its own, with the special blocks in the first tiles (each
    row block and column block of a tile has the tile's amax)."""
    rng = np.random.default_rng(seed)
    low, high = (-26, 5) if dtype == "float16" else (-149, 118)
    base = rng.uniform(low, high, (ROWS, 1))
    exponents = base + rng.uniform(0, 10, (ROWS, COLUMNS))
    x = np.exp2(exponents) * rng.choice([-1.0, 1.0], (ROWS, COLUMNS))
    x = x.astype(np.float32)
    k = -3 if dtype == "float16" else 37
    specials = [
        np.zeros((32, 32), np.float32) * rng.choice([-1, 1], (32, 32)),
        _tile(rng, 448.0 * 2.0**k),
        _tile(rng, 448.0 * 2.0**-k),
        # A mantissa just above 1.75: "floor" clips it to 448.
        _tile(rng, _next_up(1.75 * 2.0**k)),
        _tile(rng, _next_up(1.75)),
        # Subnormal amaxes (float32), and amaxes around 448 * 2**-127.
        _tile(rng, 2.0**-130, rng.uniform(0, 2**-130, (32, 32))),
        _tile(rng, 3 * 2.0**-149, 2.0**-149),
        _tile(rng, 448.0 * 2.0**-127, 2.0**-126),
        _tile(rng, _next_up(448.0 * 2.0**-127)),
        _tile(rng, 448.0 * 2.0**-126),
    ]
    tiles = [(i, j) for i in range(ROWS // 32) for j in range(COLUMNS // 32)]
    for (i, j), tile in zip(tiles, specials):
        x[32 * i : 32 * i + 32, 32 * j : 32 * j + 32] = tile
    # Inf and NaN in blocks of their own, along both axes.
    x[200, 3], x[201, 40], x[202, 70], x[203, 100] = np.inf, -np.inf, np.nan, 0
    x[240, 99] = np.nan
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _assert_float32_bits_equal(values, expected):
    values = to_numpy(values)
    assert values.dtype == np.float32 and values.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(values), nan)
    mismatch = values.view(np.uint32) != expected.view(np.uint32)
    mismatch &= ~nan
    assert not mismatch.any(), (
        f"{mismatch.sum()} values differ, e.g. got {values[mismatch][:5]}, "
        f"expected {expected[mismatch][:5]}"
    )


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_scales_and_values_match_numpy_and_ml_dtypes(
    dtype, axis, rounding
):
    x = _data(dtype)
    host = x.astype(np.float32)
    codes, scale = mxfp8.quantize(
        ops.convert_to_tensor(host, dtype=dtype), axis, rounding
    )
    expected_codes, expected_scale = reference.mx_quantize(host, axis, rounding)
    assert keras.backend.standardize_dtype(codes.dtype) == "float8_e4m3fn"
    assert keras.backend.standardize_dtype(scale.dtype) == "uint8"
    assert_fp8_codes_equal(codes, expected_codes)
    np.testing.assert_array_equal(to_numpy(scale), expected_scale)
    _assert_float32_bits_equal(
        mxfp8.dequantize(codes, scale, axis),
        reference.mx_dequantize(expected_codes, expected_scale, axis),
    )


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("axis", [-1, 0])
def test_e5m2_elements_match_numpy_and_ml_dtypes(axis, rounding):
    """Transformer Engine's MXFP8 "hybrid" gradients: E5M2 elements, each
    block scaled to 57344 = 1.75 * 2**15 by the same rules."""
    host = _data("float32")
    codes, scale = mxfp8.quantize(host, axis, rounding, fmt="e5m2")
    expected_codes, expected_scale = reference.mx_quantize(
        host, axis, rounding, fmt="e5m2"
    )
    assert keras.backend.standardize_dtype(codes.dtype) == "float8_e5m2"
    assert_fp8_codes_equal(codes, expected_codes)
    np.testing.assert_array_equal(to_numpy(scale), expected_scale)
    # One binade of E5M2's range above E4M3's: 7 codes lower.
    e4m3_scale = to_numpy(mxfp8.quantize(host, axis, rounding)[1]).astype(int)
    finite = (expected_scale != 255) & (e4m3_scale > 7)
    assert (e4m3_scale[finite] - expected_scale[finite].astype(int) == 7).all()
    _assert_float32_bits_equal(
        mxfp8.dequantize(codes, scale, axis),
        reference.mx_dequantize(expected_codes, expected_scale, axis),
    )
    amax = np.float32([57344.0, 57345.0, 0.0, np.inf])
    np.testing.assert_array_equal(
        to_numpy(mxfp8.e8m0_from_amax(amax, rounding, "e5m2")),
        reference.mx_e8m0(amax, rounding, "e5m2"),
    )


def _sampled_amax(seed=0):
    """Boundaries of the E8M0 rules: every power of two and 448 * 2**k with
    their float32 neighbours, mantissas around 1.75 in every binade, the
    subnormals near the top and bottom, 0, the largest float32, inf, NaN
    and 10**5 random positive float32 bit patterns."""
    rng = np.random.default_rng(seed)
    exponents = np.arange(0, 255, dtype=np.uint32) << 23
    mantissas = np.uint32([0, 1, 2, 0x5FFFFF, 0x600000, 0x600001, 0x600002])
    mantissas = np.concatenate([mantissas, 0x7FFFFF - mantissas[:3]])
    bits = (exponents[:, None] | mantissas[None]).ravel()
    powers = np.ldexp(448.0, np.arange(-134, 120)).astype(np.float32)
    neighbours = [
        powers,
        np.nextafter(powers, np.float32(0)),
        np.nextafter(powers, np.float32(np.inf)),
    ]
    subnormals = np.concatenate(
        [np.arange(1, 5000), 0x800000 - np.arange(1, 5000), [0x400000]]
    ).astype(np.uint32)
    random = rng.integers(1, 0x7F800000, 10**5, dtype=np.uint32)
    extremes = np.float32([0.0, np.finfo(np.float32).max, np.inf, np.nan])
    return np.concatenate(
        [
            bits.view(np.float32),
            *neighbours,
            subnormals.view(np.float32),
            random.view(np.float32),
            extremes,
        ]
    )


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_e8m0_codes_match_the_oracle_at_every_boundary(rounding):
    amax = _sampled_amax()
    codes = to_numpy(mxfp8.e8m0_from_amax(amax, rounding))
    assert codes.dtype == np.uint8
    np.testing.assert_array_equal(codes, reference.mx_e8m0(amax, rounding))
    # The sign of amax is ignored.
    np.testing.assert_array_equal(
        to_numpy(mxfp8.e8m0_from_amax(-amax[:2000], rounding)),
        codes[:2000],
    )


def test_rceil_is_transformer_engine_and_jax_rule_but_at_one_tiny_amax():
    """TE's `float_to_e8m0(amax * (1 / 448))` and JAX's
    `cast_to_e8m0_with_rounding_up(amax / 448)` round `amax / 448` to
    float32 first. Over all 2,139,095,039 positive finite float32 amaxes
    (checked once in NumPy, 71 s) they agree with "rceil" but at one: the
    amax just above 448 * 2**-127 (bits 0x04600001), whose quotient lies
    within half a subnormal step of 2**-127 and rounds down to it, giving
    code 0 and a largest value of 448 * (1 + 2**-23 / 1.75), clipped to
    448; "rceil" gives code 1. Sampled here at every boundary."""
    amax = _sampled_amax()
    finite = np.isfinite(amax)
    ours = reference.mx_e8m0(amax[finite], "rceil")
    one = np.uint32(0x04600001).view(np.float32)
    for rule in (reference.mx_e8m0_transformer_engine, reference.mx_e8m0_jax):
        theirs = rule(amax[finite])
        differ = amax[finite][ours != theirs]
        assert np.unique(differ).tolist() == [one], rule.__name__
        assert rule(one) == 0 and reference.mx_e8m0(one, "rceil") == 1
    library = to_numpy(mxfp8.e8m0_from_amax(np.float32([one])))
    assert library.tolist() == [1]


def test_rceil_never_clips_and_floor_is_the_ocp_exponent():
    amax = _sampled_amax()
    amax = amax[np.isfinite(amax) & (amax > 0)].astype(np.float64)
    rceil = to_numpy(mxfp8.e8m0_from_amax(amax.astype(np.float32)))
    floor = to_numpy(mxfp8.e8m0_from_amax(amax.astype(np.float32), "floor"))
    rceil_scale = np.ldexp(1.0, rceil.astype(np.int64) - 127)
    assert (amax / rceil_scale <= 448).all()
    # ... and is the smallest such power of two, where above 2**-127.
    larger = rceil > 0
    assert (amax[larger] / (rceil_scale[larger] / 2) > 448).all()
    expected = np.clip(np.floor(np.log2(amax)) - 8, -127, 127) + 127
    np.testing.assert_array_equal(floor, expected)


@pytest.mark.parametrize(
    "amax, rceil, floor",
    [
        (0.0, 0, 0),
        (2.0**-149, 0, 0),
        (2.0**-127, 0, 0),
        (448.0 * 2.0**-127, 0, 0),
        (448.0 * 2.0**-126, 1, 1),
        (448.0, 127, 127),
        (449.0, 128, 127),
        (448.0 * 2.0**-20, 107, 107),
        (448.0 * 2.0**100, 227, 227),
        (float(_next_up(1.75)), 120, 119),
        (float(np.finfo(np.float32).max), 247, 246),
        (np.inf, 255, 255),
        (np.nan, 255, 255),
    ],
)
def test_e8m0_codes_of_named_amaxes(amax, rceil, floor):
    amax = np.float32([amax, -amax])
    assert to_numpy(mxfp8.e8m0_from_amax(amax)).tolist() == [rceil] * 2
    assert to_numpy(mxfp8.e8m0_from_amax(amax, "floor")).tolist() == [floor] * 2


def test_floor_clips_a_mantissa_above_1_75_where_rceil_does_not():
    top = _next_up(1.75 * 2.0**5)
    x = np.full((ROWS, COLUMNS), top / 4, np.float32)
    x[0, 7] = -top
    values = {}
    for rounding in ROUNDINGS:
        codes, scale = mxfp8.quantize(x, scale_rounding=rounding)
        codes = to_numpy(ops.cast(codes, "float32"))[0]
        values[rounding] = (codes[7], codes[0], int(to_numpy(scale)[0, 0]))
    assert values["rceil"] == (-224.0, 56.0, 125)
    assert values["floor"] == (-448.0, 112.0, 124)


@pytest.mark.parametrize("axis", [-1, 0])
def test_inf_or_nan_makes_the_block_scale_0xff_and_its_codes_nan(axis):
    x = np.ones((ROWS, COLUMNS), np.float32)
    x[3, 5], x[40, 60] = np.inf, np.nan
    codes, scale = mxfp8.quantize(x, axis)
    scale = to_numpy(scale)
    values = to_numpy(ops.cast(codes, "float32"))
    blocks = np.zeros_like(x, bool)
    if axis == -1:
        blocks[3, :32] = blocks[40, 32:64] = True
        assert scale[3, 0] == scale[40, 1] == 255
    else:
        blocks[:32, 5] = blocks[32:64, 60] = True
        assert scale[0, 5] == scale[1, 60] == 255
    assert (scale == 255).sum() == 2
    np.testing.assert_array_equal(np.isnan(values), blocks)
    np.testing.assert_array_equal(values[~blocks], 256.0)
    deq = to_numpy(mxfp8.dequantize(codes, ops.convert_to_tensor(scale), axis))
    np.testing.assert_array_equal(np.isnan(deq), blocks)
    np.testing.assert_array_equal(deq[~blocks], 1.0)


def test_dequantize_is_exact_for_every_code_and_scale_subnormals_included():
    """All 256 E4M3 codes times all 256 E8M0 scales: 65,536 values, from
    `2**-136` (a float32 subnormal, which XLA on a CPU would flush) to
    overflow (inf) and NaN."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    codes = codes.view(ml_dtypes.float8_e4m3fn)
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
    expected = reference.mx_dequantize(codes, scale)
    assert ((expected != 0) & (np.abs(expected) < 2.0**-126)).sum() == 568
    values = mxfp8.dequantize(
        ops.convert_to_tensor(codes.astype(np.float32), "float8_e4m3fn"),
        ops.convert_to_tensor(scale),
    )
    _assert_float32_bits_equal(values, expected)
    # Column blocks: the same values, transposed.
    values = mxfp8.dequantize(
        ops.convert_to_tensor(codes.T.astype(np.float32), "float8_e4m3fn"),
        ops.convert_to_tensor(np.ascontiguousarray(scale.T)),
        axis=0,
    )
    _assert_float32_bits_equal(values, np.ascontiguousarray(expected.T))


def test_scale_values_are_the_e8m0_values_of_ml_dtypes():
    scale = np.arange(256, dtype=np.uint8).reshape(16, 16)
    _assert_float32_bits_equal(
        mxfp8.scale_values(scale), reference.mx_scale_values(scale)
    )


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_compiled_quantize_and_dequantize_give_the_eager_bits(rounding):
    """XLA must neither flush the subnormal paths nor fold the float32 ->
    E4M3 -> float32 round trip of quantize-then-dequantize away."""
    backend = keras.backend.backend()
    if backend == "torch":
        pytest.skip("PyTorch runs eagerly here: nothing to compile")
    x = _data("float32", seed=1)

    def run(t):
        rows = mxfp8.quantize(t, -1, rounding)
        columns = mxfp8.quantize(t, 0, rounding)
        return (
            *rows,
            mxfp8.dequantize(*rows, axis=-1),
            mxfp8.dequantize(*columns, axis=0),
        )

    if backend == "jax":
        import jax

        compiled = [jax.jit(run)(x)]
    else:
        import tensorflow as tf

        compiled = [tf.function(run, jit_compile=True)(x), tf.function(run)(x)]
    eager = run(ops.convert_to_tensor(x))
    expected_codes, _ = reference.mx_quantize(x, -1, rounding)
    for codes, scale, rows, columns in compiled:
        assert_fp8_codes_equal(codes, expected_codes)
        np.testing.assert_array_equal(to_numpy(scale), to_numpy(eager[1]))
        _assert_float32_bits_equal(rows, to_numpy(eager[2]))
        _assert_float32_bits_equal(columns, to_numpy(eager[3]))
        # The round trip is not the identity: it rounds.
        assert (to_numpy(rows) != x).sum() > x.size // 2


@pytest.mark.backends("tensorflow")
def test_a_traced_call_with_unknown_dimensions_gives_the_same_bits():
    """Only the blocked axis must be known: a `tf.function` traced for
    `[None, 64, None]` (where Keras' TensorFlow `view` alone fails)."""
    import tensorflow as tf

    x = _data("float32", seed=3)[:, :64]
    spec = tf.TensorSpec([None, 64, None], tf.float32)

    def run(t):
        codes, scale = mxfp8.quantize(t, axis=1)
        return codes, scale, mxfp8.dequantize(codes, scale, axis=1)

    for jit_compile in (False, True):
        traced = tf.function(
            run, input_signature=[spec], jit_compile=jit_compile
        )
        codes, scale, values = traced(x[:, :, None])
        expected_codes, expected_scale = reference.mx_quantize(x, 1)
        assert_fp8_codes_equal(codes[..., 0], expected_codes)
        np.testing.assert_array_equal(to_numpy(scale)[..., 0], expected_scale)
        _assert_float32_bits_equal(
            values[..., 0],
            reference.mx_dequantize(expected_codes, expected_scale, 1),
        )


@pytest.mark.backends("jax")
def test_codes_and_scales_match_jax_scaled_dot_general_quantize():
    """`jax._src.cudnn.scaled_matmul_stablehlo.quantize` (the operands of
    `jax.nn.scaled_dot_general("mxfp8")`), on blocks whose amax / 448 is a
    normal float32, all finite. On a CPU its arithmetic meets XLA's flush
    of subnormals elsewhere: an all-zero block gets NaN codes (0 divided
    by 2**-127 read as 0), amax / 448 below 2**-126 is read as 0 (code 0,
    clipping to 448), and a NaN amax wraps to code 0."""
    try:
        from jax._src.cudnn.scaled_matmul_stablehlo import quantize
        from jax._src.nn.functions import get_scaled_dot_general_config
    except ImportError as error:
        pytest.skip(f"JAX's MXFP8 quantize is not importable here: {error}")
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    base = rng.uniform(-116, 110, (ROWS, 1))
    x = np.exp2(base + rng.uniform(0, 10, (ROWS, COLUMNS)))
    x *= rng.choice([-1.0, 1.0], (ROWS, COLUMNS))
    x = x.astype(np.float32)
    x[:32, :32] = _tile(rng, 448.0 * 2.0**-20)
    x[:32, 32:64] = _tile(rng, _next_up(1.75 * 2.0**3))
    config = get_scaled_dot_general_config("mxfp8")
    jax_codes, jax_scale = quantize(jnp.asarray(x), config)
    codes, scale = mxfp8.quantize(x)
    np.testing.assert_array_equal(
        to_numpy(scale), np.asarray(jax_scale).view(np.uint8)
    )
    assert_fp8_codes_equal(codes, np.asarray(jax_codes))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: mxfp8.quantize(np.ones((4, 48))), ValueError, "Pad `x`"),
        (lambda: mxfp8.quantize(np.ones((40, 32)), 0), ValueError, "Pad `x`"),
        (
            lambda: mxfp8.quantize(np.ones((4, 32)), scale_rounding="ceil"),
            ValueError,
            r"`scale_rounding` is one of \['rceil', 'floor'\]",
        ),
        (lambda: mxfp8.quantize(np.ones((4, 32)), 2), ValueError, "`axis`"),
        (
            lambda: mxfp8.quantize(np.ones((4, 32), "int32")),
            TypeError,
            "floating point",
        ),
        (
            lambda: mxfp8.e8m0_from_amax(np.ones(3), "even"),
            ValueError,
            "`rounding` is one of",
        ),
        (
            lambda: mxfp8.dequantize(*mxfp8.quantize(np.ones((4, 64))), axis=0),
            ValueError,
            "one E8M0 code per 32",
        ),
        (
            lambda: mxfp8.dequantize(
                mxfp8.quantize(np.ones((4, 64)))[0], np.ones((4, 1), "uint8")
            ),
            ValueError,
            r"scale.shape=\(4, 1\)",
        ),
    ],
)
def test_bad_arguments_raise_saying_what_was_expected_and_the_fix(
    call, error, match
):
    with pytest.raises(error, match=match):
        call()


def test_the_size_error_names_the_shape_and_the_fix():
    with pytest.raises(ValueError) as raised:
        mxfp8.quantize(np.ones((2, 3, 50), "float32"))
    message = str(raised.value)
    assert "multiple of 32" in message
    assert "x.shape=(2, 3, 50)" in message and "axis=2" in message
    assert "Pad `x` with zeros" in message
