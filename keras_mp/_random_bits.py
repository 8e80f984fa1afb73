"""Counter-based pseudo-random bits in integer `keras.ops`.

The rounding noise of stochastic rounding: `optimizers/state_formats.py`
computes it with these functions and `backend/torch/fused_*.py` (torch's
fused updates) reproduce it bit for bit, so both import it from here. Imports
nothing from keras_mp.
"""

import numpy as np
from keras import ops


def random_bits(shape, seed):
    """32 pseudo-random bits per element (int32), from the int32 key pair
    `seed` and each element's index through the `lowbias32` integer hash (C.
    Wellons): uniform enough for rounding noise, and cheap. int32 products
    wrap on every backend; right shifts are made logical by masking."""
    key = hash32(ops.add(ops.multiply(seed[0], -1640531527), seed[1]))
    size = int(np.prod(shape)) if len(shape) else 1
    index = ops.reshape(ops.arange(size, dtype="int32"), shape)
    return hash32(ops.add(index, key))


def hash32(x):
    """The `lowbias32` integer hash of int32 `x` (wrapping products)."""
    x = ops.bitwise_xor(x, _shift_right(x, 16))
    x = ops.multiply(x, 0x7FEB352D)
    x = ops.bitwise_xor(x, _shift_right(x, 15))
    x = ops.multiply(x, -2073254261)  # 0x846CA68B as an int32
    return ops.bitwise_xor(x, _shift_right(x, 16))


def _shift_right(x, bits):
    """Logical right shift of int32 values."""
    return ops.bitwise_and(ops.right_shift(x, bits), (1 << (32 - bits)) - 1)
