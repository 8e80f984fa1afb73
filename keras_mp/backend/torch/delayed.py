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
On CUDA, where `fp8_operands.py`'s Triton kernel makes the FP8 operands,
the fold with the history's scales and a call's carrier gradient are one
Triton kernel each (`fused_fold_and_scaling`, `carrier_gradient_of_amaxes`),
bit for bit the same operations. Imports nothing from keras_mp but its
sibling `fp8_operands.py`, and torch and Triton only inside its functions:
the module is imported on every backend, with or without torch installed.
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


def select(first, currents, scales, loss_scale, indices, gradient_scale=None):
    """`keras_mp._fp8.delayed.select`: the float32 current scales
    `currents` of tensors `indices` where `first`, else their delayed
    `scales`, the output gradient's (2) times `loss_scale`; sliced where
    `indices` are a forward's (0, 1) or a backward's (2,); the delayed
    ones alone where `first` is a Python False. `gradient_scale`, where
    given, is that product made already (`fused_fold_and_scaling`)."""
    import torch

    if indices == (0, 1):
        delayed = scales[:2]
    elif indices == (2,):
        if gradient_scale is None:
            gradient_scale = scales[2:] * loss_scale
        delayed = gradient_scale
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

    fused = _fused_carrier_gradient(
        amaxes, sizes, parity, bins, mantissa_above, width, parity_column
    )
    if fused is not None:
        return fused
    stacked = torch.stack(
        [a.reshape(()) if a.numel() == 1 else a.amax() for a in amaxes]
    )
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


_fold_kernel = None
_gradient_kernel = None


def _fused_carrier_gradient(
    amaxes, sizes, parity, bins, mantissa_above, width, parity_column
):
    """`carrier_gradient_of_amaxes` in one Triton kernel (a handful of
    launches in torch's operations), or None where it does not serve
    (`fp8_operands.run_kernel`)."""
    from keras_mp.backend.torch import fp8_operands

    return fp8_operands.run_kernel(
        "triton_carrier_gradient",
        "delayed scaling's statistics",
        parity,
        _triton_carrier_gradient,
        amaxes,
        sizes,
        parity,
        bins,
        mantissa_above,
        width,
        parity_column,
    )


def _triton_carrier_gradient(
    amaxes, sizes, parity, bins, mantissa_above, width, parity_column
):
    import torch
    import triton

    global _gradient_kernel
    if _gradient_kernel is None:
        _gradient_kernel = _make_gradient_kernel()
    gradient = torch.empty(
        (3, width), dtype=torch.float32, device=parity.device
    )
    # The sizes as float32 values, as `_gradient_base`'s tensor holds them.
    s0, s1, s2 = (float(np.float32(size)) for size in sizes)
    a0, a1, a2 = (amax.reshape(-1).contiguous() for amax in amaxes)
    _gradient_kernel[(1,)](
        a0,
        a1,
        a2,
        a0.numel(),
        a1.numel(),
        a2.numel(),
        parity.contiguous(),
        gradient,
        s0,
        s1,
        s2,
        width,
        mantissa_above,
        SIZE_COLUMN=bins,
        PARITY_COLUMN=parity_column,
        WIDTH_BLOCK=triton.next_power_of_2(width),
    )
    return gradient


def _make_gradient_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def carrier_gradient(
        a0_ptr,
        a1_ptr,
        a2_ptr,
        n0,
        n1,
        n2,
        parity_ptr,
        gradient_ptr,
        s0,
        s1,
        s2,
        width,
        mantissa_above,
        SIZE_COLUMN: tl.constexpr,
        PARITY_COLUMN: tl.constexpr,
        WIDTH_BLOCK: tl.constexpr,
    ):
        rows = tl.arange(0, 4)
        columns = tl.arange(0, WIDTH_BLOCK)
        zero = tl.zeros([4], dtype=tl.float32)
        # Each amax, the max of its values (one, or a cast's programs':
        # non-negative, NaN made inf already).
        m0 = tl.zeros([WIDTH_BLOCK], dtype=tl.float32)
        for start in range(0, n0, WIDTH_BLOCK):
            at = start + columns
            m0 = tl.maximum(m0, tl.load(a0_ptr + at, mask=at < n0, other=0.0))
        m1 = tl.zeros([WIDTH_BLOCK], dtype=tl.float32)
        for start in range(0, n1, WIDTH_BLOCK):
            at = start + columns
            m1 = tl.maximum(m1, tl.load(a1_ptr + at, mask=at < n1, other=0.0))
        m2 = tl.zeros([WIDTH_BLOCK], dtype=tl.float32)
        for start in range(0, n2, WIDTH_BLOCK):
            at = start + columns
            m2 = tl.maximum(m2, tl.load(a2_ptr + at, mask=at < n2, other=0.0))
        amax = tl.where(
            rows == 0,
            zero + tl.max(m0, axis=0),
            tl.where(
                rows == 1, zero + tl.max(m1, axis=0), zero + tl.max(m2, axis=0)
            ),
        )
        size = tl.where(
            rows == 0, zero + s0, tl.where(rows == 1, zero + s1, zero + s2)
        )
        # `amax_bin`: twice the biased exponent, plus one where the
        # mantissa bits are above `mantissa_above`.
        bits = amax.to(tl.int32, bitcast=True)
        above = ((bits & 0x7FFFFF) > mantissa_above).to(tl.int32)
        bin = (bits >> 23) * 2 + above
        gradient = tl.where(columns[None, :] == bin[:, None], 1.0, 0.0)
        gradient = tl.where(
            columns[None, :] == SIZE_COLUMN, size[:, None], gradient
        )
        first = tl.load(parity_ptr)
        second = tl.load(parity_ptr + 1)
        gradient = tl.where(columns[None, :] == PARITY_COLUMN, first, gradient)
        gradient = tl.where(
            columns[None, :] == PARITY_COLUMN + 1, second, gradient
        )
        tl.store(
            gradient_ptr + rows[:, None] * width + columns[None, :],
            gradient,
            mask=(rows[:, None] < 3) & (columns[None, :] < width),
        )

    return carrier_gradient


