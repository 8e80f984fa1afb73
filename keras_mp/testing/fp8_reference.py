"""A NumPy + `ml_dtypes` oracle of `keras_mp.fp8`, written apart from it.

Scales from `np.frexp` in float64, codes from `np.clip` and `ml_dtypes`
casts, GEMMs in float64 on the dequantized codes (exact: a code times a
power of two is exact). Tests compare the library with it bit for bit
(codes, scales) or to float32 accumulation rounding (GEMMs; FP8 tensor
cores accumulate with fewer bits: `accumulation_error`).
"""

import keras
import ml_dtypes
import numpy as np

FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0),
}
BLOCK = 128


def scale(amax, fmt, margin=0):
    """The smallest power of two `s` with `amax / s <= fmax / 2**margin`."""
    amax = np.asarray(amax, np.float64)
    target = FORMATS[fmt][1] / 2.0**margin
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mantissa, exponent = np.frexp(amax / target)
        # amax / target = mantissa * 2**exponent, mantissa in [0.5, 1).
        power = np.where(mantissa == 0.5, exponent - 1, exponent)
        power = np.clip(power, -126, 127)
        result = np.ldexp(1.0, power)
    result = np.where(amax == 0, 1.0, result)
    result = np.where(np.isfinite(amax), result, amax)
    return result.astype(np.float32)


def history_value(amax):
    """The float32 a delayed layer's history holds for `amax`: its float32
    exponent bits, and a mantissa of 1.875 where `amax`'s is above 1.75
    (0 below the normal range); `scale` gives it `amax`'s scale."""
    bits = np.asarray(amax, np.float32).view(np.int32)
    exponent = bits >> 23
    above = (bits & 0x7FFFFF) > (3 << 21)
    out = (exponent << 23) + np.where(above, 0x700000, 0)
    return np.where(exponent == 0, 0, out.astype(np.int32)).view(np.float32)


def encode(x, s, fmt):
    """Codes of `x / s` (s broadcast), finite overflow clipped first."""
    dtype, fmax = FORMATS[fmt]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        y = np.asarray(x, np.float32) / np.asarray(s, np.float32)
    y = np.where(np.isfinite(y), np.clip(y, -fmax, fmax), y)
    return y.astype(dtype)


