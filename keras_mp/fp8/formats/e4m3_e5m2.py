"""FP8 codes of E4M3 and E5M2 and their float32 power-of-two scales.

The scale of a set of values is the smallest power of two `s` with
`amax / s <= fmax / 2**margin`, where `amax` is their largest absolute
value and `fmax` the format's largest finite value: Transformer Engine's
and DeepSeek-V3's power-of-two convention, `s = 2**ceil(log2(amax /
(fmax / 2**margin)))`, computed exactly from the bits of `amax` (no
`log2`, whose float32 result is not exact on every backend). Dividing by
a power of two is exact, so the only rounding is the cast to FP8, and a
loss scale of `2**k` moves every scale by `2**k` and changes no code.

These are the primitives every power-of-two quantizer
(`keras_mp/fp8/quantizers/`) builds on: the scale of an amax, the codes of
scaled values, and the operands a GEMM multiplies.
"""

import keras
from keras import ops

from keras_mp._keras_internals import constant
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.fp8.recipe import check_choice

# Format name -> (Keras dtype of the codes, largest finite value).
FORMATS = {
    "e4m3": ("float8_e4m3fn", 448.0),
    "e5m2": ("float8_e5m2", 57344.0),
}
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

# Biased float32 exponents of the smallest and largest normal powers of two.
_MIN_EXPONENT = 1
_MAX_EXPONENT = 254


def check_format(fmt):
    check_choice("fmt", fmt, FORMATS)
    return FORMATS[fmt]


def check_float(name, x):
    dtype = keras.backend.standardize_dtype(x.dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"`{name}` must be a floating point tensor ({', '.join(_FLOAT_DTYPES)}"
            f"). Received: {name} of dtype {dtype}. Cast it first, e.g. "
            f"`keras.ops.cast({name}, 'float32')`."
        )
    return dtype


def _threshold(fmt, margin):
    """`(exponent, mantissa)` of `fmax / 2**margin` as float32 bits: the
    unbiased exponent and the 23 mantissa bits."""
    target = FORMATS[fmt][1] / 2.0**margin
    exponent = 0
    while target >= 2.0 ** (exponent + 1):
        exponent += 1
    while target < 2.0**exponent:
        exponent -= 1
    mantissa = int((target / 2.0**exponent - 1.0) * 2**23)
    return exponent, mantissa


def _torch_thresholds(thresholds):
    """`(exponent, carry)` of `_threshold`'s `(exponent, mantissa)` (or a
    list of them, as int32 vectors) for `torch_scale_from_amax`: `carry`
    is `0x7FFFFF - mantissa`."""
    if isinstance(thresholds, list):
        return (
            constant(tuple(e for e, _ in thresholds), "int32"),
            constant(tuple(0x7FFFFF - m for _, m in thresholds), "int32"),
        )
    exponent, mantissa = thresholds
    return exponent, 0x7FFFFF - mantissa


def scale_from_amax(amax, fmt="e4m3", margin=0):
    """The power-of-two scale of values whose largest magnitude is `amax`.

    The smallest power of two `s` with `amax / s <= fmax / 2**margin`;
    `1` where `amax` is 0, the smallest normal float32 (`2**-126`) where
    `amax` is tinier than that allows, and `amax` itself where it is inf or
    NaN (so a non-finite tensor keeps a non-finite scale).

    Args:
        amax: A float32 tensor of non-negative values.
        fmt: `"e4m3"` or `"e5m2"`, or a tuple of them, one per value of
            `amax`'s last axis (several tensors' scales in one computation:
            a dozen small ops, where one call a tensor costs a dozen
            kernel launches each in an eager step). Defaults to `"e4m3"`.
        margin: Headroom in powers of two. Defaults to `0`.

    Returns:
        A float32 tensor of the shape of `amax`.
    """
    if isinstance(fmt, (tuple, list)):
        # One format per value of the last axis: each threshold a vector.
        for each in fmt:
            check_format(each)
        thresholds = [_threshold(each, margin) for each in fmt]
    else:
        check_format(fmt)
        thresholds = _threshold(fmt, margin)
    if backend_fp8.has_torch_bit_ops(amax):
        # The same operations in torch itself: a third of `keras.ops`'
        # host time, which an eager GPU step spends for every tensor.
        exponent, carry = _torch_thresholds(thresholds)
        return backend_fp8.torch_scale_from_amax(
            amax, exponent, carry, _MIN_EXPONENT, _MAX_EXPONENT
        )
    if isinstance(thresholds, list):
        exponent = constant(tuple(e for e, _ in thresholds), "int32")
        mantissa = constant(tuple(m for _, m in thresholds), "int32")
    else:
        exponent, mantissa = thresholds
    amax = ops.cast(amax, "float32")
    bits = ops.view(amax, "int32")
    biased = ops.right_shift(bits, 23)
    # Python numbers as `constant`s: on PyTorch each would otherwise be a
    # copy from the host at every call, which waits for the GPU.
    mantissa_bits = ops.bitwise_and(bits, constant(0x7FFFFF, "int32"))
    above = ops.cast(mantissa_bits > mantissa, "int32")
    biased = ops.clip(
        biased - exponent + above,
        constant(_MIN_EXPONENT, "int32"),
        constant(_MAX_EXPONENT, "int32"),
    )
    scale = ops.view(ops.left_shift(biased, 23), "float32")
    scale = ops.where(amax == 0.0, ops.ones_like(scale), scale)
    return ops.where(ops.isfinite(amax), scale, amax)


