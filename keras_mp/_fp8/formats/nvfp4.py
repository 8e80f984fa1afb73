"""NVFP4: E2M1 codes in 16-value blocks, E4M3 block scales, a float32 tensor
scale, and the 16x16 random Hadamard transform of wgrad operands.

The arithmetic is Transformer Engine's bit for bit
(`transformer_engine/pytorch/custom_recipes/reference_nvfp4.py::
_quantize_blockwise_reference`, and `core_nvfp4.cuh` for the tensor scale),
in float32 `keras.ops` on every backend:

1. `S_enc = min(448 * 6 / global_amax, FLT_MAX)`; 1 where `global_amax`
   is 0.
2. `dec_block = e4m3(clip(block_amax * (S_enc * fl(1/6)), 0, 448))`,
   rounded to nearest even. Transformer Engine's JAX quantizer computes
   `(block_amax / 6) * S_enc` instead: a float32 product 1 ulp away in
   about 43 % of blocks, but never a different E4M3 code (the tests check
   both orders).
3. `enc_block = min(1 / (f32(dec_block) * (1 / S_enc)), FLT_MAX)`.
4. `codes = E2M1(clip(x * enc_block, -6, 6))`, rounded to nearest even, or
   stochastically given random bits.

Dequantizing gives `codes * f32(dec_block) / S_enc`.

Non-finite values are never hidden. E2M1 has no inf or NaN (a plain cast
would saturate inf to 6 and turn NaN into 0), so a block holding inf or
NaN gets a NaN block scale (E4M3 `0x7F`) and codes 0, and dequantizes to
NaN. A non-finite global amax (an inf or NaN in `x`, or a non-finite
`tensor_amax`) gives a NaN tensor scale and NaN block scales everywhere:
one scalar tells a step to skip. (Transformer Engine sets `S_enc = 1` for
an infinite amax and quantizes the finite blocks as if nothing happened.)
"""

import keras
import numpy as np
from keras import ops

from keras_mp._fp8.formats.e4m3_e5m2 import check_float
from keras_mp.backend import fp8 as backend_fp8

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest normal float32. XLA on a CPU and TensorFlow's kernels treat
# smaller (subnormal) inputs as zero and PyTorch does not, so `quantize`
# counts them as zero itself: the same codes on every backend.
FLOAT32_MIN = float(np.finfo(np.float32).tiny)
# Float32 1/6, as Transformer Engine folds it into the tensor scale.
_RECIPROCAL_E2M1_MAX = float(np.float32(1.0) / np.float32(6.0))
# The E2M1 value of each 4-bit code (bit 3 the sign), `ml_dtypes`'
# `float4_e2m1fn` layout.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_CODE_VALUES = np.array(
    list(E2M1_VALUES) + [-v for v in E2M1_VALUES], np.float32
)
# Transformer Engine's fixed signs of the wgrad Hadamard transform
# (`reference_nvfp4.py::get_wgrad_sign_vector`, `jax/quantize/hadamard.py`).
HADAMARD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
# Random bits used per element by stochastic rounding, as Blackwell's
# `cvt.rs.satfinite.e2m1x4.f32` takes them.
STOCHASTIC_ROUNDING_BITS = 8


def tensor_scale(global_amax):
    """The float32 tensor scale `S_enc` of NVFP4 for `global_amax`.

    `min(448 * 6 / global_amax, FLT_MAX)`, as Transformer Engine's kernels
    compute it; 1 where `global_amax` is 0 (an all-zero tensor) or
    subnormal, NaN where it is inf or NaN.

    Args:
        global_amax: A float32 tensor of non-negative values.

    Returns:
        A float32 tensor of the shape of `global_amax`.
    """
    amax = ops.cast(global_amax, "float32")
    scale = ops.minimum(ops.divide(E4M3_MAX * E2M1_MAX, amax), FLOAT32_MAX)
    scale = ops.where(amax < FLOAT32_MIN, 1.0, scale)
    return ops.where(ops.isfinite(amax), scale, float("nan"))


