"""`quantize` and `dequantize`: a tensor as FP8 codes and float32 scales.

The public entry points of `keras_mp/_fp8/quantizers/`: each granularity's
quantizer says how it tiles a tensor and undoes it; the codes and the
power-of-two scales come from `formats/e4m3_e5m2.py`.
"""

import keras
from keras import ops

from keras_mp._fp8 import quantizers
from keras_mp._fp8.formats.e4m3_e5m2 import FORMATS
from keras_mp._fp8.formats.e4m3_e5m2 import check_float
from keras_mp._fp8.recipe_fields import GRANULARITIES
from keras_mp._fp8.recipe_fields import MX_FORMATS
from keras_mp._fp8.recipe_fields import NV_FORMATS
from keras_mp._fp8.recipe_fields import SCALE_ROUNDINGS
from keras_mp._fp8.recipe_fields import check_choice

# The dtype of the codes of the formats `codes.FORMATS` does not hold.
_CODE_DTYPES = {"mxfp8": "float8_e4m3fn", "nvfp4": "uint8"}


def quantize(
    x,
    fmt="e4m3",
    granularity=None,
    scale=None,
    axis=-1,
    margin=0,
    block_shape=None,
    scale_rounding=None,
):
    """Quantizes `x` to FP8 codes and float32 power-of-two scales.

    Each scale is the smallest power of two `s` with
    `amax / s <= fmax / 2**margin` (`amax`: the largest absolute value it
    covers; `fmax`: 448 for E4M3, 57344 for E5M2), i.e.
    `s = 2**ceil(log2(amax / (fmax / 2**margin)))` as Transformer Engine
    and DeepSeek-V3 choose it; `s = 1` where `amax` is 0. The codes are
    `x / s` cast to FP8, finite values beyond `±fmax` clipped first. Inf
    and NaN are never clipped into range: a tensor holding one gets a
    infinite scale (NaN counts as inf in the amax), so an overflowing
    gradient stays non-finite for a loss-scale skip to see.

    Args:
        x: A floating point tensor (float16, bfloat16, float32, float64);
            quantized in float32.
        fmt: `"e4m3"` (`float8_e4m3fn`, largest value 448), `"e5m2"`
            (`float8_e5m2`, largest value 57344), or `"mxfp8"` (OCP
            MXFP8: E4M3 codes in blocks of 32 along `axis`, each block's
            scale an E8M0 code, `uint8`, of shape `x.shape` with `axis`
            divided by 32; see `keras_mp/_fp8/formats/mxfp8.py`), or `"nvfp4"`
            (NVIDIA's NVFP4: uint8 E2M1 codes, one a byte, in blocks of 16
            along `axis`, or in 16x16 tiles with `block_shape=(16, 16)`,
            and as the scale the pair `(block_scale, tensor_scale)`: E4M3
            block scales and the float32 tensor scale; see
            `keras_mp/_fp8/formats/nvfp4.py`). Defaults to `"e4m3"`.
        granularity: `"tensorwise"` (one scale, shape `()`), `"rowwise"`
            (one scale per slice along `axis`: the amax is reduced over
            `axis`, which stays as a size-1 dimension), or `"block"`
            (one scale per tile of `BLOCK_SIZE = 128` consecutive values
            along `axis`, DeepSeek-V3's 1x128 tiles of activations and
            gradients: the scale has `x`'s shape with `axis` divided by
            128). With `fmt="mxfp8"`: `"microblock"`, its own; with
            `fmt="nvfp4"`: `"nvfp4"`, its own. Defaults to `None`: the
            format's own for `"mxfp8"` and `"nvfp4"`, else `"tensorwise"`.
        scale: Scales to use instead of computing them from `x` (e.g.
            the delayed scales of a layer), in the shape this function
            returns for `granularity`. Defaults to `None`.
        axis: The contracted axis, for `"rowwise"` and `"block"`.
            Defaults to `-1`.
        margin: Headroom below `fmax`, in powers of two. Defaults to `0`.
        block_shape: With `granularity="block"` and a 2-D `x`, tiles of
            this shape instead: `(128, 128)` gives DeepSeek-V3's kernel
            tiles, and a scale of shape
            `(rows / 128, columns / 128)`; `axis` is then unused. With
            `fmt="nvfp4"`, `(16, 16)` gives its kernel tiles.
            Defaults to `None` (1x128 tiles along `axis`; 1x16 for
            `"nvfp4"`).
        scale_rounding: With `fmt="mxfp8"`, `"rceil"` (the power of two
            at or above `amax / 448`) or `"floor"` (OCP's rule). Defaults
            to `None`: `"rceil"`.

    Returns:
        `(codes, scale)`: codes of `x`'s shape in the FP8 dtype, and a
        float32 scale with `x ≈ codes * scale`, broadcasting for
        `"tensorwise"` and `"rowwise"`; for `"block"`, each scale repeated
        over its tile (`keras.ops.repeat(scale, 128, axis)`, or along both
        axes with `block_shape`); for `"nvfp4"`, uint8 codes and the pair
        `(block_scale, tensor_scale)` (`x ≈ value(codes) * block_scale /
        tensor_scale`).

    Example:

    >>> codes, scale = keras_mp.fp8.quantize(np.array([0.5, -3.0, 96.0]))
    >>> float(scale)
    0.25
    >>> keras.ops.convert_to_numpy(keras.ops.cast(codes, "float32")).tolist()
    [2.0, -12.0, 384.0]
    """
    quantizer, granularity = _check(fmt, granularity, block_shape)
    if fmt in NV_FORMATS:
        _check_given_scale(fmt, scale, margin, scale_rounding)
    elif fmt in MX_FORMATS:
        _check_mx_arguments(fmt, scale, margin, scale_rounding)
        quantizer = quantizers.mx(scale_rounding or "rceil")
    elif scale_rounding is not None:
        raise ValueError(
            "`scale_rounding` rounds the E8M0 scales of an MX format. "
            f"Received: fmt={fmt!r}, scale_rounding={scale_rounding!r}. "
            'Leave it as None, or pass fmt="mxfp8".'
        )
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(
            f"`margin` is an integer >= 0. Received: margin={margin!r}"
        )
    x = ops.convert_to_tensor(x)
    check_float("x", x)
    x32 = ops.cast(x, "float32")
    if scale is not None:
        scale = ops.cast(ops.convert_to_tensor(scale), "float32")
    axis = _check_axis(axis, x, granularity, block_shape)
    return quantizer.quantize(x32, fmt, axis, margin, scale, block_shape)


