"""`keras.ops` code of the FP8 step in torch's own operations, bit for bit.

On PyTorch each `keras.ops` call of an eager step costs host time (Keras
looks for symbolic tensors among its arguments and converts each one:
tens of microseconds a call, several in every eager FP8 GEMM; a third of
its host time), and some make a tensor from the host or read one on it.
Each function here is the `keras.ops` code it names, or on PyTorch
torch's own operations giving the same bits (tests compare the two ways);
Python numbers stay numbers (no tensor from the host). torch is imported
inside the functions: the module loads on every backend.
"""

import keras

from keras_mp import _keras_internals
from keras_mp.backend.torch import fp8_operands


def amax(x, axis):
    """`keras_mp.backend.fp8.amax` of a torch tensor: the largest `|x|`
    over `axis` (an int, a tuple, or None for every axis), kept as size-1
    dimensions, float32; a NaN counts as inf (made so on the reduced
    result: torch's max propagates NaN)."""
    import torch

    magnitudes = largest_magnitudes(x, axis)
    # One kernel after the reduction where Triton makes the FP8 operands.
    fused = fp8_operands.amaxes(magnitudes)
    if fused is not None:
        return fused
    # A 16-bit `x`'s amax is one of its values: exact in float32.
    result = magnitudes.to(torch.float32)
    return torch.where(torch.isnan(result), float("inf"), result)


def largest_magnitudes(x, axis):
    """The largest `|x|` over `axis` (an int, a tuple, or None for every
    axis) of a torch tensor, kept as size-1 dimensions, in `x`'s dtype,
    NaN where a NaN is among them: `amax` before its float32 cast and its
    NaN made inf (which `torch/fp8_operands.scales` does in its kernel)."""
    import torch

    if axis is None:
        axis = tuple(range(x.ndim))
    if x.device.type == "cpu":
        # The CPU's infinity norm is 20x slower than this (0.67 against
        # 0.034 ms for 2048x128 float32, one thread).
        return torch.amax(torch.abs(x), dim=axis, keepdim=True)
    # The infinity norm is the largest `|x|`, exactly, in one read (where
    # `amax(abs(x))` writes and reads a tensor of `|x|`); NaN propagates.
    # On an H100 `fp8.dot`'s forward and backward went from 0.87x to 1.01x
    # bfloat16's with it (and the other changes between the two runs of
    # `benchmarks/gpu/run.sh`).
    return torch.linalg.vector_norm(x, ord=float("inf"), dim=axis, keepdim=True)


def one_hot(index, depth):
    """`keras.ops.one_hot(index, depth, dtype="float32")` without a host
    sync: PyTorch's `one_hot` reads its indices' range on the host (two
    syncs a call, each a stall of the GPU's queue in an eager step). An
    index outside `[0, depth)` gives zeros, as `one_hot` on JAX and
    TensorFlow."""
    ops = keras.ops
    positions = ops.arange(depth, dtype="int32")
    index = ops.expand_dims(ops.cast(index, "int32"), -1)
    return ops.cast(ops.equal(positions, index), "float32")


def reshape(x, shape):
    """`keras.ops.reshape`; on PyTorch the tensor's own `reshape`
    (`keras.ops` first looks for symbolic tensors among its arguments:
    tens of microseconds of host time a call, several in every eager FP8
    GEMM)."""
    if keras.backend.backend() == "torch":
        return x.reshape(tuple(shape))
    return keras.ops.reshape(x, shape)


def max_over_last_axis(x):
    """`keras.ops.max(x, axis=-1)`; of a torch tensor torch's own `amax`
    (see `reshape`)."""
    if keras.backend.backend() == "torch":
        import torch

        if isinstance(x, torch.Tensor):
            return x.amax(-1)
    return keras.ops.max(x, axis=-1)


