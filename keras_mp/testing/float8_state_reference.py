"""A NumPy + `ml_dtypes` oracle of `state_dtype="float8"`, written apart
from `keras_mp/optimizers/state_formats.py` and `float8_state.py`.

Scales from `np.frexp` (`fp8_reference.scale`), codes from `ml_dtypes`
casts (round to nearest, ties to even) of values that are, for stochastic
rounding, first moved to a neighbouring E4M3 value by `np.floor` of their
position between the two plus uniform noise; the noise from a NumPy
`uint32` copy of the `lowbias32` hash; Adam's step in float32 NumPy.
"""

import ml_dtypes
import numpy as np

from keras_mp.testing import fp8_reference

BLOCK = 128
E4M3 = ml_dtypes.float8_e4m3fn


def random_bits(shape, seed):
    """`keras_mp._random_bits.random_bits`: uint32 arithmetic, as int32."""

    def hash32(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    with np.errstate(over="ignore"):
        seed = np.asarray(seed).astype(np.int64).astype(np.uint32)
        key = hash32(seed[0] * np.uint32(0x9E3779B9) + seed[1])
        index = np.arange(int(np.prod(shape)), dtype=np.uint32)
        return hash32(index + key).reshape(shape).view(np.int32)


def _blocks(x):
    flat = np.asarray(x, np.float32).reshape(-1)
    padded = np.zeros(-(-flat.size // BLOCK) * BLOCK, np.float32)
    padded[: flat.size] = flat
    return padded.reshape(-1, BLOCK)


def quantize(x, seed=None):
    """`(codes, scales)`: uint8 E4M3 codes of `x`'s shape, float32 scales
    per block of 128 of the flattened `x`; stochastically rounded with the
    int32 key pair `seed`, or to nearest."""
    x = np.asarray(x, np.float32)
    blocks = _blocks(x)
    scales = fp8_reference.scale(np.max(np.abs(blocks), axis=1), "e4m3")
    y = blocks / scales[:, None]
    if seed is not None:
        magnitude = np.abs(y)
        # E4M3's spacing at `magnitude`: 2**(floor(log2) - 3), 2**-9 below
        # its smallest normal value.
        _, exponent = np.frexp(magnitude)
        spacing = np.ldexp(np.float32(1), np.maximum(exponent - 1, -6) - 3)
        bits = random_bits(y.shape, seed).view(np.uint32) >> np.uint32(8)
        uniform = bits.astype(np.float32) * np.float32(2.0**-24)
        rounded = np.floor(magnitude / spacing + uniform) * spacing
        y = np.copysign(rounded.astype(np.float32), y)
    y = np.clip(y, -448.0, 448.0).astype(np.float32)
    codes = y.astype(E4M3).view(np.uint8).reshape(-1)[: x.size]
    return codes.reshape(x.shape), scales


def dequantize(codes, scales):
    codes = np.asarray(codes, np.uint8)
    values = _blocks(codes.view(E4M3).astype(np.float32))
    values = (values * np.asarray(scales, np.float32)[:, None]).reshape(-1)
    return values[: codes.size].reshape(codes.shape)


def adam_step(
    weight,
    gradient,
    state,
    iteration,
    learning_rate,
    seeds,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-7,
    amsgrad_seeds=None,
):
    """One step of Adam on float8 state.

    Args:
        weight, gradient: float32 arrays.
        state: `(m_codes, m_scales, v_codes, v_scales)`, `v` stored as the
            codes of its square root; with amsgrad, `v_hat`'s codes and
            scales follow (also of its square root).
        iteration: The optimizer's `iterations` before the step.
        learning_rate: A float.
        seeds: The int32 key pair for `v`'s stochastic rounding, or None.
        amsgrad_seeds: With amsgrad, the key pair for `v_hat`'s, or None.

    Returns:
        `(new_weight, new_state)`.
    """
    f32 = np.float32
    weight = np.asarray(weight, f32)
    gradient = np.asarray(gradient, f32)
    m = dequantize(state[0], state[1])
    root = dequantize(state[2], state[3])
    v = root * root
    step = f32(iteration + 1)
    alpha = (
        f32(learning_rate)
        * np.sqrt(f32(1) - f32(beta_2) ** step)
        / (f32(1) - f32(beta_1) ** step)
    )
    m = m + (gradient - m) * f32(1 - beta_1)
    v = v + (gradient * gradient - v) * f32(1 - beta_2)
    new_state = (*quantize(m), *quantize(np.sqrt(v), seeds))
    if len(state) == 6:
        # amsgrad: v_hat = maximum(v_hat, v), and the update divides by it.
        v_hat_root = dequantize(state[4], state[5])
        v = np.maximum(v_hat_root * v_hat_root, v)
        new_state += quantize(np.sqrt(v), amsgrad_seeds)
    update = (m * alpha) / (np.sqrt(v) + f32(epsilon))
    return weight - update, new_state