def encode(y, fmt):
    """FP8 codes of float32 values already divided by their scale.

    Finite values beyond the format's range are clipped to `±fmax` here,
    because the native casts disagree (NaN on JAX and TensorFlow,
    saturation on PyTorch). Inf and NaN are never clipped: E5M2 keeps inf,
    E4M3 (which has no inf) turns it into NaN, as `ml_dtypes` does.
    """
    dtype, fmax = FORMATS[fmt]
    # `clip` keeps NaN but takes inf to fmax: inf is put back (E5M2) or
    # made NaN (E4M3) after it. Four passes over the tensor in all.
    clipped = ops.clip(y, -fmax, fmax)
    nonfinite = y if fmt == "e5m2" else float("nan")
    return ops.cast(ops.where(ops.isinf(y), nonfinite, clipped), dtype)


def gemm_operand(x, scale, fmt):
    """What a GEMM multiplies for float32 `x` and its positive scales: the
    FP8 codes of `x / scale` (`encode`), or, where the backend multiplies
    FP8 values faster as float32 (PyTorch on a CPU), the very values of
    those codes in float32 (`keras_mp.backend.fp8.round_to_format`)."""
    return gemm_operands(x, scale, fmt, ("row",))[0]


def gemm_operands(x, scale, fmt, layouts):
    """`gemm_operand` once for each of `layouts`, a tuple of `"row"` and
    `"column"`: `x`'s codes stored row-major, or column-major (for a GEMM
    that takes `x` as its B, or `x^T` as its A). Where the layout of a
    2-D operand matters (PyTorch's FP8 codes: cuBLASLt takes a row-major
    A and a column-major B), each is written in one pass with the cast
    (`keras_mp.backend.torch_fp8_operands`); elsewhere one tensor serves
    every layout."""
    if backend_fp8.rounds_to_values(x):
        values = backend_fp8.round_to_format(x, scale, fmt, FORMATS[fmt][1])
        return (values,) * len(layouts)
    if backend_fp8.has_layouts(x):
        return backend_fp8.torch_gemm_operands(x, scale, fmt, layouts)
    return (encode(x / scale, fmt),) * len(layouts)


def quantize_reduced(x, fmt, axes, margin=0, scale=None, layouts=None):
    """Codes of float32 `x` and scales from its amax over `axes`.

    Args:
        x: A float32 tensor.
        fmt: `"e4m3"` or `"e5m2"`.
        axes: The axes each scale covers (`None`: all of them).
        margin: Headroom in powers of two.
        scale: Scales to use instead (broadcastable to `x`), or None.
        layouts: None for FP8 codes, or a tuple of layouts for
            `gemm_operands`' forms of them (for
            `keras_mp.backend.fp8.einsum_float32`), one per layout.

    Returns:
        `(codes, scale)`, the scale with `axes` kept as size-1 dimensions
        (`codes` a tuple where `layouts` is given).
    """
    if scale is None:
        # A NaN counts as inf: the scale must be non-finite.
        amax = backend_fp8.amax(x, axes)
        scale = scale_from_amax(amax, fmt, margin)
    if layouts is not None:
        return gemm_operands(x, scale, fmt, layouts), scale
    return encode(x / scale, fmt), scale
