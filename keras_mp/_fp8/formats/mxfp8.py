"""MXFP8: E4M3 codes in blocks of 32 with E8M0 (power-of-two) block scales.

The OCP Microscaling format: each run of `BLOCK = 32` consecutive values
along a GEMM's contracted axis shares one scale `2**(code - 127)`, stored
as its biased exponent `code` (a `uint8`, the bits of `float8_e8m0fnu`;
`0xFF` is NaN). The scale code comes from the block's amax by bit
arithmetic on its float32 bits (no `log2`, no float cast to E8M0: the
rules round in exponent space, a cast rounds in linear space), and each
element is multiplied by the exact power of two `2**(127 - code)` before
its cast to E4M3, so the cast is the only rounding.

Everything is computed on float32 bits with integer operations where a
float operation would meet a subnormal: XLA on a CPU (JAX, and TensorFlow
eager, graph and `jit_compile=True` alike) flushes subnormal inputs and
results of float arithmetic to zero, PyTorch does not, and the codes must
be the same everywhere. Subnormal inputs, amaxes and dequantized values
are therefore exact on every backend.
"""

import numpy as np
from keras import ops

from keras_mp._fp8.formats.e4m3_e5m2 import check_float
from keras_mp._fp8.formats.e4m3_e5m2 import encode
from keras_mp._fp8.recipe_fields import check_choice

BLOCK = 32
SCALE_ROUNDINGS = ("rceil", "floor")

# E4M3's largest value is 1.75 * 2**8: an amax whose float32 mantissa is
# above 1.75 needs the next power of two under "rceil".
_E4M3_EXPONENT = 8
# The elements' format -> the exponent of its largest value (1.75 * 2**e:
# 448 = 1.75 * 2**8 for E4M3, 57344 = 1.75 * 2**15 for E5M2, as Transformer
# Engine's MXFP8 "hybrid" gradients take them).
ELEMENT_FORMATS = {"e4m3": _E4M3_EXPONENT, "e5m2": 15}
_MANTISSA_OF_1_75 = 0x600000
_MANTISSA = 0x7FFFFF
_MAGNITUDE = 0x7FFFFFFF
_SIGN = np.int32(-(2**31))
_INFINITY = 0x7F800000
_NAN = 0x7FC00000
_E8M0_NAN = 255
# E8M0 code 0, 2**-127, is a float32 subnormal: bits 0x00400000.
_TWO_TO_MINUS_127 = 0x00400000


def _view(x, dtype):
    """`keras.ops.view` between 4-byte dtypes, also for a last dimension
    unknown while tracing (where Keras 3.15's TensorFlow `view` fails)."""
    if len(x.shape) and x.shape[-1] is None:
        flat = ops.view(ops.reshape(x, (-1, 1)), dtype)
        return ops.reshape(flat, ops.shape(x))
    return ops.view(x, dtype)


def _codes_from_magnitude_bits(magnitude, rounding, fmt="e4m3"):
    """E8M0 codes (int32) of amaxes given as their float32 bits, sign
    cleared: a float32 `2**(b - 127) * m` (biased exponent `b`, `m` in
    [1, 2)) needs `2**(b - 127 - 8)` if `m <= 1.75` ("rceil") or always
    ("floor"), one binade more otherwise; subnormals and zero fall below
    the clamp to code 0, inf and NaN (`b = 255`) give 0xFF."""
    biased = ops.right_shift(magnitude, 23)
    code = biased - ELEMENT_FORMATS[fmt]
    if rounding == "rceil":
        above = ops.bitwise_and(magnitude, _MANTISSA) > _MANTISSA_OF_1_75
        code = code + ops.cast(above, "int32")
    code = ops.clip(code, 0, 254)
    return ops.where(biased == 255, _E8M0_NAN, code)


