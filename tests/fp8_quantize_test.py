"""`keras_mp.fp8.quantize`: codes bit for bit as NumPy + `ml_dtypes`.

The oracle (`keras_mp.testing.fp8_reference`) clips with `np.clip` and
casts with `ml_dtypes`; scales come from `np.frexp`. Every backend must
give the same code bits (NaN payloads aside: NaN-ness is compared) and
the same scales, for both formats, every granularity and float32,
bfloat16 and float16 inputs.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_mp import fp8
from keras_mp.testing import assert_fp8_codes_equal
from keras_mp.testing import fp8_code_bits
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

FORMATS = ["e4m3", "e5m2"]
DTYPES = ["float32", "bfloat16", "float16"]
# (granularity, axis, block_shape)
MODES = [
    ("tensorwise", -1, None),
    ("rowwise", -1, None),
    ("rowwise", 0, None),
    ("block", -1, None),
    ("block", 0, None),
    ("block", -1, (128, 128)),
]
ROWS, COLUMNS = 1664, 128  # 212,992 values, 2**-20 ... 2**12


def _special_values(fmt):
    dtype, fmax = reference.FORMATS[fmt]
    subnormals = np.float32(ml_dtypes.finfo(dtype).smallest_subnormal)
    return np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1.1 * fmax, -1.1 * fmax, fmax]
        + [k * subnormals for k in (1, 1.5, 2, 2.5, 3, -1, -3.5)],
        np.float32,
    )


def _data(fmt, dtype, seed=0):
    """Log-uniform magnitudes over 2**-20 ... 2**12 with random signs, each
    row spanning its own 12 binades (so per-row and per-tile scales differ
    from the tensor's)."""
    rng = np.random.default_rng(seed)
    low = rng.uniform(-20, 0, (ROWS, 1))
    exponents = low + rng.uniform(0, 12, (ROWS, COLUMNS))
    x = np.exp2(exponents) * rng.choice([-1.0, 1.0], (ROWS, COLUMNS))
    return x.astype(np.float32).astype(dtype)


def _with_specials(x, fmt):
    """`x` with the special values in its first rows (a scale of 1 puts
    them where the format's clipping, subnormals and NaN/inf rules act)."""
    x = x.astype(np.float32)
    specials = _special_values(fmt)
    x[: len(specials), :5] = specials[:, None]
    return x.astype(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}{m[1]}{m[2]}")
def test_codes_and_scales_match_numpy_and_ml_dtypes(mode, fmt, dtype):
    granularity, axis, block_shape = mode
    x = _data(fmt, dtype)
    host = x.astype(dtype)
    codes, scale = fp8.quantize(
        ops.convert_to_tensor(host.astype(np.float32), dtype=dtype),
        fmt,
        granularity,
        axis=axis,
        block_shape=block_shape,
    )
    expected_codes, expected_scale = reference.quantize(
        host.astype(np.float32), fmt, granularity, axis, block_shape
    )
    assert keras.backend.standardize_dtype(codes.dtype) == (
        "float8_e4m3fn" if fmt == "e4m3" else "float8_e5m2"
    )
    assert_fp8_codes_equal(codes, expected_codes)
    np.testing.assert_array_equal(to_numpy(scale), expected_scale)
    assert to_numpy(scale).dtype == np.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_given_scale_clips_finite_values_and_keeps_inf_and_nan(fmt, dtype):
    x = _with_specials(_data(fmt, dtype, seed=1), fmt).astype(dtype)
    host = x.astype(np.float32)
    codes, scale = fp8.quantize(
        ops.convert_to_tensor(host, dtype=dtype), fmt, scale=1.0
    )
    assert_fp8_codes_equal(codes, reference.encode(host, 1.0, fmt))
    assert float(to_numpy(scale)) == 1.0
    values = to_numpy(ops.cast(codes, "float32"))[:8, 0]
    fmax = reference.FORMATS[fmt][1]
    # 0, -0, inf, -inf, NaN, 1.1 max, -1.1 max, max
    assert values[5] == fmax and values[6] == -fmax and values[7] == fmax
    assert np.isnan(values[4])
    if fmt == "e5m2":
        assert values[2] == np.inf and values[3] == -np.inf
    else:  # E4M3 has no inf: NaN, never a saturated finite value.
        assert np.isnan(values[2]) and np.isnan(values[3])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}{m[1]}{m[2]}")
def test_nonfinite_values_give_nonfinite_scales_never_clipped(mode, fmt):
    granularity, axis, block_shape = mode
    x = _with_specials(_data(fmt, "float32", seed=2), fmt)
    codes, scale = fp8.quantize(
        x, fmt, granularity, axis=axis, block_shape=block_shape
    )
    expected_codes, expected_scale = reference.quantize(
        x, fmt, granularity, axis, block_shape
    )
    assert_fp8_codes_equal(codes, expected_codes)
    np.testing.assert_array_equal(to_numpy(scale), expected_scale)
    # The slices holding inf or NaN keep a non-finite scale.
    assert not np.isfinite(to_numpy(scale)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}{m[1]}{m[2]}")