def stack(values):
    """`keras.ops.stack` along a new first axis; on PyTorch torch's own
    (see `reshape`)."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.stack(list(values))
    return keras.ops.stack(values)


def cast(x, dtype):
    """`keras.ops.cast`; on PyTorch the tensor's own `to` (see
    `reshape`), nothing where `x` has that dtype already."""
    if keras.backend.backend() != "torch":
        return keras.ops.cast(x, dtype)
    import torch

    target = getattr(torch, keras.backend.standardize_dtype(dtype))
    return x if x.dtype == target else x.to(target)


# Whether `keras_mp._fp8.formats.e4m3_e5m2.scale_from_amax` uses `scale_from_amax`
# below on PyTorch (tests compare the two ways).
BIT_OPS = True


def has_bit_ops(amax):
    """Whether `keras_mp._fp8.formats.e4m3_e5m2.scale_from_amax` of `amax` runs as
    `scale_from_amax` here: a torch tensor on the torch backend, not while
    `torch.compile` traces (the compiled graph is the same either way)."""
    if not BIT_OPS or keras.backend.backend() != "torch":
        return False
    import torch

    return isinstance(amax, torch.Tensor) and not torch.compiler.is_compiling()


def variable_tensor(variable):
    """The torch tensor of the Keras `variable`, where PyTorch's eager
    step may read and write it in place (`has_bit_ops`, not in a
    stateless scope, whose values are not the variable's); else None."""
    if (
        keras.backend.backend() != "torch"
        or _keras_internals.in_stateless_scope()
    ):
        return None
    value = variable.value
    return value if has_bit_ops(value) else None


def scale_from_amax(amax, exponent, carry, low, high):
    """`keras_mp._fp8.formats.e4m3_e5m2.scale_from_amax` in torch operations, bit for
    bit: the power of two whose biased exponent is `amax`'s, less
    `exponent`, plus one where `amax`'s mantissa bits exceed `0x7FFFFF -
    carry`, clipped to `[low, high]`; 1 where `amax` is 0, `amax` where it
    is not finite. `exponent` and `carry` are ints, or int32 tensors (one
    per value of the last axis). Python numbers stay numbers (no tensor
    from the host)."""
    import torch

    if amax.dtype == torch.float32:
        # One kernel where Triton makes the FP8 operands (a dozen
        # operations' launches below).
        fused = fp8_operands.scales(
            amax, exponent, carry, low, high, inverse=False, amax=True
        )
        if fused is not None:
            return fused
    if amax.dtype != torch.float32:
        amax = amax.to(torch.float32)
    # Adding `carry` to the bits carries into the exponent exactly where
    # the mantissa bits exceed `0x7FFFFF - carry` (the bits clipped to
    # inf's first, so that no NaN overflows; a non-finite amax is its own
    # scale below): two ops where a mask, a comparison and a cast took
    # four.
    bits = torch.clamp_max(amax.view(torch.int32), 0x7F800000)
    biased = torch.bitwise_right_shift(bits + carry, 23)
    biased = torch.clamp(biased - exponent, low, high)
    scale = torch.bitwise_left_shift(biased, 23).view(torch.float32)
    scale = torch.where(amax == 0.0, 1.0, scale)
    return torch.where(torch.isfinite(amax), scale, amax)


def segment_sum(data, segment_ids, num_segments):
    """`keras.ops.segment_sum` of 1-D `data` into `num_segments` (a Python
    int) by int32 `segment_ids` in `[0, num_segments)`. On PyTorch an
    `index_add` (Keras's makes a tensor of `data`'s shape from the host at
    each call: on a GPU a copy that waits for the queued kernels)."""
    if keras.backend.backend() != "torch":
        return keras.ops.segment_sum(
            data, segment_ids, num_segments=num_segments
        )
    import torch

    data = keras.ops.convert_to_tensor(data)
    segment_ids = keras.ops.convert_to_tensor(segment_ids)
    sums = torch.zeros(num_segments, dtype=data.dtype, device=data.device)
    return sums.index_add(0, segment_ids.to(torch.int64), data)
