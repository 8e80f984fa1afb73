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
(`keras_mp/_fp8/quantizers/`) builds on: the scale of an amax, the codes of
scaled values, and the operands a GEMM multiplies.
"""

import keras
import numpy as np
from keras import ops

from keras_mp import _random_bits
from keras_mp._fp8.recipe_fields import check_choice
from keras_mp._keras_internals import constant
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.backend.torch import ops as torch_ops

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
    list of them, as int32 vectors) for `torch_ops.scale_from_amax`: `carry`
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
    if torch_ops.has_bit_ops(amax):
        # The same operations in torch itself: a third of `keras.ops`'
        # host time, which an eager GPU step spends for every tensor.
        exponent, carry = _torch_thresholds(thresholds)
        return torch_ops.scale_from_amax(
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
    (`keras_mp.backend.torch.fp8_operands`); elsewhere one tensor serves
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


# The E4M3 codec of uint8 bit patterns (`e4m3_bits`, `e4m3_values`).
# Biased float32 exponent of 2**-6, E4M3's smallest normal value; below it
# the step is 2**-9.
_MIN_NORMAL_EXPONENT = 121
# E4M3 has 3 mantissa bits: its step is 2**(exponent - 3).
_MANTISSA_BITS = 3
# (float32 biased exponent - 120) << 3 is E4M3's biased exponent field.
_CODE_OFFSET = 120 << _MANTISSA_BITS
_NAN_CODE = 0x7F
_SIGN = 0x80


def e4m3_bits(y, seed=None):
    """uint8 E4M3 codes (bit patterns) of float32 `y` (already divided by
    its scale): what a uint8 variable stores of E4M3 codes (optimizer
    state, a frozen kernel), on every backend (TensorFlow cannot bitcast
    float8). Rounded to nearest, ties to even, as `ml_dtypes` casts; with
    `seed` (an int32 key pair), stochastically, from counter-based bits
    of each value's index in `y`.

    Rounded on E4M3's grid in float32 (the step is `2**(e - 3)` for a
    value of exponent `e`, and `2**-9` below `2**-6`), finite values
    clipped to 448, inf and NaN coded as NaN (E4M3 has no inf).

    Written without division, `where` and comparisons, which cost a pass
    each (on eager PyTorch, `where` and comparisons run one value at a
    time: 4 ms per million values against 0.1 ms for an add): `|y|` times
    the inverse of its step (a power of two, so exactly the quotient) is
    rounded to an integer `k` of steps, and the code is `k` plus 8 per
    binade above E4M3's lowest: `k + 8 * (exponent - 121)`, `exponent`
    the biased float32 exponent of `|y|` (at least 121, that of `2**-6`).
    """
    bits = ops.view(y, "int32")
    magnitude = ops.bitwise_and(bits, 0x7FFFFFFF)
    biased = ops.right_shift(magnitude, 23)
    exponent = ops.maximum(biased, _MIN_NORMAL_EXPONENT)
    # 2**(3 - e): the biased exponent of the step's inverse is 257 - exponent.
    inverse_step = ops.view(ops.left_shift(257 - exponent, 23), "float32")
    steps = ops.view(magnitude, "float32") * inverse_step
    if seed is not None:
        bits_of_noise = _random_bits.random_bits(tuple(y.shape), seed)
        # 24 random bits as a float32 in [0, 1), exactly.
        uniform = ops.cast(
            ops.bitwise_and(ops.right_shift(bits_of_noise, 8), 0xFFFFFF),
            "float32",
        )
        steps = ops.floor(steps + uniform * 2.0**-24)
    # The integer of steps (at most 16), read off the bits of steps + 2**23,
    # whose float32 spacing is 1: rounded there to nearest, ties to even,
    # where no `seed` floored it (a saturating float-to-int conversion
    # costs XLA several operations an element).
    steps = ops.view(steps + 2.0**23, "int32") - 0x4B000000
    code = steps + (exponent - _MIN_NORMAL_EXPONENT) * 8
    # 448 is code 126. Inf and NaN (biased exponent 255, whatever their
    # steps give) become 127, NaN: any code of 0..126 ORed with 127.
    code = ops.clip(code, 0, 126)
    nonfinite = ops.right_shift(biased + 1, 8)  # 1 where biased == 255
    code = ops.bitwise_or(code, nonfinite * _NAN_CODE)
    # The sign bit, as a cast keeps it (-0 and -NaN included).
    code = ops.bitwise_or(
        code, ops.bitwise_and(ops.right_shift(bits, 24), _SIGN)
    )
    return ops.cast(code, "uint8")


def e4m3_values(codes):
    """Float32 values of uint8 E4M3 `codes` (`e4m3_bits`), from their
    bits; the NaN codes as float32's quiet NaN. (A lookup in
    `E4M3_VALUES` with `ops.take` made JAX's step twice as slow in
    `benchmarks/optimizer_state_memory.py`; PyTorch's in-place update
    looks them up.)"""
    code = ops.cast(codes, "int32")
    magnitude = ops.bitwise_and(code, 0x7F)
    subnormal = ops.cast(ops.bitwise_and(magnitude, 7), "float32") * 2.0**-9
    normal = ops.view(ops.left_shift(magnitude + _CODE_OFFSET, 20), "float32")
    value = ops.where(magnitude < 8, subnormal, normal)
    value = ops.where(magnitude == _NAN_CODE, float("nan"), value)
    return ops.where(code >= _SIGN, -value, value)


def _code_values():
    """The float32 value of each of the 256 E4M3 codes, from its bits: the
    exponent and mantissa fields moved into float32's (the exponent
    rebiased by +120), subnormal codes as `mantissa * 2**-9`, the NaN codes
    as float32's quiet NaN with the code's sign (0x7FC00000, 0xFFC00000)."""
    code = np.arange(256, dtype=np.int32)
    magnitude = code & 0x7F
    normal = ((magnitude + _CODE_OFFSET) << 20).view(np.float32)
    subnormal = (magnitude & 7).astype(np.float32) * np.float32(2.0**-9)
    value = np.where(magnitude < 8, subnormal, normal)
    value = np.where(magnitude == _NAN_CODE, np.float32("nan"), value)
    sign = np.where(code >= _SIGN, np.int32(-(2**31)), np.int32(0))
    return (value.view(np.int32) | sign).view(np.float32)


# The float32 value of each E4M3 code, by its bit pattern (`e4m3_values`
# in NumPy: PyTorch's in-place optimizer update looks them up).
E4M3_VALUES = _code_values()
