"""FP8 statistics: counted inside the step, carried out as a gradient.

A layer whose recipe has `stats=True` owns one float32 "carrier" variable of
shape `(3, STATS_WIDTH)`, an extra input of its `fp8.dot` whose value the
forward ignores and whose custom gradient IS the statistics of the call.
The carrier is trainable with `overwrite_with_gradient=True`, so the
optimizer assigns it this gradient as it is (never unscaled, clipped or
decayed; a skipped step leaves it bit-identical): after a training step it
holds that step's statistics, counted inside the compiled step (tf.function,
`jax.jit`, torch) with no host read. It is the one channel that works under
Keras's trainers on every backend (JAX differentiates only trainable
variables), and the output gradient's statistics exist only in the backward
pass.

Rows: `TENSORS` (0 the input, 1 the kernel, 2 the output gradient). Each row
holds `[0:512]` a one-hot histogram bin of the tensor's amax,
`2 * (biased float32 exponent) + (mantissa > 0.75 * 2**23)`: E4M3's 448 and
E5M2's 57344 are both `1.75 * 2**k`, so the bin fixes the current-scaling
power-of-two scale exactly (inf and NaN: bins 510 and 511); then `[512]` the
number of elements, `[513]` the number flushed (a non-zero value whose FP8
code is zero), `[514]` the number saturated (a finite `|x / scale|` above
the format's largest value before the clip; never under current scaling,
counted all the same for delayed scaling to reuse this channel). NVFP4
counts its E2M1 codes itself (`counted_row`): a value is flushed where it
is non-zero and dequantizes to zero (as stochastic rounding rounded it,
for the output gradient), saturated where `|x|` was above 6 times its
block's scale over the tensor scale (`dec_block / S_enc`) before the clip;
the amax bin is the tensor's, as for every format.

Autodiff sums a carrier's gradient over the calls of a layer in a step (and
over the batch's shards under JAX's `DataParallel`); each GEMM's backward
takes its max across tf.distribute replicas (`_fp8/dot.py`: Keras's
optimizer keeps one replica's overwritten gradient), and Keras's optimizer
takes their max over a `gradient_accumulation_steps` window, assigning it
at the window's last micro-step. The bins present are those of every call,
replica and micro-step, the highest being the step's amax; the counts are
the step's under the sum, and under the max those of the worst replica or
micro-step. Counts are float32: exact up to 2**24 values per tensor,
beyond that within a relative 2**-24 (fractions stay right).
"""

import math

import numpy as np
from keras import ops

from keras_mp import _keras_internals
from keras_mp._fp8.formats.e4m3_e5m2 import FORMATS
from keras_mp._keras_internals import constant
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.backend.torch import delayed as torch_delayed
from keras_mp.backend.torch import ops as torch_ops

TENSORS = ("input", "kernel", "output_gradient")
HISTOGRAM_BINS = 512
COUNT, FLUSHED, SATURATED = 512, 513, 514
STATS_WIDTH = 515
SHAPE = (len(TENSORS), STATS_WIDTH)
# Bins below this hold finite amaxes; 510 and 511 hold inf and NaN.
FINITE_BINS = 510
MANTISSA_ABOVE_1_75 = 3 << 21  # 0.75 * 2**23
# Half of each format's smallest subnormal: E4M3's is 2**-9, E5M2's 2**-16.
_HALF_SMALLEST_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


def amax_bin(amax):
    """The histogram bin of a non-negative float32 `amax` (int32)."""
    bits = ops.view(ops.cast(amax, "float32"), "int32")
    above = ops.cast(
        ops.bitwise_and(bits, constant(0x7FFFFF, "int32"))
        > MANTISSA_ABOVE_1_75,
        "int32",
    )
    return ops.right_shift(bits, 23) * 2 + above


def tensor_row(x, scale, fmt, counts=True, amax=None):
    """The statistics row of float32 `x` quantized with `scale`.

    A value is flushed where it is non-zero and `|x / scale|` is at most
    half the format's smallest subnormal (round to nearest even takes
    exactly half to zero): float32 comparisons, not a decode of the codes,
    which XLA may fold away (`convert(convert(y, f8), f32)` to `y` under its
    default excess precision, seen on a GPU).

    Args:
        x: The float32 tensor that was quantized.
        scale: Each value's scale, broadcastable to `x`.
        fmt: `"e4m3"` or `"e5m2"`.
        counts: Whether to count the flushed and saturated values (else
            0). Defaults to `True`.
        amax: `x`'s amax, where already known. Defaults to `None`.

    Returns:
        A float32 tensor of shape `(STATS_WIDTH,)`.
    """
    fmax = FORMATS[fmt][1]
    if not counts:
        # Delayed scaling needs the amax alone: no pass over `x` for the
        # flushed and saturated counts (left 0).
        size = ops.reshape(_size(x), (1,))
        return ops.concatenate(
            [_histogram(x, amax), size, ops.zeros((2,), "float32")]
        )
    # `x` may be bfloat16 (`Quantizer.reads_16bit`): its quotient by the
    # scale is taken in float32, as the cast to FP8 takes it.
    x = ops.cast(x, "float32")
    y = x / scale
    flushed = ops.logical_and(
        ops.not_equal(x, constant(0.0, "float32")),
        ops.abs(y) <= _HALF_SMALLEST_SUBNORMAL[fmt],
    )
    saturated = ops.logical_and(ops.isfinite(y), ops.abs(y) > fmax)
    return counted_row(x, flushed, saturated, amax)