def test_dequantize_gives_back_the_values_of_the_codes(mode, fmt):
    """`fp8.dequantize` undoes `fp8.quantize` for every granularity: each
    code times its own scale, as the oracle's float64 product (exact)."""
    granularity, axis, block_shape = mode
    x = _with_specials(_data(fmt, "float32", seed=3), fmt)
    codes, scale = fp8.quantize(
        x, fmt, granularity, axis=axis, block_shape=block_shape
    )
    values = fp8.dequantize(
        codes, scale, fmt, granularity, axis=axis, block_shape=block_shape
    )
    expected = reference.dequantized(x, fmt, granularity, axis, block_shape)
    assert to_numpy(values).dtype == np.float32
    np.testing.assert_array_equal(to_numpy(values), expected.astype(np.float32))


def test_dequantize_names_what_it_expected():
    codes, scale = fp8.quantize(np.ones((4, 128), "float32"), "e4m3", "rowwise")
    with pytest.raises(
        TypeError, match="float8_e5m2.*Received: codes of dtype"
    ):
        fp8.dequantize(codes, scale, "e5m2", "rowwise")
    with pytest.raises(
        ValueError, match='tiles a tensor for granularity="block"'
    ):
        fp8.dequantize(codes, scale, "e4m3", "rowwise", block_shape=(128, 128))
    with pytest.raises(ValueError, match="`axis` is an axis of `x`"):
        fp8.dequantize(codes, scale, "e4m3", "rowwise", axis=2)
    with pytest.raises(
        ValueError, match='tiles a tensor for granularity="block"'
    ):
        fp8.quantize(np.ones((128, 128), "float32"), block_shape=(128, 128))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_operands_hold_the_values_of_the_codes_bit_for_bit(fmt):
    """What `fp8.dot`'s GEMMs multiply: FP8 codes, or on PyTorch's CPU the
    codes' values rounded in float32 arithmetic; either way the values of
    the oracle's codes, over every bfloat16 bit pattern (every sign,
    exponent and 7 leading mantissa bits: ±0, subnormals, inf, NaN),
    the test data, ties, and finite values beyond the format's range."""
    from keras_mp._fp8.formats.e4m3_e5m2 import gemm_operand

    patterns = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    data = _with_specials(_data(fmt, "float32", seed=4), fmt).ravel()
    fmax = reference.FORMATS[fmt][1]
    grid = reference.encode(np.linspace(-fmax, fmax, 9999), 1.0, fmt)
    grid = grid.astype(np.float32)
    ties = (grid[1:] + grid[:-1]) / 2  # halfway: round to even
    beyond = np.float32([1.01, 1.1, 1.5, 3e5, 3e33]) * fmax
    y = np.concatenate([patterns, data, ties, beyond, -beyond])
    # Scaled by 2**3: the operand is that of y, from x = y * 2**3.
    with np.errstate(over="ignore"):  # the largest patterns become inf
        x = (y.astype(np.float64) * 8).astype(np.float32)
    scale = ops.convert_to_tensor(np.float32(8.0))
    operand = gemm_operand(ops.convert_to_tensor(x), scale, fmt)
    if keras.backend.backend() == "torch":
        assert keras.backend.standardize_dtype(operand.dtype) == "float32"
    values = to_numpy(ops.cast(operand, "float32"))
    expected = reference.encode(x, np.float32(8.0), fmt).astype(np.float32)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(values), nan)
    np.testing.assert_array_equal(
        values[~nan].view(np.uint32), expected[~nan].view(np.uint32)
    )


def test_scale_is_the_smallest_power_of_two_within_the_margin():
    amax = np.array([448.0, 448.5, 449.0, 896.0, 1.0, 0.0, 3e38, 1e-30])
    for margin in (0, 1, 3):
        _, scale = fp8.quantize(
            amax[:, None], granularity="rowwise", margin=margin
        )
        scale = to_numpy(scale)[:, 0]
        np.testing.assert_array_equal(
            scale, reference.scale(amax, "e4m3", margin)
        )
        exponent = np.log2(scale)
        assert np.array_equal(exponent, np.round(exponent))
        limit = 448.0 / 2**margin
        assert (amax / scale <= limit).all()
        assert (amax[amax > 1e-30] / (scale[amax > 1e-30] / 2) > limit).all()
    _, scale = fp8.quantize(
        np.array([448.0, 449.0]), granularity="rowwise", axis=0
    )
    assert to_numpy(scale).tolist() == [2.0]


