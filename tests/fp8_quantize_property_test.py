"""`keras_mp.fp8.quantize` against the NumPy + `ml_dtypes` oracle, drawn.

Hypothesis draws the format, the granularity (tensorwise, rowwise along
any axis, 1x128 blocks along any axis, 128x128 blocks), the shape, the
input dtype, the margin and the values: log-uniform magnitudes around any
float32 binade, ties and codes of the FP8 grid times a power of two, and
special values written over them (zeros of both signs, inf, NaN, float32
subnormals, the largest finite values, the format's limits). Codes must
be the oracle's bit for bit (NaN payloads aside: NaN-ness is compared),
and scales equal; inf and NaN are never clipped into range.

On TensorFlow and JAX (XLA), a CPU's float32 arithmetic treats subnormal
float32 inputs as zero (flush-to-zero and denormals-are-zero). Where the
backend does that, the oracle is given the input with its float32
subnormals made zeros of the same sign: the codes must then be exactly
the oracle's, and the flush itself is asserted, so a backend that
stops flushing, or starts, fails here.
"""

import functools

import hypothesis
import keras
import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from keras import ops

from keras_mp import fp8
from keras_mp.testing import assert_fp8_codes_equal
from keras_mp.testing import fp8_reference as reference
from keras_mp.testing import to_numpy

# Each backend runs this file's examples within a few seconds (the report
# of issue 35 has the measured times).
EXAMPLES = 50
_SETTINGS = dict(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
BLOCK = reference.BLOCK
_FLOAT32 = np.finfo(np.float32)
_CODE_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_INPUT_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}


def _special_values(fmt):
    dtype, fmax = reference.FORMATS[fmt]
    fp8_subnormal = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    return [
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        np.nan,
        fmax,
        -fmax,
        1.1 * fmax,
        fp8_subnormal,
        -2.5 * fp8_subnormal,
        float(_FLOAT32.max),
        -float(_FLOAT32.max),
        float(_FLOAT32.tiny),  # 2**-126
        float(_FLOAT32.smallest_subnormal),
        -3 * float(_FLOAT32.smallest_subnormal),
        2.0**-127 * 1.5,
    ]


# Shapes `(shape, axis)` per granularity: ranks 0 to 3, odd sizes, first,
# inner and last axes, one or two 1x128 tiles, 128x128 tiles. A fixed menu
# of eight, because JAX compiles each operation again for every shape and
# axis (about 1 CPU second per pair on a 2-core CPU, against 5 ms per
# quantize once compiled); the values, which hypothesis draws freely, are
# what varies.
_SHAPES = {
    "tensorwise": [((), -1), ((2, 128, 3), -1)],
    "rowwise": [((3, 5), 0), ((2, 128, 3), -1)],
    "block": [((256,), 0), ((2, 128, 3), 1), ((128, 256), -1)],
    "block 128x128": [((128, 256), -1)],
}


def _fp8_grid_values(fmt, rng, size):
    """Codes of the format and the ties halfway between neighbours, as
    float32 (finite ones)."""
    dtype = reference.FORMATS[fmt][0]
    codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    codes = np.unique(codes[np.isfinite(codes)])
    ties = (codes[1:] + codes[:-1]) / 2
    return rng.choice(np.concatenate([codes, ties]), size)


