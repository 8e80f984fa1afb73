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

import functools

import keras
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


@functools.cache
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


def torch_scale_constants(fmt, margin):
    """`(exponent, carry, low, high)`, Python ints: the constants of
    `scale_from_amax(amax, fmt, margin)` in `torch_ops.scale_from_amax`'s
    form, which PyTorch's Triton kernels of scales take too
    (`backend/torch/fp8_operands.scales`, `backend/torch/delayed.py`'s
    fold)."""
    exponent, carry = _torch_thresholds(_threshold(fmt, margin))
    return exponent, carry, _MIN_EXPONENT, _MAX_EXPONENT


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
    if scale is None and layouts is not None:
        # PyTorch's operands on CUDA: the scale and its reciprocal in one
        # kernel after the reduction, where a dozen and a half eager
        # operations each launched one.
        fused = backend_fp8.torch_operand_scales(
            x, axes, *torch_scale_constants(fmt, margin)
        )
        if fused is not None:
            scale, inverse = fused
            codes = backend_fp8.torch_gemm_operands(
                x, scale, fmt, layouts, inverse
            )
            return codes, scale
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


def e4m3_code_constants():
    """The constants of `e4m3_code_program`, by the names PyTorch's Triton
    kernel of float8 state takes them (`backend/torch/update_kernels.py`
    runs the program step for step)."""
    return {
        "MIN_NORMAL_EXPONENT": _MIN_NORMAL_EXPONENT,
        "NAN_CODE": _NAN_CODE,
        "SIGN": _SIGN,
    }


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

    `e4m3_code_program` with `keras.ops`; PyTorch's fused optimizer update
    runs the same program in place (`backend/torch/float8_codes.py`).
    """
    lanes = _KerasCodeLanes(y, seed)
    codes = e4m3_code_program(
        lanes, _Register(y), [_Register() for _ in range(4)], seed is not None
    )
    return ops.cast(codes.value, "uint8")


def e4m3_code_program(lanes, y, scratch, stochastic):
    """The E4M3 encoder, written once: the int32 codes (sign included, not
    yet uint8) of the float32 register `y`, computed on `lanes` with four
    int32 scratch registers; `stochastic` adds `lanes.random_bits`' noise.
    Returns the register holding the codes (one of `scratch`).

    Written without division, `where` and comparisons, which cost a pass
    each (on eager PyTorch, `where` and comparisons run one value at a
    time: 4 ms per million values against 0.1 ms for an add): `|y|` times
    the inverse of its step (a power of two, so exactly the quotient) is
    rounded to an integer `k` of steps, and the code is `k` plus 8 per
    binade above E4M3's lowest: `k + 8 * (exponent - 121)`, `exponent`
    the biased float32 exponent of `|y|` (at least 121, that of `2**-6`).

    Each step is three-address, `lanes.<op>(out, a, b)`; `lanes.ints` and
    `lanes.floats` reinterpret a register's bits (a view on PyTorch, a
    bitcast with `keras.ops`), after which only the new register is used,
    so that aliasing and copies give the same result. `y` is clobbered.
    """
    i0, i1, i2, i3 = scratch
    bits = lanes.ints(y)
    lanes.bitwise_and(i0, bits, 0x7FFFFFFF)  # |y|
    lanes.right_shift(i1, i0, 23)
    lanes.maximum(i1, i1, _MIN_NORMAL_EXPONENT)  # exponent
    # 127 where the biased exponent is 255 (inf, NaN: 448 is code 126, any
    # code of 0..126 ORed with 127 is NaN), and the sign bit, as a cast
    # keeps it (-0 and -NaN included); ORed into the code at the end.
    lanes.add(i2, i1, 1)
    lanes.right_shift(i2, i2, 8)
    lanes.multiply(i2, i2, _NAN_CODE)
    lanes.right_shift(bits, bits, 24)
    lanes.bitwise_and(bits, bits, _SIGN)
    lanes.bitwise_or(bits, bits, i2)
    # steps = |y| * 2**(3 - e): the biased exponent of the step's inverse
    # is 257 - e.
    lanes.subtract(i2, 257, i1)
    lanes.left_shift(i2, i2, 23)
    steps = lanes.floats(i0)
    lanes.multiply(steps, steps, lanes.floats(i2))
    if stochastic:
        # 24 random bits as a float32 in [0, 1), exactly.
        lanes.random_bits(i2, i3)
        lanes.right_shift(i2, i2, 8)
        lanes.bitwise_and(i2, i2, 0xFFFFFF)
        uniform = lanes.floats(i3)
        lanes.to_float(uniform, i2)
        lanes.multiply(uniform, uniform, 2.0**-24)
        lanes.add(steps, steps, uniform)
        lanes.floor(steps, steps)
    # The integer of steps (at most 16), read off the bits of steps + 2**23,
    # whose float32 spacing is 1: rounded there to nearest, ties to even,
    # where no noise floored it (a saturating float-to-int conversion
    # costs XLA several operations an element).
    lanes.add(steps, steps, 2.0**23)
    lanes.subtract(i2, lanes.ints(steps), 0x4B000000)
    lanes.subtract(i1, i1, _MIN_NORMAL_EXPONENT)
    lanes.multiply(i1, i1, 8)
    lanes.add(i2, i2, i1)
    lanes.clip(i2, i2, 0, 126)
    lanes.bitwise_or(i2, i2, bits)
    return i2


class _Register:
    """A register of `_KerasCodeLanes`: a tensor, replaced by each step."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value


