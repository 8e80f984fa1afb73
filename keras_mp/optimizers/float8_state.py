"""Optimizer slots as FP8 E4M3 codes with per-block power-of-two scales.

`state_dtype="float8"`: each moment of Keras's Adam or AdamW is kept as one
byte per element (the E4M3 code, in a `uint8` variable of the slot's own
shape) and one float32 power-of-two scale per block of `BLOCK_SIZE`
consecutive elements of the flattened slot (a `float32` variable of
`ceil(size / BLOCK_SIZE)` elements created right after the codes, named
after them with `_scale`). Each step decodes the moments to float32,
computes Adam's update in float32 as Keras does, and stores the new
moments as codes again: the first moment rounded to nearest, the second
stochastically (by default).

The second moment is stored as its square root (COAT's dynamic range
transform `x -> |x|**k` with a fixed `k = 1/2`): `v` spans the square of
the gradients' range, `sqrt(v)` the same range as the first moment, so in
a block where `m` is representable `sqrt(v)` is too and `m / sqrt(v)`
never meets a `v` flushed to zero. The E4M3 arithmetic is written in
float32 and int32 `keras.ops` (the codes are computed from their values'
bits, never cast natively: TensorFlow cannot bitcast float8;
`keras_mp._fp8.formats.e4m3_e5m2.e4m3_bits` and `e4m3_values`, the codec
of every uint8 E4M3 variable), identical on every backend;
`keras_mp.testing.float8_state_reference` is its NumPy oracle.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_mp._fp8.formats import e4m3_e5m2 as fp8_codes
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.backend.torch import fused_float8_update

# Elements per block scale: COAT's group size. Float32 scales cost 4/128
# of a byte per element (Adam: 2.06 bytes of state per parameter).
BLOCK_SIZE = 128
E4M3_MAX = 448.0

# Slots of `keras.optimizers.Adam`/`AdamW` the codes hold, and whether the
# slot is a second moment: stored as its square root, and stochastically
# rounded (where `stochastic_rounding` is on). Measured on the transformer of
# `guides/precision_and_memory.py` (JAX, 160 steps, eval loss, two seeds,
# float32 Adam 0.5298): square root and stochastic rounding of `v` only,
# +0.0012/+0.0025 nats; `v` itself instead of its root, +0.0030/+0.0040;
# every slot rounded to nearest, +0.0198 (`v` stalls); every slot
# stochastically rounded, -0.037/-0.018 (the noise on `m` changes the run).
ADAM_SLOTS = {"momentum": False, "velocity": True, "velocity_hat": True}


def block_count(size):
    return -(-size // BLOCK_SIZE)


def supports(optimizer):
    """Whether `optimizer` is Keras's Adam or AdamW, with Keras's update."""
    return (
        isinstance(optimizer, keras.optimizers.Adam)
        and type(optimizer).update_step is keras.optimizers.Adam.update_step
    )


def quantize(value, seed=None):
    """E4M3 codes and block scales of float32 `value`.

    Args:
        value: A float32 tensor.
        seed: An int32 key pair for stochastic rounding (each value rounded
            up or down to a neighbouring E4M3 value with probability given
            by its distance, from counter-based bits of its index in the
            flattened value), or None to round to nearest, ties to even.

    Returns:
        `(codes, scales)`: uint8 codes of `value`'s shape and float32
        power-of-two scales, one per block of the flattened value (the last
        block possibly shorter), with `value ~= decoded codes * scale`.
    """
    shape = tuple(value.shape)
    size = math.prod(shape)
    flat = ops.reshape(ops.cast(value, "float32"), (-1,))
    scales = fp8_codes.scale_from_amax(_block_amax(flat, size), "e4m3")
    codes = fp8_codes.e4m3_bits(flat / _per_value(scales, size), seed)
    return ops.reshape(codes, shape), scales


def dequantize(codes, scales):
    """Float32 values of uint8 E4M3 `codes` with their block `scales`."""
    shape = tuple(codes.shape)
    size = math.prod(shape)
    values = fp8_codes.e4m3_values(ops.reshape(codes, (-1,))) * _per_value(
        scales, size
    )
    return ops.reshape(values, shape)


# The flattened value is never padded to whole blocks: on JAX's CPU a
# padded slot (a size not a multiple of 128) took 3.6x as long to decode
# and encode again (8.2 against 2.3 ms for 2.6M values), and an unpadded
# one 1.2x (3.1 against 2.5 ms), the same bits.
def _block_amax(flat, size):
    """The amax of each block of 128 values of `flat` (the last block the
    remainder), float32 `(block_count(size),)`."""
    whole = size // BLOCK_SIZE
    parts = []
    if whole:
        blocks = ops.reshape(flat[: whole * BLOCK_SIZE], (whole, BLOCK_SIZE))
        parts.append(ops.reshape(backend_fp8.amax(blocks, 1), (-1,)))
    if size > whole * BLOCK_SIZE:
        tail = flat[whole * BLOCK_SIZE :]
        parts.append(ops.reshape(backend_fp8.amax(tail, None), (-1,)))
    return parts[0] if len(parts) == 1 else ops.concatenate(parts)


def _per_value(scales, size):
    """Each block's scale repeated for its values, `(size,)`."""
    blocks = ops.shape(scales)[0]
    repeated = ops.broadcast_to(
        ops.expand_dims(scales, 1), (blocks, BLOCK_SIZE)
    )
    return ops.reshape(repeated, (-1,))[:size]