def dequantize(
    codes,
    scale,
    fmt="e4m3",
    granularity=None,
    axis=-1,
    block_shape=None,
):
    """The float32 values of FP8 codes and their scales: `quantize` undone.

    Args:
        codes: What `quantize` returned as codes.
        scale: What `quantize` returned as the scale.
        fmt: The format of the codes. Defaults to `"e4m3"`.
        granularity: As given to `quantize`. Defaults to `None` (the
            format's default, as in `quantize`).
        axis: As given to `quantize`. Defaults to `-1`.
        block_shape: As given to `quantize`. Defaults to `None`.

    Returns:
        A float32 tensor of the shape of `codes`: each code times its
        scale (exact: the scales are powers of two; MXFP8's subnormal
        results too).

    Example:

    >>> codes, scale = keras_mp.fp8.quantize(np.array([0.5, -3.0, 96.0]))
    >>> y = keras_mp.fp8.dequantize(codes, scale)
    >>> keras.ops.convert_to_numpy(y).tolist()
    [0.5, -3.0, 96.0]
    """
    quantizer, granularity = _check(fmt, granularity, block_shape)
    codes = ops.convert_to_tensor(codes)
    dtype = keras.backend.standardize_dtype(codes.dtype)
    expected = _CODE_DTYPES.get(fmt) or FORMATS[fmt][0]
    if dtype != expected:
        raise TypeError(
            f"`codes` of fmt={fmt!r} are {expected}. Received: codes "
            f"of dtype {dtype}. Pass the codes `keras_mp.fp8.quantize` "
            "returned, with the `fmt` they were quantized in."
        )
    if fmt in NV_FORMATS:
        if not isinstance(scale, (tuple, list)) or len(scale) != 2:
            raise ValueError(
                f"The scale of fmt={fmt!r} is the pair `(block_scale, "
                "tensor_scale)` that `keras_mp.fp8.quantize` returned. "
                f"Received: scale={scale!r}"
            )
        scale = tuple(ops.convert_to_tensor(s) for s in scale)
    else:
        scale = ops.convert_to_tensor(scale)
    if fmt not in (*MX_FORMATS, *NV_FORMATS):
        scale = ops.cast(scale, "float32")
    axis = _check_axis(axis, codes, granularity, block_shape)
    return quantizer.dequantize(codes, scale, axis, block_shape)


