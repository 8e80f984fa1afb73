"""Delayed FP8 scaling's bookkeeping in torch's own operations.

On PyTorch each `keras.ops` call of an eager step costs host time (Keras
converts and checks every argument: a `where` 9.6 µs against torch's own
4.4 µs on this CPU), and delayed scaling's history, carrier and
statistics rows are about a hundred such calls a layer and step, on
tensors of a few hundred values. These are the same operations in torch
itself, bit for bit those of `keras_mp/_fp8/delayed.py` and
`keras_mp/_fp8/stats.py`, which call them where `torch/ops.py`'s
`has_bit_ops` says so (tests compare the two ways). Python numbers
stay numbers (a scalar argument of a kernel, no tensor from the host).
Imports nothing from keras_mp, and torch only inside its functions: the
module is imported on every backend, with or without torch installed.
"""

import functools

import numpy as np


@functools.cache
def _positions(depth, device):
    """`arange(depth)` as int32 on `device`, made once."""
    import torch

    return torch.arange(depth, dtype=torch.int32, device=device)


def one_hot(index, depth):
    """float32 one-hot rows of int32 `index` over `depth` positions
    (zeros for an index outside them), as `torch/ops.py`'s `one_hot`."""
    import torch

    return (_positions(depth, index.device) == index.unsqueeze(-1)).to(
        torch.float32
    )


def amax_bin(amax, mantissa_above):
    """`keras_mp._fp8.stats.amax_bin`: twice the biased exponent of the
    non-negative float32 `amax` (keras_mp's amaxes are float32), plus one
    where its mantissa bits exceed `mantissa_above` (int32)."""
    import torch

    bits = amax.view(torch.int32)
    above = torch.bitwise_and(bits, 0x7FFFFF) > mantissa_above
    return torch.bitwise_right_shift(bits, 23) * 2 + above


@functools.cache
def _bin_tables(bins, finite_bins, device):
    """`(values, writable)`, each indexed by a bin plus one (0 standing
    for no bin, -1): the float32 amax `keras_mp._fp8.delayed.bin_value`
    gives a bin (0 for no bin), and whether a fold writes it (a finite
    bin). Made once per device, from the same bits."""
    import torch

    index = np.arange(-1, bins, dtype=np.int32)
    exponent = np.maximum(index, 0) >> 1
    bits = (exponent << 23) + (np.maximum(index, 0) & 1) * 0x700000
    values = np.where(exponent == 0, np.float32(0), bits.view(np.float32))
    writable = (index >= 0) & (index < finite_bins)
    return (
        torch.from_numpy(values.astype(np.float32)).to(device),
        torch.from_numpy(writable).to(device),
    )


@functools.cache
def _bin_positions(bins, device):
    """`arange(1, bins + 1)` as int32 on `device`: each bin's position
    plus one (0 standing for none), made once."""
    return _positions(bins + 1, device)[1:]


def fold_and_scaling(
    history, folds, carrier, parity_column, loss_scale_column, bins, finite_bins
):
    """`keras_mp._fp8.delayed.fold`, then `keras_mp._fp8.delayed.scaling`'s
    parity and loss scale, from one read of the carrier: `(history, folds,
    parity, loss_scale)`. The highest bin of each row, plus one (0 where
    none is present), looks up its amax and whether it is finite in
    `_bin_tables`. The carrier is read detached: its gradient is the
    `fp8.dot`'s alone."""
    import torch

    carrier = carrier.detach()
    row = carrier[0]
    before = torch.remainder(folds, 2).reshape(1)
    marks = row[parity_column : parity_column + 2]
    fresh = torch.index_select(marks, 0, before) > 0
    device = carrier.device
    present = carrier[:, :bins] > 0
    top = torch.where(present, _bin_positions(bins, device), 0).amax(1)
    values, writable = _bin_tables(bins, finite_bins, device)
    amax = torch.index_select(values, 0, top)
    shifted = torch.cat([amax.unsqueeze(1), history[:, :-1]], 1)
    write = torch.logical_and(fresh, torch.index_select(writable, 0, top))
    history = torch.where(write.unsqueeze(1), shifted, history)
    # int32 plus bool is int32: the count, one more where fresh.
    folds = folds + fresh.reshape(())
    parity = (_positions(2, device) == torch.remainder(folds, 2)).to(
        torch.float32
    )
    value = row[loss_scale_column]
    return history, folds, parity, torch.where(value > 0, value, 1.0)