class Float8Slots:
    """The FP8 slots of one optimizer: codes, scales, and Adam's update.

    Args:
        optimizer: The Keras Adam or AdamW whose slots these are.
        seed_generator: A callable returning the wrapper's
            `keras.random.SeedGenerator`, or None to round to nearest.
    """

    def __init__(self, optimizer, seed_generator):
        self._optimizer = optimizer
        self._seed_generator = seed_generator
        # The optimizer's key of the reference variable (on TensorFlow,
        # `update_step` gets the `tf.Variable` inside the Keras one) ->
        # {slot name: (codes, scales)}.
        self._slots = {}
        # id(codes) -> (scales, whether the square root is stored).
        self._scales = {}
        # PyTorch: the same update in place, chunk by chunk (created at the
        # first step).
        self._fused = None

    def add(self, reference_variable, name, codes, scales):
        key = self._optimizer._var_key(reference_variable)
        self._slots.setdefault(key, {})[name] = (
            codes,
            scales,
        )
        self._scales[id(codes)] = (scales, ADAM_SLOTS[name])

    def scales_of(self, codes):
        """`(scales, square_root)` of a codes variable, or None."""
        return self._scales.get(id(codes))

    def holds(self, variable):
        return self._optimizer._var_key(variable) in self._slots

    def _read(self, variable, name):
        codes, scales = self._slots[self._optimizer._var_key(variable)][name]
        value = dequantize(codes.value, scales.value)
        return value * value if ADAM_SLOTS[name] else value

    def _store(self, variable, name, value):
        """Stores float32 `value` in slot `name`; a second moment's
        `value` is already its square root."""
        codes, scales = self._slots[self._optimizer._var_key(variable)][name]
        seed = None
        # Only the second moments are rounded stochastically. Adam moves
        # `v` by `(1 - beta_2) * (g**2 - v)` a step, far below half an
        # E4M3 step (1/16 of the value): rounded to nearest, `v` would
        # stall. The first moment moves by `(1 - beta_1) * (g - m)`, mostly
        # above it, and the noise of stochastic rounding (which an EMA of
        # `beta_1 = 0.9` averages only over a few steps) cost more than
        # rounding to nearest in the measurements (see `ADAM_SLOTS`).
        if self._seed_generator is not None and ADAM_SLOTS[name]:
            seed = ops.cast(self._seed_generator().next(), "int32")
        new_codes, new_scales = quantize(value, seed)
        self._optimizer.assign(codes, new_codes)
        self._optimizer.assign(scales, new_scales)

    def update_step(self, gradient, variable, learning_rate):
        """Keras's Adam `update_step` in float32 on the decoded moments.

        The same operations in the same order as Keras's; the weight's
        update uses the float32 moments computed here (before they are
        stored in 8 bits).
        """
        optimizer = self._optimizer
        dtype = "float32"
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        local_step = ops.cast(optimizer.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(optimizer.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(optimizer.beta_2, dtype), local_step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        # Python numbers made float32 tensors first, so that every backend
        # (and the NumPy oracle) multiplies and adds the same float32 values.
        one_minus_beta_1 = ops.cast(1 - optimizer.beta_1, dtype)
        one_minus_beta_2 = ops.cast(1 - optimizer.beta_2, dtype)
        if self._update_in_place(
            gradient,
            variable,
            (alpha, one_minus_beta_1, one_minus_beta_2),
        ):
            return
        m = self._read(variable, "momentum")
        v = self._read(variable, "velocity")
        m = ops.add(
            m, ops.multiply(ops.subtract(gradient, m), one_minus_beta_1)
        )
        v = ops.add(
            v,
            ops.multiply(
                ops.subtract(ops.square(gradient), v), one_minus_beta_2
            ),
        )
        # sqrt(v), once: stored (as the second moment's codes) and divided by.
        root = ops.sqrt(v)
        self._store(variable, "momentum", m)
        self._store(variable, "velocity", root)
        if optimizer.amsgrad:
            v = ops.maximum(self._read(variable, "velocity_hat"), v)
            root = ops.sqrt(v)
            self._store(variable, "velocity_hat", root)
        update = ops.divide(
            ops.multiply(m, alpha),
            ops.add(root, ops.cast(optimizer.epsilon, dtype)),
        )
        optimizer.assign_sub(variable, ops.cast(update, variable.dtype))

    def _update_in_place(self, gradient, variable, coefficients):
        """PyTorch: the update of `update_step` in place, bit for bit
        (`backend/torch/fused_float8_update.py`); returns whether it ran."""
        optimizer = self._optimizer
        if keras.backend.backend() != "torch" or optimizer.amsgrad:
            return False
        if self._fused is None:
            self._fused = fused_float8_update.FusedFloat8Update(
                fp8_codes.scale_from_amax, fp8_codes.E4M3_VALUES
            )
        names = self._slots[optimizer._var_key(variable)]
        slots = (names["momentum"], names["velocity"])
        if not self._fused.applies(gradient, variable, slots):
            return False
        seed = None
        if self._seed_generator is not None:
            # The draw `_store` makes for the second moment.
            seed = ops.cast(self._seed_generator().next(), "int32")
        epsilon = ops.cast(optimizer.epsilon, "float32")
        self._fused(gradient, variable, slots, (*coefficients, epsilon), seed)
        return True


def quantize_numpy(value):
    """`quantize` of a NumPy array, to nearest: for checkpoints converted
    while they load (which may happen while a TensorFlow step is traced,
    where `keras.ops` would give symbolic tensors)."""
    import ml_dtypes

    value = np.asarray(value, np.float32)
    blocks = _numpy_blocks(value)
    amax = np.max(np.abs(blocks), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        # The power of two at or above amax / 448 (float64 is exact here).
        mantissa, exponent = np.frexp(amax.astype(np.float64) / E4M3_MAX)
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent)
    scales = np.ldexp(1.0, np.clip(exponent, -126, 127)).astype(np.float32)
    scales = np.where(amax == 0, np.float32(1), scales)
    scales = np.where(np.isfinite(amax), scales, amax)
    with np.errstate(invalid="ignore"):
        y = blocks / scales[:, None]
    y = np.where(np.isfinite(y), np.clip(y, -E4M3_MAX, E4M3_MAX), np.nan)
    codes = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(-1)
    return codes[: value.size].reshape(value.shape), scales


def dequantize_numpy(codes, scales):
    """`dequantize` of NumPy arrays."""
    import ml_dtypes

    codes = np.asarray(codes, np.uint8)
    values = _numpy_blocks(codes.view(ml_dtypes.float8_e4m3fn))
    values = values * np.asarray(scales, np.float32)[:, None]
    return values.reshape(-1)[: codes.size].reshape(codes.shape)


def _numpy_blocks(flat):
    flat = np.asarray(flat, np.float32).reshape(-1)
    padded = np.zeros(block_count(flat.size) * BLOCK_SIZE, np.float32)
    padded[: flat.size] = flat
    return padded.reshape(-1, BLOCK_SIZE)


def is_second_moment(path):
    """Whether the slot variable at `path` is Adam's second moment (its
    codes hold the square root), from Keras's slot names."""
    return any(
        path.endswith(f"_{name}") for name, root in ADAM_SLOTS.items() if root
    )
