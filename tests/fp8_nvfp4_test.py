"""`keras_mp._fp8.formats.nvfp4`: codes, scales and rotations bit for bit as the
NumPy + `ml_dtypes` transcription of Transformer Engine's NVFP4 reference
(`keras_mp.testing.fp8_reference.nv_*`), on every backend, eager and
compiled.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_mp import _random_bits
from keras_mp._fp8.formats import nvfp4
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

# (axis, block_shape)
MODES = [(-1, None), (0, None), (-1, (16, 16))]
MODE_IDS = ["1x16_last", "1x16_first", "16x16"]
# Most tests share one shape: JAX compiles each operation once a shape.
SHAPE = (64, 64)
SMALL_SHAPE = (2, 32)
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _data(shape, seed=0, dtype="float32"):
    """Log-uniform magnitudes with random signs, each row offset by up to
    2**±30 and spanning 12 binades: blocks far below the tensor's amax get
    a zero E4M3 scale (and saturated codes, as in Transformer Engine)."""
    rng = np.random.default_rng(seed)
    offset = rng.uniform(-30, 18, shape[:1] + (1,) * (len(shape) - 1))
    offset[0], offset[-1] = -30, 18  # both ends of the range, always
    x = np.exp2(offset + rng.uniform(0, 12, shape))
    x *= rng.choice([-1.0, 1.0], shape)
    return x.astype(np.float32).astype(dtype).astype(np.float32)


def _bits(shape, seed):
    return _random_bits.random_bits(
        shape, ops.convert_to_tensor(np.array(seed, np.int32))
    )


def _as_float32(tensor):
    return np.asarray(to_numpy(ops.cast(tensor, "float32")), np.float32)


def _assert_bits_equal(got, expected):
    """Float32 values equal bit for bit; NaN only where NaN is expected."""
    got = np.asarray(got, np.float32)
    expected = np.asarray(expected).astype(np.float32)
    assert got.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    mismatch = (got.view(np.uint32) != expected.view(np.uint32)) & ~nan
    assert not mismatch.any(), (
        f"{mismatch.sum()} differ, e.g. got {got[mismatch][:5]}, expected "
        f"{expected[mismatch][:5]}"
    )


def _assert_quantized_equal(result, expected):
    codes, (block, tensor) = result
    expected_codes, (expected_block, expected_tensor) = expected
    assert keras.backend.standardize_dtype(codes.dtype) == "uint8"
    assert keras.backend.standardize_dtype(block.dtype) == "float8_e4m3fn"
    assert keras.backend.standardize_dtype(tensor.dtype) == "float32"
    assert tuple(tensor.shape) == ()
    got_codes = np.asarray(to_numpy(codes))
    mismatch = got_codes != expected_codes
    assert not mismatch.any(), (
        f"{mismatch.sum()} codes differ, e.g. got {got_codes[mismatch][:5]}"
        f", expected {expected_codes[mismatch][:5]}"
    )
    _assert_bits_equal(_as_float32(block), expected_block)
    _assert_bits_equal(_as_float32(tensor), expected_tensor)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_codes_and_scales_match_the_transcribed_reference(mode, dtype):
    axis, block_shape = mode
    x = _data(SHAPE, seed=1, dtype=dtype)
    result = nvfp4.quantize(
        ops.convert_to_tensor(x, dtype=dtype), axis, block_shape
    )
    expected = reference.nv_quantize(x, axis, block_shape)
    _assert_quantized_equal(result, expected)
    # The data reach every code, zero block scales, and the clip at 448.
    assert len(np.unique(expected[0])) == 16
    scales = expected[1][0].astype(np.float32)
    assert (scales == 448).any()
    # Row 0 lies 2**48 below the tensor's amax (blocks across rows take the
    # amax of 16 rows: none is that far below).
    assert (scales == 0).any() or mode != (-1, None)
    _assert_bits_equal(
        to_numpy(nvfp4.dequantize(*result, axis, block_shape)),
        reference.nv_dequantize(*expected, axis, block_shape),
    )


def test_blocks_along_a_middle_axis_of_a_3d_tensor():
    x = _data((3, 48, 5), seed=2)
    codes, (block, tensor) = nvfp4.quantize(x, axis=1)
    assert tuple(block.shape) == (3, 3, 5)
    _assert_quantized_equal(
        (codes, (block, tensor)), reference.nv_quantize(x, 1)
    )


def test_ties_round_to_the_even_code():
    # S_enc = 2688 / 2688 = 1 and a block amax of 6 give dec = 1, enc = 1:
    # the values themselves are rounded.
    row = [6.0] + TIES + [-t for t in TIES] + [0.0]
    x = np.zeros(SMALL_SHAPE, np.float32)
    x[0, :16] = row
    codes, (block, tensor) = nvfp4.quantize(x, tensor_amax=2688.0)
    assert float(to_numpy(tensor)) == 1.0
    assert _as_float32(block).tolist() == [[1.0, 0.0], [0.0, 0.0]]
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    assert np.asarray(to_numpy(codes))[0, :16].tolist() == expected
    _assert_quantized_equal(
        (codes, (block, tensor)),
        reference.nv_quantize(x, tensor_amax=2688.0),
    )
    values = to_numpy(nvfp4.dequantize(codes, (block, tensor)))[0]
    assert values[1:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_an_all_zero_tensor_has_tensor_scale_one_and_zero_codes():
    x = np.zeros(SMALL_SHAPE, np.float32)
    x[1, 3] = -0.0
    codes, (block, tensor) = nvfp4.quantize(x)
    assert float(to_numpy(tensor)) == 1.0
    assert (_as_float32(block) == 0).all()
    # -0.0 keeps its sign bit (code 8), as `ml_dtypes` casts it.
    expected_codes = np.zeros(SMALL_SHAPE, np.uint8)
    expected_codes[1, 3] = 8
    np.testing.assert_array_equal(to_numpy(codes), expected_codes)
    _assert_quantized_equal((codes, (block, tensor)), reference.nv_quantize(x))
    assert (to_numpy(nvfp4.dequantize(codes, (block, tensor))) == 0).all()


def test_subnormal_inputs_count_as_zero_on_every_backend():
    # XLA on a CPU and TensorFlow flush float32 subnormals, PyTorch does
    # not: quantize flushes them itself.
    x = np.zeros(SMALL_SHAPE, np.float32)
    x[0, :3] = [1e-40, -3e-41, 5e-39]
    x[1, :2] = [5e-39, 1e-3]
    for tensor_amax in (None, 5e-39):
        codes, (block, tensor) = nvfp4.quantize(x, tensor_amax=tensor_amax)
        _assert_quantized_equal(
            (codes, (block, tensor)),
            reference.nv_quantize(x, tensor_amax=tensor_amax),
        )
        assert np.asarray(to_numpy(codes))[0, :3].tolist() == [0, 8, 0]
    assert float(to_numpy(tensor)) == 1.0


def test_block_scales_clip_at_448_and_codes_saturate_at_6():
    # A tensor amax below the data's (a stale or reduced one) scales the
    # large block beyond E4M3's range: its scale clips to 448 and its codes
    # to ±6, finite values never NaN.
    x = np.linspace(-100.0, 100.0, 32, dtype=np.float32)
    x = np.stack([x, x / 1000.0])
    result = nvfp4.quantize(x, tensor_amax=1.0)
    expected = reference.nv_quantize(x, tensor_amax=1.0)
    _assert_quantized_equal(result, expected)
    assert _as_float32(result[1][0])[0, 0] == 448.0
    codes = np.asarray(to_numpy(result[0]))
    assert codes[0, 0] == 15 and codes[0, -1] == 7
    assert _as_float32(result[1][0])[1, 0] < 448.0
    # Unclipped, the scale would have been far above 448.
    assert 100.0 * float(reference.nv_tensor_scale(1.0)) / 6 > 448


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_nonfinite_values_dequantize_to_nan_never_to_finite_values(mode, value):
    axis, block_shape = mode
    x = _data(SHAPE, seed=3)
    x[5, 7] = value
    finite_amax = float(np.nanmax(np.abs(np.where(np.isinf(x), 0, x))))
    # With a finite tensor amax only the block holding it is NaN.
    result = nvfp4.quantize(x, axis, block_shape, tensor_amax=finite_amax)
    expected = reference.nv_quantize(x, axis, block_shape, finite_amax)
    _assert_quantized_equal(result, expected)
    values = to_numpy(nvfp4.dequantize(*result, axis, block_shape))
    nan_blocks = np.isnan(values)
    assert nan_blocks[5, 7] and nan_blocks.sum() == (256 if block_shape else 16)
    assert np.isfinite(values[~nan_blocks]).all()
    # From `x` itself the global amax is not finite: every scale is NaN.
    result = nvfp4.quantize(x, axis, block_shape)
    _assert_quantized_equal(result, reference.nv_quantize(x, axis, block_shape))
    assert np.isnan(to_numpy(result[1][1]))
    assert np.isnan(
        to_numpy(nvfp4.dequantize(*result, axis, block_shape))
    ).all()


def test_a_nonfinite_tensor_amax_gives_nan_scales():
    x = _data(SMALL_SHAPE, seed=4)
    _, (block, tensor) = nvfp4.quantize(x, tensor_amax=np.float32(np.inf))
    assert np.isnan(to_numpy(tensor)) and np.isnan(_as_float32(block)).all()


@pytest.mark.parametrize("axis", [-1, 0])
def test_pack_puts_the_first_code_in_the_low_nibble_and_unpack_inverts_it(
    axis,
):
    codes = np.random.default_rng(5).integers(0, 16, (6, 8), np.uint8)
    packed = nvfp4.pack(codes, axis=axis)
    assert keras.backend.standardize_dtype(packed.dtype) == "uint8"
    np.testing.assert_array_equal(
        to_numpy(packed), reference.nv_pack(codes, axis)
    )
    np.testing.assert_array_equal(
        to_numpy(nvfp4.unpack(packed, axis=axis)), codes
    )
    assert to_numpy(nvfp4.pack(np.array([3, 12], np.uint8))).tolist() == [0xC3]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_stochastic_rounding_matches_the_reference_given_the_same_bits(mode):
    axis, block_shape = mode
    x = _data(SHAPE, seed=6)
    bits = _bits(SHAPE, [7, 11])
    result = nvfp4.quantize(x, axis, block_shape, random_bits=bits)
    expected = reference.nv_quantize(
        x, axis, block_shape, random_bits=to_numpy(bits)
    )
    _assert_quantized_equal(result, expected)
    again = nvfp4.quantize(x, axis, block_shape, random_bits=bits)
    np.testing.assert_array_equal(to_numpy(again[0]), to_numpy(result[0]))
    # Other bits give other codes, and only the low 8 bits count.
    other = nvfp4.quantize(
        x, axis, block_shape, random_bits=_bits(SHAPE, [8, 11])
    )
    assert (to_numpy(other[0]) != to_numpy(result[0])).any()
    high = ops.bitwise_or(bits, 0x7FFFFF00)
    same = nvfp4.quantize(x, axis, block_shape, random_bits=high)
    np.testing.assert_array_equal(to_numpy(same[0]), to_numpy(result[0]))


def test_stochastic_rounding_keeps_grid_values_and_spans_every_bit_value():
    # Grid values never move; halfway between two neighbours, exactly half
    # of the 256 bit values round up.
    grid = reference.E2M1_GRID
    row = np.concatenate([[6.0], grid[:7], -grid[1:], [0.0]])
    row = row.astype(np.float32)
    x = np.tile(row, (256, 1))
    bits = np.tile(np.arange(256, dtype=np.int32)[:, None], (1, 16))
    codes, _ = nvfp4.quantize(x, tensor_amax=2688.0, random_bits=bits)
    rounded, _ = nvfp4.quantize(x, tensor_amax=2688.0)
    np.testing.assert_array_equal(to_numpy(codes), to_numpy(rounded))
    half = np.tile(np.float32([6.0, 0.25, 1.75, 5.0] * 4), (256, 1))
    codes, _ = nvfp4.quantize(half, tensor_amax=2688.0, random_bits=bits)
    up = np.asarray(to_numpy(codes))[:, 1:4] == [1, 4, 7]
    assert up.sum(axis=0).tolist() == [128, 128, 128]


def _draws(x, count, seed):
    """`count` stochastic roundings of `x` (one row of blocks, each holding
    a 6: S_enc = 1 with tensor_amax 2688, dec = enc = 1), in one call."""
    tiled = np.tile(x, (count, 1))
    bits = _bits(tiled.shape, seed)
    codes, scale = nvfp4.quantize(tiled, tensor_amax=2688.0, random_bits=bits)
    return to_numpy(nvfp4.dequantize(codes, scale))


def test_stochastic_rounding_is_unbiased_and_beats_nearest_on_average():
    rng = np.random.default_rng(9)
    x = rng.uniform(-6.0, 6.0, (1, 64)).astype(np.float32)
    x[0, ::16] = 6.0
    draws = _draws(x, 1000, [21, 5])
    grid = reference.E2M1_GRID.astype(np.float64)
    magnitude = np.abs(x[0]).astype(np.float64)
    low = np.searchsorted(grid, magnitude, side="right") - 1
    spread = grid[np.minimum(low + 1, 7)] - grid[low]
    # A draw lies on one of the two neighbours: its standard deviation is
    # at most half their spread.
    sigma = spread / 2 / np.sqrt(1000)
    error = np.abs(draws.mean(axis=0) - x[0])
    assert (error <= 3 * sigma).all(), error[error > 3 * sigma]
    # Transformer Engine's test: the mean of 50 draws is closer than RN.
    nearest = to_numpy(nvfp4.dequantize(*nvfp4.quantize(x, tensor_amax=2688.0)))
    rmse_sr = np.sqrt(np.mean((draws[:50].mean(axis=0) - x[0]) ** 2))
    rmse_rn = np.sqrt(np.mean((nearest[0] - x[0]) ** 2))
    assert rmse_sr < rmse_rn, (rmse_sr, rmse_rn)


def test_hadamard_matrix_is_orthogonal_exactly_with_te_signs_on_rows():
    h = to_numpy(nvfp4.hadamard_matrix())
    assert h.dtype == np.float32 and h.shape == (16, 16)
    assert (h @ h.T == np.eye(16, dtype=np.float32)).all()
    np.testing.assert_array_equal(h, reference.nv_hadamard_matrix())
    # Row i is S_i times row i of the Sylvester matrix (first column S/4).
    np.testing.assert_array_equal(h[:, 0] * 4, reference.HADAMARD_SIGNS)
    assert (np.abs(h) == 0.25).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_hadamard_is_x_times_h_bit_for_bit_on_every_backend(axis, dtype):
    x = _data(SHAPE, seed=10, dtype=dtype)
    y = to_numpy(nvfp4.hadamard(ops.convert_to_tensor(x, dtype=dtype), axis))
    assert y.dtype == np.float32
    _assert_bits_equal(y, reference.nv_hadamard(x, axis))
    moved = np.moveaxis(x.astype(np.float64), axis, -1)
    exact = moved.reshape(moved.shape[:-1] + (-1, 16)) @ (
        reference.nv_hadamard_matrix()
    )
    exact = np.moveaxis(exact.reshape(moved.shape), -1, axis)
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-6 * np.abs(x).max())


def test_rotating_both_wgrad_operands_along_tokens_keeps_the_product():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((256, 32)).astype(np.float32)
    g = rng.standard_normal((256, 48)).astype(np.float32)
    plain = ops.matmul(ops.transpose(x), g)
    rotated = ops.matmul(
        ops.transpose(nvfp4.hadamard(x, axis=0)), nvfp4.hadamard(g, axis=0)
    )
    plain, rotated = to_numpy(plain), to_numpy(rotated)
    exact = x.astype(np.float64).T @ g.astype(np.float64)
    scale = np.abs(x.astype(np.float64)).T @ np.abs(g.astype(np.float64))
    assert (np.abs(rotated - plain) <= 1e-5 * scale).all()
    assert np.abs(rotated - exact).max() <= 1e-5 * np.abs(exact).max()


def test_rotated_then_quantized_codes_match_the_reference():
    x = _data(SHAPE, seed=12, dtype="bfloat16")
    rotated = nvfp4.hadamard(ops.convert_to_tensor(x, "bfloat16"), axis=0)
    _assert_quantized_equal(
        nvfp4.quantize(rotated, axis=0),
        reference.nv_quantize(reference.nv_hadamard(x, 0), 0),
    )


def test_te_jax_operation_order_gives_the_same_e4m3_block_scales():
    # TE-JAX computes (amax / 6) * S_enc, TE-PyTorch amax * (S_enc * fl(1/6)).
    rng = np.random.default_rng(13)
    amax = np.exp2(rng.uniform(-20, 20, 819_200)).astype(np.float32)
    s_enc = reference.nv_tensor_scale(amax.max() * 1.5)
    torch_order = reference.nv_block_scale(amax, s_enc)
    jax_order = reference.nv_block_scale(amax, s_enc, order="jax")
    np.testing.assert_array_equal(
        torch_order.view(np.uint8), jax_order.view(np.uint8)
    )
    # The float32 products before the cast do differ.
    sixth = np.float32(1) / np.float32(6)
    assert ((amax / np.float32(6) * s_enc) != (amax * (s_enc * sixth))).any()


def _te_cast_to_fp4(y):
    """Transformer Engine's `cast_to_fp4x2` before packing: one code per
    value, by its thresholds (ties to even written out)."""
    # (code, low, high, low included, high included) of |y|.
    ranges = [
        (0, 0.0, 0.25, True, True),
        (1, 0.25, 0.75, False, False),
        (2, 0.75, 1.25, True, True),
        (3, 1.25, 1.75, False, False),
        (4, 1.75, 2.5, True, True),
        (5, 2.5, 3.5, False, False),
        (6, 3.5, 5.0, True, True),
        (7, 5.0, np.inf, False, True),
    ]
    magnitude = np.abs(y)
    codes = np.zeros(y.shape, np.uint8)
    for code, low, high, low_in, high_in in ranges:
        above = magnitude >= low if low_in else magnitude > low
        below = magnitude <= high if high_in else magnitude < high
        codes[above & below] = code
    return codes + 8 * (y < 0)


def test_the_reference_e2m1_cast_is_te_cast_to_fp4x2():
    # The `ml_dtypes` cast the reference uses against TE's thresholds, on a
    # fine grid, the ties and their neighbours. (TE's thresholds map an
    # exact -0.0 to code 0; `ml_dtypes` and keras_mp keep its sign, code 8.)
    ties = np.float32(TIES)
    y = np.concatenate(
        [
            np.linspace(-6, 6, 4801, dtype=np.float32),
            ties,
            np.nextafter(ties, np.float32(0)),
            np.nextafter(ties, np.float32(7)),
        ]
    )
    y = np.concatenate([y, -y]).astype(np.float32)
    y = y[y != 0]
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(codes, _te_cast_to_fp4(y))


def test_compiled_functions_give_the_eager_bits():
    """XLA must keep the fp32 -> E4M3 -> fp32 round trip of the block scale
    and the true divisions of `quantize` and `dequantize`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        compile_ = jax.jit
    elif backend == "tensorflow":
        import tensorflow as tf

        def compile_(function):
            return tf.function(function, jit_compile=True)
    else:
        pytest.skip("PyTorch runs eagerly: nothing to compile")
    x = _data(SHAPE, seed=14)
    bits = _bits(SHAPE, [1, 2])

    def run(t):
        outputs = []
        for axis, block_shape in MODES:
            quantized = nvfp4.quantize(t, axis, block_shape)
            outputs += [
                quantized,
                nvfp4.dequantize(*quantized, axis, block_shape),
                nvfp4.quantize(t, axis, block_shape, random_bits=bits),
            ]
        return outputs + [nvfp4.hadamard(t, 0), nvfp4.pack(quantized[0])]

    eager = keras.tree.flatten(run(ops.convert_to_tensor(x)))
    compiled = keras.tree.flatten(compile_(run)(ops.convert_to_tensor(x)))
    for got, expected in zip(compiled, eager):
        _assert_bits_equal(_as_float32(got), _as_float32(expected))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: nvfp4.quantize(x, axis=2), "`axis` is an axis"),
        (lambda x: nvfp4.quantize(x[:, :24]), "multiple of 16"),
        (lambda x: nvfp4.quantize(x[:24], axis=0), "Pad that dimension"),
        (lambda x: nvfp4.quantize(x, block_shape=(16, 32)), "block_shape"),
        (
            lambda x: nvfp4.quantize(x[None], block_shape=(16, 16)),
            "block_shape",
        ),
        (
            lambda x: nvfp4.quantize(x, random_bits=np.ones((32, 16), "int32")),
            "random_bits",
        ),
        (
            lambda x: nvfp4.quantize(x, random_bits=np.ones(x.shape)),
            "integer tensor",
        ),
        (
            lambda x: nvfp4.quantize(x, tensor_amax=np.ones(2, "float32")),
            "`tensor_amax` is a scalar",
        ),
        (lambda x: nvfp4.pack(np.ones((3, 5), "uint8")), "even size"),
        (lambda x: nvfp4.hadamard(x[:, :8]), "multiple of 16"),
    ],
)
def test_bad_arguments_raise_saying_what_was_expected_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call(np.ones((32, 32), "float32"))


def test_a_non_float_input_raises_a_type_error():
    with pytest.raises(TypeError, match="floating point"):
        nvfp4.quantize(np.ones((4, 16), "int32"))
