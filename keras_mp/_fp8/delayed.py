"""Delayed scaling: each scale from a history of earlier steps' amaxes.

Transformer Engine's `DelayedScaling`: per layer and tensor (the input, the
kernel, the output gradient) a window of the last `amax_history` amaxes;
each step quantizes with the scale of the window's max (or its most recent
entry), `scale_from_amax(amax, fmt, margin)`, a power of two here (TE's is
`fmax / amax / 2**margin`), and this step's amax joins the window for the
next. The first step has no history: it takes its scales from its own
tensors (current scaling), never 1.0.

How the amaxes reach the history on every backend, inside the step:

- Through the layer's statistics carrier (`stats.py`), of shape
  `CARRIER_SHAPE` here: its gradient holds each tensor's amax as a one-hot
  histogram bin, so the bins present after autodiff sums several calls of
  the layer, after keras_mp's optimizers take the max across replicas and
  after Keras's optimizer takes the max over an accumulation window, are
  those of every call, the highest being the step's amax (the max, never
  the sum). The optimizer assigns the carrier only on a step it applies:
  a skipped step leaves it as it was. `keras_mp.LossScaleOptimizer` makes
  the output gradient's bin free of the loss scale.
- The next forward folds the carrier into the history (`fold`), once:
  the carrier's gradient also marks the parity of the layer's count of
  folds when it was made (`PARITY`), so a carrier a skipped step left
  behind, or one already folded, is told from a fresh one. The history
  holds each bin's `bin_value`, which has the bin's power-of-two scale:
  the scale of every amax the bin holds, exactly (an amax below `2**-126`
  counts as 0).
- A non-finite amax is never written: that tensor's window stays as it
  was (a loss-scale skip would have left the carrier alone anyway).
- The output gradient arrives multiplied by the loss scale. Its scale is
  the history's times that loss scale, which `keras_mp.LossScaleOptimizer`
  writes into the carrier after each step (`LOSS_SCALE`): on JAX the
  backward is traced with the forward, so the layer reads it there, as a
  value of the step.

Imports `keras.ops`, `keras_mp._keras_internals`, `keras_mp.backend` and
its `keras_mp.fp8` siblings.
"""

import collections

from keras import ops

from keras_mp._fp8 import stats as stats_module
from keras_mp._fp8.formats.e4m3_e5m2 import scale_from_amax
from keras_mp._fp8.formats.e4m3_e5m2 import torch_scale_constants
from keras_mp._keras_internals import constant
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.backend.torch import delayed as torch_delayed
from keras_mp.backend.torch import ops as torch_ops

# The carrier of a delayed layer: the statistics columns, two parity
# columns and the loss scale of the next step.
PARITY = stats_module.STATS_WIDTH  # 515 and 516
LOSS_SCALE = PARITY + 2  # 517
CARRIER_WIDTH = LOSS_SCALE + 1
CARRIER_SHAPE = (len(stats_module.TENSORS), CARRIER_WIDTH)

Scaling = collections.namedtuple(
    "Scaling", "scales first parity loss_scale gradient_scale", defaults=(None,)
)
Scaling.__doc__ = """What one call of a delayed layer quantizes with.

`scales`: float32 `(3,)`, the delayed scales of the input, the kernel and
the (loss-scale-free) output gradient; `first`: a bool scalar, true while
the layer has no history (every scale is then current); `parity`: the
float32 `(2,)` one-hot the carrier's gradient carries (`PARITY`);
`loss_scale`: the float32 scalar the output gradient arrives multiplied by;
`gradient_scale`: None, or (PyTorch's fused fold) the float32 `(1,)`
output gradient's delayed scale times `loss_scale`, made with the others.
"""


def bin_value(index):
    """The float32 amax that stands for histogram bin `index` (int32): a
    value with the bin's float32 exponent and its `above 1.75` bit, so
    `scale_from_amax` gives it the scale of every amax in the bin, for
    every format and margin (each threshold is `1.75 * 2**k`)."""
    exponent = ops.right_shift(index, 1)
    above = ops.bitwise_and(index, constant(1, "int32"))
    bits = ops.left_shift(exponent, 23) + above * 0x700000  # 1.875
    value = ops.view(ops.cast(bits, "int32"), "float32")
    return ops.where(exponent == 0, ops.zeros_like(value), value)


def carrier_amax_bins(carrier):
    """The highest bin present in each row of `carrier`, or -1 (int32)."""
    bins = carrier[:, : stats_module.HISTOGRAM_BINS]
    index = ops.arange(stats_module.HISTOGRAM_BINS, dtype="int32")
    present = ops.where(
        bins > 0, ops.expand_dims(index, 0), constant(-1, "int32")
    )
    return ops.max(present, axis=1)