def e8m0_from_amax(amax, rounding="rceil", fmt="e4m3"):
    """E8M0 scale codes of blocks whose largest magnitude is `amax`.

    The code `c` stands for the scale `2**(c - 127)`; the block's E4M3
    codes are its values divided by that scale.

    - `"rceil"`: the smallest power of two `2**e`, `e` in [-127, 127],
      with `amax / 2**e <= 448`, so no value of the block is clipped:
      Transformer Engine's, JAX `scaled_dot_general`'s and torchao's
      training rule (`float_to_e8m0(amax / 448)` rounded up). It can
      waste up to one binade. Those libraries round `amax / 448` to
      float32 first; of all 2,139,095,039 positive finite float32 amaxes
      one gets another code there: the one just above `448 * 2**-127`
      (bits `0x04600001`), whose quotient rounds down to the subnormal
      `2**-127` (code 0, its largest value clipped to 448; code 1 here).
    - `"floor"`: `2**(floor(log2(amax)) - 8)`, clamped to [-127, 127]: the
      OCP specification's rule. A block whose amax has a float32 mantissa
      above 1.75 then clips its largest values to ±448 (up to 12.5 % off).

    An amax of 0, or one so small that the rule asks for less than
    `2**-127` (subnormal amaxes included), gets code 0. An inf or NaN
    amax gets `0xFF`, E8M0's NaN, so a non-finite block never has a
    finite scale and a loss-scale skip sees it (Transformer Engine writes
    `0xFE`, the largest finite scale, for an inf amax; torchao `0xFF`).

    Args:
        amax: A floating point tensor of block amaxes (its sign is
            ignored); read as float32.
        rounding: `"rceil"` or `"floor"`. Defaults to `"rceil"`.
        fmt: The elements' format, `"e4m3"` (largest value 448) or
            `"e5m2"` (57344: the rules above with 57344 and `- 15`).
            Defaults to `"e4m3"`.

    Returns:
        A `uint8` tensor of `amax`'s shape: the E8M0 codes.

    Example:

    >>> codes = keras_mp._fp8.formats.mxfp8.e8m0_from_amax(np.float32([448, 449, 0]))
    >>> keras.ops.convert_to_numpy(codes).tolist()
    [127, 128, 0]
    """
    check_choice("rounding", rounding, SCALE_ROUNDINGS)
    check_choice("fmt", fmt, ELEMENT_FORMATS)
    amax = ops.convert_to_tensor(amax)
    check_float("amax", amax)
    magnitude = ops.bitwise_and(
        _view(ops.cast(amax, "float32"), "int32"), _MAGNITUDE
    )
    return ops.cast(
        _codes_from_magnitude_bits(magnitude, rounding, fmt), "uint8"
    )


def _power_of_two(biased):
    """`2**(biased - 127)` for int32 `biased` in [1, 254], from its bits."""
    return _view(ops.left_shift(biased, 23), "float32")


def scale_values(scale):
    """The float32 values of E8M0 scale codes: `2**(code - 127)`.

    Code 0 gives `2**-127`, a float32 subnormal: exact in the tensor, but
    XLA on a CPU (JAX, TensorFlow) reads it as 0 in any arithmetic (it
    flushes subnormals), where PyTorch and GPUs do not. Code `0xFF` gives
    NaN.

    Args:
        scale: E8M0 codes, a `uint8` (or integer) tensor.

    Returns:
        A float32 tensor of `scale`'s shape, for a GEMM to multiply by.

    Example:

    >>> values = keras_mp._fp8.formats.mxfp8.scale_values(np.uint8([127, 130, 120]))
    >>> keras.ops.convert_to_numpy(values).tolist()
    [1.0, 8.0, 0.0078125]
    """
    code = ops.cast(ops.convert_to_tensor(scale), "int32")
    bits = ops.where(code == 0, _TWO_TO_MINUS_127, ops.left_shift(code, 23))
    return _view(ops.where(code == _E8M0_NAN, _NAN, bits), "float32")


def _check_axis(x, axis, what):
    ndim = len(x.shape)
    if isinstance(axis, bool) or not isinstance(axis, int):
        axis = None
    if axis is None or not -ndim <= axis < ndim:
        raise ValueError(
            f"`axis` is an axis of `{what}`, in [{-ndim}, {ndim}). "
            f"Received: axis={axis!r} for {what}.shape={tuple(x.shape)}"
        )
    return axis % ndim