def counted_row(x, flushed, saturated, amax=None):
    """The statistics row of float32 `x` whose quantization counted its
    own flushed and saturated values (NVFP4's, from its codes and two-level
    scales: `keras_mp._fp8.formats.nvfp4.flushed_and_saturated`).

    Args:
        x: The float32 tensor that was quantized.
        flushed: A boolean tensor of `x`'s shape: the values flushed.
        saturated: A boolean tensor of `x`'s shape: the values saturated.
        amax: `x`'s amax, where already known. Defaults to `None`.

    Returns:
        A float32 tensor of shape `(STATS_WIDTH,)`.
    """
    counts = ops.stack(
        [
            _size(x),
            ops.sum(ops.cast(flushed, "float32")),
            ops.sum(ops.cast(saturated, "float32")),
        ]
    )
    return ops.concatenate([_histogram(x, amax), counts])


def _size(x):
    """The number of values of `x`, a float32 scalar: a `constant` where
    the shape is known (no copy from the host on PyTorch)."""
    shape = tuple(x.shape)
    if all(isinstance(d, int) for d in shape):
        size = constant(float(math.prod(shape)), "float32")
        return ops.convert_to_tensor(size, "float32")
    return ops.cast(ops.size(x), "float32")


def _histogram(x, amax=None):
    """The one-hot histogram of `x`'s amax (NaN counted as inf)."""
    if amax is None:
        amax = backend_fp8.amax(x, None)
    if torch_ops.has_bit_ops(amax):
        bin_index = torch_delayed.amax_bin(amax, MANTISSA_ABOVE_1_75)
        return torch_delayed.one_hot(bin_index.reshape(()), HISTOGRAM_BINS)
    return torch_ops.one_hot(ops.reshape(amax_bin(amax), ()), HISTOGRAM_BINS)


def remove_loss_scale(stats, loss_scale):
    """`stats` with the output gradient's histogram free of a loss scale.

    The output gradient of a scaled loss is `loss_scale` times larger; its
    amax bin `2 * log2(loss_scale)` higher. Its finite bins move down by as
    much (read from the bits of the power-of-two `loss_scale`), clamped at
    both ends of the finite range; the inf/NaN bins and every count stay.

    Args:
        stats: A float32 tensor of shape `(3, STATS_WIDTH)`.
        loss_scale: The float32 scalar power of two the loss was scaled by.

    Returns:
        A float32 tensor of shape `(3, STATS_WIDTH)`.
    """
    bits = ops.view(ops.cast(ops.reshape(loss_scale, ()), "float32"), "int32")
    shift = (ops.right_shift(bits, 23) - 127) * 2
    target = ops.clip(
        ops.arange(FINITE_BINS, dtype="int32") - shift,
        constant(0, "int32"),
        constant(FINITE_BINS - 1, "int32"),
    )
    row = stats[2]
    histogram = torch_ops.segment_sum(row[:FINITE_BINS], target, FINITE_BINS)
    row = ops.concatenate([histogram, row[FINITE_BINS:]])
    return ops.concatenate([stats[:2], ops.expand_dims(row, 0)], axis=0)


def loss_scale_free(grads_and_vars, loss_scale, divided):
    """The pairs, each carrier's gradient made free of the loss scale.

    The output gradient's histogram moves back by the loss scale
    (`remove_loss_scale`); counts need no unscaling. Where
    `get_unscaled_gradients` already divided every gradient by the
    (power-of-two) scale, the carriers' too (`divided`), they are
    multiplied back first, exactly. Other pairs are returned as they are.

    Args:
        grads_and_vars: `(gradient, variable)` pairs.
        loss_scale: The float32 scalar power of two the loss was scaled by.
        divided: Whether the gradients were divided by `loss_scale`.

    Returns:
        A list of `(gradient, variable)` pairs.
    """
    if not any(is_carrier(v) for _, v in grads_and_vars):
        return list(grads_and_vars)

    def unscaled(g):
        if divided:
            g = ops.multiply(g, loss_scale)
        return remove_loss_scale(g, loss_scale)

    return [
        (unscaled(g) if g is not None and is_carrier(v) else g, v)
        for g, v in grads_and_vars
    ]


def is_carrier(variable):
    """Whether `variable` is the statistics carrier of an FP8 layer."""
    return bool(getattr(variable, "_keras_mp_fp8_stats", False))


def layer_carrier(layer):
    """The statistics carrier variable of `layer`, or None."""
    own = _keras_internals.own_variables(layer)
    return next((v for v in own if is_carrier(v)), None)


def bin_range(index):
    """`(low, high)`: the amaxes bin `index` holds (host side, floats)."""
    if index >= FINITE_BINS:
        return (float("inf"), float("inf"))
    exponent, above = divmod(int(index), 2)
    if exponent == 0:
        return (0.0, 2.0**-126)
    power = 2.0 ** (exponent - 127)
    return (1.75 * power, 2 * power) if above else (power, 1.75 * power)


def bin_amax(index):
    """An amax inside bin `index` (float32): every amax of a bin has the
    same current-scaling scale."""
    low, high = bin_range(index)
    return np.float32(low if index % 2 == 0 else (low + high) / 2)