def fold(history, folds, carrier):
    """The history with a fresh carrier's amaxes joined, and the new count.

    Args:
        history: float32 `(3, H)`, newest amax first.
        folds: int32 scalar, the carriers folded so far.
        carrier: float32 `CARRIER_SHAPE`, the layer's carrier (read).

    Returns:
        `(history, folds)`: unchanged unless the carrier is fresh (made
        while `folds` carriers had been folded); then each row whose amax
        is finite is shifted by one and starts with it, and `folds` is one
        more.
    """
    if torch_ops.has_bit_ops(history):
        return _torch_fold(history, folds, carrier)[:2]
    parity = ops.mod(folds, constant(2, "int32"))
    marks = carrier[0, PARITY : PARITY + 2]
    fresh = ops.take(marks, parity) > 0
    top = carrier_amax_bins(carrier)
    finite = ops.logical_and(top >= 0, top < stats_module.FINITE_BINS)
    amax = bin_value(ops.maximum(top, constant(0, "int32")))
    shifted = ops.concatenate(
        [ops.expand_dims(amax, 1), history[:, :-1]], axis=1
    )
    write = ops.expand_dims(ops.logical_and(fresh, finite), 1)
    history = ops.where(write, shifted, history)
    return history, folds + ops.cast(fresh, "int32")


# The carrier's columns PyTorch's fold reads: the parity marks, the loss
# scale, the histogram's bins and its finite ones.
_FOLD_COLUMNS = (
    PARITY,
    LOSS_SCALE,
    stats_module.HISTOGRAM_BINS,
    stats_module.FINITE_BINS,
)


def _torch_fold(history, folds, carrier):
    """`torch_delayed.fold_and_scaling` with the carrier's constants."""
    return torch_delayed.fold_and_scaling(
        history, folds, carrier, *_FOLD_COLUMNS
    )


def history_scales(history, recipe):
    """The delayed scales of the three tensors from `history` (3, H)."""
    if recipe.amax_algo == "max":
        amax = torch_ops.max_over_last_axis(history)
    else:
        amax = history[:, 0]
    formats = (recipe.forward_format,) * 2 + (recipe.backward_format,)
    return scale_from_amax(amax, formats, recipe.margin)


def carrier_loss_scale(carrier):
    """The loss scale `keras_mp.LossScaleOptimizer` wrote into the carrier
    for this step, 1 where none did."""
    value = carrier[0, LOSS_SCALE]
    return ops.where(value > 0, value, ops.ones_like(value))


def scaling(history, folds, carrier, recipe):
    """The `Scaling` of a call, from the (folded) state and the carrier."""
    if torch_ops.has_bit_ops(history):
        parity = torch_delayed.parity(folds)
        loss_scale = torch_delayed.carrier_loss_scale(carrier, LOSS_SCALE)
    else:
        parity = torch_ops.one_hot(ops.mod(folds, constant(2, "int32")), 2)
        loss_scale = carrier_loss_scale(carrier)
    return Scaling(
        scales=history_scales(history, recipe),
        first=folds == 0,
        parity=parity,
        loss_scale=loss_scale,
    )


def fold_and_scaling(history, folds, carrier, recipe, first=None, state=None):
    """PyTorch's `fold`, then the call's `scaling`, sharing their reads of
    the carrier (`torch_ops.has_bit_ops`): `(history, folds, Scaling,
    written)`. `first`, where the caller knows it (a Python bool), is the
    Scaling's as it is. `state`, where given, is the layer's `(history,
    folds, stored_scales)` tensors, `history` and `folds` being the first
    two: where the fold is one Triton kernel it writes them in place
    (`torch_delayed.fused_fold_and_scaling`), and `written` is True; else
    the caller writes the results."""
    formats = (recipe.forward_format,) * 2 + (recipe.backward_format,)
    fused = torch_delayed.fused_fold_and_scaling(
        history,
        folds,
        carrier,
        _FOLD_COLUMNS,
        [torch_scale_constants(f, recipe.margin) for f in formats],
        recipe.amax_algo == "most_recent",
        state,
    )
    gradient_scale = None
    if fused is not None:
        # One Triton kernel on CUDA: the fold and the history's scales.
        history, folds, scales, parity, loss_scale, gradient_scale = fused
    else:
        history, folds, parity, loss_scale = _torch_fold(
            history, folds, carrier
        )
        scales = history_scales(history, recipe)
    result = Scaling(
        scales=scales,
        first=folds == 0 if first is None else first,
        parity=parity,
        loss_scale=loss_scale,
        gradient_scale=gradient_scale,
    )
    return history, folds, result, fused is not None and state is not None


def pack(scaling):
    """`scaling` as one float32 vector (7,), an input a custom gradient
    can take (JAX's must not close over values of the step)."""
    if torch_ops.has_bit_ops(scaling.scales):
        return torch_delayed.pack(
            scaling.scales, scaling.first, scaling.parity, scaling.loss_scale
        )
    return ops.concatenate(
        [
            scaling.scales,
            ops.reshape(ops.cast(scaling.first, "float32"), (1,)),
            scaling.parity,
            ops.reshape(scaling.loss_scale, (1,)),
        ]
    )