def fused_fold_and_scaling(
    history, folds, carrier, columns, thresholds, newest, state=None
):
    """`fold_and_scaling`, then the history's scales
    (`keras_mp._fp8.delayed.history_scales`), in one Triton kernel where
    the FP8 operands are Triton's (`fp8_operands.implementation_for`):
    `(history, folds, scales, parity, loss_scale, gradient_scale)`, bit
    for bit the eager operations' (about twenty launches a layer and
    step); else None. `gradient_scale` is the output gradient's scale
    times the loss scale, `(1,)`: the one `select` gives a backward.

    `columns` are `fold_and_scaling`'s `(parity_column, loss_scale_column,
    bins, finite_bins)`; `thresholds` the three tensors'
    `torch/ops.scale_from_amax` constants `(exponent, carry, low, high)`,
    Python ints (the input's and the kernel's alike); `newest` whether a
    scale is the newest amax's (else the history's largest). One program
    reads the carrier and the whole history, then writes.

    `state`, where given, is the layer's `(history, folds, stored_scales)`
    variable tensors: the kernel writes the new history and count into the
    first two (`history` and `folds` being them) and the scales into the
    third, 0 while the count is 0 (`fp8_layers/state.py`), in place: three
    copies a layer and step fewer. Their version counters move as a
    `copy_`'s would.
    """
    from keras_mp.backend.torch import fp8_operands

    return fp8_operands.run_kernel(
        "triton_fold",
        "delayed scaling's fold",
        history,
        _triton_fold,
        history,
        folds,
        carrier,
        columns,
        thresholds,
        newest,
        state,
    )


def _triton_fold(history, folds, carrier, columns, thresholds, newest, state):
    import torch
    import triton

    kernel = _triton_fold_kernel()
    carrier = carrier.detach().contiguous()
    rows, length = history.shape
    device = history.device
    if state is None:
        history = history.contiguous()
        new_history = torch.empty_like(history)
        new_folds = torch.empty_like(folds)
        # Written, and never read: the scales as a layer stores them.
        stored = torch.empty(rows, dtype=torch.float32, device=device)
    else:
        new_history, new_folds, stored = state
        if not (
            new_history is history
            and new_folds is folds
            and all(t.is_contiguous() for t in state)
        ):
            raise ValueError(
                "the fold writes the layer's state in place: `history` and "
                "`folds` must be the state's own contiguous tensors"
            )
    # The three scales and the output gradient's times the loss scale.
    scales = torch.empty(rows + 1, dtype=torch.float32, device=device)
    parity = torch.empty(2, dtype=torch.float32, device=device)
    loss_scale = torch.empty((), dtype=torch.float32, device=device)
    parity_column, loss_scale_column, bins, finite_bins = columns
    (e0, c0, low, high), kernel_thresholds, (e2, c2, _, _) = thresholds
    if kernel_thresholds != thresholds[0]:
        raise ValueError("the input's and the kernel's formats differ")
    kernel[(1,)](
        carrier,
        history,
        folds,
        new_history,
        new_folds,
        scales,
        stored,
        parity,
        loss_scale,
        carrier.stride(0),
        length,
        parity_column,
        loss_scale_column,
        e0,
        c0,
        e2,
        c2,
        low,
        high,
        BINS=bins,
        FINITE_BINS=finite_bins,
        BINS_BLOCK=triton.next_power_of_2(bins),
        LENGTH_BLOCK=triton.next_power_of_2(length),
        MOST_RECENT=newest,
    )
    if state is not None:
        for tensor in state:
            torch.autograd.graph.increment_version(tensor)
    return (
        new_history,
        new_folds,
        scales[:rows],
        parity,
        loss_scale,
        scales[rows:],
    )