def parity(folds):
    """`keras_mp._fp8.delayed.scaling`'s parity: the float32 one-hot of
    `folds % 2`."""
    import torch

    return one_hot(torch.remainder(folds, 2), 2)


def carrier_loss_scale(carrier, column):
    """`keras_mp._fp8.delayed.carrier_loss_scale`, read from the carrier
    detached (see `fold`)."""
    import torch

    value = carrier.detach()[0, column]
    return torch.where(value > 0, value, 1.0)


def pack(scales, first, parity, loss_scale):
    """`keras_mp._fp8.delayed.pack` of a `Scaling`'s fields."""
    import torch

    return torch.cat(
        [
            scales,
            first.to(torch.float32).reshape(1),
            parity,
            loss_scale.reshape(1),
        ]
    )


def carrier_gradient(statistics, parity):
    """`keras_mp._fp8.delayed.carrier_gradient`."""
    import torch

    zero = torch.zeros(1, dtype=torch.float32, device=parity.device)
    extra = torch.cat([parity, zero]).unsqueeze(0)
    extra = extra.expand(statistics.shape[0], 3)
    return torch.cat([statistics, extra], 1)


def select(first, currents, scales, loss_scale, indices):
    """`keras_mp._fp8.delayed.select`: the float32 current scales
    `currents` of tensors `indices` where `first`, else their delayed
    `scales`, the output gradient's (2) times `loss_scale`; sliced where
    `indices` are a forward's (0, 1) or a backward's (2,); the delayed
    ones alone where `first` is a Python False."""
    import torch

    if indices == (0, 1):
        delayed = scales[:2]
    elif indices == (2,):
        delayed = scales[2:] * loss_scale
    else:
        delayed = torch.stack(
            [scales[i] * loss_scale if i == 2 else scales[i] for i in indices]
        )
    if first is False:
        return delayed
    return torch.where(first, currents, delayed)


@functools.lru_cache(maxsize=256)
def _gradient_base(sizes, width, size_column, device):
    """A float32 `(3, width)` of zeros but for the three tensors' `sizes`
    (Python floats) in `size_column`: what a carrier's gradient holds
    before its bins and parity, made once per shape of call."""
    import torch

    base = torch.zeros((3, width), dtype=torch.float32)
    base[:, size_column] = torch.tensor(sizes, dtype=torch.float32)
    return base.to(device)


def carrier_gradient_of_amaxes(
    amaxes, sizes, parity, bins, mantissa_above, width, parity_column
):
    """`carrier_gradient` of the three statistics rows without counts
    (`keras_mp._fp8.stats.tensor_row(..., counts=False)`: each amax's
    one-hot bin, its tensor's size, two zeros) of `amaxes`, whose sizes
    are the Python floats `sizes`: a copy of a row template
    (`_gradient_base`), each amax's bin set to 1 (every bin is below
    `bins`, the infinities' and NaN's too) and the parity written in."""
    import torch

    stacked = torch.stack([amax.reshape(()) for amax in amaxes])
    index = amax_bin(stacked, mantissa_above).to(torch.int64).unsqueeze(1)
    gradient = _gradient_base(tuple(sizes), width, bins, parity.device)
    gradient = gradient.clone().scatter_(1, index, 1.0)
    gradient[:, parity_column : parity_column + 2] = parity
    return gradient


def with_loss_scale(carrier, loss_scale, column):
    """`keras_mp._fp8.delayed.with_loss_scale`: the carrier's columns
    before `column`, then the float32 `loss_scale` in every row."""
    import torch

    scale = loss_scale.to(torch.float32).reshape(1, 1)
    return torch.cat(
        [carrier[:, :column], scale.expand(carrier.shape[0], 1)], 1
    )


def write_loss_scale(carrier, loss_scale, column):
    """`with_loss_scale` written into the carrier tensor `carrier` (a
    variable's) in place: `loss_scale` in column `column` of every row."""
    import torch

    scale = torch.as_tensor(
        loss_scale, dtype=torch.float32, device=carrier.device
    )
    with torch.no_grad():
        carrier[:, column].copy_(scale.reshape(()))