def block_scale(block_amax, s_enc):
    """E4M3 block scales `e4m3(clip(block_amax * (S_enc * fl(1/6)), 0,
    448))`, rounded to nearest even, for non-negative float32 block amaxes;
    NaN (`0x7F`) where the block amax or `S_enc` is not finite."""
    scaled = ops.multiply(block_amax, ops.multiply(s_enc, _RECIPROCAL_E2M1_MAX))
    # `min(., FLT_MAX)` then a clip to 448, as in Transformer Engine, is one
    # clip to 448 for non-negative values.
    clipped = ops.minimum(scaled, E4M3_MAX)
    finite = ops.logical_and(ops.isfinite(block_amax), ops.isfinite(s_enc))
    return _round_to_e4m3(ops.where(finite, clipped, float("nan")))


def _round_to_e4m3(scale):
    """`scale` (float32 in [0, 448] or NaN) cast to `float8_e4m3fn`, rounded
    to nearest even.

    XLA keeps this cast and the cast back to float32 under `jax.jit` and
    TensorFlow's `jit_compile=True` on CPU (tests check compiled against
    eager bit for bit); Transformer Engine's JAX quantizer guards the same
    round trip with `lax.reduce_precision(..., 4, 3)`. A compiler that
    folds it away is caught by those tests, and the guard would go here.
    """
    return ops.cast(scale, "float8_e4m3fn")


def _check_axis(x, axis):
    ndim = len(x.shape)
    if isinstance(axis, bool) or not isinstance(axis, int):
        axis = None
    if axis is None or not -ndim <= axis < ndim:
        raise ValueError(
            f"`axis` is an axis of `x`, in [{-ndim}, {ndim}). Received: "
            f"axis={axis!r} for x.shape={tuple(x.shape)}"
        )
    return axis % ndim


def _check_size(x, axis, multiple, what, fix):
    size = x.shape[axis]
    if size is None or size % multiple:
        raise ValueError(
            f"{what} must have a known size that is a multiple of "
            f"{multiple}. Received: x.shape={tuple(x.shape)}. {fix}"
        )
    return size