def _operand(x):
    return x.value if isinstance(x, _Register) else x


def _view(register, dtype):
    """A register with `register`'s bits as `dtype` (empty for a register
    not written yet: a scratch register the program writes next)."""
    value = register.value
    return _Register(None if value is None else ops.view(value, dtype))


def _three_address(op):
    def step(self, out, a, b):
        out.value = op(_operand(a), _operand(b))

    return step


class _KerasCodeLanes:
    """Runs `e4m3_code_program` with `keras.ops` on a tensor `y`."""

    def __init__(self, y, seed):
        self._shape = tuple(y.shape)
        self._seed = seed

    add = _three_address(ops.add)
    subtract = _three_address(ops.subtract)
    multiply = _three_address(ops.multiply)
    maximum = _three_address(ops.maximum)
    bitwise_and = _three_address(ops.bitwise_and)
    bitwise_or = _three_address(ops.bitwise_or)
    right_shift = _three_address(ops.right_shift)
    left_shift = _three_address(ops.left_shift)

    @staticmethod
    def ints(register):
        return _view(register, "int32")

    @staticmethod
    def floats(register):
        return _view(register, "float32")

    @staticmethod
    def to_float(out, a):
        out.value = ops.cast(a.value, "float32")

    @staticmethod
    def floor(out, a):
        out.value = ops.floor(a.value)

    @staticmethod
    def clip(out, a, low, high):
        out.value = ops.clip(a.value, low, high)

    def random_bits(self, out, scratch):
        out.value = _random_bits.random_bits(self._shape, self._seed)


def e4m3_values(codes):
    """Float32 values of uint8 E4M3 `codes` (`e4m3_bits`), from their
    bits; the NaN codes as float32's quiet NaN. (A lookup in
    `E4M3_VALUES` with `ops.take` made JAX's step twice as slow in
    `benchmarks/optimizer_state_memory.py`; PyTorch's in-place update
    looks them up in `e4m3_value_table`.)"""
    code = ops.cast(codes, "int32")
    magnitude = ops.bitwise_and(code, 0x7F)
    subnormal = ops.cast(ops.bitwise_and(magnitude, 7), "float32") * 2.0**-9
    normal = ops.view(ops.left_shift(magnitude + _CODE_OFFSET, 20), "float32")
    value = ops.where(magnitude < 8, subnormal, normal)
    value = ops.where(magnitude == _NAN_CODE, float("nan"), value)
    return ops.where(code >= _SIGN, -value, value)


def e4m3_value_table():
    """The float32 value of each of the 256 E4M3 codes, by its bit pattern
    (`e4m3_values` of 0..255): PyTorch's in-place optimizer update looks
    codes up in it."""
    return e4m3_values(ops.arange(256, dtype="int32"))