def unpack(packed):
    """The `Scaling` `pack` made `packed` from."""
    return Scaling(
        scales=packed[0:3],
        first=packed[3] > 0,
        parity=packed[4:6],
        loss_scale=packed[6],
    )


def _delayed_scales(scaling, indices):
    """The delayed scales of tensors `indices`, the output gradient's
    times the loss scale, as scalars."""
    delayed = []
    for index in indices:
        scale = scaling.scales[index]
        if index == 2:
            scale = scale * scaling.loss_scale
        delayed.append(scale)
    return delayed


def pick(scaling, indices, currents):
    """The scales of tensors `indices` (0 input, 1 kernel, 2 output
    gradient): the current ones on the first step, the delayed ones after
    (times the loss scale for the output gradient), as scalars. The
    current scales are computed only on the first step: one `ops.cond`
    for all of them, so a later step's scales depend on the stored scales
    alone (a compiled step's; PyTorch's eager step would read the flag on
    the host for the branch, and uses `select`).

    Args:
        scaling: The call's `Scaling`.
        indices: A tuple of 0, 1 or 2.
        currents: Functions giving the current scales (any size-1 shape),
            one per index.

    Returns:
        A tuple of float32 scalars, one per index.
    """
    delayed = _delayed_scales(scaling, indices)
    return tuple(
        ops.cond(
            scaling.first,
            lambda: tuple(ops.reshape(current(), ()) for current in currents),
            lambda: tuple(delayed),
        )
    )


def select(scaling, indices, currents):
    """`pick` without a branch: `currents`, the float32 current scales of
    tensors `indices` in one vector, on the first step, else the delayed
    ones, as one vector (an eager step computes every scale and selects,
    where a branch would read the flag on the host). Where `first` is a
    Python False (the host knows the layer has a history), the delayed
    ones, and `currents` may be None."""
    if torch_ops.has_bit_ops(scaling.scales):
        return torch_delayed.select(
            scaling.first,
            currents,
            scaling.scales,
            scaling.loss_scale,
            tuple(indices),
            scaling.gradient_scale,
        )
    delayed = ops.stack(_delayed_scales(scaling, indices))
    if scaling.first is False:
        return delayed
    return ops.where(scaling.first, currents, delayed)


def carrier_gradient(statistics, scaling):
    """The carrier's gradient: the statistics rows, the parity, and 0 for
    the loss scale (the optimizer writes it)."""
    if torch_ops.has_bit_ops(statistics):
        return torch_delayed.carrier_gradient(statistics, scaling.parity)
    rows = ops.shape(statistics)[0]
    extra = ops.concatenate(
        [scaling.parity, ops.zeros((1,), "float32")], axis=0
    )
    extra = ops.broadcast_to(ops.expand_dims(extra, 0), (rows, 3))
    return ops.concatenate([statistics, extra], axis=1)


def carrier_gradient_of_amaxes(amaxes, sizes, scaling):
    """`carrier_gradient` of statistics rows without counts, made from
    the three tensors' amaxes and sizes at once: PyTorch's (a handful of
    eager ops where each row took a dozen; `keras_mp.fp8.dot` calls it
    where `torch_ops.has_bit_ops`).

    Args:
        amaxes: The float32 amaxes of the input, the kernel and the output
            gradient (any size-1 shapes).
        sizes: Their numbers of values, Python floats.
        scaling: The call's `Scaling`.
    """
    return torch_delayed.carrier_gradient_of_amaxes(
        amaxes,
        tuple(sizes),
        scaling.parity,
        stats_module.HISTOGRAM_BINS,
        stats_module.MANTISSA_ABOVE_1_75,
        CARRIER_WIDTH,
        PARITY,
    )


def is_carrier(variable):
    """Whether `variable` is the carrier of a delayed FP8 layer."""
    return stats_module.is_carrier(variable) and (
        tuple(variable.shape) == CARRIER_SHAPE
    )


def write_loss_scale(carrier, loss_scale):
    """Writes the loss scale of the next step into the carrier variable
    `carrier` (`with_loss_scale`); on PyTorch's eager step in place, the
    one column (Keras's `assign` converts the whole carrier again)."""
    value = torch_ops.variable_tensor(carrier)
    if value is None:
        carrier.assign(with_loss_scale(carrier, loss_scale))
    else:
        torch_delayed.write_loss_scale(value, loss_scale, LOSS_SCALE)


def with_loss_scale(carrier, loss_scale):
    """`carrier` with the loss scale of the next step written in."""
    carrier = backend_fp8.read_tensor(carrier)
    if torch_ops.has_bit_ops(carrier):
        return torch_delayed.with_loss_scale(carrier, loss_scale, LOSS_SCALE)
    column = ops.ones((CARRIER_SHAPE[0], 1), "float32") * ops.cast(
        ops.reshape(loss_scale, ()), "float32"
    )
    return ops.concatenate([carrier[:, :LOSS_SCALE], column], axis=1)