def _blocks(x, axis, block_shape):
    """`(tiled_shape, block_axes)`: `x`'s shape with its blocks split out,
    and the axes of that shape one block spans."""
    fix = "Pad that dimension to a multiple of 16 with zeros."
    if block_shape is not None:
        if (
            len(x.shape) != 2
            or not isinstance(block_shape, (tuple, list))
            or tuple(block_shape) != (BLOCK_SIZE, BLOCK_SIZE)
        ):
            raise ValueError(
                f"`block_shape` is ({BLOCK_SIZE}, {BLOCK_SIZE}) for a 2-D "
                f"tensor (Transformer Engine's weight tiles), or None for "
                f"1x{BLOCK_SIZE} blocks along `axis`. Received: "
                f"block_shape={block_shape!r} for x.shape={tuple(x.shape)}"
            )
        what = "Both dimensions of a 2-D `x` with 16x16 tiles"
        rows = _check_size(x, 0, BLOCK_SIZE, what, fix)
        columns = _check_size(x, 1, BLOCK_SIZE, what, fix)
        tiled = (rows // 16, 16, columns // 16, 16)
        return tiled, (1, 3)
    axis = _check_axis(x, axis)
    size = _check_size(x, axis, BLOCK_SIZE, "`x` along `axis`", fix)
    shape = ops.shape(x)
    tiled = (*shape[:axis], size // 16, 16, *shape[axis + 1 :])
    return tiled, (axis + 1,)


def _check_random_bits(random_bits, x):
    random_bits = ops.convert_to_tensor(random_bits)
    dtype = keras.backend.standardize_dtype(random_bits.dtype)
    if "int" not in dtype or tuple(random_bits.shape) != tuple(x.shape):
        raise ValueError(
            "`random_bits` is an integer tensor of `x`'s shape, e.g. "
            "`keras_mp._random_bits.random_bits(x.shape, seed)`. Received: "
            f"random_bits of dtype {dtype} and shape "
            f"{tuple(random_bits.shape)} for x.shape={tuple(x.shape)}"
        )
    return ops.cast(random_bits, "int32")


def quantize(x, axis=-1, block_shape=None, tensor_amax=None, random_bits=None):
    """Quantizes `x` to NVFP4: E2M1 codes, E4M3 block scales and a float32
    tensor scale, bit for bit as Transformer Engine.

    The tensor scale `S_enc = min(2688 / amax, FLT_MAX)` maps the largest
    magnitude to 448 * 6 (1 for an all-zero tensor); each block of 16
    values gets the E4M3 scale `dec = e4m3(min(block_amax * (S_enc *
    fl(1/6)), 448))`, and its values the E2M1 codes of `x * min(1 / (dec *
    (1 / S_enc)), FLT_MAX)` clipped to `±6`, rounded to nearest even (ties
    go to an even code), or stochastically with `random_bits`. Float32
    subnormals count as zero (XLA on a CPU and TensorFlow flush them, so
    every backend does). A block
    holding inf or NaN gets a NaN block scale and codes 0; a non-finite
    global amax a NaN tensor scale (and every block scale NaN): the
    dequantized values are NaN, never saturated finite values.

    Stochastic rounding takes the low 8 bits `r` of each element's random
    bits (as Blackwell's `cvt.rs` takes 8 bits per value) and rounds a
    magnitude `a` between neighbouring E2M1 values `lo < hi` up where
    `(a - lo) / (hi - lo) >= (2 * r + 1) / 512`: values on the grid never
    move, and the chance of rounding up is the fraction rounded to 8 bits.

    Args:
        x: A floating point tensor (float16, bfloat16, float32, float64),
            quantized in float32.
        axis: The axis of the 1x16 blocks (the contracted axis of the
            GEMM). Defaults to `-1`.
        block_shape: `(16, 16)` for 16x16 tiles of a 2-D `x` (Transformer
            Engine's weights); `axis` is then unused. Defaults to `None`
            (1x16 blocks along `axis`).
        tensor_amax: The float32 scalar amax for `S_enc` instead of `x`'s
            own (e.g. one reduced over replicas). Defaults to `None`.
        random_bits: An integer tensor of `x`'s shape, e.g.
            `keras_mp._random_bits.random_bits(x.shape, seed)`, for
            stochastic rounding; `None` rounds to nearest even. Defaults
            to `None`.

    Returns:
        `(codes, (block_scale, tensor_scale))`: `codes`, uint8 of `x`'s
        shape, one E2M1 code per byte (bit 3 the sign, then two exponent
        bits and one mantissa bit; `pack` puts two in a byte);
        `block_scale`, `float8_e4m3fn` of `x`'s shape with the blocked
        axes divided by 16; `tensor_scale`, the float32 scalar `S_enc`.

    Example:

    >>> from keras_mp._fp8.formats import nvfp4
    >>> x = np.array([[0.5, -3.0, 6.0, 1.25] * 4])
    >>> codes, (block, tensor) = nvfp4.quantize(x)
    >>> keras.ops.convert_to_numpy(codes)[0, :4].tolist()
    [1, 13, 7, 2]
    >>> float(keras.ops.cast(block, "float32")[0, 0]), float(tensor)
    (448.0, 448.0)
    """
    x = ops.convert_to_tensor(x)
    check_float("x", x)
    tiled, block_axes = _blocks(x, axis, block_shape)
    if random_bits is not None:
        random_bits = _check_random_bits(random_bits, x)
    x32 = ops.cast(x, "float32")
    # Subnormals count as zero (keeping their sign) on every backend.
    x32 = ops.where(ops.abs(x32) < FLOAT32_MIN, ops.multiply(x32, 0.0), x32)
    if tensor_amax is None:
        global_amax = backend_fp8.amax(x32, None)
    else:
        global_amax = ops.cast(ops.convert_to_tensor(tensor_amax), "float32")
        if tuple(global_amax.shape) not in ((), (1,)):
            raise ValueError(
                "`tensor_amax` is a scalar. Received: tensor_amax of shape "
                f"{tuple(global_amax.shape)}. Reduce it with "
                "`keras.ops.max` first."
            )
    s_enc = ops.reshape(tensor_scale(global_amax), ())
    blocks = ops.reshape(x32, tiled)
    scale = block_scale(backend_fp8.amax(blocks, block_axes), s_enc)
    decode = ops.cast(scale, "float32")
    encode = _encode_scale(decode, s_enc)
    scaled = ops.clip(ops.multiply(blocks, encode), -E2M1_MAX, E2M1_MAX)
    scaled = ops.where(ops.isnan(decode), 0.0, scaled)
    if random_bits is not None:
        random_bits = ops.reshape(random_bits, tiled)
    codes = ops.reshape(_encode_e2m1(scaled, random_bits), ops.shape(x))
    return codes, (ops.squeeze(scale, block_axes), s_enc)


def _encode_scale(decode, s_enc):
    """`min(1 / (dec_block * (1 / S_enc)), FLT_MAX)`: what a block's
    values are multiplied by before their E2M1 rounding."""
    return ops.minimum(
        ops.divide(1.0, ops.multiply(decode, ops.divide(1.0, s_enc))),
        FLOAT32_MAX,
    )


def flushed_and_saturated(x, codes, scale, axis=-1, block_shape=None):
    """Where `quantize` flushed and where it saturated `x`, given the
    codes and scales it returned for `x`.

    Flushed: a non-zero value (float32 subnormals included) whose
    dequantized value is zero: its E2M1 code is ±0 (with stochastic
    rounding, as the random bits rounded it), or its block's E4M3 scale
    is 0 (a block below the tensor's amax by more than E4M3 spans).
    Saturated: a value whose `|x * enc_block|` (`enc_block` the inverse of
    the block's `dec_block / S_enc`) was above 6 before the clip to 6,
    in a block of finite, non-zero scale. Blocks holding inf or NaN (NaN
    scales) count in neither.

    Args:
        x: The floating point tensor `quantize` quantized.
        codes: Its codes, one a byte.
        scale: Its `(block_scale, tensor_scale)`.
        axis: The axis of the 1x16 blocks. Defaults to `-1`.
        block_shape: `(16, 16)` for 16x16 tiles. Defaults to `None`.

    Returns:
        `(flushed, saturated)`: boolean tensors of `x`'s shape.
    """
    x = ops.convert_to_tensor(x)
    tiled, block_axes = _blocks(x, axis, block_shape)
    block, s_enc = scale
    decode = ops.cast(ops.convert_to_tensor(block), "float32")
    for block_axis in block_axes:
        decode = ops.expand_dims(decode, block_axis)
    x32 = ops.cast(x, "float32")
    # The values `quantize` scaled: subnormals as zero.
    flushed_x = ops.where(
        ops.abs(x32) < FLOAT32_MIN, ops.multiply(x32, 0.0), x32
    )
    blocks = ops.reshape(flushed_x, tiled)
    scaled = ops.multiply(blocks, _encode_scale(decode, s_enc))
    finite = ops.logical_not(ops.isnan(decode))
    magnitude = ops.bitwise_and(ops.cast(ops.reshape(codes, tiled), "int32"), 7)
    zero = ops.logical_or(ops.equal(magnitude, 0), ops.equal(decode, 0.0))
    flushed = ops.logical_and(
        ops.logical_and(ops.reshape(ops.not_equal(x32, 0.0), tiled), zero),
        finite,
    )
    saturated = ops.logical_and(
        ops.logical_and(finite, ops.greater(decode, 0.0)),
        ops.abs(scaled) > E2M1_MAX,
    )
    shape = ops.shape(x)
    return ops.reshape(flushed, shape), ops.reshape(saturated, shape)


def _encode_e2m1(y, random_bits):
    """E2M1 codes (uint8) of finite float32 `y` in [-6, 6]: nearest even
    without `random_bits`, else stochastic (see `quantize`)."""
    magnitude = ops.abs(y)
    # The grid's spacing is 0.5 below 2, 1 below 4, then 2; `k` counts
    # spacings, and the code of `k * spacing` is `k` plus 0, 2 or 4.
    below_2 = ops.cast(magnitude < 2.0, "float32")
    below_4 = ops.cast(magnitude < 4.0, "float32")
    spacing = 2.0 - below_4 - 0.5 * below_2
    offset = 4.0 - 2.0 * below_4 - 2.0 * below_2
    steps = ops.divide(magnitude, spacing)  # exact: a power-of-two divisor
    if random_bits is None:
        # Halves round to even on every backend, and an even `k` is an
        # even code (mantissa bit 0) in each range.
        k = ops.round(steps)
    else:
        k = ops.floor(steps)
        # The fraction is exact in float32, and so is 512 times it.
        fraction = ops.multiply(ops.subtract(steps, k), 512.0)
        threshold = 2 * ops.bitwise_and(random_bits, 0xFF) + 1
        k = k + ops.cast(fraction >= ops.cast(threshold, "float32"), "float32")
    code = ops.cast(k + offset, "int32")
    # The sign bit of `y` (so -0.0 gets code 8, as `ml_dtypes` casts it).
    negative = ops.cast(ops.view(y, "int32") < 0, "int32")
    return ops.cast(code + 8 * negative, "uint8")


def dequantize(codes, scale, axis=-1, block_shape=None):
    """The float32 values of NVFP4 codes: `value * f32(dec_block) / S_enc`.

    Args:
        codes: uint8 E2M1 codes, one per byte, as `quantize` returns them
            (`unpack` packed ones first).
        scale: `(block_scale, tensor_scale)` as `quantize` returns them.
        axis: The axis of the 1x16 blocks. Defaults to `-1`.
        block_shape: `(16, 16)` for 16x16 tiles of 2-D codes. Defaults to
            `None`.

    Returns:
        A float32 tensor of `codes`' shape; NaN in blocks whose scale is
        NaN.

    Example:

    >>> from keras_mp._fp8.formats import nvfp4
    >>> x = np.array([[0.5, -3.0, 6.0, 1.25] * 4])
    >>> codes, scale = nvfp4.quantize(x)
    >>> keras.ops.convert_to_numpy(nvfp4.dequantize(codes, scale))[0, :4]
    array([ 0.5, -3. ,  6. ,  1. ], dtype=float32)
    """
    codes = ops.convert_to_tensor(codes)
    block, s_enc = scale
    tiled, block_axes = _blocks(codes, axis, block_shape)
    values = ops.take(
        ops.convert_to_tensor(_CODE_VALUES), ops.cast(codes, "int32")
    )
    decode = ops.cast(ops.convert_to_tensor(block), "float32")
    for block_axis in block_axes:
        decode = ops.expand_dims(decode, block_axis)
    values = ops.reshape(values, tiled)
    # XLA rewrites a division by a broadcast (`x / s`) as a product with
    # its reciprocal, 1 ulp off in about a quarter of the values; `0 * v +
    # s` (which XLA does not fold, for NaN's sake) divides by a tensor.
    divisor = ops.add(ops.multiply(values, 0.0), ops.cast(s_enc, "float32"))
    result = ops.divide(ops.multiply(values, decode), divisor)
    return ops.reshape(result, ops.shape(codes))


def _check_even(x, axis, what):
    axis = _check_axis(x, axis)
    size = x.shape[axis]
    if size is None or size % 2:
        raise ValueError(
            f"{what} must have a known even size along `axis` (two codes a "
            f"byte). Received: shape={tuple(x.shape)}, axis={axis}. Pad it "
            "with a zero code."
        )
    return axis, size


def pack(codes, axis=-1):
    """Two E2M1 codes a byte along `axis`, the first in the low nibble
    (Transformer Engine's `cast_to_fp4x2`).

    Args:
        codes: uint8 codes (0 to 15), one a byte, as `quantize` returns
            them.
        axis: The axis to halve. Defaults to `-1`.

    Returns:
        uint8, `codes`' shape with `axis` halved.

    Example:

    >>> from keras_mp._fp8.formats import nvfp4
    >>> packed = nvfp4.pack(np.array([1, 15, 2, 0], "uint8"))
    >>> keras.ops.convert_to_numpy(packed).tolist()
    [241, 2]
    """
    codes = ops.convert_to_tensor(codes)
    axis, size = _check_even(codes, axis, "`codes`")
    shape = ops.shape(codes)
    pairs = ops.reshape(
        ops.cast(codes, "int32"),
        (*shape[:axis], size // 2, 2, *shape[axis + 1 :]),
    )
    low, high = ops.unstack(pairs, 2, axis=axis + 1)
    return ops.cast(ops.bitwise_or(low, ops.left_shift(high, 4)), "uint8")


def unpack(packed, axis=-1):
    """The codes `pack` packed: two a byte along `axis`, low nibble first.

    Args:
        packed: uint8 bytes.
        axis: The axis to double. Defaults to `-1`.

    Returns:
        uint8 codes (0 to 15), `packed`'s shape with `axis` doubled.
    """
    packed = ops.convert_to_tensor(packed)
    axis = _check_axis(packed, axis)
    shape = ops.shape(packed)
    size = packed.shape[axis]
    if size is None:
        raise ValueError(
            "`packed` must have a known size along `axis`. Received: "
            f"shape={tuple(packed.shape)}, axis={axis}"
        )
    pairs = ops.cast(packed, "int32")
    low = ops.bitwise_and(pairs, 15)
    high = ops.bitwise_and(ops.right_shift(pairs, 4), 15)
    codes = ops.stack([low, high], axis=axis + 1)
    return ops.cast(
        ops.reshape(codes, (*shape[:axis], size * 2, *shape[axis + 1 :])),
        "uint8",
    )


def hadamard_matrix():
    """Transformer Engine's 16x16 random Hadamard matrix, float32.

    `H = diag(S) @ H16 / 4`: `H16` the Sylvester Hadamard matrix (entries
    ±1), its rows multiplied by the fixed signs `S` of
    `HADAMARD_SIGNS`. `H @ H.T` is the identity exactly (entries ±1/4).

    Returns:
        A float32 tensor of shape `(16, 16)`.

    Example:

    >>> from keras_mp._fp8.formats import nvfp4
    >>> h = keras.ops.convert_to_numpy(nvfp4.hadamard_matrix())
    >>> bool((h @ h.T == np.eye(16)).all()), float(h[3, 0])
    (True, -0.25)
    """
    sylvester = np.ones((1, 1), np.float32)
    while sylvester.shape[0] < BLOCK_SIZE:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    signs = np.array(HADAMARD_SIGNS, np.float32)[:, None]
    return ops.convert_to_tensor(signs * sylvester / 4.0)


def hadamard(x, axis=-1):
    """`x` rotated by Transformer Engine's 16x16 random Hadamard transform:
    each run of 16 values along `axis` times `hadamard_matrix()` (`x @ H`).

    The rotation is orthogonal: rotating both operands of a product along
    its contracted axis leaves the product unchanged, while it spreads each
    block's outliers over 16 values before NVFP4 quantization (Transformer
    Engine applies it to both wgrad operands, along the token axis). It is
    computed as sign flips and a 4-stage butterfly in float32 (then a
    multiply by 1/4), the same additions in the same order on every
    backend, so the result is bit for bit the same everywhere.

    Args:
        x: A floating point tensor, its size along `axis` a multiple of 16.
        axis: The axis to rotate. Defaults to `-1`.

    Returns:
        A float32 tensor of `x`'s shape.

    Example:

    >>> from keras_mp._fp8.formats import nvfp4
    >>> y = nvfp4.hadamard(np.eye(16, dtype="float32"))
    >>> bool((keras.ops.convert_to_numpy(y) ==
    ...       keras.ops.convert_to_numpy(nvfp4.hadamard_matrix())).all())
    True
    """
    x = ops.convert_to_tensor(x)
    check_float("x", x)
    axis = _check_axis(x, axis)
    _check_size(x, axis, BLOCK_SIZE, "`x` along `axis`", "Pad it with zeros.")
    moved = ops.moveaxis(ops.cast(x, "float32"), axis, -1)
    shape = ops.shape(moved)
    signs = ops.convert_to_tensor(np.array(HADAMARD_SIGNS, np.float32))
    signs = ops.reshape(signs, (2, 2, 2, 2))
    y = ops.reshape(moved, (*shape[:-1], -1, 2, 2, 2, 2)) * signs
    # `x @ H16` for the Sylvester matrix: one butterfly per index bit.
    for bit in range(-4, 0):
        first, second = ops.unstack(y, 2, axis=bit)
        y = ops.stack([first + second, first - second], axis=bit)
    y = ops.multiply(ops.reshape(y, shape), 0.25)
    return ops.moveaxis(y, -1, axis)