def _triton_fold_kernel():
    global _fold_kernel
    if _fold_kernel is not None:
        return _fold_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def fold(
        carrier_ptr,
        history_ptr,
        folds_ptr,
        history_out,
        folds_out,
        scales_out,
        stored_out,
        parity_out,
        loss_scale_out,
        carrier_stride,
        length,
        parity_column,
        loss_scale_column,
        e0,
        c0,
        e2,
        c2,
        low,
        high,
        BINS: tl.constexpr,
        FINITE_BINS: tl.constexpr,
        BINS_BLOCK: tl.constexpr,
        LENGTH_BLOCK: tl.constexpr,
        MOST_RECENT: tl.constexpr,
    ):
        # The three tensors' rows (a fourth, masked, pads them to 4).
        rows = tl.arange(0, 4)
        row_mask = rows < 3
        # Each row's highest bin present, plus one (0 where none is).
        b = tl.arange(0, BINS_BLOCK)
        present = tl.load(
            carrier_ptr + rows[:, None] * carrier_stride + b[None, :],
            mask=row_mask[:, None] & (b[None, :] < BINS),
            other=0.0,
        )
        top = tl.max(tl.where(present > 0, b[None, :] + 1, 0), axis=1)
        # `_bin_tables`: the bin's amax from its bits, and whether it is
        # finite (a fold writes it).
        index = top - 1
        clipped = tl.maximum(index, 0)
        exponent = clipped >> 1
        bits = (exponent << 23) + (clipped & 1) * 0x700000
        value = tl.where(exponent == 0, 0.0, bits.to(tl.float32, bitcast=True))
        writable = (index >= 0) & (index < FINITE_BINS)
        # Fresh where the carrier's mark of this parity is set.
        folds = tl.load(folds_ptr)
        before = ((folds % 2) + 2) % 2
        mark = tl.load(carrier_ptr + parity_column + before)
        fresh = (tl.zeros([4], dtype=tl.float32) + mark) > 0
        write = fresh & writable
        # The history shifted by one where a row is written.
        j = tl.arange(0, LENGTH_BLOCK)
        inside = row_mask[:, None] & (j[None, :] < length)
        at = history_ptr + rows[:, None] * length + j[None, :]
        old = tl.load(at, mask=inside, other=0.0)
        previous = tl.load(at - 1, mask=inside & (j[None, :] >= 1), other=0.0)
        loss_scale = tl.load(carrier_ptr + loss_scale_column)
        # Every read before any write: the outputs may be the inputs (the
        # layer's state, written in place), and a program's threads run
        # apart.
        tl.debug_barrier()
        shifted = tl.where(j[None, :] == 0, value[:, None], previous)
        new = tl.where(write[:, None], shifted, old)
        tl.store(
            history_out + rows[:, None] * length + j[None, :], new, mask=inside
        )
        folds = folds + (mark > 0).to(tl.int32)
        tl.store(folds_out, folds)
        p = tl.arange(0, 2)
        tl.store(parity_out + p, (p == ((folds % 2) + 2) % 2).to(tl.float32))
        loss_scale = tl.where(loss_scale > 0, loss_scale, 1.0)
        tl.store(loss_scale_out, loss_scale)
        # `history_scales`: the newest amax, or the largest (NaN where one
        # is, as torch's `amax`).
        if MOST_RECENT:
            amax = tl.sum(tl.where(j[None, :] == 0, new, 0.0), axis=1)
        else:
            amax = tl.max(tl.where(inside, new, float("-inf")), axis=1)
            nan = tl.max(((new != new) & inside).to(tl.int32), axis=1) > 0
            amax = tl.where(nan, float("nan"), amax)
        # `torch/ops.scale_from_amax`, the output gradient's row in its
        # own format.
        e = tl.where(rows == 2, e2, e0)
        c = tl.where(rows == 2, c2, c0)
        amax_bits = tl.minimum(amax.to(tl.int32, bitcast=True), 0x7F800000)
        biased = (amax_bits + c) >> 23
        biased = tl.minimum(tl.maximum(biased - e, low), high)
        scale = (biased << 23).to(tl.float32, bitcast=True)
        scale = tl.where(amax == 0.0, 1.0, scale)
        finite = (amax == amax) & (amax != float("inf"))
        scale = tl.where(finite, scale, amax)
        tl.store(scales_out + rows, scale, mask=row_mask)
        # The output gradient's times the loss scale (`select`'s product).
        tl.store(scales_out + 1 + rows, scale * loss_scale, mask=rows == 2)
        stored = tl.where(folds == 0, 0.0, scale)
        tl.store(stored_out + rows, stored, mask=row_mask)

    _fold_kernel = fold
    return _fold_kernel