def _check(fmt, granularity, block_shape):
    """The quantizer of `fmt` at `granularity` (None: the format's
    default), and that granularity."""
    check_choice("fmt", fmt, (*FORMATS, *MX_FORMATS, *NV_FORMATS))
    if fmt in NV_FORMATS:
        own = NV_FORMATS[fmt]
        if granularity not in (None, own) or block_shape not in (
            None,
            (16, 16),
            [16, 16],
        ):
            raise ValueError(
                f"fmt={fmt!r} scales blocks of 16 values along `axis`, or "
                "16x16 tiles of a 2-D tensor with `block_shape=(16, 16)` "
                f"(granularity={own!r}). Received: granularity="
                f"{granularity!r}, block_shape={block_shape!r}. Leave "
                "`granularity` as None and pass `block_shape` as None or "
                "(16, 16)."
            )
        return quantizers.nv(), own
    if fmt in MX_FORMATS:
        own = MX_FORMATS[fmt]
        if granularity not in (None, own) or block_shape is not None:
            raise ValueError(
                f"fmt={fmt!r} scales blocks of 32 values along `axis` "
                f"(granularity={own!r}), with no other tiling. Received: "
                f"granularity={granularity!r}, block_shape={block_shape!r}. "
                "Leave both as None."
            )
        return quantizers.mx("rceil"), own
    if granularity is None:
        granularity = "tensorwise"
    check_choice("granularity", granularity, GRANULARITIES)
    if block_shape is not None and granularity != "block":
        raise ValueError(
            '`block_shape` tiles a tensor for granularity="block". Received: '
            f"block_shape={block_shape!r} with granularity={granularity!r}. "
            'Pass granularity="block", or leave `block_shape` as None.'
        )
    return quantizers.BY_GRANULARITY[granularity], granularity


def _check_given_scale(fmt, scale, margin, scale_rounding):
    if scale is not None or margin != 0 or scale_rounding is not None:
        raise ValueError(
            f"fmt={fmt!r} takes its tensor scale from the amax of `x` and "
            "each block's E4M3 scale from its own amax: no given scale, no "
            "margin, no scale rounding. Received: "
            f"scale={'a tensor' if scale is not None else None}, "
            f"margin={margin!r}, scale_rounding={scale_rounding!r}. Leave "
            "them as None, 0 and None (or call `keras_mp._fp8.formats.nvfp4."
            "quantize` with `tensor_amax`)."
        )


def _check_mx_arguments(fmt, scale, margin, scale_rounding):
    if scale is not None or margin != 0:
        raise ValueError(
            f"fmt={fmt!r} takes each block's E8M0 scale from its own amax: "
            "no given scale, no margin. Received: "
            f"scale={'a tensor' if scale is not None else None}, "
            f"margin={margin!r}. Leave `scale` as None and `margin` as 0."
        )
    if scale_rounding is not None:
        check_choice("scale_rounding", scale_rounding, SCALE_ROUNDINGS)


def _check_axis(axis, x, granularity, block_shape):
    """`axis`, non-negative, where the granularity uses it."""
    if granularity == "tensorwise" or block_shape is not None:
        return axis
    ndim = len(x.shape)
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(
            f"`axis` is an axis of `x`, in [{-ndim}, {ndim}). Received: "
            f"axis={axis!r} for x.shape={tuple(x.shape)}"
        )
    return axis % ndim