@st.composite
def quantize_cases(draw):
    fmt = draw(st.sampled_from(["e4m3", "e5m2"]))
    granularity, block_shape = draw(
        st.sampled_from(
            [
                ("tensorwise", None),
                ("rowwise", None),
                ("block", None),
                ("block", (BLOCK, BLOCK)),
            ]
        )
    )
    menu = "block 128x128" if block_shape else granularity
    shape, axis = draw(st.sampled_from(_SHAPES[menu]))
    size = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Magnitudes: `spread` binades above 2**low, anywhere in float32's range
    # (subnormals included), or values of the FP8 grid (codes and ties)
    # times 2**low: ties round to even only if the scale keeps them ties.
    low = draw(st.integers(-160, 127))
    kind = draw(st.sampled_from(["log-uniform", "fp8 grid"]))
    if kind == "log-uniform":
        spread = draw(st.integers(0, 40))
        exponents = low + rng.uniform(0, spread, size)
    else:
        with np.errstate(divide="ignore"):  # log2(0): -inf, then 0
            grid = np.log2(np.abs(_fp8_grid_values(fmt, rng, size)))
        exponents = low + grid
    with np.errstate(over="ignore"):
        x = np.exp2(exponents) * rng.choice([-1.0, 1.0], size)
        x = x.astype(np.float32)
    specials = draw(
        st.lists(
            st.tuples(
                st.integers(0, max(size - 1, 0)),
                st.one_of(
                    st.sampled_from(_special_values(fmt)),
                    st.floats(width=32),
                ),
            ),
            max_size=min(size, 6),
        )
    )
    for index, value in specials:
        x[index] = value
    dtype = draw(st.sampled_from(sorted(_INPUT_DTYPES)))
    margin = draw(st.integers(0, 3))
    # The input as its dtype holds it (float16 and bfloat16 round, and
    # may overflow to inf), in float32 for the oracle.
    with np.errstate(over="ignore"):
        x = x.astype(_INPUT_DTYPES[dtype]).astype(np.float32)
    # Half the cases pass scales 2**-shift times the computed ones (as a
    # delayed layer's stale scales would be): finite values overflow the
    # format and are clipped to its largest value, inf and NaN are not.
    shift = draw(st.one_of(st.none(), st.integers(0, 8)))
    return dict(
        shift=shift,
        x=x.reshape(shape),
        fmt=fmt,
        granularity=granularity,
        axis=axis,
        block_shape=block_shape,
        dtype=dtype,
        margin=margin,
    )


@functools.cache
def _flushes_float32_subnormals():
    """Whether the backend's float32 arithmetic reads a subnormal input as
    zero on this device (XLA's and TensorFlow's CPU kernels do)."""
    tiny = ops.convert_to_tensor(np.float32(2.0**-140))
    return float(to_numpy(ops.multiply(tiny, 2.0**100))) == 0.0


def _flushed(x):
    subnormal = (x != 0) & (np.abs(x) < _FLOAT32.tiny)
    return np.where(subnormal, np.copysign(np.float32(0), x), x)


@hypothesis.settings(**_SETTINGS)
@hypothesis.given(quantize_cases())
def test_codes_and_scales_match_the_oracle_bit_for_bit(case):
    x, fmt, granularity = case["x"], case["fmt"], case["granularity"]
    axis, block_shape, margin = (
        case["axis"],
        case["block_shape"],
        case["margin"],
    )
    oracle_input = _flushed(x) if _flushes_float32_subnormals() else x
    full, expected_scale = reference.element_scales(
        oracle_input, fmt, granularity, axis, block_shape, margin
    )
    given = None
    if case["shift"] is not None:
        # Kept normal: XLA reads a subnormal scale as 0.
        lower = lambda s: np.maximum(s * 2.0 ** -case["shift"], _FLOAT32.tiny)  # noqa: E731
        full, given = lower(full), lower(expected_scale).astype(np.float32)
        expected_scale = given
    codes, scale = fp8.quantize(
        ops.convert_to_tensor(x, dtype=case["dtype"]),
        fmt,
        granularity,
        scale=given,
        axis=axis,
        margin=margin,
        block_shape=block_shape,
    )
    expected_codes = reference.encode(oracle_input, full, fmt)
    assert keras.backend.standardize_dtype(codes.dtype) == _CODE_DTYPES[fmt]
    assert_fp8_codes_equal(codes, expected_codes)
    scale = to_numpy(scale)
    assert scale.dtype == np.float32
    np.testing.assert_array_equal(scale, expected_scale)
    # Inf and NaN are never clipped into range: every scale covering one
    # is non-finite (so a loss-scale skip sees it), every other is a
    # positive power of two.
    _, covered = reference.element_scales(
        np.where(np.isfinite(x), 0.0, np.inf).astype(np.float32),
        fmt,
        granularity,
        axis,
        block_shape,
    )
    nonfinite = ~np.isfinite(covered)
    assert not np.isfinite(scale[nonfinite]).any()
    finite = scale[~nonfinite]
    assert (finite > 0).all()
    assert (np.frexp(finite)[0] == 0.5).all()