def _tiled_shape(x, axis, size):
    shape = ops.shape(x)
    return (*shape[:axis], size // BLOCK, BLOCK, *shape[axis + 1 :])


def quantize(x, axis=-1, scale_rounding="rceil", fmt="e4m3"):
    """Quantizes `x` to MXFP8: E4M3 codes and E8M0 scales per 32 values.

    Each block of 32 consecutive values along `axis` (the GEMM's
    contracted axis: `axis=-1` gives 1x32 rowwise blocks of a 2-D tensor,
    `axis=0` 32x1 columnwise blocks) gets the scale code
    `e8m0_from_amax(amax, scale_rounding)`; its values are multiplied by
    `2**(127 - code)` (exact) and cast to E4M3 with round-to-nearest-even,
    finite values beyond ±448 clipped first (only `"floor"` gets there).
    Inf and NaN are never clipped: E4M3 has no inf, so they become NaN,
    and their whole block gets scale `0xFF` and NaN codes.

    Args:
        x: A floating point tensor (float16, bfloat16, float32; float64 is
            cast to float32 first); quantized in float32. Its size along
            `axis` must be a known multiple of 32.
        axis: The axis the blocks run along. Defaults to `-1`.
        scale_rounding: `"rceil"` (the smallest power-of-two scale that
            clips nothing: Transformer Engine, JAX, torchao training) or
            `"floor"` (the OCP rule). Defaults to `"rceil"`.
        fmt: The elements' format: `"e4m3"`, or `"e5m2"` (largest value
            57344, keeps inf; Transformer Engine's MXFP8 "hybrid"
            gradients), each block then scaled to 57344. Defaults to
            `"e4m3"`.

    Returns:
        `(codes, scale)`: `float8_e4m3fn` (or `float8_e5m2`) codes of
        `x`'s shape, and `uint8`
        E8M0 codes of `x`'s shape with `axis` divided by 32; `x ≈ codes *
        scale_values(scale)`, each scale repeated over its block
        (`dequantize` gives those values).

    Example:

    >>> x = np.linspace(-2.0, 3.0, 32, dtype="float32")[None]
    >>> codes, scale = keras_mp._fp8.formats.mxfp8.quantize(x)
    >>> keras.ops.convert_to_numpy(scale).tolist()
    [[120]]
    >>> float(keras.ops.cast(codes, "float32")[0, -1])
    384.0
    """
    check_choice("scale_rounding", scale_rounding, SCALE_ROUNDINGS)
    check_choice("fmt", fmt, ELEMENT_FORMATS)
    x = ops.convert_to_tensor(x)
    check_float("x", x)
    axis = _check_axis(x, axis, "x")
    size = x.shape[axis]
    if size is None or size % BLOCK:
        raise ValueError(
            f"MXFP8 quantizes blocks of {BLOCK} values along `axis`, so "
            f"`x.shape[axis]` must be a known multiple of {BLOCK}. Received: "
            f"x.shape={tuple(x.shape)} with axis={axis}. Pad `x` with zeros "
            f"along that axis to a multiple of {BLOCK} (zeros change no "
            "scale)."
        )
    shape = ops.shape(x)
    x32 = ops.reshape(ops.cast(x, "float32"), _tiled_shape(x, axis, size))
    bits = _view(x32, "int32")
    magnitude = ops.bitwise_and(bits, _MAGNITUDE)
    # The amax as integer bits: exact (no flush of subnormals), and NaN
    # (above inf) wins on every backend.
    amax = ops.max(magnitude, axis=axis + 1, keepdims=True)
    code = _codes_from_magnitude_bits(amax, scale_rounding, fmt)
    nonfinite = code == _E8M0_NAN
    # 2**(127 - code) is a normal float32 for every code from an amax
    # (0 ... 247), so the multiply is exact wherever its result is normal;
    # a smaller result is below E4M3's smallest subnormal either way.
    reciprocal = ops.where(nonfinite, np.nan, _power_of_two(254 - code))
    scaled = x32 * reciprocal
    # A subnormal x (read as 0 by XLA on a CPU) is its mantissa times
    # 2**-149, so x * 2**(127 - code) = mantissa * 2**(-22 - code), made
    # from normal floats (0 where the result is far below E4M3's range).
    subnormal_factor = ops.where(
        nonfinite, np.nan, _power_of_two(ops.maximum(105 - code, 0))
    )
    from_subnormal = ops.cast(magnitude, "float32") * subnormal_factor
    from_subnormal = ops.where(bits < 0, -from_subnormal, from_subnormal)
    scaled = ops.where(magnitude <= _MANTISSA, from_subnormal, scaled)
    codes = ops.reshape(encode(scaled, fmt), shape)
    return codes, ops.cast(ops.squeeze(code, axis + 1), "uint8")


def dequantize(codes, scale, axis=-1):
    """The float32 values of MXFP8 codes: `codes * 2**(scale - 127)`.

    Exact on every backend, subnormal results included (built from the
    bits, not by a float multiply that XLA on a CPU would flush to zero);
    values beyond float32's range are ±inf, and NaN codes or a scale of
    `0xFF` give NaN.

    Args:
        codes: `float8_e4m3fn` codes, as `quantize` returns them.
        scale: The `uint8` E8M0 codes of their blocks: `codes`' shape with
            `axis` divided by 32.
        axis: The axis the blocks run along. Defaults to `-1`.

    Returns:
        A float32 tensor of `codes`' shape.

    Example:

    >>> codes, scale = keras_mp._fp8.formats.mxfp8.quantize(np.full((1, 32), 3.0))
    >>> values = keras_mp._fp8.formats.mxfp8.dequantize(codes, scale)
    >>> float(values[0, 0])
    3.0
    """
    codes = ops.convert_to_tensor(codes)
    scale = ops.convert_to_tensor(scale)
    axis = _check_axis(codes, axis, "codes")
    size = codes.shape[axis]
    expected = None if size is None else (*codes.shape[:axis], size // BLOCK)
    if (
        size is None
        or size % BLOCK
        or len(scale.shape) != len(codes.shape)
        or tuple(scale.shape[: axis + 1]) != expected
        or tuple(scale.shape[axis + 1 :]) != tuple(codes.shape[axis + 1 :])
    ):
        raise ValueError(
            f"`scale` has one E8M0 code per {BLOCK} `codes` along `axis`: "
            f"`codes.shape` with a known multiple of {BLOCK} at `axis`, "
            f"divided by {BLOCK}. Received: codes.shape={tuple(codes.shape)}"
            f", scale.shape={tuple(scale.shape)}, axis={axis}. Pass the "
            "`(codes, scale)` that `quantize` returned for that axis."
        )
    shape = ops.shape(codes)
    values = ops.cast(
        ops.reshape(codes, _tiled_shape(codes, axis, size)), "float32"
    )
    code = ops.expand_dims(ops.cast(scale, "int32"), axis + 1)
    bits = _view(values, "int32")
    magnitude = ops.bitwise_and(bits, _MAGNITUDE)
    # The biased exponent of the result; an E4M3 value has 3 mantissa
    # bits, so a subnormal result is exactly its shifted significand.
    exponent = ops.right_shift(magnitude, 23) + code - 127
    mantissa = ops.bitwise_and(magnitude, _MANTISSA)
    normal = ops.bitwise_or(
        ops.left_shift(ops.clip(exponent, 1, 254), 23), mantissa
    )
    subnormal = ops.right_shift(
        ops.bitwise_or(mantissa, 0x800000), ops.clip(1 - exponent, 0, 24)
    )
    result = ops.where(exponent >= 1, normal, subnormal)
    result = ops.where(exponent >= 255, _INFINITY, result)
    result = ops.where(magnitude == 0, 0, result)
    nan = ops.logical_or(magnitude > _INFINITY, code == _E8M0_NAN)
    result = ops.where(nan, _NAN, result)
    result = ops.bitwise_or(result, ops.bitwise_and(bits, _SIGN))
    return ops.reshape(_view(result, "float32"), shape)
