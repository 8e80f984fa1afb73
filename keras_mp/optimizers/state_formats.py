"""How optimizer state is stored: one `StateFormat` per `state_dtype`.

A format says what a slot of an optimizer is made of and how it turns into
float32 and back:

- `variables(shape)`: the storage of one slot of that shape, as the
  `(suffix, shape, dtype, initializer)` of each variable (the slot itself
  first, named as Keras names it; a float8 slot adds its block scales);
- `read(stored)`: the float32 values of the stored tensors;
- `write(value, seed)`: the tensors to store for a float32 `value`, rounded
  as the format rounds (to nearest, or stochastically with an int32 key
  pair `seed` where `stochastic_rounding` is on);
- float8 alone, `encode_numpy`/`decode_numpy`: the same on NumPy arrays,
  for checkpoints converted while they load (a 16-bit or float32 slot
  loads into another of them by a cast, `checkpointing.py`).

`state_format(state_dtype, stochastic_rounding)` gives the format of a
wrapper's settings. `optimizers/state_slots.py` keeps each slot's stored
variables and runs the update through them; PyTorch's fused update
(`backend/torch/fused_state_update.py`, float8's codes in
`backend/torch/float8_codes.py`) writes the same formats in place, bit for
bit.
"""

import math

import numpy as np
from keras import ops

from keras_mp import _random_bits
from keras_mp._fp8.formats import e4m3_e5m2
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.backend import optimizer_state


class StateFormat:
    """The storage of optimizer slots in one dtype (see the module).

    Attributes:
        name: The `state_dtype` this format stores ("float32", "bfloat16",
            "float16", "float8").
        dtype: The dtype of a slot's first variable.
        stochastic_rounding: Whether `write` rounds stochastically (it then
            takes a seed).
    """

    name = None
    dtype = None
    stochastic_rounding = False

    def variables(self, shape):
        """The `(suffix, shape, dtype, initializer)` of each variable of a
        slot of `shape`: the slot itself (suffix "", initializer None, the
        optimizer's own) then any companions."""
        return [("", shape, self.dtype, None)]

    def read(self, stored):
        """The float32 values of a slot's stored tensors (a sequence)."""
        return ops.cast(stored[0], "float32")

    def write(self, value, seed=None):
        """The tensors to store for float32 `value` (a list)."""
        return [ops.cast(value, self.dtype)]

    def __repr__(self):
        rounding = ", stochastic" if self.stochastic_rounding else ""
        return f"<StateFormat {self.name}{rounding}>"


class Float32State(StateFormat):
    """Slots in float32, stored as computed."""

    name = dtype = "float32"


class HalfState(StateFormat):
    """Slots in bfloat16 or float16: stored rounded to nearest, or (bfloat16)
    stochastically (`stochastic_round_to_bfloat16`)."""

    def __init__(self, dtype, stochastic_rounding):
        self.name = self.dtype = dtype
        self.stochastic_rounding = stochastic_rounding

    def write(self, value, seed=None):
        if self.stochastic_rounding:
            round_stochastically = optimizer_state.compiled_elementwise(
                _round_stochastically
            )
            return [round_stochastically(ops.cast(value, "float32"), seed)]
        return [ops.cast(value, self.dtype)]


# Elements per block scale of float8 state: COAT's group size. Float32
# scales cost 4/128 of a byte per element (Adam: 2.06 bytes of state per
# parameter).
BLOCK_SIZE = 128
E4M3_MAX = 448.0