def element_scales(x, fmt, granularity, axis=-1, block_shape=None, margin=0):
    """The scale of each element of `x` (same shape), and the scale as
    `keras_mp.fp8.quantize` returns it. Blocks along `axis` may end in a
    partial tile (as the kernel gradient's token tiles do)."""
    x = np.abs(np.asarray(x, np.float32)).astype(np.float64)
    # A NaN counts as inf in every amax.
    x = np.where(np.isnan(x), np.inf, x)
    if granularity == "tensorwise":
        s = scale(np.max(x), fmt, margin)
        return np.broadcast_to(s, x.shape), s
    if granularity == "rowwise":
        s = scale(np.max(x, axis=axis, keepdims=True), fmt, margin)
        return np.broadcast_to(s, x.shape), s
    if block_shape is not None:
        rows, cols = x.shape
        tiles = x.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        s = scale(np.max(tiles, axis=(1, 3)), fmt, margin)
        full = np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1)
        return full, s
    x = np.moveaxis(x, axis, -1)
    size = x.shape[-1]
    padded = np.zeros(x.shape[:-1] + (-(-size // BLOCK) * BLOCK,))
    padded[..., :size] = x
    tiles = padded.reshape(x.shape[:-1] + (-1, BLOCK))
    s = scale(np.max(tiles, axis=-1), fmt, margin)
    full = np.repeat(s, BLOCK, axis=-1)[..., :size]
    return np.moveaxis(full, -1, axis), np.moveaxis(s, -1, axis)


def quantize(x, fmt, granularity, axis=-1, block_shape=None, margin=0):
    """`(codes, scale)` as `keras_mp.fp8.quantize` must return them."""
    full, s = element_scales(x, fmt, granularity, axis, block_shape, margin)
    return encode(x, full, fmt), s


def dequantized(x, fmt, granularity, axis, block_shape=None, margin=0):
    """`codes * scale` of each element, in float64 (exact)."""
    full, _ = element_scales(x, fmt, granularity, axis, block_shape, margin)
    codes = encode(x, full, fmt)
    return codes.astype(np.float64) * full


def gemms(x, w, g, granularity, formats="hybrid", margin=0):
    """Float64 results of `fp8.dot`'s three GEMMs, each with the sum of
    absolute products (the scale of float32 accumulation rounding).

    Args:
        x: `[M, K]`. w: `[K, N]`. g: the output gradient `[M, N]`.

    Returns:
        `{"out": (value, bound), "dx": ..., "dw": ...}`.
    """
    forward = "e4m3"
    backward = "e5m2" if formats == "hybrid" else "e4m3"
    kernel_block = (BLOCK, BLOCK) if granularity == "block" else None
    deq = lambda t, fmt, axis, shape=None: dequantized(  # noqa: E731
        t, fmt, granularity, axis, shape, margin
    )
    operands = {
        "out": (deq(x, forward, 1), deq(w, forward, 0, kernel_block)),
        "dx": (deq(g, backward, 1), deq(w, forward, 1, kernel_block).T),
        "dw": (deq(x, forward, 0).T, deq(g, backward, 0)),
    }
    return {
        name: (a @ b, np.abs(a) @ np.abs(b))
        for name, (a, b) in operands.items()
    }


# How far a product of FP8 codes may be from the exact sum, as a fraction of
# the sum of |products|. On a CPU the codes are multiplied exactly and summed
# in float32. FP8 tensor cores accumulate with fewer bits: on an NVIDIA H100
# (2026-11-25; torch 2.11 `_scaled_mm`, jax 0.11.2's XLA) the tests' forward
# products were off by up to 2.2e-4 of it (4e-5 already at K = 16), and the
# backward ones, with E5M2 operands, by up to 2.2e-3.
CPU_ACCUMULATION_ERROR = 1e-6
GPU_ACCUMULATION_ERROR = 4e-3


def accumulation_error():
    """The error bound above for the device Keras computes on."""
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        on_gpu = torch.cuda.is_available()
    elif backend == "jax":
        import jax

        on_gpu = jax.default_backend() == "gpu"
    else:
        # TensorFlow upcasts the codes (its kernels reject FP8): on a GPU
        # its float32 GEMM may round operands to TF32, which holds every
        # FP8 code exactly, and accumulates in float32.
        on_gpu = False
    return GPU_ACCUMULATION_ERROR if on_gpu else CPU_ACCUMULATION_ERROR


# MXFP8 (OCP Microscaling): E4M3 codes, one E8M0 scale per 32 values along
# an axis. Exponents from `np.frexp` and comparisons in float64, element
# division in float64 (exact), codes from `ml_dtypes`; never
# `astype(float8_e8m0fnu)`, which rounds half-up in linear space.

MX_BLOCK = 32
E4M3_MAX = 448.0


def mx_e8m0(amax, rounding="rceil", fmt="e4m3"):
    """E8M0 codes (`uint8`) of block amaxes: `e + 127` for the scale `2**e`.

    `"rceil"`: the smallest `e` in [-127, 127] with `amax <= 448 * 2**e`;
    `"floor"`: `floor(log2(amax)) - 8`, clamped to [-127, 127]. Zero gives
    code 0, inf and NaN 0xFF.
    """
    fmax = FORMATS[fmt][1]
    # fmax = 1.75 * 2**top: E4M3 8, E5M2 15.
    top = int(np.log2(fmax / 1.75))
    amax = np.abs(np.asarray(amax, np.float32).astype(np.float64))
    with np.errstate(invalid="ignore"):
        _, exponent = np.frexp(np.where(np.isfinite(amax), amax, 1.0))
        # amax in [2**(exponent - 1), 2**exponent), so 448 * 2**(exponent -
        # 9) = 0.875 * 2**exponent is below or above it, and 448 *
        # 2**(exponent - 8) is always above it.
        if rounding == "rceil":
            fits = amax <= np.ldexp(fmax, exponent - top - 1)
            e = np.where(fits, exponent - top - 1, exponent - top)
        elif rounding == "floor":
            e = exponent - 1 - top
        else:
            raise ValueError(f"unknown rounding {rounding!r}")
    code = np.clip(e, -127, 127) + 127
    code = np.where(amax == 0, 0, code)
    code = np.where(np.isfinite(amax), code, 255)
    return code.astype(np.uint8)


def mx_e8m0_transformer_engine(amax):
    """Transformer Engine's `float_to_e8m0(amax * (1 / 448))` (CUDA, before
    SM100's `cvt.rp`; JAX's `cast_to_e8m0_with_rounding_up(amax / 448)` is
    the same function of its argument), transcribed: the float32 exponent
    of the product, plus one if its mantissa is not zero, except at
    exponent 0xFE and for subnormals up to 2**-127. TE gives 0xFE for inf
    (keras_mp 0xFF)."""
    with np.errstate(over="ignore"):
        y = np.asarray(amax, np.float32) * (np.float32(1) / np.float32(448))
    return _float_to_e8m0(y)


def mx_e8m0_jax(amax):
    """JAX's `cast_to_e8m0_with_rounding_up(amax / 448)`, in NumPy (no
    flush of subnormals, as on a GPU). For a NaN amax its exponent 0xFF + 1
    wraps to code 0 in `uint8`."""
    with np.errstate(over="ignore"):
        y = np.asarray(amax, np.float32) / np.float32(448)
    return _float_to_e8m0(y)


def _float_to_e8m0(y):
    bits = y.view(np.uint32)
    exponent = bits >> 23 & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (
        (mantissa > 0)
        & (exponent != 0xFE)
        & ~((exponent == 0) & (mantissa <= 0x400000))
    )
    return (exponent + round_up).astype(np.uint8)


def mx_scale_values(scale):
    """E8M0 codes as float32 (`2**(code - 127)`, NaN for 0xFF), through
    `ml_dtypes.float8_e8m0fnu`."""
    codes = np.asarray(scale, np.uint8)
    return codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _blocks(x, axis):
    """`x` with `axis` moved last and split into `(n / 32, 32)`."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    return x.reshape(x.shape[:-1] + (-1, MX_BLOCK))


def _unblock(tiles, axis):
    return np.moveaxis(tiles.reshape(tiles.shape[:-2] + (-1,)), -1, axis)


def mx_quantize(x, axis=-1, rounding="rceil", fmt="e4m3"):
    """`(codes, scale)` as `keras_mp._fp8.formats.mxfp8.quantize` must return them:
    `float8_e4m3fn` (or `float8_e5m2`) codes and `uint8` E8M0 codes."""
    dtype, fmax = FORMATS[fmt]
    tiles = _blocks(np.asarray(x, np.float32).astype(np.float64), axis)
    amax = np.max(np.abs(tiles), axis=-1)  # NaN propagates
    code = mx_e8m0(amax, rounding, fmt)
    power = np.ldexp(1.0, code.astype(np.int64) - 127)[..., None]
    y = tiles / power  # exact in float64
    y = np.where(np.isfinite(y), np.clip(y, -fmax, fmax), np.nan)
    y = np.where((code == 255)[..., None], np.nan, y)
    # y is a float32 times a power of two: exact in float32 unless below
    # 2**-126, far under E4M3's and E5M2's smallest subnormals either way.
    codes = y.astype(np.float32).astype(dtype)
    return _unblock(codes, axis), np.moveaxis(code, -1, axis)


def mx_dequantize(codes, scale, axis=-1):
    """Float32 `codes * 2**(scale - 127)`, exact (subnormals kept), from
    float64 products; NaN where the scale is 0xFF."""
    tiles = _blocks(np.asarray(codes).astype(np.float64), axis)
    scale = np.moveaxis(np.asarray(scale, np.uint8), axis, -1)[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        values = tiles * np.ldexp(1.0, scale.astype(np.int64) - 127)
        values = np.where(scale == 255, np.nan, values).astype(np.float32)
    return _unblock(values, axis)


# NVFP4, transcribed from Transformer Engine's
# `custom_recipes/reference_nvfp4.py::_quantize_blockwise_reference` (and
# `common/cast/nvfp4/core_nvfp4.cuh` for the tensor scale of a zero amax) in
# float32 NumPy, with `ml_dtypes` casts for the roundings: E4M3 for block
# scales, E2M1 for codes (both round to nearest even; `ml_dtypes` would
# saturate inf to ±6 and turn NaN into ±0, so non-finite blocks are handled
# before the cast). Where keras_mp decides what TE leaves open, the rule is
# keras_mp's and says so.
NV_BLOCK = 16
_F32 = np.float32
_FLT_MAX = _F32(np.finfo(np.float32).max)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
HADAMARD_SIGNS = np.array(
    [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32
)


def nv_tensor_scale(global_amax):
    """`S_enc = min(448 * 6 / amax, FLT_MAX)`; 1 where amax is 0 (TE's
    kernel; its PyTorch reference leaves FLT_MAX there, with the same codes
    and block scales) or subnormal, and NaN where amax is inf or NaN
    (keras_mp's rules: TE's kernel gives 1 for inf)."""
    amax = np.asarray(global_amax, np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.minimum(_F32(448.0) * _F32(6.0) / amax, _FLT_MAX)
    s = np.where(amax < np.finfo(np.float32).tiny, _F32(1.0), s)
    return np.where(np.isfinite(amax), s, _F32(np.nan)).astype(np.float32)


def _nv_tiles(x, axis, block_shape):
    """`x` as tiles: `(..., blocks, 16)`, `axis` moved last, for 1x16
    blocks; `(rows / 16, columns / 16, 256)` for 16x16 tiles."""
    x = np.asarray(x)
    if block_shape is not None:
        rows, cols = x.shape
        tiles = x.reshape(rows // 16, 16, cols // 16, 16).transpose(0, 2, 1, 3)
        return tiles.reshape(rows // 16, cols // 16, 256)
    moved = np.moveaxis(x, axis, -1)
    return moved.reshape(moved.shape[:-1] + (-1, NV_BLOCK))


def _nv_untile(tiles, shape, axis, block_shape):
    """The inverse of `_nv_tiles` for an array of `x`'s `shape`."""
    if block_shape is not None:
        rows, cols = shape
        tiles = tiles.reshape(rows // 16, cols // 16, 16, 16)
        return tiles.transpose(0, 2, 1, 3).reshape(rows, cols)
    moved = np.moveaxis(np.empty(shape, np.uint8), axis, -1).shape
    return np.moveaxis(tiles.reshape(moved), -1, axis)


def nv_block_scale(block_amax, s_enc, order="pytorch"):
    """E4M3 block scales: `block_amax * (S_enc * fl(1/6))` (TE-PyTorch and
    its kernels) or `(block_amax / 6) * S_enc` (`order="jax"`: TE-JAX's
    `NVFP4Quantizer`), then `min(., FLT_MAX)`, a clamp to 448 and an RNE
    cast. A non-finite block amax or `S_enc` gives NaN (keras_mp's rule)."""
    amax = np.asarray(block_amax, np.float32)
    s_enc = _F32(s_enc)
    with np.errstate(invalid="ignore", over="ignore"):
        if order == "jax":
            scaled = amax / _F32(6.0) * s_enc
        else:
            scaled = amax * (s_enc * (_F32(1.0) / _F32(6.0)))
        scaled = np.clip(np.minimum(scaled, _FLT_MAX), -448.0, 448.0)
    finite = np.isfinite(amax) & np.isfinite(s_enc)
    scaled = np.where(finite, scaled, np.nan).astype(np.float32)
    return scaled.astype(ml_dtypes.float8_e4m3fn)


def _e2m1_codes_stochastic(y, random_bits):
    """E2M1 codes of finite float32 `y` in [-6, 6], between the two grid
    neighbours of `|y|`: up where `frac >= (2 * (bits & 0xFF) + 1) / 512`."""
    magnitude = np.abs(y).astype(np.float64)
    low = np.searchsorted(E2M1_GRID, magnitude, side="right") - 1
    high = np.minimum(low + 1, 7)
    spread = E2M1_GRID[high] - E2M1_GRID[low]
    with np.errstate(invalid="ignore", divide="ignore"):
        fraction = np.where(
            spread > 0, (magnitude - E2M1_GRID[low]) / spread, 0.0
        )
    bits = np.asarray(random_bits).astype(np.int64) & 0xFF
    index = np.where(fraction >= (2 * bits + 1) / 512, high, low)
    return (index + 8 * np.signbit(y)).astype(np.uint8)


def nv_quantize(
    x,
    axis=-1,
    block_shape=None,
    tensor_amax=None,
    random_bits=None,
    order="pytorch",
):
    """`(codes, (block_scale, tensor_scale))` as `keras_mp._fp8.formats.nvfp4.
    quantize` must return them: uint8 codes (one a byte), E4M3 block
    scales, the float32 scalar `S_enc`. A block whose scale is NaN has
    codes 0 (keras_mp's rule)."""
    x = np.asarray(x, np.float32)
    # keras_mp's rule: float32 subnormals count as (signed) zero.
    with np.errstate(invalid="ignore"):
        x = np.where(np.abs(x) < np.finfo(np.float32).tiny, x * _F32(0), x)
    if tensor_amax is None:
        tensor_amax = np.where(np.isnan(x), np.inf, np.abs(x)).max()
    s_enc = nv_tensor_scale(tensor_amax)
    tiles = _nv_tiles(x, axis, block_shape)
    amax = np.where(np.isnan(tiles), np.inf, np.abs(tiles)).max(axis=-1)
    scale = nv_block_scale(amax, s_enc, order)
    decode = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        encode = np.minimum(
            _F32(1.0) / (decode * (_F32(1.0) / s_enc)), _FLT_MAX
        )
        y = np.clip(tiles * encode, _F32(-6.0), _F32(6.0))
    y = np.where(np.isnan(decode), _F32(0.0), y).astype(np.float32)
    if random_bits is None:
        codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    else:
        bits = _nv_tiles(random_bits, axis, block_shape)
        codes = _e2m1_codes_stochastic(y, bits)
    codes = _nv_untile(codes, x.shape, axis, block_shape)
    if block_shape is None:
        scale = np.moveaxis(scale, -1, axis)
    return codes, (scale, s_enc)


def nv_dequantize(codes, scale, axis=-1, block_shape=None):
    """`value(code) * f32(dec_block) / S_enc` in float32, each block scale
    repeated over its block."""
    block, s_enc = scale
    values = np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn)
    values = values.astype(np.float32)
    decode = np.asarray(block).astype(np.float32)
    if block_shape is None:
        decode = np.repeat(decode, NV_BLOCK, axis=axis)
    else:
        decode = np.repeat(np.repeat(decode, 16, 0), 16, 1)
    return (values * decode / _F32(s_enc)).astype(np.float32)


def nv_pack(codes, axis=-1):
    """Two codes a byte along `axis`, the first in the low nibble (TE's
    `cast_to_fp4x2`)."""
    codes = np.moveaxis(np.asarray(codes, np.uint8), axis, -1)
    packed = codes[..., ::2] | (codes[..., 1::2] << 4)
    return np.moveaxis(packed.astype(np.uint8), -1, axis)


def nv_hadamard_matrix():
    """`diag(S) @ H16 / 4` with TE's signs `S`, as TE's
    `_build_hadamard_matrix` builds it (float64, exact)."""
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return np.diag(HADAMARD_SIGNS.astype(np.float64)) @ h / 4.0


def nv_hadamard(x, axis=-1):
    """`x @ nv_hadamard_matrix()` on each run of 16 along `axis`, in
    float32 as keras_mp computes it: the signs, then butterflies on index
    strides 8, 4, 2, 1 (`(a + b, a - b)`), then a multiply by 1/4."""
    moved = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    y = moved.reshape(moved.shape[:-1] + (-1, 16)) * HADAMARD_SIGNS
    for stride in (8, 4, 2, 1):
        first = np.array([i for i in range(16) if not i & stride])
        a, b = y[..., first], y[..., first + stride]
        y = y.copy()
        y[..., first], y[..., first + stride] = a + b, a - b
    y = (y * _F32(0.25)).reshape(moved.shape)
    return np.moveaxis(y, -1, axis)


def _lowbias32(x):
    """The `lowbias32` hash of uint32 `x` (`keras_mp/_random_bits.py`)."""
    x = np.asarray(x, np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


NV_ROLE_KEYS = {"input_gradient": 1, "kernel_gradient": 2}


def nv_rounding_bits(t, role):
    """The stochastic rounding bits of NVFP4's backward GEMMs, keras_mp's
    rule (`keras_mp/_fp8/quantizers/nvfp4.py::rounding_bits`) in uint32:
    `v` the bits of float32 `t` (subnormals as signed zero), `key =
    hash(sum(hash(v)) + c)` with the sum modulo 2**32, and
    `hash(v[i] ^ hash(i + key))` for element `i` in row-major order."""
    t = np.asarray(t, np.float32)
    t = np.where(np.abs(t) < np.finfo(np.float32).tiny, t * _F32(0), t)
    v = t.view(np.uint32)
    with np.errstate(over="ignore"):
        total = np.uint32(_lowbias32(v).astype(np.uint64).sum() % 2**32)
        key = _lowbias32(total + np.uint32(NV_ROLE_KEYS[role]))
        index = np.arange(t.size, dtype=np.uint32).reshape(t.shape)
        bits = _lowbias32(v ^ _lowbias32(index + key))
    return bits.view(np.int32)