def test_quantize_works_the_same_inside_a_compiled_function():
    x = _with_specials(_data("e4m3", "float32", seed=3), "e5m2")
    eager = [fp8.quantize(x, "e5m2", "block")]
    backend = keras.backend.backend()
    run = lambda t: fp8.quantize(t, "e5m2", "block")  # noqa: E731
    if backend == "jax":
        import jax

        compiled = jax.jit(run)(x)
    elif backend == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(run, jit_compile=True)(x)
        assert_fp8_codes_equal(tf.function(run)(x)[0], _np_codes(eager[0][0]))
    else:
        pytest.skip("PyTorch runs eagerly: nothing to compile")
    assert_fp8_codes_equal(compiled[0], _np_codes(eager[0][0]))
    np.testing.assert_array_equal(to_numpy(compiled[1]), to_numpy(eager[0][1]))


def _np_codes(codes):
    return fp8_code_bits(codes).view(ml_dtypes.float8_e5m2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"fmt": "e3m4"}, ValueError, "`fmt` is one of"),
        ({"granularity": "mx"}, ValueError, "`granularity` is one of"),
        ({"margin": -1}, ValueError, "`margin` is an integer"),
        (
            {"granularity": "rowwise", "axis": 2},
            ValueError,
            "`axis` is an axis",
        ),
        ({"granularity": "block", "axis": 0}, ValueError, "pad that dim"),
        (
            {"granularity": "block", "block_shape": (128, 64)},
            ValueError,
            "block_shape",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_choices_and_the_fix(
    kwargs, error, match
):
    with pytest.raises(error, match=match):
        fp8.quantize(np.ones((48, 128), "float32"), **kwargs)


def test_a_non_float_input_raises_a_type_error():
    with pytest.raises(TypeError, match="floating point"):
        fp8.quantize(np.ones((4, 4), "int32"))


def test_scale_from_amax_takes_one_format_per_value():
    # Several tensors' scales in one computation (delayed scaling's
    # history, PyTorch's current scales): each that of its own format.
    from keras_mp._fp8.formats.e4m3_e5m2 import scale_from_amax

    amax = np.array([0.0, 3.0e-3, 448.0, 449.0, 6.0e4, np.inf], "float32")
    formats = ("e4m3", "e5m2", "e4m3", "e5m2", "e4m3", "e5m2")
    for margin in (0, 2):
        together = to_numpy(scale_from_amax(amax, formats, margin))
        apart = [
            to_numpy(scale_from_amax(amax[i], fmt, margin))
            for i, fmt in enumerate(formats)
        ]
        np.testing.assert_array_equal(together, np.array(apart, "float32"))


@pytest.mark.backends("torch")
def test_torchs_own_scale_from_amax_gives_the_bits_of_keras_ops(monkeypatch):
    """PyTorch's `scale_from_amax` runs in torch's own operations (a third
    of the host time of `keras.ops`, spent per tensor in an eager GPU
    step): the same bits for every exponent, at and around each format's
    threshold mantissas, random amaxes, 0, the smallest subnormal, inf and
    NaN, for each format and margin, one format or one per value."""
    import torch

    from keras_mp._fp8.formats.e4m3_e5m2 import scale_from_amax
    from keras_mp.backend.torch import ops as torch_ops

    exponents = np.arange(256, dtype=np.uint32) << 23
    mantissas = np.array(
        [0, 1, 0x0FFFFF, 0x100000, 0x100001, 0x5FFFFF, 0x600000, 0x600001]
        + [0x7FFFFE, 0x7FFFFF],
        np.uint32,
    )
    rng = np.random.default_rng(0)
    bits = np.concatenate(
        [
            (exponents[:, None] | mantissas[None, :]).ravel(),
            rng.integers(0, 0x7F800000, 20000, dtype=np.uint32),
            np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF], np.uint32),  # NaNs
        ]
    )
    amax = torch.from_numpy(bits.view(np.float32).copy()).reshape(-1, 3)
    formats = ("e4m3", "e5m2", "e4m3")
    calls = []
    own = torch_ops.scale_from_amax

    def counting(*args):
        calls.append(1)
        return own(*args)

    monkeypatch.setattr(torch_ops, "scale_from_amax", counting)
    for fmt in ("e4m3", "e5m2", formats):
        for margin in (0, 1, 3):
            monkeypatch.setattr(torch_ops, "BIT_OPS", True)
            fast = scale_from_amax(amax, fmt, margin)
            monkeypatch.setattr(torch_ops, "BIT_OPS", False)
            generic = scale_from_amax(amax, fmt, margin)
            np.testing.assert_array_equal(
                fast.view(torch.int32).numpy(),
                generic.view(torch.int32).numpy(),
            )
    assert len(calls) == 9