def block_count(size):
    return -(-size // BLOCK_SIZE)


class Float8BlockState(StateFormat):
    """Slots as FP8 E4M3 codes with per-block power-of-two scales.

    One byte per element (the E4M3 code, in a `uint8` variable of the
    slot's own shape) and one float32 power-of-two scale per block of
    `BLOCK_SIZE` consecutive elements of the flattened slot (a `float32`
    variable of `ceil(size / BLOCK_SIZE)` elements, named after the codes
    with `_scale`). The E4M3 arithmetic is written in float32 and int32
    `keras.ops` (codes computed from their values' bits, never cast
    natively: TensorFlow cannot bitcast float8), identical on every
    backend; `keras_mp.testing.float8_state_reference` is its NumPy oracle.
    """

    name = "float8"
    dtype = "uint8"

    def __init__(self, stochastic_rounding):
        self.stochastic_rounding = stochastic_rounding

    def variables(self, shape):
        size = math.prod(shape)
        return [
            ("", shape, "uint8", None),
            ("_scale", (block_count(size),), "float32", "ones"),
        ]

    def read(self, stored):
        return dequantize(stored[0], stored[1])

    def write(self, value, seed=None):
        return list(quantize(value, seed))

    def encode_numpy(self, value):
        """`write` of a NumPy array, to nearest."""
        return list(quantize_numpy(value))

    def decode_numpy(self, stored):
        """`read` of NumPy arrays."""
        return dequantize_numpy(stored[0], stored[1])


def state_format(state_dtype, stochastic_rounding):
    """The `StateFormat` of a wrapper's `state_dtype` (validated by
    `state_precision.check_state_arguments`) and `stochastic_rounding`."""
    if state_dtype == "float8":
        return Float8BlockState(stochastic_rounding)
    if state_dtype in ("bfloat16", "float16"):
        return HalfState(state_dtype, stochastic_rounding)
    return Float32State()


# ---------------------------------------------------------------- bfloat16
def stochastic_round_to_bfloat16(value, seed):
    """`value` rounded to bfloat16 up or down at random, without bias.

    A float32 is rounded up (away from zero) with probability equal to its
    distance from the bfloat16 below, measured in bfloat16 steps: 16 random
    bits are added to the low half of its bit pattern, which is then cut
    off. The expected result is `value` itself, so increments far below one
    bfloat16 step (an EMA's `(1 - beta) * (g - m)`) still move the state on
    average; rounding to nearest drops them every time. NaN stays NaN,
    infinities stay infinite.

    The bits come from a counter-based hash of each element's index and a
    key drawn from `seed`: a few integer operations per element, against
    the many of `keras.random`'s generators (Threefry, Philox), and no host
    round trip on any backend.

    Args:
        value: A float32 tensor.
        seed: A `keras.random.SeedGenerator`.

    Returns:
        A bfloat16 tensor of the same shape.
    """
    key = ops.cast(seed.next(), "int32")
    return HalfState("bfloat16", True).write(value, key)[0]


def _round_stochastically(value, seed):
    """`stochastic_round_to_bfloat16` of a float32 `value` with the int32
    key pair `seed` (a `SeedGenerator`'s draw). About twenty elementwise
    integer operations: one fused loop under XLA, but on TensorFlow without
    XLA (Keras's default there) each would be a pass over the whole slot,
    so `HalfState.write` compiles them as one kernel."""
    bits = ops.view(value, "int32")
    noise = ops.bitwise_and(
        _random_bits.random_bits(ops.shape(value), seed), 0xFFFF
    )
    # -65536 is 0xFFFF0000: the sign, exponent and bfloat16 mantissa bits.
    # A carry out of the low half moves to the next bfloat16 value.
    truncated = ops.view(ops.bitwise_and(bits + noise, -65536), "float32")
    rounded = ops.where(ops.isnan(value), value, truncated)
    return ops.cast(rounded, "bfloat16")


# ------------------------------------------------------------------ float8
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
    scales = e4m3_e5m2.scale_from_amax(_block_amax(flat, size), "e4m3")
    codes = e4m3_e5m2.e4m3_bits(flat / _per_value(scales, size), seed)
    return ops.reshape(codes, shape), scales


def dequantize(codes, scales):
    """Float32 values of uint8 E4M3 `codes` with their block `scales`."""
    shape = tuple(codes.shape)
    size = math.prod(shape)
    values = e4m3_e5m2.e4m3_values(ops.reshape(codes, (-1,))) * _per_value(
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
